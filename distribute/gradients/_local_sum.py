"""The in-process gradient sum, across workers too: one `GradientSum`.

# NOTE [summing at the optimizer step]
Gradients are SUMMED over all replicas before any optimizer applies them (losses
are already scaled by the global batch size, `compute_average_loss`). At the
step the local replicas meet once: the last to arrive packs every replica's
gradients into flat buffers (`bytes_per_pack`, one per dtype), sums them,
all-reduces the sums across workers, and each replica copies the result into its
own gradients. Every replica then applies the identical update to its own copy,
so the copies stay bitwise equal.

Used wherever the sum cannot overlap backward: several local replicas (their
threads meet only at the step), central storage, one process. One local replica
per worker of several uses the bucket reducer instead (`_bucket_reducer.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from distribute._enums import ReduceOp
from distribute.collectives.packing import pack_by_bytes, slot_views
from distribute.variables import DistributedVariable

if TYPE_CHECKING:
    from distribute.strategies._replicated import ReplicatedExtended

__all__ = ["LocalSum"]

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


class LocalSum:
    """Sums ``variables``' gradients over the local replicas, then across workers.

    Args:
        ext: the strategy's extended object (its replicas meet through it).
        variables: the optimizer's variables of that strategy.
    """

    def __init__(self, ext: ReplicatedExtended, variables: Sequence[DistributedVariable]) -> None:
        self._ext = ext
        self._variables = list(variables)

    def close(self) -> None:
        """Nothing to release: the sum keeps no buffers between steps."""

    @property
    def stale(self) -> bool:
        """Never: every step packs what it finds."""
        return False

    def sum(self, local: int) -> None:
        """Sums every replica's gradients into each replica's gradients."""
        ext = self._ext
        variables = self._variables
        grads = [_get_grad(v, local) for v in variables]
        result = ext._exchange(local, "gradient aggregation", grads, self._combine)
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
        self, per_replica: list[list[torch.Tensor | None]]
    ) -> list[tuple[list[int], torch.Tensor, set[int]]] | None:
        """Packs and sums the local replicas' gradients, then across workers.

        Returns ``(variable indices, summed flat gradients, indices no replica of
        any worker has a gradient for)`` per pack. Across workers every variable
        is packed (all workers must run the same collectives) and each pack ends
        with one flag per variable, 1 where this worker has a gradient; summed,
        the flags tell which variables nobody used, whose gradients stay None.
        """
        ext = self._ext
        variables = self._variables
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
