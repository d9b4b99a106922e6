"""`MirroredStrategy`: synchronous data parallelism over one process's devices."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distribute.collectives.cross_device_ops import CrossDeviceOps
from distribute.strategies._devices import default_devices, device_list
from distribute.strategies._replicated import ReplicatedExtended
from distribute.strategies.base import Strategy

__all__ = ["MirroredStrategy"]


class MirroredStrategy(Strategy):
    """One replica per local device, each running `fn` in its own thread.

    Variables created in scope are `MirroredVariable`s with one copy per device;
    gradients are summed over replicas at each optimizer step, so every copy gets
    the same update.

    Args:
        devices: replica devices (a list, or one device). None: every visible CUDA
            GPU, else one CPU. Logical CPU devices ("cpu:0", "cpu:1", ...) are
            distinct replicas on the one CPU. TensorFlow's spellings ("/gpu:0",
            "/device:CPU:0") are accepted.
        cross_device_ops: the `CrossDeviceOps` used by `extended.reduce_to`.

    Raises:
        InvalidArgumentError: a device that is not a device name or that this
            machine does not have (the message lists the devices it has).

    Example:
        >>> import distribute as ds, torch
        >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> s.num_replicas_in_sync
        2
        >>> s.run(lambda: ds.get_replica_context().replica_id_in_sync_group)
        PerReplica(0, 1)
    """

    def __init__(
        self,
        devices: str | torch.device | Sequence[str | torch.device] | None = None,
        cross_device_ops: CrossDeviceOps | None = None,
    ) -> None:
        self._devices = device_list(devices if devices is not None else default_devices())
        super().__init__(ReplicatedExtended(self, self._devices, cross_device_ops=cross_device_ops))

    def __repr__(self) -> str:
        return f"MirroredStrategy(devices={self._devices})"
