"""`ds.Model.fit` under ParameterServerStrategy against the custom coordinator loop.

    python benchmarks/bench_ps_fit.py            # ~1 min
    python benchmarks/bench_ps_fit.py --quick    # smoke run

Prints JSON lines ``{"bench": "ps_fit", "workers", "steps", "baseline_ms",
"distribute_ms", "ratio", "goal"}``: the time per training step of
``model.fit(x, y, batch_size=B)`` (an MLP, 784 -> 256 -> 10, on digits-sized
data) against the loop a user writes with the same strategy and coordinator (the
same model, optimizer and global batches: ``coordinator.schedule(step, args=(x,
y))`` for every batch, then ``join``). Both run in one cluster of 2 workers and 1 ps
(`ds.coordinator.LocalCluster`), alternating, ``--repeats`` times each; the
figures are the medians, ``ratio`` the median of the paired ratios; goal <= 1.10.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import distribute as ds

BATCH = 64


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _custom_loop(strategy: Any, x: np.ndarray, y: np.ndarray, epochs: int) -> float:
    """The coordinator loop of tf.distribute's parameter-server tutorial."""
    with strategy.scope():
        model = _net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    coordinator = ds.coordinator.ClusterCoordinator.of(strategy)
    xs, ys = torch.tensor(x), torch.tensor(y)
    start = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(xs))
        losses = []
        for i in range(0, len(xs), BATCH):
            rows = order[i : i + BATCH]
            losses.append(coordinator.schedule(_step, args=(model, optimizer, xs[rows], ys[rows])))
        coordinator.join()
        float(np.mean([loss.fetch() for loss in losses]))  # the epoch's loss, as fit logs
    return time.perf_counter() - start


def _fit(strategy: Any, x: np.ndarray, y: np.ndarray, epochs: int) -> float:
    with strategy.scope():
        model = ds.Model(_net())
        model.compile(
            loss=torch.nn.CrossEntropyLoss(reduction="none"),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        )
    start = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    rows, epochs, repeats = (640, 1, 2) if args.quick else (2560, 2, args.repeats)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 784)).astype("float32")
    y = rng.integers(0, 10, size=rows).astype("int64")
    steps = epochs * -(-rows // BATCH)
    with ds.coordinator.LocalCluster(num_workers=args.workers, num_ps=1) as cluster:
        strategy = ds.ParameterServerStrategy(cluster.resolver)
        _custom_loop(strategy, x[:256], y[:256], 1)  # warm: workers import, functions sent
        _fit(strategy, x[:256], y[:256], 1)
        baseline, ours, ratios = [], [], []
        for repeat in range(repeats):
            if repeat % 2 == 0:  # alternating which runs first
                base = _custom_loop(strategy, x, y, epochs)
                mine = _fit(strategy, x, y, epochs)
            else:
                mine = _fit(strategy, x, y, epochs)
                base = _custom_loop(strategy, x, y, epochs)
            baseline.append(base / steps * 1000)
            ours.append(mine / steps * 1000)
            ratios.append(mine / base)
        strategy.shutdown()
    print(
        json.dumps(
            {
                "bench": "ps_fit",
                "workers": args.workers,
                "steps": steps,
                "baseline_ms": round(statistics.median(baseline), 3),
                "distribute_ms": round(statistics.median(ours), 3),
                "ratio": round(statistics.median(ratios), 3),
                "goal": 1.10,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
