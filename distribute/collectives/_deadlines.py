"""How a rank waits for a collective: in slices on gloo, off the host on nccl.

Gloo collectives are waited for in quarter-second slices up to the library's
deadline (NOTE [no silent hangs] in process_group.py); nccl ones are watched by a
thread (below), since the host never waits for them.

# NOTE [nccl deadlines]
With nccl, ``Work.wait()`` only makes the current CUDA stream wait; the host goes
on, and a stuck collective would surface much later in whatever reads a result
(an ``.item()`` no deadline reaches). Blocking the host until each collective
completes would cost the overlap DDP has, so instead each launched work goes to a
`StreamWatch`: a daemon thread that polls ``is_completed()`` every quarter
second. A work still running at the library's deadline is diagnosed as in NOTE
[no silent hangs] (the missing ranks named, logged at once), the group is marked
broken, and its
communicators are aborted, which frees the GPU; the next collective raises the
diagnosis. The process group itself gets a longer timeout (twice the deadline
plus 30 s), so that NCCL's own watchdog, which torchrun's
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` lets kill the process, fires after ours.
Untested here (no GPU).
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from distribute.collectives._liveness import Position

__all__ = ["SLICE", "CallInThread", "StreamWatch", "grace", "nccl_group_timeout"]

#: How long one wait lasts before the rank checks whether a peer gave up.
SLICE = datetime.timedelta(seconds=0.25)
#: The longest time a failing rank waits for the others to answer its probe.
_GRACE_SECONDS = 1.0


def grace(timeout_seconds: float) -> float:
    """The part of the timeout kept for the failure diagnosis."""
    return min(_GRACE_SECONDS, timeout_seconds * 0.2)


def nccl_group_timeout(timeout_seconds: float) -> datetime.timedelta:
    """The process group's own timeout under nccl: past the library's deadline
    (NOTE [nccl deadlines]), so that the library names the missing ranks first."""
    return datetime.timedelta(seconds=2 * timeout_seconds + 30)


class StreamWatch:
    """Polls launched nccl works off the training thread (NOTE [nccl deadlines]).

    Args:
        on_overdue: a weak reference to the callback called once, from the watch
            thread, with the first work still running past ``start + timeout``:
            ``(position, start)``. The thread ends when its target is gone.
        timeout: the library's deadline for one collective, in seconds.
    """

    def __init__(self, on_overdue: Any, timeout: float) -> None:
        self._on_overdue = on_overdue
        self._timeout = timeout
        self._pending: collections.deque[tuple[Any, Position, float]] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, work: Any, position: Position, start: float) -> None:
        with self._lock:
            self._pending.append((work, position, start))
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(
                    target=self._run, name="distribute-nccl-watch", daemon=True
                )
                self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def _run(self) -> None:
        while not self._wake.wait(SLICE.total_seconds()):
            now = time.monotonic()
            overdue = None
            with self._lock:
                while self._pending and self._pending[0][0].is_completed():
                    self._pending.popleft()
                for work, position, start in self._pending:
                    if not work.is_completed() and now > start + self._timeout:
                        overdue = (position, start)
                        break
            callback = self._on_overdue()
            if callback is None:  # the collectives object is gone
                return
            if overdue is not None:
                callback(*overdue)
                return


class CallInThread:
    """A blocking call (one running collectives of its own, such as DCP's save) started
    in a helper thread, so that the calling rank can wait for it in slices and give up
    when a peer reports the group broken (`ProcessGroupCollectives.run_watched`).

    The thread is not a daemon: a call abandoned by the waiter stays blocked in the
    backend until a peer's exit closes its connection (or the group's timeout), and
    the interpreter must wait for it at exit; a daemon thread woken in the backend
    while the interpreter finalizes aborts the process. The caller's grad mode is
    carried over, and ``cuda`` is made the thread's current device.

    Example::

        worker = CallInThread(lambda: dcp_save(state), "checkpoint write", None)
        while not worker.wait(0.25):
            ...  # give up here if a peer broke the group
        ok, value = worker.outcome
    """

    def __init__(self, call: Callable[[], Any], name: str, cuda: Any) -> None:
        self.outcome: tuple[bool, Any] = (False, None)
        self._done = threading.Event()
        grad = torch.is_grad_enabled()

        def run() -> None:
            try:
                torch.set_grad_enabled(grad)
                if cuda is not None:
                    torch.cuda.set_device(cuda)
                self.outcome = (True, call())
            except BaseException as e:  # torch's CheckpointException is a BaseException
                self.outcome = (False, e)
            finally:
                self._done.set()

        threading.Thread(target=run, name=name, daemon=False).start()

    @property
    def done(self) -> bool:
        """Whether the call has returned or raised."""
        return self._done.is_set()

    def wait(self, seconds: float) -> bool:
        """Waits up to ``seconds`` for the call; returns whether it is done."""
        return self._done.wait(seconds)
