"""Gradient aggregation for unmodified `torch.optim` optimizers.

# NOTE [aggregating at the optimizer step]
Gradients are SUMMED over all replicas before any optimizer applies them (losses are
already scaled by the global batch size, `compute_average_loss`). A global optimizer
step pre-hook acts only in a replica context of a strategy, and only for optimizers
holding that strategy's variables, so unrelated optimizers never meet a replica
barrier. In the hook, the local replicas meet once: the last to arrive packs every
replica's gradients into flat buffers (`bytes_per_pack`), sums them, all-reduces
the sums across workers, and each replica copies the result into its own gradients.
Every replica then applies the identical update to its own copy, so the copies stay
bitwise equal. Optimizer state is kept per replica (`PerReplicaState`).
"""

from __future__ import annotations

import collections
import copy
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import (
    Optimizer,
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from distribute import context
from distribute._bucket_reducer import BucketReducer
from distribute._enums import ReduceOp
from distribute.collectives.packing import pack_by_bytes, slot_views
from distribute.variables import DistributedVariable, _local_replica

if TYPE_CHECKING:
    from distribute.strategies._replicated import ReplicatedExtended

__all__ = ["GradientSynchronizer", "PerReplicaState"]

_TensorBase: Any = torch._C.TensorBase


def _get_grad(var: DistributedVariable, local: int) -> torch.Tensor | None:
    if local:
        return var._ds_components[local - 1].grad
    with torch._C.DisableTorchFunctionSubclass():
        grad: torch.Tensor | None = _TensorBase.grad.__get__(var)
    return grad


def _set_grad(var: DistributedVariable, local: int, grad: torch.Tensor) -> None:
    if local:
        var._ds_components[local - 1].grad = grad
        return
    with torch._C.DisableTorchFunctionSubclass():
        _TensorBase.grad.__set__(var, grad)


class PerReplicaState(collections.defaultdict):  # type: ignore[type-arg]
    """An optimizer's `state`, one dict per local replica, chosen by the running replica.

    Cross-replica code (e.g. `optimizer.state_dict()`) sees replica 0's state.
    """

    def __init__(self, existing: dict[Any, Any], ext: ReplicatedExtended) -> None:
        super().__init__(dict)
        self._strategy = ext._container_strategy
        self._replicas: list[collections.defaultdict[Any, Any]] = [
            collections.defaultdict(dict, existing)
        ]
        for device in ext._devices[1:]:
            self._replicas.append(collections.defaultdict(dict, _clone_state(existing, device)))

    def _current(self) -> collections.defaultdict[Any, Any]:
        return self._replicas[_local_replica(self._strategy) or 0]

    def __getitem__(self, key: Any) -> Any:
        return self._current()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._current()[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._current()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._current()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    def __bool__(self) -> bool:
        return bool(self._current())

    def keys(self) -> Any:
        return self._current().keys()

    def values(self) -> Any:
        return self._current().values()

    def items(self) -> Any:
        return self._current().items()

    def get(self, key: Any, default: Any = None) -> Any:
        return self._current().get(key, default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return self._current().setdefault(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        return self._current().pop(key, *default)

    def clear(self) -> None:
        self._current().clear()

    def __repr__(self) -> str:
        return repr(dict(self._current()))


def _clone_state(state: dict[Any, Any], device: torch.device) -> dict[Any, Any]:
    def clone(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to(device, copy=True)
        if isinstance(x, dict):
            return {k: clone(v) for k, v in x.items()}
        return copy.deepcopy(x)

    return {k: clone(v) for k, v in state.items()}


class GradientSynchronizer:
    """Aggregates gradients of one strategy's variables at each optimizer step.

    Args:
        ext: the strategy's extended object.
    """

    def __init__(self, ext: ReplicatedExtended) -> None:
        self._ext_ref = weakref.ref(ext)
        self._plans: weakref.WeakKeyDictionary[
            Optimizer, tuple[tuple[int, ...], list[DistributedVariable]]
        ] = weakref.WeakKeyDictionary()
        self._reducers: weakref.WeakKeyDictionary[
            Optimizer, tuple[tuple[int, ...], BucketReducer]
        ] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    @property
    def _ext(self) -> ReplicatedExtended:
        ext = self._ext_ref()
        assert ext is not None
        return ext

    def variables_of(self, optimizer: Optimizer) -> list[DistributedVariable]:
        """This strategy's variables among `optimizer`'s parameters (cached)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        key = tuple(id(p) for p in params)
        cached = self._plans.get(optimizer)
        if cached is not None and cached[0] == key:
            return cached[1]
        strategy = self._ext._container_strategy
        variables = [
            p for p in params if isinstance(p, DistributedVariable) and p._ds_strategy is strategy
        ]
        self._plans[optimizer] = (key, variables)
        return variables

    def before_step(self, optimizer: Optimizer, local: int) -> None:
        ext = self._ext
        variables = self.variables_of(optimizer)
        if not variables:
            return
        if ext._num_local > 1 and not isinstance(optimizer.state, PerReplicaState):
            with self._lock:
                if not isinstance(optimizer.state, PerReplicaState):
                    optimizer.state = PerReplicaState(optimizer.state, ext)
        if ext.experimental_aggregate_gradients and ext._num_replicas_in_sync() > 1:
            reducer = self._reducers.get(optimizer)
            if reducer is not None and reducer[0] == tuple(id(v) for v in variables):
                reducer[1].finish()
            else:
                self.aggregate(local, variables)
                self._start_overlap(optimizer, variables)
        if ext._central and local != 0:
            ext._skip_grads.value = True

    def _start_overlap(
        self, optimizer: Optimizer, variables: Sequence[DistributedVariable]
    ) -> None:
        """After a first synchronous step, overlaps later steps' all-reduces with backward.

        Only with one local replica per worker (see NOTE [overlapped gradient sync]).
        """
        ext = self._ext
        cross = ext._cross_worker
        if ext._num_local != 1 or ext._central or cross is None:
            return
        old = self._reducers.pop(optimizer, None)
        if old is not None:
            old[1].remove()
        reducer = BucketReducer(
            variables, cross, ext._bytes_per_pack, skip=lambda: ext._no_sync_depth > 0
        )
        reducer.check_layout()
        self._reducers[optimizer] = (tuple(id(v) for v in variables), reducer)

    def remove_reducers(self) -> None:
        """Unregisters every overlapped reducer's hooks (the strategy shuts down)."""
        for _, reducer in list(self._reducers.values()):
            reducer.remove()
        self._reducers.clear()

    def after_step(self, optimizer: Optimizer, local: int) -> None:
        ext = self._ext
        if not ext._central or not self.variables_of(optimizer):
            return
        ext._skip_grads.value = False
        # Replicas wait until replica 0 has updated the one shared copy.
        ext._exchange(local, "optimizer step (central storage)", None, lambda _: None)

    def aggregate(self, local: int, variables: Sequence[DistributedVariable]) -> None:
        """Sums every replica's gradients of `variables` into each replica's gradients."""
        ext = self._ext
        grads = [_get_grad(v, local) for v in variables]
        result = ext._exchange(
            local, "gradient aggregation", grads, lambda g: self._combine(g, variables)
        )
        if result is None:
            return
        device = ext._devices[local]
        for indices, total, unused in result:
            flat = total if total.device == device else total.to(device)
            for j, view in zip(indices, slot_views(flat, [variables[j] for j in indices])):
                var = variables[j]
                grad = _get_grad(var, local)
                if grad is None or grad.shape != var.shape:
                    if j not in unused:
                        _set_grad(var, local, view.clone())
                else:
                    grad.copy_(view)

    def _combine(
        self, per_replica: list[list[torch.Tensor | None]], variables: Sequence[DistributedVariable]
    ) -> list[tuple[list[int], torch.Tensor, set[int]]] | None:
        """Packs and sums the local replicas' gradients, then across workers.

        Returns ``(variable indices, summed flat gradients, indices no replica of
        any worker has a gradient for)`` per pack. Across workers every variable
        is packed (all workers must run the same collectives) and each pack ends
        with one flag per variable, 1 where this worker has a gradient; summed,
        the flags tell which variables nobody used, whose gradients stay None.
        """
        ext = self._ext
        n_vars = len(per_replica[0])
        used = [any(g[j] is not None for g in per_replica) for j in range(n_vars)]
        multi_worker = ext._num_workers > 1
        present = list(range(n_vars)) if multi_worker else [j for j in range(n_vars) if used[j]]
        if not present:
            return None
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j in present:
            sample = next((g[j] for g in per_replica if g[j] is not None), None)
            dtype = sample.dtype if sample is not None else torch.get_default_dtype()
            by_dtype.setdefault(dtype, []).append(j)
        devices = ext._devices
        packs: list[tuple[list[int], torch.Tensor]] = []
        for dtype, indices in by_dtype.items():
            sizes = [variables[j].numel() * dtype.itemsize for j in indices]
            for pack in pack_by_bytes(sizes, ext._bytes_per_pack, reverse=False):
                members = [indices[k] for k in pack]
                parts = [
                    _flat_grad(per_replica[0][j], variables[j], dtype, devices[0]) for j in members
                ]
                if multi_worker:
                    flags = [used[j] for j in members]
                    parts.append(torch.tensor(flags, dtype=dtype, device=devices[0]))
                # Replica 0's gradients in a fresh buffer (torch.cat copies); the other
                # replicas' are added into its slots variable by variable, with no
                # concatenated copy of theirs.
                total = torch.cat(parts)
                slots = slot_views(total, [variables[j] for j in members])
                for r in range(1, len(per_replica)):
                    _add_into(slots, [per_replica[r][j] for j in members])
                packs.append((members, total))
        if not multi_worker:
            return [(m, t, set()) for m, t in packs]
        assert ext._cross_worker is not None
        totals = ext._cross_worker.all_reduce([t for _, t in packs], ReduceOp.SUM, name="gradients")
        result = []
        for (members, _), total in zip(packs, totals):
            numel = total.numel() - len(members)
            unused: set[int] = set()
            if not all(used[j] for j in members):  # only then read the flags (a device sync)
                counts = total[numel:].tolist()
                unused = {j for j, c in zip(members, counts) if c == 0}
            result.append((members, total[:numel], unused))
        return result


def _add_into(slots: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """``slot += grad`` for every gradient present (moved to the slot's device)."""
    pairs = [(s, g) for s, g in zip(slots, grads) if g is not None]
    if not pairs:
        return
    device = slots[0].device
    torch._foreach_add_([s for s, _ in pairs], [g.detach().to(device) for _, g in pairs])


def _flat_grad(
    grad: torch.Tensor | None, var: DistributedVariable, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if grad is not None:
        return grad.detach().reshape(-1)
    return torch.zeros(var.numel(), dtype=dtype, device=device)


def _pre_step_hook(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    top = context._top()
    if top is None or top.replica_context is None:
        return
    sync = getattr(top.strategy.extended, "_grad_sync", None)
    if isinstance(sync, GradientSynchronizer):
        sync.before_step(optimizer, top.replica_context.local_replica_id)


def _post_step_hook(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    top = context._top()
    if top is None or top.replica_context is None:
        return
    sync = getattr(top.strategy.extended, "_grad_sync", None)
    if isinstance(sync, GradientSynchronizer):
        sync.after_step(optimizer, top.replica_context.local_replica_id)


register_optimizer_step_pre_hook(_pre_step_hook)
register_optimizer_step_post_hook(_post_step_hook)
