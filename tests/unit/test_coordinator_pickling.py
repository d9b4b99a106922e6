"""How the coordinator pickles step functions: cloudpickle's submodule scan, memoized."""

from __future__ import annotations

import json.decoder
import sys
import types
from typing import Any

import cloudpickle
from cloudpickle import cloudpickle as impl

from distribute.coordinator._coordinator import (
    _memoize_cloudpickle_submodule_scan,
    _memoized_scan,
)


def _uses_a_submodule() -> Any:
    return json.decoder.JSONDecoder


def _scan() -> Any:
    """cloudpickle's own scan, memoized or not."""
    scan = impl._find_imported_submodules
    return getattr(scan, "__wrapped__", scan)


class _CountingScan:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, code: Any, dependencies: Any) -> list[Any]:
        self.calls += 1
        return list(_scan()(code, dependencies))


def test_the_memoized_scan_finds_what_cloudpickles_scan_finds() -> None:
    code = _uses_a_submodule.__code__
    expected = _scan()(code, [json])
    assert json.decoder in expected  # the submodule the function reaches as json.decoder
    assert _memoized_scan(_scan())(code, [json]) == expected


def test_the_scan_runs_once_per_code_while_no_module_is_loaded() -> None:
    counting = _CountingScan()
    memoized = _memoized_scan(counting)
    for _ in range(3):
        assert json.decoder in memoized(_uses_a_submodule.__code__, [json])
    assert counting.calls == 1
    sys.modules["_ds_test_new_module"] = types.ModuleType("_ds_test_new_module")
    try:
        memoized(_uses_a_submodule.__code__, [json])  # a module more: scanned again
    finally:
        del sys.modules["_ds_test_new_module"]
    assert counting.calls == 2


def test_a_function_pickled_with_the_memoized_scan_still_runs() -> None:
    _memoize_cloudpickle_submodule_scan()
    _memoize_cloudpickle_submodule_scan()  # installed once, not wrapped twice
    scan = impl._find_imported_submodules
    assert getattr(scan, "_ds_memoized", False)
    assert not getattr(scan.__wrapped__, "_ds_memoized", False)

    def step() -> Any:
        return json.decoder.JSONDecoder().decode("[1, 2]")

    blob = cloudpickle.dumps(step)
    assert cloudpickle.dumps(step) == blob  # the same bytes again: the same key
    assert cloudpickle.loads(blob)() == [1, 2]
