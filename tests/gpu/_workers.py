"""The worker script of tests/gpu/test_multi_worker_gpu.py, run under torchrun on GPUs.

    python -m torch.distributed.run --nproc_per_node=N tests/gpu/_workers.py --out DIR

Every rank builds ``MultiWorkerMirroredStrategy`` over NCCL (one GPU per process, the
default devices), records where it was bound, reduces an integer per-replica value
with MEAN, trains a small BatchNorm CNN for ``--steps`` steps on its own batches and
then trains the same CNN (same seed, same per-rank batches) with
`torch.nn.parallel.DistributedDataParallel` on the strategy's process group. Each
rank saves what it saw to ``DIR/rank<R>.pt`` (plain CPU tensors, numbers and
strings, readable with ``torch.load(weights_only=True)``); the test compares them.
``--no-ddp`` leaves DDP out (the sanitizer run checks the library's streams, not
DDP's).

Nothing is asserted here, so that every rank reaches the end and the test can name
each disagreement; an exception still fails the run (a non-zero exit status).
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distribute as ds

#: Examples per rank (per replica: one replica per process) at each step.
PER_RANK_BATCH = 8
IMAGE = (3, 8, 8)
CLASSES = 10
SEED = 0
LR = 0.05


def exact_cuda_math() -> None:
    """No TF32 and deterministic cuDNN: the strategy and DDP run the same kernels."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def make_cnn() -> torch.nn.Module:
    """A small CNN with two BatchNorm2d layers (running statistics are buffers)."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(IMAGE[0], 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, CLASSES),
    )


def rank_batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s CPU batches, one per step: a function of the rank only."""
    g = torch.Generator().manual_seed(10_000 + rank)
    return [
        (
            torch.randn(PER_RANK_BATCH, *IMAGE, generator=g),
            torch.randint(0, CLASSES, (PER_RANK_BATCH,), generator=g),
        )
        for _ in range(steps)
    ]


def _sanitizer_enabled() -> bool:
    try:
        from torch.cuda import _sanitizer
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return bool(_sanitizer.cuda_sanitizer.enabled)


def _plain(strategy: ds.Strategy, value: Any) -> torch.Tensor:
    """This worker's (only) component of a variable or value, as a CPU tensor."""
    component = strategy.experimental_local_results(value)[0]
    return torch.as_tensor(component).detach().cpu().clone()


def _write_pid(out: Path, rank: int) -> None:
    """Lets the test kill this process if torchrun's agent is killed on a timeout."""
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))


def run_strategy(strategy: ds.MultiWorkerMirroredStrategy, steps: int) -> dict[str, Any]:
    """Trains the CNN under the strategy; returns its state and what the steps saw."""
    world = strategy.num_replicas_in_sync
    torch.manual_seed(SEED)  # every rank the same seed: DDP's start is the same
    with strategy.scope():
        model = make_cnn()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    initial = {n: _plain(strategy, p) for n, p in model.named_parameters()}
    dist_data = strategy.distribute_datasets_from_function(
        lambda ctx: rank_batches(ctx.input_pipeline_id, steps)
    )
    seen: list[dict[str, Any]] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(
            {
                "x": str(x.device),
                "current": torch.cuda.current_device(),
                "new": str(torch.ones(1, device="cuda").device),
            }
        )
        per_example = F.cross_entropy(model(x), y, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=PER_RANK_BATCH * world)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    losses = []
    for x, y in dist_data:
        losses.append(float(strategy.reduce("SUM", strategy.run(step, args=(x, y)), axis=None)))
    torch.cuda.synchronize()
    return {
        "losses": losses,
        "initial_params": initial,
        "steps_seen": seen,
        "params": {n: _plain(strategy, p) for n, p in model.named_parameters()},
        "buffers": {n: _plain(strategy, b) for n, b in model.named_buffers()},
    }


def run_ddp(rank: int, local_rank: int, steps: int) -> dict[str, Any]:
    """The same training with DistributedDataParallel on the default process group.

    DDP averages gradients over the ranks, so each rank's loss is the mean over its
    own batch: the same gradient as the strategy's sum over replicas of
    ``sum(per_example) / global_batch``.
    """
    device = torch.device("cuda", local_rank)
    if not dist.is_initialized():  # the strategy normally leaves its group as the default
        dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(SEED)
    model = make_cnn().to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[local_rank], output_device=local_rank
    )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    for x, y in rank_batches(rank, steps):
        x, y = x.to(device), y.to(device)
        F.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize(device)
    return {
        "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().cpu().clone() for n, b in model.named_buffers()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-ddp", action="store_true")
    args = parser.parse_args(argv)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    _write_pid(args.out, rank)
    exact_cuda_math()

    options = ds.experimental.CommunicationOptions(
        implementation=ds.experimental.CommunicationImplementation.NCCL, timeout_seconds=120
    )
    strategy = ds.MultiWorkerMirroredStrategy(communication_options=options)
    # Read before anything else here touches a CUDA device: the strategy must bind.
    result: dict[str, Any] = {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": int(os.environ["WORLD_SIZE"]),
        "current_device_after_init": torch.cuda.current_device(),
        "worker_devices": [str(d) for d in strategy.extended.worker_devices],
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "backend": str(dist.get_backend()) if dist.is_initialized() else "",
        "sanitizer": _sanitizer_enabled(),
    }

    def where() -> dict[str, Any]:
        return {
            "current": torch.cuda.current_device(),
            "new": str(torch.ones(1, device="cuda").device),
        }

    result["in_run"] = strategy.experimental_local_results(strategy.run(where))[0]

    # Integer MEAN over nccl: float64, as on gloo. A value returned by `run` and a
    # PerReplica built from a function, both int64 on this worker's GPU.
    device = strategy.extended.worker_devices[0]
    int_from_run = strategy.run(lambda: torch.tensor(rank + 1, device=device))
    int_per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(ctx.replica_id_in_sync_group + 1, device=device)
    )
    means = {}
    for name, value in [("run", int_from_run), ("per_replica", int_per_replica)]:
        mean = strategy.reduce("MEAN", value, axis=None)
        means[name] = {"dtype": str(mean.dtype), "value": float(mean)}
    result["int_mean"] = means

    result["strategy"] = run_strategy(strategy, args.steps)
    if not args.no_ddp:
        result["ddp"] = run_ddp(rank, local_rank, args.steps)
    gc.collect()  # DDP's reducer holds the group: let it go before the group is destroyed
    strategy.shutdown()
    torch.save(result, args.out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
