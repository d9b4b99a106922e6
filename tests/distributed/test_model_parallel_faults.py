"""A dead ModelParallelStrategy worker is named, on every survivor, by its global rank.

A (2, 2) mesh of 4 workers trains a column- then row-parallel MLP (DTensor's
collectives along the model axis, the library's gradient sums along the batch axis);
one worker dies at the start of a step. Every survivor raises the library's
`CollectiveTimeoutError` within the collective timeout, naming the dead worker's
global rank and mesh coordinate: no raw gloo error, no rank of a sub-group.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

import distribute as ds
from distribute import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

TIMEOUT = 6.0
DEAD = 3  # mesh [[0, 1], [2, 3]]: rank 3 sits at batch 1, model 1


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _worker(dead: int, timeout: float) -> dict[str, Any]:
    mesh = ds.experimental.DeviceMesh((2, 2), ("batch", "model"))
    layouts = ds.experimental.LayoutMap(mesh)
    layouts[r".*up\.weight"] = ("model", None)
    layouts[r".*up\.bias"] = ("model",)
    layouts[r".*down\.weight"] = (None, "model")
    strategy = ds.experimental.ModelParallelStrategy(
        layouts,
        communication_options=ds.experimental.CommunicationOptions(timeout_seconds=timeout),
    )
    rank = int(os.environ["RANK"])
    with strategy.scope():
        model = Mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 8), torch.randn(8, 4)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.mse_loss(model(xb), yb, reduction="none").mean(1)
        loss = ds.compute_average_loss(per_example, global_batch_size=8)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    batches = list(strategy.experimental_distribute_dataset([(x, y), (x, y), (x, y)]))
    strategy.run(step, args=batches[0])  # one good step
    if rank == dead:
        os._exit(0)  # dies without a word, at the start of the next step
    start = time.monotonic()
    try:
        for batch in batches[1:]:
            strategy.run(step, args=batch)
    except Exception as exc:  # the test asserts which class it is
        return {
            "error": type(exc).__name__,
            "library": isinstance(exc, ds.errors.CollectiveTimeoutError),
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    return {"error": None, "message": "", "seconds": time.monotonic() - start}


def test_a_killed_model_parallel_worker_is_named_by_global_rank_on_every_survivor() -> None:
    results = launch.run(
        _worker, 4, args=(DEAD, TIMEOUT), timeout=150, allow_missing=True
    )
    assert results[DEAD] is None, results[DEAD]
    survivors = [(rank, out) for rank, out in enumerate(results) if rank != DEAD]
    for rank, out in survivors:
        assert out is not None, f"rank {rank} exited without a result"
        assert out["library"], (rank, out)
        message = out["message"]
        assert "rank 3 (batch 1, model 1)" in message, (rank, message)
        assert "dead" in message or "does not answer" in message, (rank, message)
        assert "cannot be named" not in message, (rank, message)
        assert out["seconds"] < TIMEOUT + 5, (rank, out["seconds"], message)
