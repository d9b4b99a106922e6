"""Part 5 of tests/gpu/device_check.py: host syncs per steady-state training step.

    python tests/gpu/_check_syncs.py syncs --work DIR [--dry-run]

tests/distributed/test_sync_budget.py counts, on the CPU, the calls that would make
the host wait for a GPU. Here the real ones are counted on CUDA with the profiler
(`torch.profiler`, CPU and CUDA activities, Python stacks): the CUDA runtime's
``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize`` and
synchronous ``cudaMemcpy``, and the aten ops that read a value or a size back
(``aten::_local_scalar_dense``, which ``.item()``, ``float(t)`` and ``bool(t)`` reach,
``aten::equal``, ``aten::nonzero``, ...). Only what happens inside a step's
``record_function`` range counts (the profiler's own stop is outside).

Cases, each after 3 warm-up steps, each step = the input's next batch (a pinned
DataLoader) and the training step of a BatchNorm CNN with SGD-momentum:

* ``plain``: plain PyTorch, the batch copied with ``non_blocking=True``: the floor;
* ``control``: the same with ``loss.item()`` in every step: it must count at least
  one sync per step, or the counting is blind and the part fails;
* OneDeviceStrategy, MirroredStrategy with one GPU, CentralStorageStrategy and
  MultiWorkerMirroredStrategy as one NCCL worker: goal 0, and never more than
  ``plain`` (a check that fails naming where each sync came from).

In a dry run the CUDA runtime counts are "skipped: no CUDA" and the aten-level counts
run on the CPU, the same code.
"""

from __future__ import annotations

import collections
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from _check_common import (
    Context,
    bn_cnn,
    loader,
    one_worker_strategy,
    run_part,
    sgd,
    train_step,
)
from _check_common import batches as make_batches
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import distribute as ds

RUNTIME_SYNCS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpy2D",
    "cuStreamSynchronize",  # the driver API, where the profiler traces it
    "cuCtxSynchronize",
    "cuEventSynchronize",
)
OP_SYNCS = (
    "aten::_local_scalar_dense",
    "aten::equal",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::repeat_interleave",
)
STEP = "device_check_step"
_API = re.compile(r"cu(da)?[A-Z]")  # CUDA runtime (cudaX) and driver (cuX) calls
WARMUP = 3
GLOBAL_BATCH = 16
IMAGE = (3, 8, 8)
_PACKAGE = str(Path(ds.__file__).resolve().parent)


def _endless(iterable: Any) -> Iterator[Any]:
    while True:
        yield from iterable


def plain_case(ctx: Context, item: bool) -> Callable[[], None]:
    torch.manual_seed(0)
    model = bn_cnn().to(ctx.device)
    step = train_step(model, sgd(model.parameters()), GLOBAL_BATCH)
    data = _endless(loader(make_batches(8, GLOBAL_BATCH, IMAGE), pin=ctx.cuda))

    def run() -> None:
        x, y = (t.to(ctx.device, non_blocking=True) for t in next(data))
        loss = step(x, y)
        if item:
            loss.item()

    return run


def strategy_case(ctx: Context, strategy: ds.Strategy, steps: int) -> Callable[[], None]:
    torch.manual_seed(0)
    with strategy.scope():
        model = bn_cnn()
        optimizer = sgd(model.parameters())
    step = train_step(model, optimizer, GLOBAL_BATCH)
    # More batches than steps: the end of data (agreed once per epoch) stays outside.
    data = loader(make_batches(steps + 4, GLOBAL_BATCH, IMAGE), pin=ctx.cuda)
    batches = iter(strategy.experimental_distribute_dataset(data))

    def run() -> None:
        strategy.run(step, args=next(batches))

    return run


def _is_frame(event: Any) -> bool:
    """Whether a profiler event is a Python frame (``with_stack``: ``file.py(12): fn``)."""
    return ".py(" in event.name


def _where(event: Any, frames: list[Any]) -> str:
    """The Python frames around ``event`` (by time, innermost first): those inside
    distribute/, else the innermost outside torch."""
    start, end = event.time_range.start, event.time_range.end
    around = [f for f in frames if f.time_range.start <= start and end <= f.time_range.end]
    around.sort(key=lambda f: -f.time_range.start)
    ours = [f.name for f in around if f.name.startswith("distribute/")]
    others = [f.name for f in around if not f.name.startswith(("torch/", "<built-in"))]
    chosen = (ours or others)[:3]
    return " <- ".join([event.name, *chosen])


def count(ctx: Context, run: Callable[[], None], steps: int) -> dict[str, Any]:
    """Profiles ``steps`` steps after the warm-up: calls per step by name, and where
    each sync came from."""
    for _ in range(WARMUP):
        run()
    ctx.sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=activities, with_stack=True) as prof:
        for _ in range(steps):
            with record_function(STEP):
                run()
    ctx.sync()
    # Host-side events only: kernels, and the GPU's copy of each record_function range
    # (same name), run on the device's clock.
    events = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == STEP]
    if len(ranges) != steps:
        raise RuntimeError(f"the profiler recorded {len(ranges)} step ranges, expected {steps}")

    def inside(e: Any) -> bool:
        return any(a <= e.time_range.start and e.time_range.end <= b for a, b in ranges)

    counted = [e for e in events if e.name != STEP and inside(e)]
    frames = [e for e in counted if _is_frame(e)]
    names = collections.Counter(e.name for e in counted if not _is_frame(e))
    where = collections.Counter(
        _where(e, frames) for e in counted if e.name in RUNTIME_SYNCS or e.name in OP_SYNCS
    )
    per_step = {n: names[n] / steps for n in (*RUNTIME_SYNCS, *OP_SYNCS) if names[n]}
    return {
        "runtime_syncs_per_step": sum(names[n] for n in RUNTIME_SYNCS) / steps,
        "op_syncs_per_step": sum(names[n] for n in OP_SYNCS) / steps,
        "per_step": per_step,
        "cuda_calls_per_step": {
            n: round(c / steps, 2) for n, c in sorted(names.items()) if _API.match(n)
        },
        "cuda_calls_whole_profile": {
            n: c
            for n, c in sorted(collections.Counter(e.name for e in events).items())
            if _API.match(n)
        },
        "aten_ops_per_step": round(
            sum(c for n, c in names.items() if n.startswith("aten::")) / steps, 1
        ),
        "where": dict(where.most_common(8)),
    }


def syncs(ctx: Context) -> None:
    steps = ctx.sizes.sync_steps
    measure = "cudaStreamSynchronize etc. (CUDA runtime)" if ctx.cuda else "aten ops that sync"
    key = "runtime_syncs_per_step" if ctx.cuda else "op_syncs_per_step"
    if not ctx.cuda:
        ctx.rec.check("syncs CUDA runtime calls", ctx.no_cuda_reason())

    control = count(ctx, plain_case(ctx, item=True), steps)
    ctx.rec.info("syncs control (plain + loss.item())", **control)
    blind = control["op_syncs_per_step"] < 1 or (ctx.cuda and control["runtime_syncs_per_step"] < 1)
    if blind:
        ctx.rec.check(
            "syncs profiler sees syncs",
            "failed: the control's loss.item() in every step was not counted; the profiler "
            f"recorded {control['cuda_calls_per_step']} CUDA calls per step inside the steps and "
            f"{control['cuda_calls_whole_profile']} in the whole profile",
        )
        return
    ctx.rec.check("syncs profiler sees syncs", "passed", control_per_step=control[key])
    floor = count(ctx, plain_case(ctx, item=False), steps)
    ctx.rec.info("syncs plain", **floor)

    device = "cuda:0" if ctx.cuda else "cpu"
    cases: dict[str, Callable[[], ds.Strategy]] = {
        f"OneDeviceStrategy('{device}')": lambda: ds.OneDeviceStrategy(device),
        f"MirroredStrategy(['{device}'])": lambda: ds.MirroredStrategy([device]),
        "CentralStorageStrategy()": ds.CentralStorageStrategy,
        "MultiWorkerMirroredStrategy(1 worker)": lambda: one_worker_strategy(
            "nccl" if ctx.cuda else "auto"
        ),
    }
    for name, make in cases.items():
        check = f"syncs {name}"
        strategy = make()
        got = count(ctx, strategy_case(ctx, strategy, WARMUP + steps), steps)
        if hasattr(strategy, "shutdown"):
            strategy.shutdown()
        over = got[key] > floor[key] or got["op_syncs_per_step"] > floor["op_syncs_per_step"]
        ctx.rec.figure(
            check,
            measure=measure,
            host_syncs_per_step=got[key],
            plain_pytorch_per_step=floor[key],
            goal="0 (never more than plain PyTorch)",
            **got,
        )
        status = "passed"
        if over:
            status = (
                f"failed: {got[key]} host syncs per step ({measure}), plain PyTorch "
                f"{floor[key]}; from {got['where']}"
            )
        ctx.rec.check(check, status, host_syncs_per_step=got[key])


PARTS = {"syncs": syncs}

if __name__ == "__main__":
    sys.exit(run_part(PARTS))
