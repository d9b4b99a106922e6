"""Tensor marks are written and read through `distribute/_marks.py` alone (NOTE [tensor
marks]): no other module reads a ``_ds_`` attribute with a default or stamps one by name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import distribute as ds
from distribute import _marks
from distribute.ps._variables import ParameterServerVariable, ShardedVariable

PACKAGE = Path(ds.__file__).parent

#: Modules that still reach a ``_ds_`` attribute by name, and why.
_ALLOWED = {
    "_marks.py": "the marks themselves",
    # A mark on cloudpickle's scan function (not a tensor), which the coordinator wraps
    # once per process; issue 37 removes that process-wide patch.
    "coordinator/_coordinator.py": "cloudpickle's memoized scan",
}


def _by_name_accesses(path: Path) -> list[str]:
    """``getattr``/``setattr``/``hasattr``/``delattr`` calls naming a ``_ds_`` string."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_ds_")
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_but_the_marks_reads_or_writes_a_ds_attribute_by_name() -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative not in _ALLOWED and (accesses := _by_name_accesses(path)):
            found[relative] = accesses
    assert not found, f"use distribute/_marks.py: {found}"


def test_the_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The scan above is not vacuous: it finds each kind of access in a sample."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        'getattr(t, "_ds_x", None)\nsetattr(t, "_ds_x", 1)\nhasattr(t, "_ds_x")\n'
        'delattr(t, "_ds_x")\ngetattr(t, "shape")\n'
    )
    assert [line.split(":")[0] for line in _by_name_accesses(sample)] == ["1", "2", "3", "4"]


def test_no_module_but_the_marks_spells_a_tensor_mark() -> None:
    marks = ("_ds_managed_by", "_ds_sharded_away", "_ds_on_parameter_server")
    marks += ("_ds_published", "_ds_pending")
    found = [
        f"{path.relative_to(PACKAGE).as_posix()}: {mark}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_marks.py"
        for mark in marks
        if mark in path.read_text()
    ]
    assert not found, found


def test_marks_read_back_what_was_written_and_nothing_on_a_plain_tensor() -> None:
    tensor, plain, owner = torch.zeros(2), torch.zeros(2), object()
    _marks.mark_managed(tensor, owner)
    _marks.mark_sharded_away(tensor)
    _marks.mark_published(tensor)
    _marks.set_pending(tensor, torch.ones(2))
    assert _marks.managed_by(tensor) is owner and _marks.managed_by(plain) is None
    assert _marks.is_sharded_away(tensor) and not _marks.is_sharded_away(plain)
    assert _marks.is_published(tensor) and not _marks.is_published(plain)
    pending = _marks.pending(tensor)
    assert pending is not None and pending.tolist() == [1.0, 1.0]
    assert _marks.take_pending(tensor) is pending and _marks.pending(tensor) is None
    with pytest.raises(AttributeError):
        _marks.take_pending(tensor)
    assert _marks.pending(plain) is None


def test_a_parameter_server_class_marks_its_instances_only() -> None:
    @_marks.parameter_server_class
    class OnPs(torch.Tensor):
        pass

    assert _marks.on_parameter_server(torch.zeros(1).as_subclass(OnPs))
    assert not _marks.on_parameter_server(torch.zeros(1))
    assert not _marks.on_parameter_server(torch.nn.Parameter(torch.zeros(1)))
    # The ps variables' classes are marked (the optimizer hooks leave them to the ps).
    assert _marks.on_parameter_server(ParameterServerVariable)
    assert _marks.on_parameter_server(ShardedVariable)
