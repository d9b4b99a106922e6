"""`CentralStorageStrategy`: one copy of each variable, compute replicated."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from distribute.errors import InvalidArgumentError
from distribute.strategies._devices import default_devices, device_list, parse_device
from distribute.strategies._replicated import ReplicatedExtended
from distribute.strategies.base import Strategy

__all__ = ["CentralStorageStrategy"]

logger = logging.getLogger(__name__)


class CentralStorageStrategy(Strategy):
    """Variables keep ONE copy on the parameter device; every replica computes with it.

    Each replica accumulates its own gradient; at the optimizer step the gradients
    are summed and the single copy is updated once (by replica 0), so the result is
    the same as single-device training on the global batch.

    Args:
        compute_devices: replica devices (default: the first GPU, else one CPU).
        parameter_device: where variables live (default: the compute devices'
            device, e.g. the CPU for logical CPU replicas).

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
        placed = {parse_device(d)[1] for d in devices}
        if compute_devices is None and len(placed) > 1:
            # Several GPUs cannot alias one copy; by default compute on the first.
            logger.warning(
                "CentralStorageStrategy: one shared copy needs the compute devices on one "
                "device, so it computes on %s alone; pass compute_devices to choose",
                devices[0],
            )
            devices = devices[:1]
            placed = {parse_device(devices[0])[1]}
        default_parameter = next(iter(placed)) if len(placed) == 1 else torch.device("cpu")
        parameter = (
            parse_device(parameter_device)[1] if parameter_device is not None else default_parameter
        )
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
