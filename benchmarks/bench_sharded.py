"""FullyShardedStrategy (FSDP2) against MultiWorkerMirroredStrategy (memory, step time)
and against the same FSDP2 written by hand (step time), in 2 and 4 CPU worker
processes (gloo on 127.0.0.1, one thread each).

    python benchmarks/bench_sharded.py                  # 2 and 4 workers (about 6 min)
    python benchmarks/bench_sharded.py --workers 2      # one world size
    python benchmarks/bench_sharded.py --quick          # smoke run (small model, 2 workers)

The model is parameter-heavy: 8 x (Linear(1024, 1024), ReLU), 8.4 M parameters
(32 MiB of float32), Adam (torch's default, single-tensor path on the CPU), MSE loss
summed and divided by the global batch of 64 (32 examples per worker at 2 workers,
16 at 4). FSDP's units are the 8 Linear layers and the root (the strategy's default:
the repeated blocks of a Sequential), ZeRO-3 (reshard after forward; the root keeps
FSDP's default).

Prints JSON lines, the baseline beside each figure:

    state_vs_mirrored     live tensor bytes held between steps by one worker: its
                          parameters, gradients and optimizer state (unique storages,
                          taken after optimizer.step(), before zero_grad), strategy
                          vs MultiWorkerMirroredStrategy. Exactly 1/W in theory.
    peak_vs_mirrored      the peak of live CPU tensor bytes during two steady-state
                          steps: the built model's parameters (their storages), plus
                          what the profiler's allocator events show allocated and not
                          yet freed from the first step on (see `_peak_live`): state
                          plus the transients (gathered units, prefetch, reduce-scatter
                          buffers, activations, temporaries). Median and max over
                          the runs and the ranks (it varies from run to run: CPU FSDP
                          holds its buffers longer or shorter depending on timing).
    rss_vs_mirrored       the peak resident set during the same steps minus the RSS
                          before the model was built (sampled every 2 ms, with
                          MALLOC_MMAP_THRESHOLD_=65536 so that freed blocks go back
                          to the OS), median and max over runs and ranks.
    peak_vs_by_hand       the strategy's peak against the same FSDP2 written by hand:
                          what the library adds (reported).
    step_vs_by_hand       one training step (forward, backward, Adam, zero_grad):
                          `strategy.run(step)` against the same FSDP2 by hand
                          (`fully_shard` on the same units, same mesh: the world
                          group; same settings: force-sum reduction, divide factor
                          1, reduce-scatter of unused parameters, ZeRO-3).
                          Goal: <= 1.05.
    step_vs_mirrored      the strategy's step against MultiWorkerMirroredStrategy's
                          (reported; FSDP is slower on a CPU: see benchmarks/README).
    peak_breakdown        what was alive at the highest peak of each side, by the op
                          that allocated it (the largest entries).

Memory goals (issue #25): <= 0.60 at 2 workers, <= 0.40 at 4 (the same goal is
printed beside state, peak and RSS). Each memory run is a fresh set of worker
processes measuring one side (the sides alternate from run to run); step times are
taken in one set of processes holding all three models, the cases interleaved
(`_timing.interleaved`, order alternating) after warm-up, medians of the
per-repetition times reported with the paired ratio and its quartiles. Figures taken
while ``loadavg_1m_before`` (the machine's load before the workers started) is well
above 1 on a 2-core machine are suspect.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _fsdp_baseline import fsdp_by_hand
from _timing import interleaved, quartiles

import distribute as ds
from distribute import launch

MiB = 2**20
SIDES = ("mirrored", "sharded", "by_hand")
NAMES = {
    "mirrored": "MultiWorkerMirroredStrategy",
    "sharded": "FullyShardedStrategy",
    "by_hand": "FSDP2 by hand",
}
GOALS = {2: "<= 0.60", 4: "<= 0.40"}


# -- the model and the step (the same on every side) ---------------------------------------


def _model(width: int, layers: int) -> torch.nn.Sequential:
    modules: list[torch.nn.Module] = []
    for _ in range(layers):
        modules += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules)


class _Side:
    """One side's model, optimizer and step."""

    def __init__(
        self,
        side: str,
        strategy: Any,
        width: int,
        layers: int,
        x: torch.Tensor,
        y: torch.Tensor,
        global_batch: int,
    ) -> None:
        torch.manual_seed(0)
        self.strategy = strategy
        if strategy is not None:
            with strategy.scope():
                self.model: torch.nn.Module = _model(width, layers)
                self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        else:
            self.model = fsdp_by_hand(_model(width, layers))
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.side = side
        self.x, self.y, self.global_batch = x, y, global_batch
        self.state_bytes = 0

    def _step(self, measure_state: bool = False) -> None:
        per_example = ((self.model(self.x) - self.y) ** 2).sum(dim=1)
        ds.compute_average_loss(per_example, global_batch_size=self.global_batch).backward()
        self.optimizer.step()
        if measure_state:
            self.state_bytes = _state_bytes(self.strategy, self.model, self.optimizer)
        self.optimizer.zero_grad()

    def step(self, measure_state: bool = False) -> None:
        if self.strategy is None:
            self._step(measure_state)
        else:
            self.strategy.run(self._step, args=(measure_state,))


def _state_bytes(strategy: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Unique storage bytes of this worker's parameters, gradients and optimizer state."""
    tensors: list[Any] = []
    for p in model.parameters():  # a MirroredVariable holds .grad, its component the values
        components = [] if strategy is None else list(strategy.experimental_local_results(p))
        for c in [p, *components]:
            tensors += [c, c.grad]
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # a DTensor: this worker's shard
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _strategy(side: str) -> Any:
    if side == "mirrored":
        return ds.MultiWorkerMirroredStrategy()
    if side == "sharded":
        return ds.experimental.FullyShardedStrategy()
    return None


def _data(rank: int, world: int, width: int, global_batch: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(global_batch, width, generator=g),
        torch.randn(global_batch, width, generator=g),
    )
    part = slice(rank * global_batch // world, (rank + 1) * global_batch // world)
    return x[part].contiguous(), y[part].contiguous()


# -- memory ---------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RSSPeak:
    """The peak RSS inside a block, sampled every 2 ms by a thread."""

    def __enter__(self) -> _RSSPeak:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _allocations(prof: Any) -> list[tuple[int, int, int, str]]:
    """(time ns, +/- bytes, address, allocating op) of every CPU allocator event the
    profiler saw, in time order. The op is the nearest enclosing FSDP, optimizer,
    matmul or backward op (else the innermost one). Allocations on threads the
    profiler does not follow (gloo's own) are not seen, on either side."""
    from torch._C._profiler import _EventType

    wanted = ("FSDP::", "Optimizer.", "aten::mm", "aten::addmm")
    events = []
    stack: list[tuple[Any, tuple[str, ...]]] = [
        (n, ()) for n in prof.profiler.kineto_results.experimental_event_tree()
    ]
    while stack:
        node, names = stack.pop()
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            label = next(
                (n for n in reversed(names) if n.startswith(wanted) or "Backward" in n),
                names[-1] if names else "<python>",
            )
            events.append((node.start_time_ns, node.typed[1].alloc_size, node.typed[1].ptr, label))
        stack.extend((child, (*names, node.name)) for child in node.children)
    return sorted(events, key=lambda e: e[0])


def _peak_live(
    events: Sequence[tuple[int, int, int, str]], start: int, end: int, built: int
) -> dict[str, Any]:
    """The peak of live bytes inside [start, end], counted from ``built`` bytes live
    when the profiler started (the model as built); the live bytes at ``start``; and
    what was alive at the peak, by allocating op.

    Only blocks allocated on a followed thread count, and a block is gone when it is
    freed, or when the allocator hands its address out again (it was freed on a thread
    the profiler does not follow: gloo's, dropping the last reference to a
    collective's buffer)."""
    live: dict[int, tuple[int, str, bool]] = {-1: (built, "the model as built", True)}
    running = peak = built
    at_start = None
    at_peak: dict[int, tuple[int, str, bool]] = {}
    for t, size, ptr, label in events:
        if t >= start and at_start is None:
            at_start = running
        if size > 0:
            stale = live.pop(ptr, None)
            if stale is not None:  # freed unseen: the address is in use again
                running -= stale[0]
            live[ptr] = (size, label, t < start)
            running += size
        elif ptr in live:
            running -= live.pop(ptr)[0]
        # else: a block allocated where the profiler does not look; never counted
        if start <= t <= end and running > peak:
            peak, at_peak = running, dict(live)
    by_op: collections.Counter[str] = collections.Counter()
    for size, label, before in at_peak.values():
        by_op[("before the steps: " if before else "in the steps: ") + label] += size
    return {
        "peak": peak,
        "at_start": at_start if at_start is not None else running,
        "by_op": [(k, round(v / MiB, 1)) for k, v in by_op.most_common(6)],
    }


def _memory_worker(side: str, width: int, layers: int, global_batch: int) -> dict[str, Any]:
    """One side's memory in a fresh process: state, peak live tensors, RSS growth."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    strategy = _strategy(side)
    if side == "by_hand":  # plain torch: a gloo group from launch's torchrun variables
        dist.init_process_group("gloo")

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _data(rank, world, width, global_batch)
    gc.collect()
    rss_before = _rss()
    model = _Side(side, strategy, width, layers, x, y, global_batch)
    gc.collect()
    # Profiling starts once the model is built (and sharded): what is live then is the
    # model's parameters, counted from their storages. The build's last transient, the
    # chief's values packed into one buffer of the whole model's size for the
    # broadcast, is sometimes freed by gloo's thread, which the profiler does not
    # follow: traced from before the build, that buffer stayed "alive" through the
    # steps in some runs (on both sides), while RSS showed it gone.
    built = _state_bytes(model.strategy, model.model, model.optimizer)
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )
    prof.__enter__()
    model.step(measure_state=True)  # the first step: FSDP's lazy init, Adam's state
    dist.barrier()
    start = time.time_ns()
    with _RSSPeak() as rss:
        model.step()
        model.step()
    end = time.time_ns()
    prof.__exit__(None, None, None)
    live = _peak_live(_allocations(prof), start, end, built)
    local = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.model.parameters()
    )
    return {
        "state": model.state_bytes,
        "peak": live["peak"],
        "at_start": live["at_start"],
        "by_op": live["by_op"],
        "rss": rss.peak - rss_before,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "local_numel": local,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }


# -- step time ------------------------------------------------------------------------------


def _time_worker(
    width: int, layers: int, global_batch: int, reps: int, calls: int, warmup: int
) -> dict[str, Any]:
    """The three sides' steps, interleaved, in one set of processes (ms per step)."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    sharded = ds.experimental.FullyShardedStrategy()  # makes the group
    mirrored = ds.MultiWorkerMirroredStrategy()  # adopts it
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _data(rank, world, width, global_batch)
    sides = {
        "sharded": _Side("sharded", sharded, width, layers, x, y, global_batch),
        "by_hand": _Side("by_hand", None, width, layers, x, y, global_batch),
        "mirrored": _Side("mirrored", mirrored, width, layers, x, y, global_batch),
    }
    cases: dict[str, Callable[[], None]] = {name: side.step for name, side in sides.items()}
    seconds = interleaved(cases, reps, calls, warmup_calls=warmup)
    return {
        "ms": {name: [s * 1000 for s in samples] for name, samples in seconds.items()},
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }


# -- the runs and the lines -----------------------------------------------------------------


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "max": max(values)}


def _memory_lines(
    world: int, runs: list[dict[str, list[dict[str, Any]]]], config: str, loads: list[float]
) -> list[dict[str, Any]]:
    def pooled(side: str, key: str) -> list[float]:
        return [r[key] / MiB for run in runs for r in run[side]]

    lines = []
    goal = GOALS.get(world, "reported")
    common = {
        "workers": world,
        "config": config,
        "runs": len(runs),
        "samples_per_side": len(pooled("sharded", "peak")),
        "loadavg_1m_before": [round(v, 2) for v in loads],
    }
    for bench, key, baseline in (
        ("state_vs_mirrored", "state", "mirrored"),
        ("peak_vs_mirrored", "peak", "mirrored"),
        ("rss_vs_mirrored", "rss", "mirrored"),
        ("peak_vs_by_hand", "peak", "by_hand"),
    ):
        base, ours = _stats(pooled(baseline, key)), _stats(pooled("sharded", key))
        line = {
            "bench": bench,
            "baseline": NAMES[baseline],
            "baseline_mib": {k: round(v, 1) for k, v in base.items()},
            "distribute_mib": {k: round(v, 1) for k, v in ours.items()},
            "ratio": round(ours["median"] / base["median"], 3),
            "ratio_of_max": round(ours["max"] / base["max"], 3),
            "goal": goal if baseline == "mirrored" else "reported",
            **common,
        }
        if key == "peak":  # persistent vs transient: what the goal is up against
            line["distribute_live_at_step_start_mib"] = round(
                statistics.median(pooled("sharded", "at_start")), 1
            )
            line["baseline_live_at_step_start_mib"] = round(
                statistics.median(pooled(baseline, "at_start")), 1
            )
        lines.append(line)
    breakdown: dict[str, Any] = {"bench": "peak_breakdown", "workers": world}
    for side in SIDES:
        worst = max((r for run in runs for r in run[side]), key=lambda r: r["peak"])
        breakdown[side] = {
            "peak_mib": round(worst["peak"] / MiB, 1),
            "state_mib": round(worst["state"] / MiB, 1),
            "live_at_step_start_mib": round(worst["at_start"] / MiB, 1),
            "alive_at_peak_by_op_mib": worst["by_op"],
            "local_numel": worst["local_numel"],
        }
    lines.append(breakdown)
    return lines


def _time_line(
    bench: str,
    base: str,
    ms: dict[str, list[float]],
    world: int,
    config: str,
    load: float,
    goal: str,
) -> dict[str, Any]:
    b, o = statistics.median(ms[base]), statistics.median(ms["sharded"])
    paired = [d / r for r, d in zip(ms[base], ms["sharded"])]
    q = quartiles(paired)
    return {
        "bench": bench,
        "workers": world,
        "config": config,
        "baseline": NAMES[base],
        "baseline_ms": round(b, 2),
        "distribute_ms": round(o, 2),
        "ratio": round(o / b, 3),
        "paired_ratio": round(statistics.median(paired), 3),
        "paired_ratio_iqr": [round(q[0], 3), round(q[1], 3)],
        "reps": len(paired),
        "goal": goal,
        "loadavg_1m_before": round(load, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: small model, 2 workers")
    parser.add_argument("--workers", type=int, nargs="+", default=None, help="default: 2 4")
    parser.add_argument("--runs", type=int, default=None, help="memory runs per side (3)")
    parser.add_argument("--only", choices=("memory", "time"), default=None)
    parser.add_argument("--width", type=int, default=None, help="Linear(width, width): 1024")
    parser.add_argument("--layers", type=int, default=None, help="how many of them: 8")
    args = parser.parse_args()
    worlds = args.workers or ([2] if args.quick else [2, 4])
    width, layers, global_batch = (256, 4, 16) if args.quick else (1024, 8, 64)
    width, layers = args.width or width, args.layers or layers
    runs = args.runs or (1 if args.quick else 3)
    reps, calls, warmup = (3, 1, 1) if args.quick else (15, 2, 3)
    params = layers * (width * width + width)
    config = (
        f"{layers} x Linear({width}, {width}) + ReLU, {params / 1e6:.1f}M params "
        f"({params * 4 / MiB:.0f} MiB), Adam, global batch {global_batch}, gloo, 1 thread "
        "per worker; FSDP units: the Linear layers and the root, ZeRO-3"
    )
    for world in worlds:
        if args.only in (None, "memory"):
            results: list[dict[str, list[dict[str, Any]]]] = []
            loads = []
            for run in range(runs):
                order = SIDES if run % 2 == 0 else SIDES[::-1]
                results.append({})
                for side in order:
                    loads.append(os.getloadavg()[0])
                    results[-1][side] = launch.run(
                        _memory_worker,
                        world,
                        args=(side, width, layers, global_batch),
                        env={"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"},
                        timeout=600,
                    )
            for line in _memory_lines(world, results, config, loads):
                print(json.dumps(line), flush=True)
        if args.only in (None, "time"):
            if "MALLOC_MMAP_THRESHOLD_" in os.environ:
                print("warning: MALLOC_MMAP_THRESHOLD_ is set: step times pay page faults")
            load = os.getloadavg()[0]
            timed = launch.run(
                _time_worker,
                world,
                args=(width, layers, global_batch, reps, calls, warmup),
                env={"OMP_NUM_THREADS": "1"},
                timeout=900,
            )[0]["ms"]  # rank 0's clock (every step is a collective of all ranks)
            for bench, base, goal in (
                ("step_vs_by_hand", "by_hand", "<= 1.05"),
                ("step_vs_mirrored", "mirrored", "reported"),
            ):
                print(json.dumps(_time_line(bench, base, timed, world, config, load, goal)))


if __name__ == "__main__":
    main()
