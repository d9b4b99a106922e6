"""ModelParallelStrategy against the same tensor parallelism written by hand with torch's
``parallelize_module`` (step time) and against MultiWorkerMirroredStrategy (memory,
step time), in 2 and 4 CPU worker processes (gloo on 127.0.0.1, one thread each).

    python benchmarks/bench_model_parallel.py               # 2 and 4 workers
    python benchmarks/bench_model_parallel.py --workers 2   # one world size
    python benchmarks/bench_model_parallel.py --quick       # smoke run (small, 2 workers)

The model is 4 x (Linear(1024, 4096), GELU, Linear(4096, 1024)) in a Sequential (33.6 M
parameters), Adam (torch's default: the single-tensor path on the CPU), MSE loss
summed and divided by the global batch of 32. ModelParallelStrategy runs it on a
(1, W) mesh ("batch", "model"): the first Linear of each pair column-parallel (weight
``("model", None)``, bias ``("model",)``), the second row-parallel (weight
``(None, "model")``); every worker sees the whole batch. By hand: the same layers
through ``parallelize_module(model, init_device_mesh("cpu", (W,)), {..: ColwiseParallel(),
..: RowwiseParallel()})``, torch's defaults, the step called directly.
MultiWorkerMirroredStrategy holds the whole model on every worker and takes 32/W rows.

Prints JSON lines, the baseline beside each figure:

    step_vs_by_hand      one step (forward, backward, Adam, zero_grad): the strategy's
                         `run` against parallelize_module by hand. Goal: <= 1.05.
    state_vs_mirrored    bytes of this worker's parameters and optimizer state (unique
                         storages of the local tensors, after a step), strategy vs
                         MultiWorkerMirroredStrategy. Goal: <= 0.55 at 2 workers,
                         <= 0.30 at 4.
    step_vs_mirrored     the strategy's step against MultiWorkerMirroredStrategy's
                         (reported: tensor parallelism moves activations, data
                         parallelism gradients).

The three models live in one set of processes; their steps are interleaved
(`_timing.interleaved`, order alternating) after warm-up, and the medians of the
per-repetition times are reported with the paired ratio and its quartiles. Figures
taken while ``loadavg_1m_before`` is well above 1 on a 2-core machine are suspect.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import emit, interleaved, quartiles

import distribute as ds
from distribute import launch

MiB = 2**20
NAMES = {
    "model_parallel": "ModelParallelStrategy",
    "by_hand": "parallelize_module by hand",
    "mirrored": "MultiWorkerMirroredStrategy",
}
STATE_GOALS = {2: "<= 0.55", 4: "<= 0.30"}


def _model(width: int, hidden: int, pairs: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(pairs):
        layers += [torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width)]
    return torch.nn.Sequential(*layers)


def _layout_map(world: int, pairs: int) -> ds.experimental.LayoutMap:
    mesh = ds.experimental.DeviceMesh((1, world), ("batch", "model"))
    layouts = ds.experimental.LayoutMap(mesh)
    first = "|".join(str(3 * i) for i in range(pairs))  # Sequential indices 0, 3, 6, ...
    second = "|".join(str(3 * i + 2) for i in range(pairs))  # 2, 5, 8, ...
    layouts[rf"^({first})\.weight$"] = ("model", None)  # column-parallel
    layouts[rf"^({first})\.bias$"] = ("model",)
    layouts[rf"^({second})\.weight$"] = (None, "model")  # row-parallel
    return layouts


def _by_hand(model: torch.nn.Sequential, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("model",))
    plan: dict[str, Any] = {}
    for i in range(0, len(model), 3):
        plan[str(i)] = ColwiseParallel()
        plan[str(i + 2)] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


class _Side:
    """One side's model, optimizer and step."""

    def __init__(
        self, strategy: Any, model: Callable[[], torch.nn.Module], x: torch.Tensor, batch: int
    ) -> None:
        self.strategy = strategy
        if strategy is not None:
            with strategy.scope():
                self.model = model()
                self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        else:
            self.model = model()
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x, self.batch = x, batch
        self.state_bytes = 0

    def _step(self, measure: bool = False) -> None:
        per_example = ((self.model(self.x) - 1.0) ** 2).sum(dim=1)
        ds.compute_average_loss(per_example, global_batch_size=self.batch).backward()
        self.optimizer.step()
        if measure:
            self.state_bytes = _state_bytes(self.strategy, self.model, self.optimizer)
        self.optimizer.zero_grad()

    def step(self, measure: bool = False) -> None:
        if self.strategy is None:
            self._step(measure)
        else:
            self.strategy.run(self._step, args=(measure,))


def _state_bytes(strategy: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Unique storage bytes of this worker's parameters and optimizer state."""
    tensors: list[Any] = []
    for p in model.parameters():
        tensors += [p] if strategy is None else [p, *strategy.experimental_local_results(p)]
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    seen, total = set(), 0
    for t in tensors:
        if hasattr(t, "to_local"):  # a DTensor: this worker's part
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _worker(
    width: int, hidden: int, pairs: int, batch: int, reps: int, calls: int, warmup: int
) -> dict[str, Any]:
    torch.set_num_threads(1)
    import torch.distributed as dist

    layouts = _layout_map(int(os.environ["WORLD_SIZE"]), pairs)
    model_parallel = ds.experimental.ModelParallelStrategy(layouts)  # makes the group
    mirrored = ds.MultiWorkerMirroredStrategy()  # adopts the group
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=g)
    rows = slice(rank * batch // world, (rank + 1) * batch // world)

    def model() -> torch.nn.Module:
        return _model(width, hidden, pairs)

    sides = {
        "model_parallel": _Side(model_parallel, model, x, batch),
        "by_hand": _Side(None, lambda: _by_hand(model(), world), x, batch),
        "mirrored": _Side(mirrored, model, x[rows].contiguous(), batch),
    }
    for side in sides.values():
        side.step(measure=True)
    seconds = interleaved(
        {name: side.step for name, side in sides.items()}, reps, calls, warmup_calls=warmup
    )
    return {
        "ms": {name: [s * 1000 for s in samples] for name, samples in seconds.items()},
        "state": {name: side.state_bytes for name, side in sides.items()},
    }


def _time_line(
    bench: str, base: str, ms: dict[str, list[float]], common: dict[str, Any], goal: str
) -> dict[str, Any]:
    b, o = statistics.median(ms[base]), statistics.median(ms["model_parallel"])
    paired = [d / r for r, d in zip(ms[base], ms["model_parallel"])]
    q = quartiles(paired)
    return {
        "bench": bench,
        "baseline": NAMES[base],
        "baseline_ms": round(b, 2),
        "distribute_ms": round(o, 2),
        "ratio": round(o / b, 3),
        "paired_ratio": round(statistics.median(paired), 3),
        "paired_ratio_iqr": [round(q[0], 3), round(q[1], 3)],
        "reps": len(paired),
        "goal": goal,
        **common,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: small, 2 workers")
    parser.add_argument("--workers", type=int, nargs="+", default=None, help="default: 2 4")
    args = parser.parse_args()
    worlds = args.workers or ([2] if args.quick else [2, 4])
    width, hidden, pairs, batch = (256, 1024, 2, 16) if args.quick else (1024, 4096, 4, 32)
    reps, calls, warmup = (3, 1, 1) if args.quick else (12, 2, 2)
    params = pairs * (2 * width * hidden + hidden + width)
    config = (
        f"{pairs} x (Linear({width}, {hidden}), GELU, Linear({hidden}, {width})), "
        f"{params / 1e6:.1f}M params, Adam, global batch {batch}, gloo, 1 thread per worker"
    )
    here = str(Path(__file__).resolve().parent)
    for world in worlds:
        load = os.getloadavg()[0]
        results = launch.run(
            _worker,
            world,
            args=(width, hidden, pairs, batch, reps, calls, warmup),
            timeout=1800,
            env={"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])},
        )
        common = {"workers": world, "config": config, "loadavg_1m_before": round(load, 2)}
        ms = {
            name: [statistics.median(r["ms"][name][i] for r in results) for i in range(reps)]
            for name in NAMES
        }  # per repetition, the median over the workers
        emit(_time_line("step_vs_by_hand", "by_hand", ms, common, "<= 1.05"))
        state = {name: max(r["state"][name] for r in results) for name in NAMES}
        emit(
            {
                "bench": "state_vs_mirrored",
                "baseline": NAMES["mirrored"],
                "baseline_mib": round(state["mirrored"] / MiB, 1),
                "distribute_mib": round(state["model_parallel"] / MiB, 1),
                "by_hand_mib": round(state["by_hand"] / MiB, 1),
                "ratio": round(state["model_parallel"] / state["mirrored"], 3),
                "goal": STATE_GOALS.get(world, "reported"),
                **common,
            }
        )
        emit(_time_line("step_vs_mirrored", "mirrored", ms, common, "reported"))


if __name__ == "__main__":
    main()
