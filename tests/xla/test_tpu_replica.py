"""TPUStrategy in replica mode: one replica per XLA device (4 on the CPU backend)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla", reason="needs torch_xla (the XLA lane: .ci/xla)")

import numpy as np
import torch
from _common import (
    BATCH_CALLS_EVERY_4,
    FIT_EPOCHS,
    FIT_STEPS,
    GLOBAL_BATCH,
    INFERENCE_CALLS_EVERY_4,
    BatchCalls,
    InferenceBatchCalls,
    assert_close_to_reference,
    assert_same_history,
    assert_same_inference,
    assert_same_run,
    assert_same_weights,
    check_clean_runs_not_warned,
    check_data_dependent_fit_warned_after_the_first_epoch,
    check_data_dependent_loop_warned_once,
    counted_fit_run,
    counted_inference_run,
    cpu_reference,
    cpu_reference_of_width,
    data,
    default_fit_run,
    fit_history,
    fit_run,
    inference_run,
    initial_weights,
    mlp,
    train,
    train_in_executions,
    written_once,
)

import distribute as ds
from distribute.collectives import xla

DEVICES = [torch.device(f"xla:{k}") for k in range(4)]


@pytest.fixture(scope="module")
def strategy() -> ds.TPUStrategy:
    return ds.TPUStrategy(ds.cluster_resolver.TPUClusterResolver())


def test_one_replica_per_xla_device(strategy: ds.TPUStrategy) -> None:
    assert strategy.num_replicas_in_sync == 4
    assert strategy.extended.worker_devices == tuple(DEVICES)
    out = strategy.run(lambda: ds.get_replica_context().replica_id_in_sync_group)
    assert strategy.experimental_local_results(out) == (0, 1, 2, 3)


def test_run_reduce_and_gather_across_devices(strategy: ds.TPUStrategy) -> None:
    def fn() -> torch.Tensor:
        r = ds.get_replica_context().replica_id_in_sync_group
        return torch.arange(r + 1, dtype=torch.float32, device=DEVICES[r]) + 10 * r

    out = strategy.run(fn)
    parts = [t.cpu() for t in strategy.experimental_local_results(out)]
    assert [t.device for t in strategy.experimental_local_results(out)] == DEVICES
    everything = torch.cat(parts)
    assert torch.equal(strategy.gather(out, axis=0).cpu(), everything)
    assert float(strategy.reduce("sum", out, axis=0)) == float(everything.sum())
    assert float(strategy.reduce("mean", out, axis=0)) == pytest.approx(float(everything.mean()))
    sums = strategy.run(lambda t: t.sum(), args=(out,))
    assert float(strategy.reduce("sum", sums, axis=None)) == float(everything.sum())
    means = strategy.reduce("mean", strategy.run(lambda t: t.mean(), args=(out,)), axis=None)
    assert float(means) == pytest.approx(sum(float(p.mean()) for p in parts) / 4)


def test_replica_all_reduce_inside_run(strategy: ds.TPUStrategy) -> None:
    def fn() -> torch.Tensor:
        ctx = ds.get_replica_context()
        r = ctx.replica_id_in_sync_group
        return ctx.all_reduce("sum", torch.full((2,), float(r + 1), device=DEVICES[r]))

    out = strategy.experimental_local_results(strategy.run(fn))
    assert [t.cpu().tolist() for t in out] == [[10.0, 10.0]] * 4


def test_values_from_function_are_per_replica(strategy: ds.TPUStrategy) -> None:
    out = strategy.experimental_distribute_values_from_function(
        lambda ctx: ctx.replica_id_in_sync_group * 10
    )
    assert strategy.experimental_local_results(out) == (0, 10, 20, 30)


def test_a_global_batch_is_split_over_the_devices_larger_first(strategy: ds.TPUStrategy) -> None:
    x = torch.arange(14.0).reshape(14, 1)
    (batch,) = list(strategy.experimental_distribute_dataset([x]))
    parts = strategy.experimental_local_results(batch)
    assert [p.shape[0] for p in parts] == [4, 4, 3, 3]
    assert [p.device for p in parts] == DEVICES
    assert torch.equal(torch.cat([p.cpu() for p in parts]), x)


def test_datasets_from_function_give_each_replica_its_own_batches(
    strategy: ds.TPUStrategy,
) -> None:
    seen = []

    def dataset_fn(ctx: ds.InputContext) -> list[torch.Tensor]:
        seen.append((ctx.num_replicas_in_sync, ctx.get_per_replica_batch_size(8)))
        return [torch.full((2,), float(k)) for k in range(8)]

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    first = [t.cpu().tolist() for t in strategy.experimental_local_results(next(iterator))]
    assert seen == [(4, 2)]
    assert sorted(first) == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    devices = [t.device for t in strategy.experimental_local_results(next(iterator))]
    assert devices == DEVICES


def test_training_matches_cpu_and_compiles_once_per_input_shape(
    strategy: ds.TPUStrategy,
) -> None:
    x, y = data()
    counts: list[int] = []
    got = train(strategy, x, y, on_step=lambda i: counts.append(xla.compile_count()))
    assert_close_to_reference(got, cpu_reference(x, y))
    # Steps 3-19 (full batches) reuse the compiled graphs; the partial last batch
    # (13 rows: 4, 3, 3, 3) adds at most one graph per new replica shape.
    assert counts[18] == counts[2], counts
    assert counts[19] - counts[18] <= 4, counts


def test_compute_average_loss_defaults_to_the_global_batch(strategy: ds.TPUStrategy) -> None:
    x = torch.ones(GLOBAL_BATCH, 1)
    (batch,) = list(strategy.experimental_distribute_dataset([x]))
    out = strategy.run(lambda t: ds.compute_average_loss(t.sum(dim=1)), args=(batch,))
    assert float(strategy.reduce("sum", out, axis=None)) == pytest.approx(1.0)


def test_the_seed_device_assignment_example_places_ops_on_logical_devices() -> None:
    resolver = ds.cluster_resolver.TPUClusterResolver(tpu="")
    topology = ds.tpu.initialize_tpu_system(resolver)
    device_assignment = ds.tpu.DeviceAssignment.build(
        topology, computation_shape=[1, 1, 1, 2], num_replicas=2
    )
    strategy = ds.TPUStrategy(resolver, experimental_device_assignment=device_assignment)
    assert strategy.num_replicas_in_sync == 2
    assert device_assignment.num_cores_per_replica == 2
    inputs = [torch.ones(4, 3)]
    iterator = iter(strategy.experimental_distribute_dataset(inputs))

    def step_fn(inputs: torch.Tensor) -> torch.Tensor:
        output = torch.add(inputs, inputs)
        # The add operation runs on logical device 1 of each replica.
        output = strategy.experimental_assign_to_logical_device(output, 1)
        return output * 2

    out = strategy.experimental_local_results(strategy.run(step_fn, args=(next(iterator),)))
    assert [t.device for t in out] == [torch.device("xla:1"), torch.device("xla:3")]
    assert all(torch.equal(t.cpu(), torch.full((2, 3), 4.0)) for t in out)
    with pytest.raises(ValueError, match="out of range: each replica has 2 logical device"):
        strategy.run(lambda: strategy.experimental_assign_to_logical_device(torch.ones(1), 2))


def test_split_to_logical_devices_checks_its_dimensions() -> None:
    topology = ds.tpu.initialize_tpu_system()
    assignment = ds.tpu.DeviceAssignment.build(topology, [1, 1, 1, 2], num_replicas=2)
    strategy = ds.TPUStrategy(experimental_device_assignment=assignment)
    t = torch.ones(4, 6)
    # Replica mode: a replica runs on its first core; an XLA tensor comes back as it
    # is, a host tensor on the replica's device (as `run` places a plain argument).
    on_device = t.to("xla:0")
    assert strategy.experimental_split_to_logical_devices(on_device, [1, 2]) is on_device
    assert strategy.experimental_replicate_to_logical_devices(on_device) is on_device
    placed = strategy.run(lambda: strategy.experimental_split_to_logical_devices(t, [1, 2]))
    assert [x.device.index for x in strategy.experimental_local_results(placed)] == [0, 2]
    assert torch.equal(strategy.experimental_replicate_to_logical_devices(t).cpu(), t)
    with pytest.raises(ValueError, match="has 1 entries but the tensor has rank 2"):
        strategy.experimental_split_to_logical_devices(t, [2])
    with pytest.raises(ValueError, match=r"partition_dimensions\[1\]=4 does not divide"):
        strategy.experimental_split_to_logical_devices(t, [1, 4])
    with pytest.raises(ValueError, match="product of partition_dimensions"):
        strategy.experimental_split_to_logical_devices(t, [2, 2])


def test_sync_on_read_counters_sum_and_reset_on_every_device(strategy: ds.TPUStrategy) -> None:
    with strategy.scope():
        seen = ds.Variable(
            0,
            synchronization=ds.VariableSynchronization.ON_READ,
            aggregation=ds.VariableAggregation.SUM,
        )
    for _ in range(2):
        for _ in range(2):
            strategy.run(
                lambda: seen.assign_add(
                    torch.tensor(ds.get_replica_context().replica_id_in_sync_group + 1)
                )
            )
        with strategy.scope():
            assert int(seen.read_value()) == 20
            seen.assign(0)  # every device's copy, not only those that alias by pointer
            assert [int(c.cpu()) for c in seen.values] == [0, 0, 0, 0]


def test_fit_matches_fit_under_the_default_strategy(strategy: ds.TPUStrategy) -> None:
    """Shuffled epochs (each its own order) and a partial last batch, as on the CPU; the
    partial batch is padded with weight-0 rows, so it runs the graph already compiled."""
    compiles: list[int] = []
    assert_same_history(fit_history(strategy, compiles), fit_history(ds.get_strategy()))
    assert len(compiles) == 10 and compiles[9] == compiles[8], compiles


# -- placement (issue #22): written once, the same numbers as on the CPU ------------------


def test_the_same_seed_gives_the_default_strategy_s_initial_weights(
    strategy: ds.TPUStrategy,
) -> None:
    # Parameters placed on xla:k when registered drew from XLA's generator.
    want = initial_weights(ds.get_strategy())
    got = initial_weights(strategy)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_training_written_once_matches_the_default_strategy(strategy: ds.TPUStrategy) -> None:
    assert_same_weights(written_once(strategy), written_once(ds.get_strategy()))


def test_plain_host_tensors_passed_to_run_reach_every_replica_s_device(
    strategy: ds.TPUStrategy,
) -> None:
    with strategy.scope():
        layer = torch.nn.Linear(5, 2)
    out = strategy.run(lambda x: (x.device, layer(x)), args=(torch.ones(3, 5),))
    devices = [d for d, _ in strategy.experimental_local_results(out)]
    assert devices == DEVICES


def test_a_module_built_on_the_meta_device_is_materialized_on_every_device(
    strategy: ds.TPUStrategy,
) -> None:
    reference = mlp(seed=4)
    with strategy.scope():
        with torch.device("meta"):
            model = mlp(seed=4)
        model.to_empty(device="cpu")
        model.load_state_dict(reference.state_dict())
    weight = model[0].weight
    assert isinstance(weight, ds.MirroredVariable)
    assert [t.device for t in weight.values] == DEVICES
    for t in weight.values:
        assert torch.equal(t.cpu(), reference[0].weight.detach())


def test_a_cast_after_the_scope_reaches_every_device(strategy: ds.TPUStrategy) -> None:
    with strategy.scope():
        layer = torch.nn.Linear(5, 2)
    layer.double()
    layer.to(DEVICES[0])  # where replica 0's copy already is: nothing moves
    assert [(t.device, t.dtype) for t in layer.weight.values] == [
        (d, torch.float64) for d in DEVICES
    ]
    out = strategy.run(lambda x: layer(x), args=(torch.ones(1, 5, dtype=torch.float64),))
    assert {t.dtype for t in strategy.experimental_local_results(out)} == {torch.float64}


@pytest.mark.parametrize("last", [12, 13], ids=["12_rows_one_new_shape", "13_rows_4_3_3_3"])
def test_a_partial_last_batch_compiles_one_program_per_shape_not_per_device(
    strategy: ds.TPUStrategy, last: int
) -> None:
    # 20 full batches of 16 (4 per device) and a partial one. Each new per-replica
    # shape needs the gradients' transfer and the step: 2 programs, whatever the
    # number of devices (device 0 compiled its own copies before: 7 more in all).
    x, y = data(20 * GLOBAL_BATCH + last)
    before = xla.compile_count()
    counts: list[int] = []
    train_steps = train(
        strategy, x, y, on_step=lambda i: counts.append(xla.compile_count()), hidden=16 + last
    )
    assert len(train_steps[0]) == 21
    assert counts[19] == counts[2], counts  # full batches reuse their programs
    # The full batches' programs (a width no other test uses): the first step's two,
    # and the step once momentum exists; per new shape of the last batch, two more.
    assert counts[19] - before <= 3, (before, counts)
    assert counts[20] - counts[19] <= 2, counts


# -- ds.Model under TPUStrategy (issue #30) -----------------------------------------------

#: XLA executions in an epoch of 10 steps, over the 4 devices: the gradients meet on
#: the host at every step (NOTE [host reduction]), which executes each device's graph
#: up to them, and ending the step executes the update: 2 per step and device, with
#: steps_per_execution 4 as with 1 (replica mode does not fuse steps).
EXECUTIONS_PER_EPOCH = {1: 4 * 2 * FIT_STEPS, 4: 4 * 2 * FIT_STEPS}

FIT_CASES = [("momentum", 1), ("momentum", 4), ("adam", 4)]
FIT_IDS = [f"{optimizer}-spe{every}" for optimizer, every in FIT_CASES]


@pytest.mark.parametrize(("optimizer", "every"), FIT_CASES, ids=FIT_IDS)
def test_fit_evaluate_and_predict_match_the_default_strategy(
    strategy: ds.TPUStrategy, optimizer: str, every: int
) -> None:
    """Momentum SGD (torch's) and Adam (Keras's), one or 4 steps per execution: the
    epochs' losses, accuracy, weights, evaluate and predict (host arrays, in input
    order, the padded last batch's extra rows dropped) as under the default strategy."""
    got, _ = counted_fit_run(strategy, optimizer, every)
    assert_same_run(got, default_fit_run(optimizer))


@pytest.mark.parametrize("every", [1, 4])
def test_fit_compiles_nothing_after_its_first_epoch(strategy: ds.TPUStrategy, every: int) -> None:
    _, counters = counted_fit_run(strategy, "momentum", every)
    assert counters.compiles[1:] == [0, 0], counters.compiles


@pytest.mark.parametrize("every", [1, 4])
def test_steps_per_execution_leaves_two_executions_per_step_in_replica_mode(
    strategy: ds.TPUStrategy, every: int
) -> None:
    _, counters = counted_fit_run(strategy, "momentum", every)
    assert counters.executions[1:] == [EXECUTIONS_PER_EPOCH[every]] * 2, counters.executions


def test_batch_callbacks_run_every_steps_per_execution_steps_with_the_default_logs(
    strategy: ds.TPUStrategy,
) -> None:
    got, want = BatchCalls(), BatchCalls()
    fit_run(strategy, "momentum", 4, got)
    fit_run(ds.get_strategy(), "momentum", 4, want)
    assert got.calls == want.calls == BATCH_CALLS_EVERY_4 * FIT_EPOCHS
    np.testing.assert_allclose(got.losses, want.losses, atol=1e-5, rtol=0)


def test_one_execution_leaves_each_run_its_own_steps_in_replica_mode(
    strategy: ds.TPUStrategy,
) -> None:
    x, y = data()
    got, runs = train_in_executions(strategy, x, y, every=8)
    assert_close_to_reference(got, cpu_reference_of_width(x, y, hidden=24))
    assert runs == 4 * 2 * 20, runs  # per step and device: the gradients, the update


# -- the recompilation warning (issue #36) ------------------------------------------------


def test_a_step_whose_shapes_follow_the_data_is_warned_of_once(
    strategy: ds.TPUStrategy,
) -> None:
    check_data_dependent_loop_warned_once(strategy)


def test_fit_whose_shapes_follow_the_data_is_warned_of_after_the_first_epoch(
    strategy: ds.TPUStrategy,
) -> None:
    check_data_dependent_fit_warned_after_the_first_epoch(strategy, steps_per_execution=1)


def test_clean_loops_and_fit_give_no_recompilation_warning(strategy: ds.TPUStrategy) -> None:
    check_clean_runs_not_warned(strategy)


# -- evaluate and predict with steps_per_execution (issue #40) ----------------------------

#: evaluate's and predict's XLA executions over 10 steps: each step's own, on each of
#: the 4 devices, with steps_per_execution 4 as with 1 (replica mode fuses no steps).
INFERENCE_EXECUTIONS = 4 * FIT_STEPS


@pytest.mark.parametrize("every", [1, 4])
def test_evaluate_and_predict_give_the_numbers_of_one_step_per_execution(
    strategy: ds.TPUStrategy, every: int
) -> None:
    got = counted_inference_run(strategy, every)
    assert_same_inference(got, inference_run(ds.get_strategy(), every, hidden=26))
    assert_same_inference(got, counted_inference_run(strategy, 1))


@pytest.mark.parametrize("every", [1, 4])
def test_evaluate_and_predict_leave_one_execution_per_step_and_device_in_replica_mode(
    strategy: ds.TPUStrategy, every: int
) -> None:
    counts = counted_inference_run(strategy, every)["counts"]
    for kind in ("evaluate", "predict"):
        assert [runs for _, runs in counts[kind]] == [INFERENCE_EXECUTIONS] * 2, counts
        assert counts[kind][1][0] == 0, counts  # the second call compiles nothing


def test_evaluate_and_predict_call_batch_hooks_every_steps_per_execution_steps(
    strategy: ds.TPUStrategy,
) -> None:
    got, want = InferenceBatchCalls(), InferenceBatchCalls()
    inference_run(strategy, 4, got)
    inference_run(ds.get_strategy(), 4, want)
    assert got.calls == want.calls == INFERENCE_CALLS_EVERY_4 * 2
    np.testing.assert_allclose(got.losses, want.losses, atol=1e-5, rtol=0)
