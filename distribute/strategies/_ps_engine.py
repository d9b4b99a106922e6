"""The parameter-server strategies' shared parts: the cluster's tasks, joining it, where
variables live, and leaving it (`ParameterServerStrategy` and
`compat.v1.ParameterServerStrategy` both build on this module; neither imports the
other).

Rpc names: ``chief``, ``worker_<i>``, ``ps_<i>``; ranks: chief 0, workers 1..W, ps after.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from distribute import _marks, context
from distribute._enums import VariableAggregation, VariableSpec, VariableSynchronization
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

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "ParameterServerVariables",
    "PsCluster",
    "connect",
    "leave_cluster",
    "shutdown_at_exit",
    "start_task",
    "task_name",
]

#: How long any one call between tasks may take before it fails (seconds).
DEFAULT_TIMEOUT_SECONDS = 60.0


def task_name(task_type: str, task_id: int) -> str:
    return "chief" if task_type == "chief" else f"{task_type}_{task_id}"


class PsCluster:
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


def connect(
    resolver: ClusterResolver, cluster: PsCluster, name: str, timeout: float
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


def start_task(runtime: _runtime.Runtime, join: Callable[[], tuple[Any, Any]]) -> Any:
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
        transport, store = join()
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


class ParameterServerVariables:
    """Variables created in a parameter-server strategy's scope live on the ps tasks:
    the replicated engine's `VariableHome` and `ScopeLifecycle` under
    `ParameterServerStrategy` and `compat.v1.ParameterServerStrategy`
    (`_engine_parts.py`). Each new variable goes to a ps task (round-robin, or split
    by the partitioner into a `ShardedVariable`); the variables created since the last
    scope are published when the last scope is left.

    Args:
        ps_tasks: the ps tasks' names.
        partitioner: splits a variable along dim 0 into shards; None keeps it whole.
        timeout: the longest one call to a ps task may take (seconds).
        on_task: the strategy of a worker task's closures: nothing is created on the
            ps tasks (modules and variables built in a closure stay local to it).
        publishes: compat.v1: whether this worker sends the initial values (worker 0);
            the others wait for them at ``barrier``.
        barrier: compat.v1: the store on which workers wait for the initial values.
    """

    def __init__(
        self,
        ps_tasks: Sequence[str],
        partitioner: Callable[[Sequence[int], torch.dtype], list[int]] | None,
        timeout: float,
        *,
        on_task: bool = False,
        publishes: bool = True,
        barrier: Any = None,
    ) -> None:
        install_gradient_push()  # NOTE [hooks at first use] in strategies/_torch_hooks.py
        # Ids by creation order: every worker of the compat.v1 style builds the same
        # variables in the same order, so they agree on ids without talking.
        self._ids = itertools.count(1)
        self._publishes = publishes
        self._on_task = on_task
        self._barrier = barrier
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

    def owns(self, variable: Any) -> bool:
        """Whether ``variable`` was created in this strategy's scope (it lives on the
        strategy's ps tasks, or is sharded over them)."""
        if isinstance(variable, ShardedVariable):
            return all(self.owns(part) for part in variable.variables)
        if not isinstance(variable, ParameterServerVariable):
            return False
        return _runtime.current().variables.get(variable.handle.var_id) is variable

    def create_variable(self, value: torch.Tensor, spec: VariableSpec) -> Any:
        trainable, aggregation = spec.trainable, spec.aggregation
        if spec.is_buffer or self._on_task:
            # Buffers stay with the module on each task (README); inside a closure on
            # a worker nothing is created on the ps tasks.
            return value
        if spec.synchronization is VariableSynchronization.NONE:
            raise InvalidArgumentError(
                "`NONE` variable synchronization is not supported under "
                "ParameterServerStrategy; use AUTO or ON_WRITE"
            )
        if not spec.is_param:
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
        _marks.set_pending(sharded, value.detach().clone())  # initialized in place, then published
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

    def publish(self) -> None:
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
                    _marks.take_pending(var)  # set at creation
                for shard in var.variables if isinstance(var, ShardedVariable) else [var]:
                    _marks.mark_published(shard)  # on the ps
            self._barrier.wait([f"published/{self._rounds}"])
            return
        runtime = _runtime.current()
        futures = []
        for var in pending:
            if isinstance(var, ShardedVariable):
                whole = _marks.take_pending(var)  # set at creation; now it lives on the ps
                parts = split_rows(whole, len(var.variables))
                pairs = list(zip(var.variables, parts))
            else:
                pairs = [(var, var.detach())]
            for shard, value in pairs:
                with torch.no_grad():
                    torch.Tensor.copy_(shard.as_subclass(torch.Tensor), value)
                _marks.mark_published(shard)  # writes go on to the ps
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

    # -- the scope (`ScopeLifecycle`) ------------------------------------------------

    def scope_entered(self) -> None:
        """Nothing: variables are placed as they are created."""

    def scope_leaving(self) -> None:
        """Nothing: publishing waits until no scope is left (below)."""

    def scope_left(self) -> None:
        """Publishes what the scopes created once no scope is left (a module has
        initialized it by now)."""
        if context._top() is None:
            self.publish()

    def placed(self, variables: list[Any]) -> None:
        """Nothing: ps variables are not the engine's to place."""

    def before_run(self) -> None:
        """Nothing: compat.v1's `run` publishes and refreshes first."""

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

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


def shutdown_at_exit(ref: weakref.ref[Any]) -> None:
    """`atexit`: shuts down a strategy still alive (an open endpoint aborts the exit)."""
    strategy = ref()
    if strategy is not None:
        strategy.shutdown()
