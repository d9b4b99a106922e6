"""Where a worker's batches come from: the DataLoader rewrapped so that each worker
loads only its block of every global batch (DATA), its files (FILE), or everything
(OFF), shuffled in the order every worker agrees on.
"""

from __future__ import annotations

import collections
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    TensorDataset,
    default_collate,
)
from torch.utils.data.distributed import DistributedSampler

from distribute.data import _position, sharding
from distribute.data._arrays import Tensors, collate_arrays
from distribute.data._batches import _MISSING
from distribute.data._workers import InputWorkers
from distribute.data.options import (
    AutoShardPolicy,
)
from distribute.errors import InvalidArgumentError

__all__ = ["FileShardable"]

logger = logging.getLogger(__name__)


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


def _batched_tensors(loader: DataLoader[Any]) -> DataLoader[Any]:
    """NOTE [batched tensor datasets]: a plain DataLoader over a plain `TensorDataset`
    with torch's default collation (the tutorials' loader) is read through `Tensors`,
    which gathers each batch with one index per tensor: the same batches, without a
    Python call and a stack per example (issue 40: ~100 us of a 64-example step, on
    the host, every step). Its batch sampler and sampler are kept, so epochs,
    shuffling and positions are the user's. Any other loader is read as it is."""
    if (
        type(loader) is not DataLoader
        or type(loader.dataset) is not TensorDataset
        or loader.collate_fn is not default_collate
        or loader.batch_sampler is None
    ):
        return loader
    return _rebuild_loader(
        loader,
        dataset=Tensors(*loader.dataset.tensors),
        batch_sampler=loader.batch_sampler,
        collate_fn=collate_arrays,
    )


def _loader_source(
    loader: DataLoader[Any], workers: InputWorkers, policy: AutoShardPolicy
) -> _Source:
    loader = _batched_tensors(loader)
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
