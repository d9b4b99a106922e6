"""Distributed variables under MirroredStrategy and CentralStorageStrategy.

The rules pinned here are API.md's "Values and variables" and REFERENCE.md's "Variables":
capture of module parameters and buffers in scope, one component per replica, replica
vs cross-replica reads and writes, the aggregation of replica-context assigns, the
sync-on-read rules, state_dict round trips, and unchanged torch.optim training keeping
every replica's copy bitwise identical.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

import distribute as ds
from distribute.errors import ContextError

VA = ds.VariableAggregation
VS = ds.VariableSynchronization

MIRRORED: dict[str, Callable[[], ds.Strategy]] = {
    "mirrored_2": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
    "mirrored_4": lambda: ds.MirroredStrategy([f"cpu:{i}" for i in range(4)]),
}
ALL: dict[str, Callable[[], ds.Strategy]] = {
    **MIRRORED,
    "central_storage_4": lambda: ds.CentralStorageStrategy([f"cpu:{i}" for i in range(4)]),
}


@pytest.fixture(params=sorted(ALL))
def strategy(request: pytest.FixtureRequest) -> ds.Strategy:
    """Mirrored with 2 and 4 logical CPUs, and CentralStorage with 4."""
    return ALL[request.param]()


@pytest.fixture(params=sorted(MIRRORED))
def mirrored(request: pytest.FixtureRequest) -> ds.Strategy:
    return MIRRORED[request.param]()


@pytest.fixture
def mirrored4() -> ds.Strategy:
    return ds.MirroredStrategy([f"cpu:{i}" for i in range(4)])


@pytest.fixture
def central4() -> ds.Strategy:
    return ds.CentralStorageStrategy([f"cpu:{i}" for i in range(4)])


def rid() -> int:
    replica_ctx = ds.get_replica_context()
    assert replica_ctx is not None
    return replica_ctx.replica_id_in_sync_group


def is_central(strategy: ds.Strategy) -> bool:
    return isinstance(strategy, ds.CentralStorageStrategy)


def components(var: Any) -> list[list[float]]:
    return [c.reshape(-1).tolist() for c in var.values]


def assert_copies_identical(var: Any) -> None:
    first = var.values[0]
    for i, c in enumerate(var.values[1:], start=1):
        assert torch.equal(c, first), f"replica {i}'s copy differs from replica 0's"


def make_net() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )


# -- capture of module parameters and buffers ------------------------------------------------


def test_module_parameters_built_in_scope_are_mirrored_variables_and_parameters(
    strategy: ds.Strategy,
) -> None:
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        net = make_net()
    params = list(net.parameters())
    assert len(params) == 6
    for p in params:
        assert isinstance(p, ds.MirroredVariable)
        assert isinstance(p, torch.nn.Parameter)
        assert p.requires_grad and p.trainable
        assert p.synchronization is VS.ON_WRITE
        assert p.aggregation is VA.NONE
        assert p.distribute_strategy is strategy
        assert strategy.extended.variable_created_in_scope(p)
        local = strategy.experimental_local_results(p)
        assert len(local) == n and len(p.values) == n
        assert all(type(c) is torch.Tensor for c in local), "components are plain tensors"
        assert_copies_identical(p)


def test_module_buffers_built_in_scope_are_mirrored_variables_but_not_parameters(
    strategy: ds.Strategy,
) -> None:
    with strategy.scope():
        bn = torch.nn.BatchNorm1d(4)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        buffer = getattr(bn, name)
        assert isinstance(buffer, ds.MirroredVariable), name
        assert not isinstance(buffer, torch.nn.Parameter), name
        assert not buffer.requires_grad and not buffer.trainable
        assert len(buffer.values) == strategy.num_replicas_in_sync
        assert_copies_identical(buffer)
    # Floating buffers are averaged across replicas; the others take replica 0's value.
    assert bn.running_mean.aggregation is VA.MEAN
    assert bn.num_batches_tracked.aggregation is VA.ONLY_FIRST_REPLICA
    assert {name for name, _ in bn.named_buffers()} == {
        "running_mean",
        "running_var",
        "num_batches_tracked",
    }
    assert [name for name, _ in bn.named_parameters()] == ["weight", "bias"]


def test_mirrored_copies_have_their_own_storage(mirrored: ds.Strategy) -> None:
    with mirrored.scope():
        layer = torch.nn.Linear(2, 2)
    ptrs = {c.data_ptr() for c in layer.weight.values}
    assert len(ptrs) == mirrored.num_replicas_in_sync


def test_central_storage_keeps_one_copy_that_every_replica_aliases(central4: ds.Strategy) -> None:
    with central4.scope():
        layer = torch.nn.Linear(2, 2)
    assert len(layer.weight.values) == 4
    assert {c.data_ptr() for c in layer.weight.values} == {layer.weight.data_ptr()}
    assert central4.extended.parameter_devices == (torch.device("cpu"),)


def test_initial_values_come_from_the_module_initialiser(mirrored4: ds.Strategy) -> None:
    torch.manual_seed(3)
    reference = torch.nn.Linear(5, 4)
    torch.manual_seed(3)
    with mirrored4.scope():
        layer = torch.nn.Linear(5, 4)
    for c in layer.weight.values:
        assert torch.equal(c, reference.weight.detach())
    for c in layer.bias.values:
        assert torch.equal(c, reference.bias.detach())


def test_modules_built_outside_scope_keep_plain_tensors(strategy: ds.Strategy) -> None:
    layer = torch.nn.Linear(2, 2)
    bn = torch.nn.BatchNorm1d(2)
    assert type(layer.weight) is torch.nn.Parameter
    assert type(bn.running_mean) is torch.Tensor
    assert not strategy.extended.variable_created_in_scope(layer.weight)
    assert not strategy.extended.variable_created_in_scope(bn.running_mean)
    with pytest.raises(ValueError, match="colocate_vars_with"):
        with strategy.extended.colocate_vars_with(layer.weight):
            pass


def test_variables_of_another_strategy_are_not_created_in_scope(strategy: ds.Strategy) -> None:
    other = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with other.scope():
        foreign = ds.Variable(torch.ones(1))
    with strategy.scope():
        own = ds.Variable(torch.ones(1))
    assert strategy.extended.variable_created_in_scope(own)
    assert not strategy.extended.variable_created_in_scope(foreign)
    with strategy.extended.colocate_vars_with(own):
        pass


def test_one_local_replica_variables_have_no_per_op_dispatch() -> None:
    s = ds.MirroredStrategy(["cpu:0"])
    with s.scope():
        layer = torch.nn.Linear(2, 2)
    assert isinstance(layer.weight, ds.MirroredVariable)
    assert type(layer.weight).__torch_function__ is torch._C._disabled_torch_function_impl
    assert type(layer.weight * 2) is torch.Tensor


# -- replica context reads and autograd ---------------------------------------------------------


def test_inside_run_torch_ops_see_the_replica_s_own_component(mirrored4: ds.Strategy) -> None:
    with mirrored4.scope():
        v = ds.Variable(torch.zeros(3))
    mirrored4.extended.update(
        v,
        lambda c, x: c.copy_(x),
        args=(ds.PerReplica([torch.full((3,), float(i)) for i in range(4)]),),
    )
    sums, reads = mirrored4.run(lambda: ((v * 10).sum().item(), v.read_value()))
    assert sums.values == (0.0, 30.0, 60.0, 90.0)
    for i, read in enumerate(reads.values):
        assert torch.equal(read, torch.full((3,), float(i)))


def test_each_replica_gets_its_own_gradient_before_the_optimizer_step(
    mirrored4: ds.Strategy,
) -> None:
    torch.manual_seed(0)
    with mirrored4.scope():
        layer = torch.nn.Linear(3, 1)
    shards = [torch.full((2, 3), float(i + 1)) for i in range(4)]

    def fn(x: torch.Tensor) -> torch.Tensor:
        layer(x).sum().backward()
        assert layer.weight.grad is not None
        return layer.weight.grad.clone()

    grads = mirrored4.experimental_local_results(mirrored4.run(fn, args=(ds.PerReplica(shards),)))
    for shard, grad in zip(shards, grads):
        assert torch.equal(grad, shard.sum(dim=0, keepdim=True))
    layer.zero_grad()  # cross-replica zero_grad clears every replica's gradient
    assert layer.weight.grad is None
    assert mirrored4.run(lambda: layer.weight.grad is None) is True


def test_cross_replica_reads_see_the_primary(mirrored4: ds.Strategy) -> None:
    with mirrored4.scope():
        v = ds.Variable(torch.tensor([1.0, 2.0]))
        assert torch.equal(v.read_value(), torch.tensor([1.0, 2.0]))
        assert torch.equal(v * 2, torch.tensor([2.0, 4.0]))
    assert float(v.detach().sum()) == 3.0


# -- assign in cross-replica context ------------------------------------------------------------


@pytest.mark.parametrize("aggregation", list(VA))
def test_cross_replica_assign_writes_every_copy(
    mirrored: ds.Strategy, aggregation: ds.VariableAggregation
) -> None:
    with mirrored.scope():
        v = ds.Variable(torch.zeros(2), aggregation=aggregation)
        returned = v.assign(torch.tensor([5.0, 6.0]))
        assert returned is v
        assert components(v) == [[5.0, 6.0]] * mirrored.num_replicas_in_sync
        v.assign_add(torch.tensor([1.0, 1.0]))
        assert components(v) == [[6.0, 7.0]] * mirrored.num_replicas_in_sync
        v.assign_sub(2.0)
        assert components(v) == [[4.0, 5.0]] * mirrored.num_replicas_in_sync
    v.assign(1.0)  # outside any scope: still cross-replica for this variable
    assert components(v) == [[1.0, 1.0]] * mirrored.num_replicas_in_sync


def test_cross_replica_assign_on_central_storage_writes_the_copy(central4: ds.Strategy) -> None:
    with central4.scope():
        v = ds.Variable(torch.zeros(2))
        v.assign(torch.tensor([5.0, 6.0]))
    assert components(v) == [[5.0, 6.0]] * 4


def test_cross_replica_assign_add_on_central_storage_is_applied_once(
    central4: ds.Strategy,
) -> None:
    with central4.scope():
        v = ds.Variable(torch.zeros(2))
        v.assign_add(torch.tensor([1.0, 2.0]))
    assert components(v) == [[1.0, 2.0]] * 4


def test_in_place_cross_replica_writes_reach_every_copy(mirrored4: ds.Strategy) -> None:
    with mirrored4.scope():
        layer = torch.nn.Linear(2, 2)
    with torch.no_grad():
        layer.bias.fill_(7.0)  # writes the primary only
    assert components(layer.bias) == [[7.0, 7.0]] * 4
    with torch.no_grad():
        layer.weight.zero_()
    seen = mirrored4.run(lambda: float(layer.weight.detach().abs().sum()))
    assert mirrored4.experimental_local_results(seen) == (0.0,) * 4


# -- assign in replica context follows the aggregation -------------------------------------------


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        (VA.SUM, lambda n: [float(sum(range(1, n + 1)))] * n),
        (VA.MEAN, lambda n: [sum(range(1, n + 1)) / n] * n),
        (VA.ONLY_FIRST_REPLICA, lambda n: [1.0] * n),
        (VA.NONE, lambda n: [float(i + 1) for i in range(n)]),  # the local copy only
    ],
    ids=["sum", "mean", "only_first_replica", "none"],
)
def test_replica_assign_follows_the_aggregation(
    mirrored: ds.Strategy,
    aggregation: ds.VariableAggregation,
    expected: Callable[[int], list[float]],
) -> None:
    n = mirrored.num_replicas_in_sync
    with mirrored.scope():
        v = ds.Variable(torch.zeros(()), aggregation=aggregation)
    mirrored.run(lambda: v.assign(torch.tensor(float(rid() + 1))))
    assert [float(c) for c in v.values] == expected(n)


@pytest.mark.parametrize(
    "strategy_name",
    [
        "mirrored_2",
        "mirrored_4",
        "central_storage_4",
    ],
)
@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        (VA.SUM, lambda n: [2.0 * sum(range(1, n + 1))] * n),
        (VA.MEAN, lambda n: [2.0 * sum(range(1, n + 1)) / n] * n),
        (VA.ONLY_FIRST_REPLICA, lambda n: [2.0] * n),
    ],
    ids=["sum", "mean", "only_first_replica"],
)
def test_replica_assign_add_applies_the_aggregated_delta_once(
    strategy_name: str,
    aggregation: ds.VariableAggregation,
    expected: Callable[[int], list[float]],
) -> None:
    strategy = ALL[strategy_name]()
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        v = ds.Variable(torch.zeros(()), aggregation=aggregation)
    strategy.run(lambda: v.assign(torch.tensor(float(rid() + 1))))
    assert [float(c) for c in v.values] == [x / 2 for x in expected(n)]  # assign: once
    strategy.run(lambda: v.assign_add(torch.tensor(float(rid() + 1))))
    assert [float(c) for c in v.values] == expected(n)


@pytest.mark.parametrize("kind", ["assign", "assign_add", "assign_sub"])
def test_replica_sum_assign_of_a_value_that_is_not_per_replica_raises(
    mirrored4: ds.Strategy, kind: str
) -> None:
    # TF: "A non-DistributedValues value cannot be reduced with SUM". Summing it would
    # count one Python number 4 times (it left 2.0 on 2 replicas before).
    with mirrored4.scope():
        v = ds.Variable(0.0, aggregation=VA.SUM)
    outside = torch.tensor(3.0)
    for value in (1.0, 7, outside):
        with pytest.raises(ValueError, match="cannot be reduced with SUM"):
            mirrored4.run(lambda value=value: getattr(v, kind)(value))
    assert components(v) == [[0.0]] * 4, "nothing was written"


def test_replica_sum_assign_of_zero_or_of_values_each_replica_computes_is_summed(
    mirrored4: ds.Strategy, central4: ds.Strategy
) -> None:
    for strategy in (mirrored4, central4):
        with strategy.scope():
            v = ds.Variable(5.0, aggregation=VA.SUM)
        strategy.run(lambda v=v: v.assign(0.0))  # zero: its sum is unambiguous (TF too)
        assert components(v) == [[0.0]] * 4
        strategy.run(lambda v=v: v.assign(torch.tensor(1.0)))  # a new tensor per replica
        assert components(v) == [[4.0]] * 4
        strategy.run(lambda v=v: v.assign_add(float(rid())))  # computed per replica
        assert components(v) == [[10.0]] * 4


def test_replica_mean_assign_of_one_value_is_that_value(mirrored4: ds.Strategy) -> None:
    with mirrored4.scope():
        v = ds.Variable(0.0, aggregation=VA.MEAN)
    mirrored4.run(lambda: v.assign(2.5))
    assert components(v) == [[2.5]] * 4


def test_replica_assign_sub_with_sum_aggregation(mirrored4: ds.Strategy) -> None:
    with mirrored4.scope():
        v = ds.Variable(torch.full((2,), 100.0), aggregation=VA.SUM)
    mirrored4.run(lambda: v.assign_sub(torch.full((2,), float(rid()))))
    assert components(v) == [[94.0, 94.0]] * 4


def test_replica_assign_none_keeps_copies_apart_until_a_cross_replica_write(
    mirrored4: ds.Strategy,
) -> None:
    with mirrored4.scope():
        v = ds.Variable(torch.zeros(()))
    mirrored4.run(lambda: v.assign_add(float(rid())))
    assert [float(c) for c in v.values] == [0.0, 1.0, 2.0, 3.0]
    assert mirrored4.run(lambda: float(v.detach())).values == (0.0, 1.0, 2.0, 3.0)
    v.assign(9.0)
    assert [float(c) for c in v.values] == [9.0] * 4


def test_replica_assign_with_none_aggregation_on_central_storage_raises(
    central4: ds.Strategy,
) -> None:
    with central4.scope():
        v = ds.Variable(torch.zeros(()))
    with pytest.raises(ValueError, match="aggregation"):
        central4.run(lambda: v.assign(float(rid())))


def test_assigning_another_strategy_s_variable_inside_run_raises(mirrored4: ds.Strategy) -> None:
    other = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with other.scope():
        foreign = ds.Variable(torch.zeros(1))
    with pytest.raises(ContextError, match="inside `run`"):
        mirrored4.run(lambda: foreign.assign(torch.ones(1)))
    assert components(foreign) == [[0.0], [0.0]]


# -- creation rules ---------------------------------------------------------------------------


def test_variable_in_scope_is_mirrored_or_sync_on_read(strategy: ds.Strategy) -> None:
    with strategy.scope():
        auto = ds.Variable(torch.ones(2))
        on_write = ds.Variable(torch.ones(2), synchronization=VS.ON_WRITE, aggregation=VA.SUM)
        on_read = ds.Variable(torch.ones(2), synchronization=VS.ON_READ, aggregation=VA.SUM)
    assert isinstance(auto, ds.MirroredVariable) and auto.synchronization is VS.ON_WRITE
    assert isinstance(on_write, ds.MirroredVariable) and on_write.aggregation is VA.SUM
    assert isinstance(on_read, ds.SyncOnReadVariable)
    assert not isinstance(on_read, ds.MirroredVariable)
    assert on_read.synchronization is VS.ON_READ
    assert auto.trainable and auto.requires_grad
    assert not on_read.trainable and not on_read.requires_grad, "ON_READ: not trainable by default"
    for var in (auto, on_write, on_read):
        assert isinstance(var, torch.Tensor)
        assert len(var.values) == strategy.num_replicas_in_sync
        assert var.distribute_strategy is strategy


def test_variable_arguments(mirrored4: ds.Strategy) -> None:
    with mirrored4.scope():
        frozen = ds.Variable(torch.ones(2), trainable=False)
        wide = ds.Variable(3.0, dtype=torch.float64)
        from_float = ds.Variable(1.5)
        from_int = ds.Variable(2, aggregation=VA.SUM)
        from_list = ds.Variable([1.0, 2.0], aggregation=VA.MEAN)
    assert not frozen.trainable and not frozen.requires_grad
    assert wide.dtype == torch.float64 and float(wide.detach()) == 3.0
    assert from_float.dtype == torch.get_default_dtype()
    assert from_int.dtype == torch.int64 and not from_int.requires_grad
    assert from_list.aggregation is VA.MEAN and components(from_list) == [[1.0, 2.0]] * 4


def test_none_synchronization_under_a_strategy_raises(strategy: ds.Strategy) -> None:
    with strategy.scope(), pytest.raises(ValueError, match="`NONE` variable synchronization"):
        ds.Variable(1.0, synchronization=VS.NONE)


@pytest.mark.parametrize("synchronization", [VS.ON_WRITE, VS.ON_READ])
def test_mean_aggregation_of_an_integer_variable_raises(
    strategy: ds.Strategy, synchronization: ds.VariableSynchronization
) -> None:
    with strategy.scope(), pytest.raises(ValueError, match="MEAN"):
        ds.Variable(torch.tensor([1, 2]), synchronization=synchronization, aggregation=VA.MEAN)


def test_variable_outside_any_scope_is_a_single_copy_variable(strategy: ds.Strategy) -> None:
    v = ds.Variable(1.0)
    assert isinstance(v, ds.DistributedVariable)
    assert len(v.values) == 1
    assert float(v.assign_add(2.0).detach()) == 3.0
    assert float(v.assign_sub(1.0).detach()) == 2.0
    assert float(v.read_value()) == 2.0
    assert not strategy.extended.variable_created_in_scope(v)
    assert v.distribute_strategy is ds.get_strategy()


def test_repr_names_the_replicas_and_the_aggregation(mirrored4: ds.Strategy) -> None:
    with mirrored4.scope():
        v = ds.Variable(torch.zeros(1), aggregation=VA.SUM)
    assert "replicas=4" in repr(v) and "SUM" in repr(v)


# -- SyncOnReadVariable ---------------------------------------------------------------------------


def on_read(strategy: ds.Strategy, aggregation: ds.VariableAggregation, value: Any = 0.0) -> Any:
    with strategy.scope():
        return ds.Variable(value, synchronization=VS.ON_READ, aggregation=aggregation)


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        (VA.SUM, lambda n: float(sum(range(1, n + 1)))),
        (VA.MEAN, lambda n: sum(range(1, n + 1)) / n),
        (VA.ONLY_FIRST_REPLICA, lambda n: 1.0),
    ],
    ids=["sum", "mean", "only_first_replica"],
)
def test_sync_on_read_cross_replica_read_aggregates(
    strategy: ds.Strategy,
    aggregation: ds.VariableAggregation,
    expected: Callable[[int], float],
) -> None:
    n = strategy.num_replicas_in_sync
    v = on_read(strategy, aggregation)
    strategy.run(lambda: v.assign_add(float(rid() + 1)))
    # Each replica wrote only its own component ...
    assert [float(c) for c in v.values] == [float(i + 1) for i in range(n)]
    assert strategy.run(lambda: float(v.read_value())).values == tuple(
        float(i + 1) for i in range(n)
    )
    # ... and a cross-replica read aggregates them.
    assert float(v.read_value()) == pytest.approx(expected(n))
    with strategy.scope():
        assert float(v * 1) == pytest.approx(expected(n))
        assert float(strategy.reduce("sum", v)) == float(sum(range(1, n + 1)))


def test_sync_on_read_replicas_read_and_write_only_their_own_component(
    mirrored4: ds.Strategy,
) -> None:
    v = on_read(mirrored4, VA.SUM, torch.zeros(2))

    def fn() -> torch.Tensor:
        v.assign(torch.full((2,), float(rid())))
        v.assign_add(torch.ones(2))
        return v + 0

    for i, out in enumerate(mirrored4.experimental_local_results(mirrored4.run(fn))):
        assert torch.equal(out, torch.full((2,), float(i + 1)))
    assert components(v) == [[float(i + 1)] * 2 for i in range(4)]


def test_sync_on_read_metric_accumulates_over_steps(mirrored4: ds.Strategy) -> None:
    total = on_read(mirrored4, VA.SUM)
    count = on_read(mirrored4, VA.SUM, torch.tensor(0))
    for _ in range(3):
        mirrored4.run(lambda: (total.assign_add(float(rid())), count.assign_add(1)))
    assert float(total.read_value()) == 3 * 6.0
    assert int(count.read_value()) == 12


def test_sync_on_read_cross_replica_assign_with_sum_divides_by_n(strategy: ds.Strategy) -> None:
    n = strategy.num_replicas_in_sync
    v = on_read(strategy, VA.SUM)
    with strategy.scope():
        v.assign(8.0)
    assert [float(c) for c in v.values] == [8.0 / n] * n
    assert float(v.read_value()) == pytest.approx(8.0)


@pytest.mark.parametrize("aggregation", [VA.MEAN, VA.ONLY_FIRST_REPLICA])
def test_sync_on_read_cross_replica_assign_writes_the_value_to_each_component(
    strategy: ds.Strategy, aggregation: ds.VariableAggregation
) -> None:
    n = strategy.num_replicas_in_sync
    v = on_read(strategy, aggregation)
    with strategy.scope():
        v.assign(8.0)
        assert [float(c) for c in v.values] == [8.0] * n
        v.assign_add(1.0)
        v.assign_sub(0.5)
    assert [float(c) for c in v.values] == [8.5] * n
    assert float(v.read_value()) == 8.5


@pytest.mark.parametrize("method", ["assign_add", "assign_sub"])
def test_sync_on_read_cross_replica_assign_add_with_sum_raises(
    mirrored4: ds.Strategy, method: str
) -> None:
    v = on_read(mirrored4, VA.SUM)
    with mirrored4.scope(), pytest.raises(ValueError, match=method):
        getattr(v, method)(1.0)
    assert [float(c) for c in v.values] == [0.0] * 4


def test_sync_on_read_with_none_aggregation_cannot_be_read_cross_replica(
    mirrored4: ds.Strategy,
) -> None:
    v = on_read(mirrored4, VA.NONE)
    mirrored4.run(lambda: v.assign(float(rid())))
    with pytest.raises(ValueError, match="NONE aggregation"):
        v.read_value()
    assert mirrored4.run(lambda: float(v.read_value())).values == (0.0, 1.0, 2.0, 3.0)


def test_sync_on_read_with_none_aggregation_has_shape_and_accepts_cross_replica_assign(
    mirrored4: ds.Strategy,
) -> None:
    v = on_read(mirrored4, VA.NONE, torch.zeros(3))
    assert v.shape == (3,) and v.dtype == torch.float32 and v.numel() == 3
    with mirrored4.scope():
        v.assign(torch.ones(3))
    assert components(v) == [[1.0, 1.0, 1.0]] * 4


def test_sync_on_read_components_are_separate_under_central_storage(
    central4: ds.Strategy,
) -> None:
    v = on_read(central4, VA.SUM)
    assert len({c.data_ptr() for c in v.values}) == 4
    central4.run(lambda: v.assign_add(1.0))
    assert float(v.read_value()) == 4.0


# -- extended.update ------------------------------------------------------------------------------


def test_extended_update_applies_fn_to_every_component_without_dividing(
    mirrored4: ds.Strategy,
) -> None:
    with mirrored4.scope():
        mirrored_var = ds.Variable(torch.zeros(2), aggregation=VA.SUM)
        sync_var = ds.Variable(torch.zeros(2), synchronization=VS.ON_READ, aggregation=VA.SUM)
    for var in (mirrored_var, sync_var):
        result = mirrored4.extended.update(var, lambda c, x: c.add_(x), args=(torch.ones(2),))
        assert isinstance(result, ds.Mirrored)
        assert components(var) == [[1.0, 1.0]] * 4, "x added to every component, not x / N"
    assert float(sync_var.read_value().sum()) == 8.0


def test_extended_update_gives_each_component_its_per_replica_argument(
    mirrored4: ds.Strategy,
) -> None:
    with mirrored4.scope():
        v = ds.Variable(torch.zeros(()))
    deltas = ds.PerReplica([torch.tensor(float(i)) for i in range(4)])
    ungrouped = mirrored4.extended.update(
        v, lambda c, d: float(c.add_(d)), args=(deltas,), group=False
    )
    assert ungrouped == (0.0, 1.0, 2.0, 3.0)


def test_extended_update_on_central_storage_updates_the_one_copy_once(
    central4: ds.Strategy,
) -> None:
    with central4.scope():
        v = ds.Variable(torch.zeros(()))
    central4.extended.update(v, lambda c: c.add_(1.0))
    assert [float(c) for c in v.values] == [1.0] * 4


def test_extended_update_of_a_foreign_tensor_raises(mirrored4: ds.Strategy) -> None:
    with pytest.raises(ValueError, match="update"):
        mirrored4.extended.update(torch.zeros(1), lambda c: c)  # type: ignore[arg-type]


# -- state_dict, copies, pickling ---------------------------------------------------------------


def test_state_dict_holds_plain_tensors_and_round_trips(strategy: ds.Strategy) -> None:
    torch.manual_seed(0)
    with strategy.scope():
        net = make_net()
    state = net.state_dict()
    assert all(type(t) is torch.Tensor for t in state.values())
    saved = {k: t.clone() for k, t in state.items()}

    torch.manual_seed(1)
    other = make_net()
    with torch.no_grad():
        other[1].running_mean.fill_(0.25)
        other[1].num_batches_tracked.fill_(7)
    net.load_state_dict(other.state_dict())
    for name, var in list(net.named_parameters()) + list(net.named_buffers()):
        expected = dict(other.named_parameters(), **dict(other.named_buffers()))[name]
        assert isinstance(var, ds.MirroredVariable), f"{name} must stay distributed"
        for c in var.values:
            assert torch.equal(c, expected.detach()), name
    # ... and every replica computes with the loaded values.
    x = torch.randn(4, 3)
    net.eval()
    other.eval()
    outs = strategy.experimental_local_results(strategy.run(lambda: net(x)))
    for out in outs:
        torch.testing.assert_close(out, other(x).detach(), rtol=0, atol=0)

    net.load_state_dict(saved)
    for name, t in net.state_dict().items():
        assert torch.equal(t, saved[name])


def test_torch_save_of_a_state_dict_round_trips(mirrored4: ds.Strategy) -> None:
    with mirrored4.scope():
        net = make_net()
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    plain = make_net()
    plain.load_state_dict(loaded)
    for (name, a), b in zip(net.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_deepcopy_of_a_module_built_in_scope_gives_plain_parameters(
    mirrored4: ds.Strategy,
) -> None:
    with mirrored4.scope():
        net = make_net()
    clone = copy.deepcopy(net)
    assert type(clone[0].weight) is torch.nn.Parameter
    assert type(clone[1].running_mean) is torch.Tensor
    assert torch.equal(clone[0].weight, net[0].weight.values[0])


def test_pickling_a_module_built_in_scope_keeps_nn_parameters(mirrored4: ds.Strategy) -> None:
    with mirrored4.scope():
        net = make_net()
    buffer = io.BytesIO()
    torch.save(net, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert all(type(p) is torch.nn.Parameter for p in loaded.parameters())


# -- training with torch.optim ---------------------------------------------------------------------

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def train_steps(
    strategy: ds.Strategy, opt: str, model_fn: Callable[[], torch.nn.Module], steps: int = 3
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with strategy.scope():
        model = model_fn()
        optimizer = OPTIMIZERS[opt](model.parameters())
    n = strategy.num_replicas_in_sync
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        # Different data on every replica, so only gradient aggregation keeps copies equal.
        xs = ds.PerReplica([torch.randn(4, 3, generator=g) * (i + 1) for i in range(n)])

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = ds.compute_average_loss(model(x).pow(2).sum(dim=1), global_batch_size=4 * n)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        strategy.run(step, args=(xs,))
    return model, optimizer


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_training_keeps_every_copy_bitwise_identical(strategy: ds.Strategy, opt: str) -> None:
    torch.manual_seed(0)
    initial = [p.detach().clone() for p in mlp().parameters()]
    model, _ = train_steps(strategy, opt, mlp)
    for p, before in zip(model.parameters(), initial):
        assert isinstance(p, ds.MirroredVariable)
        assert_copies_identical(p)
        assert not torch.equal(p.values[0], before), "training must have moved the parameters"


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_optimizer_state_is_kept_per_replica_and_identical(
    mirrored4: ds.Strategy, opt: str
) -> None:
    model, optimizer = train_steps(mirrored4, opt, mlp)
    key = "momentum_buffer" if opt == "sgd_momentum" else "exp_avg"
    weight = model[0].weight

    def state() -> tuple[int, torch.Tensor]:
        s = optimizer.state[weight]
        return s[key].data_ptr(), s[key].clone()

    ptrs, values = mirrored4.run(state)
    assert len(set(ptrs.values)) == 4, "each replica keeps its own optimizer state"
    for v in values.values[1:]:
        assert torch.equal(v, values.values[0])
    assert torch.equal(optimizer.state[weight][key], values.values[0])  # cross-replica: replica 0


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_batchnorm_parameters_stay_identical_under_training(
    mirrored4: ds.Strategy, opt: str
) -> None:
    model, _ = train_steps(mirrored4, opt, make_net)
    for p in model.parameters():
        assert_copies_identical(p)
    assert [int(c) for c in model[1].num_batches_tracked.values] == [3] * 4


def expected_running_stats(
    shards: list[torch.Tensor], momentum: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over replicas of what each replica's BatchNorm computes from its own shard."""
    means, variances = [], []
    for shard in shards:
        means.append(momentum * shard.mean(dim=0))
        variances.append((1 - momentum) * torch.ones(shard.shape[1]) + momentum * shard.var(dim=0))
    return torch.stack(means).mean(dim=0), torch.stack(variances).mean(dim=0)


def test_batchnorm_running_statistics_are_averaged_across_replicas(
    mirrored4: ds.Strategy,
) -> None:
    with mirrored4.scope():
        bn = torch.nn.BatchNorm1d(2)
    shards = [torch.tensor([[0.0, 1.0], [2.0, 5.0]]) * (i + 1) for i in range(4)]
    mirrored4.run(lambda x: bn(x), args=(ds.PerReplica(shards),))
    mean, var = expected_running_stats(shards)
    for c in bn.running_mean.values:
        torch.testing.assert_close(c, mean)
    for c in bn.running_var.values:
        torch.testing.assert_close(c, var)
    assert [int(c) for c in bn.num_batches_tracked.values] == [1] * 4


def test_batchnorm_buffers_under_central_storage_count_each_step_once(
    central4: ds.Strategy,
) -> None:
    with central4.scope():
        bn = torch.nn.BatchNorm1d(2)
    shards = [torch.tensor([[0.0, 1.0], [2.0, 5.0]]) * (i + 1) for i in range(4)]
    central4.run(lambda x: bn(x), args=(ds.PerReplica(shards),))
    assert [int(c) for c in bn.num_batches_tracked.values] == [1] * 4
    mean, _ = expected_running_stats(shards)
    torch.testing.assert_close(bn.running_mean.values[0], mean)


def test_gradient_accumulation_with_no_sync_matches_one_big_step(strategy: ds.Strategy) -> None:
    n = strategy.num_replicas_in_sync
    x = torch.randn(4 * n, 3, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    (reference(x).pow(2).sum() / x.shape[0]).backward()
    ref_opt.step()

    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    chunks = x.chunk(2 * n)

    def accumulate(xb: torch.Tensor) -> None:
        (model(xb).pow(2).sum() / x.shape[0]).backward()

    def finish(xb: torch.Tensor) -> None:
        accumulate(xb)
        optimizer.step()
        optimizer.zero_grad()

    with strategy.extended.no_sync():  # type: ignore[attr-defined]
        strategy.run(accumulate, args=(ds.PerReplica(chunks[:n]),))
    strategy.run(finish, args=(ds.PerReplica(chunks[n:]),))
    for p, ref in zip(model.parameters(), reference.parameters()):
        assert_copies_identical(p)
        torch.testing.assert_close(p.values[0], ref.detach(), rtol=0, atol=1e-6)


def test_aggregation_off_lets_the_user_all_reduce_gradients(strategy: ds.Strategy) -> None:
    n = strategy.num_replicas_in_sync
    x = torch.randn(4 * n, 3, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    (reference(x).pow(2).sum() / x.shape[0]).backward()
    ref_opt.step()

    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    strategy.extended.experimental_aggregate_gradients = False  # type: ignore[attr-defined]
    seen: list[torch.Tensor] = []

    def step(xb: torch.Tensor) -> None:
        (model(xb).pow(2).sum() / x.shape[0]).backward()
        params = list(model.parameters())
        replica_ctx = ds.get_replica_context()
        assert replica_ctx is not None
        summed = replica_ctx.all_reduce("sum", [p.grad for p in params])
        for p, g in zip(params, summed):
            p.grad = g
        optimizer.step()
        seen.append(params[1].grad.clone())  # type: ignore[union-attr]
        optimizer.zero_grad()

    strategy.run(step, args=(ds.PerReplica(x.chunk(n)),))
    for p, ref in zip(model.parameters(), reference.parameters()):
        assert_copies_identical(p)
        torch.testing.assert_close(p.values[0], ref.detach(), rtol=0, atol=1e-6)
    # Not summed twice: the library left the user's all-reduced gradient alone.
    torch.testing.assert_close(seen[0], reference.bias.grad, rtol=0, atol=1e-6)
