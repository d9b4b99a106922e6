"""Iterating a DistributedDataset against iterating the bare DataLoader, in one run.

    python benchmarks/bench_dataset.py             # full run, about 45 s
    python benchmarks/bench_dataset.py --quick     # fewer rows and steps, ~10 s
    python benchmarks/bench_dataset.py --only map_style --threads 1

The data: an in-memory map-style dataset of 200,000 rows of 64 float32 features and
an int64 label (50,000 rows with --quick), loaded by a DataLoader with batch size 256
and num_workers=0. The baseline iterates that DataLoader; the distributed case
iterates ``strategy.experimental_distribute_dataset(loader)`` for a MirroredStrategy
with 4 logical CPU replicas (and 1, where noted), which splits every batch into 4
per-replica pieces (64 rows each). Same loader, same data, same process.

Benchmarks (`--only` takes these names):
    step_overhead  what one step costs beyond iterating a list of ready batches
               (microseconds per step, 4 replicas and 1): the split, the PerReplica
               nest and the end-of-data bookkeeping, with no loading around them.
               Prints overhead_us (median) and overhead_us_min, no ratio.
    map_style  a Dataset whose ``__getitem__`` returns one (features, label) row,
               batched by the default collate: the usual DataLoader. 4 replicas and
               1 replica. Goal: ratio >= 0.97. With 4 replicas a third case, the
               bare loader whose batches are split by hand (one
               ``split_with_sizes`` per leaf, into ``PerReplica``), is the
               floor any splitting pays: ``split_by_hand_ratio`` is its throughput
               over the baseline's, ``ratio_vs_split_by_hand`` distribute's over it.
    gathered   ``ds.data.make_numpy_dataset``: each batch is one fancy-indexing gather
               (~0.1 ms), so loading is cheap and the per-step cost of splitting shows
               most. No goal: a stress figure.
    with_work  map_style plus a little work per step: a 64x256 matmul, ReLU and sum
               on every replica's piece, run inline so that only the input path
               differs; the baseline does the same on the 4 quarters of each batch
               (``x.chunk(4)``). Goal: ratio >= 0.97.
    to_cuda    (CUDA only; prints a "skipped" line elsewhere) a pinned-memory DataLoader
               through OneDeviceStrategy("cuda:0"), whose prefetch copies each batch
               to the GPU ahead of use, against the bare loader with a non-blocking
               ``.to("cuda")`` of every batch; both touch the batch on the GPU.
               Goal: ratio >= 0.97.

Each case is an endless stream of steps (epoch after epoch, each epoch a new
iterator, so epoch starts are timed too). The cases take turns one step at a time
(in alternating order), each step timed on its own, so that the machine's drifts
hit them alike: on a shared, virtualised machine chunks of 50 steps differed by
+-7% between neighbours, far more than the overhead measured, while neighbouring
single steps pair well. After 50 warm-up steps each. The ratio is the median of
the per-step ratios (baseline time / distribute time), with its quartiles; the
throughputs are medians. step_overhead, where a step is a microsecond, times chunks
of 50 steps instead. Nothing is asserted.

Output keys: bench, config, baseline (what the baseline is), baseline_batches_per_s,
distribute_batches_per_s, ratio (distribute / baseline throughput, higher is better),
ratio_iqr (quartiles of the per-step ratios), goal, steps, overhead_us (extra time
per step, from the medians), and for map_style with 4 replicas split_by_hand_ratio
and ratio_vs_split_by_hand. The first line describes the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from _timing import emit, interleaved, quartiles
from torch.utils.data import DataLoader, Dataset

import distribute as ds

FEATURES = 64
BATCH = 256
HIDDEN = 256
GOAL = "ratio >= 0.97"


@dataclass(frozen=True)
class Budget:
    rows: int
    steps: int  # timed steps of each case, taken in turns
    chunks: int  # step_overhead: timed chunks of CHUNK steps


WARMUP = 50
CHUNK = 50
QUICK = Budget(rows=50_000, steps=1000, chunks=41)
FULL = Budget(rows=200_000, steps=4000, chunks=61)


class InMemoryRows(Dataset):
    """Rows of (features, label) held in two tensors; one row per ``__getitem__``."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        self.features = features
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features[i], self.labels[i]


def make_data(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, FEATURES, generator=g), torch.randint(0, 10, (rows,), generator=g)


def mirrored(replicas: int) -> ds.Strategy:
    return ds.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])


# -- timing ---------------------------------------------------------------------------


def endless(iterable: Iterable[Any]) -> Iterator[Any]:
    """The batches of `iterable`, epoch after epoch."""
    while True:
        yield from iterable


def compare(
    bench: str,
    config: dict[str, Any],
    baseline: str,
    samples: dict[str, list[float]],
    goal: str | None,
) -> dict[str, Any]:
    base, dist = samples["baseline"], samples["distribute"]
    base_med, dist_med = statistics.median(base), statistics.median(dist)
    paired = [b / d for b, d in zip(base, dist)]  # throughput ratio per step
    record: dict[str, Any] = {
        "bench": bench,
        "config": config,
        "baseline": baseline,
        "baseline_batches_per_s": round(1 / base_med, 1),
        "distribute_batches_per_s": round(1 / dist_med, 1),
        "ratio": round(statistics.median(paired), 4),
        "ratio_iqr": [round(q, 4) for q in quartiles(paired)],
        "goal": goal,
        "steps": len(base),
        "overhead_us": round((dist_med - base_med) * 1e6, 1),
    }
    if "by_hand" in samples:
        hand = samples["by_hand"]
        record["split_by_hand_ratio"] = round(
            statistics.median([b / h for b, h in zip(base, hand)]), 4
        )
        record["ratio_vs_split_by_hand"] = round(
            statistics.median([h / d for h, d in zip(hand, dist)]), 4
        )
    emit(record)
    return record


# -- cases ----------------------------------------------------------------------------


def stepper(iterable: Iterable[Any], work: Callable[[Any], Any] | None = None) -> Callable[[], Any]:
    """One step: the next batch of `iterable` (a new epoch when one ends), then `work` on it."""
    stream = endless(iterable)
    if work is None:
        return lambda: next(stream)
    return lambda: work(next(stream))


def config(budget: Budget, threads: int, replicas: int, loader: str) -> dict[str, Any]:
    return {
        "strategy": "MirroredStrategy",
        "replicas": replicas,
        "rows": budget.rows,
        "features": f"{FEATURES} x float32 + int64 label",
        "global_batch": BATCH,
        "loader": loader,
        "num_workers": 0,
        "threads": threads,
    }


def run_case(
    bench: str,
    budget: Budget,
    cfg: dict[str, Any],
    baseline: str,
    cases: dict[str, Callable[[], Any]],
    goal: str | None,
) -> None:
    samples = interleaved(cases, budget.steps, 1, warmup_calls=WARMUP, collect_each=False)
    compare(bench, cfg, baseline, samples, goal)


def bench_map_style(budget: Budget, threads: int) -> None:
    loader = DataLoader(InMemoryRows(*make_data(budget.rows)), batch_size=BATCH)
    for replicas in (4, 1):
        dist = mirrored(replicas).experimental_distribute_dataset(loader)
        cases = {"baseline": stepper(loader), "distribute": stepper(dist)}
        if replicas > 1:
            cases["by_hand"] = stepper(loader, split_by_hand(replicas))
        run_case(
            "map_style",
            budget,
            config(budget, threads, replicas, "Dataset.__getitem__ per row, default collate"),
            "the bare DataLoader, same data",
            cases,
            GOAL,
        )


def split_by_hand(replicas: int) -> Callable[[Any], Any]:
    """Splits a flat batch as distribute does, with nothing around it: the floor."""

    def split(batch: Any) -> Any:
        sizes = ds.data.sharding.split_sizes(len(batch[0]), replicas)
        return [ds.PerReplica(x.split_with_sizes(sizes)) for x in batch]

    return split


def bench_gathered(budget: Budget, threads: int) -> None:
    features, labels = make_data(budget.rows)
    loader = ds.data.make_numpy_dataset((features.numpy(), labels.numpy()), batch_size=BATCH)
    dist = mirrored(4).experimental_distribute_dataset(loader)
    run_case(
        "gathered",
        budget,
        config(budget, threads, 4, "ds.data.make_numpy_dataset (one gather per batch)"),
        "the bare DataLoader, same data",
        {"baseline": stepper(loader), "distribute": stepper(dist)},
        None,
    )


def bench_with_work(budget: Budget, threads: int) -> None:
    loader = DataLoader(InMemoryRows(*make_data(budget.rows)), batch_size=BATCH)
    weight = torch.randn(FEATURES, HIDDEN, generator=torch.Generator().manual_seed(1))
    strategy = mirrored(4)
    dist = strategy.experimental_distribute_dataset(loader)

    def work(x: torch.Tensor) -> float:
        return float(torch.relu(x @ weight).sum())

    def per_replica_work(batch: Any) -> None:
        for piece in strategy.experimental_local_results(batch[0]):
            work(piece)

    cfg = config(budget, threads, 4, "Dataset.__getitem__ per row, default collate")
    cfg["work"] = f"relu(x @ W[{FEATURES}x{HIDDEN}]).sum() per replica piece, inline"

    def quarter_work(batch: Any) -> None:
        for piece in batch[0].chunk(4):
            work(piece)

    run_case(
        "with_work",
        budget,
        cfg,
        "the bare DataLoader, the same work on each quarter of the batch",
        {"baseline": stepper(loader, quarter_work), "distribute": stepper(dist, per_replica_work)},
        GOAL,
    )


def bench_to_cuda(budget: Budget, threads: int) -> None:
    if not torch.cuda.is_available():
        emit({"bench": "to_cuda", "skipped": "no CUDA device"})
        return
    device = torch.device("cuda:0")
    loader = DataLoader(InMemoryRows(*make_data(budget.rows)), batch_size=BATCH, pin_memory=True)
    dist = ds.OneDeviceStrategy("cuda:0").experimental_distribute_dataset(loader)

    def copy(batch: Any) -> Any:
        return [t.to(device, non_blocking=True) for t in batch]

    def use(batch: Any) -> Any:
        # Touch the batch on the GPU, as a training step would; waits for its copy.
        return batch[0].sum().item()

    cfg = config(budget, threads, 1, "Dataset.__getitem__ per row, default collate, pin_memory")
    cfg["strategy"] = "OneDeviceStrategy('cuda:0')"
    run_case(
        "to_cuda",
        budget,
        cfg,
        "the bare DataLoader, each batch .to('cuda', non_blocking=True)",
        {"baseline": stepper(loader, lambda b: use(copy(b))), "distribute": stepper(dist, use)},
        GOAL,
    )


def bench_step_overhead(budget: Budget, threads: int) -> None:
    features, labels = make_data(BATCH * 200)
    batches = [[x, y] for x, y in zip(features.split(BATCH), labels.split(BATCH))]
    for replicas in (4, 1):
        dist = mirrored(replicas).experimental_distribute_dataset(batches)
        samples = interleaved(
            {"list": stepper(batches), "distribute": stepper(dist)},
            budget.chunks,
            CHUNK,
            warmup_calls=WARMUP,
            collect_each=False,
        )
        overhead = [d - b for b, d in zip(samples["list"], samples["distribute"])]
        emit(
            {
                "bench": "step_overhead",
                "config": {
                    "strategy": "MirroredStrategy",
                    "replicas": replicas,
                    "batch": f"[features[{BATCH}, {FEATURES}], labels[{BATCH}]], made before",
                    "threads": threads,
                },
                "baseline": "iterating the same list of batches",
                "overhead_us": round(statistics.median(overhead) * 1e6, 2),
                "overhead_us_min": round(min(overhead) * 1e6, 2),
                "chunks": budget.chunks,
                "steps_per_chunk": CHUNK,
            }
        )


BENCHES: dict[str, Callable[[Budget, int], None]] = {
    "step_overhead": bench_step_overhead,
    "map_style": bench_map_style,
    "gathered": bench_gathered,
    "with_work": bench_with_work,
    "to_cuda": bench_to_cuda,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer rows and repetitions")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads for baseline and strategy alike (default 1)",
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
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "mode": "quick" if args.quick else "full",
        }
    )
    start = time.perf_counter()
    for name in selected:
        BENCHES[name](budget, args.threads)
    emit({"bench": "done", "seconds": round(time.perf_counter() - start, 1)})


if __name__ == "__main__":
    main()
