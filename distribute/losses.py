"""Loss scaling helpers for synchronous training across replicas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from distribute import context
from distribute.errors import ContextError, InvalidArgumentError

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def compute_average_loss(
    per_example_loss: torch.Tensor,
    sample_weight: torch.Tensor | float | None = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """`sum(per_example_loss * sample_weight) / global_batch_size`.

    Summing the replicas' results (what gradient aggregation does) then gives the
    mean over the global batch. The default global batch size is the local batch
    size times `num_replicas_in_sync`, which is wrong for a partial last batch:
    pass it explicitly there. A global batch size of 0 gives 0.

    Raises:
        ContextError: called in cross-replica context without `global_batch_size`.
        InvalidArgumentError: a scalar `per_example_loss` or a negative batch size.

    Example:
        >>> import distribute as ds, torch
        >>> float(ds.compute_average_loss(torch.tensor([1.0, 2.0, 3.0]), global_batch_size=6))
        1.0
    """
    if type(per_example_loss) is not torch.Tensor:
        per_example_loss = torch.as_tensor(per_example_loss)
    if per_example_loss.dim() == 0:
        raise InvalidArgumentError(
            "compute_average_loss expects per-example losses of rank >= 1 (one value per "
            "example), got a scalar; use reduction='none' in the loss function"
        )
    if sample_weight is not None:
        per_example_loss = per_example_loss * sample_weight
    if global_batch_size is None:
        if context.in_cross_replica_context():
            raise ContextError(
                "compute_average_loss was called in cross-replica context without "
                "global_batch_size; call it inside `run`, or pass global_batch_size"
            )
        replicas = _replicas_per_program()
        global_batch_size = int(per_example_loss.shape[0]) * replicas
    if global_batch_size < 0:
        raise InvalidArgumentError(f"global_batch_size must be >= 0, got {global_batch_size}")
    total = per_example_loss.sum()
    if global_batch_size == 0:
        return total * 0.0
    return total / global_batch_size


def scale_regularization_loss(
    regularization_loss: torch.Tensor | Sequence[torch.Tensor] | Any,
) -> torch.Tensor:
    """`sum(regularization_loss) / num_replicas_in_sync`.

    Raises:
        ContextError: called in cross-replica context.

    Example:
        >>> import distribute as ds, torch
        >>> float(ds.scale_regularization_loss([torch.tensor(1.0), torch.tensor(3.0)]))
        4.0
    """
    if context.in_cross_replica_context():
        raise ContextError(
            "scale_regularization_loss may only be called in replica context (inside `run`)"
        )
    if isinstance(regularization_loss, (list, tuple)):
        total = torch.stack([torch.as_tensor(x) for x in regularization_loss]).sum()
    else:
        total = torch.as_tensor(regularization_loss).sum()
    return total / _replicas_per_program()


def _replicas_per_program() -> int:
    """The replicas one call of the step covers: `num_replicas_in_sync`, except under
    SPMD (`TPUStrategy`), where one program runs over the global batch."""
    return context.get_strategy().extended._num_replicas_in_sync()
