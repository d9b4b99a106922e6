"""What `Model.fit` / `evaluate` / `predict` accept as data, made into distributed input.

Arrays and tensors (``x``, ``y``, ``sample_weight``) become a DataLoader of the
GLOBAL batch size, shuffled for `fit` in an order that is a function of a seed
(drawn from torch's generator, agreed by the workers) and the epoch alone, so
every strategy and world size trains on the same batches; DataLoaders and
datasets the user made are distributed as they are. The global batch size of
each step is known where the loader can say it (a map-style dataset and a batch
size: ``min(B, N - i * B)``), so the loss of a partial last batch is averaged
over the examples it really has; elsewhere it is counted from the batch and, with
several workers, summed across them (one small all-reduce per step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from distribute.data._arrays import Tensors, collate_arrays
from distribute.data._sources import _SeededRandomSampler
from distribute.data.dataset import DistributedDataset, DistributedDatasetsFromFunction
from distribute.errors import InvalidArgumentError
from distribute.values import flatten

__all__ = ["Data", "adapt", "split_arrays", "unpack"]

_ARRAYS = (np.ndarray, torch.Tensor, list)


class Data:
    """Distributed input and what is known of its global batch sizes.

    Args:
        dataset: the distributed dataset.
        sizes: the global batch size of step ``i``, where known.
        steps: steps per pass over the data, where known.
    """

    def __init__(self, dataset: Any, sizes: Callable[[int], int] | None, steps: int | None) -> None:
        self.dataset = dataset
        self.sizes = sizes
        self.steps = steps


def _tensor(a: Any, name: str) -> torch.Tensor:
    try:
        t = torch.as_tensor(np.asarray(a) if isinstance(a, list) else a)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"{name} must be an array or tensor, got {type(a).__name__}: {e}"
        ) from None
    if t.dtype == torch.float64:
        t = t.float()  # Keras feeds float32, as the model's parameters are
    return t


def split_arrays(
    x: Any, y: Any, sample_weight: Any, fraction: float
) -> tuple[tuple[Any, Any, Any], tuple[Any, Any, Any]]:
    """Keras's ``validation_split``: the last ``fraction`` of the arrays, before any
    shuffling, is held out."""
    if not 0.0 < fraction < 1.0:
        raise InvalidArgumentError(f"validation_split must be in (0, 1), got {fraction}")
    if not isinstance(x, _ARRAYS):
        raise InvalidArgumentError(
            "validation_split works with arrays or tensors only; for DataLoaders and "
            "datasets pass validation_data"
        )
    n = len(x)
    cut = int(n * (1.0 - fraction))
    if cut in (0, n):
        raise InvalidArgumentError(
            f"validation_split={fraction} of {n} examples leaves a side empty"
        )

    def part(a: Any, sl: slice) -> Any:
        return None if a is None else a[sl]

    head, tail = slice(0, cut), slice(cut, n)
    return (x[head], part(y, head), part(sample_weight, head)), (
        x[tail],
        part(y, tail),
        part(sample_weight, tail),
    )


def _known_sizes(loader: DataLoader[Any]) -> tuple[Callable[[int], int], int] | None:
    batch_sampler = loader.batch_sampler
    if (
        isinstance(loader.sampler, DistributedSampler)  # a per-worker batch size
        or isinstance(loader.dataset, IterableDataset)
        or type(batch_sampler) is not BatchSampler
        or not hasattr(batch_sampler.sampler, "__len__")
    ):
        return None
    n = len(batch_sampler.sampler)  # type: ignore[arg-type]
    b = batch_sampler.batch_size
    steps = len(batch_sampler)
    return (lambda i: min(b, n - i * b)), steps


def adapt(
    strategy: Any,
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    batch_size: int | None = None,
    shuffle: bool = False,
) -> Data:
    """``x`` (and ``y``, ``sample_weight``) as distributed input of ``strategy``."""
    if isinstance(x, (DistributedDataset, DistributedDatasetsFromFunction)):
        return Data(x, None, None)
    loader: DataLoader[Any] | None = None
    if isinstance(x, DataLoader):
        loader = x
    elif isinstance(x, Dataset):
        # An IterableDataset cannot be shuffled here: `shuffle` is ignored (Keras's
        # for a dataset or a generator).
        loader = DataLoader(
            x,
            batch_size=batch_size or 32,
            shuffle=shuffle and not isinstance(x, IterableDataset),
        )
    elif isinstance(x, _ARRAYS):
        arrays = [_tensor(x, "x")]
        for a, name in ((y, "y"), (sample_weight, "sample_weight")):
            if a is not None:
                arrays.append(_tensor(a, name))
        if any(len(a) != len(arrays[0]) for a in arrays):
            raise InvalidArgumentError(
                f"x, y and sample_weight must have as many examples; got {[len(a) for a in arrays]}"
            )
        if len(arrays[0]) == 0:
            raise InvalidArgumentError("got no data: x has no examples")
        dataset = Tensors(*arrays)
        sampler = None
        if shuffle:
            # An order that is a function of (seed, epoch) alone, the seed agreed by
            # the workers: every strategy and world size shuffles alike.
            seed = _agreed_seed(strategy, int(torch.randint(2**62, ()).item()))
            sampler = _SeededRandomSampler(RandomSampler(dataset), seed)
        size = batch_size or 32
        # Static shapes (XLA): a last, partial batch is padded to the full size with
        # weight-0 rows, so it runs the step already compiled (Keras on TPUs does too);
        # without targets (predict) with zero rows, whose outputs predict drops.
        pad = bool(len(dataset) % size) and strategy.extended.static_batch_shapes
        loader = DataLoader(
            dataset,
            batch_size=size,
            sampler=sampler,
            collate_fn=_PadToFull(size, add_weights=y is not None and sample_weight is None)
            if pad
            else collate_arrays,
        )
    elif isinstance(x, dict) or isinstance(y, dict):
        raise InvalidArgumentError(
            "dicts of arrays are not taken as x or y; pass a DataLoader (or a Dataset) "
            "whose batches are (inputs, targets) with dicts inside"
        )
    elif y is None:  # an iterable of batches
        return Data(strategy.experimental_distribute_dataset(x), None, None)
    else:
        raise InvalidArgumentError(
            f"x must be arrays, tensors, a DataLoader, a Dataset or a distributed dataset; got "
            f"{type(x).__name__}"
        )
    if y is not None and not isinstance(x, _ARRAYS):
        raise InvalidArgumentError(
            "y is given with arrays only; a DataLoader yields (x, y) batches"
        )
    known = _known_sizes(loader)
    return Data(
        strategy.experimental_distribute_dataset(loader),
        known[0] if known else None,
        known[1] if known else None,
    )


def _agreed_seed(strategy: Any, seed: int) -> int:
    """Worker 0's ``seed`` on every worker."""
    cross = strategy.extended.cross_worker
    if cross is None:
        return seed
    return int(cross.all_reduce_int(seed if cross.rank == 0 else 0, "shuffle seed"))


def unpack(data: Any) -> tuple[Any, Any, Any]:
    """Keras's ``(x, y, sample_weight)`` of a batch: a tuple or list of one to three."""
    if isinstance(data, (tuple, list)):
        if len(data) == 1:
            return data[0], None, None
        if len(data) == 2:
            return data[0], data[1], None
        if len(data) == 3:
            return data[0], data[1], data[2]
    return data, None, None


def local_batch_size(strategy: Any, batch: Any) -> int:
    """Examples in this worker's part of a distributed batch (its first tensor's rows)."""
    x, _, _ = unpack(batch)
    for leaf in flatten(x):
        local = strategy.experimental_local_results(leaf)
        if all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in local):
            return sum(int(t.shape[0]) for t in local)
    raise InvalidArgumentError("cannot tell the batch size: the batch's x has no tensor")


class _PadToFull:
    """Collates a batch of (x[, y[, sample_weight]]) and pads a partial one to
    ``size`` rows of zeros. With targets the padding rows weigh 0: every batch gets a
    sample weight (``add_weights``: 1 for real rows where the data has none), so every
    step has the same structure and shapes."""

    def __init__(self, size: int, *, add_weights: bool) -> None:
        self._size = size
        self._add_weights = add_weights

    def __call__(self, samples: list[Any]) -> tuple[torch.Tensor, ...]:
        parts = list(collate_arrays(samples))
        n = len(parts[0])
        if self._add_weights:
            parts.append(torch.ones(n))
        missing = self._size - n
        if missing <= 0:
            return tuple(parts)
        return tuple(
            torch.cat([part, part.new_zeros((missing, *part.shape[1:]))]) for part in parts
        )
