"""`ds.compat.v1.ParameterServerStrategy`: the between-graph parameter-server style.

Every worker task runs the same training program; variables and their updates
live on the ``ps`` tasks (which run ``ds.Server(resolver).join()``). A worker's
local replicas (its `devices`, logical CPU devices included) are synchronous with
each other: their gradients are summed into one update per step, sent once. Workers
are asynchronous with each other: each applies its updates as it goes.

* Variables get the same ids and ps tasks on every worker (they are created in the
  same order); worker 0 sends their initial values, the others wait for them.
* Each `run` first reads the current values of the worker's variables from the ps
  tasks (one request per ps), then runs `fn` per local replica.
* A write in replica context follows the variable's aggregation: SUM adds every
  replica's value on the ps, MEAN their mean, ONLY_FIRST_REPLICA (a global step)
  only the first replica's: once per worker step.
* A worker's `shutdown()` (or its exit) tells the ps tasks; they stop when every
  worker has finished.

The cluster has ``worker`` and ``ps`` jobs and no ``chief`` (a chief means the TF2
style, `ds.ParameterServerStrategy`).

Example::

    strategy = ds.compat.v1.ParameterServerStrategy()     # TF_CONFIG names this worker
    with strategy.scope():
        model = torch.nn.Linear(64, 10)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in strategy.experimental_distribute_dataset(loader):
        strategy.run(step, args=(batch,))
    strategy.shutdown()
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from distribute.cluster_resolver.base import ClusterResolver
from distribute.cluster_resolver.select import resolve_cluster
from distribute.errors import InvalidArgumentError
from distribute.ps import _runtime
from distribute.strategies import _ps_engine
from distribute.strategies._devices import device_list
from distribute.strategies._replicated import ReplicatedExtended
from distribute.strategies.base import Strategy

__all__ = ["ParameterServerStrategyV1"]


class ParameterServerStrategyV1(Strategy):
    """Between-graph asynchronous training: every worker runs this program.

    Args:
        cluster_resolver: the cluster (``worker`` and ``ps`` jobs) with this
            process's worker task; None reads it from the launcher's variables
            (`TF_CONFIG`).
        variable_partitioner: splits variables along dim 0 into shards.
        devices: this worker's local replicas (default one CPU); logical CPU
            devices ``"cpu:0"``, ``"cpu:1"`` run several replicas on the CPU.
        timeout_seconds: the longest any call between tasks may take.

    Raises:
        InvalidArgumentError: no cluster, a cluster with a chief, or this process
            is not a worker task.

    Example::

        strategy = ds.compat.v1.ParameterServerStrategy()
        strategy.num_replicas_in_sync      # this worker's local replicas
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        variable_partitioner: Callable[[Sequence[int], torch.dtype], list[int]] | None = None,
        devices: Sequence[str] | None = None,
        timeout_seconds: float = _ps_engine.DEFAULT_TIMEOUT_SECONDS,
    ) -> None:
        resolver = cluster_resolver if cluster_resolver is not None else resolve_cluster()
        if resolver is None:
            raise InvalidArgumentError(
                "compat.v1.ParameterServerStrategy found no cluster: set TF_CONFIG with "
                "'worker' and 'ps' jobs and this process's task, or pass a cluster_resolver"
            )
        cluster = _ps_engine.PsCluster(resolver)
        if cluster.has_chief:
            raise InvalidArgumentError(
                "this cluster has a 'chief': that is the TF2 style, where the chief "
                "coordinates with ds.ParameterServerStrategy and workers run ds.Server; "
                "the compat.v1 style has only 'worker' and 'ps' jobs"
            )
        if resolver.task_type != "worker" or resolver.task_id is None:
            raise InvalidArgumentError(
                f"compat.v1.ParameterServerStrategy runs on worker tasks, but this process is "
                f"{resolver.task_type!r} {resolver.task_id}; ps tasks run "
                "ds.Server(resolver).join()"
            )
        self._resolver = resolver
        self._cluster = cluster
        self._timeout = float(timeout_seconds)
        self._closed = False
        name = _ps_engine.task_name("worker", resolver.task_id)
        # Writes outside `run` (a restore) reach the ps.
        runtime = _runtime.Runtime(name, self._timeout, writes_through_outside_run=True)
        runtime.strategy = self
        self._runtime = runtime
        store = _ps_engine.start_task(
            runtime, lambda: _ps_engine.connect(resolver, cluster, name, self._timeout)
        )
        # Worker 0 sends the initial values; the others wait for them on the store.
        self._variables = _ps_engine.ParameterServerVariables(
            cluster.ps,
            variable_partitioner,
            self._timeout,
            publishes=resolver.task_id == 0,
            barrier=store,
        )
        super().__init__(
            ReplicatedExtended(
                self,
                device_list(list(devices)) if devices is not None else ["cpu"],
                wrap_single_values=False,
                home=self._variables,
                lifecycle=self._variables,
            )
        )
        atexit.register(_ps_engine.shutdown_at_exit, weakref.ref(self))

    def __reduce__(self) -> Any:
        raise InvalidArgumentError(
            "compat.v1.ParameterServerStrategy is not shipped to other tasks: every worker "
            "builds its own"
        )

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolver of the cluster."""
        return self._resolver

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: Any = None,
    ) -> Any:
        """Reads the variables' current values from the ps tasks, then runs `fn` per
        local replica (their gradients are summed into one update, sent once).

        Example::

            loss = strategy.run(step, args=(batch,))
        """
        self._variables.publish()
        self._runtime.refresh_whole()
        return super().run(fn, args, kwargs, options)

    def shutdown(self) -> None:
        """Tells the ps tasks this worker is done and closes its endpoint."""
        if self._closed:
            return
        self._closed = True
        _ps_engine.leave_cluster(
            self._runtime, self._cluster.ps, _runtime.ps_worker_done, self._runtime.name
        )

    def __repr__(self) -> str:
        return (
            f"compat.v1.ParameterServerStrategy({self._runtime.name}, "
            f"replicas={self.num_replicas_in_sync}, ps={len(self._cluster.ps)})"
        )
