"""Input for `TPUStrategy`'s SPMD mode: global batches, sharded along the data axis.

In SPMD mode `fn` runs once over the global batch, so a step's element is the
global batch itself (not a `PerReplica`), its tensors placed on the XLA device with
dim 0 split over the mesh's ``"data"`` axis. A background thread loads and places
the next batches while the devices run the current step (torch_xla's parallel
loader does the same), `prefetch` batches ahead.

Example::

    dataset = XlaShardedDataset(lambda: iter(loader), place=layout.place_batch)
    for batch in dataset:            # tensors on XLA, dim 0 sharded over "data"
        strategy.run(step, args=(batch,))
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from distribute import values
from distribute.data.dataset import OptionalValue, _check_not_in_replica_context
from distribute.data.options import InputContext

__all__ = ["XlaShardedDataset", "XlaShardedIterator", "global_batches"]

_END = object()


def global_batches(
    dataset_fn: Callable[[InputContext], Any], num_replicas: int
) -> Callable[[], Iterator[Any]]:
    """`distribute_datasets_from_function` for one SPMD program: each global batch is
    ``num_replicas`` consecutive per-replica batches of ``dataset_fn``'s iterable,
    concatenated along dim 0 (what replica mode's replicas would take, in order)."""

    def source() -> Iterator[Any]:
        it = iter(dataset_fn(InputContext(1, 0, num_replicas)))
        while True:
            parts = []
            for _ in range(num_replicas):
                try:
                    parts.append(next(it))
                except StopIteration:
                    break
            if not parts:
                return
            yield values.map_structure(_concat, *parts)
            if len(parts) < num_replicas:
                return

    return source


def _concat(*leaves: Any) -> Any:
    if isinstance(leaves[0], torch.Tensor) and leaves[0].dim() > 0:
        return torch.cat(leaves)
    return leaves[0]


class XlaShardedDataset:
    """An iterable of placed global batches; each `iter()` starts the source again.

    Args:
        source: makes a fresh iterator of host batches.
        place: moves one batch to the device (and shards it).
        prefetch: batches placed ahead of the one being used.
    """

    def __init__(
        self,
        source: Callable[[], Iterator[Any]],
        place: Callable[[Any], Any],
        prefetch: int = 2,
    ) -> None:
        self._source = source
        self._place = place
        self._prefetch = max(int(prefetch), 1)

    def __iter__(self) -> XlaShardedIterator:
        _check_not_in_replica_context("iter(dataset)")
        return XlaShardedIterator(self._source(), self._place, self._prefetch)


class XlaShardedIterator:
    """Yields placed global batches, loaded and transferred by a background thread.

    An error in the source or the transfer is raised by the `next` that would have
    returned that batch. Abandoning the iterator stops the thread after at most
    `prefetch` more batches.
    """

    def __init__(self, source: Iterator[Any], place: Callable[[Any], Any], prefetch: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._done = False
        self._steps = 0
        self._thread = threading.Thread(
            target=self._fill, args=(source, place), name="distribute-xla-input", daemon=True
        )
        self._thread.start()

    def _fill(self, source: Iterator[Any], place: Callable[[Any], Any]) -> None:
        try:
            for batch in source:
                item = place(batch)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._put_final(_END)
        except BaseException as exc:  # delivered to the consumer's next()
            self._put_final(exc)

    def _put_final(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> XlaShardedIterator:
        return self

    def __next__(self) -> Any:
        _check_not_in_replica_context("next(iterator)")
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._steps += 1
        return item

    @property
    def steps(self) -> int:
        """The batches this iterator has handed out."""
        return self._steps

    def get_next(self) -> Any:
        """The next global batch; raises `StopIteration` at the end of data."""
        return next(self)

    def get_next_as_optional(self) -> OptionalValue:
        """The next global batch as an `OptionalValue`, empty at the end of data."""
        try:
            return OptionalValue(next(self), has_value=True)
        except StopIteration:
            return OptionalValue(None, has_value=False)

    def __del__(self) -> None:
        self._stop.set()
