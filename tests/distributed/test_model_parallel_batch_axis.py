"""A layout that names the batch axis, as Keras allows, on a (2, 2) mesh of 4 workers.

The MLP's up-projection is laid out ``("model", "batch")``: split along the model axis
by DTensor (column-parallel) and along the batch axis by FSDP2; the down-projection
``(None, "model")``. The training (SGD with momentum, gradient clipping, an uneven last
batch) gives one process's losses and weights within 1e-5, and each worker holds a
quarter of the up-projection's weight (half along each axis).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import distribute as ds
from distribute import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

GLOBAL_BATCH = 8
EXAMPLES = 2 * GLOBAL_BATCH + 5  # an uneven last batch
STEPS = 3
_KEEP: list[Any] = []


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(EXAMPLES, 8, generator=g), torch.randn(EXAMPLES, 4, generator=g)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _data()
    return [
        (x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, EXAMPLES, GLOBAL_BATCH)
    ]


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(11)
    model = Mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for xb, yb in _batches()[:STEPS]:
        loss = F.mse_loss(model(xb), yb, reduction="none").mean(1).sum() / GLOBAL_BATCH
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker() -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    mesh = ds.experimental.DeviceMesh((2, 2), ("batch", "model"))
    layouts = ds.experimental.LayoutMap(mesh)
    layouts[r"up\.weight"] = ("model", "batch")
    layouts[r"up\.bias"] = ("model",)
    layouts[r"down\.weight"] = (None, "model")
    strategy = ds.experimental.ModelParallelStrategy(layouts)
    _KEEP.append(strategy)
    torch.manual_seed(11)
    with strategy.scope():
        model = Mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        per_example = F.mse_loss(model(xb), yb, reduction="none").mean(1)
        loss = ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    losses = []
    for xb, yb in list(strategy.experimental_distribute_dataset(_batches()))[:STEPS]:
        losses.append(float(strategy.reduce("sum", strategy.run(step, args=(xb, yb)), axis=None)))
    state = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    return {
        "losses": losses,
        "state": state,
        "up_local": tuple(model.up.weight.to_local().shape),
        "up_global": tuple(model.up.weight.shape),
    }


def test_a_layout_naming_the_batch_axis_splits_along_it_with_one_process_numbers() -> None:
    results = launch.run(_worker, 4, timeout=200)
    losses, state = _reference()
    for rank, out in enumerate(results):
        assert out["up_global"] == (16, 8), out
        assert out["up_local"] == (8, 4), (rank, out["up_local"])  # half along each axis
        torch.testing.assert_close(
            torch.tensor(out["losses"]), torch.tensor(losses), rtol=0, atol=1e-5
        )
        for name, value in state.items():
            torch.testing.assert_close(out["state"][name], value, rtol=0, atol=1e-5, msg=name)
