"""The replica context's differentiable all-reduce and all-gather, for every engine.

An engine gives its replicas' reduction as a `Reducer` (the in-process replicas of
`ReplicatedExtended`, the batch axis's group of `ModelParallelStrategy`); `AllReduce`
and `AllGather` put it behind one autograd node each, with tf.distribute's gradients:
the gradient of an all-reduce SUM is the all-reduce SUM of the gradient (MEAN: the
mean), and the gradient of an all-gather is this replica's slice of the summed
gradient.

Example::

    outs = AllReduce.apply(reducer, ReduceOp.SUM, "all_reduce", x, y)
    gathered = AllGather.apply(reducer, 0, x)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from distribute._enums import ReduceOp

__all__ = ["AllGather", "AllReduce", "Reducer"]


class Reducer(Protocol):
    """One replica's collectives over the replicas in sync."""

    def all_reduce(
        self, op: ReduceOp, tensors: Sequence[torch.Tensor], name: str
    ) -> Sequence[torch.Tensor]:
        """Every tensor reduced over the replicas."""
        ...

    def all_gather(
        self, tensor: torch.Tensor, axis: int, name: str
    ) -> tuple[torch.Tensor, list[int], int]:
        """The replicas' tensors concatenated along ``axis``, every replica's size
        along it, and this replica's index among them."""
        ...


class AllReduce(torch.autograd.Function):
    """All-reduce whose gradient is the all-reduce of the gradient (SUM: sum; MEAN: mean)."""

    @staticmethod
    def forward(
        ctx: Any, reducer: Reducer, op: ReduceOp, name: str, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.reducer, ctx.op, ctx.name = reducer, op, name
        return tuple(reducer.all_reduce(op, tensors, name))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        out = ctx.reducer.all_reduce(ctx.op, list(grads), f"{ctx.name} (backward)")
        return (None, None, None, *out)


class AllGather(torch.autograd.Function):
    """All-gather whose gradient is this replica's slice of the summed gradient."""

    @staticmethod
    def forward(ctx: Any, reducer: Reducer, axis: int, tensor: torch.Tensor) -> torch.Tensor:
        gathered, sizes, index = reducer.all_gather(tensor.detach(), axis, "all_gather")
        ctx.reducer, ctx.axis, ctx.sizes, ctx.index = reducer, axis, sizes, index
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (summed,) = ctx.reducer.all_reduce(ReduceOp.SUM, [grad], "all_gather (backward)")
        offset = sum(ctx.sizes[: ctx.index])
        return (None, None, summed.narrow(ctx.axis, offset, ctx.sizes[ctx.index]))
