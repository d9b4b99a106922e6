"""The in-process gradient sum, across workers too: one `GradientSum`.

# NOTE [summing at the optimizer step]
Gradients are SUMMED over all replicas before any optimizer applies them (losses
are already scaled by the global batch size, `compute_average_loss`). At the
step the local replicas meet once: the last to arrive packs every replica's
gradients into flat buffers (`bytes_per_pack`, one per dtype), sums them,
all-reduces the sums across workers, and each replica copies the result into its
own gradients. Every replica then applies the identical update to its own copy,
so the copies stay bitwise equal.

With one worker, where every replica has a gradient for every variable, of its
shape, all of one dtype and device (the usual step on simulated CPU devices),
nothing is packed: the sums are ``foreach_add`` of replica 0's gradients and
replica 1's, then of each further replica's, and each replica copies them in with
one ``foreach_copy_`` (issue 40: the packing's ~30 small ops a step on a small
model). The additions run in the packed sum's order, so the bits are the same.

Used wherever the sum cannot overlap backward: several local replicas (their
threads meet only at the step), central storage, one process. One local replica
per worker of several uses the bucket reducer instead (`_bucket_reducer.py`).

Replicas on distinct GPUs take another route (`_sum_on_gpus`): each replica packs
its own gradients on its own GPU in its own thread (every variable, zeros where
it has none, and one used-flag per variable), and the packs are summed in place
with NCCL across the GPUs (``torch.cuda.nccl``): an all-reduce in one worker;
across workers a reduce to the first GPU, the cross-worker all-reduce there,
and a broadcast back. No gradient is copied to GPU 0 one variable at a time.
Across workers the packs' layout is checked once, not at every step.

Replicas on XLA devices (`TPUStrategy`'s replica mode) sum on the host
(`_sum_on_host`, NOTE [host reduction] in `collectives/xla.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from distribute import _torch
from distribute._enums import ReduceOp
from distribute.collectives.packing import pack_by_bytes, shaped_views, slot_views
from distribute.variables import DistributedVariable

if TYPE_CHECKING:
    from distribute.gradients.base import ReplicaGroup

__all__ = ["LocalSum"]

_TensorBase: Any = _torch.TensorBase


def _get_grad(var: DistributedVariable, local: int) -> torch.Tensor | None:
    if local:
        return var._ds_components[local - 1].grad
    with _torch.DisableTorchFunctionSubclass():
        grad: torch.Tensor | None = _TensorBase.grad.__get__(var)
    return grad


def _set_grad(var: DistributedVariable, local: int, grad: torch.Tensor) -> None:
    if local:
        var._ds_components[local - 1].grad = grad
        return
    with _torch.DisableTorchFunctionSubclass():
        _TensorBase.grad.__set__(var, grad)


class LocalSum:
    """Sums ``variables``' gradients over the local replicas, then across workers.

    Args:
        ext: the strategy's replicas (`ReplicaGroup`; they meet through it).
        variables: the optimizer's variables of that strategy.
    """

    def __init__(self, ext: ReplicaGroup, variables: Sequence[DistributedVariable]) -> None:
        self._ext = ext
        self._variables = list(variables)
        # Read once: a variable's own `.shape` and `.numel()` dispatch through its
        # `__torch_function__`, and a shape change makes a new LocalSum (the key of
        # `SynchronousStepHandler._sum_for` holds the layout generation).
        self._shapes = [v.shape for v in self._variables]
        devices = ext.devices
        self._on_gpus = (
            len(devices) > 1
            and all(d.type == "cuda" for d in devices)
            and len(set(devices)) == len(devices)
        )
        self._on_xla = all(d.type == "xla" for d in devices) and len(devices) > 1
        self._checked: object = None  # the cross-worker layout last checked

    def close(self) -> None:
        """Nothing to release: the sum keeps no buffers between steps."""

    @property
    def stale(self) -> bool:
        """Never: every step packs what it finds."""
        return False

    def sum(self, local: int, also: Callable[[], Any] | None = None) -> Any:
        """Sums every replica's gradients into each replica's gradients.

        Args:
            local: the calling replica.
            also: run once, inside the sum's rendezvous (every replica has arrived,
                none has gone on): its result is returned to every replica, so a
                step needs one rendezvous for both (the optimizer's param-group
                snapshot, `SynchronousStepHandler.before_step`).

        Returns:
            What ``also`` returned; None without it.
        """
        ext = self._ext
        variables = self._variables
        grads = [_get_grad(v, local) for v in variables]
        if self._on_gpus:
            return self._sum_on_gpus(local, grads, also)
        if self._on_xla:
            return self._sum_on_host(local, grads, also)
        extra, result = ext.exchange(
            local, "gradient aggregation", grads, _with(also, self._combine)
        )
        if result is None:
            return extra
        if isinstance(result, _Totals):  # every replica has every gradient, in place
            _torch.foreach_copy_(grads, result)
            return extra
        device = ext.devices[local]
        shapes = self._shapes
        for indices, total, unused in result:
            flat = total if total.device == device else total.to(device)
            for j, view in zip(indices, shaped_views(flat, [shapes[j] for j in indices])):
                var = variables[j]
                grad = _get_grad(var, local)
                if grad is None or grad.shape != shapes[j]:
                    if j not in unused:
                        _set_grad(var, local, view.clone())
                else:
                    grad.copy_(view)
        return extra

    def _combine(
        self, per_replica: list[list[torch.Tensor | None]]
    ) -> list[tuple[list[int], torch.Tensor, set[int]]] | _Totals | None:
        """Packs and sums the local replicas' gradients, then across workers (or sums
        them unpacked, `_summed_in_place`).

        Returns ``(variable indices, summed flat gradients, indices no replica of
        any worker has a gradient for)`` per pack. Across workers every variable
        is packed (all workers must run the same collectives) and each pack ends
        with one flag per variable, 1 where this worker has a gradient; summed,
        the flags tell which variables nobody used, whose gradients stay None.
        """
        ext = self._ext
        if ext.num_workers == 1:
            in_place = self._summed_in_place(per_replica)
            if in_place is not None:
                return in_place
        variables = self._variables
        n_vars = len(per_replica[0])
        used = [any(g[j] is not None for g in per_replica) for j in range(n_vars)]
        multi_worker = ext.num_workers > 1
        present = list(range(n_vars)) if multi_worker else [j for j in range(n_vars) if used[j]]
        if not present:
            return None
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j in present:
            sample = next((g[j] for g in per_replica if g[j] is not None), None)
            dtype = sample.dtype if sample is not None else torch.get_default_dtype()
            by_dtype.setdefault(dtype, []).append(j)
        devices = ext.devices
        packs: list[tuple[list[int], torch.Tensor]] = []
        for dtype, indices in by_dtype.items():
            sizes = [self._shapes[j].numel() * dtype.itemsize for j in indices]
            for pack in pack_by_bytes(sizes, ext.bytes_per_pack, reverse=False):
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
                slots = shaped_views(total, [self._shapes[j] for j in members])
                for r in range(1, len(per_replica)):
                    _add_into(slots, [per_replica[r][j] for j in members])
                packs.append((members, total))
        if not multi_worker:
            return [(m, t, set()) for m, t in packs]
        assert ext.cross_worker is not None
        layout = [(t.dtype, t.numel()) for _, t in packs]
        totals = ext.cross_worker.all_reduce(
            [t for _, t in packs], ReduceOp.SUM, name="gradients", check=layout != self._checked
        )
        self._checked = layout
        result = []
        for (members, _), total in zip(packs, totals):
            numel = total.numel() - len(members)
            unused: set[int] = set()
            if not all(used[j] for j in members):  # only then read the flags (a device sync)
                counts = total[numel:].tolist()
                unused = {j for j, c in zip(members, counts) if c == 0}
            result.append((members, total[:numel], unused))
        return result

    def _summed_in_place(self, per_replica: list[list[torch.Tensor | None]]) -> _Totals | None:
        """One worker whose replicas all have every gradient, of its variable's shape,
        with one dtype and device: the sums per variable with two ops for all of them
        (replica 0's plus each other's, in replica order: the packed sum's bits),
        none packed; None otherwise (NOTE [summing at the optimizer step])."""
        shapes = self._shapes
        for grads in per_replica:
            for j, grad in enumerate(grads):
                if grad is None or grad.shape != shapes[j]:
                    return None
        if len({(g.dtype, g.device) for grads in per_replica for g in grads}) != 1:  # type: ignore[union-attr]
            return None
        detached = [[g.detach() for g in grads] for grads in per_replica]  # type: ignore[union-attr]
        totals = _Totals(_torch.foreach_add(detached[0], detached[1]))
        for grads in detached[2:]:
            _torch.foreach_add_(totals, grads)
        return totals

    def _sum_on_gpus(
        self, local: int, grads: list[torch.Tensor | None], also: Callable[[], Any] | None
    ) -> Any:
        """Every local replica on its own GPU: NCCL sums the replicas' own packs."""
        ext = self._ext
        variables = self._variables
        device = ext.devices[local]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j, var in enumerate(variables):
            by_dtype.setdefault(var.dtype, []).append(j)
        packs: list[tuple[list[int], torch.Tensor]] = []
        with torch.no_grad():
            for dtype, indices in by_dtype.items():
                sizes = [variables[j].numel() * dtype.itemsize for j in indices]
                for pack in pack_by_bytes(sizes, ext.bytes_per_pack, reverse=False):
                    members = [indices[k] for k in pack]
                    parts = [_flat_grad(grads[j], variables[j], dtype, device) for j in members]
                    flags = torch.ones(len(members), dtype=dtype, device=device)
                    for k, j in enumerate(members):
                        if grads[j] is None:
                            flags[k] = 0
                    packs.append((members, torch.cat([*parts, flags])))
        # the packs are summed in place, every replica's on its own GPU
        extra, _ = ext.exchange(local, "gradient aggregation", packs, _with(also, self._nccl_sum))
        for members, flat in packs:
            numel = flat.numel() - len(members)
            used: list[float] | None = None
            if any(grads[j] is None for j in members):  # a host read only then
                used = flat[numel:].tolist()
            views = slot_views(flat[:numel], [variables[j] for j in members])
            for k, (j, view) in enumerate(zip(members, views)):
                grad = grads[j]
                if grad is None:
                    if used is not None and used[k] != 0:
                        _set_grad(variables[j], local, view)
                else:
                    grad.copy_(view)
        return extra

    def _sum_on_host(
        self, local: int, grads: list[torch.Tensor | None], also: Callable[[], Any] | None
    ) -> Any:
        """Replicas on XLA devices: the sum is made on the host (NOTE [host reduction]
        in `collectives/xla.py`) and copied to each replica's device."""
        extra, totals = self._ext.exchange(
            local, "gradient aggregation", grads, _with(also, _host_sum)
        )
        device = self._ext.devices[local]
        for var, total in zip(self._variables, totals):
            if total is not None:
                _set_grad(var, local, total.to(device))
        return extra

    def _nccl_sum(self, per_replica: list[list[tuple[list[int], torch.Tensor]]]) -> None:
        """Sums every pack over the local GPUs (and across workers) in place."""
        ext = self._ext
        cross = ext.cross_worker
        layout = [(flat.dtype, flat.numel()) for _, flat in per_replica[0]]
        check = layout != self._checked  # across workers, once per layout
        for k in range(len(layout)):
            flats = [packs[k][1] for packs in per_replica]
            if cross is None or ext.num_workers == 1:
                torch.cuda.nccl.all_reduce(flats)  # type: ignore[no-untyped-call]  # untyped in torch
                continue
            torch.cuda.nccl.reduce(flats, root=0)
            cross.all_reduce(flats[:1], ReduceOp.SUM, name="gradients", in_place=True, check=check)
            torch.cuda.nccl.broadcast(flats, root=0)
        self._checked = layout


class _Totals(list):  # type: ignore[type-arg]
    """The summed gradients, one per variable, for every replica to copy in."""


def _with(
    also: Callable[[], Any] | None, combine: Callable[[list[Any]], Any]
) -> Callable[[list[Any]], tuple[Any, Any]]:
    """``combine`` that first runs ``also`` (once, in the rendezvous): (its result,
    combine's)."""

    def both(per_replica: list[Any]) -> tuple[Any, Any]:
        return (also() if also is not None else None), combine(per_replica)

    return both


def _host_sum(per_replica: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    """Per variable, the sum of the replicas' gradients on the CPU, in replica order
    (None where no replica has one)."""
    from distribute.collectives import xla

    present = [g for grads in per_replica for g in grads if g is not None]
    on_host = iter(xla.to_host([g.detach() for g in present]))
    host = [[next(on_host) if g is not None else None for g in grads] for grads in per_replica]
    totals: list[torch.Tensor | None] = []
    for j in range(len(per_replica[0])):
        parts = [g for grads in host if (g := grads[j]) is not None]
        total = parts[0].clone() if parts else None
        for part in parts[1:]:
            assert total is not None
            total.add_(part)
        totals.append(total)
    return totals


def _add_into(slots: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """``slot += grad`` for every gradient present (moved to the slot's device)."""
    pairs = [(s, g) for s, g in zip(slots, grads) if g is not None]
    if not pairs:
        return
    device = slots[0].device
    _torch.foreach_add_([s for s, _ in pairs], [g.detach().to(device) for _, g in pairs])


def _flat_grad(
    grad: torch.Tensor | None, var: DistributedVariable, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if grad is not None:
        return grad.detach().reshape(-1)
    return torch.zeros(var.numel(), dtype=dtype, device=device)
