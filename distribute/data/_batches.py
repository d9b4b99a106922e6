"""A worker's step: its share of a global batch, split per replica (the column layout),
empty parts for replicas without data, element specs, and copies to the replicas'
devices ahead of use (NOTE [prefetch copies]).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from distribute import context
from distribute.data import sharding
from distribute.errors import InvalidArgumentError
from distribute.values import (
    PerReplica,
    _children,
    _rebuild,
    assert_same_structure,
    flatten,
    pack_sequence_as,
)

__all__ = ["TensorSpec"]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor of a step's per-replica element.

    ``None`` in ``shape`` marks a dimension that can vary (the batch dimension
    when partial batches are possible).

    Example:
        >>> import distribute as ds, torch
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> data = torch.utils.data.TensorDataset(torch.ones(6, 3), torch.zeros(6))
        >>> loader = torch.utils.data.DataLoader(data, batch_size=4)
        >>> features, labels = strategy.experimental_distribute_dataset(loader).element_spec
        >>> features
        TensorSpec(shape=(None, 3), dtype=torch.float32)
    """

    shape: tuple[int | None, ...]
    dtype: torch.dtype


# NOTE [column layout]: a worker's step is kept as one column per leaf of the batch,
# each column holding that leaf's value for every local replica (`torch.split` gives
# exactly that), and packed into the batch's nest once, when the step is handed out.
# Flattening and packing a nest per replica cost more than the split itself, and the
# per-step path runs between two DataLoader batches, with cold caches.

_MISSING = object()  # a replica with no data this step
#: The end-of-data sum counts the workers that need an empty batch's structure in
#: multiples of this (the replicas with data stay below it).
_NEED_TEMPLATE = 1 << 20
_Tensor = torch.Tensor  # a module global: checked per leaf per step, one lookup fewer

_split_sizes = functools.lru_cache(maxsize=64)(sharding.split_sizes)  # read-only lists


class _Step:
    """One step of one worker: ``columns[i][r]`` is leaf ``i`` of local replica ``r``.

    Args:
      structure: the nest the leaves pack into.
      columns: one sequence per leaf, one value per local replica (`_MISSING` for a
        replica without data).
      replicas: how many local replicas.
      missing: the replicas without data.
      nest: the packed value, when it is at hand (one replica, batch unchanged).
      on_cpu: whether every tensor leaf is on the CPU, when known.
    """

    __slots__ = ("columns", "missing", "nest", "on_cpu", "replicas", "structure")

    def __init__(
        self,
        structure: Any,
        columns: Sequence[Sequence[Any]],
        replicas: int,
        *,
        missing: Sequence[int] = (),
        nest: Any = None,
        on_cpu: bool | None = None,
    ) -> None:
        self.structure = structure
        self.columns = columns
        self.replicas = replicas
        self.missing = missing
        self.nest = nest
        self.on_cpu = on_cpu

    def value(self) -> Any:
        """The step as handed out: a nest of `PerReplica` (plain values with one replica).

        A non-tensor leaf that is the same object on every replica stays unwrapped,
        as `distribute.values.regroup` does.
        """
        if self.nest is None:
            if self.replicas == 1:
                leaves = [_unwrap(column[0]) for column in self.columns]
            else:
                leaves = [
                    c[0]
                    if not isinstance(c[0], (torch.Tensor, _Examples)) and all(x is c[0] for x in c)
                    else PerReplica([_unwrap(x) for x in c])
                    for c in self.columns
                ]
            self.nest = _pack(self.structure, leaves)
        return self.nest

    def template(self) -> tuple[Any, list[Any]]:
        """An empty batch like a present replica's, as (nest, leaves): what replicas
        without data get."""
        r = next(r for r in range(self.replicas) if r not in self.missing)
        empty = _empty_leaves([column[r] for column in self.columns])
        return _pack(self.structure, empty), empty

    def filled(self, structure: Any, empty: Sequence[Any]) -> _Step:
        """This step with an empty batch (from `structure`, `empty`) for every replica
        without data."""
        if structure is not self.structure:
            assert_same_structure(self.structure, structure, "a batch and an earlier one")
        columns = [list(column) for column in self.columns]
        for r in self.missing:
            for column, leaf in zip(columns, _empty_leaves(empty)):
                column[r] = leaf
        return _Step(self.structure, columns, self.replicas)

    def to(
        self, devices: Sequence[torch.device], cpu_only: bool, copies: _CopyStreams | None = None
    ) -> _Step:
        """This step with replica ``r``'s leaves on ``devices[r]`` (host-to-GPU copies
        on ``copies``' streams, waited for when the step is handed out)."""
        if cpu_only:
            if self.on_cpu is None:
                self.on_cpu = all(_all_on_cpu(column) for column in self.columns)
            if self.on_cpu:
                return self
        columns = [
            [_to_device(x, d, copies) for x, d in zip(column, devices)] for column in self.columns
        ]
        if all(x is y for a, b in zip(columns, self.columns) for x, y in zip(a, b)):
            return self
        return _Step(self.structure, columns, self.replicas)


_ATOMS = (str, bytes)  # what `default_collate` leaves as a list (numbers become tensors)


class _Examples:
    """A per-example list or tuple of strings in a batch (file names, ids): split
    across replicas along with the tensors, like a batch dimension.

    `default_collate` leaves strings as a list or tuple with one entry per
    example; giving every replica the whole list while the tensors are split
    would pair examples with other examples' names.
    """

    __slots__ = ("items",)

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: slice) -> _Examples:
        return _Examples(self.items[index])

    def split(self, sizes: Sequence[int]) -> list[_Examples]:
        starts = itertools.accumulate(sizes, initial=0)
        return [_Examples(self.items[a : a + n]) for a, n in zip(starts, sizes)]

    def unwrap(self) -> Any:
        return self.items


def _wrap_examples(batch: Any) -> Any:
    """The batch with each list or tuple of strings made an `_Examples` leaf.

    Other lists and tuples of plain values (an image size, constants) stay what
    they were: nests whose leaves every replica gets whole.
    """
    kind = type(batch)
    if kind is _Tensor or _is_flat(batch):
        return batch
    if (kind is list or kind is tuple) and batch and all(type(x) in _ATOMS for x in batch):
        return _Examples(batch)
    children = _children(batch)
    if children is None:
        return batch
    wrapped = [_wrap_examples(c) for c in children]
    if all(w is c for w, c in zip(wrapped, children)):
        return batch
    return _rebuild(batch, wrapped)


def _unwrap(leaf: Any) -> Any:
    return leaf.unwrap() if type(leaf) is _Examples else leaf


def _empty_leaves(leaves: Sequence[Any]) -> list[Any]:
    """Fresh batches of no elements: batch dimension 0, other dimensions, dtypes and
    devices kept (new tensors: they hold no batch's memory)."""
    return [
        x.new_empty((0, *x.shape[1:]))
        if isinstance(x, torch.Tensor) and x.dim() > 0
        else x[0:0]
        if type(x) is _Examples
        else x
        for x in leaves
    ]


def _template_of(batch: Any) -> tuple[Any, list[Any]]:
    """An empty batch of `batch`'s structure, as (nest, leaves)."""
    batch = _wrap_examples(batch)
    empty = _empty_leaves(_leaves(batch))
    return _pack(batch, empty), empty


def _is_flat(batch: Any) -> bool:
    """Whether `batch` is a plain tuple or list of plain tensors (the common case)."""
    kind = type(batch)
    return (kind is tuple or kind is list) and all(type(x) is torch.Tensor for x in batch)


def _leaves(batch: Any) -> list[Any]:
    """`flatten`, with shortcuts for a tensor and a flat tuple or list of tensors."""
    if type(batch) is torch.Tensor:
        return [batch]
    if _is_flat(batch):
        return list(batch)
    return flatten(batch)


def _pack(structure: Any, leaves: Sequence[Any]) -> Any:
    """`pack_sequence_as`, with the shortcuts of `_leaves`."""
    if type(structure) is torch.Tensor:
        return leaves[0]
    if _is_flat(structure):
        return type(structure)(leaves)
    return pack_sequence_as(structure, leaves)


def _leaves_and_nest(batch: Any) -> tuple[list[Any], Any]:
    """The batch's leaves (NumPy arrays made tensors), and the batch itself when they
    are its own leaves (None when arrays were converted)."""
    if type(batch) is torch.Tensor:
        return [batch], batch
    if _is_flat(batch):
        return list(batch), batch
    leaves = flatten(batch)
    if any(isinstance(x, (np.ndarray, _Examples)) for x in leaves):
        return _from_numpy(leaves), None  # the nest is rebuilt from the leaves
    return leaves, batch


def _flat_cpu_batch_size(batch: Any) -> int:
    """The batch size of a CPU tensor with a batch dimension, or of a non-empty plain
    tuple or list of such tensors that share it; -1 for any other batch."""
    kind = type(batch)
    if kind is _Tensor:
        return batch.shape[0] if batch.is_cpu and batch.dim() > 0 else -1
    if kind is not tuple and kind is not list:
        return -1
    size = -1
    for x in batch:
        if type(x) is not _Tensor or not x.is_cpu:
            return -1
        shape = x.shape
        if not shape or (size >= 0 and shape[0] != size):
            return -1
        size = shape[0]
    return size


def _all_on_cpu(leaves: Iterable[Any]) -> bool:
    return all(x.is_cpu for x in leaves if isinstance(x, torch.Tensor))


def _from_numpy(leaves: Sequence[Any]) -> list[Any]:
    return [torch.from_numpy(x) if isinstance(x, np.ndarray) else x for x in leaves]


def _normalize(batch: Any) -> Any:
    """The batch with NumPy arrays made tensors (the same object when there are none)."""
    leaves = _leaves(batch)
    if not any(isinstance(x, np.ndarray) for x in leaves):
        return batch
    return pack_sequence_as(batch, _from_numpy(leaves))


def _leaves_len(leaves: Sequence[Any], batch: Any) -> int:
    lengths = {x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0}
    examples = {len(x) for x in leaves if type(x) is _Examples}
    if examples and len(lengths) == 1 and examples != lengths:
        raise InvalidArgumentError(
            f"A list of per-example strings (of lengths {sorted(examples)}) in a batch of "
            f"batch size {sorted(lengths)} cannot be split across replicas with its examples: "
            "a list or tuple of strings (file names, ids) needs one string per example; "
            f"got {_describe(batch)}."
        )
    lengths |= examples
    if len(lengths) == 1:
        return lengths.pop()
    if not lengths:
        raise InvalidArgumentError(
            "A batch needs at least one tensor (or NumPy array) with a batch dimension to be "
            f"split across replicas; got {_describe(batch)}."
        )
    raise InvalidArgumentError(
        f"The tensors of a batch must share their first (batch) dimension; got sizes "
        f"{sorted(lengths)} in {_describe(batch)}."
    )


def _describe(batch: Any) -> str:
    leaves = flatten(batch)
    parts = [
        f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
        if isinstance(x, torch.Tensor)
        else type(x).__name__
        for x in leaves[:6]
    ]
    more = ", ..." if len(leaves) > 6 else ""
    return f"{type(batch).__name__}({', '.join(parts)}{more})"


def _slice_leaves(leaves: Sequence[Any], start: int, stop: int) -> list[Any]:
    return [
        x[start:stop]
        if (isinstance(x, torch.Tensor) and x.dim() > 0) or type(x) is _Examples
        else x
        for x in leaves
    ]


def _to_device(x: Any, device: torch.device, copies: _CopyStreams | None = None) -> Any:
    if not isinstance(x, torch.Tensor) or (
        x.is_cpu if device.type == "cpu" else x.device == device
    ):
        return x
    if device.type == "cuda" and x.is_cpu and copies is not None:
        return copies.copy(x, device)
    return x.to(device)


class _CopyStreams:
    """Host-to-GPU copies on a side stream per device, so they overlap compute.

    NOTE [prefetch copies]: a read-ahead step's copies are issued on the device's
    copy stream (asynchronous from pinned memory: pass ``pin_memory=True`` to the
    DataLoader, whose worker threads pin off the training thread; pageable memory
    is copied synchronously by CUDA). When the step is handed out, the compute
    stream waits for the copy stream (``wait_stream``, no host sync) and every
    copied tensor is recorded on the compute stream (``record_stream``), so the
    caching allocator does not reuse its memory while a kernel may still read it.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._pending: dict[int, list[tuple[torch.Tensor, Any]]] = {}

    def copy(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # untyped in torch
        with torch.cuda.stream(stream):
            y = x.to(device, non_blocking=True)
        self._pending.setdefault(id(y), []).append((y, stream))
        return y

    def wait(self, step: _Step) -> None:
        """Makes each device's current stream wait for ``step``'s copies."""
        if not self._pending:
            return
        waited: set[Any] = set()
        for column in step.columns:
            for x in column:
                for y, stream in self._pending.pop(id(x), ()):
                    current = torch.cuda.current_stream(y.device)
                    if stream not in waited:
                        current.wait_stream(stream)
                        waited.add(stream)
                    y.record_stream(current)


def _spec(batch: Any, batch_dim: int | None) -> Any:
    leaves = flatten(batch)
    specs = [
        TensorSpec((batch_dim, *x.shape[1:]) if x.dim() > 0 else (), x.dtype)
        if isinstance(x, torch.Tensor)
        else type(x.items)
        if type(x) is _Examples
        else x
        for x in leaves
    ]
    return pack_sequence_as(batch, specs)


def _check_not_in_replica_context(what: str) -> None:
    top = context._top()
    if top is not None and top.replica_context is not None:
        raise InvalidArgumentError(
            f"{what} was called inside a replica function (strategy.run). Iterators are advanced "
            "in cross-replica context: call next(iterator) outside run and pass the batch in, "
            "e.g. strategy.run(step, args=(next(iterator),))."
        )


# -- epoch-aware, worker-aware samplers -------------------------------------------------
