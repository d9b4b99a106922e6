"""Mixed precision in one process: autocast reaches every replica thread, and
`ds.GradScaler` trains several replicas as `torch.amp.GradScaler` trains one."""

from __future__ import annotations

import pytest
import torch
from mixed_precision_cases import INF_STEP, reference, train

import distribute as ds


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["mirrored", "central_storage"])
def test_grad_scaler_under_two_replicas_matches_torch_grad_scaler_in_one_process(
    kind: str, dtype: torch.dtype | None
) -> None:
    devices = ["cpu:0", "cpu:1"]
    strategy = (
        ds.MirroredStrategy(devices) if kind == "mirrored" else ds.CentralStorageStrategy(devices)
    )
    state, scales, per_replica_scales = train(strategy, dtype)
    expected_state, expected_scales = reference(dtype)
    assert scales == expected_scales  # grows every 2 steps, backs off at the infinite step
    assert expected_scales[INF_STEP] < expected_scales[INF_STEP - 1]
    assert all(len(set(s)) == 1 for s in per_replica_scales)  # every replica agrees
    tol = 1e-5 if dtype is None else 2e-2  # low precision: summing halves rounds differently
    for name, value in expected_state.items():
        torch.testing.assert_close(state[name], value, rtol=tol, atol=tol)


def test_grad_scaler_skipped_step_leaves_weights_unchanged_on_every_replica() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ds.GradScaler("cpu", init_scale=8.0)
    before = model.weight.detach().clone()

    def step_fn() -> None:
        ctx = ds.get_replica_context()
        assert ctx is not None
        loss = model(torch.ones(2, 2)).sum() * (float("inf") if ctx.local_replica_id else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    strategy.run(step_fn)
    assert all(torch.equal(c, before) for c in model.weight.values)
    assert scaler.get_scale() == 4.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_around_run_reaches_every_replica_thread(dtype: torch.dtype) -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(2, 2)
    with torch.autocast("cpu", dtype=dtype):
        result = strategy.run(lambda: model(torch.ones(1, 2)).dtype)
    assert result == dtype
    assert strategy.run(lambda: model(torch.ones(1, 2)).dtype) == torch.float32


def test_inference_and_no_grad_modes_reach_every_replica_thread() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with torch.inference_mode():
        assert strategy.run(torch.is_inference_mode_enabled) is True
    with torch.no_grad():
        assert strategy.run(torch.is_grad_enabled) is False
    assert strategy.run(torch.is_grad_enabled) is True
