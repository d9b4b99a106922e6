"""The multi-worker lifecycle: start-up bounded by its timeout, clusters that do not
match named, restarts, repeated strategies on one port, Ctrl-C and killed launchers.

Real processes on 127.0.0.1 only; an unreachable rank 0 is a closed loopback port.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import distribute as ds
from distribute import launch
from distribute.collectives._rendezvous import rendezvous
from distribute.errors import CollectiveTimeoutError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- start-up: every wait ends within its bound ---------------------------------------


def test_rank_0_that_never_starts_is_reported_within_the_bound() -> None:
    port = _free_port()  # closed: nobody serves it
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"could not reach .* bound") as info:
        rendezvous(1, 2, "127.0.0.1", port, timeout_seconds=2.0, min_wait_seconds=2.0)
    elapsed = time.monotonic() - start
    assert elapsed < 2.0 + 5.0, elapsed  # the 2 s bound (before: at least 30 s, then more)
    assert "rank 0 started" in str(info.value)


def test_a_port_that_accepts_and_never_answers_cannot_block_a_rank() -> None:
    """Another program holds rank 0's port: it accepts connections and says nothing."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match="no rendezvous store answered"):
            rendezvous(1, 2, "127.0.0.1", listener.getsockname()[1], 2.0, min_wait_seconds=2.0)
        assert time.monotonic() - start < 2.0 + 5.0  # before: blocked for good
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        listener.close()


# -- clusters that do not match --------------------------------------------------------

_WORKER = """
import json, sys
import distribute as ds
try:
    options = ds.experimental.CommunicationOptions(timeout_seconds=float(sys.argv[1]))
    strategy = ds.MultiWorkerMirroredStrategy(communication_options=options)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.read()  # the test says when to finish (it closes stdin)
    strategy.shutdown()
    print(json.dumps({"ok": True}))
except Exception as e:
    print(json.dumps({"ok": False, "type": type(e).__name__, "message": str(e)}))
"""


def _tf_config(workers: list[str], index: int) -> str:
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})


def _start(config: str, timeout: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(timeout)],
        env={**ENV, "TF_CONFIG": config},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def _finish(procs: list[subprocess.Popen[str]], limit: float = 60.0) -> list[dict[str, Any]]:
    """Closes every task's stdin; returns the last line each printed (all must exit)."""
    outs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=limit)
            lines = [line for line in stdout.splitlines() if line.startswith("{")]
            assert lines, stderr[-2000:]
            outs.append(json.loads(lines[-1]))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return outs


def _await_ready(procs: list[subprocess.Popen[str]]) -> None:
    """Waits until each task has passed the rendezvous (its first line)."""
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert json.loads(line) == {"ready": True}, line


def test_tasks_started_with_different_worker_lists_name_the_difference() -> None:
    a, b, c = (f"127.0.0.1:{_free_port()}" for _ in range(3))
    start = time.monotonic()
    procs = [_start(_tf_config([a, b], 0), 60.0), _start(_tf_config([a, b, c], 1), 60.0)]
    outs = _finish(procs)
    assert time.monotonic() - start < 45  # well within the 60 s timeout
    for out in outs:
        assert not out["ok"]
        assert out["type"] == "InvalidArgumentError", out
        assert "different clusters" in out["message"] and c in out["message"], out


@pytest.mark.parametrize(
    ("index", "named"),
    [(1, "two processes claim rank 1"), (0, "two tasks claim rank 0")],
    ids=["index-1", "index-0"],
)
def test_a_second_task_claiming_a_running_index_is_named(index: int, named: str) -> None:
    workers = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    running = [_start(_tf_config(workers, i), 20.0) for i in (0, 1)]
    try:
        _await_ready(running)
        (duplicate,) = _finish([_start(_tf_config(workers, index), 20.0)])
    finally:
        outs = _finish(running)
    assert not duplicate["ok"] and named in duplicate["message"], duplicate
    assert outs == [{"ok": True}, {"ok": True}]  # the running job is not disturbed


_TIMED_START = """
import json, sys, time
import distribute as ds
options = ds.experimental.CommunicationOptions(timeout_seconds=float(sys.argv[1]))
start = time.monotonic()
try:
    ds.MultiWorkerMirroredStrategy(communication_options=options).shutdown()
    out = {"ok": True}
except Exception as e:
    out = {"ok": False, "type": type(e).__name__, "message": str(e)}
out["seconds"] = time.monotonic() - start  # in the rendezvous, not importing torch
print(json.dumps(out), flush=True)
"""


def test_two_tasks_started_with_index_0_both_fail_within_seconds_naming_the_duplicate() -> None:
    """Before: the one that served rank 0 waited the whole start-up bound (60 s
    here), then said that rank 1 never joined."""
    workers = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    timeout = 60.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TIMED_START, str(timeout)],
            env={**ENV, "TF_CONFIG": _tf_config(workers, 0)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for _ in range(2)
    ]
    outs = _finish(procs, limit=timeout + 30)
    for out in outs:
        assert not out["ok"] and out["type"] == "InvalidArgumentError", out
        assert "claim rank 0" in out["message"] and "TF_CONFIG" in out["message"], out
        # the other's start (imports on a busy machine) and the probe, not the bound
        assert out["seconds"] < timeout / 3, out


# -- restarts and repeated strategies ----------------------------------------------------


def _cycles(n: int) -> dict[str, Any]:
    """n strategies on the same port, each training with an optimizer, then shut down."""

    def count() -> tuple[int, int]:
        return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))

    after: list[tuple[int, int]] = []
    for _ in range(n):
        strategy = ds.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = torch.nn.Linear(3, 2)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
            model(torch.ones(2, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        strategy.run(step, args=(model, optimizer))
        strategy.run(step, args=(model, optimizer))
        strategy.shutdown()
        after.append(count())
    return {"after": after}


@pytest.mark.slow  # run by CI (.ci/run: -m slow), not by the README's command
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux's /proc")
def test_fifty_strategies_on_one_port_leave_descriptors_and_threads_flat() -> None:
    for out in launch.run(_cycles, 2, args=(50,), launcher="tf_config", timeout=140):
        after = out["after"]
        assert len(after) == 50
        # Flat after the first few (imports settle); a thread or two may be ending.
        fds, threads = zip(*after[9:])
        assert max(fds) - min(fds) <= 2 and max(threads) - min(threads) <= 2, after


_ELASTIC = """
import json, os, sys
import numpy as np
import torch
import distribute as ds

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
strategy = ds.MultiWorkerMirroredStrategy(
    communication_options=ds.experimental.CommunicationOptions(timeout_seconds=60))
torch.manual_seed(0)
with strategy.scope():
    model = ds.Model(torch.nn.Linear(4, 1))
model.compile(optimizer="sgd", loss="mse")

class Epochs(ds.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.run = []

    def on_epoch_begin(self, epoch, logs=None):
        self.run.append(epoch)
        if attempt == 0 and epoch == 2 and strategy.worker_index == 1:
            os._exit(3)  # dies mid-training; the agent restarts every worker

x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(16, 4)
epochs = Epochs()
backup = ds.callbacks.BackupAndRestore(sys.argv[1])  # epochs 0 and 1 are backed up
model.fit(x, x.sum(1, keepdims=True), batch_size=8, epochs=4, verbose=0,
          callbacks=[backup, epochs])
strategy.shutdown()
second = ds.MultiWorkerMirroredStrategy()  # a second strategy in the same process
total = float(second.reduce("sum", torch.tensor(1.0), axis=None))
if second.is_chief:
    print(json.dumps({"attempt": attempt, "epochs": epochs.run, "second": total}))
second.shutdown()
"""


def test_torchrun_elastic_restart_resumes_from_its_backup_and_trains_to_the_end(
    tmp_path: Path,
) -> None:
    script = tmp_path / "elastic.py"
    script.write_text(_ELASTIC)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(script),
        str(tmp_path / "backup"),
    ]
    # The agent's store keeps the dead attempt's keys: attempt 1 must not read them.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert [line["attempt"] for line in lines] == [1], proc.stdout
    assert lines[0]["epochs"] == [2, 3]  # resumed from BackupAndRestore, not from epoch 0
    assert lines[0]["second"] == 2.0  # the second strategy met both workers
    assert "failed to bind" not in proc.stderr, proc.stderr[-2000:]


# -- Ctrl-C and killed launchers -------------------------------------------------------

_INTERRUPTED = """
import json, os, signal, sys, threading, time
# A background job of a non-interactive shell (a CI runner) starts with SIGINT
# ignored, and Python then installs no KeyboardInterrupt handler: Ctrl-C needs it.
signal.signal(signal.SIGINT, signal.default_int_handler)
import torch
from distribute.cluster_resolver import resolve_cluster
from distribute.collectives.process_group import ProcessGroupCollectives
from distribute._enums import ReduceOp

r = resolve_cluster()
c = ProcessGroupCollectives.create(r.rank, r.world_size, r.master_addr, r.master_port,
                                   timeout_seconds=60)
c.all_reduce([torch.ones(1)], ReduceOp.SUM, name="warm-up")
if r.rank == 1:
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    print(json.dumps({"interrupt_at": time.time()}), flush=True)
    c.all_reduce([torch.ones(1)], ReduceOp.SUM, name="never joined in time")
else:
    time.sleep(15)  # busy elsewhere; joins after rank 1 is gone
    start = time.monotonic()
    try:
        c.all_reduce([torch.ones(1)], ReduceOp.SUM, name="never joined in time")
        print(json.dumps({"error": None}))
    except Exception as e:
        print(json.dumps({"error": str(e), "seconds": time.monotonic() - start}))
"""


@pytest.mark.slow  # run by CI (.ci/run: -m slow), not by the README's command
def test_ctrl_c_in_a_collective_exits_at_once_and_the_peer_names_it_gone() -> None:
    workers = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _INTERRUPTED],
            env={**ENV, "TF_CONFIG": _tf_config(workers, i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for i in range(2)
    ]
    try:
        out1, err1 = procs[1].communicate(timeout=60)
        exited = time.time()
        out0, err0 = procs[0].communicate(timeout=90)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert "KeyboardInterrupt" in err1, (procs[1].returncode, out1[-500:], err1[-2000:])
    interrupt_at = json.loads(out1.splitlines()[0])["interrupt_at"] + 1.0
    # Before: rank 1 lived until rank 0 joined, 14 s later.
    assert exited - interrupt_at < 8.0, (exited - interrupt_at, err1[-2000:])
    result = json.loads([x for x in out0.splitlines() if x.startswith("{")][-1])
    assert result["error"] is not None and "rank 1 is dead" in result["error"], err0[-2000:]
    assert result["seconds"] < 10.0  # named as gone at once, not at the 60 s timeout


_PARENT = """
import sys, time
from _preloaded_launch import starting
from distribute import launch

def hold():
    import os
    with open(f"worker-{os.getpid()}.pid", "w") as f:
        f.write(str(os.getppid()))  # this worker's parent: the launcher or its zygote
    time.sleep(120)  # a long step; the parent is killed meanwhile

if __name__ == "__main__":
    with starting(sys.argv[1]):
        launch.run(hold, 2, timeout=200)
"""


@pytest.mark.parametrize("start", ["fresh", "preloaded"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_launcher_leaves_no_temporary_directory_and_no_workers(
    tmp_path: Path, sig: int, start: str
) -> None:
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    temp = tmp_path / "tmp"
    temp.mkdir()
    tests = Path(__file__).parent.parent  # tests/_preloaded_launch.py: the fork server
    parent = subprocess.Popen(
        [sys.executable, str(script), start],
        env={**ENV, "TMPDIR": str(temp), "PYTHONPATH": os.pathsep.join([str(tests), str(ROOT)])},
        cwd=tmp_path,
    )
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("worker-*.pid"))) < 2:
        assert time.monotonic() < deadline, "the launcher never started its workers"
        time.sleep(0.05)
    time.sleep(0.2)  # the workers are in their function
    parent.send_signal(sig)
    parent.wait(30)
    deadline = time.monotonic() + 15
    while list(temp.glob("distribute-launch-*")):
        assert time.monotonic() < deadline, list(temp.iterdir())
        time.sleep(0.1)
    # Every worker, and the preloaded interpreter that forked them, is gone too.
    pids = {int(p.stem.split("-")[1]) for p in tmp_path.glob("worker-*.pid")}
    pids |= {int(p.read_text()) for p in tmp_path.glob("worker-*.pid")} - {parent.pid}
    assert len(pids) == (2 if start == "fresh" else 3), pids
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, [pid for pid in pids if _alive(pid)]
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- uneven data across workers ------------------------------------------------------------


def _empty_shard() -> dict[str, Any]:
    """3 workers; worker 2's dataset_fn yields nothing, the others 3 and 5 batches."""
    strategy = ds.MultiWorkerMirroredStrategy()
    rank = strategy.worker_index
    sizes = {0: 3, 1: 5, 2: 0}

    def dataset_fn(ctx: ds.InputContext) -> list[torch.Tensor]:
        pid = ctx.input_pipeline_id
        return [torch.full((2, 3), float(10 * pid + i)) for i in range(sizes[pid])]

    seen: list[float] = []
    shapes: list[tuple[int, ...]] = []
    for batch in strategy.distribute_datasets_from_function(dataset_fn):
        shapes.append(tuple(batch.shape))
        seen.extend(batch[:, 0].tolist())
        total = strategy.reduce("sum", strategy.run(lambda b: b.sum(), args=(batch,)), axis=None)
        assert total.item() >= 0
    strategy.shutdown()
    return {"rank": rank, "seen": seen, "shapes": shapes}


def test_a_worker_with_an_empty_shard_takes_empty_steps_while_others_have_data() -> None:
    outs = launch.run(_empty_shard, 3, timeout=120)
    assert [len(o["shapes"]) for o in outs] == [5, 5, 5]  # the longest worker's steps
    assert outs[2]["shapes"] == [(0, 3)] * 5  # empty batches shaped like the others'
    assert sorted(outs[0]["seen"]) == sorted(float(i) for i in range(3) for _ in range(2))
    assert sorted(outs[1]["seen"]) == sorted(float(10 + i) for i in range(5) for _ in range(2))


def _uneven_loaders() -> list[str]:
    strategy = ds.MultiWorkerMirroredStrategy()
    n = 100 if strategy.worker_index == 0 else 60
    loader = torch.utils.data.DataLoader(torch.arange(float(n)), batch_size=10)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = sum(1 for _ in strategy.experimental_distribute_dataset(loader))
    strategy.shutdown()
    assert steps == 10
    return [str(w.message) for w in caught]


def test_workers_whose_loaders_differ_in_length_are_warned_of_the_data_not_read() -> None:
    for messages in launch.run(_uneven_loaders, 2, timeout=120):
        assert any("differ in length" in m and "50%" in m for m in messages), messages


# -- shared process groups and collected strategies (issue #36) ---------------------------


def _strategy_of_kind(kind: str) -> Any:
    if kind == "MultiWorkerMirrored":
        return ds.MultiWorkerMirroredStrategy()
    if kind == "FullySharded":
        return ds.experimental.FullyShardedStrategy()
    mesh = ds.experimental.DeviceMesh((2,), ("batch",))
    return ds.experimental.ModelParallelStrategy(ds.experimental.LayoutMap(mesh))


_REBINDINGS = [
    ("MultiWorkerMirrored", "MultiWorkerMirrored", "first"),
    ("MultiWorkerMirrored", "MultiWorkerMirrored", "second"),
    ("MultiWorkerMirrored", "ModelParallel", "first"),
    ("MultiWorkerMirrored", "ModelParallel", "second"),
    ("MultiWorkerMirrored", "FullySharded", "first"),
    ("MultiWorkerMirrored", "FullySharded", "second"),
]


def _rebound_strategies() -> list[dict[str, Any]]:
    """For each of `_REBINDINGS`: two strategies over one default group (the second
    adopts the group the first created), one dropped and collected, a collective on
    the other, then that one dropped too."""
    import torch.distributed as dist

    outs = []
    for first, second, dropped in _REBINDINGS:
        strategies = [_strategy_of_kind(first), _strategy_of_kind(second)]
        gone = weakref.ref(strategies.pop(0 if dropped == "first" else 1))
        gc.collect()
        out: dict[str, Any] = {"dropped collected": gone() is None}
        try:
            total = strategies[0].reduce("sum", torch.tensor(1.0), axis=None)
            out["sum"] = float(total)
        except Exception as e:  # before: torch's "Default process group has not been ..."
            out["error"] = f"{type(e).__name__}: {e}"
        out["group alive"] = dist.is_initialized()
        last = weakref.ref(strategies.pop())
        gc.collect()
        out["last collected"] = last() is None
        out["destroyed by the last"] = not dist.is_initialized()
        outs.append(out)
    return outs


def test_strategies_rebound_and_collected_in_any_order_share_the_group_until_the_last() -> None:
    for outs in launch.run(_rebound_strategies, 2, launcher="tf_config", timeout=140):
        for case, out in zip(_REBINDINGS, outs):
            assert out == {
                "dropped collected": True,
                "sum": 2.0,
                "group alive": True,
                "last collected": True,
                "destroyed by the last": True,
            }, (case, out)


def _fit_then_dropped() -> dict[str, Any]:
    import numpy as np
    import torch.distributed as dist

    strategy = ds.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = ds.Model(torch.nn.Linear(4, 1))
    model.compile(optimizer="sgd", loss="mse")
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(16, 4)
    model.fit(x, x.sum(1, keepdims=True), batch_size=8, epochs=2, verbose=0)
    ref = weakref.ref(strategy)
    del strategy, model
    gc.collect()  # one collection (before: never, the optimizer's plan held it)
    return {"collected": ref() is None, "group destroyed": not dist.is_initialized()}


def test_a_multi_worker_strategy_that_ran_fit_is_collected_once_out_of_reach() -> None:
    for out in launch.run(_fit_then_dropped, 2, launcher="tf_config", timeout=120):
        assert out == {"collected": True, "group destroyed": True}, out
