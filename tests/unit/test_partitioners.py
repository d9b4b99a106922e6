"""Variable partitioners: how many shards along dim 0, and the rows of each shard.

TensorFlow's rules (`tf.distribute.experimental.partitioners`):

* the div rule: ``n`` rows over ``k`` shards give the first ``n % k`` shards one row
  more (13 over 5: 3, 3, 3, 2, 2);
* never more shards than rows, and a scalar is never split;
* `FixedShardsPartitioner(k)`: ``min(k, rows)`` shards;
* `MinSizePartitioner(min_shard_bytes, max_shards)`: TensorFlow's rule
  (`min_max_variable_partitioner`): ``ceil(total_bytes / min_shard_bytes)`` shards,
  capped by ``max_shards`` and the rows;
* `MaxSizePartitioner(max_shard_bytes, max_shards)`: the fewest shards that keep each
  (whole rows) at most ``max_shard_bytes``, capped by ``max_shards``; a row larger than
  the bound gets a shard of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import distribute as ds
from distribute.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    shard_sizes,
)

F32 = torch.float32


# -- the div rule -------------------------------------------------------------------------


def test_13_rows_over_5_shards_follow_the_div_rule() -> None:
    assert shard_sizes(13, 5) == [3, 3, 3, 2, 2]


@pytest.mark.parametrize(
    ("rows", "shards", "sizes"),
    [(10, 2, [5, 5]), (7, 3, [3, 2, 2]), (4, 4, [1, 1, 1, 1]), (5, 1, [5]), (1, 1, [1])],
)
def test_shard_sizes_give_the_remainder_to_the_first_shards(
    rows: int, shards: int, sizes: list[int]
) -> None:
    assert shard_sizes(rows, shards) == sizes


def test_shard_sizes_never_make_more_shards_than_rows() -> None:
    assert shard_sizes(3, 8) == [1, 1, 1]


def test_the_public_namespace_is_the_partitioners_module() -> None:
    namespace = ds.experimental.partitioners
    assert namespace.FixedShardsPartitioner is FixedShardsPartitioner
    assert namespace.MinSizePartitioner is MinSizePartitioner
    assert namespace.MaxSizePartitioner is MaxSizePartitioner


@given(rows=st.integers(1, 10_000), shards=st.integers(1, 200))
def test_shard_sizes_sum_to_the_rows_and_differ_by_at_most_one_larger_first(
    rows: int, shards: int
) -> None:
    sizes = shard_sizes(rows, shards)
    assert sum(sizes) == rows
    assert len(sizes) == min(rows, shards)
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert min(sizes) >= 1


# -- FixedShardsPartitioner -------------------------------------------------------------------


def test_fixed_shards_split_dim_0_only() -> None:
    assert FixedShardsPartitioner(5)(torch.Size([13, 4]), F32) == [5, 1]
    assert FixedShardsPartitioner(2)((10, 3, 7), F32) == [2, 1, 1]
    assert FixedShardsPartitioner(3)((9,), F32) == [3]


def test_fixed_shards_never_exceed_the_rows() -> None:
    assert FixedShardsPartitioner(8)(torch.Size([3, 4]), F32) == [3, 1]
    assert FixedShardsPartitioner(8)(torch.Size([1]), F32) == [1]


def test_a_scalar_is_never_split() -> None:
    for partitioner in (
        FixedShardsPartitioner(4),
        MinSizePartitioner(min_shard_bytes=1, max_shards=4),
        MaxSizePartitioner(max_shard_bytes=1, max_shards=4),
    ):
        assert partitioner(torch.Size([]), F32) == [], partitioner


# -- MinSizePartitioner -----------------------------------------------------------------------


def test_min_size_examples_of_tensorflow() -> None:
    # tf.distribute.experimental.partitioners.MinSizePartitioner's docstring.
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=2)(torch.Size([6, 1]), F32) == [2, 1]
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=10)(torch.Size([6, 1]), F32) == [6, 1]


def test_min_size_makes_as_many_shards_as_keep_each_at_least_the_minimum() -> None:
    # 12 x 4 float32 = 192 bytes: 3 shards of 64 bytes, not 4 of 48.
    assert MinSizePartitioner(min_shard_bytes=64, max_shards=8)((12, 4), F32) == [3, 1]
    # 10 x 4 float32 = 160 bytes: ceil(160 / 50) = 4 shards, as TensorFlow's
    # min_max_variable_partitioner counts.
    assert MinSizePartitioner(min_shard_bytes=50, max_shards=8)((10, 4), F32) == [4, 1]


def test_min_size_keeps_a_variable_smaller_than_the_minimum_whole() -> None:
    assert MinSizePartitioner(min_shard_bytes=1024, max_shards=8)((10, 4), F32) == [1, 1]


def test_min_size_is_capped_by_max_shards_and_by_the_rows() -> None:
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=3)((100, 1), F32) == [3, 1]
    assert MinSizePartitioner(min_shard_bytes=1, max_shards=100)((5, 8), F32) == [5, 1]


def test_min_size_defaults_to_one_shard_of_at_least_256_kib() -> None:
    assert MinSizePartitioner()((1 << 20, 4), F32) == [1, 1]


def test_min_size_counts_the_bytes_of_the_dtype() -> None:
    # 16 x 4 elements: 128 bytes in float16, 256 in float32, 512 in float64.
    partitioner = MinSizePartitioner(min_shard_bytes=64, max_shards=16)
    assert partitioner((16, 4), torch.float16) == [2, 1]
    assert partitioner((16, 4), torch.float32) == [4, 1]
    assert partitioner((16, 4), torch.float64) == [8, 1]


@given(
    rows=st.integers(1, 500),
    cols=st.integers(1, 16),
    min_bytes=st.integers(1, 4096),
    max_shards=st.integers(1, 64),
)
def test_min_size_makes_total_over_minimum_shards_rounded_up(
    rows: int, cols: int, min_bytes: int, max_shards: int
) -> None:
    total = rows * cols * 4
    (shards, rest) = MinSizePartitioner(min_bytes, max_shards)((rows, cols), F32)
    assert rest == 1
    assert 1 <= shards <= min(rows, max_shards)
    if shards < min(rows, max_shards):  # not capped: the fewest minimum-size slices
        assert (shards - 1) * min_bytes < total <= shards * min_bytes


# -- MaxSizePartitioner -----------------------------------------------------------------------


def test_max_size_examples_of_tensorflow() -> None:
    # tf.distribute.experimental.partitioners.MaxSizePartitioner's docstring.
    assert MaxSizePartitioner(max_shard_bytes=4)(torch.Size([6, 1]), F32) == [6, 1]
    assert MaxSizePartitioner(max_shard_bytes=4, max_shards=2)(torch.Size([6, 1]), F32) == [2, 1]
    assert MaxSizePartitioner(max_shard_bytes=1024)(torch.Size([6, 1]), F32) == [1, 1]


def test_max_size_makes_the_fewest_shards_that_keep_each_at_most_the_maximum() -> None:
    # 10 rows of 16 bytes, at most 64 bytes (4 rows) a shard: 3 shards (4, 3, 3 rows).
    assert MaxSizePartitioner(max_shard_bytes=64)((10, 4), F32) == [3, 1]
    # exactly 4 rows a shard fit: 2 shards, not 3
    assert MaxSizePartitioner(max_shard_bytes=128)((16, 4), F32) == [2, 1]


def test_max_size_gives_a_row_larger_than_the_maximum_a_shard_of_its_own() -> None:
    assert MaxSizePartitioner(max_shard_bytes=8)((5, 4), F32) == [5, 1]


def test_max_size_is_capped_by_max_shards() -> None:
    assert MaxSizePartitioner(max_shard_bytes=4, max_shards=3)((100, 1), F32) == [3, 1]


@given(
    rows=st.integers(1, 500),
    cols=st.integers(1, 16),
    max_bytes=st.integers(1, 4096),
)
def test_max_size_shards_fit_the_maximum_and_one_fewer_would_not(
    rows: int, cols: int, max_bytes: int
) -> None:
    row_bytes = cols * 4
    (shards, rest) = MaxSizePartitioner(max_bytes)((rows, cols), F32)
    assert rest == 1
    assert 1 <= shards <= rows
    rows_per_shard = max(1, max_bytes // row_bytes)  # whole rows; at least one
    assert max(shard_sizes(rows, shards)) <= rows_per_shard
    if shards > 1:
        assert max(shard_sizes(rows, shards - 1)) > rows_per_shard
    assert shards == math.ceil(rows / rows_per_shard)


# -- invalid arguments ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: FixedShardsPartitioner(0),
        lambda: FixedShardsPartitioner(-2),
        lambda: MinSizePartitioner(min_shard_bytes=0),
        lambda: MinSizePartitioner(min_shard_bytes=64, max_shards=0),
        lambda: MaxSizePartitioner(max_shard_bytes=0),
        lambda: MaxSizePartitioner(max_shard_bytes=64, max_shards=0),
    ],
    ids=[
        "fixed_0",
        "fixed_negative",
        "min_size_0_bytes",
        "min_size_0_shards",
        "max_size_0_bytes",
        "max_size_0_shards",
    ],
)
def test_non_positive_sizes_and_counts_raise_value_error(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        make()
