"""Reductions in cross-replica context (`CrossReplicaReductions`): `reduce`, `gather`,
`experimental_local_results`, `reduce_to` and the aggregated read of a sync-on-read
variable, over this worker's replicas and then across workers.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from distribute._enums import ReduceOp, VariableAggregation
from distribute.collectives._shapes import check_axis, check_matching_shapes
from distribute.errors import CollectiveMismatchError, InvalidArgumentError
from distribute.strategies._devices import parse_device
from distribute.values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    flatten,
    pack_sequence_as,
    select_replica,
)
from distribute.variables import DistributedVariable

if TYPE_CHECKING:
    from distribute.strategies._replicated import ReplicatedExtended

__all__ = ["CrossReplicaReductions"]


class CrossReplicaReductions:
    """What a `ReplicatedExtended` does with values of every replica, outside `run`.

    Args:
        ext: the strategy's engine (its replicas and workers).
    """

    def __init__(self, ext: ReplicatedExtended) -> None:
        self._ext_ref = weakref.ref(ext)

    @property
    def _ext(self) -> ReplicatedExtended:
        ext = self._ext_ref()
        assert ext is not None
        return ext

    def components(self, leaf: Any) -> list[Any] | None:
        if isinstance(leaf, DistributedValues):
            return list(leaf.values)
        if isinstance(leaf, DistributedVariable):
            return list(leaf.values)
        return None

    def reduce(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        if isinstance(value, (torch.Tensor, DistributedValues)):  # a leaf: no nest walk
            return self.reduce_leaf(op, value, axis)
        return pack_sequence_as(
            value, [self.reduce_leaf(op, leaf, axis) for leaf in flatten(value)]
        )

    def reduce_leaf(self, op: ReduceOp, leaf: Any, axis: int | None) -> Any:
        ext = self._ext
        components = self.components(leaf)
        count_divisor: int
        if components is None:
            if ext._num_workers == 1:
                if op is ReduceOp.MEAN or ext._num_replicas_in_sync() == 1:
                    return leaf if axis is None else self.reduce_leaf(op, PerReplica([leaf]), axis)
                raise InvalidArgumentError(
                    f"reduce(SUM) of a non-distributed value ({type(leaf).__name__}) over "
                    f"{ext._num_replicas_in_sync()} replicas is ambiguous; pass the PerReplica "
                    "that `run` returned, or use MEAN"
                )
            components = [leaf]  # a host value: one per worker, summed across workers (TF)
            count_divisor = ext._num_workers
        else:
            count_divisor = ext._num_replicas_in_sync()
        tensors = [torch.as_tensor(c) for c in components]
        count = None
        if axis is not None:
            for t in tensors:
                check_axis(t, axis, "reduce")
            count = sum(int(t.shape[axis]) for t in tensors)
        self.check_local_shapes(tensors, axis, "reduce")
        if axis is not None:
            tensors = [t.sum(dim=axis) for t in tensors]
        total = _sum_to(tensors, ext._meet_device)
        if ext._cross_worker is not None:
            extra = [torch.tensor(float(count or 0), dtype=torch.float64)]
            reduced = ext._cross_worker.all_reduce([total, *extra], ReduceOp.SUM, name="reduce")
            total = reduced[0]
            count = int(reduced[1].item()) if count is not None else None
        if op is ReduceOp.SUM:
            return total
        divisor = count if count is not None else count_divisor
        if not total.is_floating_point():
            total = total.double()
        return total / divisor if divisor else total * float("nan")

    def check_local_shapes(
        self, tensors: Sequence[torch.Tensor], axis: int | None, what: str
    ) -> None:
        """`check_matching_shapes` over this worker's replicas, made collective.

        A worker whose replicas disagree still meets the other workers, in a
        signature check that cannot match theirs, so every worker raises at once
        (naming these shapes) instead of waiting out the timeout in the collective
        this worker never reaches.
        """
        ext = self._ext
        try:
            check_matching_shapes(tensors, axis, what, ext._global_id)
        except CollectiveMismatchError as exc:
            if ext._cross_worker is not None:
                with contextlib.suppress(CollectiveMismatchError):
                    ext._cross_worker.check_same((what, str(exc)), name=what)
            raise

    def gather(self, value: Any, axis: int) -> Any:
        return pack_sequence_as(value, [self.gather_leaf(leaf, axis) for leaf in flatten(value)])

    def gather_leaf(self, leaf: Any, axis: int) -> torch.Tensor:
        ext = self._ext
        components = self.components(leaf)
        if components is None:
            components = [leaf] * ext._num_local
        tensors = [torch.as_tensor(c) for c in components]
        for t in tensors:
            check_axis(t, axis, "gather")
        axis = axis % tensors[0].dim()
        self.check_local_shapes(tensors, axis, "gather")
        gathered = torch.cat([t.to(ext._meet_device) for t in tensors], dim=axis)
        if ext._cross_worker is not None:
            gathered = ext._cross_worker.all_gather(gathered, axis, name="gather")
        return gathered

    def local_results(self, value: Any) -> tuple[Any, ...]:
        ext = self._ext
        components = self.components(value)
        if components is not None:
            return tuple(components)
        if isinstance(value, (list, tuple, dict)) or _is_dataclass(value):
            return tuple(select_replica(i, value) for i in range(ext._num_local))
        return (value,)

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any) -> Any:
        ext = self._ext
        op = ReduceOp.from_value(reduce_op)
        if ext._cross_device_ops is not None and ext._cross_worker is None:
            return ext._cross_device_ops.reduce(op, value, destinations)
        reduced = self.reduce_leaf(op, value, None)
        return _place(reduced, destinations)

    def read_sync_on_read(self, var: DistributedVariable) -> torch.Tensor:
        ext = self._ext
        components = [var._plain_component(i) for i in range(ext._num_local)]
        aggregation = var._ds_aggregation
        if aggregation is VariableAggregation.NONE:
            raise InvalidArgumentError(
                "a SyncOnReadVariable with NONE aggregation cannot be read in cross-replica "
                "context (its replicas' values have no combined meaning); give it SUM, MEAN "
                "or ONLY_FIRST_REPLICA aggregation, or read it inside `run`"
            )
        if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            first = components[0].clone()
            if ext._cross_worker is not None:
                ext._cross_worker.broadcast([first], 0, name="SyncOnReadVariable read")
            return first
        total = _sum_to(components, ext._meet_device)
        if ext._cross_worker is not None:
            total = ext._cross_worker.all_reduce(
                [total], ReduceOp.SUM, name="SyncOnReadVariable read"
            )[0]
        if aggregation is VariableAggregation.MEAN:
            total = total / ext._num_replicas_in_sync()
        return total


def _is_dataclass(x: Any) -> bool:
    import dataclasses

    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _sum_to(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = tensors[0].detach().to(device, copy=True)
    for t in tensors[1:]:
        total += t.detach().to(device)
    return total


def _place(value: torch.Tensor, destinations: Any) -> Any:
    if destinations is None:
        return value
    if isinstance(destinations, DistributedVariable):
        return Mirrored([value.to(c.device, copy=True) for c in destinations.values])
    if isinstance(destinations, DistributedValues):
        return Mirrored(
            [value.to(torch.as_tensor(c).device, copy=True) for c in destinations.values]
        )
    if isinstance(destinations, torch.Tensor):
        return value.to(destinations.device)
    return value.to(parse_device(destinations)[1])
