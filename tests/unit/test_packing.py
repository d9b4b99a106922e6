"""Packing arithmetic (`distribute.collectives.packing`): pure functions, checked by hypothesis.

REFERENCE.md: packing walks the tensors in reverse (gradients arrive last layer first)
and starts a new pack once the current one EXCEEDS `bytes_per_pack`; 0 means one
pack; `num_packs` splits one flat buffer into equal chunks, the last taking the
remainder.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distribute.collectives.packing import pack_by_bytes, split_num_packs

SIZES = st.lists(st.integers(min_value=0, max_value=64), max_size=30)
LIMITS = st.integers(min_value=1, max_value=200)


def walk_order(n: int, reverse: bool) -> list[int]:
    return list(range(n - 1, -1, -1)) if reverse else list(range(n))


@given(SIZES, st.integers(min_value=0, max_value=200), st.booleans())
def test_pack_by_bytes_covers_every_index_exactly_once_in_walk_order(
    nbytes: list[int], limit: int, reverse: bool
) -> None:
    packs = pack_by_bytes(nbytes, limit, reverse=reverse)
    flat = [i for pack in packs for i in pack]
    assert flat == walk_order(len(nbytes), reverse)
    assert all(pack for pack in packs), "no pack is empty"


@given(SIZES, LIMITS)
def test_pack_by_bytes_walks_in_reverse_by_default(nbytes: list[int], limit: int) -> None:
    packs = pack_by_bytes(nbytes, limit)
    assert [i for pack in packs for i in pack] == list(reversed(range(len(nbytes))))
    assert packs == pack_by_bytes(nbytes, limit, reverse=True)


@given(SIZES, LIMITS, st.booleans())
def test_a_pack_is_closed_only_once_it_exceeds_bytes_per_pack(
    nbytes: list[int], limit: int, reverse: bool
) -> None:
    packs = pack_by_bytes(nbytes, limit, reverse=reverse)
    for k, pack in enumerate(packs):
        size = sum(nbytes[i] for i in pack)
        without_last = size - nbytes[pack[-1]]
        assert without_last <= limit, f"pack {k} should have been closed one tensor earlier"
        if k < len(packs) - 1:
            assert size > limit, f"pack {k} was closed before exceeding {limit} bytes"


def test_pack_by_bytes_closes_on_exceeding_not_on_reaching() -> None:
    # 4 + 4 = 8 does not exceed 8, so the third tensor joins the first pack.
    assert pack_by_bytes([4, 4, 4, 4], 8) == [[3, 2, 1], [0]]
    assert pack_by_bytes([4, 4, 4], 5) == [[2, 1], [0]]


@given(SIZES, st.booleans())
def test_zero_bytes_per_pack_gives_one_pack(nbytes: list[int], reverse: bool) -> None:
    packs = pack_by_bytes(nbytes, 0, reverse=reverse)
    if nbytes:
        assert packs == [walk_order(len(nbytes), reverse)]
    else:
        assert packs == []


@given(st.integers(max_value=-1))
def test_negative_bytes_per_pack_raises_value_error(limit: int) -> None:
    with pytest.raises(ValueError, match="bytes_per_pack must be >= 0"):
        pack_by_bytes([1, 2, 3], limit)


def test_negative_first_pack_bytes_or_tensor_size_raises_value_error() -> None:
    with pytest.raises(ValueError, match="first_pack_bytes"):
        pack_by_bytes([1, 2], 4, first_pack_bytes=-1)
    with pytest.raises(ValueError, match="negative size"):
        pack_by_bytes([1, -2], 4)


@given(SIZES, LIMITS, st.integers(min_value=0, max_value=200), st.booleans())
def test_first_pack_bytes_limits_only_the_first_pack(
    nbytes: list[int], limit: int, first: int, reverse: bool
) -> None:
    packs = pack_by_bytes(nbytes, limit, first_pack_bytes=first, reverse=reverse)
    assert [i for pack in packs for i in pack] == walk_order(len(nbytes), reverse)
    for k, pack in enumerate(packs):
        pack_limit = first if k == 0 else limit
        size = sum(nbytes[i] for i in pack)
        assert size - nbytes[pack[-1]] <= pack_limit
        if k < len(packs) - 1:
            assert size > pack_limit
    if packs:
        # After the first pack, packing restarts exactly as with no first_pack_bytes.
        first_len = len(packs[0])
        rest_order = walk_order(len(nbytes), reverse)[first_len:]
        rest = pack_by_bytes([nbytes[i] for i in rest_order], limit, reverse=False)
        assert packs[1:] == [[rest_order[j] for j in pack] for pack in rest]


def test_first_pack_bytes_example() -> None:
    # The first pack closes after 1 tensor (4 > 2); later packs use 8.
    assert pack_by_bytes([4, 4, 4, 4, 4], 8, first_pack_bytes=2) == [[4], [3, 2, 1], [0]]


@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=0, max_value=64))
def test_split_num_packs_sums_to_numel_and_the_last_takes_the_remainder(
    numel: int, num_packs: int
) -> None:
    sizes = split_num_packs(numel, num_packs)
    assert sum(sizes) == numel
    if num_packs <= 1 or numel < num_packs:
        assert sizes == [numel]
        return
    assert len(sizes) == num_packs
    base = numel // num_packs
    assert sizes[:-1] == [base] * (num_packs - 1)
    assert sizes[-1] == base + numel % num_packs
    assert all(s > 0 for s in sizes)


def test_split_num_packs_examples() -> None:
    assert split_num_packs(10, 3) == [3, 3, 4]
    assert split_num_packs(7, 2) == [3, 4]
    assert split_num_packs(8, 4) == [2, 2, 2, 2]
    assert split_num_packs(2, 5) == [2]  # never an empty chunk


@given(st.integers(max_value=-1))
def test_split_num_packs_negative_raises_value_error(num_packs: int) -> None:
    with pytest.raises(ValueError, match="num_packs must be >= 0"):
        split_num_packs(10, num_packs)


def test_split_num_packs_negative_numel_raises_value_error() -> None:
    with pytest.raises(ValueError, match="numel must be >= 0"):
        split_num_packs(-1, 2)
