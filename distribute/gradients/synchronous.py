"""The `StepHandler` of the synchronous strategies: sum, then every replica updates.

Default, OneDevice, Mirrored, CentralStorage and MultiWorkerMirrored share it.
At each step every replica's gradients are summed over all replicas (a
`GradientSum`), then every replica applies the identical update to its own copy,
with its own optimizer state (`PerReplicaState`). Under central storage the
replicas share one copy: replica 0 applies the update, the others skip it and
wait until it is written.

Which `GradientSum`: with one local replica per worker and several workers, the
bucket reducer, which overlaps the all-reduce with backward
(NOTE [overlapped gradient sync]); otherwise the in-process sum at the step
(NOTE [summing at the optimizer step]).

It refuses `torch.amp.GradScaler` with several replicas in sync (it would
unscale each replica's own gradient before the sum; `distribute.GradScaler`
sums first), and a step outside `run` over gradients made inside it.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from distribute import _torch
from distribute.errors import ContextError, InvalidArgumentError
from distribute.gradients._bucket_reducer import BucketReducer
from distribute.gradients._local_sum import LocalSum
from distribute.gradients._replica_params import (
    ReplicaParamGroups,
    snapshot_groups,
    with_plain_params,
    write_back,
)
from distribute.gradients._state import PerReplicaState
from distribute.gradients.base import GradientSum
from distribute.gradients.scaler import GradScaler

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from distribute.gradients.base import ReplicaGroup
    from distribute.variables import DistributedVariable

__all__ = ["SynchronousStepHandler"]


class SynchronousStepHandler:
    """Sums gradients over every replica at the step; every replica then updates.

    Args:
        group: the strategy's replicas (`ReplicaGroup`).
    """

    def __init__(self, group: ReplicaGroup) -> None:
        self._group = group
        # This replica thread's step is to find no gradients (central storage).
        self._hidden = threading.local()
        self._sums: weakref.WeakKeyDictionary[Optimizer, tuple[tuple[int, ...], GradientSum]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        # Per optimizer: whether its steps get plain tensors (NOTE [plain tensors at the step]).
        self._plain: weakref.WeakKeyDictionary[Optimizer, bool] = weakref.WeakKeyDictionary()
        # (several local replicas, replicas in sync, central storage): fixed for the
        # engine's life, read at the first step rather than through the group's
        # properties at every step (issue 40).
        self._fixed: tuple[bool, int, bool] | None = None

    def _replicas(self) -> tuple[bool, int, bool]:
        group = self._group
        self._fixed = (len(group.devices) > 1, group.num_replicas_in_sync, group.central_storage)
        return self._fixed

    def _sum_for(
        self, optimizer: Optimizer, variables: Sequence[DistributedVariable]
    ) -> GradientSum:
        """The optimizer's `GradientSum`, made at its first step (once for all replicas)."""
        key = (*map(id, variables), self._group.layout_generation)
        cached = self._sums.get(optimizer)
        if cached is not None and cached[0] == key and not cached[1].stale:
            return cached[1]
        with self._lock:
            cached = self._sums.get(optimizer)
            if cached is not None and cached[0] == key and not cached[1].stale:
                return cached[1]
            if cached is not None:  # the optimizer's parameters changed
                cached[1].close()
            group = self._group
            gradient_sum: GradientSum
            cross = group.cross_worker
            if len(group.devices) == 1 and not group.central_storage and cross is not None:
                reducer = BucketReducer(
                    variables,
                    cross,
                    group.bytes_per_pack,
                    skip=lambda: not group.syncing,
                )
                reducer.check_layout()
                gradient_sum = reducer
            else:
                gradient_sum = LocalSum(group, variables)
            self._sums[optimizer] = (key, gradient_sum)
            return gradient_sum

    def sum_gradients(
        self, optimizer: Optimizer, variables: Sequence[DistributedVariable], local: int
    ) -> None:
        in_sync = (self._fixed or self._replicas())[1]
        if in_sync > 1 and self._group.aggregate_gradients:
            self._sum_for(optimizer, variables).sum(local)

    def before_step(
        self,
        optimizer: Optimizer,
        variables: Sequence[DistributedVariable],
        local: int,
        *,
        summed: bool,
    ) -> None:
        group = self._group
        several, in_sync, central = self._fixed or self._replicas()
        plain = self._plain_tensors(optimizer)
        if (several or plain) and not isinstance(optimizer.state, PerReplicaState):
            with self._lock:
                if not isinstance(optimizer.state, PerReplicaState):
                    optimizer.state = PerReplicaState(
                        optimizer.state, group.strategy, group.devices
                    )
        sums = not summed and in_sync > 1
        if sums:
            _refuse_torch_grad_scaler()
        view: list[dict[str, Any]] | None = None  # None: replica 0 steps on the originals
        viewed = False
        if several and sums and self._group.aggregate_gradients:
            gradient_sum = self._sum_for(optimizer, variables)
            if isinstance(gradient_sum, LocalSum):
                # One rendezvous for the sum and the groups' snapshot, taken inside it
                # while no replica can have stepped yet (issue 40: it was a second one).
                snapshot = self._snapshot(optimizer, plain)
                view = gradient_sum.sum(local, also=snapshot)[local]
                sums, viewed = False, True
        if not viewed and (several or plain):
            view = self._own_groups(optimizer, local, plain)  # before the sum, likewise
        if sums:
            self.sum_gradients(optimizer, variables, local)
        if central and local != 0:
            self._hidden.value = True
        if view is not None:
            groups = optimizer.param_groups
            assert isinstance(groups, ReplicaParamGroups)
            groups.begin(view)
            if plain:  # after the sum: replica 0's plain alias takes its summed gradient
                state = optimizer.state
                assert isinstance(state, PerReplicaState)
                state.translate(with_plain_params(view, group.strategy, local))

    def _plain_tensors(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` steps on plain tensors (NOTE [plain tensors at the step]):
        replicas off the CPU, or ``foreach``/``fused`` asked for; never under central
        storage, whose replicas share one copy that replica 0 alone updates."""
        plain = self._plain.get(optimizer)
        if plain is None:
            group = self._group
            groups = optimizer.param_groups
            if isinstance(groups, ReplicaParamGroups):
                groups = groups.originals()
            asked = any(g.get("foreach") or g.get("fused") for g in groups)
            # XLA devices step per parameter (torch's default there), and an update
            # made through replica 0's plain alias is not donated to the parameter's
            # buffer: device 0 would compile its own copy of every step's program.
            off_cpu = any(d.type not in ("cpu", "xla") for d in group.devices)
            plain = not group.central_storage and (asked or off_cpu)
            self._plain[optimizer] = plain
        return plain

    def _snapshot(
        self, optimizer: Optimizer, plain: bool
    ) -> Callable[[], list[list[dict[str, Any]] | None]]:
        """What makes every local replica's own copies of the optimizer's groups for
        the step (None for replica 0 stepping on the originals; NOTE [group state per
        replica]): called once, while no replica can have stepped."""
        groups = optimizer.param_groups
        if not isinstance(groups, ReplicaParamGroups):  # first step, or load_state_dict
            with self._lock:
                groups = optimizer.param_groups
                if not isinstance(groups, ReplicaParamGroups):
                    groups = ReplicaParamGroups(groups)
                    optimizer.param_groups = groups
        return functools.partial(
            snapshot_groups, groups.originals(), len(self._group.devices), plain
        )

    def _own_groups(
        self, optimizer: Optimizer, local: int, plain: bool
    ) -> list[dict[str, Any]] | None:
        """This replica's own copies of the optimizer's groups for the step (`_snapshot`)."""
        snapshot = self._snapshot(optimizer, plain)
        if len(self._group.devices) == 1:
            return snapshot()[0]
        views: list[list[dict[str, Any]] | None] = self._group.exchange(
            local, "optimizer step (param groups)", None, lambda _: snapshot()
        )
        return views[local]

    def after_step(
        self, optimizer: Optimizer, variables: Sequence[DistributedVariable], local: int
    ) -> None:
        groups = optimizer.param_groups
        if isinstance(groups, ReplicaParamGroups):
            view = groups.current()
            if view is not None and local == 0:
                write_back(groups.originals(), view)
            groups.end()
            state = optimizer.state
            if isinstance(state, PerReplicaState):
                state.translate(None)
        if not (self._fixed or self._replicas())[2]:
            return
        self._hidden.value = False
        # Replicas wait until replica 0 has updated the one shared copy.
        self._group.exchange(local, "optimizer step (central storage)", None, lambda _: None)

    def steps_quietly(self, optimizer: Optimizer) -> bool:
        """One replica in sync, no central storage, the variables themselves stepped:
        `before_step` makes no per-replica state, sums nothing and shows no groups,
        and `after_step` has nothing to put back or wait for."""
        several, in_sync, central = self._fixed or self._replicas()
        return not several and in_sync == 1 and not central and not self._plain_tensors(optimizer)

    def hides_gradients(self) -> bool:
        """True in a replica other than 0 during a central-storage step."""
        return bool(getattr(self._hidden, "value", False))

    def check_step_outside_run(
        self, optimizer: Optimizer, variables: Sequence[DistributedVariable]
    ) -> None:
        """Refuses a step that would apply one replica's gradient alone.

        After `backward()` inside `run`, the other local replicas' copies hold
        their own gradients, and other workers hold theirs: a step in
        cross-replica context would sum none of them.
        """
        group = self._group
        n = group.num_replicas_in_sync
        if n == 1 or not group.captures_modules:
            return
        multi_worker = group.num_workers > 1
        for var in variables:
            if any(c.grad is not None for c in var._ds_components) or (
                multi_worker and var.grad is not None
            ):
                raise ContextError(
                    "optimizer.step() was called in cross-replica context, but its variables "
                    f"of {group.strategy!r} hold gradients computed inside `run`: "
                    "this step would apply one replica's gradient alone. Call "
                    "optimizer.step() inside the function given to strategy.run, after "
                    "loss.backward()"
                )

    def close(self) -> None:
        """Unregisters every bucket reducer's hooks (the strategy shuts down)."""
        with self._lock:
            for _, gradient_sum in list(self._sums.values()):
                gradient_sum.close()
            self._sums.clear()


def _refuse_torch_grad_scaler() -> None:
    """Raises when `torch.amp.GradScaler.step` (not `distribute.GradScaler`) is stepping.

    It unscales and checks each replica's own gradient before the sum at this
    step, so replicas and workers would disagree on the scale and on whether to
    step (one skipping while the others wait for it in the sum). The scaler is
    found by `_torch.stepping_grad_scaler` (torch's ``step`` passes nothing of itself).
    """
    scaler = _torch.stepping_grad_scaler()
    if scaler is not None and not isinstance(scaler, GradScaler):
        raise InvalidArgumentError(
            "torch.amp.GradScaler unscales and checks each replica's own gradient "
            "before gradients are summed, so replicas disagree on the scale and on "
            "whether to step; use distribute.GradScaler (the same API) instead"
        )
