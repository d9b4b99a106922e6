"""The local launcher: worker processes with a cluster in their environment, started
as new interpreters ("fresh", what `launch.run` does) or, under the test suite's
plugin (tests/_preloaded_launch.py), forked from a preloaded one ("preloaded")."""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from _preloaded_launch import starting

from distribute import launch
from distribute.cluster_resolver import resolve_cluster
from distribute.errors import InvalidArgumentError, WorkerError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(60)]

ENV = {"OMP_NUM_THREADS": "1"}
STARTS = pytest.mark.parametrize("start", ["fresh", "preloaded"])


def _run(*args: Any, start: str, **kwargs: Any) -> list[Any]:
    """`launch.run`, its workers started ``start``-wise."""
    with starting(start):
        return launch.run(*args, **kwargs)


def _describe_worker(x: int, *, scale: int) -> dict[str, Any]:
    resolver = resolve_cluster()
    assert resolver is not None, "the launcher did not set up a cluster"
    return {
        "value": x * scale,
        "rank": resolver.rank,
        "world_size": resolver.world_size,
        "local": (resolver.local_rank, resolver.local_world_size),
        "master": (resolver.master_addr, resolver.master_port),
        "task": (resolver.task_type, resolver.task_id),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "extra": os.environ.get("DISTRIBUTE_TEST_EXTRA"),
        "pid": os.getpid(),
    }


@STARTS
def test_torchrun_launch_returns_results_in_rank_order_with_a_shared_master(start: str) -> None:
    results = _run(
        _describe_worker,
        3,
        args=(7,),
        kwargs={"scale": 2},
        env={"DISTRIBUTE_TEST_EXTRA": "yes"},
        start=start,
    )
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["value"] == 14 and r["world_size"] == 3 for r in results)
    assert [r["local"] for r in results] == [(0, 3), (1, 3), (2, 3)]
    assert len({r["master"] for r in results}) == 1
    assert results[0]["master"][0] == "127.0.0.1"
    omp = os.environ.get("OMP_NUM_THREADS", "1")  # 1 unless the caller set it
    assert all(r["omp"] == omp and r["extra"] == "yes" for r in results)
    assert len({r["pid"] for r in results}) == 3 and os.getpid() not in {r["pid"] for r in results}


@STARTS
def test_tf_config_launch_gives_each_worker_its_task_and_worker_zero_as_master(start: str) -> None:
    results = _run(
        _describe_worker, 2, args=(1,), kwargs={"scale": 1}, launcher="tf_config", start=start
    )
    assert [r["task"] for r in results] == [("worker", 0), ("worker", 1)]
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["master"] == results[1]["master"]
    assert results[0]["master"][0] == "127.0.0.1"


def _fail_on_rank_one(pid_dir: str) -> int:
    resolver = resolve_cluster()
    assert resolver is not None
    Path(pid_dir, f"{resolver.rank}.pid").write_text(str(os.getpid()))
    if resolver.rank == 1:
        raise ValueError("bad batch on rank one")
    threading.Event().wait()  # blocks until the launcher kills it
    return resolver.rank


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@STARTS
def test_a_worker_exception_is_reraised_with_rank_and_traceback_and_the_others_killed(
    tmp_path: Path, start: str
) -> None:
    with pytest.raises(WorkerError) as info:
        _run(_fail_on_rank_one, 2, args=(str(tmp_path),), timeout=30, env=ENV, start=start)
    message = str(info.value)
    assert "worker rank 1 raised ValueError: bad batch on rank one" in message
    assert "--- traceback of rank 1 ---" in message and "_fail_on_rank_one" in message
    assert not _is_running(int((tmp_path / "0.pid").read_text()))


def _crash_on_rank_one() -> str:
    resolver = resolve_cluster()
    assert resolver is not None
    if resolver.rank == 1:
        print("about to crash", flush=True)
        os._exit(3)
    return "survived"


def test_a_crashed_worker_is_reported_with_its_status_and_output() -> None:
    with pytest.raises(WorkerError, match=r"worker rank 1 exited with status 3 without a result"):
        try:
            launch.run(_crash_on_rank_one, 2, timeout=30, env=ENV)
        except WorkerError as exc:
            assert "about to crash" in str(exc)  # its last output
            raise
    # allow_missing lets the survivors finish: the crashed rank gives None.
    assert launch.run(_crash_on_rank_one, 2, timeout=30, allow_missing=True) == ["survived", None]


def _block_forever(pid_dir: str) -> None:
    resolver = resolve_cluster()
    assert resolver is not None
    Path(pid_dir, f"{resolver.rank}.pid").write_text(str(os.getpid()))
    threading.Event().wait()


# Long enough for both workers to start and write their pids on a busy 2-core machine
# (3 s was not, for new interpreters importing torch under a full suite).
@pytest.mark.slow  # run by CI (.ci/run: -m slow), not by the README's command
@pytest.mark.parametrize("start,timeout", [("fresh", 12.0), ("preloaded", 6.0)])
def test_the_timeout_kills_every_worker_and_names_the_ranks_still_running(
    tmp_path: Path, start: str, timeout: float
) -> None:
    expected = rf"timed out after {timeout} s; ranks \[0, 1\] were still"
    with pytest.raises(WorkerError, match=expected):
        _run(_block_forever, 2, args=(str(tmp_path),), timeout=timeout, env=ENV, start=start)
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("*.pid"))]
    assert len(pids) == 2 and not any(_is_running(p) for p in pids)


def test_functions_that_cannot_be_sent_by_reference_are_refused_before_any_start() -> None:
    with pytest.raises(InvalidArgumentError, match="module-level function"):
        launch.run(lambda: 1, 2)
    with pytest.raises(InvalidArgumentError, match="launcher must be one of"):
        launch.run(_describe_worker, 2, launcher="mpirun")
    with pytest.raises(InvalidArgumentError, match="num_workers must be at least 1"):
        launch.run(_describe_worker, 0)


_WITHOUT_THE_PLUGIN = """
import os
from distribute import launch
from test_launch import _parent_pid

print(sorted(set(launch.run(_parent_pid, 2, timeout=60))), os.getpid())
"""


def test_outside_the_test_suite_launch_run_starts_new_interpreters_as_users_run(
    tmp_path: Path,
) -> None:
    """The package has no fork server: a script's workers are its own children."""
    script = tmp_path / "plain.py"
    script.write_text(_WITHOUT_THE_PLUGIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stderr[-3000:]
    parents, launcher = done.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert parents == f"[{launcher}]"


# -- the preloaded start (the test suite's plugin) ----------------------------------------


def _import_time_state() -> dict[str, Any]:
    import numpy as np
    import torch

    return {
        "threads": torch.get_num_threads(),  # the OpenMP runtime read OMP_NUM_THREADS at load
        "numpy": float(np.random.rand()),  # NumPy's global generator, never seeded here
        "torch_seed": torch.initial_seed(),
    }


def test_preloaded_workers_see_at_import_the_environment_new_interpreters_would() -> None:
    fresh = _run(_import_time_state, 2, env={"OMP_NUM_THREADS": "2"}, start="fresh")
    one = _run(_import_time_state, 2, env={"OMP_NUM_THREADS": "1"}, start="preloaded")
    two = _run(_import_time_state, 2, env={"OMP_NUM_THREADS": "2"}, start="preloaded")
    assert [r["threads"] for r in fresh] == [2, 2]
    # One preloaded interpreter per environment: the thread count follows the variable.
    assert [r["threads"] for r in one] == [1, 1] and [r["threads"] for r in two] == [2, 2]
    # Every worker's torch and NumPy generators are seeded afresh, as in a new interpreter.
    for field in ("numpy", "torch_seed"):
        draws = [r[field] for r in fresh + one + two]
        assert len(set(draws)) == len(draws), (field, draws)


_LEFT_OPEN: list[Any] = []


def _exit_work(out_dir: str) -> int:
    import atexit
    import time

    resolver = resolve_cluster()
    assert resolver is not None
    rank = resolver.rank

    def late() -> None:
        time.sleep(0.3)
        Path(out_dir, f"thread-{rank}").write_text("done")

    atexit.register(lambda: Path(out_dir, f"atexit-{rank}").write_text("done"))
    threading.Thread(target=late, daemon=False).start()
    left_open = open(Path(out_dir, f"file-{rank}"), "w")  # never closed
    _LEFT_OPEN.append(left_open)
    left_open.write("buffered")  # flushed by nothing but the exit
    # A thread pool never shut down: the exit must wake its idle threads, not hang.
    pool = concurrent.futures.ThreadPoolExecutor(2)
    _LEFT_OPEN.append(pool)
    assert pool.submit(lambda: rank).result() == rank
    # C's stdio, buffered in the process (fully, as for any file, the interpreter not
    # running unbuffered): the exit flushes it.
    c_out = os.open(Path(out_dir, f"c-stdio-{rank}"), os.O_WRONLY | os.O_CREAT)
    os.dup2(c_out, 1)
    ctypes.CDLL(None).printf(b"from C stdio")
    return rank


@STARTS
def test_a_worker_exits_as_an_interpreter_does_threads_joined_atexit_run_files_flushed(
    tmp_path: Path, start: str
) -> None:
    buffered = {"PYTHONUNBUFFERED": ""}  # empty: unset (this machine sets it)
    ran = _run(_exit_work, 2, args=(str(tmp_path),), timeout=30, env=buffered, start=start)
    assert ran == [0, 1]
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("c-stdio"))
    assert names == ["atexit-0", "atexit-1", "file-0", "file-1", "thread-0", "thread-1"]
    assert {(tmp_path / f"file-{r}").read_text() for r in (0, 1)} == {"buffered"}
    assert {(tmp_path / f"c-stdio-{r}").read_text() for r in (0, 1)} == {"from C stdio"}


def _parent_pid() -> int:
    return os.getppid()


def test_one_preloaded_interpreter_serves_every_call_with_the_same_environment() -> None:
    def parents(extra: dict[str, str]) -> set[int]:
        return set(_run(_parent_pid, 2, env=extra, timeout=60, start="preloaded"))

    first = parents({"PYTEST_CURRENT_TEST": "a (call)"})
    # pytest's name of the running test differs from call to call and is read by
    # nothing at import: the same interpreter forks both calls' workers.
    assert len(first) == 1 and parents({"PYTEST_CURRENT_TEST": "b (call)"}) == first
    assert first != {os.getpid()}
    # Any other difference gets an interpreter of its own.
    assert parents({"DISTRIBUTE_TEST_EXTRA": "other"}).isdisjoint(first)


_IGNORING_SIGCHLD = """
import signal, sys
from distribute import launch
from test_launch import _run, _sigchld_disposition

signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # a parent that never waits for children
print(_run(_sigchld_disposition, 2, timeout=60, start=sys.argv[1]))
"""


def _sigchld_disposition() -> str:
    import signal

    return "ignored" if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN else "default"


@STARTS
def test_a_launcher_ignoring_sigchld_still_gets_its_results(tmp_path: Path, start: str) -> None:
    # The kernel reaps children of a process that ignores SIGCHLD; the preloaded
    # interpreter must still see its workers exit, and they inherit the disposition
    # as from exec.
    script = tmp_path / "ignoring.py"
    script.write_text(_IGNORING_SIGCHLD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = subprocess.run(
        [sys.executable, str(script), start], env=env, capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "['ignored', 'ignored']"
