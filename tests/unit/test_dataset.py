"""Distributed datasets: splitting, uneven ends, nests, NumPy, epochs, iterators, sharding.

Multi-worker sharding is exercised without a process group: W `DistributedDataset`
objects are built directly from `InputWorkers(worker_index=w, num_workers=W,
sum_across_workers=...)`, where the sum is a real cross-thread sum, and iterated in
W threads.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import distribute as ds
from distribute.data import (
    AutoShardPolicy,
    DistributedDataset,
    InputOptions,
    InputReplicationMode,
    InputWorkers,
    TensorSpec,
)

Point = collections.namedtuple("Point", ["x", "y"])


def mirrored(n: int) -> ds.Strategy:
    return ds.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def local_lists(strategy: ds.Strategy, step: Any) -> list[list[Any]]:
    """One replica's batch as a list, for every local replica."""
    return [t.tolist() for t in strategy.experimental_local_results(step)]


def epoch_lists(strategy: ds.Strategy, dist: Any) -> list[list[list[Any]]]:
    return [local_lists(strategy, step) for step in dist]


# -- splitting a global batch -------------------------------------------------------------


def test_range_100_in_batches_of_10_over_2_replicas_gives_halves():
    strategy = mirrored(2)
    dist = strategy.experimental_distribute_dataset(DataLoader(range(100), batch_size=10))
    steps = epoch_lists(strategy, dist)
    assert len(steps) == 10
    for k, (first, second) in enumerate(steps):
        assert first == list(range(10 * k, 10 * k + 5))
        assert second == list(range(10 * k + 5, 10 * k + 10))


def test_each_step_is_a_per_replica_with_one_component_per_replica():
    strategy = mirrored(2)
    step = next(iter(strategy.experimental_distribute_dataset(DataLoader(range(10), batch_size=4))))
    assert isinstance(step, ds.PerReplica)
    assert len(step.values) == 2


def test_seven_elements_over_four_replicas_gives_2_2_2_1_each_element_once():
    strategy = mirrored(4)
    dist = strategy.experimental_distribute_dataset(DataLoader(range(7), batch_size=7))
    (step,) = epoch_lists(strategy, dist)
    assert [len(x) for x in step] == [2, 2, 2, 1]
    assert sorted(e for x in step for e in x) == list(range(7))


def test_uneven_last_batch_ends_with_remainder_and_empty_batch():
    strategy = mirrored(2)
    dist = strategy.experimental_distribute_dataset(DataLoader(torch.arange(9), batch_size=4))
    steps = [strategy.experimental_local_results(s) for s in dist]
    assert [[t.tolist() for t in s] for s in steps] == [
        [[0, 1], [2, 3]],
        [[4, 5], [6, 7]],
        [[8], []],
    ]
    empty = steps[-1][1]
    assert empty.shape == (0,)
    assert empty.dtype == torch.int64


def test_uneven_last_batch_of_2d_features_keeps_feature_dim_and_dtype():
    strategy = mirrored(2)
    features = torch.arange(27, dtype=torch.float64).reshape(9, 3)
    loader = DataLoader(TensorDataset(features, torch.arange(9)), batch_size=4)
    *_, last = strategy.experimental_distribute_dataset(loader)
    x0, x1 = strategy.experimental_local_results(last[0])
    y0, y1 = strategy.experimental_local_results(last[1])
    assert y0.tolist() == [8]
    assert x0.shape == (1, 3) and torch.equal(x0, features[8:])
    assert x1.shape == (0, 3) and x1.dtype == torch.float64
    assert y1.shape == (0,) and y1.dtype == torch.int64


def test_fewer_elements_than_replicas_give_empty_batches_to_the_rest():
    strategy = mirrored(4)
    (step,) = epoch_lists(strategy, strategy.experimental_distribute_dataset([torch.arange(2)]))
    assert step == [[0], [1], [], []]


def test_every_element_reaches_exactly_one_replica_per_epoch_with_partial_batches():
    strategy = mirrored(3)
    dist = strategy.experimental_distribute_dataset(DataLoader(range(23), batch_size=5))
    seen = [e for step in epoch_lists(strategy, dist) for x in step for e in x]
    assert sorted(seen) == list(range(23))


def test_one_replica_strategies_yield_plain_unsplit_batches():
    for strategy in (ds.OneDeviceStrategy("cpu"), ds.get_strategy(), mirrored(1)):
        steps = list(strategy.experimental_distribute_dataset(DataLoader(range(5), batch_size=2)))
        assert all(isinstance(s, torch.Tensor) for s in steps)
        assert [s.tolist() for s in steps] == [[0, 1], [2, 3], [4]]


def test_distributed_batches_feed_strategy_run():
    strategy = mirrored(2)
    dist = strategy.experimental_distribute_dataset(DataLoader(torch.arange(10.0), batch_size=4))
    total = 0.0
    for step in dist:
        sums = strategy.run(lambda x: x.sum(), args=(step,))
        total += float(strategy.reduce("sum", sums, axis=None))
    assert total == 45.0


# -- nests ----------------------------------------------------------------------------


def nested_batch(kind: str, start: int) -> Any:
    x = torch.arange(start, start + 4)
    y = torch.arange(start, start + 4).reshape(4, 1).float()
    return {
        "tuple": (x, y),
        "list": [x, y],
        "dict": {"features": y, "label": x},
        "namedtuple": Point(x, y),
        "deep": {"a": (x, [y]), "b": Point(x=x, y={"z": y})},
    }[kind]


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "namedtuple", "deep"])
def test_nested_batches_keep_structure_with_per_replica_leaves(kind):
    strategy = mirrored(2)
    batch = nested_batch(kind, 0)
    step = next(iter(strategy.experimental_distribute_dataset([batch])))
    assert type(step) is type(batch)
    leaves, originals = ds.values.flatten(step), ds.values.flatten(batch)
    assert len(leaves) == len(originals)
    for leaf, original in zip(leaves, originals):
        assert isinstance(leaf, ds.PerReplica)
        first, second = leaf.values
        assert torch.equal(first, original[:2]) and torch.equal(second, original[2:])


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "namedtuple", "deep"])
@pytest.mark.parametrize("make", [lambda: ds.OneDeviceStrategy("cpu"), ds.get_strategy])
def test_nested_batches_with_one_replica_have_plain_leaves(kind, make):
    strategy = make()
    batch = nested_batch(kind, 0)
    step = next(iter(strategy.experimental_distribute_dataset([batch])))
    assert type(step) is type(batch)
    for leaf, original in zip(ds.values.flatten(step), ds.values.flatten(batch)):
        assert isinstance(leaf, torch.Tensor)
        assert torch.equal(leaf, original)


def test_non_tensor_leaves_are_shared_by_the_replicas_not_wrapped():
    strategy = mirrored(2)
    step = next(iter(strategy.experimental_distribute_dataset([(torch.arange(4), "tag")])))
    assert step[1] == "tag"
    assert local_lists(strategy, step[0]) == [[0, 1], [2, 3]]


def test_dict_items_from_a_dataloader_are_split_per_key():
    class Records(Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": torch.full((2,), float(i)), "id": torch.tensor(i)}

    strategy = mirrored(2)
    step = next(iter(strategy.experimental_distribute_dataset(DataLoader(Records(), batch_size=6))))
    assert set(step) == {"x", "id"}
    assert local_lists(strategy, step["id"]) == [[0, 1, 2], [3, 4, 5]]
    assert [t.shape for t in step["x"].values] == [(3, 2), (3, 2)]


def test_batches_whose_leaves_disagree_on_batch_size_raise_value_error():
    strategy = mirrored(2)
    dist = strategy.experimental_distribute_dataset([(torch.zeros(4), torch.zeros(3))])
    with pytest.raises(ValueError, match=r"\[3, 4\]"):
        next(iter(dist))


# -- NumPy input ------------------------------------------------------------------------


def test_make_numpy_dataset_tuple_of_arrays_splits_like_tensors():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10)
    strategy = mirrored(2)
    loader = ds.data.make_numpy_dataset((x, y), batch_size=4)
    steps = list(strategy.experimental_distribute_dataset(loader))
    assert len(steps) == 3
    xs, ys = steps[0]
    assert isinstance(xs.values[0], torch.Tensor)
    assert xs.values[0].dtype == torch.float32 and xs.values[0].shape == (2, 2)
    assert local_lists(strategy, ys) == [[0, 1], [2, 3]]
    assert local_lists(strategy, steps[-1][1]) == [[8], [9]]


def test_make_numpy_dataset_dict_of_arrays_keeps_keys():
    arrays = {"a": np.arange(6), "b": np.ones((6, 3), dtype=np.float64)}
    loader = ds.data.make_numpy_dataset(arrays, batch_size=6)
    (step,) = list(mirrored(2).experimental_distribute_dataset(loader))
    assert set(step) == {"a", "b"}
    assert [t.tolist() for t in step["a"].values] == [[0, 1, 2], [3, 4, 5]]
    assert step["b"].values[1].shape == (3, 3) and step["b"].values[1].dtype == torch.float64


def numpy_epochs(seed: int, epochs: int = 3) -> list[list[int]]:
    strategy = mirrored(2)
    loader = ds.data.make_numpy_dataset(np.arange(40), batch_size=8, shuffle=True, seed=seed)
    dist = strategy.experimental_distribute_dataset(loader)
    return [
        [e for step in dist for t in strategy.experimental_local_results(step) for e in t.tolist()]
        for _ in range(epochs)
    ]


def test_make_numpy_dataset_shuffle_is_a_permutation_distinct_per_epoch_same_per_seed():
    first_run, second_run = numpy_epochs(seed=5), numpy_epochs(seed=5)
    assert first_run == second_run
    assert all(sorted(epoch) == list(range(40)) for epoch in first_run)
    assert len({tuple(epoch) for epoch in first_run}) == 3
    assert first_run[0] != list(range(40))
    assert numpy_epochs(seed=6)[0] != first_run[0]


def test_make_numpy_dataset_rejects_arrays_of_different_lengths():
    with pytest.raises(ValueError, match=r"\[3, 4\]"):
        ds.data.make_numpy_dataset((np.zeros(3), np.zeros(4)), batch_size=2)


def test_iterable_of_numpy_batches_yields_tensors():
    batches = [(np.arange(4, dtype=np.int32), np.ones((4, 2))) for _ in range(2)]
    strategy = mirrored(2)
    steps = list(strategy.experimental_distribute_dataset(batches))
    x, y = steps[0]
    assert all(isinstance(t, torch.Tensor) for t in x.values + y.values)
    assert x.values[1].dtype == torch.int32 and x.values[1].tolist() == [2, 3]
    assert y.values[0].shape == (2, 2) and y.values[0].dtype == torch.float64


def test_single_numpy_batches_with_one_replica_become_tensors():
    (step,) = list(ds.OneDeviceStrategy("cpu").experimental_distribute_dataset([np.arange(3)]))
    assert isinstance(step, torch.Tensor) and step.tolist() == [0, 1, 2]


# -- input errors -----------------------------------------------------------------------


def test_per_replica_mode_in_experimental_distribute_dataset_raises_value_error():
    options = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    with pytest.raises(ValueError, match="distribute_datasets_from_function"):
        mirrored(2).experimental_distribute_dataset(DataLoader(range(4), batch_size=2), options)


def test_a_torch_dataset_instead_of_a_dataloader_raises_value_error_with_hint():
    with pytest.raises(ValueError, match=r"TensorDataset.*DataLoader\(dataset, batch_size="):
        mirrored(2).experimental_distribute_dataset(TensorDataset(torch.zeros(4)))


@pytest.mark.parametrize("data", [torch.zeros(4), np.zeros(4), 7])
def test_a_tensor_array_or_non_iterable_raises_value_error_with_hint(data):
    with pytest.raises(ValueError, match="make_numpy_dataset"):
        mirrored(2).experimental_distribute_dataset(data)


def test_batch_without_a_batch_dimension_raises_value_error():
    dist = mirrored(2).experimental_distribute_dataset([torch.tensor(3.0)])
    with pytest.raises(ValueError, match="batch dimension"):
        next(iter(dist))


def test_leaves_of_different_batch_sizes_raise_naming_the_sizes_and_iteration_goes_on():
    batches = [(torch.zeros(4), torch.zeros(3)), (torch.arange(4), torch.arange(4))]
    it = iter(mirrored(2).experimental_distribute_dataset(batches))
    with pytest.raises(ValueError, match=r"first \(batch\) dimension.*\[3, 4\]"):
        next(it)
    assert [t.tolist() for t in next(it)[1].values] == [[0, 1], [2, 3]]
    with pytest.raises(StopIteration):
        next(it)


def test_dataset_fn_returning_a_non_iterable_raises_value_error():
    with pytest.raises(ValueError, match=r"iterable.*int"):
        mirrored(2).distribute_datasets_from_function(lambda ctx: 3)


# -- distribute_datasets_from_function --------------------------------------------------


def test_per_replica_mode_calls_dataset_fn_once_per_replica_with_its_context():
    calls: list[ds.InputContext] = []

    def dataset_fn(ctx: ds.InputContext) -> list[torch.Tensor]:
        calls.append(ctx)
        return [torch.full((2,), 10 * ctx.input_pipeline_id + k) for k in range(2)]

    strategy = mirrored(3)
    options = InputOptions(experimental_replication_mode="PER_REPLICA")
    dist = strategy.distribute_datasets_from_function(dataset_fn, options)
    assert calls == [ds.InputContext(3, r, 3) for r in range(3)]
    steps = epoch_lists(strategy, dist)
    assert steps == [[[0, 0], [10, 10], [20, 20]], [[1, 1], [11, 11], [21, 21]]]


def test_per_replica_mode_gives_empty_batches_to_replicas_whose_pipeline_ended():
    def dataset_fn(ctx: ds.InputContext) -> list[torch.Tensor]:
        n = 3 if ctx.input_pipeline_id == 0 else 1
        return [torch.ones(2, 5) * k for k in range(n)]

    strategy = mirrored(2)
    options = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    steps = [
        strategy.experimental_local_results(s)
        for s in strategy.distribute_datasets_from_function(dataset_fn, options)
    ]
    assert len(steps) == 3
    assert [tuple(t.shape) for s in steps for t in s] == [
        (2, 5),
        (2, 5),
        (2, 5),
        (0, 5),
        (2, 5),
        (0, 5),
    ]


def test_per_worker_mode_calls_dataset_fn_once_and_deals_elements_to_consecutive_replicas():
    calls: list[ds.InputContext] = []

    def dataset_fn(ctx: ds.InputContext) -> list[torch.Tensor]:
        calls.append(ctx)
        return [torch.tensor([k]) for k in range(5)]

    strategy = mirrored(2)
    dist = strategy.distribute_datasets_from_function(dataset_fn)
    assert calls == [
        ds.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=2)
    ]
    assert epoch_lists(strategy, dist) == [[[0], [1]], [[2], [3]], [[4], []]]


def test_per_replica_pipelines_with_different_structures_raise_value_error():
    def dataset_fn(ctx: ds.InputContext) -> list[Any]:
        if ctx.input_pipeline_id == 0:
            return [(torch.ones(2), torch.ones(2))]
        return [torch.ones(2)]

    options = InputOptions(experimental_replication_mode="PER_REPLICA")
    dist = mirrored(2).distribute_datasets_from_function(dataset_fn, options)
    with pytest.raises(ValueError, match="replica 0 and replica 1"):
        next(iter(dist))


def test_datasets_from_function_do_not_rebatch():
    def dataset_fn(ctx: ds.InputContext) -> DataLoader:
        return DataLoader(range(12), batch_size=ctx.get_per_replica_batch_size(6))

    strategy = mirrored(2)
    steps = epoch_lists(strategy, strategy.distribute_datasets_from_function(dataset_fn))
    assert steps == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]]]


def test_datasets_from_function_with_one_replica_yield_plain_batches():
    dist = ds.OneDeviceStrategy("cpu").distribute_datasets_from_function(
        lambda ctx: [torch.arange(3), torch.arange(2)]
    )
    assert [t.tolist() for t in dist] == [[0, 1, 2], [0, 1]]


def test_datasets_from_function_set_the_epoch_of_their_samplers():
    data = list(range(8))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    dist = ds.OneDeviceStrategy("cpu").distribute_datasets_from_function(
        lambda ctx: DataLoader(data, batch_size=4, sampler=sampler)
    )
    for epoch in range(3):
        list(dist)
        assert sampler.epoch == epoch


# -- epochs -----------------------------------------------------------------------------


def shuffled_epochs(seed: int, epochs: int = 3) -> list[list[int]]:
    strategy = mirrored(2)
    loader = DataLoader(
        range(24), batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    dist = strategy.experimental_distribute_dataset(loader)
    return [
        [e for step in epoch_lists(strategy, dist) for x in step for e in x] for _ in range(epochs)
    ]


def test_reiterating_a_shuffled_loader_reshuffles_each_epoch():
    epochs = shuffled_epochs(seed=1)
    assert all(sorted(epoch) == list(range(24)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3


def test_same_seed_gives_same_epoch_orders_on_a_rerun():
    assert shuffled_epochs(seed=11) == shuffled_epochs(seed=11)
    assert shuffled_epochs(seed=11)[0] != shuffled_epochs(seed=12)[0]


def test_distributed_sampler_gets_set_epoch_automatically():
    data = list(range(16))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    strategy = mirrored(2)
    dist = strategy.experimental_distribute_dataset(DataLoader(data, batch_size=4, sampler=sampler))
    orders = []
    for epoch in range(3):
        orders.append([e for step in epoch_lists(strategy, dist) for x in step for e in x])
        assert sampler.epoch == epoch
    assert len({tuple(o) for o in orders}) == 3


class EpochAware:
    """An iterable of batches that records the epochs it was told about."""

    def __init__(self) -> None:
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([torch.arange(4)])


def test_iterables_with_set_epoch_are_told_each_new_epoch():
    source = EpochAware()
    dist = mirrored(2).experimental_distribute_dataset(source)
    for _ in range(3):
        list(dist)
    assert source.epochs == [0, 1, 2]


# -- iterators --------------------------------------------------------------------------


def test_get_next_returns_steps_then_raises_stop_iteration():
    strategy = mirrored(2)
    it = iter(strategy.experimental_distribute_dataset(DataLoader(range(6), batch_size=3)))
    assert local_lists(strategy, it.get_next()) == [[0, 1], [2]]
    assert local_lists(strategy, it.get_next()) == [[3, 4], [5]]
    with pytest.raises(StopIteration):
        it.get_next()


def test_get_next_as_optional_has_value_until_the_end():
    strategy = mirrored(2)
    it = iter(strategy.experimental_distribute_dataset(DataLoader(range(3), batch_size=3)))
    optional = it.get_next_as_optional()
    assert optional.has_value()
    assert local_lists(strategy, optional.get_value()) == [[0, 1], [2]]
    end = it.get_next_as_optional()
    assert not end.has_value()
    with pytest.raises(ValueError, match="has_value"):
        end.get_value()


def test_iterator_stays_exhausted_for_all_replicas_together():
    strategy = mirrored(4)
    it = iter(strategy.experimental_distribute_dataset(DataLoader(range(5), batch_size=5)))
    assert [len(x) for x in local_lists(strategy, next(it))] == [2, 1, 1, 1]
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)
        assert not it.get_next_as_optional().has_value()


def test_next_inside_strategy_run_raises_value_error():
    strategy = mirrored(2)
    it = iter(strategy.experimental_distribute_dataset(DataLoader(range(8), batch_size=4)))
    with pytest.raises(ValueError, match="inside a replica function"):
        strategy.run(lambda: next(it))


def test_get_next_inside_run_of_one_replica_strategy_raises_value_error():
    strategy = ds.OneDeviceStrategy("cpu")
    it = iter(strategy.experimental_distribute_dataset([torch.arange(2)]))
    with pytest.raises(ValueError, match="cross-replica context"):
        strategy.run(it.get_next)


def test_each_iter_call_starts_an_independent_iterator():
    strategy = mirrored(2)
    dist = strategy.experimental_distribute_dataset(DataLoader(range(8), batch_size=4))
    first = iter(dist)
    next(first)
    assert local_lists(strategy, next(iter(dist))) == [[0, 1], [2, 3]]


# -- element_spec -----------------------------------------------------------------------


def features_loader(n: int, batch_size: int, drop_last: bool = False) -> DataLoader:
    x = torch.zeros(n, 3, dtype=torch.float16)
    y = torch.zeros(n, dtype=torch.int32)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, drop_last=drop_last)


def test_element_spec_has_unknown_batch_dim_when_partial_batches_are_possible():
    dist = mirrored(2).experimental_distribute_dataset(features_loader(10, 4))
    assert dist.element_spec == [
        TensorSpec((None, 3), torch.float16),
        TensorSpec((None,), torch.int32),
    ]


def test_element_spec_has_fixed_batch_dim_with_drop_last_and_divisible_batch():
    dist = mirrored(2).experimental_distribute_dataset(features_loader(10, 4, drop_last=True))
    assert dist.element_spec == [TensorSpec((2, 3), torch.float16), TensorSpec((2,), torch.int32)]


def test_element_spec_batch_dim_unknown_with_drop_last_but_indivisible_batch():
    dist = mirrored(4).experimental_distribute_dataset(features_loader(12, 6, drop_last=True))
    assert dist.element_spec[0].shape == (None, 3)


def test_iterator_element_spec_matches_dataset_element_spec():
    dist = mirrored(2).experimental_distribute_dataset(features_loader(10, 4))
    it = iter(dist)
    next(it)
    assert it.element_spec == dist.element_spec


@pytest.mark.parametrize("replicas", [1, 2])
def test_iterator_element_spec_is_the_first_steps_even_from_a_one_shot_stream(replicas):
    def batches() -> Iterator[Any]:
        for k in range(4):
            yield torch.zeros(4, 3 + k), [f"s{k}"] * 4

    dist = mirrored(replicas).experimental_distribute_dataset(batches())
    it = iter(dist)
    next(it)
    spec = it.element_spec
    # A per-example list of strings is split like the tensors; its spec is its type.
    assert spec == (TensorSpec((None, 3), torch.float32), list)
    assert len(list(it)) == 3  # reading the spec took no batch from the stream
    assert it.element_spec == spec  # and it is still there once the stream has ended


def test_element_spec_of_a_dict_nest():
    dist = mirrored(2).experimental_distribute_dataset(
        [{"a": torch.zeros(4, 2), "b": torch.ones(4)}]
    )
    assert dist.element_spec == {
        "a": TensorSpec((None, 2), torch.float32),
        "b": TensorSpec((None,), torch.float32),
    }


def test_datasets_from_function_have_the_pipelines_element_spec():
    strategy = mirrored(2)
    dist = strategy.distribute_datasets_from_function(lambda ctx: features_loader(8, 2))
    assert dist.element_spec == [
        TensorSpec((None, 3), torch.float16),
        TensorSpec((None,), torch.int32),
    ]
    fixed = strategy.distribute_datasets_from_function(
        lambda ctx: features_loader(8, 2, drop_last=True)
    )
    assert fixed.element_spec[0] == TensorSpec((2, 3), torch.float16)
    assert [t.shape[0] for t in next(iter(fixed))[0].values] == [2, 2]  # nothing consumed


def batches_generator(n: int) -> Iterator[torch.Tensor]:
    for k in range(n):
        yield torch.arange(4 * k, 4 * k + 4)


def test_element_spec_of_a_generator_loses_no_batch():
    strategy = mirrored(2)
    dist = strategy.experimental_distribute_dataset(batches_generator(3))
    assert dist.element_spec == TensorSpec((None,), torch.int64)
    it = iter(dist)
    assert it.element_spec == TensorSpec((None,), torch.int64)
    assert local_lists(strategy, next(it)) == [[0, 1], [2, 3]]
    assert dist.element_spec == TensorSpec((None,), torch.int64)  # peeked mid-epoch
    assert [local_lists(strategy, s) for s in it] == [[[4, 5], [6, 7]], [[8, 9], [10, 11]]]


def test_iterator_element_spec_of_a_generator_pipeline_loses_no_batch():
    strategy = mirrored(2)
    dist = strategy.distribute_datasets_from_function(lambda ctx: batches_generator(2))
    it = iter(dist)
    assert it.element_spec == TensorSpec((None,), torch.int64)
    assert [local_lists(strategy, s) for s in it] == [[[0, 1, 2, 3], [4, 5, 6, 7]]]


# -- prefetch and device placement ------------------------------------------------------


def test_fetch_to_device_false_keeps_host_tensors_and_data_unchanged():
    strategy = mirrored(2)
    loader = DataLoader(torch.arange(10.0), batch_size=4)
    options = InputOptions(experimental_fetch_to_device=False)
    on_host = epoch_lists(strategy, strategy.experimental_distribute_dataset(loader, options))
    assert on_host == epoch_lists(strategy, strategy.experimental_distribute_dataset(loader))
    step = next(iter(strategy.experimental_distribute_dataset(loader, options)))
    assert all(t.device.type == "cpu" for t in step.values)


def test_fetch_to_device_moves_batches_to_each_replicas_device_and_false_does_not():
    # The meta device stands in for an accelerator: moving there is observable on a CPU host.
    workers = InputWorkers(devices=("meta", "meta"))
    batches = [(torch.arange(4.0), torch.ones(4, 2))]
    moved = next(iter(DistributedDataset(batches, workers)))
    kept = next(
        iter(DistributedDataset(batches, workers, InputOptions(experimental_fetch_to_device=False)))
    )
    assert all(t.device.type == "meta" for leaf in moved for t in leaf.values)
    assert all(t.device.type == "cpu" for leaf in kept for t in leaf.values)
    assert [tuple(t.shape) for t in moved[1].values] == [(2, 2), (2, 2)]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_fetch_to_device_copies_each_replicas_batch_to_cuda_with_same_values():
    workers = InputWorkers(devices=("cuda:0", "cuda:0"))
    loader = DataLoader(TensorDataset(torch.randn(10, 3), torch.arange(10)), batch_size=4)
    host = [[leaf.tolist() for leaf in step] for step in loader]
    steps = list(
        DistributedDataset(loader, workers, InputOptions(experimental_per_replica_buffer_size=3))
    )
    torch.cuda.synchronize()
    assert all(t.is_cuda for step in steps for leaf in step for t in leaf.values)
    merged = [torch.cat([t.cpu() for t in leaf.values]).tolist() for step in steps for leaf in step]
    assert merged == [leaf for step in host for leaf in step]
    assert [len(t) for t in steps[-1][1].values] == [1, 1]  # 10 = 4 + 4 + 2


@needs_cuda
def test_fetch_to_device_false_keeps_batches_on_the_host_with_cuda_replicas():
    workers = InputWorkers(devices=("cuda:0", "cuda:0"))
    options = InputOptions(experimental_fetch_to_device=False)
    (step,) = list(DistributedDataset([torch.arange(4)], workers, options))
    assert [t.device.type for t in step.values] == ["cpu", "cpu"]


@needs_cuda
def test_pinned_loader_batches_reach_cuda_intact():
    workers = InputWorkers(devices=("cuda:0",) * 4)
    loader = DataLoader(torch.arange(4096.0), batch_size=1024, pin_memory=True)
    total = sum(float(t.sum()) for step in DistributedDataset(loader, workers) for t in step.values)
    assert total == float(torch.arange(4096.0).sum())


class CountingBatches:
    """Global batches that count how many have been read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.read = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        for k in range(self.n):
            self.read += 1
            yield torch.arange(4 * k, 4 * k + 4)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_per_replica_buffer_size_is_how_many_steps_are_copied_ahead(depth):
    # The meta device stands in for an accelerator: batches are copied there.
    source = CountingBatches(10)
    options = InputOptions(experimental_per_replica_buffer_size=depth)
    it = iter(DistributedDataset(source, InputWorkers(devices=("meta", "meta")), options))
    next(it)
    assert source.read == 1 + depth


@pytest.mark.parametrize("depth", [0, 3])
def test_cpu_replicas_read_no_batch_ahead(depth):
    # Nothing to copy: reading ahead would only hold batches longer.
    source = CountingBatches(10)
    options = InputOptions(experimental_per_replica_buffer_size=depth)
    it = iter(mirrored(2).experimental_distribute_dataset(source, options))
    next(it)
    assert source.read == 1


def test_pieces_are_views_of_the_batch_that_autograd_tracks():
    data = torch.zeros(4, 2)
    (step,) = DistributedDataset([data], InputWorkers(devices=("cpu", "cpu")))
    step.values[1].fill_(1.0)
    assert data.tolist() == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]

    # The batch changed in place after a piece was saved for backward: an error, as
    # in plain PyTorch, not a silently wrong gradient.
    data = torch.ones(4)
    w = torch.ones((), requires_grad=True)
    (step,) = DistributedDataset([data], InputWorkers(devices=("cpu", "cpu")))
    loss = (w * step.values[0]).sum()
    data.mul_(10)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()

    leaf = torch.arange(4.0, requires_grad=True)
    (step,) = DistributedDataset([[leaf * 1]], InputWorkers(devices=("cpu", "cpu")))
    (step[0].values[0] * 2 + step[0].values[1] * 3).sum().backward()
    assert leaf.grad is not None and leaf.grad.tolist() == [2.0, 2.0, 3.0, 3.0]


def test_an_ended_iterator_stays_ended_with_persistent_loader_workers():
    # Persistent workers hand every iter(loader) the same underlying iterator: an
    # old, ended iterator must not take the next epoch's batches.
    loader = DataLoader(torch.arange(8), batch_size=4, num_workers=1, persistent_workers=True)
    dist = mirrored(2).experimental_distribute_dataset(loader)
    first = iter(dist)
    assert len(list(first)) == 2
    second = iter(dist)
    with pytest.raises(StopIteration):
        next(first)
    assert not first.get_next_as_optional().has_value()
    assert [local_lists(mirrored(2), step) for step in second] == [
        [[0, 1], [2, 3]],
        [[4, 5], [6, 7]],
    ]


@pytest.mark.timeout(30)
def test_buffer_sizes_0_and_3_give_identical_data():
    # Two workers (in threads) take the read-ahead path even on CPU replicas.
    def body(w: int, workers: InputWorkers) -> list[Any]:
        loader = DataLoader(torch.arange(50), batch_size=7)
        return [
            [
                [t.tolist() for t in step.values]
                for step in DistributedDataset(
                    loader, workers, InputOptions(experimental_per_replica_buffer_size=depth)
                )
            ]
            for depth in (0, 3)
        ]

    results = run_workers(2, 2, body)
    assert all(by_depth[0] == by_depth[1] for by_depth in results)
    delivered = sorted(x for by_depth in results for step in by_depth[0] for t in step for x in t)
    assert delivered == list(range(50))


# -- multi-worker sharding, one thread per worker ----------------------------------------


class ThreadSummer:
    """Sums one int per worker thread: a real cross-worker all-reduce, in threads."""

    def __init__(self, num_workers: int) -> None:
        self.barrier = threading.Barrier(num_workers, timeout=10)
        self.values = [0] * num_workers
        self.calls = [0] * num_workers
        self.blobs = [b""] * num_workers
        self.gathers = [0] * num_workers

    def gather_for(self, w: int) -> Callable[[bytes], list[bytes]]:
        def gather_across_workers(data: bytes) -> list[bytes]:
            self.gathers[w] += 1
            self.blobs[w] = data
            self.barrier.wait()
            everything = list(self.blobs)
            self.barrier.wait()
            return everything

        return gather_across_workers

    def for_worker(self, w: int) -> Callable[[int], int]:
        def sum_across_workers(n: int) -> int:
            self.calls[w] += 1
            self.values[w] = n
            self.barrier.wait()
            total = sum(self.values)
            self.barrier.wait()  # nobody overwrites values before all have read them
            return total

        return sum_across_workers


def run_workers(
    num_workers: int,
    local_replicas: int,
    body: Callable[[int, InputWorkers], Any],
    summer: ThreadSummer | None = None,
) -> list[Any]:
    """Runs ``body(w, input_workers)`` in one thread per worker; returns the results."""
    summer = ThreadSummer(num_workers) if summer is None else summer
    results: list[Any] = [None] * num_workers
    errors: list[BaseException] = []

    def target(w: int) -> None:
        workers = InputWorkers(
            devices=(torch.device("cpu"),) * local_replicas,
            worker_index=w,
            num_workers=num_workers,
            sum_across_workers=summer.for_worker(w),
            gather_across_workers=summer.gather_for(w),
        )
        try:
            results[w] = body(w, workers)
        except BaseException as e:
            errors.append(e)
            summer.barrier.abort()  # the other workers fail fast instead of hanging

    threads = [threading.Thread(target=target, args=(w,)) for w in range(num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    if errors:
        raise errors[0]
    return results


def as_lists(step: Any, local_replicas: int) -> list[list[Any]]:
    values = step.values if isinstance(step, ds.PerReplica) else (step,)
    assert len(values) == local_replicas
    return [t.tolist() for t in values]


def distribute_epochs(
    make_data: Callable[[int], Any],
    num_workers: int,
    local_replicas: int,
    *,
    epochs: int = 1,
    policy: AutoShardPolicy = AutoShardPolicy.AUTO,
) -> list[list[list[list[list[Any]]]]]:
    """``result[worker][epoch][step][local replica]`` = that replica's batch as a list."""

    def body(w: int, workers: InputWorkers) -> Any:
        dist = DistributedDataset(make_data(w), workers, InputOptions(auto_shard_policy=policy))
        return [[as_lists(step, local_replicas) for step in dist] for _ in range(epochs)]

    return run_workers(num_workers, local_replicas, body)


def by_global_replica(result: Sequence[Any], epoch: int = 0) -> list[list[list[Any]]]:
    """``[step][global replica]`` from per-worker results (steps must agree)."""
    steps = {len(r[epoch]) for r in result}
    assert len(steps) == 1, f"workers stopped at different steps: {steps}"
    return [[batch for worker in result for batch in worker[epoch][k]] for k in range(steps.pop())]


class RecordingDataset(Dataset):
    """A map-style dataset of ints that records the indices it is asked for."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.asked: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.asked.append(i)
        return i


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("num_workers", "local_replicas", "n", "batch"),
    [(2, 2, 20, 8), (3, 1, 10, 4), (2, 1, 9, 8), (4, 2, 37, 16)],
)
def test_data_sharding_matches_one_worker_with_all_replicas(num_workers, local_replicas, n, batch):
    datasets = [RecordingDataset(n) for _ in range(num_workers)]
    result = distribute_epochs(
        lambda w: DataLoader(datasets[w], batch_size=batch), num_workers, local_replicas
    )
    strategy = mirrored(num_workers * local_replicas)
    expected = epoch_lists(
        strategy, strategy.experimental_distribute_dataset(DataLoader(range(n), batch_size=batch))
    )
    assert by_global_replica(result) == expected


@pytest.mark.timeout(30)
def test_data_sharding_reads_only_each_workers_own_indices():
    n, batch, num_workers = 20, 8, 2
    datasets = [RecordingDataset(n) for _ in range(num_workers)]
    result = distribute_epochs(lambda w: DataLoader(datasets[w], batch_size=batch), num_workers, 2)
    for w in range(num_workers):
        delivered = [e for step in result[w][0] for x in step for e in x]
        assert sorted(datasets[w].asked) == sorted(delivered)
    assert datasets[0].asked == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17]
    assert datasets[1].asked == [4, 5, 6, 7, 12, 13, 14, 15, 18, 19]


@pytest.mark.timeout(30)
def test_shuffled_loader_has_one_global_order_each_element_once_per_epoch():
    n, num_workers = 30, 3
    datasets = [RecordingDataset(n) for _ in range(num_workers)]

    def make(w: int) -> DataLoader:
        # Different seeds per worker: the workers must still agree on worker 0's order.
        return DataLoader(
            datasets[w],
            batch_size=8,
            shuffle=True,
            generator=torch.Generator().manual_seed(100 + w),
        )

    result = distribute_epochs(make, num_workers, 2, epochs=2)
    orders = []
    for epoch in range(2):
        order = [e for step in by_global_replica(result, epoch) for x in step for e in x]
        assert sorted(order) == list(range(n))
        orders.append(order)
    assert orders[0] != orders[1]
    assert orders[0] != list(range(n))
    for w in range(num_workers):  # no wasted reads: each worker read only what it delivered
        delivered = [e for epoch in result[w] for step in epoch for x in step for e in x]
        assert sorted(datasets[w].asked) == sorted(delivered)


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def test_a_sharded_iterable_dataset_pickles_for_spawned_loader_workers():
    import pickle

    # The cross-worker hook is a closure (not picklable); the sharded dataset that
    # DataLoader worker processes receive must not carry it.
    workers = InputWorkers(
        devices=("cpu",), worker_index=1, num_workers=3, sum_across_workers=lambda n: n
    )
    dist = DistributedDataset(DataLoader(Stream(10), batch_size=4), workers)
    clone = pickle.loads(pickle.dumps(dist._source.iterable.dataset))
    assert [b.tolist() for b in clone] == [[2], [6], [9]]


@pytest.mark.timeout(30)
def test_iterable_dataset_is_sharded_by_element():
    result = distribute_epochs(lambda w: DataLoader(Stream(10), batch_size=4), 3, 1)
    assert [r[0] for r in result] == [
        [[[0, 1]], [[4, 5]], [[8]]],
        [[[2]], [[6]], [[9]]],
        [[[3]], [[7]], [[]]],
    ]
    strategy = mirrored(3)
    expected = epoch_lists(
        strategy, strategy.experimental_distribute_dataset(DataLoader(Stream(10), batch_size=4))
    )
    assert by_global_replica(result) == expected


class FileLines(IterableDataset):
    """A FILE-shardable dataset: file ``k`` holds the elements ``10k, 10k+1, 10k+2``."""

    def __init__(self, files: Sequence[int], opened: list[Sequence[int]] | None = None) -> None:
        self.files = list(files)
        self.opened = opened if opened is not None else []

    def with_files(self, files: Sequence[int]) -> FileLines:
        self.opened.append(list(files))
        return FileLines(files, self.opened)

    def __iter__(self) -> Iterator[int]:
        for f in self.files:
            yield from range(10 * f, 10 * f + 3)


def test_file_lines_is_recognised_as_file_shardable():
    assert isinstance(FileLines([0]), ds.data.FileShardable)


@pytest.mark.timeout(30)
def test_file_sharding_gives_each_worker_every_num_workers_th_file():
    datasets = [FileLines(range(5)) for _ in range(2)]
    result = distribute_epochs(
        lambda w: DataLoader(datasets[w], batch_size=4), 2, 1, policy=AutoShardPolicy.FILE
    )
    assert [d.opened for d in datasets] == [[[0, 2, 4]], [[1, 3]]]
    # split_sizes(4, 2) = [2, 2]: each worker batches its own files two at a time.
    assert result[0][0] == [[[0, 1]], [[2, 20]], [[21, 22]], [[40, 41]], [[42]]]
    # Worker 1 runs out after 3 steps and gets empty batches until worker 0 is done.
    assert result[1][0] == [[[10, 11]], [[12, 30]], [[31, 32]], [[]], [[]]]


@pytest.mark.timeout(30)
def test_auto_policy_prefers_file_sharding_when_there_are_files_enough():
    datasets = [FileLines(range(4)) for _ in range(2)]
    distribute_epochs(lambda w: DataLoader(datasets[w], batch_size=4), 2, 1)
    assert [d.opened for d in datasets] == [[[0, 2]], [[1, 3]]]


def test_file_sharding_with_fewer_files_than_workers_names_the_counts():
    workers = InputWorkers(devices=("cpu",), worker_index=0, num_workers=3)
    options = InputOptions(auto_shard_policy=AutoShardPolicy.FILE)
    with pytest.raises(ValueError, match="2 files for 3 workers"):
        DistributedDataset(DataLoader(FileLines(range(2)), batch_size=4), workers, options)


@pytest.mark.timeout(30)
def test_auto_policy_with_fewer_files_than_workers_falls_back_to_data_sharding():
    datasets = [FileLines(range(2)) for _ in range(3)]
    result = distribute_epochs(lambda w: DataLoader(datasets[w], batch_size=3), 3, 1)
    assert all(d.opened == [] for d in datasets)
    elements = sorted(e for r in result for step in r[0] for x in step for e in x)
    assert elements == [0, 1, 2, 10, 11, 12]
    assert [r[0][0] for r in result] == [[[0]], [[1]], [[2]]]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["loader", "iterable"])
def test_off_policy_gives_every_worker_all_the_data(kind):
    def make(w: int) -> Any:
        if kind == "loader":
            return DataLoader(range(10), batch_size=4)
        return [torch.arange(k, min(k + 4, 10)) for k in range(0, 10, 4)]

    result = distribute_epochs(make, 2, 2, policy=AutoShardPolicy.OFF)
    for r in result:
        assert sorted(e for step in r[0] for x in step for e in x) == list(range(10))


@pytest.mark.timeout(30)
def test_generic_iterables_of_global_batches_are_sliced_per_worker():
    batches = [torch.arange(k, min(k + 6, 15)) for k in range(0, 15, 6)]
    result = distribute_epochs(lambda w: batches, 3, 1)
    strategy = mirrored(3)
    assert by_global_replica(result) == epoch_lists(
        strategy, strategy.experimental_distribute_dataset(batches)
    )


@pytest.mark.timeout(30)
def test_workers_whose_data_ran_out_get_empty_per_replica_batches_then_all_stop_together():
    # 9 elements in batches of 8 over 2 workers x 2 replicas: the last global batch
    # holds one element, so worker 1 has nothing left at step 2.
    result = distribute_epochs(lambda w: DataLoader(torch.arange(9), batch_size=8), 2, 2, epochs=2)
    for epoch in range(2):
        assert result[0][epoch] == [[[0, 1], [2, 3]], [[8], []]]
        assert result[1][epoch] == [[[4, 5], [6, 7]], [[], []]]


@pytest.mark.timeout(30)
def test_uneven_workers_with_off_policy_stop_at_the_longest_workers_last_step():
    lengths = [4, 1, 2]

    def make(w: int) -> list[torch.Tensor]:
        return [torch.full((3, 3), float(w)) for _ in range(lengths[w])]

    def body(w: int, workers: InputWorkers) -> Any:
        dist = DistributedDataset(make(w), workers, InputOptions(auto_shard_policy="OFF"))
        return [tuple(t.shape) for t in dist]

    shapes = run_workers(3, 1, body)
    # OFF: each worker's global batches of 3 are split over the 3 replicas in sync,
    # and each worker steps through all of them, one replica's share per step.
    assert shapes == [
        [(1, 3)] * 12,
        [(1, 3)] * 3 + [(0, 3)] * 9,
        [(1, 3)] * 6 + [(0, 3)] * 6,
    ]


@pytest.mark.timeout(30)
def test_off_policy_gives_each_replica_a_global_batch_share_as_in_tf():
    # 8 elements in global batches of 4 over 2 workers x 2 replicas: a replica's batch
    # is 4 / 4 = 1 element, and every worker walks the whole stream of those.
    result = distribute_epochs(
        lambda w: DataLoader(torch.arange(8), batch_size=4), 2, 2, policy=AutoShardPolicy.OFF
    )
    expected = [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]]]
    assert result[0][0] == result[1][0] == expected


@pytest.mark.timeout(30)
def test_end_of_data_needs_no_collective_per_step_when_every_loader_knows_its_length():
    summer = ThreadSummer(2)

    def body(w: int, workers: InputWorkers) -> int:
        dist = DistributedDataset(DataLoader(range(12), batch_size=4), workers)
        return len(list(dist))

    assert run_workers(2, 1, body, summer=summer) == [3, 3]
    assert summer.gathers == [1, 1]  # the epoch's step counts, exchanged once
    assert summer.calls == [2, 2]  # the datasets' lengths compared once, then the end


def test_end_of_data_agreement_is_one_sum_per_step_when_lengths_are_unknown():
    summer = ThreadSummer(2)

    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(12))

    def body(w: int, workers: InputWorkers) -> int:
        dist = DistributedDataset(DataLoader(Stream(), batch_size=4), workers)
        return len(list(dist))

    assert run_workers(2, 1, body, summer=summer) == [3, 3]
    assert summer.gathers == [1, 1]  # asks once whether every worker knows its length
    assert summer.calls == [4, 4]  # 3 steps + the end


def test_a_loader_shorter_than_its_len_raises_instead_of_desynchronizing_workers():
    class Short(torch.utils.data.DistributedSampler[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(list(super().__iter__())[:2])  # len() still says 6

    def body(w: int, workers: InputWorkers) -> int:
        data = list(range(12))
        sampler_type = Short if w == 1 else torch.utils.data.DistributedSampler
        sampler = sampler_type(data, num_replicas=2, rank=w, shuffle=False)
        return len(
            list(DistributedDataset(DataLoader(data, batch_size=2, sampler=sampler), workers))
        )

    with pytest.raises(ds.errors.InvalidArgumentError, match=r"len\(\) promised at least 3"):
        run_workers(2, 1, body)


@pytest.mark.timeout(30)
def test_multi_worker_element_spec_describes_one_replicas_element():
    def body(w: int, workers: InputWorkers) -> Any:
        dist = DistributedDataset(features_loader(10, 4), workers)
        return dist.element_spec

    specs = run_workers(2, 2, body)
    assert (
        specs[0]
        == specs[1]
        == [TensorSpec((None, 3), torch.float16), TensorSpec((None,), torch.int32)]
    )


# -- resources: an ended epoch lets go of its loader --------------------------------------


def _open_descriptors() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def _two_workers_in_step() -> InputWorkers:
    """Worker 0 of 2 whose peer has the same data (its collectives: sums and gathers
    of two equal contributions), so the steps go through the agreed read-ahead path."""
    return InputWorkers(
        devices=("cpu",),
        worker_index=0,
        num_workers=2,
        sum_across_workers=lambda n: 2 * n,
        gather_across_workers=lambda data: [data, data],
    )


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="reads /proc")
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "make",
    [
        lambda loader: mirrored(2).experimental_distribute_dataset(loader),
        lambda loader: DistributedDataset(
            loader,
            _two_workers_in_step(),
            InputOptions(auto_shard_policy=AutoShardPolicy.DATA),
        ),
        lambda loader: DistributedDataset(
            loader,
            _two_workers_in_step(),
            InputOptions(auto_shard_policy=AutoShardPolicy.OFF),
        ),
    ],
    ids=["one-worker", "two-workers-data", "two-workers-off"],
)
def test_descriptors_stay_flat_over_30_epochs_of_a_loader_with_worker_processes_without_gc(
    make: Callable[[DataLoader[Any]], Any],
) -> None:
    # Each epoch's DataLoader iterator holds a worker process and its pipes (12
    # descriptors here); the ended epoch's must go when the epoch ends, not when the
    # cyclic collector runs (a closure referring to itself kept it until then).
    import gc

    loader = DataLoader(TensorDataset(torch.arange(16.0)), batch_size=4, num_workers=1)
    dist = make(loader)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        counts = []
        for _ in range(30):
            assert sum(1 for _ in dist) > 0
            counts.append(_open_descriptors())
    finally:
        if was_enabled:
            gc.enable()
    # A worker process's shutdown may still be closing a pipe when one epoch ends.
    assert max(counts[10:]) <= counts[0] + 4, counts
