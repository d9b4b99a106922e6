"""Run a function in N fresh worker processes with a ready cluster.

For tests and notebooks: each worker is a new Python interpreter (spawned, never
forked) whose environment is what torchrun (or a ``TF_CONFIG``) would give it, so
``ds.MultiWorkerMirroredStrategy()`` inside the function finds its cluster. The
function is pickled by reference (define it at module level); its return value
comes back pickled. A worker's exception is re-raised here as `WorkerError` naming
its rank, and the other workers are killed.

Example::

    import distribute as ds

    def work():
        strategy = ds.MultiWorkerMirroredStrategy()
        return strategy.cluster_resolver.rank

    if __name__ == "__main__":
        print(ds.launch.run(work, 2))   # [0, 1]
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

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


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on the loopback interface."""
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
    # The child's environment is built here and handed to Popen; os.environ is not written.
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
            "launch.run cannot send a function defined interactively (in a notebook or the "
            "REPL) to new processes; define it in a module and import it."
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
        env: extra environment variables for the workers.
        allow_missing: a worker that exits with status 0 without returning (it
            called ``os._exit(0)``) gives ``None`` instead of an error.

    Returns:
        The workers' return values in rank order.

    Raises:
        WorkerError: a worker raised or crashed (its rank and traceback are in the
            message), or the timeout passed (the ranks still running are named).

    Example::

        results = ds.launch.run(work, 2, args=(3,), timeout=60)
    """
    if num_workers < 1:
        raise InvalidArgumentError(f"num_workers must be >= 1, got {num_workers}.")
    if launcher not in ("torchrun", "tf_config"):
        raise InvalidArgumentError(f"launcher must be 'torchrun' or 'tf_config', got {launcher!r}.")
    with tempfile.TemporaryDirectory(prefix="distribute-launch-") as tmp:
        root = Path(tmp)
        payload = root / "payload.pkl"
        try:
            payload.write_bytes(
                pickle.dumps({"sys_path": list(sys.path), "main_path": _main_path(fn)})
                + pickle.dumps((fn, tuple(args), dict(kwargs or {})))
            )
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise InvalidArgumentError(
                f"launch.run needs a module-level function and picklable arguments: {exc}"
            ) from exc
        ports = free_ports(num_workers if launcher == "tf_config" else 1)
        procs: list[subprocess.Popen[bytes]] = []
        logs = [root / f"worker-{r}.log" for r in range(num_workers)]
        results_paths = [root / f"result-{r}.pkl" for r in range(num_workers)]
        try:
            for rank in range(num_workers):
                with open(logs[rank], "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            [
                                sys.executable,
                                "-m",
                                "distribute._launch_child",
                                str(payload),
                                str(results_paths[rank]),
                            ],
                            env=_worker_env(rank, num_workers, launcher, ports, env or {}),
                            stdout=log,
                            stderr=subprocess.STDOUT,
                        )
                    )
            _wait(procs, logs, results_paths, timeout, allow_missing)
            return [_load_result(p, allow_missing) for p in results_paths]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in procs:
                proc.wait()


def _wait(
    procs: Sequence[subprocess.Popen[bytes]],
    logs: Sequence[Path],
    results: Sequence[Path],
    timeout: float | None,
    allow_missing: bool,
) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        running = []
        for rank, proc in enumerate(procs):
            code = proc.poll()
            if code is None:
                running.append(rank)
                continue
            outcome = _read(results[rank])
            if outcome is not None and not outcome["ok"]:
                raise WorkerError(
                    f"worker rank {rank} raised {outcome['type']}: {outcome['message']}\n"
                    f"--- traceback of rank {rank} ---\n{outcome['traceback']}"
                )
            if code != 0 or (outcome is None and not allow_missing):
                raise WorkerError(
                    f"worker rank {rank} exited with status {code} without a result; its last "
                    f"output:\n{_tail(logs[rank])}"
                )
        if not running:
            return
        if deadline is not None and time.monotonic() > deadline:
            raise WorkerError(
                f"launch.run timed out after {timeout} s; ranks {running} were still running "
                f"and were killed. Last output of rank {running[0]}:\n{_tail(logs[running[0]])}"
            )
        time.sleep(0.05)


def _read(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    with open(path, "rb") as f:
        outcome: dict[str, Any] = pickle.load(f)
    return outcome


def _load_result(path: Path, allow_missing: bool) -> Any:
    outcome = _read(path)
    if outcome is None:
        return None
    return outcome["value"]
