"""MultiWorkerMirroredStrategy against DistributedDataParallel, and collectives against
raw torch.distributed, in the same worker processes (gloo on 127.0.0.1).

    python benchmarks/bench_multi_worker.py            # full (a few minutes)
    python benchmarks/bench_multi_worker.py --quick    # smoke run

Prints JSON lines: {"bench", "config", "baseline_ms", "distribute_ms", "ratio", "goal"}.
Both sides use the same model, batches, backend and threads (1 per process), and
their repetitions are interleaved; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import distribute as ds  # noqa: E402
from distribute import launch  # noqa: E402
from distribute._enums import ReduceOp  # noqa: E402


def _model(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(256, width), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


def _time(fn: Any, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1000


def _worker(quick: bool) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    strategy = ds.MultiWorkerMirroredStrategy()
    collectives = strategy.extended._cross_worker  # type: ignore[attr-defined]
    world = strategy.num_workers
    width, depth, batch = (512, 2, 32) if quick else (1024, 3, 64)
    rounds, iters = (2, 3) if quick else (5, 10)
    torch.manual_seed(0)
    x = torch.randn(batch, 256)
    y = torch.randint(0, 10, (batch,))
    global_batch = batch * world

    with strategy.scope():
        model = _model(width, depth)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        ds.compute_average_loss(per_example, global_batch_size=global_batch).backward()
        optimizer.step()
        optimizer.zero_grad()

    baseline = _model(width, depth)
    ddp = DistributedDataParallel(baseline)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    def ddp_step() -> None:
        per_example = torch.nn.functional.cross_entropy(ddp(x), y, reduction="none")
        (per_example.sum() / batch).backward()
        ddp_opt.step()
        ddp_opt.zero_grad()

    params = sum(p.numel() for p in baseline.parameters())
    results = []
    dist_ms, base_ms = [], []
    for _ in range(2):  # warm-up (the first strategy step also builds the buckets)
        strategy.run(step)
        ddp_step()
    for _ in range(rounds):
        dist_ms.append(_time(lambda: strategy.run(step), iters))
        base_ms.append(_time(ddp_step, iters))
    results.append(
        _line("train_step_vs_ddp", f"{world} workers, MLP {params / 1e6:.1f}M params, "
              f"batch {batch}/worker, SGD momentum, gloo", base_ms, dist_ms, "<= 1.0")
    )

    # Large all-reduce: throughput of ProcessGroupCollectives vs raw dist.all_reduce.
    big = torch.randn((4 if quick else 16) * 1024 * 1024)  # 16 M floats = 64 MB
    raw_ms, ours_ms = [], []
    for _ in range(rounds):
        raw_ms.append(_time(lambda: dist.all_reduce(big.clone()), 2))
        ours_ms.append(
            _time(lambda: collectives.all_reduce([big], ReduceOp.SUM, name="big"), 2)
        )
    results.append(
        _line("large_all_reduce", f"{big.numel() * 4 / 2**20:.0f} MB float32 "
              "(time ratio; throughput ratio = 1/ratio)", raw_ms, ours_ms, "throughput >= 0.95")
    )

    # 1000 small tensors: packed into one collective vs one collective per tensor.
    small = [torch.randn(256) for _ in range(1000)]
    per_tensor_ms, packed_ms = [], []
    for _ in range(rounds):
        per_tensor_ms.append(
            _time(lambda: [dist.all_reduce(t.clone()) for t in small], 1)
        )
        packed_ms.append(
            _time(lambda: collectives.all_reduce(small, ReduceOp.SUM, name="small"), 1)
        )
    results.append(
        _line("packed_vs_per_tensor", "1000 x 256 float32 all-reduce (speedup = 1/ratio)",
              per_tensor_ms, packed_ms, "speedup >= 10")
    )
    strategy.shutdown()
    return results


def _line(bench: str, config: str, base: list[float], ours: list[float], goal: str) -> dict[str, Any]:
    b, o = statistics.median(base), statistics.median(ours)
    return {
        "bench": bench, "config": config, "baseline_ms": round(b, 3), "distribute_ms": round(o, 3),
        "ratio": round(o / b, 3), "goal": goal,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    results = launch.run(_worker, args.workers, args=(args.quick,), timeout=900)
    for line in results[0]:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
