"""Parts of tests/gpu/device_check.py for FullyShardedStrategy (FSDP2, issue #25).

    python tests/gpu/_check_sharded.py sharded --work DIR [--dry-run]
    python tests/gpu/_check_sharded.py sharded_two_workers --work DIR [--dry-run]

``sharded``: ``FullyShardedStrategy`` as one NCCL worker (a process group of one on
``cuda:0``) trains the parity part's BatchNorm CNN (SGD with momentum and Adam, 10
steps of a pinned DataLoader through ``experimental_distribute_dataset``) to the
default strategy's losses and weights on the CPU within 1e-4, TF32 off; its
parameters are DTensors on ``cuda:0`` and the batches reach the step there. Then a
figure: one step of 8 x Linear(1024, 1024) with Adam, ``strategy.run(step)`` against
the same FSDP2 written by hand (same units, same group, same settings), interleaved
(goal <= 1.05). It also records which FSDP2 setters this torch has (the strategy
needs all of them).

``sharded_two_workers``: two worker processes on the one GPU over gloo with CUDA
tensors (NCCL refuses two ranks on one GPU), ``FullyShardedStrategy`` against one
process computing what two replicas compute (`_check_common.reference_step`), each
rank seeding differently and loading its own half of every batch; each rank must
hold half of every parameter. Then the memory figure: per worker, the CUDA memory
held after a step (``torch.cuda.memory_allocated``: parameters, gradients, Adam's
state) and the peak during two steps (``max_memory_allocated``), both counted from
before the model is built, 8 x Linear(1024, 1024) with Adam and a global batch of
64, against ``MultiWorkerMirroredStrategy`` in the same two processes (goal <= 0.60;
each process has its own CUDA allocator, so the two workers' figures are their own).

In a dry run the same code runs on the CPU (gloo throughout, tiny sizes); the memory
figure is skipped there (no CUDA allocator to ask).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any

import torch
from _check_common import (
    OPTIMIZERS,
    Context,
    batches,
    bn_cnn,
    exact_math,
    failure,
    loader,
    losses_difference,
    max_difference,
    ratio_fields,
    run_part,
    time_cases,
    train_step,
    two_workers_problems,
)
from _check_parity import IMAGE, PER_RANK, _one_process
from _fsdp_baseline import fsdp_by_hand  # benchmarks/, on the path by _check_common

import distribute as ds

MiB = 2**20
#: The FSDP2 setters FullyShardedStrategy calls (strategies/_sharding.py).
FSDP_SETTERS = (
    "set_force_sum_reduction_for_comms",
    "set_gradient_divide_factor",
    "set_reduce_scatter_unused_params",
    "set_custom_all_gather",
    "set_custom_reduce_scatter",
    "set_all_reduce_hook",
    "set_requires_gradient_sync",
)


def sharded_strategy(comm: str = "auto", devices: Any = None) -> Any:
    """``FullyShardedStrategy`` with NCCL (``"nccl"``), gloo (``"ring"``) or the default."""
    impl = ds.experimental.CommunicationImplementation
    chosen = {"nccl": impl.NCCL, "ring": impl.RING}.get(comm, impl.AUTO)
    options = ds.experimental.CommunicationOptions(implementation=chosen)
    return ds.experimental.FullyShardedStrategy(communication_options=options, devices=devices)


def _whole(value: Any) -> torch.Tensor:
    """A DTensor's whole value (a collective of every rank). Over gloo with CUDA tensors
    the shards travel as CPU objects: torch 2.11's ``full_tensor()`` (a functional
    all-gather) dies there with SIGSEGV in ``wait_tensor`` (seen on the lent H100)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    local = value.to_local()
    if not (local.is_cuda and dist.get_backend() == "gloo"):
        return value.full_tensor()
    if tuple(value.placements) != (Shard(0),):
        raise NotImplementedError(f"gathering placements {value.placements} over gloo")
    shards: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shards, local.detach().cpu())
    return torch.cat(shards)


def full_state(strategy: ds.Strategy, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (whole: a collective for DTensors) and buffers on the CPU, by name."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, value in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(value, DTensor):
            value = _whole(value)
        else:
            value = torch.as_tensor(strategy.experimental_local_results(value)[0])
        out[name] = value.detach().cpu().clone()
    return out


def train(
    strategy: ds.Strategy,
    dataset: Callable[[ds.Strategy], Any],
    optimizer: str,
    global_batch: int,
    seed: int = 0,
) -> dict[str, Any]:
    """The parity part's training under ``strategy``; the losses, the whole state, and
    where the shards and the batches were."""
    torch.manual_seed(seed)
    with strategy.scope():
        model = bn_cnn()
        opt = OPTIMIZERS[optimizer](model.parameters())
    step = train_step(model, opt, global_batch)
    seen: set[str] = set()

    def recorded(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.add(str(x.device))
        return step(x, y)

    losses = []
    for x, y in dataset(strategy):
        losses.append(float(strategy.reduce("SUM", strategy.run(recorded, args=(x, y)), axis=None)))
    params = list(model.parameters())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return {
        "losses": losses,
        "state": full_state(strategy, model),
        "batch_devices": sorted(seen),
        "shard_devices": sorted({str(t.device) for t in local}),
        "parameter_types": sorted({type(p).__name__ for p in params}),
        "local_numel": sum(t.numel() for t in local),
        "numel": sum(p.numel() for p in params),
    }


def _problems(got: dict[str, Any], want_device: str) -> list[str]:
    problems = []
    if got["parameter_types"] != ["DTensor"]:
        problems.append(f"parameters are {got['parameter_types']}, expected DTensor")
    if got["shard_devices"] != [want_device]:
        problems.append(f"shards on {got['shard_devices']}, expected {want_device}")
    if got["batch_devices"] != [want_device]:
        problems.append(f"batches reached the step on {got['batch_devices']}")
    return problems


# -- one NCCL worker -------------------------------------------------------------------------


def sharded(ctx: Context) -> None:
    from torch.distributed.fsdp import FSDPModule

    missing = [name for name in FSDP_SETTERS if not hasattr(FSDPModule, name)]
    ctx.rec.info("fsdp2 api", torch=torch.__version__, missing_setters=missing)
    sizes = ctx.sizes
    data = batches(sizes.parity_steps, sizes.parity_batch, IMAGE)
    want = str(torch.empty(0, device=ctx.device).device)
    name = "FullyShardedStrategy(1 worker, NCCL)" if ctx.cuda else "FullyShardedStrategy(1 worker)"
    try:
        strategy = sharded_strategy("nccl" if ctx.cuda else "auto")
    except Exception as exc:
        ctx.rec.check(f"parity {name}", failure(f"building {name}", exc))
        return
    try:
        with exact_math():
            for optimizer in OPTIMIZERS:
                check = f"parity {name} {optimizer}"
                reference = train(
                    ds.get_strategy(),
                    lambda s: s.experimental_distribute_dataset(loader(data, False)),
                    optimizer,
                    len(data[0][1]),
                )
                try:
                    got = train(
                        strategy,
                        lambda s: s.experimental_distribute_dataset(loader(data, ctx.cuda)),
                        optimizer,
                        len(data[0][1]),
                    )
                except Exception as exc:
                    ctx.rec.check(check, failure(check, exc))
                    continue
                weights, bad = max_difference(got["state"], reference["state"])
                losses, losses_ok = losses_difference(got["losses"], reference["losses"])
                problems = _problems(got, want)
                if bad:
                    problems.append(f"weights differ beyond 1e-4: {bad[:5]}")
                if not losses_ok:
                    problems.append(f"losses {got['losses']} vs {reference['losses']}")
                ctx.rec.check(
                    check,
                    "failed: " + "; ".join(problems) if problems else "passed",
                    reference="the default strategy on the CPU",
                    steps=len(data),
                    max_weight_diff=weights,
                    max_loss_diff=losses,
                    shard_devices=got["shard_devices"],
                    batch_devices=got["batch_devices"],
                )
        _step_figure(ctx, strategy)
    finally:
        strategy.shutdown()


def big_model(width: int, layers: int) -> torch.nn.Sequential:
    """The benchmark's parameter-heavy model: ``layers`` x (Linear(width, width), ReLU)."""
    modules: list[torch.nn.Module] = []
    for _ in range(layers):
        modules += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules)


def _mse_step(model: Any, optimizer: torch.optim.Optimizer, global_batch: int) -> Any:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        per_example = ((model(x) - y) ** 2).sum(dim=1)
        ds.compute_average_loss(per_example, global_batch_size=global_batch).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def _step_figure(ctx: Context, strategy: Any) -> None:
    """One worker: the strategy's step against the same FSDP2 by hand (the library's
    cost: `run`, the watched collectives, the hooks)."""
    width, layers, batch = (1024, 8, 64) if ctx.cuda else (32, 2, 8)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batch, width, generator=g).to(ctx.device)
    y = torch.randn(batch, width, generator=g).to(ctx.device)
    torch.manual_seed(0)
    with strategy.scope():
        ours = big_model(width, layers)
        ours_opt = torch.optim.Adam(ours.parameters(), lr=1e-4)
    torch.manual_seed(0)
    theirs = fsdp_by_hand(big_model(width, layers), ctx.device.type)
    theirs_opt = torch.optim.Adam(theirs.parameters(), lr=1e-4)
    ours_step = _mse_step(ours, ours_opt, batch)
    theirs_step = _mse_step(theirs, theirs_opt, batch)
    timed = time_cases(
        ctx,
        {
            "FSDP2 by hand": lambda: theirs_step(x, y),
            "FullyShardedStrategy": lambda: strategy.run(ours_step, args=(x, y)),
        },
    )
    samples = timed["samples"]
    ctx.rec.figure(
        f"one worker, {layers} x Linear({width}, {width}) Adam: FullyShardedStrategy vs FSDP2 "
        "by hand",
        baseline="fully_shard on the same units and group, force-sum, divide factor 1, ZeRO-3",
        goal="ratio <= 1.05",
        **ratio_fields(samples["FSDP2 by hand"], samples["FullyShardedStrategy"]),
        steps_per_rep=timed["steps_per_rep"],
        batch=batch,
        dry_run=ctx.dry_run,
    )


# -- two workers on one GPU ------------------------------------------------------------------


def peak_memory(strategy: Any, device: torch.device, width: int, layers: int) -> dict[str, int]:
    """CUDA bytes this worker holds after a step (parameters, gradients, optimizer state)
    and at its peak over two more steps, counted from before the model is built; the
    global batch is 64, split over the workers."""
    world = strategy.num_replicas_in_sync
    rank = strategy.worker_index
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, width, generator=g)[rank::world].to(device)
    y = torch.randn(64, width, generator=g)[rank::world].to(device)
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.manual_seed(0)
    with strategy.scope():
        model = big_model(width, layers)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    held = {}

    def step() -> None:
        per_example = ((model(x) - y) ** 2).sum(dim=1)
        ds.compute_average_loss(per_example, global_batch_size=64).backward()
        optimizer.step()
        held["state"] = torch.cuda.memory_allocated(device) - base
        optimizer.zero_grad()

    strategy.run(step)  # the first step: lazy initialisation, Adam's state
    torch.cuda.synchronize(device)
    state = held["state"]
    torch.cuda.reset_peak_memory_stats(device)
    strategy.run(step)
    strategy.run(step)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    return {"state": state, "peak": peak}


def _worker(device: str, steps: int) -> dict[str, Any]:
    """One of the two workers (run by `distribute.launch.run`): FullyShardedStrategy over
    gloo with its replica on ``device``, both optimizers in turn; then the memory of the
    big model under it and under MultiWorkerMirroredStrategy (CUDA only)."""
    with exact_math():
        strategy = sharded_strategy("ring", devices=[device])
        rank = strategy.worker_index
        data = batches(steps, 2 * PER_RANK, IMAGE)
        part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        mine = [(x[part], y[part]) for x, y in data]
        pin = torch.device(device).type == "cuda"
        out: dict[str, Any] = {
            "rank": rank,
            "backend": str(torch.distributed.get_backend()),
            "replicas": strategy.num_replicas_in_sync,
        }
        for optimizer in OPTIMIZERS:  # different seeds: the chief's values must win
            out[optimizer] = train(
                strategy,
                lambda s: s.distribute_datasets_from_function(lambda _: loader(mine, pin)),
                optimizer,
                2 * PER_RANK,
                seed=1000 + rank,
            )
    if pin:
        ring = ds.experimental.CommunicationOptions(
            implementation=ds.experimental.CommunicationImplementation.RING
        )
        mirrored = ds.MultiWorkerMirroredStrategy(communication_options=ring, devices=[device])
        where = torch.device(device)
        out["memory"] = {  # the baseline first: the sharded side's leftovers cannot count
            "mirrored": peak_memory(mirrored, where, 1024, 8),
            "sharded": peak_memory(strategy, where, 1024, 8),
        }
    strategy.shutdown()
    return out


def sharded_two_workers(ctx: Context) -> None:
    from distribute import launch

    steps = ctx.sizes.parity_steps
    device = str(ctx.device if ctx.device.type == "cpu" else torch.device("cuda", 0))
    timeout = max(30.0, min(240.0, ctx.seconds_left() - 15))
    try:
        results = launch.run(_worker, 2, args=(device, steps), timeout=timeout)
    except Exception as exc:
        ctx.rec.check("sharded_two_workers 2x1 gloo", failure("two sharded workers", exc))
        return
    want = str(torch.empty(0, device=ctx.device).device)
    ctx.rec.info(
        "sharded_two_workers setup",
        device=device,
        backend=[r["backend"] for r in results],
        replicas_in_sync=[r["replicas"] for r in results],
    )
    with exact_math():
        for optimizer in OPTIMIZERS:
            check = f"sharded_two_workers 2x1 gloo {optimizer}"
            expected = _one_process(ctx, optimizer, steps)
            weights, losses, problems = two_workers_problems(results, optimizer, expected)
            for r in results:
                got = r[optimizer]
                problems += [f"rank {r['rank']}: {p}" for p in _problems(got, want)]
                if got["local_numel"] > got["numel"] // 2 + 64:  # half, plus padding
                    problems.append(
                        f"rank {r['rank']} holds {got['local_numel']} of {got['numel']} "
                        "parameter elements, expected about half"
                    )
            ctx.rec.check(
                check,
                "failed: " + "; ".join(problems) if problems else "passed",
                reference="one process, the two replicas' halves through the model in turn",
                steps=steps,
                max_weight_diff=weights,
                max_loss_diff=losses,
                local_numel=[r[optimizer]["local_numel"] for r in results],
                numel=results[0][optimizer]["numel"],
            )
    if not ctx.cuda:
        ctx.rec.check("sharded_two_workers memory", ctx.no_cuda_reason())
        return
    memory = [r["memory"] for r in results]
    for key, what in (("state", "held after a step"), ("peak", "peak over two steps")):
        base = max(m["mirrored"][key] for m in memory)
        ours = max(m["sharded"][key] for m in memory)
        ctx.rec.figure(
            f"2 workers (gloo) on one GPU, 8 x Linear(1024, 1024) Adam: CUDA memory {what} "
            "per worker, FullyShardedStrategy vs MultiWorkerMirroredStrategy",
            baseline="MultiWorkerMirroredStrategy in the same two processes",
            goal="memory ratio <= 0.60",
            baseline_mib=round(base / MiB, 1),
            distribute_mib=round(ours / MiB, 1),
            memory_ratio=round(ours / base, 3),
            per_rank_mib={
                side: [round(m[side][key] / MiB, 1) for m in memory]
                for side in ("mirrored", "sharded")
            },
        )


PARTS = {"sharded": sharded, "sharded_two_workers": sharded_two_workers}

if __name__ == "__main__":
    sys.exit(run_part(PARTS))
