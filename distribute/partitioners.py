"""Variable partitioners: how many shards a variable is split into along dim 0.

`ParameterServerStrategy(variable_partitioner=...)` calls a partitioner with a
variable's shape and dtype; it returns the number of shards per dimension (only
dim 0 may be split). The shard sizes follow TensorFlow's div rule: ``n`` rows over
``k`` shards give the first ``n % k`` shards one row more (13 rows over 5 shards:
3, 3, 3, 2, 2). Scalars are never split, and a variable is never split into more
shards than it has rows.

Example:
    >>> import torch
    >>> from distribute.partitioners import FixedShardsPartitioner, shard_sizes
    >>> FixedShardsPartitioner(5)(torch.Size([13, 4]), torch.float32)
    [5, 1]
    >>> shard_sizes(13, 5)
    [3, 3, 3, 2, 2]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from distribute.errors import InvalidArgumentError

__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
    "shard_sizes",
]


def shard_sizes(rows: int, shards: int) -> list[int]:
    """Rows per shard by the div rule: the first ``rows % shards`` get one more.

    Example:
        >>> from distribute.partitioners import shard_sizes
        >>> shard_sizes(13, 5)
        [3, 3, 3, 2, 2]
    """
    shards = max(1, min(shards, rows)) if rows else 1
    base, extra = divmod(rows, shards)
    return [base + (1 if i < extra else 0) for i in range(shards)]


def _partition(shape: Sequence[int], shards: int) -> list[int]:
    if not shape:
        return []  # a scalar is never split
    return [max(1, min(int(shards), int(shape[0]))), *([1] * (len(shape) - 1))]


class Partitioner:
    """Base: ``partitioner(shape, dtype)`` -> shards per dimension.

    Example:
        >>> import torch
        >>> from distribute.partitioners import Partitioner
        >>> class Halves(Partitioner):
        ...     def __call__(self, shape, dtype):
        ...         return [2, *([1] * (len(shape) - 1))] if shape else []
        >>> Halves()((10, 4), torch.float32)
        [2, 1]
    """

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> list[int]:
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """A fixed number of shards (fewer when the variable has fewer rows).

    Example:
        >>> import torch
        >>> from distribute.partitioners import FixedShardsPartitioner
        >>> FixedShardsPartitioner(2)(torch.Size([10, 3]), torch.float32)
        [2, 1]
    """

    def __init__(self, num_shards: int) -> None:
        if num_shards < 1:
            raise InvalidArgumentError(f"num_shards must be >= 1, got {num_shards}")
        self._num_shards = int(num_shards)

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> list[int]:
        return _partition(shape, self._num_shards)


class MinSizePartitioner(Partitioner):
    """About ``total_bytes / min_shard_bytes`` shards (rounded up), at most ``max_shards``.

    TensorFlow's rule (`min_max_variable_partitioner`): ``ceil(bytes /
    min_shard_bytes)`` shards, capped by ``max_shards`` and the rows.

    Example:
        >>> import torch
        >>> from distribute.partitioners import MinSizePartitioner
        >>> MinSizePartitioner(min_shard_bytes=48, max_shards=8)(torch.Size([10, 4]), torch.float32)
        [4, 1]
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1) -> None:
        if min_shard_bytes < 1 or max_shards < 1:
            raise InvalidArgumentError(
                f"min_shard_bytes and max_shards must be >= 1, got {min_shard_bytes}, {max_shards}"
            )
        self._min = int(min_shard_bytes)
        self._max = int(max_shards)

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> list[int]:
        total = math.prod(shape) * dtype.itemsize
        return _partition(shape, max(1, min(self._max, math.ceil(total / self._min))))


class MaxSizePartitioner(Partitioner):
    """The fewest shards that keep each at most ``max_shard_bytes`` (capped by ``max_shards``).

    Example:
        >>> import torch
        >>> from distribute.partitioners import MaxSizePartitioner
        >>> MaxSizePartitioner(max_shard_bytes=64)(torch.Size([10, 4]), torch.float32)
        [3, 1]
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None) -> None:
        if max_shard_bytes < 1 or (max_shards is not None and max_shards < 1):
            raise InvalidArgumentError(
                f"max_shard_bytes and max_shards must be >= 1, got {max_shard_bytes}, {max_shards}"
            )
        self._max_bytes = int(max_shard_bytes)
        self._max_shards = max_shards

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> list[int]:
        if not shape:
            return []
        row_bytes = max(1, math.prod(shape[1:]) * dtype.itemsize)
        rows_per_shard = max(1, self._max_bytes // row_bytes)
        shards = math.ceil(int(shape[0]) / rows_per_shard)
        if self._max_shards is not None:
            shards = min(shards, self._max_shards)
        return _partition(shape, shards)
