"""`ds.Model.fit` against the same steps written by hand with `strategy.run`.

    python benchmarks/bench_fit.py            # ~1.5 min
    python benchmarks/bench_fit.py --quick    # smoke run

Prints JSON lines: {"bench", "config", "baseline_ms", "distribute_ms", "ratio",
"paired_ratio", "paired_ratio_iqr", "reps", "goal"}; the times are per training
step, ratio = fit / hand-written loop (lower is better), goal <= 1.03.

One call is one epoch over the same arrays (NumPy, global batch 256, no shuffle):
`model.fit(x, y, batch_size=256, epochs=1, verbose=0)` against a loop that makes
the same DataLoader and distributed dataset and runs, per step,
``strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None)`` with the
step of the README (per-example loss, `compute_average_loss`, backward, step,
zero_grad) and reads the loss as a float, as fit does. Both sides have their own
model and optimizer with the same initial weights; the cases take turns.

Cases: MirroredStrategy with 1 replica and with 2 logical CPU replicas; an MLP
512-1024-1024-512-10 (2.1M parameters, the size of bench_mirrored.py's), SGD
with momentum; loss only (the metric-free step), then with ``metrics=["accuracy"]``
against a hand-written loop that counts correct predictions in sync-on-read
variables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import emit, interleaved, quartiles

import distribute as ds

BATCH = 256


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )


def _case(strategy: ds.Strategy, steps: int, with_metric: bool) -> dict[str, Any]:
    x = np.random.default_rng(0).normal(size=(steps * BATCH, 512)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 10, size=steps * BATCH)
    torch.manual_seed(0)
    with strategy.scope():
        model = ds.Model(_mlp())
        by_hand = _mlp()
        by_hand.load_state_dict(model.module.state_dict())
        optimizer = torch.optim.SGD(by_hand.parameters(), lr=0.01, momentum=0.9)
        correct = ds.Variable(
            0.0,
            synchronization=ds.VariableSynchronization.ON_READ,
            aggregation=ds.VariableAggregation.SUM,
        )
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
        loss=torch.nn.CrossEntropyLoss(),
        metrics=["accuracy"] if with_metric else None,
    )

    def step(batch: Any) -> torch.Tensor:
        inputs, labels = batch
        logits = by_hand(inputs)
        per_example = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if with_metric:
            with torch.no_grad():
                correct.assign_add((logits.argmax(1) == labels).sum().double())
        return loss.detach()

    def hand_written_epoch() -> None:
        loader = DataLoader(TensorDataset(torch.as_tensor(x), torch.as_tensor(y)), batch_size=BATCH)
        for batch in strategy.experimental_distribute_dataset(loader):
            float(strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None))
        if with_metric:
            float(correct.read_value())

    def fit_epoch() -> None:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    return {"by_hand": hand_written_epoch, "fit": fit_epoch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps = 4 if args.quick else 12
    reps = 3 if args.quick else 15
    emit(
        {
            "bench": "environment",
            "torch": torch.__version__,
            "threads": args.threads,
            "loadavg_1m_before": round(os.getloadavg()[0], 2),
        }
    )
    for replicas in (1, 2):
        for with_metric in (False, True):
            strategy = ds.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
            cases = _case(strategy, steps, with_metric)
            samples = interleaved(cases, reps, 1, warmup_calls=1)
            base = [s / steps for s in samples["by_hand"]]
            ours = [s / steps for s in samples["fit"]]
            ratios = [o / b for o, b in zip(ours, base)]
            emit(
                {
                    "bench": "fit_step",
                    "config": {
                        "strategy": "MirroredStrategy",
                        "replicas": replicas,
                        "metrics": ["accuracy"] if with_metric else [],
                        "model": "MLP 512-1024-1024-512-10 (2.10M params)",
                        "global_batch": BATCH,
                        "steps_per_epoch": steps,
                    },
                    "baseline": "hand-written strategy.run loop, same model, data and optimizer",
                    "baseline_ms": round(statistics.median(base) * 1e3, 3),
                    "distribute_ms": round(statistics.median(ours) * 1e3, 3),
                    "ratio": round(statistics.median(ours) / statistics.median(base), 4),
                    "paired_ratio": round(statistics.median(ratios), 4),
                    "paired_ratio_iqr": [round(q, 4) for q in quartiles(ratios)],
                    "reps": reps,
                    "goal": "ratio <= 1.03",
                }
            )


if __name__ == "__main__":
    main()
