"""Run a function in N fresh worker processes with a ready cluster.

For tests and notebooks. Each worker is a new Python interpreter (spawned with
`subprocess.Popen`, as torchrun starts its workers) whose environment is what
torchrun would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
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

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

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

_LAUNCHERS = ("torchrun", "tf_config")
_POLL_SECONDS = 0.02


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
                procs.append(_start_worker(payload, results[rank], worker_env, logs[rank]))
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


def _start_worker(payload: Path, result: Path, env: Mapping[str, str], log: Path) -> _Worker:
    """Starts one worker: a new interpreter running ``distribute._launch_child`` with
    ``env``, its output in ``log``, leading a process group of its own (killed whole).

    The test suite forks its workers from a preloaded interpreter instead, by
    replacing this function for the session (tests/_preloaded_launch.py); users'
    workers are always new interpreters, as torchrun's are.
    """
    with open(log, "wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distribute._launch_child",
                str(payload),
                str(result),
                str(os.getpid()),
            ],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # one process group per worker: kill it whole
        )


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
