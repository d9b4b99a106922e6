"""ProcessGroupCollectives against raw torch.distributed, in 2 local processes (gloo).

    python benchmarks/bench_collectives.py            # full (about a minute)
    python benchmarks/bench_collectives.py --quick    # smoke run

Prints one JSON line per case: {"bench", "config", "baseline", "baseline_ms",
"distribute_ms", "ratio", "goal"}. ``ratio`` is baseline time / distribute time,
so above 1 means distribute is faster. Both sides run in the same processes, one
thread each, with their repetitions interleaved; medians are reported.

Cases:
* ``large_all_reduce``: one 64 MiB float32 tensor, `all_reduce` against an
  in-place ``dist.all_reduce``: by default (a new output tensor, so the input is
  untouched; with and without the signature check) and with ``in_place=True``
  (no copy, like the baseline). Goal: ratio >= 0.95.
* ``packed_small``: 1000 tensors of 256 floats, packed (one pack, and 4 MiB
  packs) against one ``dist.all_reduce`` per tensor. Goal: ratio (speed-up) > 1.
* ``all_reduce_int``: the per-step end-of-data agreement against a raw 8-byte
  ``dist.all_reduce``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distribute import launch
from distribute._enums import ReduceOp
from distribute.cluster_resolver import resolve_cluster
from distribute.collectives.process_group import ProcessGroupCollectives


def _time_ms(fn: Callable[[], object], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1000


def _compare(cases: dict[str, Callable[[], object]], rounds: int, iters: int) -> dict[str, float]:
    """Median ms per call of each case, rounds interleaved; every rank runs the same."""
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()  # warm-up
    for _ in range(rounds):
        for key, fn in cases.items():
            dist.barrier()
            samples[key].append(_time_ms(fn, iters))
    return {k: statistics.median(v) for k, v in samples.items()}


def _worker(quick: bool) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    resolver = resolve_cluster()
    assert resolver is not None
    c = ProcessGroupCollectives.create(
        resolver.rank, resolver.world_size, resolver.master_addr, resolver.master_port
    )
    world = c.world_size
    rounds, iters = (3, 2) if quick else (7, 5)
    lines: list[dict[str, Any]] = []

    big = torch.randn((16 << 20) // (16 if quick else 1) // 4 * 4)  # 64 MiB (4 MiB quick)
    mib = big.numel() * 4 / 2**20
    t = _compare(
        {
            "raw": lambda: dist.all_reduce(big),
            "checked": lambda: c.all_reduce([big], ReduceOp.SUM, name="big"),
            "unchecked": lambda: c.all_reduce([big], ReduceOp.SUM, name="big", check=False),
            "in_place": lambda: c.all_reduce([big], ReduceOp.SUM, name="big", in_place=True),
        },
        rounds,
        iters,
    )
    for variant in ("checked", "unchecked", "in_place"):
        lines.append(
            {
                "bench": "large_all_reduce",
                "config": f"{mib:.0f} MiB float32, {variant}, world {world}",
                "baseline": "dist.all_reduce (in place)",
                "baseline_ms": round(t["raw"], 2),
                "distribute_ms": round(t[variant], 2),
                "ratio": round(t["raw"] / t[variant], 3),
                "goal": ">= 0.95",
            }
        )

    small = [torch.randn(256) for _ in range(1000)]

    def per_tensor() -> None:
        for s in small:
            dist.all_reduce(s)

    t = _compare(
        {
            "raw": per_tensor,
            "one_pack": lambda: c.all_reduce(small, ReduceOp.SUM, name="small"),
            "4mib_packs": lambda: c.all_reduce(
                small, ReduceOp.SUM, name="small", bytes_per_pack=4 << 20
            ),
            "64kib_packs": lambda: c.all_reduce(
                small, ReduceOp.SUM, name="small", bytes_per_pack=64 << 10
            ),
        },
        max(rounds // 2, 2),
        1 if quick else 3,
    )
    for variant in ("one_pack", "4mib_packs", "64kib_packs"):
        lines.append(
            {
                "bench": "packed_small",
                "config": f"1000 x 256 float32, {variant}, world {world}",
                "baseline": "dist.all_reduce per tensor",
                "baseline_ms": round(t["raw"], 2),
                "distribute_ms": round(t[variant], 2),
                "ratio": round(t["raw"] / t[variant], 1),
                "goal": "> 1 (speed-up)",
            }
        )

    one = torch.zeros(1, dtype=torch.int64)
    t = _compare(
        {
            "raw": lambda: dist.all_reduce(one),
            "int": lambda: c.all_reduce_int(1, "end of data"),
        },
        rounds,
        200 if quick else 1000,
    )
    lines.append(
        {
            "bench": "all_reduce_int",
            "config": f"one int, world {world}",
            "baseline": "dist.all_reduce of int64[1]",
            "baseline_ms": round(t["raw"], 4),
            "distribute_ms": round(t["int"], 4),
            "ratio": round(t["raw"] / t["int"], 3),
            "goal": "~1",
        }
    )
    c.shutdown()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    results = launch.run(_worker, args.workers, args=(args.quick,), timeout=900)
    for line in results[0]:
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
