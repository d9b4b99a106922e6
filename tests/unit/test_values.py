"""Distributed values and the nest helpers (unwrap per replica, regroup)."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import distribute as ds
from distribute.values import (
    assert_same_structure,
    flatten,
    map_structure,
    pack_sequence_as,
    regroup,
    select_replica,
)

Point = namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Batch:
    features: Any
    label: Any


leaves = st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=3), st.none())


def nests(leaf: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaf,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.tuples(children, children),
            st.dictionaries(st.text(min_size=1, max_size=3), children, max_size=3),
            st.builds(Point, children, children),
            st.builds(Batch, children, children),
        ),
        max_leaves=12,
    )


@given(nests(leaves))
def test_flatten_then_pack_is_identity(structure: Any) -> None:
    assert pack_sequence_as(structure, flatten(structure)) == structure


@given(nests(leaves), st.integers(min_value=1, max_value=4))
def test_regroup_then_select_replica_gives_each_replica_its_nest(structure: Any, n: int) -> None:
    per_replica = [map_structure(lambda leaf, i=i: (i, leaf), structure) for i in range(n)]
    grouped = regroup(per_replica)
    for i in range(n):
        assert select_replica(i, grouped) == per_replica[i]


def test_regroup_unwraps_leaves_that_are_the_same_object() -> None:
    shared = object()
    grouped = regroup([{"a": 1, "b": shared}, {"a": 2, "b": shared}])
    assert grouped["b"] is shared
    assert grouped["a"] == ds.PerReplica((1, 2))


def test_regroup_of_one_replica_is_the_value_itself() -> None:
    value = {"a": [1, 2]}
    assert regroup([value]) is value


def test_regroup_rejects_different_structures_naming_the_replicas() -> None:
    with pytest.raises(ValueError, match="replica 0 and replica 1"):
        regroup([(1, 2), (1, 2, 3)])


def test_select_replica_reaches_into_namedtuples_and_dataclasses() -> None:
    v = ds.PerReplica(("a", "b"))
    nested = Batch(features=Point(x=v, y=1), label=[v])
    assert select_replica(1, nested) == Batch(features=Point(x="b", y=1), label=["b"])


def test_dict_keys_are_flattened_in_sorted_order_whatever_the_insertion_order() -> None:
    assert flatten({"b": 1, "a": 2}) == flatten({"a": 2, "b": 1}) == [2, 1]
    assert list(pack_sequence_as({"b": 0, "a": 0}, [5, 6])) == ["b", "a"]


def test_assert_same_structure_catches_different_dict_keys() -> None:
    with pytest.raises(ValueError, match="differ"):
        assert_same_structure({"a": 1}, {"b": 1})


def test_pack_sequence_as_rejects_wrong_leaf_counts() -> None:
    with pytest.raises(ValueError, match="too few"):
        pack_sequence_as((1, 2), [1])
    with pytest.raises(ValueError, match="too many"):
        pack_sequence_as((1, 2), [1, 2, 3])


def test_distributed_values_need_a_component() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ds.PerReplica(())


def test_per_replica_and_mirrored_hold_their_values() -> None:
    assert ds.PerReplica([1, 2]).values == (1, 2)
    assert isinstance(ds.Mirrored([1, 1]), ds.DistributedValues)
    assert repr(ds.PerReplica([1, 2])) == "PerReplica(1, 2)"
