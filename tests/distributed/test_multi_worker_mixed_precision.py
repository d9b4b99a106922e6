"""`ds.GradScaler` under MultiWorkerMirroredStrategy in real gloo processes: the same
weights and the same scale history as torch's GradScaler in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mixed_precision_cases import INF_STEP, reference, train

import distribute as ds
from distribute import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _train_scaled(local_replicas: int, dtype: torch.dtype | None) -> dict[str, Any]:
    devices = [f"cpu:{i}" for i in range(local_replicas)] if local_replicas > 1 else None
    strategy = ds.MultiWorkerMirroredStrategy(devices=devices)
    state, scales, per_replica_scales = train(strategy, dtype)
    strategy.shutdown()
    return {"state": state, "scales": scales, "per_replica_scales": per_replica_scales}


def _torch_scaler() -> str:
    strategy = ds.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step() -> None:
        scaler.scale(model(torch.ones(2, 2)).sum()).backward()
        scaler.step(optimizer)

    try:
        strategy.run(step)
    except ds.errors.InvalidArgumentError as e:
        return str(e)
    finally:
        strategy.shutdown()
    return "no error"


@pytest.mark.parametrize(
    ("local_replicas", "dtype"),
    [(1, None), (1, torch.bfloat16), (1, torch.float16), (2, torch.bfloat16)],
    ids=["2x1-float32", "2x1-bfloat16", "2x1-float16", "2x2-bfloat16"],
)
def test_grad_scaler_across_workers_matches_one_process(
    local_replicas: int, dtype: torch.dtype | None
) -> None:
    """The overlapped (2x1) and hierarchical (2x2) sums: every worker and replica
    skips the step whose gradient is infinite on one replica only, and the scale
    grows and backs off exactly as in one process."""
    expected_state, expected_scales = reference(dtype)
    results = launch.run(_train_scaled, 2, args=(local_replicas, dtype), timeout=150)
    assert expected_scales[INF_STEP] < expected_scales[INF_STEP - 1]
    tol = 1e-5 if dtype is None else 2e-2
    for out in results:
        assert out["scales"] == expected_scales
        assert all(len(set(s)) == 1 for s in out["per_replica_scales"])
        for name, value in expected_state.items():
            torch.testing.assert_close(out["state"][name], value, rtol=tol, atol=tol)
    for name in expected_state:  # workers agree bit for bit
        assert torch.equal(results[0]["state"][name], results[1]["state"][name])


def test_torch_grad_scaler_is_refused_across_workers() -> None:
    messages = launch.run(_torch_scaler, 2, timeout=120)
    assert all("distribute.GradScaler" in m for m in messages)
