"""Distributed values and the nest helpers that split and regroup them per replica.

Glossary:
    PerReplica: one value per local replica, possibly different (a replica's batch,
        a replica's loss).
    Mirrored: one value per local replica, all identical (a broadcast result).

Nests are lists, tuples, namedtuples, dicts and dataclass instances, at any depth;
anything else (tensors, numbers, strings, None, `DistributedValues`) is a leaf. Dict
keys are visited in sorted order, as `tf.nest` does, so every replica flattens a
dict the same way whatever its insertion order.

Example:
    >>> import distribute as ds
    >>> v = ds.PerReplica((1, 2))
    >>> ds.values.select_replica(1, {"x": v, "y": 5})
    {'x': 2, 'y': 5}
    >>> ds.values.regroup([(1, "a"), (2, "a")])
    (PerReplica(1, 2), 'a')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from distribute.errors import InvalidArgumentError

__all__ = [
    "DistributedValues",
    "Mirrored",
    "PerReplica",
    "assert_same_structure",
    "flatten",
    "map_structure",
    "pack_sequence_as",
    "regroup",
    "select_replica",
]


class DistributedValues:
    """Base class of values with one component per local replica.

    Args:
        values: the components, in local replica order.

    Example:
        >>> import distribute as ds
        >>> ds.PerReplica([1, 2]).values
        (1, 2)
    """

    def __init__(self, values: Sequence[Any]) -> None:
        self._values = tuple(values)
        if not self._values:
            raise InvalidArgumentError(
                f"{type(self).__name__} needs at least one component, got none"
            )

    @property
    def values(self) -> tuple[Any, ...]:
        """The components, one per local replica."""
        return self._values

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(repr(v) for v in self._values)})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, DistributedValues)
        return len(self._values) == len(other._values) and all(
            a is b or _leaf_equal(a, b) for a, b in zip(self._values, other._values)
        )

    def __hash__(self) -> int:
        return id(self)


def _leaf_equal(a: Any, b: Any) -> bool:
    try:
        result = a == b
        return bool(result) if not hasattr(result, "all") else bool(result.all())
    except Exception:
        return False


class PerReplica(DistributedValues):
    """Per-replica values that may differ: what `run` returns and batches hold.

    Example:
        >>> import distribute as ds, torch
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> batch = ds.PerReplica((torch.ones(2), torch.zeros(3)))  # replica 0's, replica 1's
        >>> strategy.run(lambda x: x.shape[0], args=(batch,))
        PerReplica(2, 3)
    """


class Mirrored(DistributedValues):
    """Per-replica values that are identical on every replica.

    Example:
        >>> import distribute as ds
        >>> ds.Mirrored((1.0, 1.0)).values
        (1.0, 1.0)
    """


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _is_leaf_type(cls: type) -> bool:
    """Whether every instance of `cls` is a leaf (what `_children` returns None for)."""
    return issubclass(cls, DistributedValues) or not (
        issubclass(cls, (list, tuple, dict)) or dataclasses.is_dataclass(cls)
    )


def _children(x: Any) -> list[Any] | None:
    """The children of a nest node in canonical order, or None for a leaf."""
    if isinstance(x, DistributedValues):
        return None
    if isinstance(x, (list, tuple)):
        return list(x)
    if isinstance(x, dict):
        return [x[k] for k in _sorted_keys(x)]
    if _is_dataclass_instance(x):
        return [getattr(x, f.name) for f in dataclasses.fields(x) if f.init]
    return None


def _sorted_keys(d: dict[Any, Any]) -> list[Any]:
    try:
        return sorted(d)
    except TypeError:
        return sorted(d, key=repr)


def _rebuild(template: Any, children: list[Any]) -> Any:
    if _is_namedtuple(template):
        return type(template)(*children)
    if isinstance(template, tuple):
        return tuple(children) if type(template) is tuple else type(template)(children)
    if isinstance(template, list):
        return list(children) if type(template) is list else type(template)(children)
    if isinstance(template, dict):
        rebuilt = dict(zip(_sorted_keys(template), children))
        ordered = {k: rebuilt[k] for k in template}
        return ordered if type(template) is dict else type(template)(ordered)
    names = [f.name for f in dataclasses.fields(template) if f.init]
    return dataclasses.replace(template, **dict(zip(names, children)))


def flatten(structure: Any) -> list[Any]:
    """Returns the leaves of `structure` in canonical order.

    Example:
        >>> from distribute.values import flatten
        >>> flatten({"b": [1, 2], "a": (3,)})   # dict keys sorted, as tf.nest does
        [3, 1, 2]
    """
    children = _children(structure)
    if children is None:
        return [structure]
    leaves: list[Any] = []
    for child in children:
        leaves.extend(flatten(child))
    return leaves


def pack_sequence_as(structure: Any, leaves: Sequence[Any]) -> Any:
    """Builds a nest shaped like `structure` from `leaves` (the inverse of `flatten`).

    Example:
        >>> from distribute.values import pack_sequence_as
        >>> pack_sequence_as({"b": [0, 0], "a": (0,)}, [3, 1, 2])
        {'b': [1, 2], 'a': (3,)}
    """
    it = iter(leaves)

    def build(node: Any) -> Any:
        children = _children(node)
        if children is None:
            try:
                return next(it)
            except StopIteration:
                raise InvalidArgumentError(
                    f"pack_sequence_as: too few leaves ({len(leaves)}) for the structure"
                ) from None
        return _rebuild(node, [build(c) for c in children])

    result = build(structure)
    if next(it, _SENTINEL) is not _SENTINEL:
        raise InvalidArgumentError(
            f"pack_sequence_as: too many leaves ({len(leaves)}) for the structure"
        )
    return result


_SENTINEL = object()


def _structure_signature(x: Any) -> Any:
    children = _children(x)
    if children is None:
        return None
    if isinstance(x, dict):
        key: Any = ("dict", tuple(_sorted_keys(x)))
    elif _is_dataclass_instance(x):
        key = ("dataclass", type(x).__qualname__)
    elif _is_namedtuple(x):
        key = ("namedtuple", type(x).__qualname__, type(x)._fields)
    else:
        key = ("seq", len(children))
    return (key, tuple(_structure_signature(c) for c in children))


def assert_same_structure(a: Any, b: Any, what: str = "structures") -> None:
    """Raises `InvalidArgumentError` unless `a` and `b` have the same nest structure.

    Example:
        >>> from distribute.values import assert_same_structure
        >>> assert_same_structure({"x": 1}, {"x": 2})      # same keys: fine
        >>> assert_same_structure([1, 2], [1])
        Traceback (most recent call last):
        ...
        distribute.errors.InvalidArgumentError: structures differ: ...
    """
    if _structure_signature(a) != _structure_signature(b):
        raise InvalidArgumentError(
            f"{what} differ: {_describe(a)} vs {_describe(b)}; every replica must pass "
            "the same nest structure (same keys, same lengths)"
        )


def _describe(x: Any) -> str:
    text = repr(pack_sequence_as(x, ["."] * len(flatten(x))))
    return text if len(text) < 200 else text[:197] + "..."


def map_structure(fn: Callable[..., Any], *structures: Any) -> Any:
    """Applies `fn` to corresponding leaves of `structures` (all of one structure).

    Example:
        >>> from distribute.values import map_structure
        >>> map_structure(lambda a, b: a + b, {"x": 1, "y": [2]}, {"x": 10, "y": [20]})
        {'x': 11, 'y': [22]}
    """
    first = structures[0]
    for other in structures[1:]:
        assert_same_structure(first, other)
    flat = [flatten(s) for s in structures]
    return pack_sequence_as(first, [fn(*leaves) for leaves in zip(*flat)])


def select_replica(replica: int, structure: Any, num_replicas: int | None = None) -> Any:
    """Replaces every `DistributedValues` leaf by its component for local `replica`.

    Raises:
        InvalidArgumentError: ``num_replicas`` is given and a leaf has another
            number of components.

    Example:
        >>> import distribute as ds
        >>> from distribute.values import select_replica
        >>> select_replica(1, {"x": ds.PerReplica((0, 10)), "lr": 0.1})
        {'x': 10, 'lr': 0.1}
    """
    if isinstance(structure, DistributedValues):
        values = structure.values
        if num_replicas is not None and len(values) != num_replicas:
            raise InvalidArgumentError(
                f"a {type(structure).__name__} with {len(values)} components was passed to "
                f"`run` of a strategy with {num_replicas} local replicas; give one component "
                "per local replica (strategy.experimental_distribute_values_from_function "
                "makes one)"
            )
        return values[replica]
    kind = type(structure)
    if kind is tuple or kind is list:  # `run`'s args, the common case: no walk into leaves
        selected = [
            select_replica(replica, c, num_replicas)
            if isinstance(c, _SELECTABLE) or hasattr(type(c), "__dataclass_fields__")
            else c  # a leaf no selection changes (a tensor, a number)
            for c in structure
        ]
        return selected if kind is list else tuple(selected)
    if kind is dict and not structure:  # `run`'s kwargs, most often
        return {}
    children = _children(structure)
    if children is None:
        return structure
    return _rebuild(structure, [select_replica(replica, c, num_replicas) for c in children])


#: What `select_replica` looks into (with dataclass instances).
_SELECTABLE = (DistributedValues, list, tuple, dict)


def regroup(per_replica: Sequence[Any], wrap: type[DistributedValues] = PerReplica) -> Any:
    """Regroups one nest per replica into one nest whose leaves are `wrap` values.

    A leaf that is the same object on every replica is returned unwrapped, as
    tf.distribute does.

    Raises:
        InvalidArgumentError: the replicas returned different structures.

    Example:
        >>> from distribute.values import regroup
        >>> shared = object()
        >>> out = regroup([{"loss": 1.0, "same": shared}, {"loss": 2.0, "same": shared}])
        >>> out["loss"], out["same"] is shared
        (PerReplica(1.0, 2.0), True)
    """
    first = per_replica[0]
    if len(per_replica) == 1:
        return first
    kind = type(first)
    kinds = set(map(type, per_replica))
    if len(kinds) == 1 and _is_leaf_type(kind):  # one leaf per replica (a loss): no walk
        for p in per_replica:
            if p is not first:
                return wrap(per_replica)
        return first
    if (
        (kind is list or kind is tuple)
        and all(type(p) is kind and len(p) == len(first) for p in per_replica)
        and all(_is_leaf_type(t) for t in set().union(*(map(type, p) for p in per_replica)))
    ):  # a plain list or tuple of leaves, the common case: no nest walk
        leaves = []
        for column in zip(*per_replica):
            leaf = column[0]
            for other in column:
                if other is not leaf:
                    leaf = wrap(column)
                    break
            leaves.append(leaf)
        return leaves if kind is list else tuple(leaves)
    for i, other in enumerate(per_replica[1:], start=1):
        assert_same_structure(first, other, f"values of replica 0 and replica {i}")
    flat = [flatten(s) for s in per_replica]
    leaves = []
    for column in zip(*flat):
        if all(c is column[0] for c in column):
            leaves.append(column[0])
        else:
            leaves.append(wrap(column))
    return pack_sequence_as(first, leaves)
