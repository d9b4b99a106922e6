"""Input for `TPUStrategy`'s SPMD mode: global batches, sharded along the data axis.

In SPMD mode `fn` runs once over the global batch, so a step's element is the
global batch itself (not a `PerReplica`), its tensors sent to the XLA device
already sharded, dim 0 split over the mesh's ``"data"`` axis (one sharded transfer,
as torch_xla's parallel loader does).

Example::

    dataset = XlaShardedDataset(lambda: iter(loader), place=layout.place_batch)
    for batch in dataset:            # tensors on XLA, dim 0 sharded over "data"
        strategy.run(step, args=(batch,))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from distribute import values
from distribute.data._batches import _check_not_in_replica_context
from distribute.data._iterator import OptionalValue
from distribute.data.options import InputContext

__all__ = ["XlaShardedDataset", "XlaShardedIterator", "global_batches"]


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
    """

    def __init__(self, source: Callable[[], Iterator[Any]], place: Callable[[Any], Any]) -> None:
        self._source = source
        self._place = place

    def __iter__(self) -> XlaShardedIterator:
        _check_not_in_replica_context("iter(dataset)")
        return XlaShardedIterator(self._source(), self._place)


class XlaShardedIterator:
    """Yields global batches placed on the device, sharded.

    Batches are placed in the thread that asks for them: a step's graph is cut
    from every live tensor on the device when `run` ends the step, so a batch half
    way through its transfer in another thread would end up in it (NOTE [XLA
    steps]). The transfer still overlaps computation: `run` launches a step
    without waiting for it, and the next batch is loaded and sent while the
    devices compute.
    """

    def __init__(self, source: Iterator[Any], place: Callable[[Any], Any]) -> None:
        self._source = source
        self._place = place
        self._steps = 0

    def __iter__(self) -> XlaShardedIterator:
        return self

    def __next__(self) -> Any:
        _check_not_in_replica_context("next(iterator)")
        batch = self._place(next(self._source))
        self._steps += 1
        return batch

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
