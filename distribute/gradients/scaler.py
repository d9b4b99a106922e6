"""`GradScaler`: `torch.amp.GradScaler` that unscales the summed gradients.

# NOTE [loss scaling with replicas]
`torch.amp.GradScaler.unscale_` divides each replica's own gradient by the scale
and checks it for infinities before the optimizer step, which is where gradients
are summed over replicas. Replicas then disagree on whether to step (one skips
and the others wait for it in the sum), and an unscaled local gradient is summed
with scaled ones. This scaler sums first: its `unscale_` (called by `step`, or
by the user before clipping) has the strategy sum the gradients over every
replica of every worker, then unscales and checks the sum, which every replica
holds identically; so every replica steps or skips together, and the scale
evolves identically everywhere. The scale, the growth tracker and the
per-optimizer stages are kept per local replica (replica threads share the
scaler object); in cross-replica code, `get_scale()` and `state_dict()` see
replica 0's.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from distribute import _torch
from distribute.errors import ContextError
from distribute.gradients._hooks import forget_early_sums, sum_before_step
from distribute.variables import _running_replica

__all__ = ["GradScaler"]

_PER_REPLICA = (
    "_scale",
    "_growth_tracker",
    "_per_optimizer_states",
    "_init_scale",
    "_init_growth_tracker",
)


def _local_replica_id() -> int | None:
    """The local replica running in this thread (of any strategy), else None."""
    running = _running_replica()
    return None if running is None else running[1]


class _PerReplicaAttribute:
    """A `GradScaler` attribute with one value per local replica."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, scaler: Any, owner: type | None = None) -> Any:
        if scaler is None:
            return self
        try:
            return scaler._ds_slot()[self._name]
        except KeyError:
            raise AttributeError(self._name) from None

    def __set__(self, scaler: Any, value: Any) -> None:
        scaler._ds_slot()[self._name] = value


class GradScaler(torch.amp.GradScaler):
    """Loss scaling for mixed precision under any strategy (`torch.amp.GradScaler`'s API).

    Use it exactly like `torch.amp.GradScaler`, inside the step function given to
    `strategy.run`; gradients are summed over all replicas before they are
    unscaled and checked, so every replica and worker makes the same decision.
    `torch.amp.GradScaler` itself is refused under a strategy with more than one
    replica in sync.

    Example:
        >>> import distribute as ds, torch
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     model = torch.nn.Linear(4, 1)
        ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     scaler = ds.GradScaler("cpu", init_scale=1024.0)
        >>> def step(x):
        ...     with torch.autocast("cpu", dtype=torch.bfloat16):
        ...         per_example = model(x).float().pow(2).mean(1)
        ...     loss = ds.compute_average_loss(per_example, global_batch_size=8)
        ...     scaler.scale(loss).backward()
        ...     scaler.step(optimizer)   # sums, unscales, checks, steps
        ...     scaler.update()
        ...     optimizer.zero_grad()
        >>> _ = strategy.run(step, args=(ds.PerReplica((torch.ones(4, 4), torch.ones(4, 4))),))
        >>> scaler.get_scale()
        1024.0
    """

    _scale = _PerReplicaAttribute()
    _growth_tracker = _PerReplicaAttribute()
    _per_optimizer_states = _PerReplicaAttribute()
    _init_scale = _PerReplicaAttribute()
    _init_growth_tracker = _PerReplicaAttribute()

    def _ds_slot(self) -> dict[str, Any]:
        """The running local replica's attributes (replica 0's in cross-replica code)."""
        slots: dict[int, dict[str, Any]] = self.__dict__.setdefault("_ds_slots", {0: {}})
        replica = _local_replica_id() or 0
        slot = slots.get(replica)
        if slot is None:
            lock: threading.Lock = self.__dict__.setdefault("_ds_lock", threading.Lock())
            with lock:
                slot = slots.get(replica)
                if slot is None:
                    slot = self._ds_new_slot(slots[0])
                    slots[replica] = slot
        return slot

    def _ds_new_slot(self, first: dict[str, Any]) -> dict[str, Any]:
        """Another replica's attributes, starting where replica 0's are.

        The scale tensors are made lazily by `scale()` on the replica's own device,
        from ``_init_scale``: replica 0's current scale when it has one.
        """
        slot: dict[str, Any] = {
            "_scale": None,
            "_growth_tracker": None,
            "_per_optimizer_states": collections.defaultdict(_torch.refresh_per_optimizer_state),
        }
        for name, current in (
            ("_init_scale", "_scale"),
            ("_init_growth_tracker", "_growth_tracker"),
        ):
            if first.get(current) is not None:
                slot[name] = first[current].item()
            elif name in first:
                slot[name] = first[name]
        return slot

    def _ds_require_replica_context(self, method: str) -> None:
        """Refuses cross-replica calls that would change replica 0's state alone."""
        slots = self.__dict__.get("_ds_slots", {})
        if len(slots) > 1 and _local_replica_id() is None:
            raise ContextError(
                f"GradScaler.{method}() was called in cross-replica context after the "
                f"scaler was used by {len(slots)} replicas: it would change replica 0's "
                f"state alone. Call {method}() inside the function given to strategy.run"
            )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Sums the optimizer's gradients over all replicas, then unscales the sum.

        See `torch.amp.GradScaler.unscale_`; inside `strategy.run` it first has
        the strategy sum the gradients (every replica must call it, as `step`).
        """
        if self._enabled and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            sum_before_step(optimizer)
        super().unscale_(optimizer)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """See `torch.amp.GradScaler.update`; identical on every replica."""
        if self._enabled:
            self._ds_require_replica_context("update")
            forget_early_sums(self._per_optimizer_states.keys())
        super().update(new_scale)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """See `torch.amp.GradScaler.load_state_dict`; call it outside `run`.

        Every replica's scale starts from the loaded one.
        """
        if _local_replica_id() is not None:
            raise ContextError(
                "GradScaler.load_state_dict() was called inside `run`; load it in "
                "cross-replica code, where it sets every replica's scale"
            )
        slots = self.__dict__.get("_ds_slots")
        if slots is not None:
            for replica in [r for r in slots if r != 0]:
                del slots[replica]  # made again from replica 0's loaded state
        super().load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()
        state.pop("_ds_lock", None)
        slots = state.pop("_ds_slots", {0: {}})
        state["_ds_slots"] = {
            0: {**slots[0], **{k: state.pop(k) for k in _PER_REPLICA if k in state}}
        }
        return state
