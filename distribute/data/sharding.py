"""Pure split and shard arithmetic for distributed input.

Everything here is a function of indices and counts, so it is tested without a
process group. The layout of one global batch of ``G`` elements over
``N = num_workers * local_replicas`` replicas (TF's rebatching rule):

* the first ``G mod N`` replicas get ``ceil(G / N)`` elements, the rest
  ``floor(G / N)``;
* replica ``g`` (global id, ``worker_index * local_replicas + local id``) takes
  the contiguous elements after those of replicas ``0 .. g-1``.

tf.distribute computes each worker's sizes as the ceil-then-floor list rotated by
``worker_index * local_replicas`` and keeps the first ``local_replicas`` of them;
that is exactly the worker's block of the layout above, which is how it is
computed here.

Example: 7 elements over 2 workers with 2 local replicas each::

    >>> from distribute.data.sharding import split_sizes, worker_replica_sizes, worker_slice
    >>> split_sizes(7, 4)
    [2, 2, 2, 1]
    >>> worker_replica_sizes(7, num_workers=2, local_replicas=2, worker_index=1)
    [2, 1]
    >>> worker_slice(7, num_workers=2, local_replicas=2, worker_index=1)
    (4, 7)
"""

from __future__ import annotations

from collections.abc import Sequence

from distribute.errors import InvalidArgumentError

__all__ = [
    "offsets",
    "shard_files",
    "split_sizes",
    "worker_replica_sizes",
    "worker_slice",
]


def split_sizes(batch_size: int, num_replicas: int) -> list[int]:
    """Sizes of ``num_replicas`` sub-batches of a batch: ceil first, then floor.

    Example::

        >>> from distribute.data.sharding import split_sizes
        >>> split_sizes(9, 2)
        [5, 4]
    """
    if num_replicas < 1:
        raise InvalidArgumentError(f"num_replicas must be >= 1, got {num_replicas}.")
    if batch_size < 0:
        raise InvalidArgumentError(f"batch_size must be >= 0, got {batch_size}.")
    base, remainder = divmod(batch_size, num_replicas)
    return [base + 1] * remainder + [base] * (num_replicas - remainder)


def _check_worker(num_workers: int, local_replicas: int, worker_index: int) -> None:
    if num_workers < 1 or local_replicas < 1:
        raise InvalidArgumentError(
            f"num_workers and local_replicas must be >= 1, got {num_workers} and {local_replicas}."
        )
    if not 0 <= worker_index < num_workers:
        raise InvalidArgumentError(
            f"worker_index must be in [0, {num_workers}), got {worker_index}."
        )


def worker_replica_sizes(
    global_batch: int, *, num_workers: int, local_replicas: int, worker_index: int
) -> list[int]:
    """Sizes of the sub-batches of one worker's local replicas.

    Example::

        >>> from distribute.data.sharding import worker_replica_sizes
        >>> worker_replica_sizes(3, num_workers=2, local_replicas=1, worker_index=1)
        [1]
    """
    _check_worker(num_workers, local_replicas, worker_index)
    sizes = split_sizes(global_batch, num_workers * local_replicas)
    offset = worker_index * local_replicas
    rotated = sizes[offset:] + sizes[:offset]
    return rotated[:local_replicas]


def worker_slice(
    global_batch: int, *, num_workers: int, local_replicas: int, worker_index: int
) -> tuple[int, int]:
    """``(start, stop)`` of one worker's elements within a global batch.

    Example::

        >>> from distribute.data.sharding import worker_slice
        >>> worker_slice(10, num_workers=2, local_replicas=1, worker_index=1)
        (5, 10)
    """
    _check_worker(num_workers, local_replicas, worker_index)
    sizes = split_sizes(global_batch, num_workers * local_replicas)
    start = sum(sizes[: worker_index * local_replicas])
    return start, start + sum(
        sizes[worker_index * local_replicas : (worker_index + 1) * local_replicas]
    )


def offsets(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive pieces with the given sizes.

    Example::

        >>> from distribute.data.sharding import offsets
        >>> offsets([2, 1])
        [(0, 2), (2, 3)]
    """
    result = []
    start = 0
    for size in sizes:
        result.append((start, start + size))
        start += size
    return result


def shard_files(num_files: int, *, num_workers: int, worker_index: int) -> list[int]:
    """Indices of the files one worker reads: every ``num_workers``-th one.

    Raises:
      ValueError: when there are fewer files than workers.

    Example::

        >>> from distribute.data.sharding import shard_files
        >>> shard_files(5, num_workers=2, worker_index=1)
        [1, 3]
    """
    _check_worker(num_workers, 1, worker_index)
    if num_files < num_workers:
        raise InvalidArgumentError(
            f"FILE auto-sharding needs at least one file per worker: {num_files} files for "
            f"{num_workers} workers. Split the data into more files, or use "
            "InputOptions(auto_shard_policy=AutoShardPolicy.DATA)."
        )
    return list(range(worker_index, num_files, num_workers))
