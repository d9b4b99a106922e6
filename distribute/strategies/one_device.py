"""`OneDeviceStrategy`: everything on one device."""

from __future__ import annotations

import torch

from distribute.strategies._devices import parse_device
from distribute.strategies._replicated import ReplicatedExtended
from distribute.strategies.base import Strategy

__all__ = ["OneDeviceStrategy"]


class OneDeviceStrategy(Strategy):
    """Places variables and input on one device; `run` calls `fn` once, inline.

    Args:
        device: the device, e.g. "cpu" or "cuda:0" (TensorFlow's "/gpu:0" too).

    Raises:
        InvalidArgumentError: not a device name, or a device this machine lacks.

    Example:
        >>> import distribute as ds, torch
        >>> s = ds.OneDeviceStrategy("cpu")
        >>> with s.scope():
        ...     model = torch.nn.Linear(3, 1)
        >>> model.weight.device
        device(type='cpu')
    """

    def __init__(self, device: str | torch.device) -> None:
        self._device = parse_device(device)[1]
        super().__init__(ReplicatedExtended(self, [self._device], wrap_single_values=False))

    def __repr__(self) -> str:
        return f"OneDeviceStrategy({str(self._device)!r})"
