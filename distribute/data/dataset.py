"""Distributed datasets: global batches split per replica, sharded per worker.

What each replica receives, for a DataLoader batched with the global batch size
``G`` over ``N = num_workers * local_replicas`` replicas: the replicas split
every global batch by the ceil-then-floor rule of :mod:`distribute.data.sharding`,
each element going to exactly one replica. With 2 replicas and ``range(9)`` in
batches of 4 the steps are ``[0, 1] / [2, 3]``, ``[4, 5] / [6, 7]`` and
``[8] / []``: a replica whose data has run out gets an empty batch (batch
dimension 0, the other dimensions and the dtype of the data) for as long as any
other replica still has data, then the iterator ends for every replica at once.

Across workers (``AutoShardPolicy``): DATA rewraps the DataLoader's batch sampler
so that each worker loads only its own block of every global batch; FILE gives
each worker every ``num_workers``-th file of a dataset exposing ``files`` and
``with_files(files)``; an ``IterableDataset`` is sharded by element; OFF gives
every worker all the data: each global batch is still split into one share per
replica in sync, and every worker steps through all of those shares (so an
epoch takes ``num_workers`` times as many steps), as in tf.distribute.

Example::

    >>> import torch, distribute as ds
    >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> loader = torch.utils.data.DataLoader(torch.arange(9), batch_size=4)
    >>> dist = strategy.experimental_distribute_dataset(loader)
    >>> [[t.tolist() for t in strategy.experimental_local_results(b)] for b in dist]
    [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import pickle
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler
from torch.utils.data.distributed import DistributedSampler

from distribute import context
from distribute.data import _position, sharding
from distribute.data.options import (
    AutoShardPolicy,
    InputContext,
    InputOptions,
    InputReplicationMode,
)
from distribute.errors import InvalidArgumentError
from distribute.values import (
    PerReplica,
    _children,
    _rebuild,
    assert_same_structure,
    flatten,
    pack_sequence_as,
    select_replica,
)

__all__ = [
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "FileShardable",
    "InputWorkers",
    "OptionalValue",
    "TensorSpec",
    "make_numpy_dataset",
]

logger = logging.getLogger(__name__)


def _identity(n: int) -> int:
    return n


@dataclass(frozen=True)
class InputWorkers:
    """The devices of this worker's replicas and this worker's place among workers.

    Args:
      devices: one device per local replica.
      worker_index: this worker's index.
      num_workers: how many workers read input.
      sum_across_workers: sums an int over all workers; the end-of-data
        agreement calls it once per step (an all-reduce across processes,
        the identity in one process).
      gather_across_workers: every worker's bytes, in worker order (an
        all-gather across processes); used only when a worker without any data
        needs the others' element structure.
    """

    devices: tuple[torch.device, ...]
    worker_index: int = 0
    num_workers: int = 1
    sum_across_workers: Callable[[int], int] = field(default=_identity, compare=False)
    gather_across_workers: Callable[[bytes], list[bytes]] = field(
        default=lambda data: [data], compare=False
    )
    #: The cross-worker collectives, for whoever needs every worker (a checkpoint).
    collectives: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(torch.device(d) for d in self.devices))
        if not self.devices:
            raise InvalidArgumentError("InputWorkers needs at least one device.")
        if not 0 <= self.worker_index < self.num_workers:
            raise InvalidArgumentError(
                f"worker_index must be in [0, num_workers={self.num_workers}), got "
                f"{self.worker_index}."
            )

    @property
    def local_replicas(self) -> int:
        return len(self.devices)

    @property
    def num_replicas_in_sync(self) -> int:
        return self.num_workers * len(self.devices)

    @property
    def cpu_only(self) -> bool:
        """Whether every local replica's device is a CPU."""
        return all(d.type == "cpu" for d in self.devices)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor of a step's per-replica element.

    ``None`` in ``shape`` marks a dimension that can vary (the batch dimension
    when partial batches are possible).
    """

    shape: tuple[int | None, ...]
    dtype: torch.dtype


@runtime_checkable
class FileShardable(Protocol):
    """A dataset FILE auto-sharding can split: it reads ``files`` and can be narrowed.

    Example::

        class Shards(torch.utils.data.IterableDataset):
            def __init__(self, files): self.files = list(files)
            def with_files(self, files): return Shards(files)
            def __iter__(self): ...
    """

    files: Sequence[Any]

    def with_files(self, files: Sequence[Any]) -> Any: ...


class OptionalValue:
    """A step's element that may be absent, from `get_next_as_optional`.

    Example::

        >>> opt = OptionalValue(None, has_value=False)
        >>> opt.has_value()
        False
    """

    def __init__(self, value: Any, *, has_value: bool) -> None:
        self._value = value
        self._has_value = has_value

    def has_value(self) -> bool:
        """Whether the iterator produced an element."""
        return self._has_value

    def get_value(self) -> Any:
        """The element.

        Raises:
          ValueError: when there is none (the iterator was exhausted).
        """
        if not self._has_value:
            raise InvalidArgumentError(
                "get_value() on an empty OptionalValue: the iterator was exhausted; check "
                "has_value() first."
            )
        return self._value


# -- steps: batches as columns of leaves ----------------------------------------------------
#
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


class _SeededRandomSampler(Sampler[int]):
    """A RandomSampler whose order is a function of (seed, epoch) only.

    Every worker builds the same order for the same epoch, which DATA sharding by
    batch sampler needs; each epoch gets a distinct order. The seed is part of a
    distributed iterator's saved position (NOTE [input position]).
    """

    def __init__(self, original: Any, seed: int) -> None:
        self._original = original
        self._seed = seed
        self._epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __len__(self) -> int:
        return int(self._original.num_samples)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self._seed + self._epoch)
        n = len(self._original.data_source)
        num_samples = self._original.num_samples
        if self._original.replacement:
            yield from torch.randint(n, (num_samples,), generator=generator).tolist()
            return
        for _ in range(num_samples // n):
            yield from torch.randperm(n, generator=generator).tolist()
        yield from torch.randperm(n, generator=generator)[: num_samples % n].tolist()


class _WorkerBatchSampler(Sampler[list[int]]):
    """Yields, for each global batch of indices, this worker's block of it.

    A worker whose block of the (partial) last batch is empty stops early; the
    end-of-data agreement gives its replicas empty batches.
    """

    def __init__(self, batch_sampler: Iterable[list[int]], workers: InputWorkers) -> None:
        self._inner = batch_sampler
        self._workers = workers

    def set_epoch(self, epoch: int) -> None:
        _set_epoch(self._inner, epoch)
        # A plain BatchSampler has no set_epoch: reach the (seeded) sampler inside it.
        _set_epoch(getattr(self._inner, "sampler", None), epoch)

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]  # DataLoader batch samplers are sized

    def exact_len(self) -> int | None:
        """How many blocks this worker gets (its block of a small batch may be
        empty), where the global batch sizes are known (a `BatchSampler`)."""
        inner = self._inner
        if type(inner) is not BatchSampler or not isinstance(inner.sampler, Sized):
            return None
        w = self._workers

        def nonempty(size: int) -> bool:
            start, stop = sharding.worker_slice(
                size,
                num_workers=w.num_workers,
                local_replicas=w.local_replicas,
                worker_index=w.worker_index,
            )
            return stop > start

        full, rest = divmod(len(inner.sampler), inner.batch_size)
        last = rest > 0 and not inner.drop_last and nonempty(rest)
        return full * int(nonempty(inner.batch_size)) + int(last)

    def __iter__(self) -> Iterator[list[int]]:
        w = self._workers
        for indices in self._inner:
            indices = list(indices)
            start, stop = sharding.worker_slice(
                len(indices),
                num_workers=w.num_workers,
                local_replicas=w.local_replicas,
                worker_index=w.worker_index,
            )
            if start == stop:
                return
            yield indices[start:stop]


class _WorkerBlockIterable(IterableDataset[Any]):
    """Shards an IterableDataset by element: this worker's block of each global batch."""

    def __init__(
        self,
        dataset: IterableDataset[Any],
        global_batch: int,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any],
        workers: InputWorkers,
    ) -> None:
        self._dataset = dataset
        self._global_batch = global_batch
        self._drop_last = drop_last
        self._collate = collate_fn
        # Plain numbers only: DataLoader worker processes may pickle this dataset, and
        # the InputWorkers' cross-worker hook is not picklable.
        self._layout = {
            "num_workers": workers.num_workers,
            "local_replicas": workers.local_replicas,
            "worker_index": workers.worker_index,
        }

    def __iter__(self) -> Iterator[Any]:
        chunk: list[Any] = []
        for element in self._dataset:
            chunk.append(element)
            if len(chunk) == self._global_batch:
                yield self._block(chunk)
                chunk = []
        if chunk and not self._drop_last:
            start, stop = sharding.worker_slice(len(chunk), **self._layout)
            if start < stop:
                yield self._collate(chunk[start:stop])

    def _block(self, chunk: list[Any]) -> Any:
        start, stop = sharding.worker_slice(len(chunk), **self._layout)
        return self._collate(chunk[start:stop])


def _no_collate(batch: Any) -> Any:
    return batch


def _set_epoch(obj: Any, epoch: int) -> None:
    set_epoch = getattr(obj, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


def _rebuild_loader(loader: DataLoader[Any], **overrides: Any) -> DataLoader[Any]:
    """A DataLoader with `loader`'s settings and some replaced."""
    settings: dict[str, Any] = {
        "dataset": loader.dataset,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        settings["prefetch_factor"] = loader.prefetch_factor
    settings.update(overrides)
    # A StatefulDataLoader stays one, so that its position can be checkpointed.
    return type(loader)(**settings) if _position.is_stateful(loader) else DataLoader(**settings)


# -- sources: what one worker reads -----------------------------------------------------


class _Source:
    """One worker's stream of worker batches (its replicas' data, concatenated)."""

    def __init__(
        self, iterable: Iterable[Any], *, slice_global: bool, epoch_targets: Sequence[Any]
    ) -> None:
        self.iterable = iterable
        self.slice_global = (
            slice_global  # the stream holds global batches: keep this worker's block
        )
        self.epoch_targets = epoch_targets

    def batches(self, epoch: int) -> Iterator[Any]:
        for target in self.epoch_targets:
            _set_epoch(target, epoch)
        return iter(self.iterable)

    def known_steps(self) -> int | None:
        """At least how many batches an epoch of this worker yields, where the
        loader can say for sure (a map-style dataset's batch sampler); else None."""
        loader = self.iterable
        if (
            isinstance(loader, DataLoader)
            and loader.batch_sampler is not None
            and not isinstance(loader.dataset, IterableDataset)
        ):
            if isinstance(loader.batch_sampler, _WorkerBatchSampler):
                return loader.batch_sampler.exact_len()
            return len(loader)
        return None


def _agree_seed(workers: InputWorkers, seed: int) -> int:
    """Worker 0's seed, agreed with one sum across workers."""
    if workers.num_workers == 1:
        return seed
    return workers.sum_across_workers(seed if workers.worker_index == 0 else 0)


def _loader_source(
    loader: DataLoader[Any], workers: InputWorkers, policy: AutoShardPolicy
) -> _Source:
    multi = workers.num_workers > 1
    dataset = loader.dataset
    if (
        multi
        and policy in (AutoShardPolicy.FILE, AutoShardPolicy.AUTO)
        and isinstance(dataset, FileShardable)
    ):
        files = list(dataset.files)
        if len(files) >= workers.num_workers or policy is AutoShardPolicy.FILE:
            mine = sharding.shard_files(
                len(files), num_workers=workers.num_workers, worker_index=workers.worker_index
            )
            narrowed = dataset.with_files([files[i] for i in mine])
            batch = loader.batch_size
            if batch is None:
                raise InvalidArgumentError(
                    "FILE auto-sharding needs a DataLoader with batch_size set (the global "
                    "batch size)."
                )
            sizes = sharding.split_sizes(batch, workers.num_workers)
            local_batch = sizes[workers.worker_index]
            overrides: dict[str, Any] = {
                "dataset": narrowed,
                "batch_size": local_batch,
                "drop_last": loader.drop_last,
            }
            if not isinstance(narrowed, IterableDataset):
                overrides["shuffle"] = isinstance(loader.sampler, RandomSampler)
            rebuilt = _rebuild_loader(loader, **overrides)
            return _Source(rebuilt, slice_global=False, epoch_targets=[rebuilt.sampler])
        logger.warning(
            "AUTO sharding: %d files for %d workers, falling back to DATA sharding.",
            len(files),
            workers.num_workers,
        )
    if isinstance(loader.sampler, DistributedSampler):
        logger.info("The DataLoader already uses a DistributedSampler: not sharding it again.")
        return _Source(loader, slice_global=False, epoch_targets=[loader.sampler])
    if isinstance(dataset, IterableDataset):
        if multi and policy is not AutoShardPolicy.OFF and loader.batch_size is not None:
            block = _WorkerBlockIterable(
                dataset, loader.batch_size, loader.drop_last, loader.collate_fn, workers
            )
            return _Source(
                # The blocks come collated: the rebuilt loader must not collate them again.
                _rebuild_loader(loader, dataset=block, batch_size=None, collate_fn=_no_collate),
                slice_global=False,
                epoch_targets=[dataset],
            )
        return _Source(
            loader,
            slice_global=multi and policy is not AutoShardPolicy.OFF,
            epoch_targets=[dataset],
        )
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        # The loader yields whatever its dataset items are: treat them as global batches.
        return _Source(
            loader,
            slice_global=multi and policy is not AutoShardPolicy.OFF,
            epoch_targets=[loader.sampler],
        )
    batches: Any = batch_sampler  # a BatchSampler (torch's or torchdata's) where shuffled
    if (
        multi
        and type(batches) in _position.BATCH_SAMPLERS
        and isinstance(batches.sampler, _position.RANDOM_SAMPLERS)
        and policy is not AutoShardPolicy.OFF
    ):
        sampler: Any = batches.sampler
        seed = (
            sampler.generator.initial_seed()
            if sampler.generator is not None
            else torch.initial_seed()
        )
        seeded = _SeededRandomSampler(sampler, _agree_seed(workers, seed % (1 << 62)))
        batch_sampler = BatchSampler(seeded, batches.batch_size, batches.drop_last)
    if multi and policy is not AutoShardPolicy.OFF:
        _warn_if_lengths_differ(dataset, workers)
        wrapped = _WorkerBatchSampler(batch_sampler, workers)
        rebuilt = _rebuild_loader(loader, batch_sampler=wrapped)
        return _Source(rebuilt, slice_global=False, epoch_targets=[wrapped])
    return _Source(loader, slice_global=False, epoch_targets=[batch_sampler, loader.sampler])


def _warn_if_lengths_differ(dataset: Any, workers: InputWorkers) -> None:
    """Warns when the workers' datasets differ in length (every worker whose length is
    not the workers' mean sees it: one sum at construction).

    DATA sharding gives each worker its own block of every global batch, assuming
    every worker holds the same dataset; with different datasets each worker reads
    only its block of its own, and the rest of its data is never seen.
    """
    try:
        n = len(dataset)
    except TypeError:
        n = -1  # unknown here: still in the sum, which every worker must make
    total = workers.sum_across_workers(max(n, 0))  # one sum: a worker off the mean sees it
    w = workers.num_workers
    if n >= 0 and total != n * w:
        skipped = 100.0 * (w - 1) / w
        warnings.warn(
            f"experimental_distribute_dataset: the workers' datasets differ in length (this "
            f"worker's has {n} examples, the {w} workers' {total} together). DATA sharding "
            "gives each worker its own block of every global batch of its own dataset, so "
            f"about {skipped:.0f}% of each worker's data is never read. Give every worker "
            "the same dataset (each reads only its share), or build per-worker data with "
            "strategy.distribute_datasets_from_function, which reads every element once",
            stacklevel=4,
        )


def _make_source(dataset: Any, workers: InputWorkers, policy: AutoShardPolicy) -> _Source:
    if isinstance(dataset, DataLoader):
        return _loader_source(dataset, workers, policy)
    if isinstance(dataset, torch.utils.data.Dataset):
        raise InvalidArgumentError(
            f"experimental_distribute_dataset got a {type(dataset).__name__} (a Dataset of single "
            "examples); wrap it in a DataLoader batched with the GLOBAL batch size, e.g. "
            "DataLoader(dataset, batch_size=global_batch_size), or use ds.data.make_numpy_dataset."
        )
    if isinstance(dataset, (torch.Tensor, np.ndarray)) or not isinstance(dataset, Iterable):
        raise InvalidArgumentError(
            f"experimental_distribute_dataset needs a DataLoader or an iterable of batches, got "
            f"{type(dataset).__name__}. For arrays use ds.data.make_numpy_dataset(arrays, "
            "batch_size)."
        )
    multi = workers.num_workers > 1 and policy is not AutoShardPolicy.OFF
    iterable = _Replay(dataset) if isinstance(dataset, Iterator) else dataset
    return _Source(iterable, slice_global=multi, epoch_targets=[dataset])


class _Replay:
    """A one-shot iterator (a generator, say) as a source: peeking loses no batch.

    What `peek` reads to infer the element structure is yielded next.
    """

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator
        self._peeked: collections.deque[Any] = collections.deque()

    def peek(self) -> Any:
        if not self._peeked:
            try:
                self._peeked.append(next(self._iterator))
            except StopIteration:
                return _MISSING
        return self._peeked[0]

    def __iter__(self) -> Iterator[Any]:
        while True:
            if self._peeked:
                yield self._peeked.popleft()
                continue
            try:
                batch = next(self._iterator)
            except StopIteration:
                return
            yield batch


def _first_batch(iterable: Iterable[Any]) -> Any:
    """The first batch of a re-iterable (or `_Replay`) source, or `_MISSING`."""
    if isinstance(iterable, _Replay):
        return iterable.peek()
    for batch in iterable:
        return batch
    return _MISSING


# -- iterators --------------------------------------------------------------------------


class DistributedIterator:
    """Iterates a distributed dataset one step at a time.

    Each step is a nest whose leaves are `PerReplica` (plain values with one
    local replica). ``next`` must be called in cross-replica context.

    Example::

        >>> import torch, distribute as ds
        >>> it = iter(ds.OneDeviceStrategy("cpu").experimental_distribute_dataset([torch.ones(2)]))
        >>> it.get_next_as_optional().has_value()
        True
        >>> it.get_next_as_optional().has_value()
        False
    """

    def __init__(
        self,
        read: Callable[[], _Step | None],  # this worker's next step, None when it has none
        workers: InputWorkers,
        options: InputOptions,
        template: Callable[[], Any],
        spec_batch_dim: int | None,
        prefetch: bool,
        # The next step, as handed out, when there is nothing to agree on or copy
        # (see NOTE [direct steps]); the steps then come from it alone.
        direct: Callable[[], Any] | None = None,
        # How many steps this worker's epoch has, when its loader knows (see
        # NOTE [end of data]).
        known_steps: Callable[[], int | None] | None = None,
    ) -> None:
        self._read = read
        self._workers = workers
        self._options = options
        self._template_fn = template
        # An empty batch of the data's structure, as (structure, leaves).
        self._template: tuple[Any, list[Any]] | None = None
        self._spec_batch_dim = spec_batch_dim
        # Steps read ahead, each with the loader's state after it (NOTE [input position]).
        self._buffer: collections.deque[tuple[_Step, Any]] = collections.deque()
        self._depth = options.experimental_per_replica_buffer_size if prefetch else 0
        self._cpu_only = workers.cpu_only
        self._done = False
        self._element_spec: Any = None
        self._direct = direct
        self._known_steps = known_steps
        self._horizon: int | None = None  # steps every worker is known to have
        self._taken = 0
        self._copies = _CopyStreams()
        # NOTE [input position]: set by the dataset that made this iterator.
        self._owner: Any = None
        self._epoch = 0
        self._random_state: dict[str, Any] | None = None
        self._loader: Any = None  # a StatefulDataLoader, whose state is the position
        self._draws: _position.RecordedDraws | None = None
        self._steps = 0
        self._position: Any = None  # the loader's state after the last step handed out

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        _check_not_in_replica_context("next(iterator)")
        if self._direct is not None:
            value = self._direct()
            if self._template is None:  # for element_spec: the first step's structure
                self._template = _template_of(select_replica(0, value))
            self._steps += 1
            return value
        if not self._buffer:
            step = self._prepare()
            if step is None:
                raise StopIteration
            self._buffer.append((step, self._snapshot()))
        step, position = self._buffer.popleft()
        while len(self._buffer) < self._depth:
            ahead = self._prepare()
            if ahead is None:
                break
            self._buffer.append((ahead, self._snapshot()))
        self._copies.wait(step)
        self._steps += 1
        self._position = position
        return step.value()

    def _skip_without_reading(self, steps: int) -> bool:
        """Skips ``steps`` batches by their indices alone, where one batch of a
        single-process loader is one step of one worker (no data is loaded)."""
        draws = self._draws
        if draws is None or self._workers.num_workers != 1 or self._buffer or self._steps:
            return False
        return draws.skip_indices(steps)

    @property
    def steps(self) -> int:
        """Global steps handed out in this epoch (counting those before a restore)."""
        return self._steps

    def _snapshot(self) -> Any:
        return self._loader.state_dict() if self._loader is not None else None

    # -- position (NOTE [input position]) ------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this iterator is: the epoch, the global steps handed out, and the
        loader's state or the random state its epoch started from.

        Raises:
            InvalidArgumentError: the data is a Python iterator or generator, which
                cannot start again: pass a DataLoader (or torchdata's
                StatefulDataLoader) to checkpoint the input position.
        """
        if self._owner is None or self._random_state is None:
            raise InvalidArgumentError(
                "this iterator's position cannot be saved: its data is a Python iterator or "
                "generator, which cannot start again at a given batch. Pass a DataLoader (or "
                "torchdata's StatefulDataLoader, which resumes without reading the batches "
                "before), or leave the iterator out of the checkpoint"
            )
        position = self._snapshot() if self._direct is not None else self._position
        return {
            "shuffle_seeds": [s._seed for s in self._owner._seeded_samplers()],
            "epoch": self._epoch,
            "steps": self._steps,
            "loader": position,
            "random_state": self._random_state,
            "first_draw": self._draws.state() if self._draws is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Moves this iterator to ``state`` (from `state_dict`): the next step is the
        one after the last step handed out when it was saved, with the same shuffle."""
        owner = self._owner
        if owner is None:
            raise InvalidArgumentError(
                "this iterator's position cannot be restored: its data is a Python iterator "
                "or generator; pass a DataLoader"
            )
        owner._epoch = int(state["epoch"]) - 1  # the next iter() starts that epoch
        seeded = owner._seeded_samplers()
        for sampler, seed in zip(seeded, state.get("shuffle_seeds", ())):
            sampler._seed = int(seed)  # the order every worker agreed on when saving
        steps = int(state["steps"])
        # Making this iterator drew from torch's generator (a DataLoader iterator draws
        # its base seed); it stands in for the saved one, whose draws were made before
        # the save, so torch's generator goes back to before this one was made.
        before_this = self._random_state["cpu"] if self._random_state is not None else None
        if state.get("loader") is not None and self._loader is not None:
            self._loader.load_state_dict(state["loader"])
            fresh = iter(owner)
            fresh._taken = fresh._steps = steps
            fresh._random_state = state["random_state"]
        else:
            generators = owner._generators()
            with _position.replayed_random_state(state["random_state"], generators):
                if hasattr(owner, "_replay_first_draw"):
                    owner._replay_first_draw = state.get("first_draw")
                fresh = iter(owner)
                if fresh._skip_without_reading(steps):
                    fresh._taken = fresh._steps = steps
                else:
                    for _ in range(steps):  # the same shuffle; their data is read again
                        next(fresh)
        self.__dict__.update(fresh.__dict__)
        if before_this is not None:
            torch.set_rng_state(before_this)

    def get_next(self) -> Any:
        """The next step's element; raises `StopIteration` at the end of data."""
        return next(self)

    def get_next_as_optional(self) -> OptionalValue:
        """The next step's element as an `OptionalValue`, empty at the end of data."""
        try:
            return OptionalValue(next(self), has_value=True)
        except StopIteration:
            return OptionalValue(None, has_value=False)

    @property
    def element_spec(self) -> Any:
        """`TensorSpec` nest of one replica's element: from the first step taken, or
        before any, from the dataset's first element."""
        if self._element_spec is None:
            structure, empty = self._empty_template()
            self._element_spec = _spec(_pack(structure, empty), self._spec_batch_dim)
        return self._element_spec

    def _empty_template(self) -> tuple[Any, list[Any]]:
        if self._template is None:
            self._template = _template_of(self._template_fn())
        return self._template

    def _has_template(self) -> bool:
        """Whether this worker knows (or can read) what an empty batch looks like."""
        try:
            self._empty_template()
        except InvalidArgumentError:  # no data here to infer it from
            return False
        return True

    def _exchange_template(self) -> None:
        """Every worker shares its empty batch; one that has none takes another's."""
        try:
            mine = pickle.dumps(self._template) if self._template is not None else b""
        except Exception:  # cannot be shared; the others still need this worker's call
            mine = b""
        theirs = self._workers.gather_across_workers(mine)
        if self._template is None:
            # Bytes from this job's own workers: as trusted as the process group itself.
            self._template = pickle.loads(next(t for t in theirs if t))

    def _agree_horizon(self) -> int:
        """The number of steps every worker is known to have: the least of their
        loaders' lengths (one exchange per epoch), 0 where one cannot tell."""
        mine = self._known_steps() if self._known_steps is not None else None
        if self._workers.num_workers == 1:
            return 0  # nothing to agree on: the sum across workers is free
        theirs = self._workers.gather_across_workers(str(-1 if mine is None else mine).encode())
        lengths = [int(t) for t in theirs]
        return 0 if min(lengths) < 0 else min(lengths)

    def _prepare(self) -> _Step | None:
        if self._done:
            return None
        if self._horizon is None:
            self._horizon = self._agree_horizon()
        step = self._read()
        workers = self._workers
        local = workers.local_replicas
        have = 0 if step is None else local - len(step.missing)
        if self._template is None and step is not None and have:
            self._template = step.template()
        if self._taken < self._horizon:
            # NOTE [end of data]: every worker's loader said it has this step, so
            # there is nothing to agree on (DDP-like: no collective, no host sync).
            self._taken += 1
            if step is None:
                raise InvalidArgumentError(
                    f"worker {workers.worker_index}'s DataLoader ended after {self._taken - 1} "
                    f"batches, but its len() promised at least {self._horizon}, which the other "
                    "workers relied on; make the dataset's __len__ match what it yields"
                )
            return self._finish(step)
        self._taken += 1
        # A worker with no data at all (an empty shard) cannot know what an empty
        # batch looks like: it asks, in the same all-reduce as the end-of-data count.
        need = int((step is None or bool(step.missing)) and not self._has_template())
        total = workers.sum_across_workers(have + need * _NEED_TEMPLATE)
        if total % _NEED_TEMPLATE == 0:
            self._done = True
            return None
        if total >= _NEED_TEMPLATE:
            self._exchange_template()
        if step is None:
            structure, empty = self._empty_template()
            columns = [[_MISSING] * local for _ in empty]
            step = _Step(structure, columns, local, missing=range(local))
        return self._finish(step)

    def _finish(self, step: _Step) -> _Step:
        """Fills the replicas without data with empty batches; starts the copies."""
        if step.missing:
            structure, empty = self._empty_template()
            step = step.filled(structure, empty)
        if self._options.experimental_fetch_to_device:
            step = step.to(self._workers.devices, self._cpu_only, self._copies)
        return step


class DistributedDataset:
    """A dataset whose every step is split across the strategy's replicas.

    Made by ``strategy.experimental_distribute_dataset(dataset, options)``.
    Iterating it again starts a new epoch (samplers get ``set_epoch(epoch)``).

    Example::

        >>> import torch, distribute as ds
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> loader = torch.utils.data.DataLoader(torch.arange(100), batch_size=10)
        >>> first = next(iter(strategy.experimental_distribute_dataset(loader)))
        >>> [t.tolist() for t in first.values]
        [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    """

    def __init__(
        self, dataset: Any, input_workers: InputWorkers, options: InputOptions | None = None
    ) -> None:
        options = InputOptions() if options is None else options
        if options.experimental_replication_mode is not InputReplicationMode.PER_WORKER:
            raise InvalidArgumentError(
                "InputReplicationMode.PER_REPLICA works only with "
                "strategy.distribute_datasets_from_function; "
                "experimental_distribute_dataset splits each worker's batches itself."
            )
        self._workers = input_workers
        self._options = options
        self._dataset = dataset
        self._source = _make_source(dataset, input_workers, options.auto_shard_policy)
        # OFF with several workers: every worker reads every global batch, split into
        # one sub-batch per replica in sync, and takes its local replicas' share of
        # that stream one step at a time (so a replica's batch is G/N, as in TF).
        self._every_worker_reads_all = (
            input_workers.num_workers > 1
            and options.auto_shard_policy is AutoShardPolicy.OFF
            and not (
                isinstance(dataset, DataLoader) and isinstance(dataset.sampler, DistributedSampler)
            )
        )
        self._epoch = -1
        self._replay_first_draw: dict[str, Any] | None = None  # NOTE [input position]

    def __iter__(self) -> DistributedIterator:
        self._epoch += 1
        if self._epoch > 0 and isinstance(self._dataset, Iterator):
            warnings.warn(
                f"A {type(self._dataset).__name__} given to experimental_distribute_dataset is "
                "an iterator, which can be iterated once: this pass continues where the last "
                "one stopped and is empty if it ended. Pass a re-iterable (a DataLoader, a "
                "list, or an object whose __iter__ starts over) for several epochs",
                stacklevel=2,
            )
        positionable = not isinstance(self._dataset, Iterator)
        generators = self._generators()
        random_state = _position.random_state(generators) if positionable else None
        draws = _position.RecordedDraws(
            self._source.batches(self._epoch), generators, replay=self._replay_first_draw
        )
        self._replay_first_draw = None
        batches: Iterator[Any] = draws
        workers = self._workers
        slice_global = self._source.slice_global
        local = workers.local_replicas
        exhausted = False
        every_worker_reads_all = self._every_worker_reads_all
        pending: collections.deque[tuple[Any, list[Any]]] = collections.deque()

        def read() -> _Step | None:
            # A loop, not a recursive call: a closure that refers to itself is a
            # reference cycle, which kept the finished epoch's loader iterator (a
            # DataLoader's worker processes and pipes) until the cyclic collector ran.
            nonlocal exhausted
            while not pending:
                if exhausted:
                    return None
                try:
                    batch = next(batches)
                except StopIteration:
                    exhausted = True
                    draws.close()  # the epoch's loader iterator goes now
                    return None
                batch = _wrap_examples(batch)
                leaves, nest = _leaves_and_nest(batch)
                if slice_global:
                    start, stop = sharding.worker_slice(
                        _leaves_len(leaves, batch),
                        num_workers=workers.num_workers,
                        local_replicas=local,
                        worker_index=workers.worker_index,
                    )
                    return split(batch, _slice_leaves(leaves, start, stop), None)
                if not every_worker_reads_all:
                    return split(batch, leaves, nest)
                sizes = sharding.split_sizes(
                    _leaves_len(leaves, batch), workers.num_replicas_in_sync
                )
                for k in range(workers.num_workers):
                    start, stop = sum(sizes[: k * local]), sum(sizes[: (k + 1) * local])
                    if stop > start:  # only a partial last batch leaves some empty
                        pending.append((batch, _slice_leaves(leaves, start, stop)))
            batch, leaves = pending.popleft()
            return split(batch, leaves, None)

        def split(batch: Any, leaves: list[Any], nest: Any) -> _Step:
            if local == 1:
                return _Step(batch, [(x,) for x in leaves], 1, nest=nest)
            sizes = _split_sizes(_leaves_len(leaves, batch), local)
            columns = [
                x.split_with_sizes(sizes)
                if isinstance(x, torch.Tensor) and x.dim() > 0
                else x.split(sizes)
                if type(x) is _Examples
                else (x,) * local
                for x in leaves
            ]
            # The pieces are views of the leaves: one device check for all of them.
            return _Step(batch, columns, local, on_cpu=_all_on_cpu(leaves))

        fetch = self._options.experimental_fetch_to_device

        def direct() -> Any:
            # NOTE [direct steps]: with one worker there is nothing to agree on, and
            # with nothing to copy (CPU replicas, or no fetching to devices) nothing
            # to read ahead, so each step is made from a batch as it comes
            # (StopIteration at the end comes from `batches`). The common batch (a
            # tensor, or a flat tuple or list of CPU tensors) is split without the
            # column bookkeeping of `_Step`; the per-step cost is then the split
            # itself (see benchmarks/bench_dataset.py).
            nonlocal exhausted
            if exhausted:  # stays ended: `batches` may be shared (persistent workers)
                raise StopIteration
            try:
                batch = next(batches)
            except StopIteration:
                exhausted = True
                draws.close()  # the epoch's loader iterator goes now
                raise
            size = _flat_cpu_batch_size(batch)
            if size < 0:
                batch = _wrap_examples(batch)
                leaves, nest = _leaves_and_nest(batch)
                step = split(batch, leaves, nest)
                # Only a batch not on the CPU has anything to move, to the CPU replicas.
                return (step.to(workers.devices, cpu_only=True) if fetch else step).value()
            if local == 1:
                return batch
            if type(batch) is _Tensor:
                return PerReplica(batch.split_with_sizes(_split_sizes(size, local)))
            sizes = _split_sizes(size, local)
            return type(batch)([PerReplica(x.split_with_sizes(sizes)) for x in batch])

        iterator = DistributedIterator(
            read,
            workers,
            self._options,
            self._peek,
            self._batch_dim(),
            prefetch=True,
            direct=direct if workers.num_workers == 1 and (workers.cpu_only or not fetch) else None,
            known_steps=None if every_worker_reads_all else self._source.known_steps,
        )
        if positionable:
            iterator._owner = self
            iterator._epoch = self._epoch
            iterator._random_state = random_state
            iterator._draws = draws
            loader = self._source.iterable
            iterator._loader = loader if _position.is_stateful(loader) else None
        return iterator

    def _generators(self) -> list[torch.Generator]:
        """The generators an epoch's shuffle draws from (NOTE [input position])."""
        return _position.generators_of(self._source.iterable)

    def _seeded_samplers(self) -> list[_SeededRandomSampler]:
        """The samplers whose agreed seed orders the workers' shuffle."""
        loader = self._source.iterable
        batch_sampler = getattr(loader, "batch_sampler", None)
        inner = getattr(batch_sampler, "_inner", batch_sampler)
        sampler = getattr(inner, "sampler", None)
        return [sampler] if isinstance(sampler, _SeededRandomSampler) else []

    def _batch_dim(self) -> int | None:
        loader = self._dataset
        if isinstance(loader, DataLoader) and loader.drop_last and loader.batch_size is not None:
            n = self._workers.num_replicas_in_sync
            if loader.batch_size % n == 0 and not isinstance(loader.dataset, FileShardable):
                return loader.batch_size // n
        return None

    def _peek(self) -> Any:
        """One replica's element, read without the end-of-data agreement."""
        if isinstance(self._dataset, DataLoader) and not isinstance(
            self._dataset.dataset, IterableDataset
        ):
            loader = self._dataset
            if loader.batch_size is not None and len(loader.dataset) > 0:  # type: ignore[arg-type]
                return _normalize(loader.collate_fn([loader.dataset[0]]))
        batch = _first_batch(self._source.iterable)
        if batch is not _MISSING:
            return _normalize(batch)
        raise InvalidArgumentError(
            f"Worker {self._workers.worker_index} has no data to infer the element structure "
            "from: the "
            "dataset is empty, or has fewer elements than workers."
        )

    @property
    def element_spec(self) -> Any:
        """`TensorSpec` nest of one replica's element; the batch dimension is
        ``None`` when partial batches are possible."""
        return _spec(self._peek(), self._batch_dim())


class DistributedDatasetsFromFunction:
    """Input pipelines built by a function, one per worker (or per replica).

    Each element the pipeline yields is one replica's batch: no rebatching or
    sharding is done. With PER_WORKER and several local replicas, consecutive
    elements go to consecutive local replicas.

    Example::

        >>> import torch, distribute as ds
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> def dataset_fn(ctx):
        ...     return [torch.full((2,), float(i)) for i in range(4)]
        >>> step = next(iter(strategy.distribute_datasets_from_function(dataset_fn)))
        >>> [t.tolist() for t in step.values]
        [[0.0, 0.0], [1.0, 1.0]]
    """

    def __init__(
        self,
        dataset_fn: Callable[[InputContext], Any],
        input_workers: InputWorkers,
        options: InputOptions | None = None,
    ) -> None:
        options = InputOptions() if options is None else options
        self._workers = input_workers
        self._options = options
        w = input_workers
        if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            self._pipelines = [
                dataset_fn(
                    InputContext(
                        w.num_replicas_in_sync,
                        w.worker_index * w.local_replicas + r,
                        w.num_replicas_in_sync,
                    )
                )
                for r in range(w.local_replicas)
            ]
        else:
            self._pipelines = [
                dataset_fn(InputContext(w.num_workers, w.worker_index, w.num_replicas_in_sync))
            ]
        for pipeline in self._pipelines:
            if not isinstance(pipeline, Iterable):
                raise InvalidArgumentError(
                    "dataset_fn must return an iterable of per-replica batches (a "
                    "DataLoader, say), got "
                    f"{type(pipeline).__name__}."
                )
        self._pipelines = [_Replay(p) if isinstance(p, Iterator) else p for p in self._pipelines]
        self._epoch = -1

    def __iter__(self) -> DistributedIterator:
        self._epoch += 1
        for pipeline in self._pipelines:
            _set_epoch(getattr(pipeline, "sampler", None), self._epoch)
            _set_epoch(getattr(pipeline, "batch_sampler", None), self._epoch)
        positionable = not any(isinstance(p, _Replay) for p in self._pipelines)
        random_state = _position.random_state(self._generators()) if positionable else None
        iterators = [iter(p) for p in self._pipelines]
        done = [False] * len(iterators)
        local = self._workers.local_replicas

        def take(k: int) -> Any:
            if done[k]:
                return _MISSING
            try:
                return _normalize(next(iterators[k]))
            except StopIteration:
                done[k] = True
                return _MISSING

        def read() -> _Step | None:
            batches = [take(0 if len(iterators) == 1 else r) for r in range(local)]
            present = [r for r, b in enumerate(batches) if b is not _MISSING]
            if not present:
                return None
            first = batches[present[0]]
            for r in present[1:]:
                assert_same_structure(
                    first, batches[r], f"batches of replica {present[0]} and replica {r}"
                )
            per_replica = [_leaves(b) if b is not _MISSING else None for b in batches]
            columns = [
                [_MISSING if leaves is None else leaves[i] for leaves in per_replica]
                for i in range(len(per_replica[present[0]] or ()))
            ]
            missing = [r for r in range(local) if batches[r] is _MISSING]
            nest = first if local == 1 else None
            return _Step(first, columns, local, missing=missing, nest=nest)

        iterator = DistributedIterator(
            read, self._workers, self._options, self._template, None, prefetch=False
        )
        if positionable:
            iterator._owner = self
            iterator._epoch = self._epoch
            iterator._random_state = random_state
        return iterator

    def _seeded_samplers(self) -> list[_SeededRandomSampler]:
        return []

    def _generators(self) -> list[torch.Generator]:
        """The generators an epoch of the pipelines draws from (NOTE [input position])."""
        found: list[torch.Generator] = []
        for pipeline in self._pipelines:
            found += [
                g for g in _position.generators_of(pipeline) if all(g is not f for f in found)
            ]
        return found

    def _template(self) -> Any:
        for p in self._pipelines:
            batch = _first_batch(p)
            if batch is not _MISSING:
                return _normalize(batch)
        raise InvalidArgumentError(
            "dataset_fn produced no data to infer the element structure from."
        )

    @property
    def element_spec(self) -> Any:
        """`TensorSpec` nest of one replica's element, from the pipeline's first batch.

        The batch dimension is known only for a DataLoader with ``drop_last=True``.
        """
        pipeline = self._pipelines[0]
        batch_dim = None
        if isinstance(pipeline, DataLoader) and pipeline.drop_last:
            batch_dim = pipeline.batch_size
        return _spec(self._template(), batch_dim)


# -- NumPy input ------------------------------------------------------------------------


class _ArrayDataset(torch.utils.data.Dataset[Any]):
    def __init__(self, structure: Any) -> None:
        self._structure = structure
        self._leaves = [torch.as_tensor(np.asarray(x)) for x in flatten(structure)]
        lengths = {len(x) for x in self._leaves}
        if len(lengths) != 1:
            raise InvalidArgumentError(
                f"make_numpy_dataset needs arrays of one length, got lengths {sorted(lengths)}."
            )
        self._length = lengths.pop()

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        return pack_sequence_as(self._structure, [x[index] for x in self._leaves])

    def __getitems__(self, indices: list[int]) -> list[Any]:
        index = torch.as_tensor(indices)
        return [_Collated(pack_sequence_as(self._structure, [x[index] for x in self._leaves]))]


class _Collated:
    """A batch already gathered by fancy indexing; `_collate_arrays` unwraps it."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch


def _collate_arrays(items: list[Any]) -> Any:
    if len(items) == 1 and isinstance(items[0], _Collated):
        return items[0].batch
    return torch.utils.data.default_collate(items)


def make_numpy_dataset(
    arrays: Any, batch_size: int, *, shuffle: bool = False, seed: int = 0, drop_last: bool = False
) -> DataLoader[Any]:
    """A DataLoader over in-memory NumPy arrays, batched with the global batch size.

    Args:
      arrays: an array or a nest (tuple, dict, ...) of arrays of one length.
      batch_size: the GLOBAL batch size.
      shuffle: reshuffle every epoch (the order depends on ``seed`` and the epoch only).
      seed: the shuffling seed.
      drop_last: drop the last partial batch.

    Example::

        >>> import numpy as np, distribute as ds
        >>> loader = ds.data.make_numpy_dataset((np.zeros((10, 3)), np.arange(10)), batch_size=4)
        >>> [b[1].tolist() for b in loader][-1]
        [8, 9]
    """
    dataset = _ArrayDataset(arrays)
    generator = torch.Generator()
    generator.manual_seed(seed)
    sampler: Sampler[int] = (
        RandomSampler(dataset, generator=generator)
        if shuffle
        else torch.utils.data.SequentialSampler(dataset)
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        collate_fn=_collate_arrays,
    )
