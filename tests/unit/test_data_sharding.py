"""The pure split and shard arithmetic of `distribute.data.sharding`, with hypothesis.

Properties, for 1..8 workers, 1..4 local replicas and global batches of 0..200:
sizes sum to the batch, differ by at most one (ceil first), workers' blocks tile
the batch in worker order, and an epoch simulated through these functions alone
delivers every element exactly once, to exactly one replica.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distribute.data import sharding

workers_st = st.integers(1, 8)
local_st = st.integers(1, 4)
batch_st = st.integers(0, 200)

FAST = settings(max_examples=150, deadline=None)


# -- examples from TF's rebatching rule --------------------------------------------------


def test_split_sizes_seven_over_four_is_two_two_two_one():
    assert sharding.split_sizes(7, 4) == [2, 2, 2, 1]


def test_split_sizes_ten_over_two_is_halves():
    assert sharding.split_sizes(10, 2) == [5, 5]


def test_split_sizes_fewer_elements_than_replicas_gives_zeros_last():
    assert sharding.split_sizes(1, 2) == [1, 0]
    assert sharding.split_sizes(0, 3) == [0, 0, 0]


def test_worker_replica_sizes_are_the_workers_block_of_the_global_split():
    # 7 over 2 workers x 2 replicas: [2, 2 | 2, 1]
    def sizes(w: int) -> list[int]:
        return sharding.worker_replica_sizes(7, num_workers=2, local_replicas=2, worker_index=w)

    assert sizes(0) == [2, 2]
    assert sizes(1) == [2, 1]


def test_worker_slice_of_second_worker_starts_after_first_workers_block():
    assert sharding.worker_slice(7, num_workers=2, local_replicas=2, worker_index=1) == (4, 7)
    assert sharding.worker_slice(10, num_workers=2, local_replicas=1, worker_index=1) == (5, 10)


def test_offsets_are_consecutive():
    assert sharding.offsets([2, 0, 3]) == [(0, 2), (2, 2), (2, 5)]
    assert sharding.offsets([]) == []


def test_shard_files_takes_every_num_workers_th_file():
    assert sharding.shard_files(5, num_workers=2, worker_index=1) == [1, 3]


def test_shard_files_with_fewer_files_than_workers_names_both_counts():
    with pytest.raises(ValueError, match="2 files for 3 workers"):
        sharding.shard_files(2, num_workers=3, worker_index=0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: sharding.split_sizes(4, 0), "num_replicas"),
        (lambda: sharding.split_sizes(-1, 2), "batch_size"),
        (
            lambda: sharding.worker_slice(4, num_workers=2, local_replicas=1, worker_index=2),
            "worker_index",
        ),
        (
            lambda: sharding.worker_replica_sizes(
                4, num_workers=0, local_replicas=1, worker_index=0
            ),
            "num_workers",
        ),
        (lambda: sharding.shard_files(4, num_workers=2, worker_index=-1), "worker_index"),
    ],
)
def test_bad_counts_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -- properties -------------------------------------------------------------------------


@FAST
@given(batch=batch_st, replicas=st.integers(1, 32))
def test_split_sizes_sum_to_batch_differ_by_at_most_one_ceil_first(batch, replicas):
    sizes = sharding.split_sizes(batch, replicas)
    assert len(sizes) == replicas
    assert sum(sizes) == batch
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] == -(-batch // replicas)  # ceil
    assert sizes[-1] == batch // replicas  # floor


@FAST
@given(batch=batch_st, workers=workers_st, local=local_st)
def test_worker_slices_tile_the_batch_in_worker_order(batch, workers, local):
    start = 0
    for w in range(workers):
        lo, hi = sharding.worker_slice(
            batch, num_workers=workers, local_replicas=local, worker_index=w
        )
        assert lo == start
        assert hi >= lo
        start = hi
    assert start == batch


@FAST
@given(batch=batch_st, workers=workers_st, local=local_st)
def test_worker_slice_length_agrees_with_worker_replica_sizes(batch, workers, local):
    for w in range(workers):
        lo, hi = sharding.worker_slice(
            batch, num_workers=workers, local_replicas=local, worker_index=w
        )
        sizes = sharding.worker_replica_sizes(
            batch, num_workers=workers, local_replicas=local, worker_index=w
        )
        assert len(sizes) == local
        assert hi - lo == sum(sizes)


@FAST
@given(batch=batch_st, workers=workers_st, local=local_st)
def test_worker_replica_sizes_concatenate_to_the_global_split(batch, workers, local):
    together = []
    for w in range(workers):
        together += sharding.worker_replica_sizes(
            batch, num_workers=workers, local_replicas=local, worker_index=w
        )
    assert together == sharding.split_sizes(batch, workers * local)


@FAST
@given(batch=batch_st, workers=workers_st, local=local_st)
def test_worker_replica_sizes_are_tfs_rotated_split(batch, workers, local):
    # tf.distribute: the ceil-then-floor list rotated by worker_index * local_replicas,
    # first local_replicas entries.
    n = workers * local
    base = sharding.split_sizes(batch, n)
    for w in range(workers):
        shift = w * local
        rotated = base[shift:] + base[:shift]
        assert (
            sharding.worker_replica_sizes(
                batch, num_workers=workers, local_replicas=local, worker_index=w
            )
            == rotated[:local]
        )


def simulate_epoch(num_elements: int, global_batch: int, workers: int, local: int):
    """Runs one epoch through the pure functions only.

    Returns ``{element: [(step, worker, replica), ...]}`` and the per-step sizes of
    every replica.
    """
    delivered: dict[int, list[tuple[int, int, int]]] = {}
    step_sizes: list[list[int]] = []
    for step, first in enumerate(range(0, num_elements, global_batch)):
        batch = list(range(first, min(first + global_batch, num_elements)))
        sizes_this_step: list[int] = []
        for w in range(workers):
            lo, hi = sharding.worker_slice(
                len(batch), num_workers=workers, local_replicas=local, worker_index=w
            )
            block = batch[lo:hi]
            sizes = sharding.worker_replica_sizes(
                len(batch), num_workers=workers, local_replicas=local, worker_index=w
            )
            sizes_this_step += sizes
            for r, (a, b) in enumerate(sharding.offsets(sizes)):
                for element in block[a:b]:
                    delivered.setdefault(element, []).append((step, w, r))
        step_sizes.append(sizes_this_step)
    return delivered, step_sizes


@FAST
@given(
    workers=workers_st,
    local=local_st,
    global_batch=st.integers(1, 200),
    steps=st.integers(1, 5),
    partial=st.integers(0, 199),
)
def test_epoch_delivers_every_element_exactly_once_to_one_replica(
    workers, local, global_batch, steps, partial
):
    num_elements = steps * global_batch + partial % global_batch  # incl. a partial last batch
    delivered, step_sizes = simulate_epoch(num_elements, global_batch, workers, local)
    assert sorted(delivered) == list(range(num_elements))
    assert all(len(places) == 1 for places in delivered.values())
    for sizes in step_sizes:
        assert len(sizes) == workers * local
        assert max(sizes) - min(sizes) <= 1


@FAST
@given(workers=workers_st, local=local_st, global_batch=st.integers(1, 200))
def test_epoch_delivers_elements_in_order_within_each_replica(workers, local, global_batch):
    num_elements = 3 * global_batch + global_batch // 2
    delivered, _ = simulate_epoch(num_elements, global_batch, workers, local)
    by_replica: dict[tuple[int, int], list[int]] = {}
    for element in sorted(delivered):
        ((_, w, r),) = delivered[element]
        by_replica.setdefault((w, r), []).append(element)
    for elements in by_replica.values():
        assert elements == sorted(elements)


@FAST
@given(files=st.integers(1, 64), workers=workers_st)
def test_shard_files_partitions_the_files(files, workers):
    if files < workers:
        with pytest.raises(ValueError, match=f"{files} files for {workers} workers"):
            sharding.shard_files(files, num_workers=workers, worker_index=0)
        return
    shards = [
        sharding.shard_files(files, num_workers=workers, worker_index=w) for w in range(workers)
    ]
    assert sorted(i for shard in shards for i in shard) == list(range(files))
    assert all(shard for shard in shards)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
