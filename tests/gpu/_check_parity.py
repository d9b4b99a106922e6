"""Parts 2 and 3 of tests/gpu/device_check.py: parity on the GPU.

    python tests/gpu/_check_parity.py parity --work DIR [--dry-run]
    python tests/gpu/_check_parity.py two_workers --work DIR [--dry-run]

``parity``: the same training code (a BatchNorm CNN, SGD with momentum and Adam, 10
steps of a pinned DataLoader through ``experimental_distribute_dataset``) under
``OneDeviceStrategy("cuda")``, ``MirroredStrategy(["cuda:0"])``,
``CentralStorageStrategy()`` and ``MultiWorkerMirroredStrategy`` as one NCCL worker,
against the default strategy on the CPU: the same losses and weights within 1e-4,
TF32 off. Each strategy must also hold its variables and get its batches on the GPU.

``two_workers``: two worker processes on the one GPU (NCCL refuses two ranks on one
GPU, so gloo, with CUDA tensors), ``MultiWorkerMirroredStrategy`` 2x1 against one
process computing what two replicas compute (`_check_common.reference_step`). The
workers seed differently, so the chief's initial values must be broadcast; each
loads its own half of every global batch. This runs the prefetch streams, the CUDA
event hand-offs, the on-device buffer sync and the bucket flags, none of which the
CPU runs.

In a dry run the same code runs on the CPU (``"cpu"`` replacing ``"cuda:0"``, gloo
throughout), so CI keeps it working.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from _check_common import (
    OPTIMIZERS,
    Context,
    bn_cnn,
    component,
    exact_math,
    failure,
    loader,
    losses_difference,
    max_difference,
    module_state,
    one_worker_strategy,
    reference_step,
    run_part,
    train_step,
    two_workers_problems,
)
from _check_common import batches as make_batches

import distribute as ds

IMAGE = (3, 8, 8)


def train(
    strategy: ds.Strategy,
    dataset: Callable[[ds.Strategy], Any],
    optimizer: str,
    global_batch: int,
    seed: int = 0,
) -> dict[str, Any]:
    """The training every strategy runs, on ``dataset(strategy)``; returns the losses,
    the state and where the variables and batches were."""
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
        loss = strategy.reduce("SUM", strategy.run(recorded, args=(x, y)), axis=None)
        losses.append(float(loss))
    return {
        "losses": losses,
        "state": module_state(strategy, model),
        "batch_devices": sorted(seen),
        "variable_device": str(component(strategy, next(iter(model.parameters()))).device),
    }


def strategies(ctx: Context) -> dict[str, Callable[[], ds.Strategy]]:
    """The strategies compared with the default strategy, by the name they are reported under."""
    if ctx.cuda:
        return {
            "OneDeviceStrategy('cuda')": lambda: ds.OneDeviceStrategy("cuda"),
            "MirroredStrategy(['cuda:0'])": lambda: ds.MirroredStrategy(["cuda:0"]),
            "CentralStorageStrategy()": ds.CentralStorageStrategy,
            "MultiWorkerMirroredStrategy(1 worker, NCCL)": lambda: one_worker_strategy("nccl"),
        }
    return {
        "OneDeviceStrategy('cpu')": lambda: ds.OneDeviceStrategy("cpu"),
        "MirroredStrategy(['cpu'])": lambda: ds.MirroredStrategy(["cpu"]),
        "CentralStorageStrategy()": ds.CentralStorageStrategy,
        "MultiWorkerMirroredStrategy(1 worker)": one_worker_strategy,
    }


def parity(ctx: Context) -> None:
    sizes = ctx.sizes
    data = make_batches(sizes.parity_steps, sizes.parity_batch, IMAGE)
    want = str(torch.empty(0, device=ctx.device).device)

    def whole(pin: bool) -> Callable[[ds.Strategy], Any]:
        return lambda strategy: strategy.experimental_distribute_dataset(loader(data, pin))

    with exact_math():
        for optimizer in OPTIMIZERS:
            reference = train(ds.get_strategy(), whole(pin=False), optimizer, len(data[0][1]))
            for name, make in strategies(ctx).items():
                check = f"parity {name} {optimizer}"
                try:
                    strategy = make()
                    got = train(strategy, whole(pin=ctx.cuda), optimizer, len(data[0][1]))
                    shutdown = getattr(strategy, "shutdown", None)
                    if shutdown is not None:
                        shutdown()
                except Exception as exc:
                    ctx.rec.check(check, failure(check, exc))
                    continue
                weights, bad = max_difference(got["state"], reference["state"])
                losses, losses_ok = losses_difference(got["losses"], reference["losses"])
                problems = []
                if bad:
                    problems.append(f"weights differ beyond 1e-4: {bad[:5]}")
                if not losses_ok:
                    problems.append(f"losses {got['losses']} vs {reference['losses']}")
                if got["variable_device"] != want:
                    problems.append(f"variables on {got['variable_device']}, expected {want}")
                if got["batch_devices"] != [want]:
                    problems.append(f"batches reached the step on {got['batch_devices']}")
                ctx.rec.check(
                    check,
                    "failed: " + "; ".join(problems) if problems else "passed",
                    reference="the default strategy on the CPU",
                    steps=len(data),
                    max_weight_diff=weights,
                    max_loss_diff=losses,
                    variable_device=got["variable_device"],
                    batch_devices=got["batch_devices"],
                )


# -- two workers on one GPU ----------------------------------------------------------------

PER_RANK = 8


def _worker(device: str, steps: int) -> dict[str, Any]:
    """One of the two workers (run by `distribute.launch.run`): MWMS over gloo with its
    replica on ``device``, both optimizers in turn; what it saw, on the CPU."""
    with exact_math():
        options = ds.experimental.CommunicationOptions(
            implementation=ds.experimental.CommunicationImplementation.RING
        )
        strategy = ds.MultiWorkerMirroredStrategy(communication_options=options, devices=[device])
        rank = strategy.worker_index
        data = make_batches(steps, 2 * PER_RANK, IMAGE)
        part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        mine = [(x[part], y[part]) for x, y in data]
        pin = torch.device(device).type == "cuda"
        out: dict[str, Any] = {
            "rank": rank,
            "backend": str(torch.distributed.get_backend())
            if torch.distributed.is_initialized()
            else None,
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
        strategy.shutdown()
        return out


def _one_process(ctx: Context, optimizer: str, steps: int) -> dict[str, Any]:
    """What two replicas compute, in one process on the same device."""
    torch.manual_seed(1000)  # the chief's seed
    model = bn_cnn().to(ctx.device)
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    for x, y in make_batches(steps, 2 * PER_RANK, IMAGE):
        losses.append(
            reference_step(model, opt, x.to(ctx.device), y.to(ctx.device), 2, 2 * PER_RANK)
        )
    state = {n: t.detach().cpu() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    return {"losses": losses, "state": state}


def two_workers(ctx: Context) -> None:
    from distribute import launch

    steps = ctx.sizes.parity_steps
    device = str(ctx.device if ctx.device.type == "cpu" else torch.device("cuda", 0))
    timeout = max(30.0, min(240.0, ctx.seconds_left() - 20))
    try:
        results = launch.run(_worker, 2, args=(device, steps), timeout=timeout)
    except Exception as exc:
        ctx.rec.check("two_workers 2x1 gloo", failure("two workers on one device", exc))
        return
    want = str(torch.empty(0, device=ctx.device).device)
    ctx.rec.info(
        "two_workers setup",
        device=device,
        backend=[r["backend"] for r in results],
        replicas_in_sync=[r["replicas"] for r in results],
    )
    with exact_math():
        for optimizer in OPTIMIZERS:
            check = f"two_workers 2x1 gloo {optimizer}"
            expected = _one_process(ctx, optimizer, steps)
            weights, losses, problems = two_workers_problems(results, optimizer, expected)
            for r in results:
                got = r[optimizer]
                if got["variable_device"] != want or got["batch_devices"] != [want]:
                    problems.append(
                        f"rank {r['rank']}: variables on {got['variable_device']}, "
                        f"batches on {got['batch_devices']}, expected {want}"
                    )
            ctx.rec.check(
                check,
                "failed: " + "; ".join(problems) if problems else "passed",
                reference="one process, the two replicas' halves through the model in turn",
                steps=steps,
                max_weight_diff=weights,
                max_loss_diff=losses,
            )


PARTS = {"parity": parity, "two_workers": two_workers}

if __name__ == "__main__":
    sys.exit(run_part(PARTS))
