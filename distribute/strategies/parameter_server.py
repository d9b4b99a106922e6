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
import contextlib
import itertools
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from distribute import context
from distribute._enums import VariableAggregation, VariableSynchronization
from distribute.cluster_resolver.base import ClusterResolver
from distribute.cluster_resolver.cluster_spec import split_host_port
from distribute.collectives._rendezvous import rendezvous
from distribute.errors import InvalidArgumentError
from distribute.ps import _runtime
from distribute.ps._transport import RpcTransport
from distribute.ps._variables import (
    ParameterServerVariable,
    ShardedVariable,
    VarHandle,
    install_gradient_push,
    split_rows,
)
from distribute.strategies._replicated import ReplicatedExtended
from distribute.strategies.base import Strategy

__all__ = ["ParameterServerStrategy", "Server"]

logger = logging.getLogger(__name__)

#: How long any one call between tasks may take before it fails (seconds).
DEFAULT_TIMEOUT_SECONDS = 60.0


def task_name(task_type: str, task_id: int) -> str:
    return "chief" if task_type == "chief" else f"{task_type}_{task_id}"


class _Cluster:
    """The parameter-server view of a cluster spec: tasks, rpc names and ranks.

    With a ``chief`` (TF2 style) the chief coordinates and serves the rendezvous;
    without one (the compat.v1 between-graph style) every worker runs the program
    and worker 0 serves it.
    """

    def __init__(self, resolver: ClusterResolver) -> None:
        spec = resolver.cluster_spec().as_dict()
        self.spec = spec
        workers = list(spec.get("worker", []))
        ps = list(spec.get("ps", []))
        chief = list(spec.get("chief", []))
        if not workers or not ps or len(chief) > 1:
            raise InvalidArgumentError(
                f"a parameter-server cluster needs at least one 'worker' and one 'ps' task "
                f"(and at most one 'chief'), got chief={len(chief)}, worker={len(workers)}, "
                f"ps={len(ps)} in {spec}"
            )
        self.has_chief = bool(chief)
        self.workers = [task_name("worker", i) for i in range(len(workers))]
        self.ps = [task_name("ps", i) for i in range(len(ps))]
        self.names = [*(["chief"] if chief else []), *self.workers, *self.ps]
        self.addresses = dict(zip(self.names, [*chief, *workers, *ps]))
        first = chief[0] if chief else workers[0]
        self.host, self.port = split_host_port(str(first), where=f"the address of {self.names[0]}")
        self.fingerprint = json.dumps({k: spec[k] for k in sorted(spec)}, sort_keys=True)

    def rank(self, name: str) -> int:
        return self.names.index(name)


def _connect(
    resolver: ClusterResolver, cluster: _Cluster, name: str, timeout: float
) -> tuple[RpcTransport, Any]:
    store = rendezvous(
        cluster.rank(name),
        len(cluster.names),
        cluster.host,
        cluster.port,
        timeout,
        cluster=cluster.fingerprint,
        prefix="ps/",
        # a worker's restarted process takes its place (the chief finds the old
        # dead); a ps's is told why it cannot
        rejoin=cluster.has_chief and name != "chief",
    )
    host, _ = split_host_port(str(cluster.addresses[name]), where=f"the address of {name}")
    transport = RpcTransport.start(
        name,
        host=host,
        rank=cluster.rank(name),
        world_size=len(cluster.names),
        store=store,
        timeout_seconds=timeout,
    )
    return transport, store


def start_task(runtime: _runtime.Runtime, connect: Callable[[], tuple[Any, Any]]) -> Any:
    """Installs `runtime` as this process's task and connects it; returns the store.

    Raises:
        InvalidArgumentError: this process already is a task of a running cluster.
    """
    try:
        running: _runtime.Runtime | None = _runtime.current()
    except InvalidArgumentError:
        running = None
    if running is not None:
        raise InvalidArgumentError(
            f"this process already is task {running.name} of a parameter-server cluster; "
            "one process is one task: call shutdown() on its strategy (or let its Server "
            "return) before starting another"
        )
    _warm_up_optimizers()
    _runtime.install(runtime)
    try:
        transport, store = connect()
    except BaseException as e:
        runtime.transport = _runtime._Failed(str(e))  # nothing waits for it any more
        _runtime.install(None)
        raise
    runtime.transport = transport
    return store


def _warm_up_optimizers() -> None:
    """Pays, as the task starts, for what the first torch optimizer of a process
    imports (torch._dynamo: a second, several on a busy machine). Paid in a worker's
    first closure, it made that step's gradient arrive after every other worker's
    steps of a short run, so a gradient of the initial weights was the last update
    applied; paid in a ps's first update, it held the ps's lock."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0).zero_grad()


class _ParameterServerExtended(ReplicatedExtended):
    """Contexts of one replica per task (closures run on one worker each); variables
    created in scope go to ps tasks."""

    def __init__(
        self,
        container_strategy: Strategy,
        ps_tasks: Sequence[str],
        partitioner: Callable[[Sequence[int], torch.dtype], list[int]] | None,
        timeout: float,
        devices: Sequence[str] = ("cpu",),
    ) -> None:
        super().__init__(container_strategy, list(devices), wrap_single_values=False)
        install_gradient_push()  # NOTE [hooks at first use] in strategies/_torch_hooks.py
        # Ids by creation order: every worker of the compat.v1 style builds the same
        # variables in the same order, so they agree on ids without talking.
        self._ids = itertools.count(1)
        # compat.v1: one worker publishes initial values, the others wait for them.
        self._publishes = True
        self._on_task = False  # the strategy of a worker task's closures
        self._barrier: Any = None
        self._rounds = 0
        self._ps_tasks = list(ps_tasks)
        self._partitioner = partitioner
        self._timeout = timeout
        self._next_ps = 0
        self._colocate: str | None = None
        self._pending: list[ParameterServerVariable | ShardedVariable] = []
        self._ps_lock = threading.Lock()

    @property
    def parameter_devices(self) -> tuple[torch.device, ...]:
        return (torch.device("cpu"),)

    def _place(self) -> str:
        if self._colocate is not None:
            return self._colocate
        task = self._ps_tasks[self._next_ps % len(self._ps_tasks)]
        self._next_ps += 1
        return task

    def _create_variable(
        self,
        value: torch.Tensor,
        *,
        trainable: bool,
        synchronization: VariableSynchronization,
        aggregation: VariableAggregation,
        is_param: bool = False,
        is_buffer: bool = False,
        deferred: bool = False,
    ) -> Any:
        if is_buffer or self._on_task:
            # Buffers stay with the module on each task (README); inside a closure on
            # a worker nothing is created on the ps tasks.
            return value
        if synchronization is VariableSynchronization.NONE:
            raise InvalidArgumentError(
                "`NONE` variable synchronization is not supported under "
                "ParameterServerStrategy; use AUTO or ON_WRITE"
            )
        if not is_param:
            trainable = trainable and (value.is_floating_point() or value.is_complex())
        runtime = _runtime.current()
        shards = (
            self._partitioner(tuple(value.shape), value.dtype)
            if self._partitioner is not None and value.dim() > 0 and self._colocate is None
            else []
        )
        count = shards[0] if shards else 1
        if count <= 1:
            handle = self._handle(value, trainable, aggregation)
            var = ParameterServerVariable._make(value, handle)
            self._register(runtime, var)
            self._pending.append(var)
            return var
        parts = [
            ParameterServerVariable._make(part, self._handle(part, trainable, aggregation))
            for part in split_rows(value.detach(), count)
        ]
        for part in parts:
            self._register(runtime, part)
        sharded = ShardedVariable(parts)
        runtime.add_sharded(tuple(p.handle.var_id for p in parts), sharded)
        sharded._ds_pending = value.detach().clone()  # type: ignore[attr-defined]  # initialized in place before it is published
        self._pending.append(sharded)
        return sharded

    def _handle(
        self, value: torch.Tensor, trainable: bool, aggregation: VariableAggregation
    ) -> VarHandle:
        return VarHandle(
            next(self._ids), self._place(), tuple(value.shape), value.dtype, trainable, aggregation
        )

    @staticmethod
    def _register(runtime: _runtime.Runtime, var: ParameterServerVariable) -> None:
        runtime.variables[var.handle.var_id] = var
        runtime.locations[var.handle.var_id] = var.handle.task

    def _publish(self) -> None:
        """Sends the variables created since the last call to their ps tasks, with
        their values now (a module initializes its parameters after creating them)."""
        with self._ps_lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        self._rounds += 1
        if not self._publishes:
            for var in pending:  # worker 0 sends the initial values; they arrive there
                if isinstance(var, ShardedVariable):
                    del var._ds_pending  # type: ignore[attr-defined]  # set at creation
                for shard in var.variables if isinstance(var, ShardedVariable) else [var]:
                    shard._ds_published = True  # type: ignore[attr-defined]  # on the ps
            self._barrier.wait([f"published/{self._rounds}"])
            return
        runtime = _runtime.current()
        futures = []
        for var in pending:
            if isinstance(var, ShardedVariable):
                whole = var._ds_pending  # type: ignore[attr-defined]  # set at creation
                del var._ds_pending  # type: ignore[attr-defined]  # now it lives on the ps
                parts = split_rows(whole, len(var.variables))
                pairs = list(zip(var.variables, parts))
            else:
                pairs = [(var, var.detach())]
            for shard, value in pairs:
                with torch.no_grad():
                    torch.Tensor.copy_(shard.as_subclass(torch.Tensor), value)
                shard._ds_published = True  # type: ignore[attr-defined]  # writes go on to the ps
                futures.append(
                    runtime.transport.call(
                        shard.handle.task,
                        _runtime.ps_create,
                        (shard.handle.var_id, value.detach().as_subclass(torch.Tensor).clone()),
                        self._timeout,
                    )
                )
        for future in futures:
            future.wait()
        if self._barrier is not None:
            self._barrier.set(f"published/{self._rounds}", "1")

    def _exit_scope(self) -> None:
        super()._exit_scope()
        if context._top() is None:
            self._publish()

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """New variables go to the ps task of `colocate_with_variable` (not sharded)."""
        var = colocate_with_variable
        if isinstance(var, ShardedVariable):
            var = var.variables[0]
        if not isinstance(var, ParameterServerVariable):
            raise InvalidArgumentError(
                f"colocate_vars_with expects a variable of this strategy, got {type(var).__name__}"
            )
        previous, self._colocate = self._colocate, var.handle.task
        try:
            yield
        finally:
            self._colocate = previous


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
        self._cluster = _Cluster(cluster_resolver)
        self._timeout = float(timeout_seconds)
        self._coordinator: Any = None
        self._closed = False
        extended = _ParameterServerExtended(
            self, self._cluster.ps, variable_partitioner, self._timeout
        )
        super().__init__(extended)
        if _task is not None:  # the strategy closures see on a worker task
            # Modules and variables built inside a closure stay local to it: only the
            # chief creates variables on the ps tasks.
            extended._captures_modules = False
            extended._on_task = True
            self._runtime = _task
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
        self._runtime = runtime
        cluster = self._cluster
        self._store = start_task(
            runtime, lambda: _connect(cluster_resolver, cluster, "chief", self._timeout)
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

    def _publish(self) -> None:
        ext = self.extended
        assert isinstance(ext, _ParameterServerExtended)
        ext._publish()

    # -- on a worker task -----------------------------------------------------------

    def _call_in_worker(self, fn: Callable[[], Any]) -> Any:
        with self.scope():
            return fn()

    def _run_closure(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        variables: set[int],
    ) -> Any:
        """Runs one closure on this worker with fresh values of `variables` (a
        sharded variable's shards are read when used, rows only for lookups)."""
        runtime = self._runtime
        for sharded in runtime.sharded.values():
            sharded._ds_reads.clear()  # an earlier closure's lookups without a step
        runtime.refresh_whole(variables)
        with self.scope():
            return fn(*args, **kwargs)

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
        if self._coordinator is not None:
            self._coordinator._replaced(task)
        # A joining process calls every member of rpc's list: every dead worker
        # leaves it (the coordinator finds the others dead by its own calls).
        for other in self._cluster.workers:
            if other == task or not runtime.answers(other):
                runtime.transport.forget(other)
        self._store.delete_key(f"owner/{rank}")
        logger.info("%s was restarted; it rejoins the cluster", task)

    def _worker_rejoined(self, worker: str) -> None:
        """`worker`'s restarted process has joined: the coordinator takes it back."""
        if self._coordinator is not None and not self._closed:
            self._coordinator._readmit(worker)

    # -- shutting down ----------------------------------------------------------------

    def shutdown(self) -> None:
        """Stops every ps and worker task (their `Server.join()` returns) and this
        chief's endpoint. Called at exit if not before."""
        if self._closed or self._runtime.name != "chief":
            return
        self._closed = True
        if self._coordinator is not None:
            self._coordinator._stop()
        runtime = self._runtime
        leave_cluster(runtime, [*self._cluster.workers, *self._cluster.ps], _runtime.stop_task)
        self._store = None  # the rendezvous store's port is free again

    def __repr__(self) -> str:
        return (
            f"ParameterServerStrategy(workers={len(self._cluster.workers)}, "
            f"ps={len(self._cluster.ps)})"
        )


def leave_cluster(
    runtime: _runtime.Runtime, tasks: Sequence[str], tell: Callable[..., None], *args: Any
) -> None:
    """Tells `tasks` (``tell(*args)`` on each, 5 s at most, a dead one skipped), then
    closes this task's endpoint. Every task is quiesced first, this one last, so that
    no live task reports the others' connections closing (NOTE [quiet shutdown] in
    ps/_transport.py)."""

    def call_all(fn: Callable[..., None], fn_args: tuple[Any, ...]) -> None:
        futures = []
        for name in tasks:
            with contextlib.suppress(Exception):
                futures.append(runtime.transport.call(name, fn, fn_args, 5.0))
        for future in futures:
            with contextlib.suppress(Exception):
                future.wait()

    call_all(_runtime.quiesce_task, ())
    with contextlib.suppress(Exception):
        runtime.transport.quiesce()
    call_all(tell, args)
    runtime.transport.shutdown()
    _runtime.install(None)


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


def shutdown_at_exit(ref: weakref.ref[Any]) -> None:
    """`atexit`: shuts down a strategy still alive (an open endpoint aborts the exit)."""
    strategy = ref()
    if strategy is not None:
        strategy.shutdown()


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
        cluster = _Cluster(cluster_resolver)
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
        start_task(runtime, lambda: _connect(cluster_resolver, cluster, name, timeout_seconds))
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
