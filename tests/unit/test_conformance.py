"""The engine contract, run through every engine that can run in one process.

`StrategyExtended` is the contract (docs/architecture.md, "Adding an engine"); these
checks hold for every engine: the scope and the contexts, `run` (and `run` refused
inside `run` and inside a merge_fn), `reduce` (SUM and MEAN, with an axis), `gather`,
`experimental_local_results`, `merge_call`, `extended.update` (and refused for another
strategy's variable), `colocate_vars_with`, a training step whose weights are one
device's, and a checkpoint round trip. A new engine joins by adding its factory to
`ENGINES`. Engines that need other processes run the same checks elsewhere: the
parameter-server engine with one worker in tests/distributed/test_conformance_ps.py,
TPUStrategy's two modes in tests/xla/test_conformance_xla.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import distribute as ds
from distribute.errors import ContextError, InvalidArgumentError


def _model_parallel() -> ds.Strategy:
    mesh = ds.experimental.DeviceMesh((1, 1), ("batch", "model"))
    layouts = ds.experimental.LayoutMap(mesh)
    layouts[r".*0\.weight"] = ("model", None)
    return ds.experimental.ModelParallelStrategy(layouts)


ENGINES: dict[str, Callable[[], ds.Strategy]] = {
    "default": ds.get_strategy,
    "one_device": lambda: ds.OneDeviceStrategy("cpu"),
    "mirrored_1": lambda: ds.MirroredStrategy(["cpu:0"]),
    "mirrored_4": lambda: ds.MirroredStrategy([f"cpu:{i}" for i in range(4)]),
    "central_storage": lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    "multi_worker_1": lambda: ds.MultiWorkerMirroredStrategy(),
    "multi_worker_2_local": lambda: ds.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"]),
    "fully_sharded_1": lambda: ds.experimental.FullyShardedStrategy(),
    "model_parallel_1x1": _model_parallel,
}


@pytest.fixture(params=sorted(ENGINES))
def strategy(request: pytest.FixtureRequest) -> ds.Strategy:
    if "RANK" in os.environ or "TF_CONFIG" in os.environ:  # one worker, in this process
        pytest.skip("a cluster is configured in the environment")
    return ENGINES[request.param]()


def _whole(t: Any) -> torch.Tensor:
    """A value's one logical tensor, plain, on the host (a DTensor's whole value, a
    per-replica value's first component)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, ds.DistributedValues):
        t = t.values[0]
    if isinstance(t, DTensor):
        t = t.full_tensor()
    host = t.detach().cpu()
    return (host if type(host) is torch.Tensor else torch.Tensor(host)).clone()


def _net() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(24, 4, generator=g), torch.randn(24, 2, generator=g)


# -- the contexts ----------------------------------------------------------------------------


def test_scope_makes_the_strategy_current_in_cross_replica_context(
    strategy: ds.Strategy,
) -> None:
    with strategy.scope():
        assert ds.get_strategy() is strategy
        if strategy is not ds.get_strategy.__call__() or ds.has_strategy():
            assert ds.in_cross_replica_context()
    assert strategy.extended.worker_devices
    assert strategy.num_replicas_in_sync >= 1


def test_run_gives_every_replica_its_id_and_refuses_run_inside_run(
    strategy: ds.Strategy,
) -> None:
    n = strategy.num_replicas_in_sync

    def fn() -> int:
        ctx = ds.get_replica_context()
        assert ctx is not None and ctx.num_replicas_in_sync == n
        return ctx.replica_id_in_sync_group

    ids = strategy.experimental_local_results(strategy.run(fn))
    assert sorted(ids) == list(range(n))

    def nested() -> None:
        strategy.run(lambda: None)

    with pytest.raises(ContextError, match="inside `run`"):
        strategy.run(nested)


def test_run_inside_a_merge_fn_is_refused(strategy: ds.Strategy) -> None:
    def fn() -> None:
        ds.get_replica_context().merge_call(lambda s: s.run(lambda: None))

    with pytest.raises(ContextError, match="merge_fn"):
        strategy.run(fn)


# -- reductions ------------------------------------------------------------------------------


def test_reduce_sum_and_mean_and_along_an_axis(strategy: ds.Strategy) -> None:
    n = strategy.num_replicas_in_sync

    def fn() -> torch.Tensor:
        i = ds.get_replica_context().replica_id_in_sync_group
        return torch.full((2, 3), float(i + 1))

    values = strategy.run(fn)
    total = sum(range(1, n + 1))
    assert torch.equal(_whole(strategy.reduce("sum", values, axis=None)), torch.full((2, 3), total))
    mean = _whole(strategy.reduce("mean", values, axis=None))
    torch.testing.assert_close(mean, torch.full((2, 3), total / n))
    along = _whole(strategy.reduce("sum", values, axis=0))
    assert torch.equal(along, torch.full((3,), 2.0 * total))


def test_gather_concatenates_every_replica_in_order(strategy: ds.Strategy) -> None:
    n = strategy.num_replicas_in_sync

    def fn() -> torch.Tensor:
        return torch.full((1, 2), float(ds.get_replica_context().replica_id_in_sync_group))

    gathered = _whole(strategy.gather(strategy.run(fn), axis=0))
    expected = torch.arange(n, dtype=torch.float32).repeat_interleave(2).view(n, 2)
    assert torch.equal(gathered, expected)


def test_local_results_of_a_plain_value_and_a_run(strategy: ds.Strategy) -> None:
    assert strategy.experimental_local_results(5) == (5,)
    local = len(strategy.extended.worker_devices)
    results = strategy.experimental_local_results(strategy.run(lambda: torch.ones(1)))
    assert len(results) == local


def test_merge_call_runs_once_in_cross_replica_context(strategy: ds.Strategy) -> None:
    calls: list[bool] = []

    def merge(s: ds.Strategy, value: Any) -> int:
        calls.append(ds.in_cross_replica_context())
        return 11

    def fn() -> int:
        return ds.get_replica_context().merge_call(merge, args=(1,))

    results = strategy.experimental_local_results(strategy.run(fn))
    assert set(results) == {11}  # one object on every replica: `run` unwraps it
    assert calls == [True]


# -- variables -------------------------------------------------------------------------------


def test_update_applies_to_the_strategys_variables_and_refuses_others(
    strategy: ds.Strategy,
) -> None:
    with strategy.scope():
        model = _net()
    weight = model[1].bias
    assert strategy.extended.variable_created_in_scope(weight)
    strategy.extended.update(weight, lambda v, x: v.add_(x), args=(torch.ones(2),))
    torch.testing.assert_close(_whole(weight), _whole(_net()[1].bias) + 1)
    with strategy.extended.colocate_vars_with(weight):
        pass
    if strategy is not ds.get_strategy():
        foreign = torch.nn.Parameter(torch.zeros(2))
        with pytest.raises(InvalidArgumentError, match="update"):
            strategy.extended.update(foreign, lambda v: v)
        with pytest.raises(InvalidArgumentError, match="colocate_vars_with"):
            with strategy.extended.colocate_vars_with(foreign):
                pass


def _train(strategy: ds.Strategy, steps: int = 3) -> tuple[torch.nn.Module, Any]:
    with strategy.scope():
        model = _net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.mse_loss(model(xb), yb, reduction="none").mean(1)
        loss = ds.compute_average_loss(per_example, global_batch_size=8)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    for i, (xb, yb) in enumerate(strategy.experimental_distribute_dataset(loader)):
        if i == steps:
            break
        strategy.run(step, args=(xb, yb))
    return model, optimizer


def test_a_training_step_gives_one_devices_weights(strategy: ds.Strategy) -> None:
    model, _ = _train(strategy)
    reference = _net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    x, y = _data()
    for i in range(3):
        xb, yb = x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]
        torch.nn.functional.mse_loss(reference(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(_whole(got), want, rtol=1e-5, atol=1e-6, msg=name)


def test_a_checkpoint_round_trip_restores_weights_and_optimizer_state(
    strategy: ds.Strategy, tmp_path: Path
) -> None:
    model, optimizer = _train(strategy, steps=2)
    path = ds.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "ckpt"))
    with strategy.scope():
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    ds.Checkpoint(model=fresh, optimizer=fresh_optimizer).restore(path)
    for name, value in model.state_dict().items():
        assert torch.equal(_whole(fresh.state_dict()[name]), _whole(value)), name
    saved = optimizer.state_dict()["state"]
    restored = fresh_optimizer.state_dict()["state"]
    assert saved.keys() == restored.keys()
    for key in saved:
        assert torch.equal(
            _whole(restored[key]["momentum_buffer"]), _whole(saved[key]["momentum_buffer"])
        ), key
