"""Shape checks shared by every reduction and gather over replicas' values.

Per-replica values that are summed must have one shape: torch would broadcast a
`[1]` against a `[3]` (or fail with its raw in-place error the other way round), a
silently wrong number. Values that are concatenated may differ along the axis only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from distribute.errors import CollectiveMismatchError, InvalidArgumentError

__all__ = ["check_axis", "check_matching_shapes"]


def check_axis(tensor: torch.Tensor, axis: int, what: str) -> None:
    """Raises unless `axis` is a valid dimension of `tensor` (rank >= 1)."""
    if tensor.dim() == 0:
        raise InvalidArgumentError(
            f"{what} along axis {axis} needs tensors of rank >= 1, got a scalar; "
            "reshape it with x.reshape(1) or use reduce with axis=None"
        )
    if not -tensor.dim() <= axis < tensor.dim():
        raise InvalidArgumentError(
            f"{what}: axis {axis} is out of range for a tensor of shape {list(tensor.shape)}"
        )


def check_matching_shapes(
    tensors: Sequence[torch.Tensor],
    axis: int | None,
    what: str,
    replica_id: Callable[[int], int] = int,
) -> None:
    """Raises unless every tensor has the first one's dtype, rank and shape, except
    along `axis` (None: the whole shape must match).

    Args:
        tensors: one value per replica, in local replica order.
        axis: the dimension that may differ (a gather's or a reduction's axis).
        what: the operation, for the message.
        replica_id: the replica id to name for position `i` (global ids under
            several workers).

    Raises:
        CollectiveMismatchError: (a `ValueError`) naming both replicas' shapes.
    """
    first = tensors[0]

    def key(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
        shape = list(t.shape)
        if axis is not None and t.dim() > 0:
            shape[axis % t.dim()] = -1
        return (t.dtype, tuple(shape))

    reference = key(first)
    for i, t in enumerate(tensors[1:], start=1):
        if key(t) == reference:
            continue
        rule = (
            "reduce them with matching shapes (pad or slice a partial batch, or pass "
            "axis= to reduce along the batch dimension first)"
            if axis is None
            else f"shapes may differ only along axis {axis}"
        )
        raise CollectiveMismatchError(
            f"{what}: replica {replica_id(0)} has {first.dtype}{list(first.shape)} but "
            f"replica {replica_id(i)} has {t.dtype}{list(t.shape)}; {rule}"
        )
