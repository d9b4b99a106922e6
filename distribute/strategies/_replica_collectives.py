"""Collectives among the local replicas inside `run` (`ReplicaCollectives`).

Every replica thread of a `ReplicatedExtended` calls the same collective at the
same point; they meet at the strategy's rendezvous (`ReplicatedExtended.exchange`),
the last to arrive combines the payloads, across workers too, and each replica
takes its share. All-reduce and all-gather are differentiable: the gradient of a SUM
is the SUM of the gradients, an all-gather's is each replica's slice of the summed
gradient (tf.distribute's rules).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from distribute import context
from distribute._enums import ReduceOp
from distribute.collectives._shapes import check_axis, check_matching_shapes
from distribute.collectives.packing import PackedTensors, pack_tensors, sum_packs, unpack_tensors
from distribute.context import ReplicaContext
from distribute.errors import CollectiveMismatchError, InvalidArgumentError
from distribute.strategies._autograd_collectives import AllGather, AllReduce
from distribute.values import flatten, pack_sequence_as, regroup, select_replica

if TYPE_CHECKING:
    from distribute.strategies._replica_host import ReplicaHost

__all__ = ["ReplicaCollectives"]


class ReplicaCollectives:
    """`all_reduce`, `all_gather`, `merge_call` and the writes variables make in replica
    context, for the replicas of one `ReplicatedExtended`.

    Args:
        ext: the strategy's engine (its replicas, rendezvous and workers).
    """

    def __init__(self, ext: ReplicaHost) -> None:
        self._ext_ref = weakref.ref(ext)
        self._topology = ext.topology  # fixed: read without the engine

    @property
    def _ext(self) -> ReplicaHost:
        ext = self._ext_ref()
        assert ext is not None
        return ext

    def all_reduce_tensors(
        self, local: int, op: ReduceOp, tensors: Sequence[torch.Tensor], name: str
    ) -> list[torch.Tensor]:
        """All-reduces `tensors` over every replica; returns replica `local`'s copies.

        Each replica packs its tensors into one buffer per dtype in its own thread
        (the copies of different replicas overlap, outside the GIL); the last
        replica to arrive compares the layouts (a tuple comparison per replica; the
        tensor-by-tensor description only when they differ) and sums the buffers;
        then each replica copies the sums to its device and cuts its copy into
        views, again in its own thread. No Python step is taken per tensor beyond
        reading shapes and dtypes.
        """
        ext = self._ext

        topo = self._topology

        def combine(packs: list[PackedTensors]) -> list[torch.Tensor]:
            for i, pack in enumerate(packs[1:], start=1):
                if not packs[0].same_layout(pack):
                    raise CollectiveMismatchError(
                        f"{name}: replica {topo.global_id(0)} passed {packs[0].describe()} but "
                        f"replica {topo.global_id(i)} passed {pack.describe()}; every replica "
                        "must pass the same structure, shapes and dtypes"
                    )
            totals = sum_packs(packs, topo.meet_device)
            if topo.cross_worker is not None:
                totals = topo.cross_worker.all_reduce(totals, ReduceOp.SUM, name=name)
            if op is ReduceOp.MEAN:
                n = topo.num_replicas_in_sync
                totals = [t / n if t.is_floating_point() else t.double() / n for t in totals]
            return totals  # read by every replica, written by none

        with torch.no_grad():
            packed = pack_tensors(tensors)
        totals: list[torch.Tensor] = ext.exchange(local, f"all_reduce {name}", packed, combine)
        device = self._topology.devices[local]
        own = [t.to(device, copy=True) for t in totals]
        return unpack_tensors(own, packed.shapes, packed.groups)

    def all_reduce(self, replica_ctx: ReplicaContext, op: ReduceOp, value: Any) -> Any:
        if self._topology.num_replicas_in_sync == 1:
            return value
        local = replica_ctx.local_replica_id
        # A tensor, or a plain list or tuple of tensors (the common cases): no nest walk.
        if type(value) is torch.Tensor:
            return self.all_reduce_leaves(local, op, [value])[0]
        if type(value) in (list, tuple) and set(map(type, value)) <= {torch.Tensor}:
            return type(value)(self.all_reduce_leaves(local, op, list(value)))
        leaves = flatten(value)
        outs = self.all_reduce_leaves(local, op, [torch.as_tensor(leaf) for leaf in leaves])
        results = [
            out if isinstance(leaf, torch.Tensor) else out.item() for leaf, out in zip(leaves, outs)
        ]
        return pack_sequence_as(value, results)

    def all_reduce_leaves(
        self, local: int, op: ReduceOp, tensors: list[torch.Tensor]
    ) -> Sequence[torch.Tensor]:
        """`_all_reduce_tensors`, behind an autograd node only if a tensor needs a gradient.

        The node has one input and one output per tensor, which costs more than the
        reduction itself for many small tensors; with no gradient to carry it is
        skipped.
        """
        if torch.is_grad_enabled() and any(map(_requires_grad, tensors)):
            outs: tuple[torch.Tensor, ...] = AllReduce.apply(  # type: ignore[no-untyped-call]  # autograd.Function.apply is untyped
                _LocalReducer(self, local), op, "all_reduce", *tensors
            )
            return outs
        return self.all_reduce_tensors(local, op, tensors, "all_reduce")

    def reduce_assigned(
        self, replica_ctx: ReplicaContext, op: ReduceOp, value: Any
    ) -> torch.Tensor:
        """The all-reduce of an aggregated variable's assigned value, refusing SUM of a
        value that is not per replica.

        As in tf.distribute, a value every local replica passes as the same object (a
        Python number in the step's code, a tensor made outside `run`) is one value,
        not one per replica, and summing it over the replicas would silently count it
        N times: SUM raises (zero excepted, whose sum is unambiguous). Values the
        replicas compute are distinct objects and are summed. With one local replica
        the value is summed across workers, as TF's multi-worker strategy does.
        """
        ext = self._ext
        if op is ReduceOp.SUM and self._topology.num_local > 1:
            local = replica_ctx.local_replica_id

            def combine(values: list[Any]) -> list[bool]:
                same = all(v is values[0] for v in values[1:])
                return [same] * self._topology.num_local

            same: list[bool] = ext.exchange(local, "assign (SUM)", value, combine)
            if same[local] and bool(torch.as_tensor(value).detach().ne(0).any()):
                raise InvalidArgumentError(
                    f"a variable with SUM aggregation was assigned {_short(value)} inside "
                    f"`run`, the same object on all {self._topology.num_local} replicas: a "
                    "non-distributed value cannot be reduced with SUM (it would count "
                    f"{self._topology.num_local} times). Assign a value each replica "
                    "computes, give the variable MEAN or ONLY_FIRST_REPLICA aggregation, or "
                    "assign it in "
                    "cross-replica context"
                )
        result: torch.Tensor = self.all_reduce(replica_ctx, op, torch.as_tensor(value))
        return result

    def all_gather(self, replica_ctx: ReplicaContext, value: Any, axis: int) -> Any:
        leaves = flatten(value)
        local = replica_ctx.local_replica_id
        outs = []
        for leaf in leaves:
            tensor = torch.as_tensor(leaf)
            check_axis(tensor, axis, "all_gather")
            reducer = _LocalReducer(self, local)
            outs.append(AllGather.apply(reducer, axis % tensor.dim(), tensor))  # type: ignore[no-untyped-call]  # autograd.Function.apply is untyped
        return pack_sequence_as(value, outs)

    def all_gather_tensor(
        self, local: int, tensor: torch.Tensor, axis: int, name: str
    ) -> tuple[torch.Tensor, list[int]]:
        ext = self._ext

        def combine(per_replica: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[int]]]:
            check_matching_shapes(per_replica, axis, name, self._topology.global_id)
            gathered = torch.cat([t.to(self._topology.meet_device) for t in per_replica], dim=axis)
            sizes = [int(t.shape[axis]) for t in per_replica]
            if self._topology.cross_worker is not None:
                sizes_t = torch.tensor(sizes, dtype=torch.int64)
                sizes = self._topology.cross_worker.all_gather(
                    sizes_t, 0, name=f"{name} sizes"
                ).tolist()
                gathered = self._topology.cross_worker.all_gather(gathered, axis, name=name)
            return [(gathered.to(d, copy=True), sizes) for d in self._topology.devices]

        results: list[tuple[torch.Tensor, list[int]]] = ext.exchange(
            local, name, tensor.detach(), combine
        )
        return results[local]

    def merge_call(
        self,
        replica_ctx: ReplicaContext,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        ext = self._ext
        strategy = ext.container_strategy

        def run_merge(merge_args: Any, merge_kwargs: Any) -> Any:
            with context._push(strategy, None, in_merge=True):
                return merge_fn(strategy, *merge_args, **merge_kwargs)

        if ext.rendezvous is None:
            return run_merge(args, kwargs)

        def combine(per_replica: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> Any:
            merged_args = regroup([a for a, _ in per_replica])
            merged_kwargs = regroup([k for _, k in per_replica])
            return run_merge(merged_args, merged_kwargs)

        local = replica_ctx.local_replica_id
        result = ext.exchange(local, "merge_call", (args, kwargs), combine)
        return select_replica(local, result)

    def once(self, replica_ctx: ReplicaContext, fn: Callable[[], None]) -> None:
        """Runs replica 0's `fn` once while every local replica waits (shared state)."""
        ext = self._ext

        def combine(per_replica: list[Callable[[], None]]) -> list[None]:
            per_replica[0]()
            return [None] * self._topology.num_local

        ext.exchange(replica_ctx.local_replica_id, "shared variable write", fn, combine)

    def broadcast_first(self, replica_ctx: ReplicaContext, value: torch.Tensor) -> Any:
        ext = self._ext

        def combine(per_replica: list[torch.Tensor]) -> list[torch.Tensor]:
            first = per_replica[0].detach().clone()
            if self._topology.cross_worker is not None:
                self._topology.cross_worker.broadcast([first], 0, name="ONLY_FIRST_REPLICA assign")
            return [first.to(d, copy=True) for d in self._topology.devices]

        local = replica_ctx.local_replica_id
        results: list[torch.Tensor] = ext.exchange(local, "broadcast", value, combine)
        return results[local]


_requires_grad = operator.attrgetter("requires_grad")


def _short(value: Any) -> str:
    """A value for a message: a number as itself, a tensor by its shape and dtype."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)} ({value.dtype})"
    return repr(value)


class _LocalReducer:
    """One local replica's collectives (`_autograd_collectives.Reducer`)."""

    __slots__ = ("_local", "_ops")

    def __init__(self, ops: ReplicaCollectives, local: int) -> None:
        self._ops, self._local = ops, local

    def all_reduce(
        self, op: ReduceOp, tensors: Sequence[torch.Tensor], name: str
    ) -> Sequence[torch.Tensor]:
        return self._ops.all_reduce_tensors(self._local, op, list(tensors), name)

    def all_gather(
        self, tensor: torch.Tensor, axis: int, name: str
    ) -> tuple[torch.Tensor, list[int], int]:
        gathered, sizes = self._ops.all_gather_tensor(self._local, tensor, axis, name)
        return gathered, sizes, self._ops._topology.global_id(self._local)
