"""The per-step host cost (issue 40): the library's step against its plain baseline.

    python benchmarks/bench_host_cost.py            # ~2 min on 2 cores
    python benchmarks/bench_host_cost.py --quick    # ~40 s
    python benchmarks/bench_host_cost.py --only four_replicas

Each figure pairs the library with its baseline in one process, interleaved
repetition by repetition (order alternating), and prints one JSON line: baseline_ms,
distribute_ms (per step), ratio of the medians, paired_ratio and its quartiles
(paired_ratio_iqr), and the 1-minute load average before the case. Cases:

    one_replica    `MirroredStrategy(["cpu:0"])` and `OneDeviceStrategy("cpu")`:
                   `reduce("sum", run(step))` on the tiny MLP (32-64-10, batch 32),
                   SGD with momentum and Adam, against the same step in plain PyTorch.
                   Goal (issue 40): <= 1.10.
    four_replicas  `MirroredStrategy` over 4 logical CPUs against the same step done
                   as 4 quarter-batches in one plain process (forward and backward of
                   each quarter, gradients accumulated, one optimizer step): what the
                   replicas cost beyond the work they share. The tiny MLP (batch 32,
                   8 a replica) and bench_mirrored.py's MLP 512-1024-1024-512-10
                   (batch 256), SGD with momentum. Goal (issue 40): <= 1.20.
                   Beside them, in the same interleaved run, the replica threads'
                   design in plain PyTorch (`_plain_replicas.py`: 4 threads, a model
                   copy each, one meeting to sum, 4 optimizer steps, no library):
                   ``floor_ratio`` (it / the quarter-batches) is what any threaded
                   replica design costs here, ``over_floor`` (the library / it) what
                   the library adds; ``in_turn_ratio``: the same replicas one after
                   the other on one thread, no threads at all.

    handoff        a round trip between two Python threads (two hand-offs, no
                   torch): what each wake-up of a replica thread costs on this machine.

``torch.set_num_threads(--threads)`` (default 1: the replicas then take turns on
the cores as the quarters do) for both sides.
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from _plain_replicas import PlainReplicas, cross_entropy
from _timing import emit, interleaved, quartiles

import distribute as ds

TINY = ((32, 64, 10), 32)
MLP = ((512, 1024, 1024, 512, 10), 256)


def make_model(layers: tuple[int, ...]) -> torch.nn.Module:
    torch.manual_seed(0)
    modules: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(layers)):
        if i:
            modules.append(torch.nn.ReLU())
        modules.append(torch.nn.Linear(fan_in, fan_out))
    return torch.nn.Sequential(*modules)


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def make_batches(layers: tuple[int, ...], batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(batch, layers[0], generator=g),
            torch.randint(0, layers[-1], (batch,), generator=g),
        )
        for _ in range(4)
    ]


def plain_step(layers: tuple[int, ...], batch: int, opt: str, pieces: int) -> Callable[[], float]:
    """Plain PyTorch: the batch in ``pieces`` chunks, gradients accumulated, one step."""
    model = make_model(layers)
    optimizer = make_optimizer(opt, model.parameters())
    batches = [(x.chunk(pieces), y.chunk(pieces)) for x, y in make_batches(layers, batch)]
    counter = iter(range(sys.maxsize))

    def step() -> float:
        xs, ys = batches[next(counter) % len(batches)]
        total = 0.0
        for x, y in zip(xs, ys):
            per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            loss = per_example.sum() / batch
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        return total

    return step


def plain_threads_step(
    layers: tuple[int, ...], batch: int, opt: str, n: int
) -> tuple[Callable[[], float], Callable[[], float], Callable[[], None]]:
    """The replica threads' design in plain PyTorch (`_plain_replicas.py`): the step,
    the same step with the replicas in turn on the caller's thread, and what stops
    the threads."""
    replicas = PlainReplicas(
        make_model(layers), lambda params: make_optimizer(opt, params), cross_entropy(batch), n
    )
    shards = [(x.chunk(n), y.chunk(n)) for x, y in make_batches(layers, batch)]
    counter = iter(range(sys.maxsize))

    def step() -> float:
        xs, ys = shards[next(counter) % len(shards)]
        return float(replicas.step(xs, ys))

    def in_turn() -> float:
        xs, ys = shards[next(counter) % len(shards)]
        return float(replicas.step_in_turn(xs, ys))

    return step, in_turn, replicas.close


def strategy_step(
    strategy: ds.Strategy, layers: tuple[int, ...], batch: int, opt: str
) -> Callable[[], float]:
    """The tf.distribute idiom: `reduce("sum", run(step))`."""
    with strategy.scope():
        model = make_model(layers)
        optimizer = make_optimizer(opt, model.parameters())
    n = strategy.num_replicas_in_sync
    batches: list[Any] = [
        (x, y) if n == 1 else (ds.PerReplica(x.chunk(n)), ds.PerReplica(y.chunk(n)))
        for x, y in make_batches(layers, batch)
    ]
    counter = iter(range(sys.maxsize))

    def replica_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    def step() -> float:
        x, y = batches[next(counter) % len(batches)]
        return float(strategy.reduce("sum", strategy.run(replica_step, args=(x, y)), axis=None))

    return step


def pair(
    name: str,
    config: dict[str, Any],
    baseline: str,
    cases: dict[str, Callable[[], Any]],
    reps: int,
    steps: int,
    goal: str,
) -> None:
    load = round(os.getloadavg()[0], 2)
    samples = interleaved(cases, reps, steps, warmup_calls=max(5, steps // 4))
    base, ours = samples["baseline"], samples["distribute"]
    paired = [o / b for b, o in zip(base, ours)]
    floor: dict[str, Any] = {}
    if "plain_threads" in samples:
        threads = samples["plain_threads"]
        floor = {
            "plain_threads_ms": round(statistics.median(threads) * 1e3, 4),
            "floor_ratio": round(statistics.median([t / b for b, t in zip(base, threads)]), 4),
            "over_floor": round(statistics.median([o / t for t, o in zip(threads, ours)]), 4),
        }
    if "plain_in_turn" in samples:
        turns = samples["plain_in_turn"]
        floor["in_turn_ratio"] = round(statistics.median([t / b for b, t in zip(base, turns)]), 4)
    emit(
        {
            "bench": name,
            "config": config,
            "baseline": baseline,
            "baseline_ms": round(statistics.median(base) * 1e3, 4),
            "distribute_ms": round(statistics.median(ours) * 1e3, 4),
            "ratio": round(statistics.median(ours) / statistics.median(base), 4),
            "paired_ratio": round(statistics.median(paired), 4),
            "paired_ratio_iqr": [round(q, 4) for q in quartiles(paired)],
            **floor,
            "goal": goal,
            "reps": reps,
            "steps_per_rep": steps,
            "loadavg_1m_before": load,
        }
    )


def one_replica(quick: bool) -> None:
    layers, batch = TINY
    reps, steps = (9, 40) if quick else (31, 100)
    for strategy_name, make in (
        ("MirroredStrategy(['cpu:0'])", lambda: ds.MirroredStrategy(["cpu:0"])),
        ("OneDeviceStrategy('cpu')", lambda: ds.OneDeviceStrategy("cpu")),
    ):
        for opt in ("sgd_momentum", "adam"):
            cases = {
                "baseline": plain_step(layers, batch, opt, 1),
                "distribute": strategy_step(make(), layers, batch, opt),
            }
            pair(
                "one_replica",
                {"strategy": strategy_name, "optimizer": opt, "model": "MLP 32-64-10"},
                "plain PyTorch, same step on the whole batch",
                cases,
                reps,
                steps,
                "ratio <= 1.10",
            )


def four_replicas(quick: bool) -> None:
    for (layers, batch), (reps, steps) in (
        (TINY, (9, 20) if quick else (31, 50)),
        (MLP, (5, 3) if quick else (21, 5)),
    ):
        strategy = ds.MirroredStrategy([f"cpu:{i}" for i in range(4)])
        plain_threads, in_turn, close = plain_threads_step(layers, batch, "sgd_momentum", 4)
        cases = {
            "baseline": plain_step(layers, batch, "sgd_momentum", 4),
            "distribute": strategy_step(strategy, layers, batch, "sgd_momentum"),
            "plain_threads": plain_threads,
            "plain_in_turn": in_turn,
        }
        pair(
            "four_replicas",
            {
                "strategy": "MirroredStrategy(4 logical CPUs)",
                "optimizer": "sgd_momentum",
                "model": f"MLP {'-'.join(map(str, layers))}",
                "global_batch": batch,
            },
            "plain PyTorch, the batch as 4 quarter-batches in one process, one step",
            cases,
            reps,
            steps,
            "ratio <= 1.20",
        )
        threads = getattr(strategy.extended, "_threads", None)
        if threads is not None:  # idle replica threads slow later cases
            threads.shutdown(join=True)
        close()


def handoff(quick: bool) -> None:
    """What waking another thread costs here: a round trip between two Python threads
    through two `queue.SimpleQueue`s (two hand-offs), no library."""
    there: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    back: queue.SimpleQueue[int] = queue.SimpleQueue()

    def echo() -> None:
        while (item := there.get()) is not None:
            back.put(item)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    trips = 2_000 if quick else 10_000
    samples = []
    for _ in range(5):
        began = time.perf_counter()
        for i in range(trips):
            there.put(i)
            back.get()
        samples.append((time.perf_counter() - began) / trips)
    there.put(None)
    thread.join()
    emit(
        {
            "bench": "handoff",
            "what": "a round trip between two Python threads (two hand-offs)",
            "round_trip_us": round(statistics.median(samples) * 1e6, 1),
            "runs_us": [round(t * 1e6, 1) for t in samples],
            "trips_per_run": trips,
            "loadavg_1m_before": round(os.getloadavg()[0], 2),
        }
    )


BENCHES = {"one_replica": one_replica, "four_replicas": four_replicas, "handoff": handoff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=",".join(BENCHES))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    emit(
        {
            "bench": "environment",
            "torch": torch.__version__,
            "threads": args.threads,
            "cpus": os.cpu_count(),
            "loadavg_1m_before": round(os.getloadavg()[0], 2),
        }
    )
    for name in args.only.split(","):
        BENCHES[name](args.quick)


if __name__ == "__main__":
    main()
