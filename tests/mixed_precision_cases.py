"""Mixed-precision training shared by the in-process and multi-worker tests: the same
steps under a strategy with `ds.GradScaler`, and in one process with torch's own."""

from __future__ import annotations

from typing import Any

import torch

import distribute as ds

GLOBAL_BATCH = 16
STEPS = 6
INF_STEP = 3  # the second replica's loss is infinite at this step: every replica skips it


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(GLOBAL_BATCH * STEPS, 8, generator=g), torch.randn(
        GLOBAL_BATCH * STEPS, 2, generator=g
    )


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _per_example(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: Any) -> Any:
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = model(x)
    return (out.float() - y).pow(2).mean(dim=1)


def reference(dtype: torch.dtype | None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole global batch, torch's own GradScaler."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    x, y = _data()
    scales = []
    for step in range(STEPS):
        xb = x[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        yb = y[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        per_example = _per_example(model, xb, yb, dtype)
        if step == INF_STEP:  # the second half is the second replica's share
            per_example = torch.cat([per_example[:8], per_example[8:] * float("inf")])
        scaler.scale(per_example.sum() / GLOBAL_BATCH).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, scales


def train(
    strategy: ds.Strategy, dtype: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], list[float], list[list[float]]]:
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = ds.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    x, y = _data()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=GLOBAL_BATCH
    )
    scales, per_replica_scales = [], []

    def step_fn(xb: torch.Tensor, yb: torch.Tensor, step: int) -> float:
        ctx = ds.get_replica_context()
        assert ctx is not None
        per_example = _per_example(model, xb, yb, dtype)
        if step == INF_STEP and ctx.replica_id_in_sync_group == 1:
            per_example = per_example * float("inf")
        loss = ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        return scaler.get_scale()

    for step, (xb, yb) in enumerate(strategy.experimental_distribute_dataset(loader)):
        result = strategy.run(step_fn, args=(xb, yb, step))
        per_replica_scales.append(list(strategy.experimental_local_results(result)))
        scales.append(scaler.get_scale())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, scales, per_replica_scales
