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
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from distribute.data import _position, sharding
from distribute.data._batches import (
    _MISSING,
    _all_on_cpu,
    _Examples,
    _flat_cpu_batch_size,
    _leaves,
    _leaves_and_nest,
    _leaves_len,
    _normalize,
    _slice_leaves,
    _spec,
    _split_sizes,
    _Step,
    _Tensor,
    _wrap_examples,
)
from distribute.data._iterator import DistributedIterator
from distribute.data._sources import (
    FileShardable,
    _first_batch,
    _make_source,
    _Replay,
    _SeededRandomSampler,
    _set_epoch,
)
from distribute.data._workers import InputWorkers
from distribute.data.options import (
    AutoShardPolicy,
    InputContext,
    InputOptions,
    InputReplicationMode,
)
from distribute.errors import InvalidArgumentError
from distribute.values import (
    PerReplica,
    assert_same_structure,
)

__all__ = ["DistributedDataset", "DistributedDatasetsFromFunction"]


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
