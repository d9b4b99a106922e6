"""NumPy arrays (and nests of them) as a dataset of examples (`make_numpy_dataset`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler

from distribute.errors import InvalidArgumentError
from distribute.values import (
    flatten,
    pack_sequence_as,
)

__all__ = ["Collated", "Tensors", "collate_arrays", "make_numpy_dataset"]


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
        return [Collated(pack_sequence_as(self._structure, [x[index] for x in self._leaves]))]


class Tensors(torch.utils.data.TensorDataset):
    """A `TensorDataset` that gathers a batch with one index per tensor, as Keras
    slices its arrays and `tf.data` batches its slices (NOTE [batched tensor
    datasets] in `_sources.py`): DataLoader's fetcher calls ``__getitems__`` with the
    batch's indices, where a plain TensorDataset builds every example and
    ``default_collate`` stacks them. Same values, dtypes, shapes and containers."""

    def __getitems__(self, indices: list[int]) -> list[Any]:
        tensors = self.tensors
        if any(t.device.type != "cpu" for t in tensors):
            # An index would be copied to the device, a host sync a batch: the
            # examples one by one instead, as a TensorDataset gives them.
            return [tuple(t[i] for t in tensors) for i in indices]
        start = indices[0] if indices else 0
        if indices == list(range(start, start + len(indices))):  # unshuffled: a slice,
            # copied (a batch never shares memory with the dataset, as a stack does not)
            rows = slice(start, start + len(indices))
            batch = [torch.clone(t[rows], memory_format=torch.contiguous_format) for t in tensors]
        else:
            index = torch.as_tensor(indices)  # on the CPU, with the tensors
            batch = [t[index] for t in tensors]
        # A list, as `default_collate` makes of tuple examples.
        return [Collated(batch)]


class Collated:
    """A batch already gathered by fancy indexing; `collate_arrays` unwraps it."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch


def collate_arrays(items: list[Any]) -> Any:
    if len(items) == 1 and isinstance(items[0], Collated):
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
        collate_fn=collate_arrays,
    )
