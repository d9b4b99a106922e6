"""`ParameterServerStrategy` and `ds.Server`: asynchronous training with parameter servers.

A cluster has one ``chief`` (it runs the user's program and coordinates), ``worker``
tasks (they run scheduled closures) and ``ps`` tasks (they hold the variables and
apply the updates). ps and worker tasks run ``ds.Server(resolver).join()``. The
chief builds the strategy, creates variables in its scope (each goes to a ps task,
round-robin, or split by a `variable_partitioner` into a `ShardedVariable`) and
schedules step functions with `ds.coordinator.ClusterCoordinator`.

Every task joins through this library's rendezvous at the chief's address (a task
started with another cluster spec, or a second process claiming a task, is refused
there, naming the difference), then talks through `_transport.Transport` (rpc).

Rpc names: ``chief``, ``worker_<i>``, ``ps_<i>``; ranks: chief 0, workers 1..W, ps after.

Example::

    # chief
    strategy = ds.ParameterServerStrategy(ds.cluster_resolver.TFConfigClusterResolver())
    coordinator = ds.coordinator.ClusterCoordinator(strategy)
    # every ps and worker task
    ds.Server(ds.cluster_resolver.TFConfigClusterResolver()).join()
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from distribute._enums import StepRunner
from distribute.cluster_resolver.base import ClusterResolver
from distribute.errors import InvalidArgumentError
from distribute.ps import _runtime
from distribute.strategies._ps_engine import (
    DEFAULT_TIMEOUT_SECONDS,
    ParameterServerVariables,
    PsCluster,
    connect,
    leave_cluster,
    shutdown_at_exit,
    start_task,
    task_name,
)
from distribute.strategies._replicated import ReplicatedExtended
from distribute.strategies.base import Strategy

__all__ = ["ClusterEvents", "CoordinatedCluster", "ParameterServerStrategy", "Server"]

logger = logging.getLogger(__name__)


class ClusterEvents(Protocol):
    """What a `ParameterServerStrategy` tells its coordinator about the cluster
    (`ds.coordinator.ClusterCoordinator` passes one to `attach_coordinator`)."""

    def worker_replaced(self, worker: str) -> None:
        """`worker`'s process died and a new one is joining: calls still out to the
        old process are stale (NOTE [worker restarts])."""
        ...

    def worker_rejoined(self, worker: str) -> None:
        """`worker`'s new process has joined: it may run closures again."""
        ...

    def cluster_stopping(self) -> None:
        """The strategy is shutting the cluster down: nothing more will run."""
        ...


@dataclass(frozen=True)
class CoordinatedCluster:
    """What a coordinator uses of its strategy's cluster (`attach_coordinator`).

    Attributes:
        runtime: the chief's task runtime (its transport and timeout).
        workers: the worker tasks' names, in index order.
        ps: the ps tasks' names, in index order.
        publish: sends the variables created since its last call to their ps tasks.
    """

    runtime: _runtime.Runtime
    workers: tuple[str, ...]
    ps: tuple[str, ...]
    publish: Callable[[], None]


class ParameterServerStrategy(Strategy):
    """Asynchronous data parallelism: variables on ps tasks, steps on worker tasks.

    Build it on the chief; schedule steps with `ds.coordinator.ClusterCoordinator`.
    ps and worker tasks run ``ds.Server(resolver).join()``.

    Args:
        cluster_resolver: the cluster (one chief, workers, ps tasks); e.g. a
            `TFConfigClusterResolver` or `SimpleClusterResolver`, with this process
            as the chief.
        variable_partitioner: splits variables along dim 0 into shards
            (`ds.experimental.partitioners`); None keeps each variable whole.
        timeout_seconds: the longest any call between tasks may take (a dead
            task is noticed sooner: its calls fail at once).

    Raises:
        InvalidArgumentError: a cluster without a chief, a worker or a ps task, or
            this process is not the chief.

    Example::

        strategy = ds.ParameterServerStrategy(resolver)
        with strategy.scope():
            model = torch.nn.Linear(4, 1)                 # parameters on the ps tasks
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        coordinator = ds.coordinator.ClusterCoordinator(strategy)
        coordinator.schedule(step, args=(batch,))
        coordinator.join()
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver,
        variable_partitioner: Callable[[Sequence[int], torch.dtype], list[int]] | None = None,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        *,
        _task: _runtime.Runtime | None = None,
    ) -> None:
        self._resolver = cluster_resolver
        self._cluster = PsCluster(cluster_resolver)
        self._timeout = float(timeout_seconds)
        self._coordinator: object | None = None
        self._events: ClusterEvents | None = None  # the coordinator's
        self._closed = False
        # On a worker task (the strategy closures see), modules and variables built
        # inside a closure stay local to it: only the chief creates variables on the ps.
        on_task = _task is not None
        self._variables = ParameterServerVariables(
            self._cluster.ps, variable_partitioner, self._timeout, on_task=on_task
        )
        super().__init__(
            ReplicatedExtended(
                self,
                ["cpu"],
                captures_modules=not on_task,
                wrap_single_values=False,
                home=self._variables,
                lifecycle=self._variables,
                step_runner=StepRunner.COORDINATED,
            )
        )
        if _task is not None:
            self._runtime = _task
            _task.host = _Host(self)
            return
        if not self._cluster.has_chief:
            raise InvalidArgumentError(
                "ParameterServerStrategy (TF2 style) needs a 'chief' task in the cluster to "
                "coordinate; for every worker running its own loop without a chief, use "
                "ds.compat.v1.ParameterServerStrategy"
            )
        if cluster_resolver.task_type != "chief":
            raise InvalidArgumentError(
                f"ParameterServerStrategy is built on the chief, but this process is "
                f"{cluster_resolver.task_type!r} {cluster_resolver.task_id}; run "
                "ds.Server(resolver).join() on ps and worker tasks"
            )
        runtime = _runtime.Runtime("chief", self._timeout)
        runtime.strategy = self
        runtime.host = _Host(self)
        self._runtime = runtime
        cluster = self._cluster
        self._store = start_task(
            runtime, lambda: connect(cluster_resolver, cluster, "chief", self._timeout)
        )
        # An endpoint left open at exit aborts the interpreter; the tasks must hear.
        atexit.register(shutdown_at_exit, weakref.ref(self))
        threading.Thread(
            target=_watch_rejoins,
            args=(weakref.ref(self),),
            name="distribute-ps-rejoins",
            daemon=True,
        ).start()

    def __reduce__(self) -> Any:
        return (_task_strategy, ())

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolver of the cluster."""
        return self._resolver

    @property
    def num_replicas_in_sync(self) -> int:
        """1: each closure is one replica's step; workers do not synchronize."""
        return 1

    @property
    def coordinator(self) -> object | None:
        """The `ds.coordinator.ClusterCoordinator` attached to this strategy, if any."""
        return self._coordinator

    def attach_coordinator(self, coordinator: object, events: ClusterEvents) -> CoordinatedCluster:
        """Attaches the strategy's one `coordinator`, told about the cluster through
        `events`; called by `ds.coordinator.ClusterCoordinator` (build one of those).

        Returns:
            What the coordinator uses of the cluster.

        Raises:
            InvalidArgumentError: a coordinator is attached already, or this is
                not the chief's strategy.
        """
        if self._runtime.name != "chief":
            raise InvalidArgumentError(
                f"a ClusterCoordinator runs on the chief, and this is {self._runtime.name}'s "
                "strategy (a closure may not build one)"
            )
        if self._coordinator is not None:
            raise InvalidArgumentError(
                "this ParameterServerStrategy already has a ClusterCoordinator; use that one "
                "(there is one coordinator per strategy)"
            )
        self._coordinator, self._events = coordinator, events
        return CoordinatedCluster(
            runtime=self._runtime,
            workers=tuple(self._cluster.workers),
            ps=tuple(self._cluster.ps),
            publish=self._variables.publish,
        )

    # -- workers that come back -------------------------------------------------------

    def _admit_rejoins(self) -> None:
        """Answers the restarted tasks asking for their task (NOTE [worker
        restarts]): a dead worker is forgotten and its rank released; a live one
        means two processes claim the task, and the newcomer is refused, as is a
        restarted ps (its variables died with the old process)."""
        for task in [*self._cluster.workers, *self._cluster.ps]:
            rank = self._cluster.rank(task)
            if not self._store.check([f"rejoin/{rank}"]):
                continue
            process = self._store.get(f"rejoin/{rank}").decode()
            try:
                self._answer_rejoin(task, rank, process)
            except Exception as e:  # the newcomer hears why, instead of timing out
                logger.exception("answering %s's restarted process failed", task)
                self._store.set(f"refused/{process}", f"the chief could not take {task} back: {e}")
            finally:
                self._store.delete_key(f"rejoin/{rank}")

    def _answer_rejoin(self, task: str, rank: int, process: str) -> None:
        runtime = self._runtime
        # The old process has the whole timeout to answer (a dead one fails at once).
        if runtime.answers(task, self._timeout):
            self._store.set(
                f"refused/{process}",
                f"{task} is alive, so two processes claim it (check TF_CONFIG's task "
                "index); a restarted worker takes over once the old process is gone",
            )
            return
        if task in self._cluster.ps:
            self._store.set(
                f"refused/{process}",
                f"{task} died, and a ps task cannot rejoin a running cluster: its "
                "variables died with it. Restart the whole cluster and restore the last "
                "checkpoint",
            )
            return
        if self._events is not None:
            self._events.worker_replaced(task)
        # A joining process calls every member of rpc's list: every dead worker
        # leaves it (the coordinator finds the others dead by its own calls).
        for other in self._cluster.workers:
            if other == task or not runtime.answers(other):
                runtime.transport.forget(other)
        self._store.delete_key(f"owner/{rank}")
        logger.info("%s was restarted; it rejoins the cluster", task)

    # -- shutting down ----------------------------------------------------------------

    def shutdown(self) -> None:
        """Stops every ps and worker task (their `Server.join()` returns) and this
        chief's endpoint. Called at exit if not before."""
        if self._closed or self._runtime.name != "chief":
            return
        self._closed = True
        if self._events is not None:
            self._events.cluster_stopping()
        runtime = self._runtime
        leave_cluster(runtime, [*self._cluster.workers, *self._cluster.ps], _runtime.stop_task)
        self._store = None  # the rendezvous store's port is free again

    def __repr__(self) -> str:
        return (
            f"ParameterServerStrategy(workers={len(self._cluster.workers)}, "
            f"ps={len(self._cluster.ps)})"
        )


class _Host:
    """This task's `TaskHost` (ps/_runtime.py): what the calls of other tasks do
    here. On a worker, closures and ``dataset_fn`` run in the strategy's scope; on
    the chief, a restarted worker is handed to the coordinator."""

    def __init__(self, strategy: ParameterServerStrategy) -> None:
        self._strategy = strategy

    def run_closure(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        variables: set[int],
    ) -> Any:
        """Runs one closure on this worker with fresh values of `variables` (a
        sharded variable's shards are read when used, rows only for lookups)."""
        runtime = self._strategy._runtime
        for sharded in runtime.sharded.values():
            sharded._ds_reads.clear()  # an earlier closure's lookups without a step
        runtime.refresh_whole(variables)
        with self._strategy.scope():
            return fn(*args, **kwargs)

    def call_in_worker(self, fn: Callable[[], Any]) -> Any:
        with self._strategy.scope():
            return fn()

    def worker_rejoined(self, worker: str) -> None:
        """`worker`'s restarted process has joined: the coordinator takes it back."""
        strategy = self._strategy
        if strategy._events is not None and not strategy._closed:
            strategy._events.worker_rejoined(worker)


# NOTE [worker restarts]
# A worker's restarted process (same TF_CONFIG, `ds.Server(...).join()`) finds its
# rank held by the dead process in the rendezvous; it posts ``rejoin/<rank>`` and
# waits. The chief's watcher (below) pings the old process: alive, the newcomer is
# refused (two processes claim one task); dead, the chief forgets it in the
# transport and releases the rank. The newcomer then joins under a new transport
# name, which every task learns, and calls `worker_rejoined` on the chief; the
# coordinator rebuilds the per-worker datasets and iterators it still holds on the
# new process (iterators start over) and sends it closures again.


def _watch_rejoins(ref: weakref.ref[ParameterServerStrategy]) -> None:
    """The chief's thread answering rejoin requests, until its strategy shuts down."""
    seen = 0
    while True:
        time.sleep(_REJOIN_POLL_SECONDS)
        strategy = ref()
        if strategy is None or strategy._closed:
            return
        try:
            requests = int(strategy._store.add("rejoins", 0))
            if requests != seen:
                seen = requests
                strategy._admit_rejoins()
        except Exception:  # the store or the transport closing under a shutdown
            if strategy._closed:
                return
            logger.exception("answering a restarted worker failed")
        del strategy


_REJOIN_POLL_SECONDS = 0.5


def _task_strategy() -> ParameterServerStrategy:
    """The strategy a closure captured, on the task that unpickles it."""
    strategy = _runtime.current().strategy
    assert isinstance(strategy, ParameterServerStrategy)
    return strategy


class Server:
    """Runs a ps or worker task of a parameter-server cluster.

    A worker task that died can be started again with the same resolver: it
    rejoins the running cluster (NOTE [worker restarts]). A ps task cannot: its
    variables died with it.

    Args:
        cluster_resolver: the cluster, with this process's task (`task_type` "ps"
            or "worker", `task_id`).
        timeout_seconds: the longest one call between tasks may take while the
            task joins; the closures a worker runs take the chief's strategy's.

    Raises:
        InvalidArgumentError: the task is not a ps or worker task of the cluster.

    Example::

        ds.Server(ds.cluster_resolver.TFConfigClusterResolver()).join()
    """

    #: How often a task checks that the chief is alive while it waits.
    _PING_SECONDS = 1.0

    def __init__(
        self, cluster_resolver: ClusterResolver, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    ) -> None:
        task_type, task_id = cluster_resolver.task_type, cluster_resolver.task_id
        if task_type not in ("ps", "worker") or task_id is None:
            raise InvalidArgumentError(
                f"ds.Server runs 'ps' and 'worker' tasks, got {task_type!r} {task_id}; the "
                "chief builds ParameterServerStrategy instead"
            )
        cluster = PsCluster(cluster_resolver)
        self._name = task_name(task_type, task_id)
        if self._name not in cluster.names:
            raise InvalidArgumentError(
                f"task {task_type} {task_id} is not in the cluster {cluster.spec}"
            )
        if task_type == "worker" and not cluster.has_chief:
            raise InvalidArgumentError(
                "in a cluster without a chief (the compat.v1 style) every worker runs the "
                "training program with ds.compat.v1.ParameterServerStrategy; only ps tasks "
                "run ds.Server"
            )
        self._cluster = cluster
        runtime = _runtime.Runtime(self._name, float(timeout_seconds))
        runtime.strategy = ParameterServerStrategy(
            cluster_resolver, timeout_seconds=timeout_seconds, _task=runtime
        )
        runtime.expected_workers = set(cluster.workers)
        self._runtime = runtime
        name = self._name
        start_task(runtime, lambda: connect(cluster_resolver, cluster, name, timeout_seconds))
        if runtime.transport.restarted:  # NOTE [worker restarts]
            runtime.transport.call(
                "chief", _runtime.worker_rejoined, (name,), float(timeout_seconds)
            ).wait()

    def join(self) -> None:
        """Serves until the cluster shuts down (the chief says so; without a chief,
        every worker has finished), then returns.

        Raises:
            ConnectionError: the chief (without a chief: every unfinished worker)
                stopped answering without shutting down.
        """
        runtime = self._runtime
        misses = 0
        while not runtime.stopped.wait(self._PING_SECONDS):
            watched = (
                ["chief"]
                if self._cluster.has_chief
                else sorted(runtime.expected_workers - runtime.workers_done)
            )
            if any(runtime.answers(name) for name in watched):
                misses = 0
                continue
            misses += 1
            if misses >= 3 and not runtime.stopped.is_set():
                runtime.transport.shutdown()
                _runtime.install(None)
                raise ConnectionError(
                    f"{self._name}: {', '.join(watched)} stopped answering without shutting "
                    "the cluster down (died?); this task exits"
                )
        time.sleep(0.1)  # lets the last stop call return before the endpoint closes
        runtime.transport.shutdown()
        _runtime.install(None)
