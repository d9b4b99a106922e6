"""Grouping of many small tensors into few collectives.

Two rules, both from tf.distribute:

* :func:`pack_by_bytes` walks the tensors (in reverse by default, because
  gradients become ready last layer first) and closes a pack once its size
  exceeds ``bytes_per_pack``; ``0`` puts everything into one pack.
* :func:`split_num_packs` cuts one concatenated buffer into ``num_packs``
  chunks, the last one taking the remainder.

Example::

    >>> pack_by_bytes([4, 4, 4], bytes_per_pack=5)
    [[2, 1], [0]]
    >>> split_num_packs(10, 3)
    [3, 3, 4]
"""

from __future__ import annotations

from collections.abc import Sequence

from distribute.errors import InvalidArgumentError

__all__ = ["pack_by_bytes", "split_num_packs"]


def pack_by_bytes(
    nbytes: Sequence[int],
    bytes_per_pack: int,
    *,
    first_pack_bytes: int | None = None,
    reverse: bool = True,
) -> list[list[int]]:
    """Groups tensor indices into packs of roughly ``bytes_per_pack`` bytes.

    Args:
      nbytes: size in bytes of each tensor, in their natural order.
      bytes_per_pack: a pack is closed once its size exceeds this; ``0``
        means a single pack holding every tensor.
      first_pack_bytes: optional smaller limit for the first pack, so the
        first collective can start early (as DDP's first bucket does).
      reverse: walk the tensors from the last to the first.

    Returns:
      Lists of indices into ``nbytes``, in walk order; every index appears
      exactly once.

    Example::

        >>> pack_by_bytes([8, 8, 8, 8], bytes_per_pack=0)
        [[3, 2, 1, 0]]
    """
    if bytes_per_pack < 0:
        raise InvalidArgumentError(f"bytes_per_pack must be >= 0, got {bytes_per_pack}.")
    if first_pack_bytes is not None and first_pack_bytes < 0:
        raise InvalidArgumentError(f"first_pack_bytes must be >= 0, got {first_pack_bytes}.")
    order = list(range(len(nbytes)))
    if reverse:
        order.reverse()
    if not order:
        return []
    if bytes_per_pack == 0:
        return [order]
    packs: list[list[int]] = []
    current: list[int] = []
    size = 0
    limit = bytes_per_pack if first_pack_bytes is None else first_pack_bytes
    for index in order:
        if nbytes[index] < 0:
            raise InvalidArgumentError(f"tensor {index} has a negative size {nbytes[index]}.")
        current.append(index)
        size += nbytes[index]
        if size > limit:
            packs.append(current)
            current, size, limit = [], 0, bytes_per_pack
    if current:
        packs.append(current)
    return packs


def split_num_packs(numel: int, num_packs: int) -> list[int]:
    """Splits ``numel`` elements into ``num_packs`` chunk sizes.

    Every chunk gets ``numel // num_packs`` elements and the last one also
    takes the remainder. When there are fewer elements than packs, one chunk
    holds them all (a chunk is never empty unless ``numel`` is ``0``).

    Example::

        >>> split_num_packs(7, 2)
        [3, 4]
    """
    if num_packs < 0:
        raise InvalidArgumentError(f"num_packs must be >= 0, got {num_packs}.")
    if numel < 0:
        raise InvalidArgumentError(f"numel must be >= 0, got {numel}.")
    if num_packs <= 1 or numel < num_packs:
        return [numel]
    base = numel // num_packs
    return [base] * (num_packs - 1) + [numel - base * (num_packs - 1)]
