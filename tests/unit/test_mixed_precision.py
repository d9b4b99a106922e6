"""Mixed precision in one process: autocast reaches every replica thread, and
`ds.GradScaler` trains several replicas as `torch.amp.GradScaler` trains one."""

from __future__ import annotations

from typing import Any

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


def _one_scaled_step(strategy: ds.Strategy, scaler: ds.GradScaler, model: Any, opt: Any) -> None:
    def step_fn() -> None:
        scaler.scale(model(torch.ones(2, 2)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    strategy.run(step_fn)


def test_grad_scaler_load_state_dict_sets_every_replica_scale() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ds.GradScaler("cpu", init_scale=1024.0)
    _one_scaled_step(strategy, scaler, model, opt)
    scaler.load_state_dict({**scaler.state_dict(), "scale": 8.0})
    scales = strategy.experimental_local_results(strategy.run(scaler.get_scale))
    assert list(scales) == [8.0, 8.0]
    _one_scaled_step(strategy, scaler, model, opt)
    assert torch.equal(model.weight.values[0], model.weight.values[1])


def test_grad_scaler_update_outside_run_after_replicas_used_it_raises() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ds.GradScaler("cpu")
    _one_scaled_step(strategy, scaler, model, opt)
    with pytest.raises(ds.errors.ContextError, match="inside the function given to"):
        scaler.update(2.0)


def test_grad_scaler_pickles_and_copies_after_replicas_used_it() -> None:
    import copy
    import pickle

    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ds.GradScaler("cpu", init_scale=64.0, growth_interval=1)
    _one_scaled_step(strategy, scaler, model, opt)
    for clone in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        assert clone.get_scale() == scaler.get_scale() == 128.0


def test_disabled_grad_scaler_behaves_like_torch_one() -> None:
    scaler = ds.GradScaler("cpu", enabled=False)
    assert getattr(scaler, "_scale", None) is None
    assert scaler.get_scale() == 1.0
    assert scaler.scale(torch.tensor(3.0)) == 3.0


def test_explicit_unscale_then_clipping_clips_the_summed_gradient() -> None:
    """`unscale_` sums first, so clipping after it clips the sum over replicas, as the
    same clipping does on the whole batch in one process."""

    def train(strategy: ds.Strategy | None) -> torch.Tensor:
        torch.manual_seed(0)
        scope = strategy.scope() if strategy is not None else ds.get_strategy().scope()
        with scope:
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = ds.GradScaler("cpu", init_scale=256.0)
        x = torch.arange(32.0).reshape(8, 4)

        def step_fn(xb: torch.Tensor) -> None:
            loss = ds.compute_average_loss(model(xb).pow(2).sum(1), global_batch_size=8)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

        if strategy is None:
            step_fn(x)
        else:
            strategy.run(step_fn, args=(ds.PerReplica((x[:4], x[4:])),))
        return model.weight.detach().clone()

    torch.testing.assert_close(train(ds.MirroredStrategy(["cpu:0", "cpu:1"])), train(None))


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_adam"])
def test_torch_grad_scaler_is_refused_under_two_replicas(fused: bool) -> None:
    """Also for an optimizer that takes the scale itself (a fused Adam: torch's scaler
    then checks each replica's gradient and steps it directly, not through the path
    that unscales)."""
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        opt = (
            torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
            if fused
            else torch.optim.SGD(model.parameters(), lr=0.1)
        )
    scalers = [torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")]  # one per replica

    def step_fn() -> None:
        ctx = ds.get_replica_context()
        assert ctx is not None
        scaler = scalers[ctx.local_replica_id]
        scaler.scale(model(torch.ones(2, 2)).sum()).backward()
        scaler.step(opt)

    with pytest.raises(ds.errors.InvalidArgumentError, match=r"distribute\.GradScaler"):
        strategy.run(step_fn)
