"""The parameter-server layers' seams (#37, docs/architecture.md "Parameter servers",
"Declared seams"): the ps runtime and the coordinator reach their strategy through
declared protocols, not its private attributes; nothing patches another library."""

from __future__ import annotations

import ast
from pathlib import Path

import cloudpickle
from cloudpickle import cloudpickle as cloudpickle_impl

import distribute as ds
from distribute.coordinator._coordinator import _Events
from distribute.ps._runtime import TaskHost
from distribute.strategies.parameter_server import ClusterEvents, _Host

PACKAGE = Path(ds.__file__).parent


def _private_attributes_of_strategies(under: Path) -> list[str]:
    """``x._name`` where ``x`` reads as a strategy or its engine (``strategy``,
    ``self._strategy``, ``replica.strategy.extended``)."""
    found = []
    for path in sorted(under.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and ast.unparse(node.value).split(".")[-1].lstrip("_") in ("strategy", "extended")
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_ps_runtime_and_the_coordinator_read_no_private_attribute_of_a_strategy() -> None:
    found = [
        *_private_attributes_of_strategies(PACKAGE / "ps"),
        *_private_attributes_of_strategies(PACKAGE / "coordinator"),
    ]
    assert not found, found


def test_the_parameter_server_fit_writes_no_private_attribute_of_the_model() -> None:
    path = PACKAGE / "training" / "_ps_fit.py"
    written = [
        ast.unparse(target)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Assign, ast.AugAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
        and target.attr.startswith("_")
        and ast.unparse(target.value) == "model"
    ]
    assert not written, written


def test_the_declared_protocols_are_what_the_strategy_and_the_coordinator_implement() -> None:
    for protocol, implementation in ((TaskHost, _Host), (ClusterEvents, _Events)):
        members = [
            name
            for name, value in vars(protocol).items()
            if callable(value) and not name.startswith("_")
        ]
        assert members, protocol
        missing = [name for name in members if not callable(getattr(implementation, name, None))]
        assert not missing, (implementation, missing)


def test_no_module_of_the_library_writes_an_attribute_of_cloudpickle() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and "pickle" in ast.unparse(target.value):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "setattr"
                and node.args
                and "pickle" in ast.unparse(node.args[0])
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found
    # and importing the coordinator left cloudpickle's scan as cloudpickle defines it
    scan = cloudpickle_impl._find_imported_submodules
    assert scan.__module__ == cloudpickle.cloudpickle.__name__
