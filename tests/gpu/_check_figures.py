"""Part 4 of tests/gpu/device_check.py: figures at GPU speed, each a ratio against its
baseline measured in the same process, cases interleaved (`_check_common.time_cases`).

    python tests/gpu/_check_figures.py step_figures --work DIR [--dry-run]
    (and ddp_figure, input_figure, amp_figures, compile_figures)

Every training step is `_check_common.train_step` (cross-entropy, backward, SGD with
momentum, zero_grad) on batches made before timing, unless the input is what is
measured. Figures leave the precision defaults as they are (recorded beside them).

* ``step_figures``: the 1-replica step (``OneDeviceStrategy`` and
  ``MirroredStrategy([one GPU])``, ``strategy.run(step)``) against plain PyTorch, on
  a small MLP (32-64-10, batch 32: about 0.3 ms a step, where per-step overhead shows;
  reported) and on ResNet-18 (CIFAR-sized 3x32x32 images, batch 128; goal <= 1.05).
* ``ddp_figure``: ``MultiWorkerMirroredStrategy`` as one NCCL worker against
  ``DistributedDataParallel`` with one rank (nccl), same two models (goal <= 1.0).
  A strategy of one worker starts no process group (nothing to reach); DDP all-reduces
  over its group of one.
* ``input_figure``: a pinned DataLoader (per-row dataset, default collate) through
  ``OneDeviceStrategy("cuda").experimental_distribute_dataset`` (copies ahead on a side
  stream) against the bare loader with ``.to("cuda", non_blocking=True)``; the same
  plain training step consumes each batch. Throughput ratio, goal >= 0.97.
* ``amp_figures``: bf16 autocast, ResNet-18, under ``OneDeviceStrategy`` and the
  one-worker ``MultiWorkerMirroredStrategy`` against the same in plain PyTorch.
* ``compile_figures``: ``torch.compile(model)`` of an MLP 512-1024-1024-512-10, batch
  256 (bench_mirrored.py's), under the same two strategies against plain PyTorch; the
  compile time, dynamo's graph and graph-break counts, and the first loss against
  compiled plain PyTorch's (a check, 1e-4).

In a dry run everything runs on the CPU with tiny sizes (``torch.compile`` with the
``aot_eager`` backend: no C++ build), so CI keeps the code working; its numbers mean
nothing and say so (``"dry_run": true``).
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _check_common import (
    SMALL_BATCH,
    SMALL_LAYERS,
    Context,
    batches,
    failure,
    loader,
    math_settings,
    mlp,
    one_worker_strategy,
    parameters_m,
    ratio_fields,
    resnet18,
    run_part,
    sgd,
    time_cases,
    train_step,
)

import distribute as ds

NUM_BATCHES = 4  # distinct batches cycled through, made before timing
INPUT_FEATURES = 3 * 32 * 32
INPUT_BATCH = 256

Step = Callable[[], Any]


def _cycle(items: list[Any]) -> Iterator[Any]:
    while True:
        yield from items


def _endless(iterable: Any) -> Iterator[Any]:
    while True:
        yield from iterable


class Workload:
    """A model and its batches (on the device), by the name the figures use."""

    def __init__(
        self, name: str, make: Callable[[], torch.nn.Module], batch: int, features: tuple[int, ...]
    ) -> None:
        self.name = name
        self.make = make
        self.batch = batch
        self.features = features

    def data(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (x.to(device), y.to(device))
            for x, y in batches(NUM_BATCHES, self.batch, self.features, seed=3)
        ]

    def config(self, ctx: Context) -> dict[str, Any]:
        return {
            "model": self.name,
            "parameters_m": parameters_m(self.make()),
            "batch": self.batch,
            "input": list(self.features),
            "optimizer": "SGD momentum 0.9",
            "device": str(ctx.device),
            **math_settings(),
        }


def workloads(ctx: Context) -> list[Workload]:
    s = ctx.sizes
    return [
        Workload("small MLP 32-64-10", lambda: mlp(SMALL_LAYERS), SMALL_BATCH, (SMALL_LAYERS[0],)),
        Workload(
            f"ResNet-18 (width {s.resnet_width})",
            lambda: resnet18(s.resnet_width),
            s.resnet_batch,
            (3, s.resnet_image, s.resnet_image),
        ),
    ]


def plain_step(
    ctx: Context, work: Workload, autocast: torch.dtype | None = None, compiled: bool = False
) -> Step:
    torch.manual_seed(0)
    model = work.make().to(ctx.device)
    forward = _compile(ctx, model) if compiled else model
    step = train_step(forward, sgd(model.parameters()), work.batch, autocast)
    data = _cycle(work.data(ctx.device))
    return lambda: step(*next(data))


def strategy_step(
    ctx: Context,
    strategy: ds.Strategy,
    work: Workload,
    autocast: torch.dtype | None = None,
    compiled: bool = False,
) -> Step:
    torch.manual_seed(0)
    with strategy.scope():
        model = work.make()
        optimizer = sgd(model.parameters())
    forward = _compile(ctx, model) if compiled else model
    step = train_step(forward, optimizer, work.batch, autocast)
    data = _cycle(work.data(ctx.device))
    return lambda: strategy.run(step, args=next(data))


def _compile(ctx: Context, model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    backend = "inductor" if ctx.cuda else "aot_eager"  # aot_eager: no C++ build on the CPU
    return torch.compile(model, backend=backend)


def _device(ctx: Context) -> str:
    return "cuda:0" if ctx.cuda else "cpu"


def _figure(
    ctx: Context,
    name: str,
    timed: dict[str, Any],
    base: str,
    cand: str,
    baseline: str,
    goal: str | None,
    config: dict[str, Any],
    higher_is_better: bool = False,
) -> None:
    samples = timed["samples"]
    ctx.rec.figure(
        name,
        baseline=baseline,
        goal=goal,
        config=config,
        steps_per_rep=timed["steps_per_rep"],
        dry_run=ctx.dry_run,
        ratio_kind="throughput (higher is better)"
        if higher_is_better
        else "time (lower is better)",
        **ratio_fields(samples[base], samples[cand], higher_is_better),
    )


# -- the parts -----------------------------------------------------------------------------


def step_figures(ctx: Context) -> None:
    device = _device(ctx)
    for work, goal in zip(workloads(ctx), (None, "ratio <= 1.05")):
        cases = {
            "plain": plain_step(ctx, work),
            "OneDeviceStrategy": strategy_step(ctx, ds.OneDeviceStrategy(device), work),
            "MirroredStrategy 1 replica": strategy_step(ctx, ds.MirroredStrategy([device]), work),
        }
        timed = time_cases(ctx, cases)
        for name in list(cases)[1:]:
            _figure(
                ctx,
                f"step {work.name}: {name} vs plain",
                timed,
                "plain",
                name,
                "plain PyTorch, same model, batches and optimizer",
                goal,
                work.config(ctx),
            )


def ddp_figure(ctx: Context) -> None:
    import torch.distributed as dist

    from distribute import launch

    strategy = one_worker_strategy("nccl" if ctx.cuda else "auto")
    backend = "nccl" if ctx.cuda else "gloo"
    port = launch.free_ports(1)[0]
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        device_id=ctx.device if ctx.cuda else None,
    )
    try:
        for work in workloads(ctx):
            _ddp_case(ctx, strategy, work, backend)
    finally:
        gc.collect()  # DDP's reducer holds the group: let it go before the group goes
        dist.destroy_process_group()
        strategy.shutdown()


def _ddp_case(ctx: Context, strategy: ds.Strategy, work: Workload, backend: str) -> None:
    """One workload's figure; its DDP model is gone when this returns."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(work.make().to(ctx.device), device_ids=[0] if ctx.cuda else None)
    ddp_step = train_step(ddp, sgd(ddp.parameters()), work.batch)
    data = _cycle(work.data(ctx.device))
    cases = {
        "DDP": lambda: ddp_step(*next(data)),
        "MultiWorkerMirroredStrategy": strategy_step(ctx, strategy, work),
    }
    timed = time_cases(ctx, cases)
    config = {**work.config(ctx), "workers": 1, "ddp_backend": backend}
    config["strategy_process_group"] = "none (a world of one has no other worker)"
    _figure(
        ctx,
        f"one worker {work.name}: MultiWorkerMirroredStrategy vs DDP",
        timed,
        "DDP",
        "MultiWorkerMirroredStrategy",
        f"DistributedDataParallel, one rank ({backend}), same model, batches, optimizer",
        "ratio <= 1.0",
        config,
    )


def input_figure(ctx: Context) -> None:
    device = _device(ctx)
    data = batches(ctx.sizes.input_batches, INPUT_BATCH, (INPUT_FEATURES,), seed=5)
    source = loader(data, pin=ctx.cuda)  # TensorDataset: a row per __getitem__, default collate
    work = Workload("MLP 3072-512-10", lambda: mlp((INPUT_FEATURES, 512, 10)), INPUT_BATCH, ())

    def plain_model_step() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        model = work.make().to(ctx.device)
        return train_step(model, sgd(model.parameters()), INPUT_BATCH)

    bare_step, dist_step = plain_model_step(), plain_model_step()
    bare = _endless(source)
    strategy = ds.OneDeviceStrategy(device)
    distributed = _endless(strategy.experimental_distribute_dataset(source))

    def baseline() -> None:
        x, y = next(bare)
        bare_step(x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True))

    def candidate() -> None:
        x, y = next(distributed)  # already on the device, copied ahead
        dist_step(x, y)

    timed = time_cases(ctx, {"bare": baseline, "distributed": candidate})
    config = {
        "loader": "TensorDataset rows, default collate, num_workers=0, "
        + ("pin_memory=True" if ctx.cuda else "no pinning (no CUDA)"),
        "batch": INPUT_BATCH,
        "features": INPUT_FEATURES,
        "batches_per_epoch": len(data),
        "step": "the same plain MLP 3072-512-10 training step on each batch",
        "device": str(ctx.device),
    }
    _figure(
        ctx,
        f"input: DistributedDataset to {device} vs bare DataLoader",
        timed,
        "bare",
        "distributed",
        "the bare DataLoader, each batch .to(device, non_blocking=True)",
        "ratio >= 0.97",
        config,
        higher_is_better=True,
    )


def _one_worker_cases(
    ctx: Context, work: Workload, autocast: torch.dtype | None, compiled: bool
) -> tuple[dict[str, Step], list[Any]]:
    strategies: list[Any] = [
        ds.OneDeviceStrategy(_device(ctx)),
        one_worker_strategy("nccl" if ctx.cuda else "auto"),
    ]
    cases = {
        "plain": plain_step(ctx, work, autocast, compiled),
        "OneDeviceStrategy": strategy_step(ctx, strategies[0], work, autocast, compiled),
        "MultiWorkerMirroredStrategy": strategy_step(ctx, strategies[1], work, autocast, compiled),
    }
    return cases, strategies


def amp_figures(ctx: Context) -> None:
    work = workloads(ctx)[1]
    cases, strategies = _one_worker_cases(ctx, work, torch.bfloat16, compiled=False)
    timed = time_cases(ctx, cases)
    for name in list(cases)[1:]:
        _figure(
            ctx,
            f"bf16 autocast {work.name}: {name} vs plain",
            timed,
            "plain",
            name,
            "plain PyTorch under the same torch.autocast(bfloat16)",
            None,
            {**work.config(ctx), "autocast": "bfloat16"},
        )
    strategies[1].shutdown()


def _dynamo_counts() -> dict[str, int]:
    """Dynamo's running totals: graphs compiled and graph breaks."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def compile_figures(ctx: Context) -> None:
    s = ctx.sizes
    work = Workload(
        f"MLP {'-'.join(map(str, s.mlp_layers))}",
        lambda: mlp(s.mlp_layers),
        s.mlp_batch,
        (s.mlp_layers[0],),
    )
    cases, strategies = _one_worker_cases(ctx, work, None, compiled=True)
    first: dict[str, float] = {}
    for name, step in cases.items():  # the first call compiles: timed on its own
        before = _dynamo_counts()
        start = time.perf_counter()
        try:
            first[name] = float(step())  # one replica: `run` returns the plain loss
        except Exception as exc:
            ctx.rec.check(f"compile {name}", failure(f"torch.compile under {name}", exc))
            return
        ctx.sync()
        after = _dynamo_counts()
        ctx.rec.info(
            f"compile {name}",
            first_step_seconds=round(time.perf_counter() - start, 2),
            **{k: after[k] - before[k] for k in after},
        )
    for name in list(cases)[1:]:
        diff = abs(first[name] - first["plain"])
        ok = diff <= 1e-4 * max(1.0, abs(first["plain"]))
        ctx.rec.check(
            f"compile {name} first loss as compiled plain PyTorch's",
            "passed" if ok else f"failed: {first[name]} vs {first['plain']}",
            loss_diff=diff,
        )
    timed = time_cases(ctx, cases)
    backend = "inductor" if ctx.cuda else "aot_eager"
    for name in list(cases)[1:]:
        _figure(
            ctx,
            f"torch.compile {work.name}: {name} vs plain",
            timed,
            "plain",
            name,
            f"plain PyTorch, the same torch.compile(model, backend={backend!r})",
            None,
            {**work.config(ctx), "compile_backend": backend},
        )
    strategies[1].shutdown()


PARTS: dict[str, Callable[[Context], None]] = {
    "step_figures": step_figures,
    "ddp_figure": ddp_figure,
    "input_figure": input_figure,
    "amp_figures": amp_figures,
    "compile_figures": compile_figures,
}

if __name__ == "__main__":
    sys.exit(run_part(PARTS))
