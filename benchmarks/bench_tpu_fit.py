r"""`ds.Model.fit` under `TPUStrategy` (SPMD) against the same loop written by hand in torch_xla.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 TF_CPP_MIN_LOG_LEVEL=2 OMP_NUM_THREADS=1 \
        .xla-venv/bin/python benchmarks/bench_tpu_fit.py            # ~3 min
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 TF_CPP_MIN_LOG_LEVEL=2 OMP_NUM_THREADS=1 \
        .xla-venv/bin/python benchmarks/bench_tpu_fit.py --quick    # smoke run

(``.xla-venv`` is the torch_xla environment of docs/torch_xla_notes.md, or the one
``.ci/xla`` builds, with this package installed in it.) Options: ``--epoch-steps N``
(steps per epoch, a multiple of every steps_per_execution), ``--reps N`` (timed
repetitions), ``--executions 8,1`` (the steps_per_execution cases).

The three sides run in ONE process (SPMD is process-wide in torch_xla: the script
calls ``xr.use_spmd()`` first, the strategy finds it on), each with its own model,
the same initial weights and the same batches in the same order (no shuffling), so
their weights should stay equal (checked after each case).

* distribute: ``strategy = ds.TPUStrategy(experimental_spmd_xla_partitioning=True)``;
  ``with strategy.scope(): model = ds.Model(MLP())``; ``model.compile(optimizer=
  lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), loss=CrossEntropyLoss(),
  steps_per_execution=N)``; one call is ``model.fit(x, y, batch_size=256, epochs=1,
  shuffle=False, verbose=0)`` over NumPy arrays.
* baseline, torch_xla SPMD by hand, what ``fit`` does for one epoch: a
  ``DataLoader(TensorDataset(x, y), batch_size=256)``; per batch one sharded transfer
  per tensor (``xm.send_cpu_data_to_device`` with ``ShardingSpec(mesh, ("data",
  None))``, labels ``("data",)``), the step (forward, ``per_example.sum() / 256``,
  backward, ``optimizer.step()``, ``zero_grad()``), the loss times the batch size
  added to a running total on the device; ``torch_xla.sync()`` after every N steps;
  at the end the epoch's mean loss read once (``float``). Parameters annotated
  replicated up front.
* mp_device_loader: the same step and total over torch_xla's own loader,
  ``MpDeviceLoader(loader, device, input_sharding=ShardingSpec(mesh, ("data",
  None)), batches_per_execution=N)`` (it transfers in background threads, syncs
  every N batches, and leaves the 1-D labels replicated: a spec applies to tensors
  of its rank).

Model: MLP 64-256-256-10 (85k parameters), global batch 256 (64 rows on each of the
4 CPU devices), SGD lr 0.01 momentum 0.9, ``--epoch-steps`` (32) steps per epoch.

Every call ends with the epoch's loss on the host, which waits for the devices.
Per case each side is called twice to warm up (compiles), then the three sides take
turns, one call each per repetition, in alternating order (`_timing.interleaved`).

Output keys (times are per training step, medians over repetitions):

* ``bench``: ``environment`` or ``fit``.
* environment: ``torch``, ``torch_xla``, ``pjrt_device``, ``runtime_devices``,
  ``torch_threads``, ``loadavg_1m_before`` (figures taken above ~1.5 on 2 cores
  mean little).
* fit: ``steps_per_execution``; ``config``; ``baseline`` and ``mp_device_loader``
  (what they are); ``baseline_ms``, ``mp_device_loader_ms`` and ``distribute_ms``
  (median time per step); ``ratio`` = distribute_ms / baseline_ms (lower is
  better); ``paired_ratio`` and ``paired_ratio_iqr`` (median and quartiles of the
  per-repetition ratios: the noise); the same three against MpDeviceLoader
  (``ratio_vs_mp_device_loader``, ...); ``overhead_us_per_step`` (against the
  baseline); ``reps``; ``goal`` (ratio <= 1.05); ``executions_per_step`` (per side,
  XLA executions counted by torch_xla's ``ExecuteReplicated`` counter over the timed
  calls, per step: 1/N expected); ``compiles_warmup`` / ``compiles_timed`` (graphs
  compiled per side; timed should be 0); ``max_abs_param_diff`` (per hand-written
  side, the largest difference from fit's weights after the case: the same steps
  on the same data); ``epoch_loss`` (per side, the last call's); ``error`` instead
  of the times where a call raised.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import emit, interleaved, quartiles

BATCH = 256
IN, HIDDEN, OUT = 64, 256, 10


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, OUT),
    )


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _by_hand(
    template: torch.nn.Module, device: Any, mesh: Any
) -> tuple[torch.nn.Module, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """A copy of `template` on the SPMD device, parameters annotated replicated, and
    its training step (the loss times the batch size comes back, detached)."""
    import torch_xla.distributed.spmd as xs

    model = _mlp()
    model.load_state_dict(template.state_dict())
    model.to(device)
    for p in model.parameters():
        xs.mark_sharding(p, mesh, (None,) * p.dim())
    optimizer = _sgd(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = per_example.sum() / BATCH
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach() * BATCH

    return model, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--epoch-steps", type=int, default=32, help="steps per epoch")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions")
    parser.add_argument("--executions", default="8,1", help="steps_per_execution cases")
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 31)
    cases = [int(n) for n in args.executions.split(",")]
    steps = args.epoch_steps
    if any(steps % n for n in cases):
        parser.error(f"--epoch-steps {steps} must be a multiple of every case in {cases}")

    loadavg = round(os.getloadavg()[0], 2)

    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    import distribute as ds

    xr.use_spmd()  # before any XLA tensor; the strategy finds it on
    num_devices = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(num_devices), (num_devices,), ("data",))
    emit(
        {
            "bench": "environment",
            "torch": torch.__version__,
            "torch_xla": torch_xla.__version__,
            "pjrt_device": os.environ.get("PJRT_DEVICE"),
            "runtime_devices": num_devices,
            "torch_threads": torch.get_num_threads(),
            "loadavg_1m_before": loadavg,
        }
    )

    gen = torch.Generator().manual_seed(0)
    x_all = torch.randn(steps * BATCH, IN, generator=gen)
    y_all = torch.randint(0, OUT, (steps * BATCH,), generator=gen)
    strategy = ds.TPUStrategy(experimental_spmd_xla_partitioning=True)
    for every in cases:
        emit(_case(strategy, every, x_all, y_all, reps, mesh))


def _case(
    strategy: Any, every: int, x_all: torch.Tensor, y_all: torch.Tensor, reps: int, mesh: Any
) -> dict[str, Any]:
    """One steps_per_execution case: the three sides interleaved; its JSON record."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.distributed.spmd as xs

    import distribute as ds

    def counter(name: str) -> int:
        value = met.counter_value(name)
        return int(value) if value is not None else 0

    device = torch_xla.device()
    steps = len(x_all) // BATCH
    loader = DataLoader(TensorDataset(x_all, y_all), batch_size=BATCH)
    x_np, y_np = x_all.numpy(), y_all.numpy()
    rows = xs.ShardingSpec(mesh, ("data", None))  # dim 0 over "data", one transfer each
    labels = xs.ShardingSpec(mesh, ("data",))
    torch.manual_seed(0)
    template = _mlp()
    with strategy.scope():
        net = _mlp()
        net.load_state_dict(template.state_dict())
        model = ds.Model(net)
    model.compile(optimizer=_sgd, loss=torch.nn.CrossEntropyLoss(), steps_per_execution=every)
    hand = {side: _by_hand(template, device, mesh) for side in ("baseline", "mp_device_loader")}
    epoch_loss: dict[str, float] = {}

    def dist_epoch() -> None:
        history = model.fit(x_np, y_np, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        epoch_loss["distribute"] = history.history["loss"][-1]

    def base_epoch() -> None:
        step = hand["baseline"][1]
        total = torch.zeros((), device=device)
        for i, (xb, yb) in enumerate(loader):
            (xb,) = xm.send_cpu_data_to_device([xb], device, rows)
            (yb,) = xm.send_cpu_data_to_device([yb], device, labels)
            total = total + step(xb, yb)
            if (i + 1) % every == 0:
                torch_xla.sync()
        epoch_loss["baseline"] = float(total) / (steps * BATCH)

    def loader_epoch() -> None:
        step = hand["mp_device_loader"][1]
        total = torch.zeros((), device=device)
        # One spec for the batch: it applies to the rows; torch_xla leaves the 1-D
        # labels replicated.
        device_loader = pl.MpDeviceLoader(
            loader, device, input_sharding=rows, batches_per_execution=every
        )
        for xb, yb in device_loader:
            total = total + step(xb, yb)
        epoch_loss["mp_device_loader"] = float(total) / (steps * BATCH)

    sides: dict[str, Callable[[], None]] = {
        "baseline": base_epoch,
        "mp_device_loader": loader_epoch,
        "distribute": dist_epoch,
    }
    warm = {side: 0 for side in sides}
    timed = {side: 0 for side in sides}
    executions = {side: 0 for side in sides}

    def counted(side: str, fn: Callable[[], None]) -> Callable[[], None]:
        def call() -> None:
            before, ran = counter("UncachedCompile"), counter("ExecuteReplicated")
            fn()
            timed[side] += counter("UncachedCompile") - before
            executions[side] += counter("ExecuteReplicated") - ran

        return call

    record: dict[str, Any] = {
        "bench": "fit",
        "steps_per_execution": every,
        "config": {
            "strategy": "TPUStrategy(experimental_spmd_xla_partitioning=True)",
            "mesh": f"{tuple(mesh.mesh_shape)} ('data',)",
            "model": f"MLP {IN}-{HIDDEN}-{HIDDEN}-{OUT}",
            "global_batch": BATCH,
            "optimizer": "torch.optim.SGD lr 0.01 momentum 0.9",
            "steps_per_epoch": steps,
            "call": "one epoch (distribute: model.fit(x, y, epochs=1, shuffle=False))",
        },
        "baseline": f"torch_xla SPMD by hand: DataLoader, one sharded transfer per tensor, "
        f"torch_xla.sync() every {every} step(s), the epoch's loss read once",
        "mp_device_loader": f"the same step over torch_xla's MpDeviceLoader(input_sharding, "
        f"batches_per_execution={every})",
    }
    try:
        torch_xla.sync()
        for side, fn in sides.items():
            before = counter("UncachedCompile")
            for _ in range(2):
                fn()
            warm[side] = counter("UncachedCompile") - before
        samples = interleaved({side: counted(side, fn) for side, fn in sides.items()}, reps, 1)
    except Exception as exc:  # a library failure is reported, not hidden
        record["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    else:
        per_step = {side: [t / steps for t in samples[side]] for side in sides}
        medians = {side: statistics.median(ts) for side, ts in per_step.items()}
        for base, suffix in (("baseline", ""), ("mp_device_loader", "_vs_mp_device_loader")):
            ratios = [o / b for o, b in zip(per_step["distribute"], per_step[base])]
            record[f"ratio{suffix}"] = round(medians["distribute"] / medians[base], 4)
            record[f"paired_ratio{suffix}"] = round(statistics.median(ratios), 4)
            record[f"paired_ratio_iqr{suffix}"] = [round(q, 4) for q in quartiles(ratios)]
        record.update(
            {
                "baseline_ms": round(medians["baseline"] * 1e3, 4),
                "mp_device_loader_ms": round(medians["mp_device_loader"] * 1e3, 4),
                "distribute_ms": round(medians["distribute"] * 1e3, 4),
                "overhead_us_per_step": round(
                    (medians["distribute"] - medians["baseline"]) * 1e6, 1
                ),
                "reps": reps,
                "goal": "ratio <= 1.05",
                "executions_per_step": {
                    side: round(n / (reps * steps), 4) for side, n in executions.items()
                },
            }
        )
    record.update(
        {
            "compiles_warmup": warm,
            "compiles_timed": timed,
            "max_abs_param_diff": {
                side: max(
                    float((a.detach().cpu() - b.detach().cpu()).abs().max())
                    for a, b in zip(net.parameters(), copy.parameters())
                )
                for side, (copy, _) in hand.items()
            },
            "epoch_loss": epoch_loss,
        }
    )
    return record


if __name__ == "__main__":
    main()
