"""MirroredStrategy and CentralStorageStrategy against plain PyTorch, in one run.

    python benchmarks/bench_mirrored.py             # full run, about 2.5 minutes on 2 cores
    python benchmarks/bench_mirrored.py --quick     # a few repetitions, under a minute
    python benchmarks/bench_mirrored.py --only train_step,run_overhead --threads 1

Each figure is measured in the same process as its baseline, with the same
`torch.set_num_threads`, after a warm-up, with the cases interleaved repetition by
repetition (their order alternating), and reported as medians. Nothing is asserted:
the ratios and their goals are printed side by side, one JSON line per figure.

Benchmarks (`--only` takes these names):
    train_step     one training step of a 2.1M-parameter MLP on a global batch of 256,
                   SGD with momentum and Adam: MirroredStrategy with 1 replica, with 4
                   logical CPU replicas, and CentralStorageStrategy with 4, against the
                   same plain PyTorch loop on the whole batch. Goal for 1 replica:
                   ratio <= 1.05. With 4 logical replicas on one CPU the replicas share
                   the cores, so that ratio measures overhead, not speed-up.
    step_overhead  the same comparison with 1 replica on a tiny MLP (32-64-10, batch
                   32), where the step is so short that the fixed per-step cost of the
                   library shows: overhead_us is that cost in microseconds.
    run_overhead   `strategy.run(fn)` with a trivial `fn`, 1 and 4 replicas, with no
                   variables and with 200 variables in scope, against calling `fn()`
                   directly (overhead_us: microseconds per call).
    all_reduce     1,000 tensors of 256 floats per replica, summed over 2 and 4
                   replicas: one `ReplicaContext.all_reduce` of the list (packed into
                   one buffer) against 1,000 separate `all_reduce` calls inside one
                   `run`. Goal: packed at least 10x faster. torch_floor_ms is what the
                   same packed sum costs in plain torch (cat, add, clone, split).

Input batches are made once, before timing (the input pipeline has its own
benchmark, bench_dataset.py). `distribute` is imported for the whole run, and its
global optimizer-step and module-registration hooks, installed by the first strategy
scope, are there for the baseline too; outside a strategy they return at once (about
0.3 microseconds a step).

Output keys: bench, config, baseline (what the baseline is), baseline_ms,
distribute_ms, ratio (distribute_ms / baseline_ms, lower is better), paired_ratio and
paired_ratio_iqr (median and quartiles of the per-repetition ratios: robust to load
that comes and goes, and a measure of the noise), goal, reps, and where they apply
overhead_us, speedup (baseline_ms / distribute_ms), per_call_us, torch_floor_ms,
results_equal; overhead_us is the median over repetitions of the paired difference.
The first line describes the machine, with its 1-minute load average before the run
(other processes on the machine show there: figures taken above ~0.3 are suspect);
the last line gives the total time.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from _timing import emit, interleaved, quartiles

import distribute as ds

NUM_BATCHES = 4  # distinct batches cycled through, made before timing


@dataclass(frozen=True)
class Budget:
    """How long each kind of measurement runs."""

    warmup_steps: int
    reps: int
    steps_per_rep: int
    tiny_reps: int
    tiny_steps_per_rep: int
    run_calls_per_rep: int
    run_reps: int
    reduce_reps: int


QUICK = Budget(
    warmup_steps=3,
    reps=4,
    steps_per_rep=3,
    tiny_reps=7,
    tiny_steps_per_rep=50,
    run_calls_per_rep=200,
    run_reps=5,
    reduce_reps=3,
)
FULL = Budget(
    warmup_steps=5,
    reps=21,
    steps_per_rep=6,
    tiny_reps=41,
    tiny_steps_per_rep=100,
    run_calls_per_rep=2000,
    run_reps=15,
    reduce_reps=9,
)


@dataclass(frozen=True)
class Workload:
    """An MLP (layer widths, ReLU between) and the global batch it trains on."""

    layers: tuple[int, ...]
    global_batch: int

    def make_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        modules: list[torch.nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(self.layers[:-1], self.layers[1:])):
            if i:
                modules.append(torch.nn.ReLU())
            modules.append(torch.nn.Linear(fan_in, fan_out))
        return torch.nn.Sequential(*modules)

    def make_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(0)
        return [
            (
                torch.randn(self.global_batch, self.layers[0], generator=g),
                torch.randint(0, self.layers[-1], (self.global_batch,), generator=g),
            )
            for _ in range(NUM_BATCHES)
        ]

    def describe(self) -> str:
        n_params = sum(p.numel() for p in self.make_model().parameters())
        size = f"{n_params / 1e6:.2f}M" if n_params >= 1e5 else f"{n_params}"
        return f"MLP {'-'.join(map(str, self.layers))} ({size} params)"


MLP = Workload(layers=(512, 1024, 1024, 512, 10), global_batch=256)
TINY = Workload(layers=(32, 64, 10), global_batch=32)


# -- timing ---------------------------------------------------------------------------


def ms(seconds: float) -> float:
    """Milliseconds to 4 significant digits (run overhead is a few microseconds)."""
    return float(f"{seconds * 1e3:.4g}")


def compare(
    bench: str,
    config: dict[str, Any],
    baseline: str,
    samples: dict[str, list[float]],
    goal: str | None,
    **extra: Any,
) -> dict[str, Any]:
    base, dist = samples["baseline"], samples["distribute"]
    base_med, dist_med = statistics.median(base), statistics.median(dist)
    paired = [d / b for b, d in zip(base, dist)]
    record = {
        "bench": bench,
        "config": config,
        "baseline": baseline,
        "baseline_ms": ms(base_med),
        "distribute_ms": ms(dist_med),
        "ratio": round(dist_med / base_med, 4),
        "paired_ratio": round(statistics.median(paired), 4),
        "paired_ratio_iqr": [round(q, 4) for q in quartiles(paired)],
        "goal": goal,
        "reps": len(base),
        **extra,
    }
    emit(record)
    return record


def release_threads(strategy: ds.Strategy) -> None:
    """Stops a finished case's replica threads.

    Works around replica threads outliving their strategy (each worker thread keeps
    its last task, and through it the strategy, alive): idle threads left from
    earlier cases slowed later steps by up to 15% (3x on the tiny step) here.
    """
    threads = getattr(strategy.extended, "_threads", None)
    if threads is not None:
        threads.shutdown(join=True)


# -- 1, 2: training step ----------------------------------------------------------------

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}

FOUR_CPUS = [f"cpu:{i}" for i in range(4)]

# name: (replicas, factory)
STRATEGIES: dict[str, tuple[int, Callable[[], ds.Strategy]]] = {
    "mirrored_1": (1, lambda: ds.MirroredStrategy(["cpu:0"])),
    "mirrored_4": (4, lambda: ds.MirroredStrategy(FOUR_CPUS)),
    "central_storage_4": (4, lambda: ds.CentralStorageStrategy(FOUR_CPUS)),
}

GOALS = {"mirrored_1": "ratio <= 1.05"}
NOTES = {
    "mirrored_4": "4 logical replicas share the 2 cores: overhead, not speed-up",
    "central_storage_4": "4 logical replicas share the 2 cores: overhead, not speed-up",
}


def baseline_stepper(work: Workload, opt_name: str) -> Callable[[], Any]:
    """The plain PyTorch loop: one model, one optimizer, the whole batch."""
    model = work.make_model()
    optimizer = OPTIMIZERS[opt_name](model.parameters())
    batches = work.make_batches()
    counter = iter(range(sys.maxsize))

    def step() -> float:
        x, y = batches[next(counter) % NUM_BATCHES]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach())

    return step


def strategy_stepper(strategy: ds.Strategy, work: Workload, opt_name: str) -> Callable[[], Any]:
    """The same step written the tf.distribute way: `run`, then `reduce`."""
    with strategy.scope():
        model = work.make_model()
        optimizer = OPTIMIZERS[opt_name](model.parameters())
    n = strategy.num_replicas_in_sync
    batches: list[Any] = [
        (x, y) if n == 1 else (ds.PerReplica(x.chunk(n)), ds.PerReplica(y.chunk(n)))
        for x, y in work.make_batches()
    ]
    counter = iter(range(sys.maxsize))

    def replica_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=work.global_batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    def step() -> float:
        x, y = batches[next(counter) % NUM_BATCHES]
        per_replica = strategy.run(replica_step, args=(x, y))
        return float(strategy.reduce("sum", per_replica, axis=None))

    return step


def measure_steps(
    strategy: ds.Strategy,
    work: Workload,
    opt_name: str,
    budget: Budget,
    reps: int,
    steps_per_rep: int,
) -> dict[str, list[float]]:
    cases = {
        "baseline": baseline_stepper(work, opt_name),
        "distribute": strategy_stepper(strategy, work, opt_name),
    }
    for fn in cases.values():
        for _ in range(max(budget.warmup_steps, steps_per_rep // 2)):
            fn()
    return interleaved(cases, reps, steps_per_rep)


def step_config(
    strategy: ds.Strategy, work: Workload, opt_name: str, threads: int
) -> dict[str, Any]:
    return {
        "strategy": type(strategy).__name__,
        "replicas": strategy.num_replicas_in_sync,
        "optimizer": opt_name,
        "model": work.describe(),
        "global_batch": work.global_batch,
        "threads": threads,
    }


BASELINE_STEP = "plain PyTorch, same model and optimizer, whole batch on one CPU"


def train_step_case(strategy_name: str, opt_name: str, budget: Budget, threads: int) -> None:
    strategy = STRATEGIES[strategy_name][1]()
    samples = measure_steps(strategy, MLP, opt_name, budget, budget.reps, budget.steps_per_rep)
    extra = {"note": NOTES[strategy_name]} if strategy_name in NOTES else {}
    compare(
        "train_step",
        step_config(strategy, MLP, opt_name, threads),
        BASELINE_STEP,
        samples,
        GOALS.get(strategy_name),
        steps_per_rep=budget.steps_per_rep,
        **extra,
    )
    release_threads(strategy)


def bench_train_step(budget: Budget, threads: int) -> list[Case]:
    return [
        Case(replicas, functools.partial(train_step_case, name, opt_name, budget, threads))
        for name, (replicas, _) in STRATEGIES.items()
        for opt_name in OPTIMIZERS
    ]


def paired_overhead_us(samples: dict[str, list[float]]) -> float:
    """Median over repetitions of (distribute - baseline), in microseconds per call."""
    diffs = [d - b for b, d in zip(samples["baseline"], samples["distribute"])]
    return round(statistics.median(diffs) * 1e6, 2)


def step_overhead_case(opt_name: str, budget: Budget, threads: int) -> None:
    strategy = ds.MirroredStrategy(["cpu:0"])
    samples = measure_steps(
        strategy, TINY, opt_name, budget, budget.tiny_reps, budget.tiny_steps_per_rep
    )
    compare(
        "step_overhead",
        step_config(strategy, TINY, opt_name, threads),
        BASELINE_STEP,
        samples,
        None,
        steps_per_rep=budget.tiny_steps_per_rep,
        overhead_us=paired_overhead_us(samples),
    )


def bench_step_overhead(budget: Budget, threads: int) -> list[Case]:
    return [
        Case(1, functools.partial(step_overhead_case, opt_name, budget, threads))
        for opt_name in OPTIMIZERS
    ]


# -- 3: strategy.run overhead ---------------------------------------------------------


def run_overhead_case(replicas: int, layers: int, budget: Budget, threads: int) -> None:
    def fn() -> None:
        return None

    strategy = ds.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
    variables = sum(1 for _ in model.parameters())
    cases = {"baseline": fn, "distribute": lambda: strategy.run(fn)}
    calls = budget.run_calls_per_rep if replicas == 1 else budget.run_calls_per_rep // 4
    for case in cases.values():
        for _ in range(calls // 4):
            case()
    samples = interleaved(cases, budget.run_reps, calls)
    compare(
        "run_overhead",
        {
            "strategy": "MirroredStrategy",
            "replicas": replicas,
            "variables": variables,
            "fn": "returns None",
            "threads": threads,
        },
        "calling fn() directly",
        samples,
        None,
        calls_per_rep=calls,
        overhead_us=paired_overhead_us(samples),
    )
    release_threads(strategy)


def bench_run_overhead(budget: Budget, threads: int) -> list[Case]:
    return [
        Case(replicas, functools.partial(run_overhead_case, replicas, layers, budget, threads))
        for replicas in (1, 4)
        for layers in (0, 100)
    ]


# -- 4: packed vs per-tensor all-reduce -----------------------------------------------

NUM_TENSORS = 1000
TENSOR_NUMEL = 256


def torch_floor(per_replica: list[list[torch.Tensor]]) -> Callable[[], Any]:
    """The packed sum in plain torch: one cat per replica, add, one copy and split each."""

    def reduce() -> list[tuple[torch.Tensor, ...]]:
        total = torch.cat(per_replica[0])
        for ts in per_replica[1:]:
            total += torch.cat(ts)
        return [total.clone().split(TENSOR_NUMEL) for _ in per_replica]

    return reduce


def replica_context() -> ds.ReplicaContext:
    ctx = ds.get_replica_context()
    if ctx is None:
        raise RuntimeError("expected to run inside strategy.run, found cross-replica context")
    return ctx


def all_reduce_case(replicas: int, budget: Budget, threads: int) -> None:
    strategy = ds.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    g = torch.Generator().manual_seed(replicas)
    tensors = [
        [torch.randn(TENSOR_NUMEL, generator=g) for _ in range(NUM_TENSORS)]
        for _ in range(replicas)
    ]

    def packed() -> Any:
        ctx = replica_context()
        return ctx.all_reduce("sum", tensors[ctx.replica_id_in_sync_group])

    def per_tensor() -> Any:
        ctx = replica_context()
        return [ctx.all_reduce("sum", t) for t in tensors[ctx.replica_id_in_sync_group]]

    # Both ways must give the same sums (printed, not asserted).
    a = strategy.experimental_local_results(strategy.run(packed))
    b = strategy.experimental_local_results(strategy.run(per_tensor))
    agree = all(torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    cases = {
        "baseline": lambda: strategy.run(per_tensor),
        "distribute": lambda: strategy.run(packed),
    }
    floor = torch_floor(tensors)
    for case in (*cases.values(), floor):
        case()
    samples = interleaved(cases, budget.reduce_reps, 1)
    floor_s = statistics.median(interleaved({"f": floor}, budget.reduce_reps, 10)["f"])
    base_med = statistics.median(samples["baseline"])
    dist_med = statistics.median(samples["distribute"])
    compare(
        "all_reduce",
        {
            "strategy": "MirroredStrategy",
            "replicas": replicas,
            "tensors": f"{NUM_TENSORS} x {TENSOR_NUMEL} float32 per replica",
            "threads": threads,
        },
        f"{NUM_TENSORS} separate ReplicaContext.all_reduce calls inside one run",
        samples,
        "speedup >= 10",
        speedup=round(base_med / dist_med, 2),
        per_call_us=round(base_med / NUM_TENSORS * 1e6, 1),
        torch_floor_ms=ms(floor_s),
        results_equal=agree,
    )
    release_threads(strategy)


def bench_all_reduce(budget: Budget, threads: int) -> list[Case]:
    return [
        Case(replicas, functools.partial(all_reduce_case, replicas, budget, threads))
        for replicas in (2, 4)
    ]


@dataclass(frozen=True)
class Case:
    """One figure to measure: a line of output."""

    replicas: int
    measure: Callable[[], None]


BENCHES: dict[str, Callable[[Budget, int], list[Case]]] = {
    "train_step": bench_train_step,
    "step_overhead": bench_step_overhead,
    "run_overhead": bench_run_overhead,
    "all_reduce": bench_all_reduce,
}


def in_run_order(cases: list[Case]) -> list[Case]:
    """Single-replica cases first, then the rest, each group in the order given.

    Insurance beside `release_threads`: replica threads left alive by a
    multi-replica case slow every later step in the process.
    """
    return [c for c in cases if c.replicas == 1] + [c for c in cases if c.replicas != 1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="few repetitions (< 60 s)")
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch.set_num_threads for baseline and strategy alike",
    )
    parser.add_argument(
        "--only", default=",".join(BENCHES), help=f"comma-separated subset of {', '.join(BENCHES)}"
    )
    args = parser.parse_args(argv)
    selected = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in selected if name not in BENCHES]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES)}")

    torch.set_num_threads(args.threads)
    budget = QUICK if args.quick else FULL
    emit(
        {
            "bench": "environment",
            "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "mode": "quick" if args.quick else "full",
            "loadavg_1m_before": round(os.getloadavg()[0], 2),
        }
    )
    start = time.perf_counter()
    cases = [case for name in selected for case in BENCHES[name](budget, args.threads)]
    for case in in_run_order(cases):
        case.measure()
    emit({"bench": "done", "seconds": round(time.perf_counter() - start, 1)})


if __name__ == "__main__":
    main()
