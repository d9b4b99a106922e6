"""What each parameter-server task keeps, and the functions other tasks call on it.

# NOTE [task runtime]
rpc calls a module-level function by name in the receiving process, so what it
acts on lives in that process: the `Runtime` installed by `ds.Server` (ps and
worker tasks) or by the strategy (the chief). It is this process's one piece of
state outside the strategy/context stack, and it belongs to the task, not to a
strategy: a process is one task of one cluster.

* A **ps** task holds variables by id (`_Store`) and one optimizer per (optimizer,
  ps) with the optimizer's state, so updates are applied where the variables are.
* A **worker** task keeps the functions it was sent (by key, so a step function
  crosses the wire once), the variables they refer to (local copies, refreshed from
  the ps tasks at the start of every closure), and per-worker resources (datasets,
  iterators) by key.
* The **chief** refreshes its copies when the coordinator joins.

Example::

    runtime = install(Runtime("ps_0", timeout=60.0))
    runtime.transport = RpcTransport.start(...)
"""

from __future__ import annotations

import collections
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import cloudpickle
import torch

from distribute.errors import DistributeError, InvalidArgumentError
from distribute.ps._transport import Transport

__all__ = [
    "ClosureFailure",
    "PsUnavailableError",
    "Runtime",
    "TaskHost",
    "current",
    "install",
]


class PsUnavailableError(DistributeError, ConnectionError):
    """A ps task did not answer (it died, or its host is unreachable); training
    cannot go on without its variables.

    Example::

        try:
            coordinator.join()
        except ds.coordinator.PsUnavailableError as e:
            print(e)   # names the ps; restart the cluster, restore the last checkpoint
    """


@dataclass(frozen=True)
class ClosureFailure:
    """A closure's (or a ``dataset_fn``'s) exception as its worker sends it back.

    rpc pickles a reply with plain pickle, which cannot carry an exception whose
    class the worker got by value (one defined in the chief's ``__main__``): so
    the exception travels as cloudpickle bytes (its class by value, which the
    chief maps back to its own class), beside plain text that names it where the
    chief cannot rebuild it (NOTE [errors from workers] in coordinator/).

    Attributes:
        task: the worker that raised (``worker_1``).
        type_name: the exception's class, ``module.QualName``.
        builtins: the builtin exception classes of its MRO, nearest first.
        message: ``str()`` of the exception.
        text: the traceback on the worker.
        blob: the exception pickled by cloudpickle; None where it cannot be.
        unsent: why it could not be pickled ("" where it was).
    """

    task: str
    type_name: str
    builtins: tuple[str, ...]
    message: str
    text: str
    blob: bytes | None
    unsent: str = ""


class TaskHost(Protocol):
    """What a task's strategy does for the functions other tasks call on it.

    The strategy installs one in its task's `Runtime` (``runtime.host``): the
    chief's takes restarted workers back, a worker's runs closures and builds
    per-worker data in its scope.
    """

    def run_closure(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        variables: set[int],
    ) -> Any:
        """Runs one closure with fresh values of `variables` (their ids)."""
        ...

    def call_in_worker(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (a ``dataset_fn``) in the worker's strategy scope."""
        ...

    def worker_rejoined(self, worker: str) -> None:
        """On the chief: `worker`'s restarted process joined the cluster."""
        ...


@dataclass
class _Store:
    """A ps task's variables and optimizers."""

    variables: dict[int, torch.Tensor] = field(default_factory=dict)
    optimizers: dict[tuple[Any, ...], torch.optim.Optimizer] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Failed:
    """The transport of a runtime whose connection failed: every call fails at once."""

    name = "failed"

    def __init__(self, reason: str) -> None:
        self._reason = reason

    def call(self, task: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
        raise PsUnavailableError(f"this task never connected to the cluster: {self._reason}")

    restarted = False

    def forget(self, task: str) -> None:
        pass

    def quiesce(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class _NotConnected:
    """The transport of a runtime that is installed but not yet connected."""

    name = "unconnected"

    def call(self, task: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
        raise PsUnavailableError(f"this task is not connected to the cluster yet (calling {task})")

    restarted = False

    def forget(self, task: str) -> None:
        pass

    def quiesce(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class Runtime:
    """One task's parameter-server state (NOTE [task runtime]).

    Installed before the task connects, so that calls arriving as soon as the
    transport is up find it.

    Args:
        name: the task's name (``chief``, ``worker_<i>``, ``ps_<i>``).
        timeout: the longest one call between tasks may take (seconds).
        writes_through_outside_run: a compat.v1 worker: an in-place write of a
            variable's local copy outside `run` (a restore) goes on to its ps.
    """

    def __init__(
        self, name: str, timeout: float, *, writes_through_outside_run: bool = False
    ) -> None:
        self.name = name
        self._writes_through_outside_run = writes_through_outside_run
        self._transport: Transport = _NotConnected()
        self._connected = threading.Event()
        self.timeout = timeout
        self.store = _Store()
        self.functions: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.resources: dict[str, Any] = {}
        self.variables: dict[int, torch.Tensor] = {}  # local copies, by id
        self.locations: dict[int, str] = {}  # the ps task of each variable
        # Sharded variables known here, by their shards' ids: their shards are read
        # when used (rows only for a lookup), never by a refresh.
        self.sharded: dict[tuple[int, ...], Any] = {}
        self.shard_ids: set[int] = set()
        self.stopped = threading.Event()
        self.workers_done: set[str] = set()  # compat.v1: workers that finished
        self.expected_workers: set[str] = set()
        self.strategy: Any = None  # the strategy closures see on a worker
        self.host: TaskHost | None = None  # what other tasks' calls act on here

    @property
    def transport(self) -> Transport:
        """The task's transport; a call that arrives while the task is still
        connecting (its endpoint serves before the connection returns) waits for it."""
        if not self._connected.is_set():
            self._connected.wait(self.timeout)
        return self._transport

    @transport.setter
    def transport(self, transport: Transport) -> None:
        self._transport = transport
        self._connected.set()

    def writes_through(self) -> bool:
        """Whether an in-place write of a variable's local copy here goes on to its
        ps: on the chief, and on a compat.v1 worker outside `run`; not inside a
        closure or a replica (their writes go through `assign*` and the optimizer)."""
        from distribute import context

        if self.name == "chief":
            return True
        return self._writes_through_outside_run and context.get_replica_context() is None

    def answers(self, task: str, timeout: float = 5.0) -> bool:
        """Whether `task` answers a ping within `timeout` seconds."""
        try:
            self.transport.call(task, worker_ping, (), timeout).wait()
            return True
        except Exception:
            return False

    # -- talking to ps tasks --------------------------------------------------------

    def ps_call(self, task: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Calls `fn` on ps `task` and waits; a dead ps becomes `PsUnavailableError`."""
        try:
            return self.transport.call(task, fn, args, self.timeout).wait()
        except RuntimeError as e:
            if _is_remote_user_error(e):
                raise
            raise self.unavailable(task, e) from None

    def unavailable(self, task: str, error: BaseException) -> PsUnavailableError:
        """The error for ps `task` not answering this task's call."""
        return PsUnavailableError(
            f"parameter server {task} did not answer {self.name} ({_first_line(error)}; calls "
            f"time out after {self.timeout:.0f} s); the cluster cannot go on without it: "
            "restart the cluster and restore from the last checkpoint"
        )

    def add_sharded(self, key: tuple[int, ...], variable: Any) -> None:
        """Records a sharded variable (``key``: its shards' ids)."""
        self.sharded[key] = variable
        self.shard_ids.update(key)

    def refresh(self, ids: Iterable[int]) -> None:
        """Reads the current values of variables `ids` into the local copies, one
        request per ps task."""
        by_task: dict[str, list[int]] = {}
        for var_id in ids:
            by_task.setdefault(self.locations[var_id], []).append(var_id)
        futures = [
            (ids_, self.transport.call(task, ps_read, (ids_,), self.timeout))
            for task, ids_ in by_task.items()
        ]
        for (ids_, future), task in zip(futures, by_task):
            try:
                values = future.wait()
            except RuntimeError as e:
                raise self.unavailable(task, e) from None
            with torch.no_grad():
                for var_id, value in zip(ids_, values):
                    local = self.variables.get(var_id)
                    if local is not None:
                        torch.Tensor.copy_(local.as_subclass(torch.Tensor), value)

    def refresh_whole(self, ids: Iterable[int] | None = None) -> None:
        """`refresh` of `ids` (default: every variable here) but the shards."""
        ids = self.variables if ids is None else ids
        self.refresh(sorted(i for i in ids if i not in self.shard_ids))


_current: Runtime | None = None


def install(runtime: Runtime | None) -> Runtime | None:
    """Makes `runtime` this process's (None removes it)."""
    global _current
    _current = runtime
    return runtime


def current() -> Runtime:
    """This process's runtime.

    Raises:
        InvalidArgumentError: this process is not a task of a parameter-server cluster.
    """
    if _current is None:
        raise InvalidArgumentError(
            "this process is not a task of a parameter-server cluster: build the "
            "ParameterServerStrategy on the chief, and run ds.Server(resolver).join() "
            "on the ps and worker tasks"
        )
    return _current


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def _is_remote_user_error(e: RuntimeError) -> bool:
    """rpc re-raises a remote function's exception as its type; transport failures
    are bare RuntimeErrors naming the transport."""
    text = str(e)
    return not any(
        marker in text
        for marker in (
            "eof",
            "ECONNREFUSED",
            "ECONNRESET",
            "connection",
            "timed out",
            "timeout",
            "Timeout",
            "RPC ran for more than",
        )
    )


# -- functions run on ps tasks ---------------------------------------------------------------


def ps_create(var_id: int, value: torch.Tensor) -> None:
    store = current().store
    with store.lock:
        store.variables[var_id] = value.clone()


def ps_read(ids: list[int]) -> list[torch.Tensor]:
    store = current().store
    with store.lock:
        return [store.variables[i].clone() for i in ids]


def ps_read_rows(var_id: int, rows: torch.Tensor) -> torch.Tensor:
    store = current().store
    with store.lock:
        return store.variables[var_id].index_select(0, rows)


def ps_write(var_id: int, kind: str, value: torch.Tensor) -> torch.Tensor:
    """``assign`` / ``assign_add`` / ``assign_sub`` of one variable; returns its value."""
    store = current().store
    with store.lock, torch.no_grad():
        var = store.variables[var_id]
        if kind == "assign":
            var.copy_(value)
        elif kind == "assign_add":
            var.add_(value.to(var.dtype))
        else:
            var.sub_(value.to(var.dtype))
        return var.clone()


def ps_apply(
    key: tuple[Any, ...],
    optimizer_cls: type[torch.optim.Optimizer],
    groups: list[dict[str, Any]],
    dense: dict[int, torch.Tensor],
    sparse: dict[int, tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Applies one optimizer step to this ps's variables of an optimizer.

    ``groups`` are the optimizer's param groups with variable ids for params (this
    ps's only) and the current hyperparameters; ``dense`` maps an id to its
    gradient, ``sparse`` to (rows, row gradients), summed into a dense gradient of
    the shard here so that only the rows crossed the wire.
    """
    store = current().store
    with store.lock:
        optimizer = _ps_optimizer(store, key, optimizer_cls, groups)
        for group, sent in zip(optimizer.param_groups, groups):
            group.update({k: v for k, v in sent.items() if k != "params"})
        for var_id, var in ((i, store.variables[i]) for g in groups for i in g["params"]):
            if var_id in dense:
                var.grad = dense[var_id].to(var.dtype)
            elif var_id in sparse:
                rows, values = sparse[var_id]
                var.grad = torch.zeros_like(var).index_add_(0, rows, values.to(var.dtype))
            else:
                var.grad = None
        optimizer.step()
        for g in optimizer.param_groups:
            for p in g["params"]:
                p.grad = None


def _ps_optimizer(
    store: _Store,
    key: tuple[Any, ...],
    optimizer_cls: type[torch.optim.Optimizer],
    groups: list[dict[str, Any]],
) -> torch.optim.Optimizer:
    """The ps's optimizer `key` over its variables of ``groups`` (made at first use)."""
    optimizer = store.optimizers.get(key)
    if optimizer is None:
        params = [{**g, "params": [store.variables[i] for i in g["params"]]} for g in groups]
        optimizer = optimizer_cls(params)  # type: ignore[call-arg]  # subclasses take params first
        store.optimizers[key] = optimizer
    return optimizer


def ps_optimizer_state(key: tuple[Any, ...]) -> dict[int, dict[str, Any]]:
    """The state (momentum, Adam's moments, step) of this ps's optimizer `key`, by
    variable id; empty before its first step."""
    store = current().store
    with store.lock:
        optimizer = store.optimizers.get(key)
        if optimizer is None:
            return {}
        ids = {id(v): i for i, v in store.variables.items()}
        return {
            ids[id(param)]: {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()
            }
            for param, state in optimizer.state.items()
        }


def ps_load_optimizer_state(
    key: tuple[Any, ...],
    optimizer_cls: type[torch.optim.Optimizer],
    groups: list[dict[str, Any]],
    state: dict[int, dict[str, Any]],
) -> None:
    """Replaces the state of this ps's optimizer `key` (made if it is not yet)."""
    store = current().store
    with store.lock:
        optimizer = _ps_optimizer(store, key, optimizer_cls, groups)
        for group, sent in zip(optimizer.param_groups, groups):
            group.update({k: v for k, v in sent.items() if k != "params"})
        optimizer.state.clear()
        for var_id, entry in state.items():
            var = store.variables[var_id]
            optimizer.state[var] = {k: _like(var, k, v) for k, v in entry.items()}


def _like(var: torch.Tensor, name: str, value: Any) -> Any:
    """A saved optimizer state value as the ps variable `var` needs it: floating
    tensors in its dtype (``step`` stays as saved), as torch's `load_state_dict`
    casts them."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and name != "step":
        return value.to(dtype=var.dtype, device=var.device)
    return value


# -- functions run on worker tasks -----------------------------------------------------------


_loading = threading.local()


def note_variable(var_id: int) -> None:
    """Records that the object being unpickled refers to variable `var_id`."""
    seen = getattr(_loading, "seen", None)
    if seen is not None:
        seen.add(var_id)


def _load(blob: bytes) -> tuple[Any, set[int]]:
    """Unpickles `blob`; returns it and the variables it refers to."""
    seen: set[int] = set()
    _loading.seen = seen
    try:
        return cloudpickle.loads(blob), seen
    finally:
        _loading.seen = None


def worker_run(key: str, blob: bytes | None, args_blob: bytes, timeout: float) -> Any:
    """Runs closure `key` (its function sent once, as `blob`) on this worker, with
    fresh values of the variables the function and its arguments refer to.

    ``timeout`` is the chief's strategy's: this worker's calls to the ps tasks
    take it from then on (its own `Server` timeout only bounded joining).

    Returns the closure's result pickled, or a `ClosureFailure` (the coordinator
    raises it): a failed call means a lost worker, never the user's error.
    """
    runtime = current()
    runtime.timeout = timeout
    try:
        cached = runtime.functions.get(key)
        if cached is None:
            if blob is None:
                raise InvalidArgumentError(f"worker {runtime.name} was never sent function {key}")
            cached = runtime.functions[key] = _load(blob)
            while len(runtime.functions) > _FUNCTIONS_KEPT:
                runtime.functions.popitem(last=False)
        else:
            runtime.functions.move_to_end(key)
        fn, fn_vars = cached
        (args, kwargs), arg_vars = _load(args_blob)
        result = _host(runtime).run_closure(fn, args, kwargs, fn_vars | arg_vars)
        try:
            return cloudpickle.dumps(result)
        except Exception as e:
            raise InvalidArgumentError(
                f"the closure's result ({type(result).__name__}) cannot be sent back to the "
                f"chief: {e}; return tensors, numbers or other picklable values"
            ) from e
    except BaseException as e:
        return failure(runtime.name, e)


#: Step functions a worker keeps, most recently used first.
_FUNCTIONS_KEPT = 64


def _host(runtime: Runtime) -> TaskHost:
    if runtime.host is None:
        raise InvalidArgumentError(
            f"{runtime.name} has no strategy to run closures in: start it with "
            "ds.Server(resolver).join()"
        )
    return runtime.host


def failure(task: str, error: BaseException) -> ClosureFailure:
    """`error` (raised on `task`) as its worker sends it back: by value where
    cloudpickle can pickle it, with its name, message and traceback always."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        blob: bytes | None = cloudpickle.dumps(error)
        unsent = ""
    except Exception as e:  # an attribute that cannot be pickled (a lock, a file)
        blob, unsent = None, f"{type(e).__name__}: {e}"
    cls = type(error)
    return ClosureFailure(
        task=task,
        type_name=f"{cls.__module__}.{cls.__qualname__}",
        builtins=tuple(c.__name__ for c in cls.__mro__ if c.__module__ == "builtins"),
        message=str(error),
        text=text,
        blob=blob,
        unsent=unsent,
    )


def worker_make_resource(key: str, blob: bytes, source: str | None) -> ClosureFailure | None:
    """Builds a per-worker resource: ``fn()`` (a dataset), or ``iter()`` of another.

    Returns the user's error as a `ClosureFailure` (never raises it), so that a
    failed call means a lost worker.
    """
    runtime = current()
    try:
        if source is None:
            runtime.resources[key] = _host(runtime).call_in_worker(cloudpickle.loads(blob))
        else:
            runtime.resources[key] = iter(runtime.resources[source])
    except BaseException as e:
        return failure(runtime.name, e)
    return None


def worker_free_resources(keys: list[str]) -> None:
    """Forgets per-worker objects the chief no longer holds."""
    resources = current().resources
    for key in keys:
        resources.pop(key, None)


def worker_ping() -> str:
    return current().name


def worker_rejoined(worker: str) -> None:
    """On the chief: `worker`'s restarted process has joined (NOTE [worker restarts]);
    it is taken back in a thread of its own (that sends calls and waits for them)."""
    host = _host(current())
    threading.Thread(
        target=host.worker_rejoined, args=(worker,), name="distribute-ps-readmit", daemon=True
    ).start()


def ps_worker_done(worker: str) -> None:
    """A worker of the compat.v1 style finished; the ps stops when all have."""
    runtime = current()
    runtime.workers_done.add(worker)
    if runtime.expected_workers <= runtime.workers_done:
        runtime.stopped.set()


def worker_index(name: str) -> int:
    """The index of worker task `name` (``worker_<i>``)."""
    prefix = "worker_"
    if not name.startswith(prefix):
        raise InvalidArgumentError(
            f"{name} is not a worker task; per-worker data is built on workers"
        )
    return int(name[len(prefix) :])


def quiesce_task() -> None:
    """First phase of a cluster's shutdown (NOTE [quiet shutdown] in _transport)."""
    current().transport.quiesce()


def stop_task() -> None:
    """Ends a ps or worker task's `Server.join()` (the cluster is shutting down)."""
    current().stopped.set()
