"""A pytest plugin: `launch.run`'s workers forked from a preloaded interpreter.

A new interpreter spends 1.5-2.5 s of CPU time importing torch and `distribute`
before a worker's function runs, and 0.4-0.5 s tearing torch down at exit: with a few
hundred worker processes that was most of the suite's 12 minutes on two cores. This
plugin (registered by tests/conftest.py) keeps one interpreter per environment (less
the per-rank variables) that has imported `distribute` and nothing else
(tests/_preloaded_server.py), single-threaded, and forks each worker from it: the
worker takes its rank's variables, reseeds torch's and NumPy's generators, runs the
same `distribute._launch_child.main`, and exits without tearing its modules down.

It is test machinery, outside the package: `launch.run` itself always starts new
interpreters, as users run. What a forked worker cannot match: the workers of one
interpreter share Python's hash seed (a set's order that differs between workers
would not show), and objects still alive at exit run no finalizer. So CI runs every
multi-process test again with new interpreters::

    python -m pytest -m distributed --launch-start=fresh

Example (a test of both ways of starting)::

    with starting("preloaded"):
        launch.run(work, 2)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import pytest

from distribute import launch
from distribute.errors import WorkerError

__all__ = ["STARTS", "starting"]

#: How `launch.run` may start workers under this plugin.
STARTS = ("fresh", "preloaded")

_SERVER = Path(__file__).with_name("_preloaded_server.py")
#: Variables that differ from one call to the next and that nothing reads at import:
#: they do not pick the preloaded interpreter.
_PER_CALL_VARIABLES = frozenset(launch._LAUNCHER_VARIABLES) | {"PYTEST_CURRENT_TEST"}
#: Preloaded interpreters kept at once (one per distinct environment); the least
#: recently used goes first.
_KEPT = 2
_POLL_SECONDS = 0.02

_fresh_start = launch._start_worker


class _ForkedWorker:
    """A worker forked by a preloaded interpreter (`_Preloaded`), which reports its exit."""

    def __init__(self, pid: int, server: _Preloaded) -> None:
        self._pid = pid
        self._server = server

    @property
    def pid(self) -> int:
        return self._pid

    def poll(self) -> int | None:
        return self._server.exit_code(self._pid)

    def kill(self) -> None:
        try:
            os.kill(self._pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        return self._server.wait_exit(self._pid)


class _Preloaded:
    """The launcher's side of one preloaded interpreter (tests/_preloaded_server.py)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, str(_SERVER)],
            env=dict(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            start_new_session=True,  # a terminal's Ctrl-C reaches the launcher, not it
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._requests: IO[bytes] = self._proc.stdin
        self._replies: IO[bytes] = self._proc.stdout
        self._request_lock = threading.Lock()
        self._changed = threading.Condition()
        self._exits: dict[int, int] = {}
        self._spawned: dict[int, int] = {}  # request number -> pid
        self._next_seq = 0
        self._handed: set[int] = set()
        self._gone = False
        if self._replies.readline() != b"ready\n":
            self._proc.wait()
            self._requests.close()
            self._replies.close()
            raise WorkerError(
                "the test suite's preloaded interpreter (tests/_preloaded_server.py) failed to "
                f"start; its output:\n{self._stderr_text()}\nRun pytest with "
                "--launch-start=fresh to start each worker as a new interpreter instead."
            )
        threading.Thread(target=self._read_replies, name="preloaded-launch", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return not self._gone and self._proc.poll() is None

    @property
    def busy(self) -> bool:
        """Whether a worker it forked may still be running."""
        with self._changed:
            return not self._gone and bool(self._handed - self._exits.keys())

    def _stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-4000:].decode(errors="replace")

    def _read_replies(self) -> None:
        for line in self._replies:
            kind, *fields = line.split()
            with self._changed:
                if kind == b"spawned":
                    seq, pid = int(fields[0]), int(fields[1])
                    self._spawned[seq] = pid
                    self._exits.pop(pid, None)  # an earlier worker's pid, reused
                elif kind == b"exited":
                    self._exits[int(fields[0])] = int(fields[1])
                self._changed.notify_all()
        with self._changed:
            self._gone = True
            self._changed.notify_all()

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], log: Path) -> _ForkedWorker:
        """Forks a worker running ``distribute._launch_child argv`` with ``env``."""
        with self._request_lock:
            seq = self._next_seq
            self._next_seq += 1
            request = {
                "seq": seq,
                "argv": list(argv),
                "env": dict(env),
                "log": str(log),
                "cwd": os.getcwd(),
            }
            try:
                self._requests.write(json.dumps(request).encode() + b"\n")
                self._requests.flush()
            except BrokenPipeError:
                pass  # gone: reported below
            with self._changed:
                # Its own reply: a call interrupted while waiting leaves another's behind.
                while seq not in self._spawned and not self._gone:
                    self._changed.wait()
                if seq not in self._spawned:
                    raise WorkerError(
                        "the test suite's preloaded interpreter exited before starting a "
                        f"worker; its output:\n{self._stderr_text()}"
                    )
                pid = self._spawned.pop(seq)
                self._handed.add(pid)
                return _ForkedWorker(pid, self)

    def exit_code(self, pid: int) -> int | None:
        """The worker's exit code once it has exited, else None."""
        with self._changed:
            if pid in self._exits:
                return self._exits[pid]
            if not self._gone:
                return None
        # The interpreter that would report the exit is gone; the worker exits by
        # itself within a second (its parent is gone) and is reaped by init, or by this
        # process if it is the subreaper (a container's first process).
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
            if reaped == pid:
                return os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            pass
        return None if _running(pid) else -signal.SIGKILL

    def wait_exit(self, pid: int) -> int:
        while True:
            code = self.exit_code(pid)
            if code is not None:
                return code
            with self._changed:
                self._changed.wait(_POLL_SECONDS * 5)

    def close(self) -> None:
        """Ends the interpreter (its running workers exit by themselves)."""
        try:
            self._requests.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._replies.close()
        self._stderr.close()


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


_servers: dict[tuple[str, ...], _Preloaded] = {}
_servers_lock = threading.Lock()


def _start_preloaded(payload: Path, result: Path, env: Mapping[str, str], log: Path) -> Any:
    """`launch._start_worker` under this plugin: forks the worker from the preloaded
    interpreter for this environment (less `_PER_CALL_VARIABLES`), started on first
    use; idle ones beyond `_KEPT` are ended, the least recently used first (never one
    between being chosen and forking)."""
    base = {k: v for k, v in env.items() if k not in _PER_CALL_VARIABLES}
    key = (sys.executable, *sorted(f"{k}={v}" for k, v in base.items()))
    with _servers_lock:
        server = _servers.pop(key, None)
        if server is None or not server.alive:
            if server is not None:
                server.close()
            server = _Preloaded(base)
        _servers[key] = server  # most recently used last
        worker = server.spawn([str(payload), str(result), str(server.pid)], env, log)
        idle = [k for k, s in _servers.items() if k != key and not s.busy]
        for old in idle[: max(0, len(_servers) - _KEPT)]:
            _servers.pop(old).close()
        return worker


@atexit.register
def close_all() -> None:
    """Ends every preloaded interpreter (their running workers exit by themselves)."""
    with _servers_lock:
        while _servers:
            _servers.popitem()[1].close()


def _set(start: str) -> None:
    if start not in STARTS:
        raise ValueError(f"start must be one of {STARTS}, got {start!r}")
    launch._start_worker = _start_preloaded if start == "preloaded" else _fresh_start  # type: ignore[assignment]


def current() -> str:
    """How `launch.run` starts workers now: ``"preloaded"`` or ``"fresh"``."""
    return "preloaded" if launch._start_worker is _start_preloaded else "fresh"


@contextlib.contextmanager
def starting(start: str) -> Iterator[None]:
    """Inside the block `launch.run` starts workers ``start``-wise (``"fresh"``: new
    interpreters; ``"preloaded"``: forked), whatever the session's default."""
    previous = current()
    _set(start)
    try:
        yield
    finally:
        _set(previous)


# -- the pytest plugin --------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--launch-start",
        choices=STARTS,
        default="preloaded",
        help=(
            "how launch.run starts the multi-process tests' workers: forked from a "
            "preloaded interpreter (default, about twice as fast) or as new interpreters, "
            "as users run (fresh)"
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    _set(config.getoption("--launch-start"))


def pytest_unconfigure(config: pytest.Config) -> None:
    _set("fresh")
    close_all()


def pytest_report_header(config: pytest.Config) -> str:
    return f"launch.run workers: {config.getoption('--launch-start')} (tests/_preloaded_launch.py)"
