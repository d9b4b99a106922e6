"""The test suite's preloaded interpreter that forks `distribute.launch.run`'s workers.

Usage (by tests/_preloaded_launch.py only)::

    python tests/_preloaded_server.py

Importing torch and `distribute` takes a new interpreter 1.5-2.5 s of CPU time, the
bulk of a short multi-process test. This process pays it once: it imports
`distribute` (and torch with it), then, single-threaded, forks one worker per
request. A forked worker starts from a process that has imported modules and run
nothing else (no thread, no process group, no CUDA context), and seeds its random
generators afresh as a new interpreter would.

Protocol: one JSON request per line on stdin, ``{"seq": n, "argv": [...], "env":
{...}, "log": path, "cwd": path}``; on the original stdout (fd 1 is pointed at stderr so
that nothing printed by an import can corrupt it) the lines ``ready``, ``spawned
SEQ PID`` (the worker is the leader of its own session by then) and ``exited PID
CODE`` (CODE as `subprocess.Popen.returncode`: minus the signal of a killed
worker). End of stdin (the launcher exited, or died) ends this process; its
workers notice their parent is gone and exit (`distribute._launch_child`). A
worker exits without tearing its modules down (`_exit_quickly`).

The plugin keeps one such process per environment (less the per-rank
variables), so a worker sees at import time exactly the environment a new
interpreter would have seen; the per-rank variables are set before the worker's
function is imported.

Linux (and other POSIX systems) only: it forks. This is test machinery, not part of
the package: users' workers are new interpreters (`launch.run`), as torchrun's are.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
from typing import Any

_REAP_SECONDS = 0.02


def _reap(out: Any) -> None:
    """Reports every worker that has exited."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        out.write(f"exited {pid} {os.waitstatus_to_exitcode(status)}\n")
        out.flush()


def _fork(request: dict[str, Any], out: Any) -> bool:
    """Forks a worker for ``request``; True in the worker, False here."""
    ready_r, ready_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.setsid()  # its own session and process group: the launcher kills it whole
        os.write(ready_w, b"x")
        os.close(ready_w)
        return True
    os.close(ready_w)
    os.read(ready_r, 1)  # the worker leads its process group before the launcher hears of it
    os.close(ready_r)
    out.write(f"spawned {request['seq']} {pid}\n")
    out.flush()
    return False


def _become_worker(request: dict[str, Any], protocol_fd: int, sigchld: Any) -> int:
    """Turns this forked process into the worker that ``request`` describes."""
    os.close(protocol_fd)
    signal.signal(signal.SIGCHLD, sigchld)  # as the launcher left it, as exec would
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # A new interpreter seeds torch's and NumPy's global generators afresh (Python's
    # `random` reseeds itself after a fork).
    import torch

    torch.seed()
    if "numpy" in sys.modules:
        import numpy

        numpy.random.seed()
    from distribute import _launch_child

    sys.argv = [str(_launch_child.__file__), *request["argv"]]
    code = _launch_child.main(list(request["argv"]))
    _exit_quickly(code)
    return code  # not reached


def _exit_quickly(code: int) -> None:
    """Exits as an interpreter does, less the teardown of its modules.

    Tearing down torch's modules takes 0.4-0.5 s of CPU time, as long as forking
    the worker and running a short function together. Kept from a normal exit: the
    interpreter's own shutdown of threads (`threading._shutdown`: thread pools
    woken, non-daemon threads joined), `atexit` functions (the strategies'
    shutdowns, `logging.shutdown`, `weakref.finalize`), and every buffer flushed:
    Python's open files (the standard streams among them) and C's stdio. Lost:
    finalizers (``__del__``) of objects still alive, so a file left open is flushed
    but not closed (an unclosed gzip or zip file lacks its trailer; a
    ``NamedTemporaryFile`` left open stays on disk).
    """
    import atexit
    import ctypes
    import gc
    import io
    import threading

    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    for obj in gc.get_objects():
        # type(), not isinstance: a dead weak proxy raises on any attribute, __class__ too
        if issubclass(type(obj), io.IOBase) and not obj.closed:
            try:
                obj.flush()
            except (OSError, ValueError):
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    ctypes.CDLL(None).fflush(None)  # C and C++ code's buffered stdout
    os._exit(code)


def main() -> int:
    # Workers are reaped here and reported; an inherited SIG_IGN would have the kernel
    # reap them unreported. Each worker gets the inherited disposition back.
    sigchld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    protocol_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints go to stderr, never into the protocol
    out = os.fdopen(protocol_fd, "w", buffering=1, closefd=False)
    import distribute  # noqa: F401 - the point of this process: pay the imports once
    from distribute import _launch_child  # noqa: F401 - what every worker runs

    out.write("ready\n")
    out.flush()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], _REAP_SECONDS)
        _reap(out)
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return 0  # the launcher is gone
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if _fork(request, out):
                return _become_worker(request, protocol_fd, sigchld)


if __name__ == "__main__":
    sys.exit(main())
