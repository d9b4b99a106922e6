"""What the replicated engine's own parts read of it: a fixed topology and a declared host.

# NOTE [the replica host]
`ReplicatedExtended` is split over a few modules to keep each readable: placement
(`_placement.VariablePlacement`), the collectives among replicas
(`_replica_collectives.ReplicaCollectives`) and the cross-replica reductions
(`_cross_replica.CrossReplicaReductions`). They once read some 70 of the engine's
private attributes, typed against the engine class itself (an import cycle that only
`TYPE_CHECKING` hid, and a coupling no check saw). Now they read two declared things:

* `ReplicaTopology`, frozen when the engine is built: its replica devices, where
  their values meet, this worker's place among the workers and their collectives,
  whether storage is central. Nothing of it changes over the engine's life, so a
  part keeps the object itself and reads plain fields (no property call per read on
  the hot path).
* `ReplicaHost`, the few things only the live engine can do (meet the other local
  replicas, make and register a variable, hear that variables changed); the parts
  hold it weakly, as before, so that they never keep a dropped strategy alive.

Example::

    topology = ReplicaTopology.of((cpu0, cpu1), workers=None, central=False)
    topology.num_replicas_in_sync        # 2
    topology.global_id(1)                # 1 (worker 0's second replica)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from distribute._enums import VariableSpec

if TYPE_CHECKING:
    from distribute.collectives.base import CrossWorker
    from distribute.collectives.cross_device_ops import CrossDeviceOps
    from distribute.strategies._engine_parts import Workers
    from distribute.strategies._replica_threads import Rendezvous
    from distribute.variables import DistributedVariable

__all__ = ["ReplicaHost", "ReplicaTopology"]


@dataclass(frozen=True, slots=True)
class ReplicaTopology:
    """Where a replicated engine's replicas are, fixed when it is built.

    Attributes:
        devices: this worker's replica devices, one per local replica.
        meet_device: where the local replicas' values meet to be combined: the first
            replica's device, or the host for XLA devices (their pending tensors
            cannot move between devices; NOTE [host reduction] in collectives/xla.py).
        worker_index: this worker's index among the strategy's workers.
        num_workers: how many workers the strategy has.
        cross_worker: the workers' collectives (None: one worker).
        central: whether variables live in one copy (central storage).
        num_local: ``len(devices)``.
        num_replicas_in_sync: replicas over every worker.
    """

    devices: tuple[torch.device, ...]
    meet_device: torch.device
    worker_index: int
    num_workers: int
    cross_worker: CrossWorker | None
    central: bool
    num_local: int
    num_replicas_in_sync: int

    @classmethod
    def of(
        cls, devices: Sequence[torch.device], workers: Workers | None, central: bool
    ) -> ReplicaTopology:
        """The topology of replicas on ``devices`` of this worker among ``workers``."""
        devices = tuple(devices)
        count = workers.count if workers is not None else 1
        return cls(
            devices=devices,
            meet_device=torch.device("cpu") if devices[0].type == "xla" else devices[0],
            worker_index=workers.index if workers is not None else 0,
            num_workers=count,
            cross_worker=workers.collectives if workers is not None else None,
            central=central,
            num_local=len(devices),
            num_replicas_in_sync=count * len(devices),
        )

    def global_id(self, local: int) -> int:
        """The replica id over every worker of this worker's local replica ``local``."""
        return self.worker_index * self.num_local + local


class ReplicaHost(Protocol):
    """What the replicated engine's parts ask of the live engine (NOTE [the replica
    host])."""

    @property
    def topology(self) -> ReplicaTopology:
        """Where the replicas are."""
        ...

    @property
    def container_strategy(self) -> Any:
        """The strategy this engine serves (for messages and the merge context)."""
        ...

    @property
    def cross_device_ops(self) -> CrossDeviceOps | None:
        """The user's `CrossDeviceOps`, if one was given."""
        ...

    @property
    def rendezvous(self) -> Rendezvous | None:
        """Where the local replica threads meet (None: one local replica)."""
        ...

    def exchange(
        self, local: int, kind: str, payload: Any, combine: Callable[[list[Any]], Any]
    ) -> Any:
        """Runs ``combine`` over every local replica's payload; each gets its result."""
        ...

    def make_variable(
        self, value: torch.Tensor, spec: VariableSpec, devices: Sequence[torch.device]
    ) -> DistributedVariable:
        """A variable of this strategy on ``devices``, not yet registered with it."""
        ...

    def register_variable(self, var: DistributedVariable) -> None:
        """Makes a placed variable one of this strategy's."""
        ...

    def variables_changed(self) -> None:
        """A variable's shape or dtype changed (gradient sums laid out for it are stale)."""
        ...

    def data_replaced(self, var: DistributedVariable) -> None:
        """``var``'s data was swapped: every worker takes the chief's before the next run."""
        ...
