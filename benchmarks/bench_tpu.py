r"""`TPUStrategy` in SPMD mode against the same training step written with torch_xla SPMD.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 TF_CPP_MIN_LOG_LEVEL=2 \
        .xla-venv/bin/python benchmarks/bench_tpu.py            # ~1 min
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 TF_CPP_MIN_LOG_LEVEL=2 \
        .xla-venv/bin/python benchmarks/bench_tpu.py --quick    # smoke run

(``.xla-venv`` is the torch_xla environment of docs/torch_xla_notes.md with this
package installed in it: ``.xla-venv/bin/pip install -e .``.) The full run takes
about a minute on 2 cores; ``--quick`` a few seconds after the import (~5 s).
Options: ``--steps N`` (steps per timed call), ``--reps N`` (timed repetitions),
``--baseline-first`` (warm the baseline up first).

Both sides run in ONE process: SPMD is process-wide in torch_xla, so they share it
(the baseline calls ``xr.use_spmd()`` first; the strategy finds it on). Each side
has its own model and optimizer with the same initial weights, and both see the
same batches in the same order, so their weights should stay equal (checked after
each case).

* distribute: ``strategy = ds.TPUStrategy(experimental_spmd_xla_partitioning=True)``;
  ``with strategy.scope(): model = MLP(); optimizer = SGD(momentum=0.9)``; per step
  ``strategy.run(step, args=(x, y))`` where the step computes the per-example
  cross-entropy, ``ds.compute_average_loss(per_example, global_batch_size=BATCH)``,
  ``backward``, ``optimizer.step()``, ``optimizer.zero_grad()`` and returns the
  detached loss (``run`` ends the XLA step itself).
* baseline: torch_xla by hand: ``xs.Mesh(np.arange(4), (4, 1), ("data", "model"))``,
  the model moved to ``torch_xla.device()`` and every parameter annotated replicated
  (``xs.mark_sharding(p, mesh, (None,) * p.dim())``); per step the same step
  function with ``per_example.sum() / BATCH``, then ``torch_xla.sync()`` once it
  has returned (as `run` does: the step's temporaries are then gone and do not
  become extra graph outputs).

Model: MLP 64-256-256-10 (85k parameters), global batch 256 (64 rows on each of the
4 CPU devices), SGD lr 0.01 momentum 0.9. The data are pre-generated tensors.

Cases (one JSON line each, in this order):

* ``step``: the input path left out: one call is ``--steps`` steps over batches
  already on the device and sharded, placed before timing (distribute:
  ``list(strategy.experimental_distribute_dataset(loader))``; baseline: placed by
  hand as below).
* ``pipeline``: one call is one epoch of ``--steps`` steps over a
  ``DataLoader(TensorDataset(x, y), batch_size=256, drop_last=True)``. distribute
  iterates ``strategy.experimental_distribute_dataset(loader)`` (made once; batches
  placed in the stepping thread, one sharded transfer each); the baseline iterates the loader
  and per batch calls ``x.to(device)``, ``xs.mark_sharding(x, mesh, ("data",
  None))`` (labels: ``("data",)``) in the loop, in the main thread.

Every call ends with ``float(loss)`` of its last step, which waits for the devices,
so the asynchronous execution of every step is inside the timed block. Per case,
each side is called twice to warm up (compiles), then the two sides take turns,
one call each per repetition, in alternating order (`_timing.interleaved`).

Output keys (times are per training step, medians over repetitions):

* ``bench``: ``environment``, ``step``, ``pipeline`` or ``compiles``.
* environment: ``torch``, ``torch_xla``, ``pjrt_device``, ``runtime_devices``
  (XLA devices behind the SPMD virtual device), ``torch_threads``,
  ``loadavg_1m_before`` (the machine's 1-minute load average before the run;
  figures taken above ~1.5 on 2 cores mean little).
* step / pipeline: ``config`` (strategy, mesh, model, global batch, optimizer,
  steps per call, input); ``baseline`` (what the baseline is); ``baseline_ms`` and
  ``distribute_ms`` (median time per step); ``ratio`` = distribute_ms /
  baseline_ms (lower is better); ``paired_ratio`` (the median of the per-repetition
  ratios distribute / baseline) and ``paired_ratio_iqr`` (their first and third
  quartiles: the noise); ``overhead_us_per_step`` (distribute_ms - baseline_ms, in
  microseconds); ``reps`` (timed repetitions); ``goal`` (ratio <= 1.05);
  ``compiles_warmup`` / ``compiles_timed`` (per side, graphs compiled during this
  case's warm-up calls / summed over its timed calls; timed should be 0);
  ``max_abs_param_diff`` (the largest difference between the two sides' weights
  after the case: the same steps on the same data, so 0 (bit-equal) expected);
  ``final_loss`` (per side, the loss of the last step of its last completed call).
  ``error`` (instead of the times) when a call raised: the exception's type and
  first line.
* compiles: graph compilations (``torch_xla.debug.metrics.counter_value
  ("UncachedCompile")`` deltas) per side over both cases: ``baseline_warmup`` /
  ``distribute_warmup``, ``baseline_timed`` / ``distribute_timed`` (should be 0),
  ``baseline_total`` / ``distribute_total``; ``warmup_order`` (which side warmed
  up first). The set-up (weights, pre-placed batches) is materialised by one sync
  before any of this and not counted. torch_xla caches graphs by hash for the
  whole process, so the side that warms up second would compile nothing for a
  graph the first side already built; the two sides' graphs differ (the baseline's
  explicit annotation leaves a ``custom_sharding`` op on each updated parameter,
  the strategy's parameters are replicated by default and carry none), so each
  side's count is its own whatever the order.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (a few seconds)")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed call")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions")
    parser.add_argument("--baseline-first", action="store_true", help="warm the baseline up first")
    args = parser.parse_args()
    steps = args.steps or (5 if args.quick else 25)
    reps = args.reps or (3 if args.quick else 51)

    loadavg = round(os.getloadavg()[0], 2)

    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    import distribute as ds

    def compiles() -> int:
        value = met.counter_value("UncachedCompile")
        return int(value) if value is not None else 0

    # -- the baseline's SPMD set-up (before any XLA tensor of the process) ------------
    xr.use_spmd()
    num_devices = xr.global_runtime_device_count()
    device = torch_xla.device()
    mesh = xs.Mesh(np.arange(num_devices), (num_devices, 1), ("data", "model"))

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

    # -- data: pre-generated, the same for both sides ---------------------------------
    gen = torch.Generator().manual_seed(0)
    x_all = torch.randn(steps * BATCH, IN, generator=gen)
    y_all = torch.randint(0, OUT, (steps * BATCH,), generator=gen)
    loader = DataLoader(TensorDataset(x_all, y_all), batch_size=BATCH, drop_last=True)

    torch.manual_seed(0)
    template = _mlp()

    # -- distribute -------------------------------------------------------------------
    strategy = ds.TPUStrategy(experimental_spmd_xla_partitioning=True)
    with strategy.scope():
        model = _mlp()
        with torch.no_grad():
            model.load_state_dict(template.state_dict())
        optimizer = _sgd(model.parameters())

    def dist_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    dist_dataset = strategy.experimental_distribute_dataset(loader)

    # -- baseline: torch_xla SPMD by hand ------------------------------------------------
    base_model = _mlp()
    base_model.load_state_dict(template.state_dict())
    base_model.to(device)
    for p in base_model.parameters():
        xs.mark_sharding(p, mesh, (None,) * p.dim())
    base_optimizer = _sgd(base_model.parameters())

    def base_place(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(device)
        xs.mark_sharding(x, mesh, ("data", None))
        y = y.to(device)
        xs.mark_sharding(y, mesh, ("data",))
        return x, y

    def base_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(base_model(x), y, reduction="none")
        loss = per_example.sum() / BATCH
        loss.backward()
        base_optimizer.step()
        base_optimizer.zero_grad()
        return loss.detach()

    last_loss: dict[str, torch.Tensor] = {}

    # -- the timed calls -----------------------------------------------------------------
    def dist_pipeline() -> None:
        for x, y in dist_dataset:
            loss = strategy.run(dist_step, args=(x, y))
        last_loss["distribute"] = loss
        float(loss)

    def base_pipeline() -> None:
        for x, y in loader:
            loss = base_step(*base_place(x, y))
            torch_xla.sync()  # after the step returns, as `run` does: no step locals alive
        last_loss["baseline"] = loss
        float(loss)

    # Batches placed before timing (placed once, read by every call).
    dist_batches = list(dist_dataset)
    base_batches = [base_place(x, y) for x, y in loader]
    torch_xla.sync()  # both sides' initial weights and placed batches materialised

    def dist_steps() -> None:
        for x, y in dist_batches:
            loss = strategy.run(dist_step, args=(x, y))
        last_loss["distribute"] = loss
        float(loss)

    def base_steps() -> None:
        for x, y in base_batches:
            loss = base_step(x, y)
            torch_xla.sync()
        last_loss["baseline"] = loss
        float(loss)

    sides: dict[str, dict[str, Callable[[], None]]] = {
        "distribute": {"step": dist_steps, "pipeline": dist_pipeline},
        "baseline": {"step": base_steps, "pipeline": base_pipeline},
    }
    order = ["baseline", "distribute"] if args.baseline_first else ["distribute", "baseline"]
    n_params = sum(p.numel() for p in template.parameters())
    warm_compiles = {side: 0 for side in sides}
    timed_compiles = {side: 0 for side in sides}

    def param_diff() -> float:
        return max(
            float((a.detach().cpu() - b.detach().cpu()).abs().max())
            for a, b in zip(model.parameters(), base_model.parameters())
        )

    for case in ("step", "pipeline"):
        case_warm = {side: 0 for side in sides}
        case_timed = {side: 0 for side in sides}

        def counted(
            side: str, fn: Callable[[], None], into: dict[str, int] = case_timed
        ) -> Callable[[], None]:
            def call() -> None:
                before = compiles()
                fn()
                into[side] += compiles() - before

            return call

        record: dict[str, Any] = {
            "bench": case,
            "config": {
                "strategy": "TPUStrategy(experimental_spmd_xla_partitioning=True)",
                "mesh": f"({num_devices}, 1) ('data', 'model')",
                "model": f"MLP {IN}-{HIDDEN}-{HIDDEN}-{OUT} ({n_params} params)",
                "global_batch": BATCH,
                "optimizer": "SGD lr 0.01 momentum 0.9",
                "steps_per_call": steps,
                "input": "DataLoader per call (distribute: experimental_distribute_dataset)"
                if case == "pipeline"
                else "batches already on the device, sharded",
            },
            "baseline": "torch_xla SPMD by hand (mark_sharding, torch_xla.sync())",
        }
        try:
            for side in order:
                before = compiles()
                for _ in range(2):
                    sides[side][case]()
                case_warm[side] = compiles() - before
            cases = {side: counted(side, sides[side][case]) for side in ("baseline", "distribute")}
            samples = interleaved(cases, reps, 1)
        except Exception as exc:  # a library failure is reported, not hidden
            record["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
        else:
            base = [t / steps for t in samples["baseline"]]
            ours = [t / steps for t in samples["distribute"]]
            ratios = [o / b for o, b in zip(ours, base)]
            base_med, ours_med = statistics.median(base), statistics.median(ours)
            record.update(
                {
                    "baseline_ms": round(base_med * 1e3, 4),
                    "distribute_ms": round(ours_med * 1e3, 4),
                    "ratio": round(ours_med / base_med, 4),
                    "paired_ratio": round(statistics.median(ratios), 4),
                    "paired_ratio_iqr": [round(q, 4) for q in quartiles(ratios)],
                    "overhead_us_per_step": round((ours_med - base_med) * 1e6, 1),
                    "reps": reps,
                    "goal": "ratio <= 1.05",
                }
            )
        record.update(
            {
                "compiles_warmup": {side: case_warm[side] for side in order},
                "compiles_timed": {side: case_timed[side] for side in order},
                "max_abs_param_diff": param_diff(),
                "final_loss": {side: float(last_loss[side]) for side in order if side in last_loss},
            }
        )
        emit(record)
        for side in sides:
            warm_compiles[side] += case_warm[side]
            timed_compiles[side] += case_timed[side]

    emit(
        {
            "bench": "compiles",
            "warmup_order": order,
            "baseline_warmup": warm_compiles["baseline"],
            "distribute_warmup": warm_compiles["distribute"],
            "baseline_timed": timed_compiles["baseline"],
            "distribute_timed": timed_compiles["distribute"],
            "baseline_total": warm_compiles["baseline"] + timed_compiles["baseline"],
            "distribute_total": warm_compiles["distribute"] + timed_compiles["distribute"],
        }
    )


if __name__ == "__main__":
    main()
