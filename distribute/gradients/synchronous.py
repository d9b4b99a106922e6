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
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from distribute.gradients import _hooks  # noqa: F401  # registers the optimizer step hooks
from distribute.gradients._bucket_reducer import BucketReducer
from distribute.gradients._local_sum import LocalSum
from distribute.gradients._state import PerReplicaState
from distribute.gradients.base import GradientSum

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from distribute.strategies._replicated import ReplicatedExtended
    from distribute.variables import DistributedVariable

__all__ = ["SynchronousStepHandler"]


class SynchronousStepHandler:
    """Sums gradients over every replica at the step; every replica then updates.

    Args:
        ext: the strategy's extended object.
    """

    def __init__(self, ext: ReplicatedExtended) -> None:
        self._ext_ref = weakref.ref(ext)
        self._sums: weakref.WeakKeyDictionary[Optimizer, tuple[tuple[int, ...], GradientSum]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    @property
    def _ext(self) -> ReplicatedExtended:
        ext = self._ext_ref()
        assert ext is not None
        return ext

    def _sum_for(
        self, optimizer: Optimizer, variables: Sequence[DistributedVariable]
    ) -> GradientSum:
        """The optimizer's `GradientSum`, made at its first step (once for all replicas)."""
        key = tuple(map(id, variables))
        cached = self._sums.get(optimizer)
        if cached is not None and cached[0] == key:
            return cached[1]
        with self._lock:
            cached = self._sums.get(optimizer)
            if cached is not None and cached[0] == key:
                return cached[1]
            if cached is not None:  # the optimizer's parameters changed
                cached[1].close()
            ext = self._ext
            gradient_sum: GradientSum
            if ext._num_local == 1 and not ext._central and ext._cross_worker is not None:
                reducer = BucketReducer(
                    variables,
                    ext._cross_worker,
                    ext._bytes_per_pack,
                    skip=lambda: ext._no_sync_depth > 0,
                )
                reducer.check_layout()
                gradient_sum = reducer
            else:
                gradient_sum = LocalSum(ext, variables)
            self._sums[optimizer] = (key, gradient_sum)
            return gradient_sum

    def sum_gradients(
        self, optimizer: Optimizer, variables: Sequence[DistributedVariable], local: int
    ) -> None:
        ext = self._ext
        if ext.experimental_aggregate_gradients and ext._num_replicas_in_sync() > 1:
            self._sum_for(optimizer, variables).sum(local)

    def before_step(
        self,
        optimizer: Optimizer,
        variables: Sequence[DistributedVariable],
        local: int,
        *,
        summed: bool,
    ) -> None:
        ext = self._ext
        if ext._num_local > 1 and not isinstance(optimizer.state, PerReplicaState):
            with self._lock:
                if not isinstance(optimizer.state, PerReplicaState):
                    optimizer.state = PerReplicaState(optimizer.state, ext)
        if not summed:
            self.sum_gradients(optimizer, variables, local)
        if ext._central and local != 0:
            ext._skip_grads.value = True

    def after_step(
        self, optimizer: Optimizer, variables: Sequence[DistributedVariable], local: int
    ) -> None:
        ext = self._ext
        if not ext._central:
            return
        ext._skip_grads.value = False
        # Replicas wait until replica 0 has updated the one shared copy.
        ext._exchange(local, "optimizer step (central storage)", None, lambda _: None)

    def close(self) -> None:
        """Unregisters every bucket reducer's hooks (the strategy shuts down)."""
        with self._lock:
            for _, gradient_sum in list(self._sums.values()):
                gradient_sum.close()
            self._sums.clear()
