"""Run a function in N fresh worker processes with a ready cluster.

For tests and notebooks. Each worker is a new Python interpreter (spawned with
`subprocess.Popen`; or, with ``start="preloaded"``, forked from an interpreter kept
for the purpose that has imported `distribute` and done nothing else, see below)
whose environment is what torchrun would give
it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``), or a ``TF_CONFIG`` naming every
worker at a free loopback port, plus ``OMP_NUM_THREADS=1`` unless already set. So
``ds.MultiWorkerMirroredStrategy()`` (or `distribute.cluster_resolver.resolve_cluster`)
inside the function finds its cluster. The environment is handed to the new
processes; this process's ``os.environ`` is never written.

The function is pickled by reference (define it at module level, in a module or
in the script you run) together with this process's ``sys.path``, so test modules
import in the workers. Return values come back as pickle files. A worker's
exception is re-raised here as `WorkerError` naming its rank and carrying its
traceback, and the other workers are killed at once (with their own child
processes); a timeout kills every worker and names those still running. A worker
also exits by itself if this process dies, so no orphan is left behind.

A new interpreter spends 1.5-2.5 s of CPU time importing torch and `distribute`
before the function runs, which dominates short runs (a test suite's). With
``start="preloaded"`` (or ``DISTRIBUTE_LAUNCH_START=preloaded`` in the environment)
one interpreter per environment pays it once (`distribute._zygote`) and forks each
worker from that state: single-threaded, no process group, no CUDA context, random
generators seeded afresh, and the same environment at import time as a new
interpreter would have had. What differs: modules `distribute` imports are
already imported (their import-time reading of variables that ``env`` changes is
not redone, which is why each distinct environment gets its own interpreter),
and the workers of one environment share Python's hash seed.

Example::

    import distribute as ds
    from distribute import launch

    def work(scale):
        strategy = ds.MultiWorkerMirroredStrategy()
        return strategy.cluster_resolver.rank * scale

    if __name__ == "__main__":
        print(launch.run(work, 2, args=(10,), timeout=120))   # [0, 10]
        print(launch.run(work, 2, args=(1,), launcher="tf_config"))   # [0, 1]
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from distribute.errors import InvalidArgumentError, WorkerError

__all__ = ["free_ports", "run"]

#: Variables of an outer launcher that must not leak into the workers.
_LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TF_CONFIG",
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
)

#: Variables that differ from one call to the next and that nothing reads at import:
#: they do not pick the preloaded interpreter (see `_preloaded`).
_PER_CALL_VARIABLES = frozenset(_LAUNCHER_VARIABLES) | {"PYTEST_CURRENT_TEST"}

_LAUNCHERS = ("torchrun", "tf_config")
_STARTS = ("fresh", "preloaded")
#: The environment variable that sets `run`'s default ``start``.
START_VARIABLE = "DISTRIBUTE_LAUNCH_START"
_POLL_SECONDS = 0.02
#: Preloaded interpreters kept at once (one per distinct environment); the least
#: recently used goes first.
_PRELOADED_KEPT = 2


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that are free on the loopback interface now.

    Example::

        master_port, = free_ports(1)
    """
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _worker_env(
    rank: int, num_workers: int, launcher: str, ports: Sequence[int], extra: Mapping[str, str]
) -> dict[str, str]:
    """The environment of worker ``rank`` (built here and handed to Popen)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env.setdefault("OMP_NUM_THREADS", "1")
    if launcher == "torchrun":
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(num_workers),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(num_workers),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(ports[0]),
        )
    else:
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": rank}}
        )
    env.update(extra)
    return env


def _main_path(fn: Callable[..., Any]) -> str | None:
    """The script to import as ``__main__`` in the workers when ``fn`` is defined there."""
    if getattr(fn, "__module__", None) != "__main__":
        return None
    path = getattr(sys.modules["__main__"], "__file__", None)
    if path is None:
        raise InvalidArgumentError(
            f"launch.run cannot send {getattr(fn, '__qualname__', fn)!r}, defined interactively "
            "(in a notebook or the REPL), to new processes; define it in a module and import it."
        )
    return str(path)


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-limit:]


def run(
    fn: Callable[..., Any],
    num_workers: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    launcher: str = "torchrun",
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    allow_missing: bool = False,
    start: str | None = None,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` in ``num_workers`` new processes; returns their results.

    Args:
        fn: a module-level function (pickled by reference).
        num_workers: how many worker processes.
        args: positional arguments, pickled.
        kwargs: keyword arguments, pickled.
        launcher: ``"torchrun"`` (RANK, WORLD_SIZE, MASTER_ADDR, ... variables) or
            ``"tf_config"`` (one ``TF_CONFIG`` per worker).
        timeout: seconds before every worker is killed; None waits forever.
        env: extra environment variables for the workers (they win over the
            launcher's).
        allow_missing: a worker that exits without a result (``os._exit``, a
            crash, a kill) gives ``None`` instead of an error, and the others
            keep running: for tests of what the survivors of a death see. An
            exception raised by ``fn`` is still an error.
        start: ``"fresh"`` (a new interpreter per worker) or ``"preloaded"``
            (forked from a kept interpreter that has imported `distribute`; see
            the module's docstring). None: ``DISTRIBUTE_LAUNCH_START``, else
            ``"fresh"``.

    Returns:
        The workers' return values in rank order.

    Raises:
        InvalidArgumentError: bad arguments, or ``fn``/``args`` cannot be pickled.
        WorkerError: a worker raised or crashed (its rank and traceback are in the
            message), or the timeout passed (the ranks still running are named).

    Example::

        # in a module: def square(x): return x * x
        launch.run(square, 2, args=(3,), timeout=60)   # [9, 9]
    """
    if num_workers < 1:
        raise InvalidArgumentError(
            f"num_workers must be at least 1, got {num_workers}; pass how many worker processes "
            "to start."
        )
    if launcher not in _LAUNCHERS:
        raise InvalidArgumentError(
            f"launcher must be one of {_LAUNCHERS}, got {launcher!r}; 'torchrun' sets RANK, "
            "WORLD_SIZE, ... and 'tf_config' sets TF_CONFIG."
        )
    if timeout is not None and timeout <= 0:
        raise InvalidArgumentError(f"timeout must be positive seconds or None, got {timeout}.")
    start = start if start is not None else os.environ.get(START_VARIABLE, "fresh")
    if start not in _STARTS:
        raise InvalidArgumentError(
            f"start must be one of {_STARTS}, got {start!r} (from the argument or "
            f"{START_VARIABLE}); 'fresh' starts a new interpreter per worker, 'preloaded' "
            "forks each from one that has imported distribute."
        )
    setup = {"sys_path": list(sys.path), "main_path": _main_path(fn)}
    try:
        payload_bytes = pickle.dumps(setup) + pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise InvalidArgumentError(
            f"launch.run needs a module-level function and picklable arguments, but pickling "
            f"{getattr(fn, '__qualname__', fn)!r} failed: {exc}. Define the function at module "
            "level (not a lambda or a nested function)."
        ) from exc
    with tempfile.TemporaryDirectory(prefix="distribute-launch-") as tmp:
        root = Path(tmp)
        payload = root / "payload.pkl"
        payload.write_bytes(payload_bytes)
        ports = free_ports(num_workers if launcher == "tf_config" else 1)
        logs = [root / f"worker-{r}.log" for r in range(num_workers)]
        results = [root / f"result-{r}.pkl" for r in range(num_workers)]
        procs: list[_Worker] = []
        try:
            for rank in range(num_workers):
                worker_env = _worker_env(rank, num_workers, launcher, ports, env or {})
                if start == "preloaded":
                    procs.append(_spawn_preloaded(payload, results[rank], worker_env, logs[rank]))
                    continue
                with open(logs[rank], "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            [
                                sys.executable,
                                "-m",
                                "distribute._launch_child",
                                str(payload),
                                str(results[rank]),
                                str(os.getpid()),
                            ],
                            env=worker_env,
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,  # one process group per worker: kill it whole
                        )
                    )
            _wait(procs, logs, results, timeout, allow_missing)
            return [_load_result(p) for p in results]
        finally:
            _kill(procs)


class _Worker(Protocol):
    """What the launcher needs of a worker process (`subprocess.Popen` has it)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self) -> int: ...


class _ForkedWorker:
    """A worker forked by a preloaded interpreter (`_Zygote`), which reports its exit."""

    def __init__(self, pid: int, zygote: _Zygote) -> None:
        self._pid = pid
        self._zygote = zygote

    @property
    def pid(self) -> int:
        return self._pid

    def poll(self) -> int | None:
        return self._zygote.exit_code(self._pid)

    def kill(self) -> None:
        try:
            os.kill(self._pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        return self._zygote.wait_exit(self._pid)


class _Zygote:
    """The launcher's side of one preloaded interpreter (`distribute._zygote`)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "distribute._zygote"],
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
                "launch.run's preloaded interpreter (python -m distribute._zygote) failed to "
                f"start; its output:\n{self._stderr_text()}\nUse start='fresh' to start "
                "each worker as a new interpreter instead."
            )
        threading.Thread(target=self._read_replies, name="launch-zygote", daemon=True).start()

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
                        "launch.run's preloaded interpreter exited before starting a worker; "
                        f"its output:\n{self._stderr_text()}"
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


_zygotes: dict[tuple[str, ...], _Zygote] = {}
_zygotes_lock = threading.Lock()


def _spawn_preloaded(
    payload: Path, result: Path, worker_env: Mapping[str, str], log: Path
) -> _ForkedWorker:
    """Forks a worker from the preloaded interpreter for this environment (less
    `_PER_CALL_VARIABLES`: the per-rank ones, pytest's name of the running test),
    started on first use; idle ones beyond `_PRELOADED_KEPT` are ended, the least
    recently used first (never one between being chosen and forking)."""
    base = {k: v for k, v in worker_env.items() if k not in _PER_CALL_VARIABLES}
    key = (sys.executable, *sorted(f"{k}={v}" for k, v in base.items()))
    with _zygotes_lock:
        zygote = _zygotes.pop(key, None)
        if zygote is None or not zygote.alive:
            if zygote is not None:
                zygote.close()
            zygote = _Zygote(base)
        _zygotes[key] = zygote  # most recently used last
        worker = zygote.spawn([str(payload), str(result), str(zygote.pid)], worker_env, log)
        idle = [k for k, z in _zygotes.items() if k != key and not z.busy]
        for old in idle[: max(0, len(_zygotes) - _PRELOADED_KEPT)]:
            _zygotes.pop(old).close()
        return worker


@atexit.register
def _close_preloaded() -> None:
    with _zygotes_lock:
        while _zygotes:
            _zygotes.popitem()[1].close()


def _kill(procs: Sequence[_Worker]) -> None:
    """Kills every worker still running, with its children, and reaps them."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
    for proc in procs:
        proc.wait()


def _wait(
    procs: Sequence[_Worker],
    logs: Sequence[Path],
    results: Sequence[Path],
    timeout: float | None,
    allow_missing: bool,
) -> None:
    """Returns when every worker exited with a result; raises on the first failure."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        running: list[int] = []
        failures: list[str] = []
        for rank, proc in enumerate(procs):
            code = proc.poll()
            if code is None:
                running.append(rank)
                continue
            failure = _failure(rank, code, _read(results[rank]), logs[rank], allow_missing)
            if failure is not None:
                failures.append(failure)
        if failures:
            also = f"\n(other ranks had failed too by then: {len(failures) - 1})"
            raise WorkerError(failures[0] + (also if len(failures) > 1 else ""))
        if not running:
            return
        if deadline is not None and time.monotonic() > deadline:
            raise WorkerError(
                f"launch.run timed out after {timeout} s; ranks {running} were still running "
                f"and were killed. Raise the timeout if the work is legitimately slow. Last "
                f"output of rank {running[0]}:\n{_tail(logs[running[0]])}"
            )
        time.sleep(_POLL_SECONDS)


def _failure(
    rank: int, code: int, outcome: dict[str, Any] | None, log: Path, allow_missing: bool
) -> str | None:
    """The error message for an exited worker, or None when it succeeded."""
    if outcome is not None and not outcome["ok"]:
        return (
            f"worker rank {rank} raised {outcome['type']}: {outcome['message']}\n"
            f"--- traceback of rank {rank} ---\n{outcome['traceback']}"
        )
    if outcome is None and not allow_missing:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"worker rank {rank} {how} without a result; its last output:\n{_tail(log)}"
    if outcome is not None and code != 0:
        return (
            f"worker rank {rank} returned a result but then exited with status {code} (a crash "
            f"while shutting down); its last output:\n{_tail(log)}"
        )
    return None


def _read(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    with open(path, "rb") as f:
        outcome: dict[str, Any] = pickle.load(f)
    return outcome


def _load_result(path: Path) -> Any:
    outcome = _read(path)
    return None if outcome is None else outcome["value"]
