"""In-process reductions across local replica devices (`CrossDeviceOps`).

`ReductionToOneDevice` sums on one device and copies the result to every
destination. `HierarchicalCopyAllReduce` and `NcclAllReduce` all-reduce packs of
tensors across distinct GPUs (`torch.cuda.comm` / `torch.cuda.nccl`); as in
tf.distribute, any other placement (CPU replicas, several replicas on one GPU)
falls back to `ReductionToOneDevice`, which gives the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from distribute._enums import ReduceOp
from distribute.collectives._shapes import check_matching_shapes
from distribute.collectives.packing import pack_tensors, split_num_packs, unpack_tensors
from distribute.errors import CollectiveMismatchError, InvalidArgumentError
from distribute.values import DistributedValues, Mirrored

__all__ = ["CrossDeviceOps", "HierarchicalCopyAllReduce", "NcclAllReduce", "ReductionToOneDevice"]


def _components(value: Any) -> list[torch.Tensor]:
    if isinstance(value, DistributedValues):
        return [torch.as_tensor(v) for v in value.values]
    from distribute.variables import DistributedVariable

    if isinstance(value, DistributedVariable):
        return list(value.values)
    return [torch.as_tensor(value)]


def _destination_devices(destinations: Any, fallback: Sequence[torch.Tensor]) -> list[torch.device]:
    if destinations is None:
        return [t.device for t in fallback]
    if isinstance(destinations, (str, torch.device)):
        return [torch.device(destinations)]
    if isinstance(destinations, torch.Tensor) and not isinstance(destinations, DistributedValues):
        from distribute.variables import DistributedVariable

        if isinstance(destinations, DistributedVariable):
            return [v.device for v in destinations.values]
        return [destinations.device]
    if isinstance(destinations, DistributedValues):
        return [torch.as_tensor(v).device for v in destinations.values]
    if isinstance(destinations, (list, tuple)):
        return [torch.device(d) for d in destinations]
    raise InvalidArgumentError(
        f"destinations must be a device, a device list, a tensor, a variable or a "
        f"DistributedValues, got {type(destinations).__name__}"
    )


class CrossDeviceOps:
    """Base class of in-process reductions across local replica devices.

    Example:
        >>> import distribute as ds, torch
        >>> ops = ds.ReductionToOneDevice()
        >>> r = ops.reduce("sum", ds.PerReplica((torch.tensor(1.), torch.tensor(2.))), "cpu")
        >>> r.values
        (tensor(3.),)
    """

    def reduce(
        self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any
    ) -> Mirrored:
        """Reduces `per_replica_value` and places the result on `destinations`."""
        return self.batch_reduce(reduce_op, [(per_replica_value, destinations)])[0]

    def batch_reduce(
        self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]
    ) -> list[Mirrored]:
        """Reduces several (value, destinations) pairs."""
        op = ReduceOp.from_value(reduce_op)
        return [self._reduce_one(op, v, d) for v, d in value_destination_pairs]

    def broadcast(self, tensor: Any, destinations: Any) -> Mirrored:
        """Copies `tensor` to every destination device."""
        t = torch.as_tensor(tensor)
        devices = _destination_devices(destinations, [t])
        return Mirrored([t.to(d, copy=True) for d in devices])

    def _reduce_one(self, op: ReduceOp, value: Any, destinations: Any) -> Mirrored:
        return _reduce_to_one_device(op, value, destinations, None)


def _reduce_to_one_device(
    op: ReduceOp, value: Any, destinations: Any, reduce_to_device: torch.device | None
) -> Mirrored:
    components = _components(value)
    check_matching_shapes(components, None, f"{op.name} reduction")
    devices = _destination_devices(destinations, components)
    target = reduce_to_device or devices[0]
    total = components[0].detach().to(target, copy=True)
    for c in components[1:]:
        total += c.detach().to(target)
    if op is ReduceOp.MEAN:
        total = _mean(total, len(components))
    return Mirrored([total.to(d, copy=True) for d in devices])


class ReductionToOneDevice(CrossDeviceOps):
    """Sums on one device (the first destination by default), then copies out.

    Args:
        reduce_to_device: where the sum is computed.

    Example:
        >>> import distribute as ds
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"],
        ...                                cross_device_ops=ds.ReductionToOneDevice())
        >>> float(strategy.reduce("sum", ds.PerReplica((1.0, 2.0)), axis=None))
        3.0
    """

    def __init__(self, reduce_to_device: str | torch.device | None = None) -> None:
        self._device = torch.device(reduce_to_device) if reduce_to_device is not None else None

    def _reduce_one(self, op: ReduceOp, value: Any, destinations: Any) -> Mirrored:
        return _reduce_to_one_device(op, value, destinations, self._device)


def _mean(total: torch.Tensor, n: int) -> torch.Tensor:
    """``total / n``; integers give float64, as everywhere in the library."""
    return total / n if total.is_floating_point() else total.double() / n


def packed_all_reduce(
    op: ReduceOp,
    per_replica: Sequence[Sequence[torch.Tensor]],
    num_packs: int,
    *,
    nccl: bool = True,
) -> list[list[torch.Tensor]]:
    """All-reduces lists of tensors (one list per replica) in `num_packs` chunks.

    TF's rule: every replica's tensors are concatenated into one flat buffer (one
    per dtype here), split into `num_packs` chunks (the last takes the
    remainder), and each chunk is reduced; `num_packs == 0` reduces tensor by
    tensor.

    ``nccl``: chunks on distinct GPUs are summed with ``torch.cuda.nccl``; otherwise
    (and for other devices) by copies to the first device and back (TF's
    hierarchical copy).

    Returns:
        One list of reduced tensors per replica, on that replica's devices: views
            of one buffer per replica and dtype.

    Raises:
        InvalidArgumentError: `num_packs < 0`.
        CollectiveMismatchError: the replicas' tensors differ in number, shape or dtype.
    """
    if num_packs < 0:
        raise InvalidArgumentError(f"num_packs must be >= 0, got {num_packs}")
    n = len(per_replica)
    devices = [p[0].device for p in per_replica]
    if num_packs == 0:
        outs = []
        for j in range(len(per_replica[0])):
            reduced = _reduce_to_one_device(
                op, Mirrored([p[j] for p in per_replica]), devices, None
            )
            outs.append(reduced.values)
        return [[outs[j][r] for j in range(len(outs))] for r in range(n)]
    with torch.no_grad():
        packs = [pack_tensors(p) for p in per_replica]
    for r, pack in enumerate(packs[1:], start=1):
        if not packs[0].same_layout(pack):
            raise CollectiveMismatchError(
                f"packed all-reduce: replica 0 passed {packs[0].describe()} but replica {r} "
                f"passed {pack.describe()}; every replica must pass as many tensors, with "
                "the same shapes and dtypes, in the same order"
            )
    reduced_flats: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for k in range(len(packs[0].flats)):
        flats = [p.flats[k] for p in packs]
        chunk_sizes = split_num_packs(flats[0].numel(), num_packs)
        reduced_chunks: list[list[torch.Tensor]] = [[] for _ in range(n)]
        for chunks in zip(*(f.split_with_sizes(chunk_sizes) for f in flats)):
            if nccl and all(c.is_cuda for c in chunks) and len({c.device for c in chunks}) == n:
                outputs = [c.clone() for c in chunks]
                torch.cuda.nccl.all_reduce(outputs)  # type: ignore[no-untyped-call]  # torch.cuda.nccl is untyped
                if op is ReduceOp.MEAN:
                    outputs = [_mean(o, n) for o in outputs]
            else:
                outputs = list(
                    _reduce_to_one_device(
                        op, Mirrored(chunks), [c.device for c in chunks], None
                    ).values
                )
            for r in range(n):
                reduced_chunks[r].append(outputs[r])
        for r in range(n):
            chunks_r = reduced_chunks[r]
            reduced_flats[r].append(chunks_r[0] if len(chunks_r) == 1 else torch.cat(chunks_r))
    return [unpack_tensors(reduced_flats[r], packs[r].shapes, packs[r].groups) for r in range(n)]


class _AllReduceOps(CrossDeviceOps):
    _nccl = True  # whether distinct GPUs sum with torch.cuda.nccl

    def __init__(self, num_packs: int = 1) -> None:
        if num_packs < 0:
            raise InvalidArgumentError(
                f"num_packs must be >= 0, got {num_packs} (0 reduces tensor by tensor)"
            )
        self._num_packs = num_packs

    @property
    def num_packs(self) -> int:
        """The number of chunks the concatenated tensors are split into."""
        return self._num_packs

    def batch_reduce(
        self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]
    ) -> list[Mirrored]:
        op = ReduceOp.from_value(reduce_op)
        if not value_destination_pairs:
            return []
        per_value = [_components(v) for v, _ in value_destination_pairs]
        devices_ok = all(
            len(c) > 1
            and all(t.is_cuda for t in c)
            and len({t.device for t in c}) == len(c)
            and [t.device for t in c] == _destination_devices(d, c)
            for c, (_, d) in zip(per_value, value_destination_pairs)
        )
        if not devices_ok:  # TF: anything but one replica per distinct GPU falls back
            return [_reduce_to_one_device(op, v, d, None) for v, d in value_destination_pairs]
        n = len(per_value[0])
        per_replica = [[c[r] for c in per_value] for r in range(n)]
        reduced = packed_all_reduce(op, per_replica, self._num_packs, nccl=self._nccl)
        return [Mirrored([reduced[r][j] for r in range(n)]) for j in range(len(per_value))]


class HierarchicalCopyAllReduce(_AllReduceOps):
    """Packed all-reduce across distinct GPUs by copies (TF's hierarchical copy):
    each chunk is summed on the first GPU and copied back, without NCCL.

    Args:
        num_packs: chunks the concatenated tensors are split into (>= 0).

    Example:
        >>> import distribute as ds
        >>> ds.HierarchicalCopyAllReduce(num_packs=2).num_packs
        2
    """

    _nccl = False


class NcclAllReduce(_AllReduceOps):
    """Packed all-reduce across distinct GPUs with `torch.cuda.nccl`.

    Args:
        num_packs: chunks the concatenated tensors are split into (>= 0).

    Example:
        >>> import distribute as ds
        >>> ds.NcclAllReduce().num_packs
        1
    """
