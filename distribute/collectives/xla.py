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

# NOTE [autograd's device queues]
PyTorch's autograd engine starts its device worker threads once per process, at
the first backward (`Engine::start_device_threads`, under a `call_once`): it asks
every registered device type for its `deviceCount()` and makes one ready queue per
index up to the largest. torch_xla's `XLAGuardImpl::deviceCount()` answers 0
while its runtime (the PJRT client) has not started. So when the process's first
backward runs on the CPU before torch_xla's runtime starts (a model trained under
the default strategy first, say), the engine has no queue for any XLA device, and
every later backward on one fails inside autograd (`INTERNAL ASSERT FAILED ...
device_ready_queues_`), for the rest of the process: nothing resets the engine.
The library starts the runtime as early as it is told XLA is wanted
(`ds.tpu.initialize_tpu_system`, `TPUStrategy(...)`), never at import (that would
claim the TPUs of a process that does not use them), and `check_autograd` runs a
backward of a scalar on the highest XLA device a strategy uses (nothing is
compiled or run: XLA records it lazily) to turn the assert into an error that
says what to do.

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

from distribute.errors import InvalidArgumentError, XlaAutogradError

__all__ = [
    "available",
    "check_autograd",
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


def check_autograd(devices: Sequence[torch.device]) -> None:
    """Checks that autograd can run a backward on every one of `devices` (NOTE
    [autograd's device queues]); where it has never run one, this starts its device
    threads with a queue for each XLA device. Call it after the runtime started
    (and, for SPMD, after ``use_spmd``).

    Raises:
        XlaAutogradError: the process's first backward ran before torch_xla's
            runtime started, so autograd has no queue for these devices.
    """
    device = max(devices, key=lambda d: d.index or 0)
    leaf = torch.zeros((), device=device, requires_grad=True)
    try:
        torch.autograd.grad(leaf * 2.0, leaf)
    except RuntimeError as exc:
        if "device_ready_queues_" not in str(exc):
            raise
        raise XlaAutogradError(
            f"autograd cannot run a backward on {device} in this process: its first "
            "backward ran before torch_xla's runtime started, and PyTorch's autograd engine "
            "sized its per-device queues then, once for the whole process, with no XLA "
            "device (a model trained first under the default strategy or on the CPU does "
            "this); create the TPUStrategy, or call ds.tpu.initialize_tpu_system(), before "
            "the first backward of the process (at the top of the script), or train on XLA "
            "in a process of its own"
        ) from None


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
