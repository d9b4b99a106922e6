"""Where the one-replica step's host cost sits (issue 40): the same step, built up.

    python benchmarks/host_cost_decomposition.py      # ~30 s, 1 thread

Times, interleaved repetition by repetition (15 repetitions of 200 steps, medians),
the tiny MLP step of `bench_host_cost.py` (32-64-10, batch 32, SGD momentum):

    plain          plain PyTorch
    vars_no_run    the same step on `MirroredStrategy(["cpu:0"])`'s variables,
                   called directly (no `run`)
    run            that step inside `strategy.run`
    run_cal        ... with `ds.compute_average_loss` for the loss
    full           ... and `strategy.reduce("sum", ...)` of its result

Prints one JSON line per case: microseconds a step and the ratio to plain. A
measurement, never a test.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_host_cost as bench

import distribute as ds


def main() -> None:
    torch.set_num_threads(1)
    layers, batch = bench.TINY
    plain = bench.plain_step(layers, batch, "sgd", 1)
    strategy = ds.MirroredStrategy(["cpu:0"])
    with strategy.scope():
        model = bench.make_model(layers)
        optimizer = bench.make_optimizer("sgd", model.parameters())
    x, y = bench.make_batches(layers, batch)[0]

    def step(average: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        def replica_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            per = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            if average:
                loss = ds.compute_average_loss(per, global_batch_size=batch)
            else:
                loss = per.sum() / batch
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        return replica_step

    bare, averaged = step(False), step(True)
    cases: dict[str, Callable[[], float]] = {
        "plain": plain,
        "vars_no_run": lambda: float(bare(x, y)),
        "run": lambda: float(strategy.run(bare, args=(x, y))),
        "run_cal": lambda: float(strategy.run(averaged, args=(x, y))),
        "full": lambda: float(strategy.reduce("sum", strategy.run(averaged, args=(x, y)), None)),
    }
    for case in cases.values():
        for _ in range(200):
            case()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(15):
        for name, case in cases.items():
            start = time.perf_counter()
            for _ in range(200):
                case()
            times[name].append((time.perf_counter() - start) / 200 * 1e6)
    base = statistics.median(times["plain"])
    for name, samples in times.items():
        us = statistics.median(samples)
        print(json.dumps({"case": name, "us_per_step": round(us, 1), "ratio": round(us / base, 3)}))


if __name__ == "__main__":
    main()
