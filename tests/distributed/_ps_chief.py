"""Chief programs of parameter-server clusters, for tests/distributed/test_parameter_server.py.

rpc is process-global, so the test process never builds a ParameterServerStrategy:
it runs ``python tests/distributed/_ps_chief.py <case>``; the case starts a
`LocalCluster` (this process is its chief), runs its checks, shuts the cluster down
and prints one line ``PS_CHIEF_RESULT <json>`` with what each check observed. A
check that raises is reported as ``{"error": ...}`` and the next check still runs,
so one failure does not hide the others.

Closures are module-level functions of this file; cloudpickle sends them to the
workers by value (this file is ``__main__`` there too).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import distribute as ds
from distribute.launch import free_ports

MARKER = "PS_CHIEF_RESULT "
ROOT = Path(__file__).resolve().parents[2]


def _attempt(coordinator: Any, check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Runs one check; an exception becomes ``{"error": ...}``, and an error left
    pending in the coordinator is cleared so that the next check starts clean."""
    try:
        return check()
    except BaseException as e:
        out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        if coordinator is not None:
            try:
                coordinator.join()
            except BaseException as pending:
                out["pending_error"] = f"{type(pending).__name__}: {pending}"
        return out


def _error(e: BaseException) -> dict[str, str]:
    return {
        "type": type(e).__name__,
        "mro": [c.__name__ for c in type(e).__mro__],
        "message": str(e),
    }


# -- closures (run on the workers) --------------------------------------------------------


def _scaled(var: torch.Tensor, scale: float) -> float:
    return float(var.detach() * scale)


def _total(variables: list[torch.Tensor]) -> float:
    return float(sum(float(v) for v in variables))


def _sleep_then(value: int, seconds: float) -> int:
    time.sleep(seconds)  # a closure's work that takes a while
    return value


def _increment(counter: Any) -> int:
    return int(counter.assign_add(1))


def _increment_slowly(counter: Any, index: int, seconds: float) -> int:
    counter.assign_add(1)
    time.sleep(seconds)  # a closure's work that takes a while
    return index


def _identity(x: Any) -> Any:
    return x


def _boom_later(message: str, seconds: float) -> None:
    """Fails after a while: the closures scheduled right after it are queued by then."""
    time.sleep(seconds)
    _boom(message)


def _boom(message: str) -> None:
    raise ValueError(message)


def _dynamo_imported() -> bool:
    """Whether what a process's first optimizer imports is loaded on this worker."""
    return "torch._dynamo" in sys.modules


def _next_batch(iterator: Iterator[torch.Tensor]) -> list[int]:
    return [int(x) for x in next(iterator)]


def _repeating_batches() -> Iterator[torch.Tensor]:
    """A per-worker dataset: batches [0, 1], [2, 3], [4, 5], [6, 7], again and again."""
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(8)), batch_size=2
    )
    for _ in itertools.count():
        for (batch,) in loader:
            yield batch


def _loader() -> torch.utils.data.DataLoader[Any]:
    """A per-worker dataset: a DataLoader of batches [0, 1], [2, 3], [4, 5], [6, 7]."""
    return torch.utils.data.DataLoader(torch.arange(8), batch_size=2)


def _train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def _embedding_step(
    embedding: torch.nn.Embedding, optimizer: torch.optim.Optimizer, ids: torch.Tensor
) -> list[int]:
    rows = embedding(ids)
    optimizer.zero_grad()
    rows.sum().backward()
    optimizer.step()
    return list(rows.shape)


# -- checks -------------------------------------------------------------------------------


def _scalars(strategy: Any, count: int) -> list[Any]:
    """Variables 1.0, 2.0, ...: the first of the run, so placed from ps_0 on."""
    with strategy.scope():
        return [ds.Variable(float(i + 1)) for i in range(count)]


def check_schedule_join_fetch(coordinator: Any, scalars: list[Any]) -> dict[str, Any]:
    slow = coordinator.schedule(_sleep_then, args=(7, 1.0))
    done_while_running = coordinator.done()
    values = [coordinator.schedule(_scaled, args=(v, 10.0)) for v in scalars]
    total = coordinator.schedule(_total, args=(scalars,))
    keyword = coordinator.schedule(_sleep_then, kwargs={"value": 5, "seconds": 0.0})
    coordinator.join()
    return {
        "done_while_running": done_while_running,
        "done_after_join": coordinator.done(),
        "fetched_list": coordinator.fetch([*values, total]),
        "fetched_nest": coordinator.fetch({"slow": slow, "pair": (keyword, 3)}),
        "remote_fetch": slow.fetch(),
        "remote_get": keyword.get(),
    }


def check_sum_counter(strategy: Any, coordinator: Any, closures: int) -> dict[str, Any]:
    with strategy.scope():
        counter = ds.Variable(0, aggregation=ds.VariableAggregation.SUM)
    returned = [coordinator.schedule(_increment, args=(counter,)) for _ in range(closures)]
    coordinator.join()
    return {
        "read_value": int(counter.read_value()),
        "chief_copy_after_join": int(counter.detach()),
        "returned": sorted(coordinator.fetch(returned)),
    }


def check_remote_value_argument(coordinator: Any) -> dict[str, Any]:
    value = coordinator.schedule(_identity, args=(1,))
    out: dict[str, Any] = {}
    for name, args, kwargs in [
        ("positional", (value,), None),
        ("nested", ([value, 2],), None),
        ("keyword", (), {"x": value}),
    ]:
        try:
            coordinator.schedule(_identity, args=args, kwargs=kwargs)
            out[name] = None
        except Exception as e:
            out[name] = _error(e)
    coordinator.join()
    out["still_works"] = coordinator.schedule(_identity, args=(coordinator.fetch(value),)).fetch()
    return out


def check_per_worker_dataset(coordinator: Any, num_workers: int) -> dict[str, Any]:
    per_worker = coordinator.create_per_worker_dataset(_repeating_batches)
    iterators = iter(per_worker)
    # 4 batches a pass: with 2 x 4 closures one worker runs at least 4, so it sees them all.
    batches = [coordinator.schedule(_next_batch, args=(iterators,)) for _ in range(4 * num_workers)]
    coordinator.join()
    first, second = (
        coordinator.schedule(_identity, args=("a",)),
        coordinator.schedule(_identity, args=("b",)),
    )
    loader_iterators = iter(coordinator.create_per_worker_dataset(_loader))
    from_loader = [coordinator.schedule(_next_batch, args=(loader_iterators,)) for _ in range(4)]
    coordinator.join()
    return {
        "loader_batches": coordinator.fetch(from_loader),
        "iterators_per_worker": len(iterators.values),
        "iterators_type": type(iterators).__name__,
        "batches": coordinator.fetch(batches),
        "fetched_per_worker_values": list(
            coordinator.fetch(ds.coordinator.PerWorkerValues([first, second]))
        ),
    }


def check_training(strategy: Any, coordinator: Any) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 3, generator=generator)
    y = x @ torch.tensor([[1.5], [-2.0], [0.5]]) + 0.3
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        initial = float(torch.nn.functional.mse_loss(model(x), y))
    losses = [
        coordinator.schedule(
            _train_step, args=(model, optimizer, x[i % 16 * 16 :][:16], y[i % 16 * 16 :][:16])
        )
        for i in range(60)
    ]
    coordinator.join()
    with torch.no_grad():
        final = float(torch.nn.functional.mse_loss(model(x), y))
    return {
        "optimizer_type": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "initial_loss": initial,
        "final_loss": final,
        "step_losses": coordinator.fetch(losses),
        "chief_copies": [p.detach().tolist() for p in model.parameters()],
        "read_values": [p.read_value().tolist() for p in model.parameters()],
    }


def check_closure_errors(coordinator: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # join: the error of the last closure to finish surfaces.
    failing = coordinator.schedule(_boom, args=("boom 0",))
    try:
        coordinator.join()
        out["join_last"] = None
    except Exception as e:
        out["join_last"] = _error(e)
    out["failing_fetch_0"] = _fetch_outcome(failing)
    # join: the error surfaces, and the closures queued behind it are cancelled.
    # (the failure comes 0.3 s late, before the other worker's first 0.5 s closure
    # ends: the schedules below happen before it, or the first would raise it)
    failing = coordinator.schedule(_boom_later, args=("boom", 0.3))
    queued = [coordinator.schedule(_sleep_then, args=(i, 0.5)) for i in range(8)]
    try:
        coordinator.join()
        out["join"] = None
    except Exception as e:
        out["join"] = _error(e)
    out["failing_fetch"] = _fetch_outcome(failing)
    out["queued_fetch"] = [_fetch_outcome(v) for v in queued]
    # schedule: the next schedule after the failure is known raises it.
    failing = coordinator.schedule(_boom, args=("boom 2",))
    out["failing_fetch_2"] = _fetch_outcome(failing)
    try:
        coordinator.schedule(_identity, args=(1,))
        out["schedule"] = None
    except Exception as e:
        out["schedule"] = _error(e)
    # done: likewise.
    failing = coordinator.schedule(_boom, args=("boom 3",))
    out["failing_fetch_3"] = _fetch_outcome(failing)
    try:
        out["done"] = coordinator.done()
    except Exception as e:
        out["done"] = _error(e)
    # raised once, the error is cleared: the coordinator goes on.
    try:
        coordinator.join()
        out["join_after_raised"] = "returned"
    except Exception as e:
        out["join_after_raised"] = _error(e)
    out["rescheduled"] = coordinator.schedule(_identity, args=(42,)).fetch()
    return out


def _fetch_outcome(value: Any) -> Any:
    try:
        return {"value": value.fetch()}
    except Exception as e:
        return _error(e)


def check_embedding_lookup_updates_only_its_rows(
    strategy: Any, coordinator: Any, rows: int
) -> dict[str, Any]:
    torch.manual_seed(1)
    reference = torch.nn.Embedding(rows, 4).weight.detach().clone()
    torch.manual_seed(1)
    with strategy.scope():
        embedding = torch.nn.Embedding(rows, 4)
        optimizer = torch.optim.SGD(embedding.parameters(), lr=0.5)
    weight = embedding.weight
    out: dict[str, Any] = {
        "weight_type": type(weight).__name__,
        "is_sharded": isinstance(weight, ds.ShardedVariable),
        "shard_rows": [int(v.shape[0]) for v in getattr(weight, "variables", ())],
        "shard_tasks": [v.handle.task for v in getattr(weight, "variables", ())],
        "initial_equal": bool(torch.equal(weight.read_value(), reference)),
    }
    before = weight.read_value().clone()
    ids = torch.tensor([1, 1, rows // 2, rows - 1])
    lookup = coordinator.schedule(_embedding_step, args=(embedding, optimizer, ids))
    coordinator.join()
    after = weight.read_value()
    out["lookup_shape"] = lookup.fetch()
    out["ids"] = ids.tolist()
    out["before"] = before.tolist()
    out["after"] = after.tolist()
    return out


def check_min_size_partitioner(strategy: Any) -> dict[str, Any]:
    torch.manual_seed(2)
    reference = torch.nn.Embedding(12, 4).weight.detach().clone()
    torch.manual_seed(2)
    with strategy.scope():
        embedding = torch.nn.Embedding(12, 4)  # 192 bytes: 3 shards of 64
        small = ds.Variable(torch.zeros(3))  # 12 bytes: whole
    weight = embedding.weight
    return {
        "is_sharded": isinstance(weight, ds.ShardedVariable),
        "shard_rows": [int(v.shape[0]) for v in getattr(weight, "variables", ())],
        "shard_tasks": [v.handle.task for v in getattr(weight, "variables", ())],
        "initial_equal": bool(torch.equal(weight.read_value(), reference)),
        "small_type": type(small).__name__,
        "small_is_sharded": isinstance(small, ds.ShardedVariable),
    }


class _TaskProcess:
    """A ``serve`` process for `task` of the cluster `spec`; it runs beside the
    checks (its start is mostly imports)."""

    def __init__(self, spec: dict[str, Any], task: dict[str, Any]) -> None:
        self.task = task
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            "TF_CONFIG": json.dumps({"cluster": spec, "task": task}),
        }
        self._start = time.monotonic()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "distribute.coordinator.serve"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def outcome(self) -> dict[str, Any]:
        try:
            _, stderr = self._proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, stderr = self._proc.communicate()
        return {
            "task": self.task,
            "returncode": self._proc.returncode,
            "seconds": time.monotonic() - self._start,
            "stderr_tail": stderr[-1500:],
        }


def _of_another_cluster(cluster: Any, task: dict[str, Any]) -> _TaskProcess:
    """`task` of a cluster with one worker more than `cluster`, the same chief."""
    spec = json.loads(json.dumps(cluster.spec))
    spec["worker"].append(f"127.0.0.1:{free_ports(1)[0]}")
    return _TaskProcess(spec, task)


def _timed_join(coordinator: Any) -> dict[str, Any]:
    """How `coordinator.join()` ended (its error, or None) and how long it took."""
    start = time.monotonic()
    try:
        coordinator.join()
        error = None
    except Exception as e:
        error = _error(e)
    return {"join": error, "seconds": time.monotonic() - start}


def _listening_addresses(pid: int) -> list[str]:
    """The addresses process `pid`'s TCP sockets listen on (from /proc: Linux)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            host = local.split(":")[0]
            if table == "tcp":
                found.append(".".join(str(int(host[i : i + 2], 16)) for i in (6, 4, 2, 0)))
            else:
                found.append("::" if int(host, 16) == 0 else f"ipv6:{host}")
    return sorted(set(found))


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def check_idle_cpu(cluster: Any, seconds: float = 2.0) -> dict[str, Any]:
    """CPU seconds each task of `cluster` used while the cluster sat idle."""
    pids = {name: p.pid for name, p in cluster.processes.items()}
    before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    return {
        "seconds": seconds,
        "cpu": {name: _cpu_seconds(pid) - before[name] for name, pid in pids.items()},
    }


def check_listeners(cluster: Any) -> dict[str, Any]:
    """Where every task of `cluster` (this chief included) listens."""
    pids = {"chief": os.getpid(), **{name: p.pid for name, p in cluster.processes.items()}}
    return {name: _listening_addresses(pid) for name, pid in pids.items()}


# -- cases: one cluster each ----------------------------------------------------------------


def case_one_ps() -> dict[str, Any]:
    """2 workers, 1 ps: scheduling, a SUM counter, datasets, training, errors; a process
    of another cluster beside."""
    with ds.coordinator.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = ds.ParameterServerStrategy(cluster.resolver, timeout_seconds=30)
        coordinator = ds.coordinator.ClusterCoordinator(strategy)
        # one worker more, and this process claims ps 0: rank 4, which no task holds
        intruder = _of_another_cluster(cluster, {"type": "ps", "index": 0})
        scalars = _scalars(strategy, 2)
        out = {
            "warm_start": _attempt(
                coordinator,
                lambda: {"imported": coordinator.fetch([coordinator.schedule(_dynamo_imported)])},
            ),
            "listeners": _attempt(None, lambda: check_listeners(cluster)),
            "idle_cpu": _attempt(None, lambda: check_idle_cpu(cluster)),
            "placement": {"tasks": [v.handle.task for v in scalars]},
            "schedule": _attempt(
                coordinator, lambda: check_schedule_join_fetch(coordinator, scalars)
            ),
            "counter": _attempt(coordinator, lambda: check_sum_counter(strategy, coordinator, 20)),
            "remote_value_argument": _attempt(
                coordinator, lambda: check_remote_value_argument(coordinator)
            ),
            "per_worker_dataset": _attempt(
                coordinator, lambda: check_per_worker_dataset(coordinator, 2)
            ),
            "training": _attempt(coordinator, lambda: check_training(strategy, coordinator)),
            "errors": _attempt(coordinator, lambda: check_closure_errors(coordinator)),
            "another_cluster": _attempt(None, intruder.outcome),
        }
        strategy.shutdown()
        out["exit_codes"] = cluster.wait(30.0)
    return out


def case_two_ps_sharded() -> dict[str, Any]:
    """2 workers, 2 ps, FixedShardsPartitioner(5); a process of another cluster beside."""
    with ds.coordinator.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = ds.ParameterServerStrategy(
            cluster.resolver,
            variable_partitioner=ds.experimental.partitioners.FixedShardsPartitioner(5),
            timeout_seconds=30,
        )
        coordinator = ds.coordinator.ClusterCoordinator(strategy)
        # the extra worker itself: rank 3, which ps_0 holds in this cluster
        intruder = _of_another_cluster(cluster, {"type": "worker", "index": 2})
        scalars = _scalars(strategy, 4)
        out = {
            "placement": {"tasks": [v.handle.task for v in scalars]},
            "schedule": _attempt(
                coordinator, lambda: check_schedule_join_fetch(coordinator, scalars)
            ),
            "embedding": _attempt(
                coordinator,
                lambda: check_embedding_lookup_updates_only_its_rows(strategy, coordinator, 13),
            ),
            "another_cluster": _attempt(None, intruder.outcome),
        }
        out["after_another_cluster"] = _attempt(
            coordinator, lambda: {"value": coordinator.schedule(_identity, args=(3,)).fetch()}
        )
        strategy.shutdown()
        out["exit_codes"] = cluster.wait(30.0)
    return out


def case_worker_failure() -> dict[str, Any]:
    """2 workers, 1 ps: worker_1 is killed while 50 closures run; then worker_0, and
    nothing comes back."""
    closures, timeout = 50, 8.0
    with ds.coordinator.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = ds.ParameterServerStrategy(cluster.resolver, timeout_seconds=timeout)
        coordinator = ds.coordinator.ClusterCoordinator(strategy)

        def run() -> dict[str, Any]:
            with strategy.scope():
                counter = ds.Variable(0, aggregation=ds.VariableAggregation.SUM)
            values = [
                coordinator.schedule(_increment_slowly, args=(counter, i, 0.02))
                for i in range(closures)
            ]
            values[5].fetch()  # a few have run
            cluster.kill("worker_1")
            start = time.monotonic()
            coordinator.join()
            return {
                "closures": closures,
                "join_seconds": time.monotonic() - start,
                "fetched": [v.fetch() for v in values],
                "counter": int(counter.read_value()),
            }

        def all_lost() -> dict[str, Any]:
            cluster.kill("worker_0")
            value = coordinator.schedule(_identity, args=(1,))
            joined = _timed_join(coordinator)
            return {"timeout_seconds": timeout, **joined, "value": _fetch_outcome(value)}

        def back_after_all_lost() -> dict[str, Any]:
            start = time.monotonic()
            cluster.restart("worker_0")
            # nothing was queued when the wait for a worker ran out: no error is left
            value = coordinator.schedule(_identity, args=(9,)).fetch()
            return {"value": value, "seconds": time.monotonic() - start}

        out = {
            "run": _attempt(coordinator, run),
            "all_lost": _attempt(None, all_lost),
            "back_after_all_lost": _attempt(coordinator, back_after_all_lost),
        }
        strategy.shutdown()
        out["exit_codes"] = cluster.wait(30.0)
    return out


def _pid_and_batch(iterator: Iterator[torch.Tensor]) -> tuple[int, list[int]]:
    return os.getpid(), [int(x) for x in next(iterator)]


def _increment_and_pid(counter: Any, seconds: float) -> int:
    time.sleep(seconds)
    counter.assign_add(1)
    return os.getpid()


def case_worker_restart() -> dict[str, Any]:
    """2 workers, 1 ps: worker_1 is killed during 50 closures and restarted; it
    rejoins, its per-worker iterator rebuilt; a second process claiming the live
    worker_0 is refused."""
    closures = 50
    with ds.coordinator.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = ds.ParameterServerStrategy(cluster.resolver, timeout_seconds=30)
        coordinator = ds.coordinator.ClusterCoordinator(strategy)

        def run() -> dict[str, Any]:
            with strategy.scope():
                counter = ds.Variable(0, aggregation=ds.VariableAggregation.SUM)
            iterators = iter(coordinator.create_per_worker_dataset(_repeating_batches))
            values = [
                coordinator.schedule(_increment_slowly, args=(counter, i, 0.02))
                for i in range(closures)
            ]
            values[5].fetch()
            old_pid = cluster.processes["worker_1"].pid
            cluster.kill("worker_1")
            killed = time.monotonic()
            cluster.restart("worker_1")
            new_pid = cluster.processes["worker_1"].pid
            coordinator.join()
            fetched = [v.fetch() for v in values]
            # The restarted worker runs closures again once it has rejoined.
            first_batch_there: list[int] | None = None
            while first_batch_there is None and time.monotonic() - killed < 60:
                results = [
                    coordinator.schedule(_pid_and_batch, args=(iterators,)) for _ in range(4)
                ]
                coordinator.join()
                there = [batch for pid, batch in coordinator.fetch(results) if pid == new_pid]
                first_batch_there = there[0] if there else None
            rejoined_after = time.monotonic() - killed
            before = int(counter.read_value())
            after = [
                coordinator.schedule(_increment_and_pid, args=(counter, 0.05)) for _ in range(20)
            ]
            coordinator.join()
            return {
                "closures": closures,
                "fetched": fetched,
                "counter_after_kill": before,
                "counter_after_rejoin": int(counter.read_value()),
                "old_pid": old_pid,
                "new_pid": new_pid,
                "worker_0_pid": cluster.processes["worker_0"].pid,
                "rejoined_after_seconds": rejoined_after,
                "first_batch_there": first_batch_there,
                "pids_after_rejoin": sorted(set(coordinator.fetch(after))),
            }

        def duplicate() -> dict[str, Any]:
            outcome = _TaskProcess(cluster.spec, {"type": "worker", "index": 0}).outcome()
            return {**outcome, "still": coordinator.schedule(_identity, args=(5,)).fetch()}

        out = {"run": _attempt(coordinator, run), "duplicate": _attempt(coordinator, duplicate)}
        strategy.shutdown()
        out["exit_codes"] = cluster.wait(30.0)
    # worker_1 was worker_1:1 to rpc there; the next cluster's worker_1 is worker_1
    out["next_cluster"] = _attempt(None, lambda: _next_cluster(num_workers=2))
    return out


def case_ps_failure() -> dict[str, Any]:
    """2 workers, 2 ps, MinSizePartitioner; then ps_0 is killed during a run."""
    timeout = 10.0
    partitioner = ds.experimental.partitioners.MinSizePartitioner(min_shard_bytes=64, max_shards=8)
    with ds.coordinator.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = ds.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=partitioner, timeout_seconds=timeout
        )
        coordinator = ds.coordinator.ClusterCoordinator(strategy)
        out: dict[str, Any] = {
            "min_size": _attempt(None, lambda: check_min_size_partitioner(strategy))
        }

        def run() -> dict[str, Any]:
            counter = _counter_on(strategy, "ps_0")
            values = [
                coordinator.schedule(_increment_slowly, args=(counter, i, 0.02)) for i in range(200)
            ]
            values[3].fetch()  # a few have run
            cluster.kill("ps_0")
            joined = _timed_join(coordinator)
            return {"timeout_seconds": timeout, "counter_task": counter.handle.task, **joined}

        def ps_restarted() -> dict[str, Any]:
            return _TaskProcess(cluster.spec, {"type": "ps", "index": 0}).outcome()

        out["run"] = _attempt(None, run)
        out["ps_restarted"] = _attempt(None, ps_restarted)
        strategy.shutdown()
        out["exit_codes"] = cluster.wait(30.0)
    return out


def case_ps_frozen() -> dict[str, Any]:
    """1 worker, 1 ps, a short timeout; the ps is stopped (SIGSTOP: alive, its
    connections open, answering nothing) during a run."""
    timeout = 4.0
    with ds.coordinator.LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = ds.ParameterServerStrategy(cluster.resolver, timeout_seconds=timeout)
        coordinator = ds.coordinator.ClusterCoordinator(strategy)

        def run() -> dict[str, Any]:
            counter = _counter_on(strategy, "ps_0")
            values = [
                coordinator.schedule(_increment_slowly, args=(counter, i, 0.02)) for i in range(50)
            ]
            values[3].fetch()  # a few have run
            os.killpg(cluster.processes["ps_0"].pid, signal.SIGSTOP)
            return {"timeout_seconds": timeout, **_timed_join(coordinator)}

        out: dict[str, Any] = {"run": _attempt(None, run)}
        cluster.kill("ps_0")  # SIGKILL ends a stopped process too
        strategy.shutdown()
        out["exit_codes"] = cluster.wait(30.0)
    return out


def _counter_on(strategy: Any, task: str) -> Any:
    """A SUM counter placed on ps `task` (round-robin: one of the next two is)."""
    with strategy.scope():
        for _ in range(2):
            counter = ds.Variable(0, aggregation=ds.VariableAggregation.SUM)
            if counter.handle.task == task:
                return counter
    raise AssertionError(f"neither of two new variables was placed on {task}")


# -- robustness: what users trip on --------------------------------------------------------


def _build_a_module_inside(x: torch.Tensor) -> float:
    """A closure that builds its own module: it stays local to the worker."""
    return float(torch.nn.Linear(2, 2)(x).sum().detach())


def _sgd_step(model: Any, optimizer: Any) -> None:
    model(torch.ones(1, 1)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _unpicklable() -> Any:
    import threading

    return threading.Lock()  # cannot be pickled, even by cloudpickle


def _padded_lookup(table: Any, optimizer: Any) -> None:
    table(torch.tensor([0, 1, 1])).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _adam_step(dense: Any, rows: Any, adam: Any) -> None:
    loss = dense(torch.tensor([[1.0, 2.0]])).sum() + rows(torch.tensor([1, 3])).pow(2).sum()
    loss.backward()
    adam.step()
    adam.zero_grad()


def _resource_count() -> int:
    """Per-worker objects (datasets, iterators) this worker holds."""
    from distribute.ps import _runtime
    from distribute.ps._variables import ShardedVariable

    resources = _runtime.current().resources.values()
    return sum(not isinstance(r, ShardedVariable) for r in resources)


def case_robustness() -> dict[str, Any]:
    """2 workers, 1 ps: closures that build modules, writes on the chief, a changed
    learning rate, an unsendable result, padding rows, a second strategy, shutdown."""
    with ds.coordinator.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = ds.ParameterServerStrategy(
            cluster.resolver,
            variable_partitioner=ds.experimental.partitioners.FixedShardsPartitioner(2),
            timeout_seconds=30,
        )
        coordinator = ds.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            model = torch.nn.Linear(1, 1, bias=False)
            optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
            table = torch.nn.Embedding(4, 2, padding_idx=0)
            table_optimizer = torch.optim.SGD(table.parameters(), lr=1.0)
        out: dict[str, Any] = {}

        def module_inside() -> dict[str, Any]:
            before = model.weight.read_value().tolist()
            coordinator.schedule(_build_a_module_inside, args=(torch.ones(1, 2),)).fetch()
            return {"before": before, "after": model.weight.read_value().tolist()}

        def chief_writes() -> dict[str, Any]:
            model.load_state_dict({"weight": torch.full((1, 1), 7.0)})
            return {"ps": model.weight.read_value().tolist()}

        def learning_rate() -> dict[str, Any]:
            coordinator.schedule(_sgd_step, args=(model, optimizer)).fetch()
            first = model.weight.read_value().item()
            optimizer.param_groups[0]["lr"] = 0.0
            coordinator.schedule(_sgd_step, args=(model, optimizer)).fetch()
            return {"after_lr_1": first, "after_lr_0": model.weight.read_value().item()}

        def unsendable_result() -> dict[str, Any]:
            value = coordinator.schedule(_unpicklable)
            try:
                value.fetch()
                failure = None
            except Exception as e:
                failure = _error(e)
            try:
                coordinator.join()
            except Exception:
                pass
            later = coordinator.schedule(_identity, args=(5,)).fetch()
            return {"failure": failure, "later": later}

        def unsendable_argument() -> dict[str, Any]:
            import threading

            try:
                coordinator.schedule(_identity, args=(threading.Lock(),))
                failure = None
            except Exception as e:
                failure = _error(e)
            return {"failure": failure, "later": coordinator.schedule(_identity, args=(6,)).fetch()}

        def padding() -> dict[str, Any]:
            before = table.weight.read_value().tolist()
            coordinator.schedule(_padded_lookup, args=(table, table_optimizer)).fetch()
            return {"before": before, "after": table.weight.read_value().tolist()}

        def second_strategy() -> dict[str, Any]:
            try:
                ds.ParameterServerStrategy(cluster.resolver)
                return {"failure": None}
            except Exception as e:
                return {
                    "failure": _error(e),
                    "first_still_works": coordinator.schedule(_identity, args=(3,)).fetch(),
                }

        def checkpoint() -> dict[str, Any]:
            import tempfile

            saved = model.weight.read_value().tolist()
            saved_table = table.weight.read_value().tolist()  # a ShardedVariable
            path = ds.Checkpoint(model=model, table=table).save(tempfile.mkdtemp() + "/ckpt")
            model.weight.assign(torch.full((1, 1), -3.0))
            table.weight.assign(torch.zeros(4, 2))
            ds.Checkpoint(model=model, table=table).restore(path)
            return {
                "saved": saved,
                "ps_after_restore": model.weight.read_value().tolist(),
                "saved_table": saved_table,
                "table_after_restore": table.weight.read_value().tolist(),
            }

        def optimizer_state() -> dict[str, Any]:
            import tempfile

            with strategy.scope():
                dense = torch.nn.Linear(2, 1)
                rows = torch.nn.Embedding(4, 2)  # sharded in 2
                adam = torch.optim.Adam([*dense.parameters(), *rows.parameters()], lr=0.1)

            def weights() -> list[Any]:
                return [p.read_value().tolist() for p in (dense.weight, dense.bias, rows.weight)]

            for _ in range(2):
                coordinator.schedule(_adam_step, args=(dense, rows, adam)).fetch()
            path = ds.Checkpoint(dense=dense, rows=rows, adam=adam).save(
                tempfile.mkdtemp() + "/ckpt"
            )
            coordinator.schedule(_adam_step, args=(dense, rows, adam)).fetch()
            continued = weights()
            for _ in range(3):  # the state moves on
                coordinator.schedule(_adam_step, args=(dense, rows, adam)).fetch()
            ds.Checkpoint(dense=dense, rows=rows, adam=adam).restore(path)
            coordinator.schedule(_adam_step, args=(dense, rows, adam)).fetch()
            # the same model with the table whole (colocated: not sharded)
            with strategy.scope():
                dense_again = torch.nn.Linear(2, 1)
                with strategy.extended.colocate_vars_with(dense_again.weight):
                    whole = torch.nn.Embedding(4, 2)
                adam_again = torch.optim.Adam([*dense_again.parameters(), *whole.parameters()])
            try:
                ds.Checkpoint(dense=dense_again, rows=whole, adam=adam_again).restore(path)
                other_sharding = None
            except Exception as e:
                other_sharding = _error(e)
            return {"continued": continued, "resumed": weights(), "other_sharding": other_sharding}

        def iterators_freed() -> dict[str, Any]:
            import gc

            dataset = coordinator.create_per_worker_dataset(_repeating_batches)
            for _ in range(5):  # an epoch's iterator each time, the last one dropped
                iterator = iter(dataset)
                coordinator.schedule(_next_batch, args=(iterator,)).fetch()
                del iterator
                gc.collect()
            coordinator.join()
            return {"counts": [coordinator.schedule(_resource_count).fetch() for _ in range(4)]}

        out["module_inside"] = _attempt(coordinator, module_inside)
        out["iterators_freed"] = _attempt(coordinator, iterators_freed)
        out["optimizer_state"] = _attempt(coordinator, optimizer_state)
        out["checkpoint"] = _attempt(coordinator, checkpoint)
        out["chief_writes"] = _attempt(coordinator, chief_writes)
        out["learning_rate"] = _attempt(coordinator, learning_rate)
        out["unsendable_result"] = _attempt(coordinator, unsendable_result)
        out["unsendable_argument"] = _attempt(coordinator, unsendable_argument)
        out["padding"] = _attempt(coordinator, padding)
        out["second_strategy"] = _attempt(coordinator, second_strategy)
        strategy.shutdown()
        try:
            coordinator.schedule(_identity, args=(1,))
            out["after_shutdown"] = {"failure": None}
        except Exception as e:
            out["after_shutdown"] = {"failure": _error(e)}
        out["exit_codes"] = cluster.wait(30.0)
    out["next_cluster"] = _attempt(None, _next_cluster)
    return out


def _next_cluster(num_workers: int = 1) -> dict[str, Any]:
    """After a shutdown, this process starts another cluster; which processes ran
    its closures."""
    start = time.monotonic()
    with ds.coordinator.LocalCluster(num_workers=num_workers, num_ps=1) as cluster:
        strategy = ds.ParameterServerStrategy(cluster.resolver, timeout_seconds=30)
        coordinator = ds.coordinator.ClusterCoordinator(strategy)
        value = coordinator.schedule(_identity, args=(11,)).fetch()
        seconds = time.monotonic() - start
        pids = [coordinator.schedule(_sleep_then_pid, args=(0.2,)) for _ in range(3 * num_workers)]
        ran_on = sorted(set(coordinator.fetch(pids)))
        workers = sorted(
            p.pid for name, p in cluster.processes.items() if name.startswith("worker")
        )
        strategy.shutdown()
        return {
            "value": value,
            "seconds": seconds,
            "ran_on_every_worker": ran_on == workers,
            "exit_codes": cluster.wait(30.0),
        }


def _sleep_then_pid(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "one_ps": case_one_ps,
    "two_ps_sharded": case_two_ps_sharded,
    "worker_failure": case_worker_failure,
    "worker_restart": case_worker_restart,
    "ps_failure": case_ps_failure,
    "ps_frozen": case_ps_frozen,
    "robustness": case_robustness,
}


def main(argv: list[str]) -> int:
    (case,) = argv
    start = time.monotonic()
    try:
        result = CASES[case]()
    except BaseException as e:
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    result["case_seconds"] = time.monotonic() - start
    print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
