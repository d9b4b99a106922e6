"""Distributed input: options, split/shard arithmetic and distributed datasets.

Example::

    >>> import torch, distribute as ds
    >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> loader = torch.utils.data.DataLoader(torch.arange(8), batch_size=4)
    >>> dist = strategy.experimental_distribute_dataset(loader)
    >>> [b.values[1].tolist() for b in dist]
    [[2, 3], [6, 7]]
"""

from __future__ import annotations

from distribute.data import sharding
from distribute.data._arrays import make_numpy_dataset
from distribute.data._batches import TensorSpec
from distribute.data._iterator import DistributedIterator, OptionalValue
from distribute.data._sources import FileShardable
from distribute.data._workers import InputWorkers
from distribute.data.dataset import DistributedDataset, DistributedDatasetsFromFunction
from distribute.data.options import (
    AutoShardPolicy,
    InputContext,
    InputOptions,
    InputReplicationMode,
    ValueContext,
)

__all__ = [
    "AutoShardPolicy",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "FileShardable",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "InputWorkers",
    "OptionalValue",
    "TensorSpec",
    "ValueContext",
    "make_numpy_dataset",
    "sharding",
]
