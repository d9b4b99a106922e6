"""Replica threads and the in-process rendezvous that synchronizes them.

# NOTE [replica threads]
With several local replicas, `run` executes `fn` in one persistent thread per
replica (TF's design; PyTorch releases the GIL inside kernels). Replicas meet at a
`Rendezvous` for every collective and merge: each deposits its value, the last to
arrive computes the combined result once, and every replica reads it. A rendezvous
never waits forever: when a replica fails, the others are released with
`ReplicaAbortedError`; when a replica finishes `fn` while others wait for it, the
waiters get a `ContextError` (different numbers of collectives or merge calls); when
the timeout passes, the error names the replicas that never arrived.

# NOTE [CUDA hand-offs]
Each replica thread runs with its replica's GPU as the current device, on the
stream the caller had current for that device (as `DataParallel.parallel_apply`
does), so ``.cuda()``, ``current_stream()`` and ``synchronize()`` inside ``fn``
mean the replica's own GPU. Tensors cross threads at every rendezvous, and each
thread may have queued work on its own stream: a depositor records an event on
its stream, the replica that combines makes its streams (on every replica GPU)
wait for all of them first, and records events after combining, which every
replica's stream waits for before using the result. Without this the hand-off is
right only while every thread uses the default stream. (Untested without a GPU.)
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from distribute.errors import CollectiveTimeoutError, ContextError, ReplicaAbortedError

__all__ = ["Rendezvous", "ReplicaThreads"]


class Rendezvous:
    """A reusable meeting point for `num_replicas` replica threads.

    Args:
        num_replicas: the number of local replicas.
        timeout: seconds a replica waits for the others before raising.
        devices: the replicas' devices; CUDA ones get stream events at every
            hand-off (NOTE [CUDA hand-offs]).
    """

    def __init__(
        self, num_replicas: int, timeout: float, devices: Sequence[torch.device] = ()
    ) -> None:
        self._n = num_replicas
        self._timeout = timeout
        self._cuda = [d for d in devices if d.type == "cuda"]
        self._cond = threading.Condition()
        self._generation = 0
        self._slots: list[Any] = [None] * num_replicas
        self._arrived: list[bool] = [False] * num_replicas
        self._names: list[str] = [""] * num_replicas
        self._results: dict[int, tuple[bool, Any]] = {}
        self._finished: set[int] = set()
        self._abort: BaseException | None = None
        self._events: list[Any] = [None] * num_replicas  # CUDA only: each deposit's event
        self._done_events: list[Any] = []  # CUDA only: recorded after combining

    def reset(self) -> None:
        """Prepares for a new `run`: clears finished replicas and any abort."""
        with self._cond:
            self._finished.clear()
            self._abort = None
            self._arrived = [False] * self._n
            self._slots = [None] * self._n
            self._results.clear()

    def abort(self, error: BaseException) -> None:
        """Releases every waiting replica with `error` (first abort wins)."""
        with self._cond:
            if self._abort is None:
                self._abort = error
            self._cond.notify_all()

    def finish(self, replica: int) -> None:
        """Marks `replica` as done with `fn`; waiters can no longer be completed."""
        with self._cond:
            self._finished.add(replica)
            if any(self._arrived):
                waiting = [i for i, a in enumerate(self._arrived) if a]
                op = self._names[waiting[0]]
                self._abort = ContextError(
                    f"replica {replica} returned from `fn` while replicas {waiting} wait in "
                    f"{op}: every replica must make the same collective and merge_call calls "
                    "in the same order (check for replica-dependent branches around them)"
                )
                self._cond.notify_all()

    def exchange(
        self, replica: int, value: Any, combine: Callable[[list[Any]], Any], name: str
    ) -> Any:
        """Deposits `value`; once all replicas have, `combine(values)` runs once.

        Returns:
            What `combine` returned, to every replica. An exception raised by
                `combine` is raised in every replica.
        """
        with self._cond:
            self._check_abort()
            if self._finished:
                raise ContextError(
                    f"replica {replica} entered {name} but replicas {sorted(self._finished)} "
                    "already returned from `fn`: every replica must make the same collective "
                    "and merge_call calls in the same order"
                )
            generation = self._generation
            self._slots[replica] = value
            self._arrived[replica] = True
            self._names[replica] = name
            if self._cuda:
                self._events[replica] = torch.cuda.current_stream().record_event()
            if all(self._arrived):
                values = self._slots
                self._slots = [None] * self._n
                self._arrived = [False] * self._n
                if self._cuda:
                    self._wait_for(self._events)
                try:
                    outcome: tuple[bool, Any] = (True, combine(values))
                except BaseException as e:  # delivered to every replica
                    outcome = (False, e)
                if self._cuda:
                    self._done_events = [
                        torch.cuda.current_stream(d).record_event() for d in self._cuda
                    ]
                self._results = {generation: outcome}
                self._generation += 1
                self._cond.notify_all()
            else:
                deadline = time.monotonic() + self._timeout
                while self._generation == generation:
                    self._check_abort()
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        missing = [i for i, a in enumerate(self._arrived) if not a]
                        error = CollectiveTimeoutError(
                            f"{name}: local replicas {missing} did not arrive within "
                            f"{self._timeout:.0f}s; a replica is stuck or skipped the call "
                            "(raise CommunicationOptions.timeout_seconds for slow steps)"
                        )
                        self._abort = error
                        self._cond.notify_all()
                        raise error
                    self._cond.wait(remaining)
            ok, result = self._results[generation]
            done_events = self._done_events
        if self._cuda:
            for event in done_events:  # the combined result is ready on this stream
                torch.cuda.current_stream().wait_event(event)
        if not ok:
            raise result
        return result

    def _wait_for(self, events: Sequence[Any]) -> None:
        """Makes the combining thread's stream on every replica GPU wait for ``events``."""
        for device in self._cuda:
            stream = torch.cuda.current_stream(device)
            for event in events:
                if event is not None:
                    stream.wait_event(event)

    def _check_abort(self) -> None:
        if self._abort is not None:
            if isinstance(self._abort, (ContextError, CollectiveTimeoutError)):
                raise self._abort
            raise ReplicaAbortedError(
                f"released because another replica failed: {self._abort!r}"
            ) from self._abort


class _ThreadState:
    """The caller's thread-local torch modes, carried into each replica thread.

    Grad mode, inference mode and autocast are thread-local in torch: without
    this, ``with torch.autocast("cpu", dtype=torch.bfloat16): strategy.run(fn)``
    would compute in bfloat16 with one replica and in float32 with several.
    """

    __slots__ = ("autocast", "autocast_cache", "grad", "inference")

    def __init__(
        self,
        grad: bool,
        inference: bool,
        autocast: tuple[tuple[str, torch.dtype], ...],
        autocast_cache: bool,
    ) -> None:
        self.grad = grad
        self.inference = inference
        self.autocast = autocast
        self.autocast_cache = autocast_cache

    @classmethod
    def capture(cls) -> _ThreadState:
        autocast = tuple(
            (device, torch.get_autocast_dtype(device))
            for device in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)
        )
        return cls(
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            autocast,
            torch.is_autocast_cache_enabled(),
        )

    def entered(self) -> contextlib.AbstractContextManager[Any]:
        """A context manager that sets these modes in the current thread."""
        if not self.inference and not self.autocast:  # the common case: one mode
            return torch.set_grad_enabled(self.grad)
        stack = contextlib.ExitStack()
        if self.inference:
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for device, dtype in self.autocast:
            stack.enter_context(
                torch.autocast(device, dtype=dtype, cache_enabled=self.autocast_cache)
            )
        return stack


_AUTOCAST_DEVICES = ("cpu", "cuda")


class _Placement:
    """A replica's GPU and the caller's current stream on it, entered in its thread."""

    __slots__ = ("stream",)

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    @classmethod
    def capture(cls, device: torch.device) -> _Placement:
        return cls(torch.cuda.current_stream(device) if device.type == "cuda" else None)

    def entered(self) -> contextlib.AbstractContextManager[Any]:
        if self.stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.stream.device))
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack


class _Worker(threading.Thread):
    def __init__(self, index: int) -> None:
        super().__init__(name=f"distribute-replica-{index}", daemon=True)
        self.tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            task = self.tasks.get()
            if task is None:
                return
            task()
            # Drop the finished task: it refers to the strategy, which must stay
            # collectable so that its finalizer can stop these threads.
            del task


class ReplicaThreads:
    """One persistent thread per local replica.

    Args:
        num_replicas: the number of local replicas (at least 2).
        devices: the replicas' devices; a thread whose replica is a GPU runs with
            it as the current device (NOTE [CUDA hand-offs]).
    """

    def __init__(self, num_replicas: int, devices: Sequence[torch.device] = ()) -> None:
        self._devices = list(devices)
        self._workers = [_Worker(i) for i in range(num_replicas)]
        for w in self._workers:
            w.start()
        _LIVE.add(self)

    def call(
        self,
        fns: Sequence[Callable[[], Any]],
        on_error: Callable[[int, BaseException], None],
        on_finish: Callable[[int], None],
    ) -> list[Any]:
        """Runs `fns[i]` in replica thread i and waits for all of them.

        `on_error(i, e)` is called as soon as replica i fails, so that the others
        can be released; `on_finish(i)` when replica i returns normally.

        Returns:
            The replicas' results, in replica order.

        Raises:
            BaseException: the first failing replica's exception (not a release of
                another replica), re-raised.
        """
        n = len(fns)
        results: list[Any] = [None] * n
        errors: list[BaseException | None] = [None] * n
        # The last replica to finish wakes the caller, once (a semaphore released by
        # each would wake it up to n times a step; issue 40).
        done = threading.Event()
        running = [n]
        count_lock = threading.Lock()
        state = _ThreadState.capture()
        places = [_Placement.capture(d) for d in self._devices] or [_Placement(None)] * n

        def make_task(i: int) -> Callable[[], None]:
            def task() -> None:
                try:
                    with state.entered(), places[i].entered():
                        results[i] = fns[i]()
                    on_finish(i)
                except BaseException as e:
                    errors[i] = e
                    on_error(i, e)
                finally:
                    with count_lock:
                        running[0] -= 1
                        last = running[0] == 0
                    if last:
                        done.set()

            return task

        for i in range(n):
            self._workers[i].tasks.put(make_task(i))
        done.wait()
        first = _first_cause(errors)
        if first is not None:
            raise first
        return results

    def shutdown(self, join: bool = False) -> None:
        """Stops the threads (waiting for them when `join`)."""
        for w in self._workers:
            w.tasks.put(None)
        if join:
            for w in self._workers:
                w.join(timeout=5.0)


_LIVE: weakref.WeakSet[ReplicaThreads] = weakref.WeakSet()


@atexit.register
def _stop_all_replica_threads() -> None:
    # Threads still parked in torch code at interpreter exit can abort the process.
    for threads in list(_LIVE):
        threads.shutdown(join=True)


def _first_cause(errors: Sequence[BaseException | None]) -> BaseException | None:
    """The root failure: a replica's own error rather than another's release."""
    real = [e for e in errors if e is not None and not isinstance(e, ReplicaAbortedError)]
    if real:
        return real[0]
    return next((e for e in errors if e is not None), None)
