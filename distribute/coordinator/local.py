"""A parameter-server cluster on this machine: ps and worker tasks as local processes.

From Python, this process is the chief::

    with ds.coordinator.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = ds.ParameterServerStrategy(cluster.resolver)
        ...

From one command, a chief script with its ps and worker tasks (the script reads its
cluster from ``TF_CONFIG``, as on a real cluster); with ``--v1``, the compat.v1
style: ps tasks, and the script once per worker::

    python -m distribute.coordinator.launch --workers 2 --ps 1 -- \\
        examples/train_digits.py --strategy parameter_server
    python -m distribute.coordinator.launch --v1 --workers 2 --ps 1 -- \\
        examples/train_digits.py --strategy parameter_server_v1

Each task is a fresh interpreter running ``ds.Server(resolver).join()`` with its own
``TF_CONFIG`` on a free loopback port (``OMP_NUM_THREADS=1`` unless set); this
process's environment is not written.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from distribute.cluster_resolver.simple import SimpleClusterResolver
from distribute.launch import free_ports
from distribute.ps._transport import listening_environment

#: Every task of a local cluster listens on the loopback address.
_HOST = "127.0.0.1"

__all__ = ["LocalCluster", "main"]


class LocalCluster:
    """Starts `num_ps` ps and `num_workers` worker tasks; this process is the chief.

    Args:
        num_workers: worker tasks.
        num_ps: ps tasks.
        env: extra environment variables for the tasks.

    Example::

        with LocalCluster(num_workers=2, num_ps=1) as cluster:
            strategy = ds.ParameterServerStrategy(cluster.resolver)
    """

    def __init__(
        self,
        num_workers: int = 2,
        num_ps: int = 1,
        env: dict[str, str] | None = None,
        *,
        chief: bool = True,
    ) -> None:
        ports = free_ports(int(chief) + num_workers + num_ps)
        addresses = [f"{_HOST}:{p}" for p in ports]
        self.spec: dict[str, list[str]] = {}
        if chief:
            self.spec["chief"] = addresses[:1]
        first = int(chief)
        self.spec["worker"] = addresses[first : first + num_workers]
        self.spec["ps"] = addresses[first + num_workers :]
        # The chief's resolver (TF2 style); without a chief (compat.v1), start each
        # worker's program with `tf_config("worker", i)`.
        self.resolver = SimpleClusterResolver(
            self.spec, task_type="chief" if chief else "worker", task_id=0
        )
        self._env = dict(env or {})
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        for job in ("ps", "worker") if chief else ("ps",):
            for index in range(len(self.spec[job])):
                self.processes[f"{job}_{index}"] = self._start(job, index)

    def tf_config(self, job: str, index: int) -> str:
        """The ``TF_CONFIG`` of task (job, index)."""
        return json.dumps({"cluster": self.spec, "task": {"type": job, "index": index}})

    def _start(self, job: str, index: int) -> subprocess.Popen[bytes]:
        # rpc listens on the tasks' loopback address only, unless the caller chose an
        # interface (NOTE [rpc's listening interface] in ps/_transport.py).
        env = {
            **listening_environment(_HOST),
            **os.environ,
            **self._env,
            "TF_CONFIG": self.tf_config(job, index),
        }
        env.setdefault("OMP_NUM_THREADS", "1")
        return subprocess.Popen(
            [sys.executable, "-m", "distribute.coordinator.serve"],
            env=env,
            start_new_session=True,
        )

    def restart(self, task: str) -> None:
        """Starts task `task` again after it exited (a worker rejoins the running
        cluster; a restarted ps cannot: its variables are gone).

        Raises:
            ValueError: the task is still running.
        """
        proc = self.processes[task]
        if proc.poll() is None:
            raise ValueError(f"{task} is still running (pid {proc.pid}); kill it first")
        job, index = task.rsplit("_", 1)
        self.processes[task] = self._start(job, int(index))

    def kill(self, task: str) -> None:
        """Kills task `task` (``"worker_1"``, ``"ps_0"``) with SIGKILL."""
        proc = self.processes[task]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def wait(self, timeout: float = 30.0) -> dict[str, int | None]:
        """Waits for every task to exit (up to `timeout`); returns exit codes, None
        for a task still running (it is then killed)."""
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for name, proc in self.processes.items():
            try:
                codes[name] = proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                codes[name] = None
                self.kill(name)
        return codes

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait(10.0 if exc[0] is None else 0.01)


def main(argv: list[str] | None = None) -> int:
    """``python -m distribute.coordinator.launch --workers N --ps M -- script.py [args]``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument(
        "--v1",
        action="store_true",
        help="the compat.v1 style: no chief, the script runs once per worker",
    )
    parser.add_argument("script", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    script = [a for a in args.script if a != "--"]
    if not script:
        parser.error("give the chief's (with --v1: every worker's) script after --")
    cluster = LocalCluster(args.workers, args.ps, chief=not args.v1)
    tasks = [("worker", i) for i in range(args.workers)] if args.v1 else [("chief", 0)]
    programs = [
        subprocess.Popen(
            [sys.executable, *script],
            env={
                **listening_environment(_HOST),
                **os.environ,
                "TF_CONFIG": cluster.tf_config(job, index),
            },
        )
        for job, index in tasks
    ]
    code = max(abs(p.wait()) for p in programs)
    codes = cluster.wait(30.0)
    failed = {k: v for k, v in codes.items() if v != 0}
    if failed:
        print(f"tasks that did not exit cleanly: {failed}", file=sys.stderr)
    return code or (1 if failed else 0)
