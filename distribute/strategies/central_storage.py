"""`CentralStorageStrategy`: one copy of each variable, compute replicated."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distribute.errors import InvalidArgumentError
from distribute.strategies._devices import device_list, parse_device
from distribute.strategies._replicated import ReplicatedExtended
from distribute.strategies.base import Strategy
from distribute.strategies.mirrored import default_devices

__all__ = ["CentralStorageStrategy"]


class CentralStorageStrategy(Strategy):
    """Variables keep ONE copy on the parameter device; every replica computes with it.

    Each replica accumulates its own gradient; at the optimizer step the gradients
    are summed and the single copy is updated once (by replica 0), so the result is
    the same as single-device training on the global batch.

    Args:
        compute_devices: replica devices (default: every GPU, else one CPU).
        parameter_device: where variables live (default: the CPU).

    Raises:
        InvalidArgumentError: the compute devices are not on the parameter device's
            memory (only shared-memory placement is implemented so far).

    Example:
        >>> import distribute as ds, torch
        >>> s = ds.CentralStorageStrategy(["cpu:0", "cpu:1"])
        >>> with s.scope():
        ...     w = ds.Variable(torch.ones(2))
        >>> w.values[0].data_ptr() == w.values[1].data_ptr()   # one copy
        True
    """

    def __init__(
        self,
        compute_devices: str | torch.device | Sequence[str | torch.device] | None = None,
        parameter_device: str | torch.device | None = None,
    ) -> None:
        devices = device_list(compute_devices if compute_devices is not None else default_devices())
        parameter = parse_device(parameter_device or "cpu")[1]
        placed = {parse_device(d)[1] for d in devices}
        if placed != {parameter}:
            raise InvalidArgumentError(
                f"CentralStorageStrategy: compute devices {devices} are not on parameter device "
                f"{parameter}; only compute devices sharing the parameter device's memory are "
                "supported (e.g. logical CPUs with a CPU parameter device). Use MirroredStrategy "
                "for several GPUs"
            )
        self._compute = devices
        self._parameter_device = parameter
        super().__init__(ReplicatedExtended(self, devices, central_storage=True))

    def __repr__(self) -> str:
        return (
            f"CentralStorageStrategy(compute_devices={self._compute}, "
            f"parameter_device={str(self._parameter_device)!r})"
        )
