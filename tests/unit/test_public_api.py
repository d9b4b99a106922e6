"""The public surface: every exported name resolves; errors derive from builtins."""

from __future__ import annotations

import pytest

import distribute as ds
from distribute import errors


def test_every_name_in_all_resolves() -> None:
    missing = [name for name in ds.__all__ if not hasattr(ds, name)]
    assert missing == []


def test_all_lists_each_name_once() -> None:
    assert len(ds.__all__) == len(set(ds.__all__))


@pytest.mark.parametrize(
    "name, builtin",
    [
        ("InvalidArgumentError", ValueError),
        ("ContextError", RuntimeError),
        ("MixedStrategyError", RuntimeError),
        ("CollectiveTimeoutError", TimeoutError),
        ("CollectiveMismatchError", ValueError),
        ("WorkerError", RuntimeError),
    ],
)
def test_errors_derive_from_distribute_error_and_the_fitting_builtin(
    name: str, builtin: type[Exception]
) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.DistributeError)
    assert issubclass(cls, builtin)


def test_reduce_op_accepts_strings_in_any_case() -> None:
    assert ds.ReduceOp.from_value("sum") is ds.ReduceOp.SUM
    assert ds.ReduceOp.from_value("Mean") is ds.ReduceOp.MEAN
    assert ds.ReduceOp.from_value(ds.ReduceOp.SUM) is ds.ReduceOp.SUM


def test_reduce_op_rejects_unknown_names_with_the_choices() -> None:
    with pytest.raises(ValueError, match="SUM"):
        ds.ReduceOp.from_value("max")


def test_communication_options_validate_their_fields() -> None:
    with pytest.raises(ValueError, match="bytes_per_pack"):
        ds.experimental.CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(ValueError, match="timeout_seconds"):
        ds.experimental.CommunicationOptions(timeout_seconds=0)
    options = ds.experimental.CommunicationOptions(implementation="RING")  # type: ignore[arg-type]
    assert options.implementation is ds.experimental.CommunicationImplementation.RING
