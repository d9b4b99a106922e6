"""The private torch names the library uses live in `distribute/_torch.py` alone, and
every one resolves on the installed torch (NOTE [private torch]): a torch upgrade that
moves one fails here, loudly, instead of turning a feature off."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import distribute as ds
from distribute import _torch

PACKAGE = Path(ds.__file__).parent

#: torch_xla's internals stay with the one module that imports torch_xla (lazily; the
#: XLA lane checks them), and `_torch.py` is where the rest are.
_ALLOWED = {"_torch.py", "collectives/xla.py"}


def _private_torch_references(path: Path) -> list[str]:
    """``torch.x._y``-style names and imports of private torch modules or names."""
    tree = ast.parse(path.read_text(), str(path))
    torch_names = {"torch"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch"):
                    torch_names.add(alias.asname or alias.name.split(".")[0])
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            module = node.module or ""
            for alias in node.names:
                torch_names.add(alias.asname or alias.name)
                private_module = any(part.startswith("_") for part in module.split("."))
                if private_module or alias.name.startswith("_"):
                    found.append(f"{node.lineno}: from {module} import {alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in torch_names:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_but_torch_py_names_a_private_torch_name() -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in _ALLOWED:
            continue
        references = _private_torch_references(path)
        if references:
            found[relative] = references
    assert not found, f"private torch names outside distribute/_torch.py: {found}"


def test_the_check_finds_what_it_looks_for() -> None:
    """The scan above is not vacuous: `_torch.py` itself is full of such names."""
    assert len(_private_torch_references(PACKAGE / "_torch.py")) >= 10


def test_every_private_torch_name_resolves_on_the_installed_torch() -> None:
    assert _torch.missing_names() == [], (
        f"torch {torch.__version__} lacks these names distribute uses "
        f"(checked on {_torch.CHECKED_ON}): {_torch.missing_names()}"
    )


def test_a_missing_name_raises_naming_the_torch_version_and_the_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(torch.distributed.distributed_c10d, "_abort_process_group")
    with pytest.raises(_torch.TorchInternalsError, match=re.escape(torch.__version__)) as caught:
        _torch.abort_process_group(None)
    assert "_abort_process_group" in str(caught.value)
    assert "distribute/_torch.py" in str(caught.value)
    assert isinstance(caught.value, ds.errors.DistributeError)
    assert "torch.distributed.distributed_c10d._abort_process_group" in _torch.missing_names()


def test_fsdp_state_read_from_a_module_without_it_raises_instead_of_watching_nothing() -> None:
    with pytest.raises(_torch.TorchInternalsError, match="_get_fsdp_state"):
        _torch.fsdp_param_groups(torch.nn.Linear(2, 2))


_LIVE_FSDP = """
import json
import torch
import distribute as ds
from distribute import _torch

strategy = ds.experimental.FullyShardedStrategy()  # one worker, a group of one
with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
groups = _torch.fsdp_param_groups(model[0])
seen = {"groups": len(groups), "idle": _torch.fsdp_phase(groups[0])}
phases = []
hook = model[0].register_forward_pre_hook(
    lambda module, args: phases.append(_torch.fsdp_phase(_torch.fsdp_param_groups(module)[0]))
)
strategy.run(lambda: model(torch.ones(2, 4)).sum().backward())
seen["forward"] = phases[0]
strategy.shutdown()
print(json.dumps(seen))
"""


def test_fsdp_internals_resolve_on_a_live_sharded_module() -> None:
    """FSDP's param groups and their phase, read through `_torch.py` from a module the
    strategy sharded (in a new interpreter: it makes a process group of one)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", _LIVE_FSDP],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"groups": 1, "idle": "unshard", "forward": "forward"}, seen


def test_the_optimizer_adding_a_param_group_is_found_from_a_torch_function_mode() -> None:
    """`Optimizer.add_param_group` reads each parameter's ``is_leaf`` with the optimizer
    a few frames up (the sharded scope's optimizer watch relies on it), in its
    constructor and in a later call; outside it, nothing is found."""
    first, second = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    found: list[torch.optim.Optimizer | None] = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if getattr(func, "__self__", None) is _torch.is_leaf_property:
                found.append(_torch.optimizer_adding_param_group())
            return func(*args, **(kwargs or {}))

    with Mode():
        optimizer = torch.optim.SGD([first], lr=0.1)
        optimizer.add_param_group({"params": [second]})
        assert first.is_leaf
    assert found == [optimizer, optimizer, None]


def test_the_torch_grad_scaler_stepping_an_optimizer_is_found_from_its_step_hook() -> None:
    """`torch.amp.GradScaler.step` (its public method) calls ``optimizer.step`` from a
    few frames up, through ``_maybe_opt_step`` for a plain optimizer and directly for
    one that handles the scale itself (``_step_supports_amp_scaling``, a fused Adam's);
    the synchronous handler refuses torch's scaler by it. A plain step finds no scaler,
    also from a user's function named ``step``."""

    class ScalesItself(torch.optim.Optimizer):
        _step_supports_amp_scaling = True

        def __init__(self, params: Any, lr: float) -> None:
            super().__init__(params, {"lr": lr})

        def step(self, closure: Any = None) -> None:  # reads grad_scale/found_inf
            pass

    def step(optimizer: torch.optim.Optimizer) -> None:  # a user's function of that name
        optimizer.step()

    for kind in (torch.optim.SGD, ScalesItself):
        param = torch.nn.Parameter(torch.ones(2))
        optimizer = kind([param], lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        found: list[torch.amp.GradScaler | None] = []
        handle = optimizer.register_step_pre_hook(
            lambda opt, args, kwargs, found=found: found.append(_torch.stepping_grad_scaler())
        )
        try:
            scaler.scale(param.sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.step()
            step(optimizer)
        finally:
            handle.remove()
        assert found == [scaler, None, None], kind
