"""MultiWorkerMirroredStrategy against DistributedDataParallel, and collectives against
raw torch.distributed, in the same worker processes (gloo on 127.0.0.1).

    python benchmarks/bench_multi_worker.py            # full (a few minutes)
    python benchmarks/bench_multi_worker.py --quick    # smoke run
    python benchmarks/bench_multi_worker.py --bytes-per-pack 0   # no overlap

Prints JSON lines: {"bench", "config", "baseline_ms", "distribute_ms", "ratio",
"paired_ratio", "paired_ratio_iqr", "reps", "goal", "loadavg_1m_before"}.
Both sides use the same model, batches, backend, bucket size (25 MiB, first bucket
1 MiB: DDP's defaults) and threads (1 per process). Each side is warmed up first;
then the sides run in turn inside every repetition, in an order that alternates
(so drifts of a shared machine hit both alike), and the medians of the
per-repetition times are reported. ratio = distribute_ms / baseline_ms (lower is
better); paired_ratio and paired_ratio_iqr are the median and quartiles of the
per-repetition ratios (robust to load that comes and goes, and a measure of the
noise: figures taken while loadavg_1m_before is well above 0 are suspect).

Benchmarks:
    train_step_vs_ddp          one training step (forward, backward, SGD momentum,
                               zero_grad): `strategy.run(step)` against the same step
                               of a DistributedDataParallel model. Goal: <= 1.0.
    train_step_floor           from the same interleaved run: the step without any
                               communication and one raw all-reduce of every
                               gradient, each alone, against DDP's step: the larger
                               of the two (a perfectly overlapped step,
                               overlapped_floor_ratio) and their sum (no overlap,
                               no copy into buckets, serial_floor_ratio).
    large_all_reduce           64 MB float32 in place: `all_reduce(..., in_place=True)`
                               against raw `dist.all_reduce(t)`. Goal: throughput
                               (1 / ratio) >= 0.95.
    large_all_reduce_copy      the same returning a new tensor (the default) against
                               raw `dist.all_reduce(t.clone())`.
    packed_vs_per_tensor       1000 tensors of 256 floats: one packed `all_reduce`
                               against 1000 raw calls. Goal: 10x faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import interleaved, quartiles

import distribute as ds
from distribute import launch
from distribute._enums import ReduceOp


def _model(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(256, width), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


def _interleaved(cases: dict[str, Any], reps: int, calls: int) -> dict[str, list[float]]:
    """Milliseconds per call of each case, one sample per repetition, after one warm-up call.

    Every worker runs the same sequence, as collectives require.
    """
    seconds = interleaved(cases, reps, calls, warmup_calls=1)
    return {name: [t * 1000 for t in ts] for name, ts in seconds.items()}


def _worker(quick: bool, bytes_per_pack: int | None = None) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    # Both sides keep their defaults, which agree: buckets of 25 MiB, the first one
    # (the last layers' gradients) closed after 1 MiB. Do not pass DDP an explicit
    # bucket_cap_mb: that also turns its small first bucket off (torch 2.13), and a
    # single bucket then changes how much communication overlaps the backward pass.
    options = (
        None
        if bytes_per_pack is None
        else ds.experimental.CommunicationOptions(bytes_per_pack=bytes_per_pack)
    )
    strategy = ds.MultiWorkerMirroredStrategy(communication_options=options)
    collectives = strategy.extended.cross_worker
    world = strategy.num_workers
    width, depth, batch = (512, 2, 32) if quick else (1024, 3, 64)
    # Repetitions of `iters` steps: on a shared 2-core machine one repetition's ratio
    # swings by about +-10%, so the median needs a few dozen of them.
    warmup, step_reps, iters = (3, 4, 3) if quick else (5, 40, 5)
    reps = 4 if quick else 20
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
    load = os.getloadavg()[0]
    results = []
    for _ in range(warmup):  # the first strategy step also builds the buckets
        strategy.run(step)
        ddp_step()
    # The two halves of a step, alone, in the same interleaved run: the step without
    # communication (a plain copy of the model, one worker's batch), and one raw
    # all-reduce of a flat buffer of every gradient (what either side must send).
    # Overlapped perfectly, a step costs the larger of the two: the floor of any
    # design that sends the same gradients (`train_step_floor`).
    alone = _model(width, depth)
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.01, momentum=0.9)
    flat = torch.zeros(params)

    def compute_only() -> None:
        per_example = torch.nn.functional.cross_entropy(alone(x), y, reduction="none")
        (per_example.sum() / batch).backward()
        alone_opt.step()
        alone_opt.zero_grad()

    t = _interleaved(
        {
            "ddp": ddp_step,
            "ours": lambda: strategy.run(step),
            "compute": compute_only,
            "all_reduce": lambda: dist.all_reduce(flat),
        },
        step_reps,
        iters,
    )
    results.append(
        _line(
            "train_step_vs_ddp",
            f"{world} workers, MLP {params / 1e6:.1f}M params, "
            f"batch {batch}/worker, SGD momentum, gloo, buckets (bytes) ours "
            f"{_our_buckets(strategy, optimizer)}, DDP {_ddp_buckets(ddp)}",
            t["ddp"],
            t["ours"],
            "<= 1.0",
            load,
        )
    )
    ddp_ms = t["ddp"]
    overlapped = [max(c, a) / d for c, a, d in zip(t["compute"], t["all_reduce"], ddp_ms)]
    serial = [(c + a) / d for c, a, d in zip(t["compute"], t["all_reduce"], ddp_ms)]
    results.append(
        {
            "bench": "train_step_floor",
            "config": "the step without communication and one raw all-reduce of every "
            f"gradient ({params * 4 / 2**20:.1f} MiB), each alone, against DDP's step",
            "ddp_ms": round(statistics.median(ddp_ms), 3),
            "compute_ms": round(statistics.median(t["compute"]), 3),
            "all_reduce_ms": round(statistics.median(t["all_reduce"]), 3),
            "overlapped_floor_ratio": round(statistics.median(overlapped), 3),
            "serial_floor_ratio": round(statistics.median(serial), 3),
            "reps": len(ddp_ms),
            "loadavg_1m_before": round(load, 2),
        }
    )

    # Large all-reduce: throughput of ProcessGroupCollectives vs raw dist.all_reduce,
    # in place (each side on its own tensor; sums double at every call, harmlessly),
    # and returning a new tensor (raw: reduce a clone).
    numel = (4 if quick else 16) * 1024 * 1024  # 16 M floats = 64 MB
    big = torch.randn(numel)
    mine = big.clone()
    theirs = big.clone()
    mb = f"{numel * 4 / 2**20:.0f} MB float32"
    load = os.getloadavg()[0]
    t = _interleaved(
        {
            "raw": lambda: dist.all_reduce(theirs),
            "ours": lambda: collectives.all_reduce([mine], ReduceOp.SUM, name="big", in_place=True),
        },
        reps,
        1,
    )
    results.append(
        _line(
            "large_all_reduce",
            f"{mb} in place (time ratio; throughput ratio = 1/ratio)",
            t["raw"],
            t["ours"],
            "throughput >= 0.95",
            load,
        )
    )
    load = os.getloadavg()[0]
    t = _interleaved(
        {
            "raw": lambda: dist.all_reduce(big.clone()),
            "ours": lambda: collectives.all_reduce([big], ReduceOp.SUM, name="big"),
        },
        reps,
        1,
    )
    results.append(
        _line(
            "large_all_reduce_copy",
            f"{mb} into a new tensor (raw: reduce a clone)",
            t["raw"],
            t["ours"],
            "throughput >= 0.95",
            load,
        )
    )

    # 1000 small tensors: packed into one collective vs one collective per tensor.
    small = [torch.randn(256) for _ in range(1000)]
    load = os.getloadavg()[0]
    t = _interleaved(
        {
            "raw": lambda: [dist.all_reduce(x.clone()) for x in small],
            "ours": lambda: collectives.all_reduce(small, ReduceOp.SUM, name="small"),
        },
        max(3, reps // 3),
        1,
    )
    results.append(
        _line(
            "packed_vs_per_tensor",
            "1000 x 256 float32 all-reduce (speedup = 1/ratio)",
            t["raw"],
            t["ours"],
            "speedup >= 10",
            load,
        )
    )
    strategy.shutdown()
    return results


def _our_buckets(strategy: Any, optimizer: Any) -> list[int] | None:
    """The strategy's gradient bucket sizes in bytes (internals: None if they moved)."""
    try:
        reducer = strategy.extended.step_handler._sums[optimizer][1]
        return [int(b.buffer.numel() * b.buffer.element_size()) for b in reducer._buckets]
    except (AttributeError, KeyError, TypeError):
        return None


def _ddp_buckets(ddp: Any) -> list[int] | None:
    """DDP's bucket sizes in bytes after its first-iteration rebuild (None if unknown)."""
    try:
        sizes = ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"]
        return [int(s) for s in str(sizes).split(",")]
    except (AttributeError, KeyError, ValueError):
        return None


def _line(
    bench: str, config: str, base: list[float], ours: list[float], goal: str, load: float
) -> dict[str, Any]:
    b, o = statistics.median(base), statistics.median(ours)
    paired = [d / r for r, d in zip(base, ours)]
    q = quartiles(paired)
    return {
        "bench": bench,
        "config": config,
        "baseline_ms": round(b, 3),
        "distribute_ms": round(o, 3),
        "ratio": round(o / b, 3),
        "paired_ratio": round(statistics.median(paired), 3),
        "paired_ratio_iqr": [round(q[0], 3), round(q[1], 3)],
        "reps": len(paired),
        "goal": goal,
        "loadavg_1m_before": round(load, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--bytes-per-pack",
        type=int,
        help="the strategy's bucket size (0: one bucket, launched at the step: no overlap "
        "with backward); default: DDP's",
    )
    args = parser.parse_args()
    results = launch.run(_worker, args.workers, args=(args.quick, args.bytes_per_pack), timeout=900)
    for line in results[0]:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
