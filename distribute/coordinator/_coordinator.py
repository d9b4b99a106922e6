"""`ClusterCoordinator`: schedules closures onto idle workers, at least once each.

# NOTE [scheduling]
Closures wait in one queue; whenever a closure is scheduled or a worker finishes
one, queued closures are sent to idle workers (the function once per worker, by
key; the arguments each time, with any `PerWorkerValues` replaced by that worker's
element). Sending happens in the thread that schedules, and a result is handled
in the transport's thread that receives it, so no thread sits between a closure
and its worker.

* A closure that raises: its `RemoteValue` holds the error (rebuilt on the
  chief, NOTE [errors from workers] in `_failures.py`); the error is raised by the
  next `schedule`, `join` or `done`, and every queued closure is cancelled. It is
  raised once: closures scheduled before it was raised and still running then
  keep their own errors in their `RemoteValue`s, so the next call starts clean.
* A worker is lost when its connection closed (the transport notices a dead peer
  at once) or it does not answer a ping within the strategy's timeout after a
  call failed; the loss is logged with the worker's name and the cause. It is
  dropped and its closure goes back to the front of the queue: another worker
  runs it (at-least-once). A user's error never drops a worker. Restarted, it
  rejoins (NOTE [worker restarts] in strategies/parameter_server.py): the
  per-worker datasets and iterators still held are rebuilt on it, and it gets
  closures again. With no worker left, the queue waits the strategy's timeout
  for one to come back, then fails.
* A ps that does not answer fails the closure with `PsUnavailableError`, which
  stops the queue: training cannot go on without its variables. A dead ps fails
  the worker's call to it at once; a stopped one (its connections open) is found
  when the closure's call times out with its worker alive: the chief pings the ps
  tasks and names the one that does not answer. Workers take the chief's
  timeout with each closure, so every message names the strategy's.
* Every wait is bounded: a closure by the strategy's timeout (then its worker is
  pinged, and lost if it does not answer), `RemoteValue.fetch` by the closures'
  fate.

Example::

    coordinator = ds.coordinator.ClusterCoordinator(strategy)
    values = [coordinator.schedule(step, args=(it,)) for _ in range(10)]
    coordinator.join()
    print(coordinator.fetch(values))
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle

from distribute import values as nest
from distribute.coordinator._failures import (
    ClosureCancelledError,
    RemoteError,
    WorkerLostError,
    rebuilt,
)
from distribute.coordinator._values import (
    PerWorkerDataset,
    PerWorkerIterators,
    PerWorkerValues,
    RemoteValue,
    Resource,
    WithInputContext,
    takes_one_argument,
)
from distribute.errors import InvalidArgumentError, WorkerError
from distribute.ps import _runtime

__all__ = [
    "ClosureCancelledError",
    "ClusterCoordinator",
    "PerWorkerValues",
    "RemoteError",
    "RemoteValue",
    "WorkerLostError",
]

logger = logging.getLogger(__name__)


@dataclass
class _Closure:
    key: str
    blob: bytes
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: RemoteValue
    # How many errors the coordinator had raised when this closure was scheduled:
    # its error is the coordinator's only if none was raised since (NOTE [scheduling]).
    raised: int = 0
    # The pickled arguments, the same for every worker (None: they hold
    # `PerWorkerValues`, pickled for each worker as it is sent).
    args_blob: bytes | None = None


class ClusterCoordinator:
    """Schedules functions onto a `ParameterServerStrategy`'s workers.

    One per strategy. Functions and their arguments are shipped with cloudpickle:
    a function refers to variables and modules built in the strategy's scope, and
    to per-worker datasets, and they resolve on the worker.

    Args:
        strategy: a `ParameterServerStrategy`.

    Raises:
        InvalidArgumentError: not a `ParameterServerStrategy`, or it already has a
            coordinator.

    Example::

        coordinator = ds.coordinator.ClusterCoordinator(strategy)
        result = coordinator.schedule(step_fn, args=(per_worker_iterator,))
        coordinator.join()
        result.fetch()
    """

    def __init__(self, strategy: Any) -> None:
        from distribute.strategies.parameter_server import ParameterServerStrategy

        if not isinstance(strategy, ParameterServerStrategy):
            raise InvalidArgumentError(
                f"ClusterCoordinator needs a ParameterServerStrategy, got {type(strategy).__name__}"
            )
        cluster = strategy.attach_coordinator(self, _Events(self))
        self._strategy = strategy
        self._runtime = cluster.runtime
        self._publish = cluster.publish
        self._ps = cluster.ps
        self._workers = list(cluster.workers)
        self._alive = set(self._workers)
        self._queue: collections.deque[_Closure] = collections.deque()
        self._cond = threading.Condition()
        self._inflight = 0
        self._error: BaseException | None = None
        self._raised = 0  # errors raised so far (NOTE [scheduling])
        self._stopping = False
        self._sent: dict[str, set[str]] = {w: set() for w in self._workers}
        self._idle = list(self._workers)
        self._forgotten: list[str] = []  # per-worker objects to free (list ops are atomic)
        # How to rebuild each per-worker object the chief holds, in creation order:
        # key -> (pickled dataset_fn, None) or (None, the dataset's key).
        self._resources: dict[str, tuple[bytes | None, str | None]] = {}
        self._resources_lock = threading.Lock()  # creation vs. a rejoining worker
        self._all_lost: threading.Timer | None = None
        # Bumped when a worker's process is replaced: a call to the old process
        # that ends later is stale, and says nothing about the new one.
        self._generation = dict.fromkeys(self._workers, 0)

    # -- the public surface ---------------------------------------------------------

    def schedule(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> RemoteValue:
        """Queues `fn(*args, **kwargs)` to run on an idle worker; returns at once.

        Raises:
            Exception: the first error of an earlier closure, whatever its type (the
                queue was cancelled).
            InvalidArgumentError: a `RemoteValue` among the arguments (fetch it first),
                or an argument that cannot be sent (pickled) to the workers.
        """
        if self._stopping:
            raise InvalidArgumentError(
                "schedule() after the strategy was shut down; build a new cluster to go on"
            )
        self._raise_error()
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        leaves = nest.flatten((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, RemoteValue):
                raise InvalidArgumentError(
                    "a RemoteValue was passed to schedule(); pass its fetched value "
                    "(coordinator.fetch(value)) instead"
                )
        self._publish()
        self._free_forgotten()
        key, blob = self._function_key(fn)
        per_worker = any(isinstance(leaf, PerWorkerValues) for leaf in leaves)
        closure = _Closure(key, blob, args, kwargs, RemoteValue())
        if not per_worker:
            closure.args_blob = _pickled_arguments(args, kwargs)
        with self._cond:
            closure.raised = self._raised
            self._queue.append(closure)
        self._arm_all_lost(None)
        self._pump()
        return closure.result

    def join(self) -> None:
        """Waits until every scheduled closure has run; refreshes the chief's copies
        of the variables.

        Raises:
            Exception: the first error of a closure scheduled since an error was last
                raised, whatever its type; raised once.
        """
        with self._cond:
            while (self._queue or self._inflight) and self._error is None:
                self._cond.wait(0.5)
        self._raise_error()
        self._runtime.refresh_whole()

    def done(self) -> bool:
        """Whether every scheduled closure has run (raises a closure's error)."""
        self._raise_error()
        with self._cond:
            return not self._queue and not self._inflight

    def fetch(self, val: Any) -> Any:
        """`val` with every `RemoteValue` replaced by its result (waits for them).

        Example::

            coordinator.fetch([v1, v2])   # [result1, result2]
        """

        def get(leaf: Any) -> Any:
            if isinstance(leaf, RemoteValue):
                return leaf.fetch()
            if isinstance(leaf, PerWorkerValues):
                return tuple(get(v) for v in leaf.values)
            return leaf

        return nest.map_structure(get, val)

    def create_per_worker_dataset(self, dataset_fn: Callable[..., Any]) -> PerWorkerValues:
        """Builds ``dataset_fn()`` on every worker; `iter()` of the result gives
        per-worker iterators to pass to `schedule`.

        A `dataset_fn` of one parameter is called with the worker's
        `ds.InputContext` (``num_input_pipelines``: the workers,
        ``input_pipeline_id``: this worker's index), as Keras's ``DatasetCreator``
        is, so that each worker can read its own part of the data.

        Example::

            per_worker = coordinator.create_per_worker_dataset(lambda: loader)
            iterators = iter(per_worker)
            # each worker its own shard:
            coordinator.create_per_worker_dataset(
                lambda ctx: shard(files, ctx.num_input_pipelines, ctx.input_pipeline_id))
        """
        if takes_one_argument(dataset_fn):
            dataset_fn = WithInputContext(dataset_fn, len(self._workers))
        return self._per_worker(cloudpickle.dumps(dataset_fn), None)

    @staticmethod
    def of(strategy: Any) -> ClusterCoordinator:
        """`strategy`'s coordinator: the one made for it, else a new one.

        Example::

            coordinator = ds.coordinator.ClusterCoordinator.of(strategy)
        """
        from distribute.strategies.parameter_server import ParameterServerStrategy

        if isinstance(strategy, ParameterServerStrategy):
            existing = strategy.coordinator
            if isinstance(existing, ClusterCoordinator):
                return existing
        return ClusterCoordinator(strategy)

    # -- what the strategy tells it (`ClusterEvents`, through `_Events`) -------------

    def _worker_replaced(self, worker: str) -> None:
        """`worker`'s process died and a new one is joining (NOTE [worker
        restarts]): calls still out to the old one are stale."""
        with self._cond:
            self._generation[worker] += 1
        self._lose(worker, "its process was replaced by a restarted one")

    def _cluster_stopping(self) -> None:
        """The cluster is shutting down: queued closures are cancelled."""
        with self._cond:
            self._stopping = True
            if self._all_lost is not None:
                self._all_lost.cancel()
            cancelled = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for closure in cancelled:
            closure.result._set(error=ClosureCancelledError(_SHUT_DOWN))

    # -- internals ------------------------------------------------------------------

    def _per_worker(self, blob: bytes | None, source: PerWorkerValues | None) -> PerWorkerValues:
        """Builds a per-worker object on every live worker: ``fn()`` of pickled
        `blob` (a dataset), or ``iter()`` of `source`'s.

        Raises:
            Exception: the user's error, on the first worker where it was raised
                (NOTE [errors from workers]); the object is freed where it was made.
            WorkerError: a live worker did not finish within the timeout.
        """
        key = uuid.uuid4().hex
        runtime = self._runtime
        src_key = None if source is None else Resource.key_of(source)
        with self._resources_lock:
            self._resources[key] = (blob, src_key)
            futures = [
                (
                    w,
                    runtime.transport.call(
                        w,
                        _runtime.worker_make_resource,
                        (key, blob or b"", src_key),
                        runtime.timeout,
                    ),
                )
                for w in self._workers
                if w in self._alive
            ]
        error: BaseException | None = None
        for worker, future in futures:
            try:
                failure = future.wait()
            except Exception as e:
                if not self._lost_after(worker, e):
                    error = error or WorkerError(
                        f"building a per-worker dataset on {worker} failed ({_first_line(e)}), "
                        "though the worker answers; the dataset_fn must return within the "
                        f"strategy's timeout_seconds ({runtime.timeout:.0f} s): make it "
                        "lazy (read in the iterator) or raise the timeout"
                    )
                continue
            if isinstance(failure, _runtime.ClosureFailure):
                error = error or rebuilt(failure)
        if error is not None:
            with self._resources_lock:
                self._resources.pop(key, None)
            self._forgotten.append(key)
            raise error
        resources = [Resource(key) for _ in self._workers]
        made: PerWorkerValues = (
            PerWorkerDataset(resources, self._iterators)
            if source is None
            else PerWorkerIterators(resources, source)
        )
        # Gone from the chief (nothing can refer to it any more: a queued closure
        # holds its arguments), it is freed on the workers at the next schedule.
        weakref.finalize(made, self._forgotten.append, key)
        return made

    def _iterators(self, dataset: PerWorkerValues) -> PerWorkerValues:
        """``iter()`` of per-worker `dataset` on every worker."""
        return self._per_worker(None, dataset)

    def _lost_after(self, worker: str, error: BaseException) -> bool:
        """After a call to `worker` failed with `error`: whether it is lost (it does
        not answer a ping within the timeout); if so, drops it."""
        runtime = self._runtime
        if runtime.answers(worker, runtime.timeout):
            return False
        self._lose(
            worker,
            f"a call to it failed ({_first_line(error)}) and it did not answer a ping within "
            f"{runtime.timeout:.0f} s",
        )
        return True

    def _free_forgotten(self) -> None:
        """Frees, on every worker, the per-worker objects the chief no longer holds
        (an epoch's iterator, a DataLoader's worker processes with it)."""
        if not self._forgotten:
            return
        keys = []
        while self._forgotten:
            keys.append(self._forgotten.pop())
        with self._resources_lock:
            for key in keys:
                self._resources.pop(key, None)
        runtime = self._runtime
        for worker in list(self._alive):
            with contextlib.suppress(Exception):  # a dead worker frees nothing
                runtime.transport.call(
                    worker, _runtime.worker_free_resources, (keys,), runtime.timeout
                )

    def _function_key(self, fn: Callable[..., Any]) -> tuple[str, bytes]:
        """`fn` pickled now (what it captures is read at each `schedule`: a changed
        learning rate, a module's train/eval mode), keyed by its bytes, so a worker
        that has the same bytes is not sent them again."""
        try:
            blob = cloudpickle.dumps(fn)
        except Exception as e:
            name = getattr(fn, "__qualname__", type(fn).__name__)
            raise InvalidArgumentError(
                f"cannot send {name} to the workers: {e}. A scheduled function may capture "
                "modules, variables, optimizers, the strategy and per-worker iterators (pass "
                "those as arguments); not the coordinator, locks, open files or threads"
            ) from e
        return hashlib.sha1(blob).hexdigest(), blob

    def _raise_error(self) -> None:
        """Raises the recorded error, once (NOTE [scheduling])."""
        with self._cond:
            error, self._error = self._error, None
            if error is not None:
                self._raised += 1
        if error is not None:
            raise error

    def _fail(self, error: BaseException, closure: _Closure | None = None) -> None:
        """Records the first error and cancels every queued closure; the error of a
        `closure` scheduled before an error was last raised is its own alone."""
        with self._cond:
            if closure is not None and closure.raised != self._raised:
                return
            if self._error is None:
                self._error = error
            cancelled = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for queued in cancelled:
            queued.result._set(
                error=ClosureCancelledError(
                    f"this closure was cancelled because an earlier one failed: {error}"
                )
            )

    def _lose(self, worker: str, cause: str) -> None:
        """Drops `worker` (dead, for `cause`); with none left, queued closures fail
        unless one comes back within the timeout."""
        with self._cond:
            if worker not in self._alive:
                return
            self._alive.discard(worker)
            if worker in self._idle:
                self._idle.remove(worker)
            left = len(self._alive)
        logger.warning(
            "%s is lost: %s; its closures run on the %d other worker(s) (a restarted %s rejoins)",
            worker,
            cause,
            left,
            worker,
        )
        self._arm_all_lost(worker)

    def _arm_all_lost(self, last: str | None) -> None:
        """With no worker alive, starts the wait for one to come back."""
        with self._cond:
            if self._alive or self._all_lost is not None or self._stopping:
                return
            timer = self._all_lost = threading.Timer(
                self._runtime.timeout, self._none_came_back, args=(last,)
            )
        timer.daemon = True
        timer.start()

    def _none_came_back(self, last: str | None) -> None:
        with self._cond:
            self._all_lost = None
            if self._alive or not (self._queue or self._inflight):
                return  # a worker is back, or nothing waits for one
        which = f" (the last was {last})" if last else ""
        self._fail(
            WorkerLostError(
                f"every worker is gone{which} and none came back within "
                f"{self._runtime.timeout:.0f} s; restart workers (ds.Server with their "
                "TF_CONFIG): they rejoin the running cluster"
            )
        )

    def _readmit(self, worker: str) -> None:
        """`worker`'s restarted process joined: rebuilds there the per-worker
        objects the chief holds (iterators start over), then sends it closures. One
        whose ``dataset_fn`` fails there is logged, and the worker is taken back
        (closures that use it fail there)."""
        runtime = self._runtime
        generation = self._generation[worker]
        with self._resources_lock:
            for key, (blob, source) in self._resources.items():
                try:
                    failure = runtime.transport.call(
                        worker,
                        _runtime.worker_make_resource,
                        (key, blob or b"", source),
                        runtime.timeout,
                    ).wait()
                except Exception as e:
                    logger.warning(
                        "%s came back but failed again while rejoining (%s); a restarted "
                        "process may rejoin",
                        worker,
                        _first_line(e),
                    )
                    return
                if isinstance(failure, _runtime.ClosureFailure):
                    logger.error(
                        "%s came back, but rebuilding a per-worker dataset there failed "
                        "(closures that use it fail there):\n%s",
                        worker,
                        failure.text,
                    )
            with self._cond:
                if self._generation[worker] != generation:
                    return  # replaced again while this one was being set up
                self._sent[worker] = set()
                self._alive.add(worker)
                if worker not in self._idle:
                    self._idle.append(worker)
                if self._all_lost is not None:
                    self._all_lost.cancel()
                    self._all_lost = None
                self._cond.notify_all()
        logger.info("%s rejoined; it runs closures again", worker)
        self._pump()

    def _pump(self) -> None:
        """Sends queued closures to idle workers (NOTE [scheduling])."""
        while True:
            with self._cond:
                if self._stopping or not self._queue or not self._idle:
                    return
                closure = self._queue.popleft()
                worker = self._idle.pop(0)
                self._inflight += 1
            self._send(worker, closure)

    def _send(self, worker: str, closure: _Closure) -> None:
        index = self._workers.index(worker)

        def for_worker(leaf: Any) -> Any:
            return leaf.values[index] if isinstance(leaf, PerWorkerValues) else leaf

        args_blob = closure.args_blob
        if args_blob is None:
            try:
                args_blob = _pickled_arguments(
                    nest.map_structure(for_worker, closure.args),
                    nest.map_structure(for_worker, closure.kwargs),
                )
            except Exception as e:
                self._closure_failed(worker, closure, e)
                return
        blob = None if closure.key in self._sent[worker] else closure.blob
        self._sent[worker].add(closure.key)
        runtime = self._runtime
        generation = self._generation[worker]
        try:
            future = runtime.transport.call(
                worker,
                _runtime.worker_run,
                (closure.key, blob, args_blob, runtime.timeout),
                runtime.timeout,
            )
        except Exception as e:  # the transport knows it is gone
            self._requeue(worker, closure, lost=f"it cannot be called ({_first_line(e)})")
            return
        future.add_done_callback(lambda f: self._on_done(worker, generation, closure, f))

    def _on_done(self, worker: str, generation: int, closure: _Closure, future: Any) -> None:
        """A closure's call ended (in the transport's thread)."""
        current = self._generation[worker] == generation
        try:
            result = future.value()
        except Exception as e:
            if not current:  # the old process of a replaced worker: run it elsewhere
                self._requeue(worker, closure, lost=None)
                return
            # Not in the transport's thread: asking the worker whether it is alive
            # waits for another call, which that thread may be needed to receive.
            threading.Thread(
                target=self._call_failed, args=(worker, generation, closure, e), daemon=True
            ).start()
            return
        if isinstance(result, _runtime.ClosureFailure):
            self._closure_failed(worker, closure, rebuilt(result), idle=current)
            return
        try:
            value = cloudpickle.loads(result)
        except Exception as e:
            error = InvalidArgumentError(
                f"the result of a closure that ran on {worker} cannot be read on the chief "
                f"({type(e).__name__}: {e}); return tensors, numbers or values whose "
                "classes the chief imports"
            )
            self._closure_failed(worker, closure, error, idle=current)
            return
        closure.result._set(value=value)
        self._finish(worker, idle=current)
        self._pump()

    def _call_failed(
        self, worker: str, generation: int, closure: _Closure, e: BaseException
    ) -> None:
        """A closure's call failed: its worker died (it does not answer a ping
        within the timeout: the closure runs elsewhere), or it is alive and the call
        timed out: then a ps that does not answer (a frozen one: its connections stay
        open) is named, else the closure fails."""
        if self._stopping:
            self._closure_failed(worker, closure, ClosureCancelledError(_SHUT_DOWN))
            return
        runtime = self._runtime
        answers = runtime.answers(worker, runtime.timeout)
        if self._generation[worker] != generation:
            # replaced meanwhile: the ping may have reached the new process, and
            # losing the worker now would drop that one
            self._requeue(worker, closure, lost=None)
            return
        if not answers:
            cause = (
                f"its closure's call failed ({_first_line(e)}) and it did not answer a ping "
                f"within {runtime.timeout:.0f} s"
            )
            self._requeue(worker, closure, lost=cause)
            return
        silent = self._silent_ps(worker)
        if silent is not None:
            self._closure_failed(worker, closure, silent)
            return
        self._closure_failed(
            worker,
            closure,
            WorkerError(
                f"{worker} is alive and every ps task answers, but its closure's call failed "
                f"({e}); a closure must finish within the strategy's timeout_seconds "
                f"({self._runtime.timeout:.0f} s): raise it for longer steps"
            ),
        )

    def _silent_ps(self, worker: str) -> _runtime.PsUnavailableError | None:
        """The error naming the first ps task that does not answer a ping, if any.

        A closure waits on the ps tasks; one that stopped (SIGSTOP, a hung host)
        keeps its connections open, so the worker's own call to it ends only by its
        timeout, which starts after the chief's call to the worker did.
        """
        runtime = self._runtime
        wait = min(_PS_PING_SECONDS, runtime.timeout)
        for task in self._ps:
            if not runtime.answers(task, wait):
                return runtime.unavailable(
                    task,
                    TimeoutError(
                        f"{worker}'s closure timed out and {task} did not answer a ping "
                        f"within {wait:.0f} s"
                    ),
                )
        return None

    def _closure_failed(
        self, worker: str, closure: _Closure, error: BaseException, *, idle: bool = True
    ) -> None:
        self._fail(error, closure)  # first: join() and done() must see it
        closure.result._set(error=error)
        self._finish(worker, idle=idle)

    def _requeue(self, worker: str, closure: _Closure, *, lost: str | None) -> None:
        """Puts `closure` back at the front of the queue; `lost`: why its worker is
        lost (None: the call went to a replaced worker's old process)."""
        with self._cond:
            self._queue.appendleft(closure)
        if lost is not None:
            self._sent[worker].clear()
        self._finish(worker, idle=False)
        if lost is not None:
            self._lose(worker, lost)
        self._pump()

    def _finish(self, worker: str, *, idle: bool) -> None:
        with self._cond:
            self._inflight -= 1
            if idle and worker in self._alive:
                self._idle.append(worker)
            self._cond.notify_all()

    def __reduce__(self) -> Any:
        raise InvalidArgumentError(
            "a ClusterCoordinator cannot be sent to the workers (a scheduled function "
            "captured it?); it lives on the chief: schedule from the chief only"
        )


class _Events:
    """A coordinator's `ClusterEvents` (strategies/parameter_server.py): what its
    strategy tells it about the cluster."""

    def __init__(self, coordinator: ClusterCoordinator) -> None:
        self._coordinator = coordinator

    def worker_replaced(self, worker: str) -> None:
        self._coordinator._worker_replaced(worker)

    def worker_rejoined(self, worker: str) -> None:
        self._coordinator._readmit(worker)

    def cluster_stopping(self) -> None:
        self._coordinator._cluster_stopping()


_SHUT_DOWN = "the cluster was shut down before this closure ran"
#: The longest wait for a ps task's answer after a closure timed out.
_PS_PING_SECONDS = 5.0


def _pickled_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """A closure's arguments as a worker receives them.

    Raises:
        InvalidArgumentError: an argument cannot be sent.
    """
    try:
        blob: bytes = cloudpickle.dumps((args, kwargs))
    except Exception as e:
        raise InvalidArgumentError(
            f"cannot send the arguments to the workers: {e}. Arguments may be tensors, "
            "modules, variables, optimizers, per-worker iterators and other picklable "
            "values; not locks, open files or threads"
        ) from e
    return blob


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__
