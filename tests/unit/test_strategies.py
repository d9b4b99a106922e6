"""Rules every strategy shares, run under each strategy combination (conftest)."""

from __future__ import annotations

import pytest
import torch

import distribute as ds


def local(strategy: ds.Strategy) -> int:
    return len(strategy.extended.worker_devices)


def per_replica_ids(strategy: ds.Strategy) -> object:
    """A value whose component on replica i is tensor([i, i])."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.full((2,), float(ctx.replica_id_in_sync_group))
    )


def test_run_returns_one_result_per_replica(strategy: ds.Strategy) -> None:
    out = strategy.run(lambda: ds.get_replica_context().replica_id_in_sync_group)  # type: ignore[union-attr]
    if local(strategy) == 1:
        assert out == 0
    else:
        assert isinstance(out, ds.PerReplica)
        assert out.values == tuple(range(local(strategy)))


def test_run_unwraps_identical_objects(strategy: ds.Strategy) -> None:
    marker = object()
    assert strategy.run(lambda: marker) is marker


def test_run_gives_each_replica_its_component_at_any_depth(strategy: ds.Strategy) -> None:
    values = per_replica_ids(strategy)
    out = strategy.run(lambda d: float(d["x"][0][1]), args=({"x": [values]},))
    assert strategy.experimental_local_results(out) == tuple(
        float(i) for i in range(local(strategy))
    )


def test_run_rejects_args_that_are_not_a_list_or_tuple(strategy: ds.Strategy) -> None:
    with pytest.raises(ValueError, match="list or tuple"):
        strategy.run(lambda x: x, args=torch.ones(1))  # type: ignore[arg-type]


def test_reduce_sum_and_mean_across_replicas(strategy: ds.Strategy) -> None:
    values = per_replica_ids(strategy)
    n = local(strategy)
    total = sum(range(n))
    with strategy.scope():
        assert torch.equal(
            strategy.reduce("SUM", values, axis=None), torch.full((2,), float(total))
        )
        assert torch.allclose(
            strategy.reduce("mean", values, axis=None), torch.full((2,), total / n)
        )


def test_reduce_with_axis_weights_the_mean_by_element_count(strategy: ds.Strategy) -> None:
    # Replica i holds i + 1 elements, all equal to i + 1; MEAN divides by the total count.
    components = [torch.full((i + 1,), float(i + 1)) for i in range(local(strategy))]
    value = components[0] if len(components) == 1 else ds.PerReplica(components)
    total = sum((i + 1) ** 2 for i in range(local(strategy)))
    count = sum(i + 1 for i in range(local(strategy)))
    assert float(strategy.reduce("sum", value, axis=0)) == total
    assert float(strategy.reduce("mean", value, axis=0)) == pytest.approx(total / count)


def test_reduce_with_an_axis_out_of_range_raises(strategy: ds.Strategy) -> None:
    with pytest.raises(ValueError, match="out of range"):
        strategy.reduce("sum", per_replica_ids(strategy), axis=3)


def test_reduce_of_a_plain_value(strategy: ds.Strategy) -> None:
    value = torch.tensor([1.0, 2.0])
    assert strategy.reduce("mean", value) is value
    if strategy.num_replicas_in_sync == 1:
        assert strategy.reduce("sum", value) is value
    else:
        with pytest.raises(ValueError, match="ambiguous"):
            strategy.reduce("sum", value)


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("axis", [None, 0])
def test_reduce_of_per_replica_values_of_different_shapes_raises_naming_them(
    strategy: ds.Strategy, op: str, axis: int | None
) -> None:
    # TF raises; torch would broadcast [1] against [3] (or fail with its raw in-place
    # error the other way round): a partial last batch reduced with axis=None.
    if local(strategy) == 1:
        pytest.skip("needs several replicas to disagree")
    shapes = [(3, 2)] * (local(strategy) - 1) + [(1, 4)]
    value = ds.PerReplica([torch.ones(s) for s in shapes])
    expected = r"replica 0 has torch.float32\[3, 2\] but replica \d+ has torch.float32\[1, 4\]"
    with strategy.scope(), pytest.raises(ValueError, match=expected):
        strategy.reduce(op, value, axis=axis)
    with pytest.raises(ValueError, match=expected):
        strategy.extended.reduce_to(op, value, destinations="cpu")
    with pytest.raises(ValueError, match=expected):
        strategy.extended.batch_reduce_to(op, [(value, "cpu")])


def test_reduce_of_shapes_that_broadcast_raises_in_either_order(strategy: ds.Strategy) -> None:
    if local(strategy) == 1:
        pytest.skip("needs several replicas to disagree")
    n = local(strategy)
    for first, other in (((3,), (1,)), ((1,), (3,))):
        value = ds.PerReplica([torch.ones(first)] + [torch.ones(other)] * (n - 1))
        with pytest.raises(ValueError, match="replica 0 has"):
            strategy.reduce("sum", value, axis=None)


def test_reduce_with_an_axis_accepts_shapes_that_differ_along_it(strategy: ds.Strategy) -> None:
    components = [torch.ones(i + 1, 3) for i in range(local(strategy))]
    value = components[0] if len(components) == 1 else ds.PerReplica(components)
    count = sum(i + 1 for i in range(local(strategy)))
    assert torch.equal(strategy.reduce("sum", value, axis=0), torch.full((3,), float(count)))


@pytest.mark.parametrize(
    "cross_device_ops",
    [ds.ReductionToOneDevice(), ds.HierarchicalCopyAllReduce(), ds.NcclAllReduce()],
    ids=["to_one_device", "hierarchical_copy", "nccl"],
)
def test_cross_device_ops_refuse_values_of_different_shapes(
    cross_device_ops: ds.CrossDeviceOps,
) -> None:
    value = ds.PerReplica((torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0])))
    with pytest.raises(ValueError, match=r"\[3\] but replica 1 has torch.float32\[1\]"):
        cross_device_ops.reduce("sum", value, destinations=["cpu:0", "cpu:1"])
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=cross_device_ops)
    with pytest.raises(ValueError, match="replica 1 has"):
        strategy.extended.reduce_to("mean", value, destinations="cpu")


def test_reduce_of_a_nest_reduces_each_leaf(strategy: ds.Strategy) -> None:
    values = per_replica_ids(strategy)
    out = strategy.reduce("sum", {"a": values, "b": (values,)})
    expected = torch.full((2,), float(sum(range(local(strategy)))))
    assert torch.equal(out["a"], expected) and torch.equal(out["b"][0], expected)


def test_gather_concatenates_components_that_differ_on_the_axis(strategy: ds.Strategy) -> None:
    components = [torch.arange(i + 1) for i in range(local(strategy))]
    value = components[0] if len(components) == 1 else ds.PerReplica(components)
    assert torch.equal(strategy.gather(value, axis=0), torch.cat(components))


def test_gather_rejects_shapes_that_differ_off_the_axis(strategy: ds.Strategy) -> None:
    if local(strategy) == 1:
        pytest.skip("needs several replicas to disagree")
    components = [torch.zeros(2, i + 1) for i in range(local(strategy))]
    with pytest.raises(ValueError, match="only along axis 0"):
        strategy.gather(ds.PerReplica(components), axis=0)


def test_gather_of_scalars_raises(strategy: ds.Strategy) -> None:
    with pytest.raises(ValueError, match="rank >= 1"):
        strategy.gather(torch.tensor(1.0), axis=0)


def test_local_results(strategy: ds.Strategy) -> None:
    n = local(strategy)
    plain = torch.ones(1)
    assert strategy.experimental_local_results(plain) == (plain,)
    nest = {"a": 1, "b": 2}
    assert strategy.experimental_local_results(nest) == tuple([nest] * n)
    assert len(strategy.experimental_local_results(per_replica_ids(strategy))) == n


def test_values_from_function_wraps_like_tf(strategy: ds.Strategy) -> None:
    out = strategy.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync)
    )
    n = local(strategy)
    if isinstance(strategy, (ds.OneDeviceStrategy,)) or strategy is ds.get_strategy():
        assert out == (0, 1)
    else:
        assert isinstance(out, ds.PerReplica)
        assert out.values == tuple((i, n) for i in range(n))


def test_scope_turns_module_parameters_into_variables(strategy: ds.Strategy) -> None:
    with strategy.scope():
        layer = torch.nn.Linear(3, 2)
    if strategy is ds.get_strategy():
        assert not isinstance(layer.weight, ds.DistributedVariable)
        return
    assert isinstance(layer.weight, ds.MirroredVariable)
    assert isinstance(layer.weight, torch.nn.Parameter)
    assert len(layer.weight.values) == local(strategy)
    assert strategy.extended.variable_created_in_scope(layer.weight)
    assert layer.weight.device == strategy.extended.worker_devices[0]


def test_a_training_step_runs_and_returns_the_loss(strategy: ds.Strategy) -> None:
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    n = strategy.num_replicas_in_sync
    x = torch.randn(4 * n, 4)
    batch = x if n == 1 else ds.PerReplica(x.chunk(n))

    def step(xb: torch.Tensor) -> torch.Tensor:
        loss = ds.compute_average_loss(model(xb).pow(2).sum(dim=1), global_batch_size=4 * n)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    with torch.no_grad():
        expected = model(x).pow(2).sum() / (4 * n)
    loss = strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None)
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)
