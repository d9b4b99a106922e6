"""`ds.coordinator`: scheduling closures onto parameter-server workers.

Example::

    strategy = ds.ParameterServerStrategy(resolver)
    coordinator = ds.coordinator.ClusterCoordinator(strategy)
    value = coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
"""

from __future__ import annotations

from distribute.coordinator._coordinator import ClusterCoordinator
from distribute.coordinator._failures import ClosureCancelledError, RemoteError, WorkerLostError
from distribute.coordinator._values import PerWorkerValues, RemoteValue
from distribute.coordinator.local import LocalCluster
from distribute.ps._runtime import PsUnavailableError

__all__ = [
    "ClosureCancelledError",
    "ClusterCoordinator",
    "LocalCluster",
    "PerWorkerValues",
    "PsUnavailableError",
    "RemoteError",
    "RemoteValue",
    "WorkerLostError",
]
