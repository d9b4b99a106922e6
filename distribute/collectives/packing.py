"""Grouping of many small tensors into few collectives.

Two rules, both from tf.distribute:

* :func:`pack_by_bytes` walks the tensors (in reverse by default, because
  gradients become ready last layer first) and closes a pack once its size
  exceeds ``bytes_per_pack``; ``0`` puts everything into one pack.
* :func:`split_num_packs` cuts one concatenated buffer into ``num_packs``
  chunks, the last one taking the remainder.

And the buffers themselves, for all-reducing many small tensors in one go:

* :func:`pack_tensors` copies one replica's tensors into one contiguous buffer
  per dtype (one concatenation each, in C++) and records their layout, so that
  replicas compare layouts with one tuple comparison instead of tensor by tensor;
* :func:`sum_packs` adds the replicas' buffers;
* :func:`unpack_tensors` cuts a buffer back into tensors of the original shapes,
  as views of it (no copy).

Nothing here loops over the tensors in Python except to read their shapes and
dtypes: with 1,000 small tensors, a Python step per tensor costs more than the
arithmetic.

Example::

    >>> import torch
    >>> from distribute.collectives.packing import (
    ...     pack_by_bytes, pack_tensors, split_num_packs, unpack_tensors
    ... )
    >>> pack_by_bytes([4, 4, 4], bytes_per_pack=5)
    [[2, 1], [0]]
    >>> split_num_packs(10, 3)
    [3, 3, 4]
    >>> p = pack_tensors([torch.ones(2, 2), torch.arange(3.0)])
    >>> p.flats[0].tolist(), p.groups
    ([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 2.0], None)
    >>> [t.shape for t in unpack_tensors(p.flats, p.shapes, p.groups)]
    [torch.Size([2, 2]), torch.Size([3])]
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from distribute import _torch
from distribute.errors import InvalidArgumentError

__all__ = [
    "PackedTensors",
    "pack_by_bytes",
    "pack_tensors",
    "shaped_views",
    "slot_views",
    "split_num_packs",
    "sum_packs",
    "unpack_tensors",
]


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

        >>> from distribute.collectives.packing import pack_by_bytes
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

        >>> from distribute.collectives.packing import split_num_packs
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


# -- buffers ----------------------------------------------------------------------------

_dtype_of = operator.attrgetter("dtype")
_shape_of = operator.attrgetter("shape")


@dataclass(frozen=True, eq=False)
class PackedTensors:
    """One replica's tensors, copied into one contiguous 1-D buffer per dtype.

    Attributes:
        flats: one buffer per dtype, in the order of each dtype's first tensor.
        groups: the indices of the tensors in each buffer, in order; ``None`` when
            every tensor has the same dtype (one buffer, holding them all).
        dtypes: each tensor's dtype, in the original order.
        shapes: each tensor's shape, in the original order.
        owned: whether every buffer is a fresh copy that nothing else refers to,
            so that a reduction may accumulate into it in place. A lone tensor
            of its dtype is not copied: its buffer is a view of it.
    """

    flats: tuple[torch.Tensor, ...]
    groups: tuple[tuple[int, ...], ...] | None
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[torch.Size, ...]
    owned: bool

    def same_layout(self, other: PackedTensors) -> bool:
        """Whether `other` packed as many tensors as this, with the same shapes and dtypes."""
        return self.shapes == other.shapes and self.dtypes == other.dtypes

    def describe(self) -> str:
        """The layout as text, e.g. ``[float32[2, 3], int64[]]``, for error messages."""
        return (
            "["
            + ", ".join(
                f"{str(d).removeprefix('torch.')}{list(s)}"
                for d, s in zip(self.dtypes, self.shapes)
            )
            + "]"
        )


def _flatten(tensors: list[torch.Tensor], shapes: Sequence[torch.Size]) -> torch.Tensor:
    """A contiguous 1-D copy of `tensors`, one after another (a view of a lone tensor)."""
    if len(tensors) > 1 and len(shapes[0]) >= 1 and len(set(shapes)) == 1:
        # Equal shapes, the common case: a plain concatenation is the fastest kernel.
        return torch.cat(tensors).view(-1)
    if len(tensors) > 1 and all(len(s) == 1 for s in shapes):
        return torch.cat(tensors)
    return _torch.flatten_dense_tensors(tensors)


def _unflatten(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of consecutive pieces of `flat`, one per shape."""
    if len(shapes) == 1:
        return [flat.view(shapes[0])]
    if not shapes:
        return []
    if len(set(shapes)) == 1:  # equal shapes: one view, then one unbind, whatever the rank
        return list(flat.view(len(shapes), *shapes[0]).unbind(0))
    pieces = flat.split_with_sizes([s.numel() for s in shapes])
    return [p if len(s) == 1 else p.view(s) for p, s in zip(pieces, shapes)]


def slot_views(flat: torch.Tensor, templates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of consecutive pieces of `flat`, one per template, shaped like it.

    `flat` may be longer than the templates together (trailing elements, such as
    flags riding in a buffer, are left out).

    Example:
        >>> import torch
        >>> from distribute.collectives.packing import slot_views
        >>> a, b = slot_views(torch.arange(7.0), [torch.zeros(2, 2), torch.zeros(2)])
        >>> a.tolist(), b.tolist()
        ([[0.0, 1.0], [2.0, 3.0]], [4.0, 5.0])
    """
    return shaped_views(flat, [t.shape for t in templates])


def shaped_views(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """`slot_views` from the shapes alone (a hot path's, computed once: a distributed
    variable's own `.shape` and `.numel()` go through its `__torch_function__`).

    Example:
        >>> import torch
        >>> from distribute.collectives.packing import shaped_views
        >>> shapes = [torch.Size([2]), torch.Size([])]
        >>> [v.tolist() for v in shaped_views(torch.arange(5.0), shapes)]
        [[0.0, 1.0], 2.0]
    """
    numel = sum(map(math.prod, shapes))  # no generator frame: a hot path
    if flat.numel() != numel:
        flat = flat[:numel]
    return _unflatten(flat, shapes)


def pack_tensors(tensors: Sequence[torch.Tensor]) -> PackedTensors:
    """Copies `tensors` into one contiguous 1-D buffer per dtype.

    The buffers are differentiable when a tensor requires a gradient and grad
    mode is on; call under `torch.no_grad()` to pack values only.

    Example::

        >>> import torch
        >>> from distribute.collectives.packing import pack_tensors
        >>> p = pack_tensors([torch.ones(2), torch.tensor([7]), torch.zeros(1)])
        >>> [f.tolist() for f in p.flats], p.groups
        ([[1.0, 1.0, 0.0], [7]], ((0, 2), (1,)))
    """
    tensors = list(tensors)
    dtypes = tuple(map(_dtype_of, tensors))
    shapes = tuple(map(_shape_of, tensors))
    distinct = dict.fromkeys(dtypes)
    flats: tuple[torch.Tensor, ...]
    if len(distinct) <= 1:
        flats = (_flatten(tensors, shapes),) if tensors else ()
        return PackedTensors(flats, None, dtypes, shapes, owned=len(tensors) != 1)
    groups = tuple(tuple(j for j, d in enumerate(dtypes) if d is dtype) for dtype in distinct)
    flats = tuple(
        _flatten([tensors[j] for j in group], [shapes[j] for j in group]) for group in groups
    )
    return PackedTensors(flats, groups, dtypes, shapes, owned=all(len(g) > 1 for g in groups))


def sum_packs(packs: Sequence[PackedTensors], device: torch.device) -> list[torch.Tensor]:
    """Adds the replicas' buffers, dtype by dtype, on `device`.

    Every pack must have the same layout (see `PackedTensors.same_layout`). The
    sum goes into the first pack's buffers when it owns them and they are on
    `device`, else into new buffers; the other packs are only read.

    Returns:
        One buffer per dtype, in the packs' order, that no input aliases.

    Example::

        >>> import torch
        >>> from distribute.collectives.packing import pack_tensors, sum_packs
        >>> a, b = pack_tensors([torch.ones(2)]), pack_tensors([torch.ones(2)])
        >>> sum_packs([a, b], torch.device("cpu"))[0].tolist()
        [2.0, 2.0]
    """
    totals = []
    first_owned = packs[0].owned
    for k, first in enumerate(packs[0].flats):
        others = [p.flats[k].to(device) for p in packs[1:]]
        if first_owned and first.device == device:
            total = first
        elif others:
            total = torch.add(first.to(device), others.pop(0))
        else:
            total = first.to(device, copy=True)
        for other in others:
            total.add_(other)
        totals.append(total)
    return totals


def unpack_tensors(
    flats: Sequence[torch.Tensor],
    shapes: Sequence[torch.Size],
    groups: Sequence[Sequence[int]] | None,
) -> list[torch.Tensor]:
    """Cuts buffers laid out by `pack_tensors` back into tensors of `shapes`.

    Every result is a view of its buffer (no copy). A buffer's dtype may differ
    from the dtype it was packed from (the MEAN of integers is float64).

    Args:
        flats: one buffer per dtype, like `PackedTensors.flats`.
        shapes: the packed tensors' shapes, in their original order.
        groups: `PackedTensors.groups` of the same pack.

    Returns:
        One tensor per shape, in the original order.
    """
    if groups is None:
        return _unflatten(flats[0], shapes) if shapes else []
    out: list[torch.Tensor] = [flats[0]] * len(shapes)
    for flat, group in zip(flats, groups):
        for j, piece in zip(group, _unflatten(flat, [shapes[j] for j in group])):
            out[j] = piece
    return out
