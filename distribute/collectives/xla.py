"""The XLA runtime behind `TPUStrategy`: torch_xla imported in this one module, lazily.

Nothing here imports torch_xla at import time: the package works without it, and
`require_torch_xla()` names the missing install when a TPU strategy is built.

# NOTE [XLA steps]
torch_xla records operations lazily and compiles a graph when a step is marked.
A step left unmarked keeps growing (every `run` adds to one ever larger graph, a
new compile each time), so `TPUStrategy.run` marks one step on every device it
used when `fn` returns. `torch_xla.sync()` launches the default device's pending
work only; `mark_step` launches each replica device's own.

# NOTE [host reduction]
On the CPU backend torch_xla's per-device collectives do not work in one process
(`xm.all_reduce` is an identity at world size 1, and aborts under manual
sharding), so replica mode sums gradients on the host: every replica's gradients
come to the CPU in one transfer (`to_host`), are summed there in their dtype, in
replica order, and go back to each device. The sum is exact and the same on every
replica, so the copies stay equal.

Example:
    >>> from distribute.collectives import xla
    >>> xla.available() in (True, False)
    True
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from distribute.errors import InvalidArgumentError

__all__ = [
    "available",
    "compile_count",
    "mark_step",
    "require_torch_xla",
    "runtime_device_count",
    "to_host",
]

_INSTALL = (
    "install torch_xla in its own environment (torch-xla 2.9.0 needs exactly torch 2.9.0): "
    "python3 -m venv .xla-venv && .xla-venv/bin/pip install torch==2.9.0 torch-xla==2.9.0 "
    "-e '.[xla]'; on a machine without TPUs run with PJRT_DEVICE=CPU CPU_NUM_DEVICES=4"
)


def available() -> bool:
    """Whether torch_xla is installed (it is not imported to find out)."""
    return importlib.util.find_spec("torch_xla") is not None


def require_torch_xla() -> ModuleType:
    """Imports torch_xla, or raises an error that says how to install it.

    Raises:
        InvalidArgumentError: torch_xla is not installed.
    """
    if not available():
        raise InvalidArgumentError(
            f"TPUStrategy needs torch_xla, which is not installed: {_INSTALL}"
        )
    import torch_xla

    module: ModuleType = torch_xla
    return module


def runtime() -> Any:
    """`torch_xla.runtime`."""
    require_torch_xla()
    import torch_xla.runtime as xr

    return xr


def spmd() -> Any:
    """`torch_xla.distributed.spmd`."""
    require_torch_xla()
    import torch_xla.distributed.spmd as xs

    return xs


def runtime_device_count() -> int:
    """The XLA devices this process addresses (4 with ``PJRT_DEVICE=CPU
    CPU_NUM_DEVICES=4``), also under SPMD, where torch_xla shows one virtual device.
    Other hosts' devices are not counted: one process drives its own host's."""
    return int(runtime().addressable_runtime_device_count())


def mark_step(devices: Sequence[torch.device]) -> None:
    """Ends the step on each device: compiles (once per graph) and launches its work
    without waiting for it (NOTE [XLA steps])."""
    torch_xla = require_torch_xla()
    for device in devices:
        torch_xla._XLAC._xla_step_marker(str(device), [], wait=False)


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies XLA tensors to the CPU: one transfer per device (in the given order)."""
    torch_xla = require_torch_xla()
    by_device: dict[str, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(str(t.device), []).append(i)
    out: list[torch.Tensor] = list(tensors)
    for indices in by_device.values():
        group = [tensors[i] for i in indices]
        torch_xla._XLAC._xla_sync_multi(group, devices=[], wait=True, sync_xla_data=False)
        for i, host in zip(indices, torch_xla._XLAC._xla_get_cpu_tensors(group)):
            out[i] = host
    return out


def compile_count() -> int:
    """Graphs torch_xla has compiled in this process so far (0 before the first)."""
    require_torch_xla()
    import torch_xla.debug.metrics as met

    value = met.counter_value("UncachedCompile")
    return int(value) if value is not None else 0
