"""Reductions in cross-replica context (`CrossReplicaReductions`): `reduce`, `gather`,
`experimental_local_results`, `reduce_to` and the aggregated read of a sync-on-read
variable, over this worker's replicas and then across workers.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from distribute._enums import ReduceOp, VariableAggregation
from distribute.collectives._calls import describe, signature_hash
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
    from distribute.collectives.base import CrossWorker
    from distribute.strategies._replica_host import ReplicaHost

__all__ = ["CrossReplicaReductions"]


class CrossReplicaReductions:
    """What a `ReplicatedExtended` does with values of every replica, outside `run`.

    Args:
        ext: the strategy's engine (its replicas and workers).
    """

    def __init__(self, ext: ReplicaHost) -> None:
        self._ext_ref = weakref.ref(ext)
        self._topology = ext.topology  # fixed: read without the engine
        # Whether a cross-worker reduce was made: the first one's collective is
        # checked against the other workers' call (NOTE [one collective per reduce]).
        self._met = False

    @property
    def _ext(self) -> ReplicaHost:
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
            topology = self._topology
            if (  # `reduce_leaf`'s first case, inlined: a plain tensor, one worker
                type(value) is torch.Tensor
                and axis is None
                and topology.num_workers == 1
                and (op is ReduceOp.MEAN or topology.num_replicas_in_sync == 1)
            ):
                return value
            return self.reduce_leaf(op, value, axis)
        return pack_sequence_as(
            value, [self.reduce_leaf(op, leaf, axis) for leaf in flatten(value)]
        )

    def reduce_leaf(self, op: ReduceOp, leaf: Any, axis: int | None) -> Any:
        components = self.components(leaf)
        count_divisor: int
        if components is None:
            if self._topology.num_workers == 1:
                if op is ReduceOp.MEAN or self._topology.num_replicas_in_sync == 1:
                    return leaf if axis is None else self.reduce_leaf(op, PerReplica([leaf]), axis)
                raise InvalidArgumentError(
                    f"reduce(SUM) of a non-distributed value ({type(leaf).__name__}) over "
                    f"{self._topology.num_replicas_in_sync} replicas is ambiguous; pass the "
                    "PerReplica that `run` returned, or use MEAN"
                )
            components = [leaf]  # a host value: one per worker, summed across workers (TF)
            count_divisor = self._topology.num_workers
        else:
            count_divisor = self._topology.num_replicas_in_sync
        tensors = [torch.as_tensor(c) for c in components]
        count = None
        if axis is not None:
            for t in tensors:
                check_axis(t, axis, "reduce")
            count = sum(int(t.shape[axis]) for t in tensors)
        cross = self._topology.cross_worker
        try:
            check_matching_shapes(tensors, axis, "reduce", self._topology.global_id)
        except CollectiveMismatchError as exc:
            if cross is not None:  # the other workers still meet this one, and raise
                check, self._met = not self._met, True
                _refuse_across_workers(cross, str(exc), check=check)
            raise
        if axis is not None:
            tensors = [t.sum(dim=axis) for t in tensors]
        total = _sum_to(tensors, self._topology.meet_device)
        if cross is not None:
            check, self._met = not self._met, True
            total, count = _sum_across_workers(cross, total, count, check=check)
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
        try:
            check_matching_shapes(tensors, axis, what, self._topology.global_id)
        except CollectiveMismatchError as exc:
            if self._topology.cross_worker is not None:
                with contextlib.suppress(CollectiveMismatchError):
                    self._topology.cross_worker.check_same((what, str(exc)), name=what)
            raise

    def gather(self, value: Any, axis: int) -> Any:
        return pack_sequence_as(value, [self.gather_leaf(leaf, axis) for leaf in flatten(value)])

    def gather_leaf(self, leaf: Any, axis: int) -> torch.Tensor:
        components = self.components(leaf)
        if components is None:
            components = [leaf] * self._topology.num_local
        tensors = [torch.as_tensor(c) for c in components]
        for t in tensors:
            check_axis(t, axis, "gather")
        axis = axis % tensors[0].dim()
        self.check_local_shapes(tensors, axis, "gather")
        gathered = torch.cat([t.to(self._topology.meet_device) for t in tensors], dim=axis)
        if self._topology.cross_worker is not None:
            gathered = self._topology.cross_worker.all_gather(gathered, axis, name="gather")
        return gathered

    def local_results(self, value: Any) -> tuple[Any, ...]:
        components = self.components(value)
        if components is not None:
            return tuple(components)
        if isinstance(value, (list, tuple, dict)) or _is_dataclass(value):
            return tuple(select_replica(i, value) for i in range(self._topology.num_local))
        return (value,)

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any) -> Any:
        ext = self._ext
        op = ReduceOp.from_value(reduce_op)
        if ext.cross_device_ops is not None and self._topology.cross_worker is None:
            return ext.cross_device_ops.reduce(op, value, destinations)
        reduced = self.reduce_leaf(op, value, None)
        return _place(reduced, destinations)

    def read_sync_on_read(self, var: DistributedVariable) -> torch.Tensor:
        components = [var._plain_component(i) for i in range(self._topology.num_local)]
        aggregation = var._ds_aggregation
        if aggregation is VariableAggregation.NONE:
            raise InvalidArgumentError(
                "a SyncOnReadVariable with NONE aggregation cannot be read in cross-replica "
                "context (its replicas' values have no combined meaning); give it SUM, MEAN "
                "or ONLY_FIRST_REPLICA aggregation, or read it inside `run`"
            )
        if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            first = components[0].clone()
            if self._topology.cross_worker is not None:
                self._topology.cross_worker.broadcast([first], 0, name="SyncOnReadVariable read")
            return first
        total = _sum_to(components, self._topology.meet_device)
        if self._topology.cross_worker is not None:
            total = self._topology.cross_worker.all_reduce(
                [total], ReduceOp.SUM, name="SyncOnReadVariable read"
            )[0]
        if aggregation is VariableAggregation.MEAN:
            total = total / self._topology.num_replicas_in_sync
        return total


# NOTE [one collective per reduce]
# A cross-worker `reduce` makes ONE all-reduce of a fixed 16-float64 buffer:
#
#     [a, a*a, b, b*b, count, v0 ... v10]
#
# a and b: two 20-bit hashes of the call's signature (dtype, shape, whether an axis was
# reduced); count: the elements along that axis; v: the worker's sum itself when it is
# a floating tensor of at most 11 elements (a loss), else zeros and the value follows
# in a second, unchecked all-reduce. The buffer's layout never depends on the value,
# so the collective completes whatever the workers passed, and its sums tell whether
# they passed the same: the hashes agree on every worker exactly when sum(a) = W*a and
# sum(a*a) = W*a*a for this worker's a (their variance is 0; every integer stays below
# 2**53, so float64 is exact). Every worker reads the same sums, so all take the same
# branch: on a mismatch every worker makes the checked all-reduce (or, for a worker
# whose own replicas disagree, the `check_same` it pairs with), which raises on every
# worker naming both workers' shapes. This replaced a signature all-gather before every
# reduce's all-reduce(s) (issue 40). The first reduce of a strategy still checks its
# collective against the other workers' (one signature all-gather, identical for any
# reduce): a worker making another collective there (a checkpoint save on one worker
# only) raises at once on every worker; later, such a worker meets a timeout that
# names the collective. Float32 values summed in float64 and rounded once give the
# same bits as a float32 sum for two workers, and a sum at least as close for more.
_HEADER = 5
_SLOTS = 16
_HASH_BITS = 20


@functools.lru_cache(maxsize=256)
def _hashes(dtype: torch.dtype, shape: tuple[int, ...], counted: bool) -> tuple[int, int]:
    """Two 20-bit hashes of a reduce's signature (NOTE [one collective per reduce])."""
    h = signature_hash(("reduce", str(dtype), shape, counted)) & ((1 << 2 * _HASH_BITS) - 1)
    return h >> _HASH_BITS, h & ((1 << _HASH_BITS) - 1)


def _exchange(
    cross: CrossWorker, hashes: tuple[int, int], count: int, values: list[float], check: bool
) -> tuple[bool, list[float]]:
    """The one all-reduce of the header: whether every worker's hashes equal this
    worker's, and the summed buffer."""
    a, b = hashes
    header = [float(a), float(a * a), float(b), float(b * b), float(count), *values]
    header += [0.0] * (_SLOTS - len(header))
    buffer = torch.tensor(header, dtype=torch.float64)
    summed: list[float] = cross.all_reduce([buffer], ReduceOp.SUM, name="reduce", check=check)[
        0
    ].tolist()
    w = cross.world_size
    same = summed[:4] == [w * a, w * a * a, w * b, w * b * b]
    return same, summed


def _sum_across_workers(
    cross: CrossWorker, total: torch.Tensor, count: int | None, *, check: bool
) -> tuple[torch.Tensor, int | None]:
    """``total`` and ``count`` summed over the workers (NOTE [one collective per reduce])."""
    hashes = _hashes(total.dtype, tuple(total.shape), count is not None)
    inline = total.is_floating_point() and total.numel() <= _SLOTS - _HEADER
    values = total.reshape(-1).tolist() if inline else []
    same, summed = _exchange(cross, hashes, count or 0, values, check)
    if not same:
        cross.all_reduce([total], ReduceOp.SUM, name="reduce")  # raises naming both
        raise CollectiveMismatchError(
            f"reduce: the workers passed {describe([total])} but reduced it over different "
            "axes (some passed axis=None); every worker must call reduce with the same axis."
        )
    if count is not None:
        count = int(summed[4])
    if inline:
        n = total.numel()
        piece = torch.tensor(summed[_HEADER : _HEADER + n], dtype=torch.float64)
        return piece.to(total.dtype).reshape(total.shape).to(total.device), count
    return cross.all_reduce([total], ReduceOp.SUM, name="reduce", check=False)[0], count


def _refuse_across_workers(cross: CrossWorker, error: str, *, check: bool) -> None:
    """This worker's replicas disagree: it meets the others' reduce with a signature
    theirs cannot match, then pairs their checked all-reduce with a `check_same` that
    carries its error, so that every worker raises at once."""
    same, _ = _exchange(cross, _hashes(torch.bool, (-1,), False), 0, [], check)
    if not same:
        with contextlib.suppress(CollectiveMismatchError):
            cross.check_same(("reduce", error), name="reduce")


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
