"""Checkpoint save and restore under MultiWorkerMirroredStrategy (2 workers, gloo)
against `torch.save` / `torch.load` of the same state dict by one process.

    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint.py            # ~1 min
    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint.py --quick    # smoke run

Prints JSON lines: {"bench", "config", "baseline_ms", "distribute_ms", "ratio",
"paired_ratio", "paired_ratio_iqr", "reps", "goal", ...}.

Benchmarks:
    save       `ds.Checkpoint(model=...).write(path)` on both workers (every worker
               calls it; torch.distributed.checkpoint writes each mirrored value
               once, the writes and their checksums shared between the workers)
               against rank 0 alone calling `torch.save(model.state_dict(), path)`.
               Goal: ratio <= 1.3.
    restore    `ds.Checkpoint(model=...).restore(path)` on both workers (each
               reads every value: every worker holds the whole model, and checks
               the checksum of every byte it reads) against rank 0 alone calling
               `model.load_state_dict(torch.load(path))`. Goal: ratio <= 1.1.
    bytes      disk bytes of the checkpoint directory against the state dict's
               tensor bytes. Goal: <= 1.05 (mirrored values written once).

The model is an MLP of about 100 MB of float32 parameters. Files go to a fresh
temporary directory on the same file system for both sides; the page cache is
warm for both (what a training job saving every few minutes sees). Both sides'
repetitions alternate, and every repetition overwrites its own path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import quartiles

import distribute as ds
from distribute import launch


def _model(megabytes: int) -> torch.nn.Module:
    width = 2048
    layers = max(1, round(megabytes * 2**20 / 4 / (width * width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _worker(megabytes: int, reps: int, directory: str) -> dict[str, Any]:
    strategy = ds.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.rank if strategy.cluster_resolver else 0
    collectives = strategy.extended.cross_worker
    assert collectives is not None
    torch.manual_seed(0)
    with strategy.scope():
        model = _model(megabytes)
    ours = Path(directory) / "ours"
    theirs = Path(directory) / "theirs.pt"
    times: dict[str, list[float]] = {"save": [], "torch_save": [], "restore": [], "torch_load": []}

    def timed(name: str, fn: Any, everyone: bool) -> None:
        collectives.barrier(f"before {name}")
        start = time.perf_counter()
        if everyone or rank == 0:
            fn()
        if everyone:
            collectives.barrier(f"after {name}")
        elapsed = time.perf_counter() - start
        times[name].append(elapsed)
        collectives.barrier(f"done {name}")

    checkpoint = ds.Checkpoint(model=model)
    plain = _model(megabytes)  # the baseline's own model, outside any strategy
    for _ in range(reps + 1):  # the first repetition warms both sides up
        timed("save", lambda: checkpoint.write(ours), everyone=True)
        timed("torch_save", lambda: torch.save(plain.state_dict(), theirs), everyone=False)
        timed("restore", lambda: checkpoint.restore(ours), everyone=True)
        timed(
            "torch_load",
            lambda: plain.load_state_dict(torch.load(theirs, weights_only=True)),
            everyone=False,
        )
    on_disk = sum(p.stat().st_size for p in ours.iterdir())
    tensors = sum(t.numel() * t.element_size() for t in plain.state_dict().values())
    strategy.shutdown()
    return {
        "rank": rank,
        "times": {k: v[1:] for k, v in times.items()},
        "disk": on_disk,
        "tensors": tensors,
        "torch_file": theirs.stat().st_size,
    }


def _line(bench: str, config: str, base: list[float], ours: list[float], goal: str) -> str:
    ratios = [o / b for o, b in zip(ours, base)]
    return json.dumps(
        {
            "bench": bench,
            "config": config,
            "baseline_ms": round(statistics.median(base) * 1e3, 2),
            "distribute_ms": round(statistics.median(ours) * 1e3, 2),
            "ratio": round(statistics.median(ours) / statistics.median(base), 3),
            "paired_ratio": round(statistics.median(ratios), 3),
            "paired_ratio_iqr": [round(q, 3) for q in quartiles(ratios)],
            "reps": len(ratios),
            "goal": goal,
            "loadavg_1m_before": round(os.getloadavg()[0], 2),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--megabytes", type=int, default=100)
    parser.add_argument("--reps", type=int, default=10, help="repetitions of each case")
    args = parser.parse_args()
    megabytes = 16 if args.quick else args.megabytes
    reps = 3 if args.quick else args.reps
    directory = tempfile.mkdtemp(prefix="bench_checkpoint_")
    try:
        results = launch.run(_worker, 2, args=(megabytes, reps, directory), timeout=900)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    rank0 = results[0]
    times = rank0["times"]
    config = f"MLP of {rank0['tensors'] / 2**20:.0f} MiB float32, MultiWorkerMirrored 2 workers"
    print(_line("save", config, times["torch_save"], times["save"], "ratio <= 1.3"))
    print(_line("restore", config, times["torch_load"], times["restore"], "ratio <= 1.1"))
    print(
        json.dumps(
            {
                "bench": "bytes",
                "config": config,
                "state_dict_tensor_bytes": rank0["tensors"],
                "torch_save_file_bytes": rank0["torch_file"],
                "checkpoint_bytes": rank0["disk"],
                "ratio": round(rank0["disk"] / rank0["tensors"], 4),
                "goal": "ratio <= 1.05",
            }
        )
    )


if __name__ == "__main__":
    main()
