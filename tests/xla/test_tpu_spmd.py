"""TPUStrategy in SPMD mode: one program over a (data, model) mesh of 4 XLA devices.

Run in its own process (``-m spmd``): torch_xla's SPMD mode is process-wide.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla", reason="needs torch_xla (the XLA lane: .ci/xla)")

from typing import Any

import numpy as np
import torch
import torch_xla
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
    loader,
    recompilation_warnings,
    train,
    train_in_executions,
    validated_fit_history,
    written_once,
)

import distribute as ds
from distribute.collectives import xla

pytestmark = pytest.mark.spmd


def _sharding(t: torch.Tensor) -> str:
    return str(torch_xla._XLAC._get_xla_sharding_spec(t))


@pytest.fixture(scope="module")
def strategy() -> ds.TPUStrategy:
    return ds.TPUStrategy(experimental_spmd_xla_partitioning=True)


def test_fn_runs_once_over_the_global_batch_sharded_on_the_data_axis(
    strategy: ds.TPUStrategy,
) -> None:
    assert strategy.spmd and strategy.num_replicas_in_sync == 4
    x = torch.arange(32.0).reshape(16, 2)
    calls = []

    def fn(batch: torch.Tensor) -> torch.Tensor:
        calls.append((tuple(batch.shape), _sharding(batch)))
        return batch * 2

    (batch,) = list(strategy.experimental_distribute_dataset([x]))
    out = strategy.run(fn, args=(batch,))
    assert calls == [((16, 2), "{devices=[4,1]0,1,2,3}")]
    assert torch.equal(out.cpu(), x * 2)


def test_returned_values_are_global(strategy: ds.TPUStrategy) -> None:
    x = torch.arange(12.0).reshape(12, 1)
    (batch,) = list(strategy.experimental_distribute_dataset([x]))
    per_example = strategy.run(lambda b: b[:, 0], args=(batch,))
    assert strategy.experimental_local_results(per_example)[0] is per_example
    assert torch.equal(strategy.gather(per_example, axis=0).cpu(), x[:, 0])
    assert float(strategy.reduce("sum", per_example, axis=0)) == float(x.sum())
    assert float(strategy.reduce("mean", per_example, axis=0)) == float(x.mean())
    total = strategy.run(lambda b: b.sum(), args=(batch,))
    assert float(strategy.reduce("sum", total, axis=None)) == float(x.sum())


def test_compute_average_loss_divides_by_the_global_batch(strategy: ds.TPUStrategy) -> None:
    (batch,) = list(strategy.experimental_distribute_dataset([torch.ones(GLOBAL_BATCH, 1)]))
    out = strategy.run(lambda b: ds.compute_average_loss(b.sum(dim=1)), args=(batch,))
    assert float(out) == pytest.approx(1.0)
    reg = strategy.run(lambda: ds.scale_regularization_loss(torch.tensor(3.0)))
    assert float(reg) == pytest.approx(3.0)  # one program: not divided by 4


def test_datasets_from_function_concatenate_the_replicas_batches(
    strategy: ds.TPUStrategy,
) -> None:
    contexts = []

    def dataset_fn(ctx: ds.InputContext) -> list[torch.Tensor]:
        contexts.append((ctx.num_replicas_in_sync, ctx.get_per_replica_batch_size(8)))
        return [torch.full((2, 1), float(k)) for k in range(10)]

    batches = [b.cpu() for b in strategy.distribute_datasets_from_function(dataset_fn)]
    assert contexts == [(4, 2)]
    assert [b.shape[0] for b in batches] == [8, 8, 4]  # 10 per-replica batches: 4 + 4 + 2
    assert batches[0][:, 0].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert batches[2][:, 0].tolist() == [8, 8, 9, 9]


def test_training_matches_cpu_and_compiles_once_per_input_shape(
    strategy: ds.TPUStrategy,
) -> None:
    x, y = data()
    counts: list[int] = []
    got = train(strategy, x, y, on_step=lambda i: counts.append(xla.compile_count()))
    assert_close_to_reference(got, cpu_reference(x, y))
    assert counts[18] == counts[2], counts  # full batches reuse the graph
    assert counts[19] - counts[18] <= 2, counts  # the partial batch: its own shape


def test_logical_devices_are_sharding_annotations() -> None:
    topology = ds.tpu.initialize_tpu_system(ds.cluster_resolver.TPUClusterResolver())
    assignment = ds.tpu.DeviceAssignment.build(topology, [1, 1, 1, 2], num_replicas=2)
    strategy = ds.TPUStrategy(
        experimental_device_assignment=assignment, experimental_spmd_xla_partitioning=True
    )
    assert strategy.num_replicas_in_sync == 2
    w = torch.ones(4, 6, device="xla:0")
    # Split 2 ways along dim 1 inside each replica, the same on both replicas: part 0
    # on each replica's logical core 0 (devices 0 and 2), part 1 on core 1 (1 and 3).
    split = strategy.experimental_split_to_logical_devices(w, [1, 2])
    assert _sharding(split) == "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}"
    v = strategy.experimental_replicate_to_logical_devices(torch.ones(3, device="xla:0"))
    assert _sharding(v) == "{replicated}"
    with pytest.raises(ValueError, match="not supported in SPMD mode"):
        strategy.experimental_assign_to_logical_device(w, 0)
    with pytest.raises(ValueError, match="product of partition_dimensions"):
        strategy.experimental_split_to_logical_devices(w, [1, 1])
    x = torch.arange(16.0).reshape(4, 4)
    (batch,) = list(strategy.experimental_distribute_dataset([x]))
    out = strategy.run(
        lambda b: strategy.experimental_split_to_logical_devices(b @ b, [1, 2]).sum(dim=1),
        args=(batch,),
    )
    assert torch.equal(out.cpu(), (x @ x).sum(dim=1))


def test_an_assignment_that_leaves_devices_out_is_refused_under_spmd() -> None:
    topology = ds.tpu.initialize_tpu_system()
    assignment = ds.tpu.DeviceAssignment.build(topology, [1, 1, 1, 2], num_replicas=1)
    with pytest.raises(ValueError, match="covers 1 replica"):
        ds.TPUStrategy(
            experimental_device_assignment=assignment, experimental_spmd_xla_partitioning=True
        )


def test_replica_mode_is_refused_in_a_process_already_in_spmd_mode(
    strategy: ds.TPUStrategy,
) -> None:
    with pytest.raises(ValueError, match="already runs torch_xla in SPMD mode"):
        ds.TPUStrategy()


def test_fit_matches_fit_under_the_default_strategy(strategy: ds.TPUStrategy) -> None:
    """Shuffled epochs (each its own order) and a partial last batch, as on the CPU; the
    partial batch is padded with weight-0 rows, so it runs the graph already compiled."""
    compiles: list[int] = []
    assert_same_history(fit_history(strategy, compiles), fit_history(ds.get_strategy()))
    assert len(compiles) == 10 and compiles[9] == compiles[8], compiles


def test_a_long_loader_loop_compiles_nothing_after_its_first_steps(
    strategy: ds.TPUStrategy,
) -> None:
    """Batches are placed in the stepping thread: placed in another one, a batch half
    way through its transfer was cut into a step's graph (new compiles, wrong weights)."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(256 * 25, 64, generator=g), torch.randint(0, 10, (256 * 25,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=256)
    torch.manual_seed(0)
    reference = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )
    with strategy.scope():
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
        )
        model.load_state_dict(reference.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    counts = []
    for _ in range(3):
        for batch in strategy.experimental_distribute_dataset(loader):
            strategy.run(step, args=batch)
            counts.append(xla.compile_count())
    for xb, yb in list(loader) * 3:
        torch.nn.functional.cross_entropy(reference(xb), yb).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert counts[-1] == counts[2], counts
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.detach().cpu(), want.detach(), atol=1e-4, rtol=0)


# -- placement (issue #22): written once, the same numbers as on the CPU ------------------


def test_the_same_seed_gives_the_default_strategy_s_initial_weights(
    strategy: ds.TPUStrategy,
) -> None:
    want = initial_weights(ds.get_strategy())
    got = initial_weights(strategy)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_training_written_once_matches_the_default_strategy(strategy: ds.TPUStrategy) -> None:
    assert_same_weights(written_once(strategy), written_once(ds.get_strategy()))


def test_plain_host_tensors_reach_the_program_s_device(strategy: ds.TPUStrategy) -> None:
    with strategy.scope():
        layer = torch.nn.Linear(5, 2)
    out = strategy.run(lambda x: layer(x), args=(torch.ones(4, 5),))
    assert out.device.type == "xla"
    host = torch.ones(4, 6)
    split = strategy.experimental_split_to_logical_devices(host, [1, 1])
    replicated = strategy.experimental_replicate_to_logical_devices(host)
    for placed in (split, replicated):
        assert placed.device.type == "xla" and torch.equal(placed.cpu(), host)


# -- ds.Model under TPUStrategy (issue #30) -----------------------------------------------

#: XLA executions in an epoch of 10 steps: one program per step, or per execution of
#: 4, 4 and 2 steps.
EXECUTIONS_PER_EPOCH = {1: FIT_STEPS, 4: 3}

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
def test_steps_per_execution_steps_run_as_one_xla_execution(
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


def test_one_execution_runs_a_custom_loop_s_steps_as_one_xla_execution(
    strategy: ds.TPUStrategy,
) -> None:
    x, y = data()
    got, runs = train_in_executions(strategy, x, y, every=8)
    assert_close_to_reference(got, cpu_reference_of_width(x, y, hidden=24))
    assert runs == 3, runs  # 8, 8 and 4 steps


# -- layout_map: the ModelParallelStrategy's LayoutMap, annotated for GSPMD ---------------


def _two_by_two() -> ds.tpu.DeviceAssignment:
    topology = ds.tpu.initialize_tpu_system(ds.cluster_resolver.TPUClusterResolver())
    return ds.tpu.DeviceAssignment.build(topology, [1, 1, 1, 2], num_replicas=2)


def _layout_map(
    shape: tuple[int, int] = (2, 2), names: tuple[str, str] = ("data", "model")
) -> ds.experimental.LayoutMap:
    layout_map = ds.experimental.LayoutMap(ds.experimental.DeviceMesh(shape, names))
    if names == ("data", "model"):
        layout_map[r"^0\.weight$"] = ("model", None)  # torch Linear weight: (out, in)
        layout_map[r"^2\.weight$"] = (None, "model")
    return layout_map


def _laid_out_strategy(layout_map: ds.experimental.LayoutMap | None = None) -> ds.TPUStrategy:
    return ds.TPUStrategy(
        experimental_device_assignment=_two_by_two(),
        experimental_spmd_xla_partitioning=True,
        layout_map=_layout_map() if layout_map is None else layout_map,
    )


def _layout_mlp() -> torch.nn.Sequential:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


#: Split 2 ways along the "model" axis (each replica's 2 cores: devices 0, 2 hold part
#: 0 and 1, 3 part 1), whole along "data".
_ROWS_SPLIT = "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"
_COLS_SPLIT = "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}"


def _layout_train(strategy: ds.Strategy, steps: int = 4) -> tuple[list[float], dict[str, Any]]:
    x, y = data(steps * GLOBAL_BATCH)  # 8 features, 3 classes (of the 4 outputs)
    with strategy.scope():
        model = _layout_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    losses = [
        float(strategy.reduce("sum", strategy.run(step, args=batch), axis=None))
        for batch in strategy.experimental_distribute_dataset(loader(x, y))
    ]
    specs = {name: _sharding(p) for name, p in model.named_parameters() if p.device.type == "xla"}
    return losses, {"specs": specs, **{k: v.detach().cpu() for k, v in model.state_dict().items()}}


def test_a_layout_map_shards_the_mapped_variables_and_replicates_the_others() -> None:
    strategy = _laid_out_strategy()
    with strategy.scope():
        model = _layout_mlp()
        free = ds.Variable(torch.ones(3))
    assert _sharding(model[0].weight) == _ROWS_SPLIT
    assert _sharding(model[2].weight) == _COLS_SPLIT
    unmapped: list[torch.Tensor] = [model[0].bias, model[2].bias, free]
    for tensor in unmapped:
        assert _sharding(tensor) == "{replicated}"
    torch.manual_seed(5)
    for got, want in zip(model.parameters(), _layout_mlp().parameters()):
        assert torch.equal(got.detach().cpu(), want.detach())


def test_training_with_a_layout_map_matches_the_default_strategy() -> None:
    got_losses, got = _layout_train(_laid_out_strategy())
    want_losses, want = _layout_train(ds.get_strategy())
    np.testing.assert_allclose(got_losses, want_losses, atol=1e-5, rtol=0)
    specs = got.pop("specs")
    want.pop("specs")
    assert specs["0.weight"] == _ROWS_SPLIT and specs["2.weight"] == _COLS_SPLIT  # kept
    assert_same_weights(got, want)


def test_layout_map_misuse_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="needs SPMD mode"):
        ds.TPUStrategy(layout_map=_layout_map())
    with pytest.raises(ValueError, match=r"axis_names=\('batch', 'model'\).*\('data', 'model'\)"):
        _laid_out_strategy(_layout_map(names=("batch", "model")))
    with pytest.raises(ValueError, match=r"shape=\(1, 4\).*shape=\(2, 2\)"):
        _laid_out_strategy(_layout_map(shape=(1, 4)))
    wrong_rank = _layout_map()
    wrong_rank[r"^0\.bias$"] = ("model", None)
    strategy = _laid_out_strategy(wrong_rank)
    with pytest.raises(ValueError, match=r"'0\.bias' is \('model', None\), with 2 entries"):
        with strategy.scope():
            _layout_mlp()
    with pytest.raises(ValueError, match="names axis 'rows'"):
        _layout_map()[r"^2\.bias$"] = ("rows",)


# -- the recompilation warning (issue #36) ------------------------------------------------


def test_a_step_whose_shapes_follow_the_data_is_warned_of_once(
    strategy: ds.TPUStrategy,
) -> None:
    check_data_dependent_loop_warned_once(strategy)


def test_fit_whose_shapes_follow_the_data_is_warned_of_after_the_first_epoch(
    strategy: ds.TPUStrategy,
) -> None:
    check_data_dependent_fit_warned_after_the_first_epoch(strategy, steps_per_execution=4)


def test_clean_loops_and_fit_give_no_recompilation_warning(strategy: ds.TPUStrategy) -> None:
    check_clean_runs_not_warned(strategy)


# -- evaluate and predict in executions of steps_per_execution (issue #40) ---------------

#: evaluate's and predict's XLA executions over 10 steps: one per steps_per_execution
#: steps (4, 4 and 2 for 4), as in fit's epochs.
INFERENCE_EXECUTIONS = {1: FIT_STEPS, 4: 3}
#: Graphs each one's first call compiles: the step's; the executions of 4 and of 2 steps.
INFERENCE_COMPILES = {1: 1, 4: 2}


@pytest.mark.parametrize("every", [1, 4])
def test_evaluate_and_predict_give_the_numbers_of_one_step_per_execution(
    strategy: ds.TPUStrategy, every: int
) -> None:
    """The same loss, accuracy and predictions (the padded last batch's extra rows
    dropped) as under the default strategy, and as with one step per execution."""
    got = counted_inference_run(strategy, every)
    assert_same_inference(got, inference_run(ds.get_strategy(), every, hidden=26))
    assert_same_inference(got, counted_inference_run(strategy, 1))


@pytest.mark.parametrize("every", [1, 4])
def test_evaluate_and_predict_run_steps_per_execution_steps_as_one_xla_execution(
    strategy: ds.TPUStrategy, every: int
) -> None:
    """One execution per group of steps, the short last group included; the second
    calls compile nothing."""
    counts = counted_inference_run(strategy, every)["counts"]
    runs, compiles = INFERENCE_EXECUTIONS[every], INFERENCE_COMPILES[every]
    assert counts == {
        "evaluate": [(compiles, runs), (0, runs)],
        "predict": [(compiles, runs), (0, runs)],
    }


def test_evaluate_and_predict_call_batch_hooks_every_steps_per_execution_steps(
    strategy: ds.TPUStrategy,
) -> None:
    """Keras's rule, as fit's: a group's first step begins, its last ends, with the
    logs of that step (read after the execution); still one execution per group."""
    got, want = InferenceBatchCalls(), InferenceBatchCalls()
    counts = inference_run(strategy, 4, got)["counts"]
    inference_run(ds.get_strategy(), 4, want)
    assert got.calls == want.calls == INFERENCE_CALLS_EVERY_4 * 2
    np.testing.assert_allclose(got.losses, want.losses, atol=1e-5, rtol=0)
    assert [runs for kind in ("evaluate", "predict") for _, runs in counts[kind]] == [3] * 4


def test_fit_s_validation_in_executions_matches_the_default_strategy_unwarned(
    strategy: ds.TPUStrategy,
) -> None:
    """fit's validation runs evaluate's executions every epoch: the same val_loss and
    val_accuracy as the default strategy, and no recompilation warning."""
    got: dict[str, Any] = {}
    warned = recompilation_warnings(lambda: got.update(validated_fit_history(strategy, 4)))
    assert warned == []
    want = validated_fit_history(ds.get_strategy(), 4)
    assert got["val_accuracy"] == want["val_accuracy"]
    np.testing.assert_allclose(got["val_loss"], want["val_loss"], atol=1e-5, rtol=0)
    assert_same_history(got, want)
