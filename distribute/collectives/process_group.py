"""Cross-process collectives over one `torch.distributed` process group.

`ProcessGroupCollectives` is what `MultiWorkerMirroredStrategy` plugs into its
replica engine: all-reduce (packed), asynchronous all-reduce (gradient buckets),
all-gather of tensors whose sizes differ along one axis, broadcast, and the small
integer sum the input pipeline uses to agree on the end of data.

# NOTE [no silent hangs]
Every collective completes or raises within ``timeout_seconds``:

* The process group is created with a timeout a little shorter than the
  strategy's, so gloo (or nccl) gives up on its own.
* When a collective fails (a timeout, or a peer's connection closing because it
  died), the rank posts ``(sequence number, operation)`` to the rendezvous store
  and waits a short grace period for the other ranks to post theirs. Ranks that
  failed in the same collective post the same sequence number; a rank that is
  dead, or stuck elsewhere, posts nothing (or an older number) and is named as
  missing. Nothing is written to the store on the hot path.
* Mismatched calls (different shapes, dtypes, structures or operations on
  different ranks) are caught before the data moves: the ranks exchange a 64-bit
  hash of their call's signature with one tiny all-gather; on a mismatch every
  rank posts its description to the store and raises an error naming both ranks.
  Hot paths whose layout was checked once (gradient buckets) skip the check.

Example::

    collectives = ProcessGroupCollectives.create(rank, 2, "127.0.0.1", 29500)
    total = collectives.all_reduce([torch.ones(3)], ReduceOp.SUM, name="x")[0]
    collectives.shutdown()
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from distribute._enums import ReduceOp
from distribute.collectives.packing import pack_by_bytes
from distribute.errors import CollectiveMismatchError, CollectiveTimeoutError, InvalidArgumentError

__all__ = ["ProcessGroupCollectives", "AllReduceHandle"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: How long a failing rank waits for the others to report where they are.
_GRACE_SECONDS = 2.0


def _grace(timeout_seconds: float) -> float:
    """The part of the timeout kept for the failure diagnosis."""
    return min(_GRACE_SECONDS, timeout_seconds * 0.25)


def _signature_hash(signature: Any) -> int:
    digest = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _describe(tensors: Sequence[torch.Tensor]) -> str:
    return (
        "["
        + ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)
        + "]"
    )


class AllReduceHandle:
    """An all-reduce in flight; `wait()` returns the reduced tensors."""

    def __init__(
        self,
        owner: ProcessGroupCollectives,
        work: Any,
        flat: torch.Tensor,
        templates: list[torch.Tensor],
        op: ReduceOp,
        name: str,
        seq: int,
    ) -> None:
        self._owner = owner
        self._work = work
        self._flat = flat
        self._templates = templates
        self._op = op
        self._name = name
        self._seq = seq

    def wait(self) -> list[torch.Tensor]:
        """Blocks until the all-reduce is done.

        Raises:
            CollectiveTimeoutError: a peer never arrived (it is named).
        """
        self._owner._guard(self._seq, "all_reduce", self._name, self._work.wait)
        flat = self._owner._finish_reduce(self._flat, self._op)
        return _unflatten(flat, self._templates)


def _unflatten(flat: torch.Tensor, templates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    offset = 0
    for t in templates:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


class ProcessGroupCollectives:
    """Collectives among the worker processes of one process group.

    Build it with `create` (or `adopt` for a group the user initialised). Every
    method must be called by every rank in the same order, as with
    `torch.distributed`.

    Args:
        store: the rendezvous store (used only on failure paths).
        rank: this process's rank.
        world_size: the number of processes.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_seconds: how long a collective may take before it raises.
        owns_group: whether `shutdown` destroys the default process group.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        backend: str,
        timeout_seconds: float,
        owns_group: bool,
    ) -> None:
        self._store = _c10d.PrefixStore("distribute/", store) if store is not None else None
        self._rank = rank
        self._world_size = world_size
        self._backend = backend
        self._timeout = timeout_seconds
        self._owns_group = owns_group
        self._seq = 0
        self._closed = False

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        *,
        backend: str = "gloo",
        timeout_seconds: float = 300.0,
    ) -> ProcessGroupCollectives:
        """Joins (or, on rank 0, serves) the rendezvous and creates the process group.

        Adopts the default group instead when `torch.distributed` is already
        initialised with the same rank and world size.

        Example::

            collectives = ProcessGroupCollectives.create(0, 1, "127.0.0.1", 29500)
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise InvalidArgumentError(
                f"rank must be in [0, world_size={world_size}), got rank {rank}."
            )
        if dist.is_available() and dist.is_initialized():
            if dist.get_rank() != rank or dist.get_world_size() != world_size:
                raise InvalidArgumentError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, but the cluster says rank {rank} of {world_size}; "
                    "destroy the existing group or pass a matching cluster resolver."
                )
            return cls(
                None, rank, world_size, dist.get_backend(), timeout_seconds, owns_group=False
            )
        group_timeout = timeout_seconds - _grace(timeout_seconds)
        store = _c10d.TCPStore(
            master_addr,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=datetime.timedelta(seconds=max(timeout_seconds, 30.0)),
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=group_timeout),
        )
        return cls(store, rank, world_size, backend, timeout_seconds, owns_group=True)

    # -- identity ------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def backend(self) -> str:
        return self._backend

    # -- failure diagnosis -----------------------------------------------------------

    def _next_seq(self) -> int:
        if self._closed:
            raise InvalidArgumentError(
                "The process group was shut down; create a new strategy to run collectives."
            )
        self._seq += 1
        return self._seq

    def _guard(self, seq: int, kind: str, name: str, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except CollectiveMismatchError:
            raise
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._diagnose(seq, kind, name, exc) from exc

    def _diagnose(self, seq: int, kind: str, name: str, exc: BaseException) -> Exception:
        what = f"{kind} '{name}' (collective #{seq})"
        store = self._store
        if store is None:
            return CollectiveTimeoutError(
                f"{what} failed on rank {self._rank}: {exc}. Check that every rank runs the same "
                "collectives and that no process died."
            )
        positions: dict[int, tuple[int, str] | None] = {}
        try:
            grace = _grace(self._timeout)
            store.set_timeout(datetime.timedelta(seconds=max(grace, 0.5)))
            store.set(f"failed/{self._rank}", f"{seq}|{kind} '{name}'")
            deadline = time.monotonic() + grace
            while True:
                for r in range(self._world_size):
                    key = f"failed/{r}"
                    if r != self._rank and store.check([key]):
                        text = store.get(key).decode()
                        their_seq, their_op = text.split("|", 1)
                        positions[r] = (int(their_seq), their_op)
                missing = [
                    r
                    for r in range(self._world_size)
                    if r != self._rank and (r not in positions or positions[r][0] < seq)  # type: ignore[index]  # checked by `r not in positions`
                ]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        except Exception:  # the store's host (rank 0) is gone too
            missing = [r for r in range(self._world_size) if r != self._rank and r not in positions]
            return CollectiveTimeoutError(
                f"{what} failed on rank {self._rank} and the rendezvous store (served by rank 0) "
                f"is unreachable: rank 0 is probably dead. Ranks not heard from: {missing}. "
                f"Original error: {exc}"
            )
        if not missing:
            return CollectiveTimeoutError(
                f"{what} failed on rank {self._rank}: {exc}. Every other rank reached it too; "
                "see their errors."
            )
        details = "; ".join(
            f"rank {r} is dead or stuck before it (no report)"
            if positions.get(r) is None
            else f"rank {r} was at collective #{positions[r][0]} {positions[r][1]}"  # type: ignore[index]  # not None here
            for r in missing
        )
        return CollectiveTimeoutError(
            f"{what} did not complete within {self._timeout:.1f} s: ranks {missing} never arrived "
            f"({details}). Every rank must call the same collectives in the same order; raise "
            "CommunicationOptions(timeout_seconds=...) if a rank is legitimately slow."
        )

    # -- signatures --------------------------------------------------------------------

    def check_same(self, signature: Any, *, name: str) -> None:
        """Raises `CollectiveMismatchError` on every rank unless all pass equal signatures.

        Example::

            collectives.check_same([("float32", 1024)], name="gradient bucket layout")
        """
        seq = self._next_seq()
        self._check_signature(seq, "check_same", name, signature, repr(signature))

    def _check_signature(
        self, seq: int, kind: str, name: str, signature: Any, description: str
    ) -> None:
        if self._world_size == 1:
            return
        mine = torch.tensor([_signature_hash((kind, name, signature))], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self._world_size)]
        mine_dev = self._on_device(mine)
        gathered_dev = [self._on_device(g) for g in gathered]
        self._guard(seq, kind, name, lambda: dist.all_gather(gathered_dev, mine_dev))
        hashes = [int(g.item()) for g in gathered_dev]
        if all(h == hashes[0] for h in hashes):
            return
        odd = next(r for r, h in enumerate(hashes) if h != hashes[0])
        descriptions = self._exchange_descriptions(seq, description, [0, odd])
        raise CollectiveMismatchError(
            f"{kind} '{name}': rank 0 passed {descriptions.get(0, '?')} but rank {odd} passed "
            f"{descriptions.get(odd, '?')}; every rank must pass the same structure, shapes and "
            "dtypes to the same collective, in the same order."
        )

    def _exchange_descriptions(self, seq: int, mine: str, ranks: Sequence[int]) -> dict[int, str]:
        store = self._store
        found: dict[int, str] = {self._rank: mine}
        if store is None:
            return found
        try:
            store.set(f"signature/{seq}/{self._rank}", mine)
            store.set_timeout(datetime.timedelta(seconds=_GRACE_SECONDS * 2))
            for r in ranks:
                if r != self._rank:
                    text = store.get(f"signature/{seq}/{r}").decode()
                    found[r] = text
        except Exception:  # a peer that never posts: describe what we have
            logger.debug("could not read every rank's signature", exc_info=True)
        return found

    # -- data movement -----------------------------------------------------------------

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        if self._backend == "nccl" and not t.is_cuda:
            return t.cuda()
        if self._backend == "gloo" and t.is_cuda:
            return t.cpu()
        return t

    def _finish_reduce(self, flat: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        if op is ReduceOp.MEAN:
            return (
                flat / self._world_size
                if flat.is_floating_point()
                else flat.double() / self._world_size
            )
        return flat

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp,
        *,
        name: str,
        bytes_per_pack: int = 0,
        check: bool = True,
    ) -> list[torch.Tensor]:
        """Sums (or averages) each tensor over the ranks; returns new tensors.

        Tensors of one dtype travel in packs of about ``bytes_per_pack`` bytes
        (0: one pack per dtype), so many small tensors cost few collectives.

        Example::

            total, = collectives.all_reduce([torch.ones(2)], ReduceOp.SUM, name="loss")
        """
        tensors = list(tensors)
        seq = self._next_seq()
        if check:
            self._check_signature(
                seq,
                "all_reduce",
                name,
                [(str(t.dtype), tuple(t.shape)) for t in tensors] + [op.name],
                _describe(tensors),
            )
        if self._world_size == 1:
            return [self._finish_reduce(t.detach().clone(), op) for t in tensors]
        results: list[torch.Tensor | None] = [None] * len(tensors)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(j)
        for dtype, indices in by_dtype.items():
            sizes = [tensors[j].numel() * dtype.itemsize for j in indices]
            for pack in pack_by_bytes(sizes, bytes_per_pack, reverse=False):
                members = [indices[k] for k in pack]
                parts = [tensors[j].detach().reshape(-1) for j in members]
                flat = self._on_device(torch.cat(parts) if len(parts) > 1 else parts[0].clone())
                self._guard(seq, "all_reduce", name, lambda f=flat: dist.all_reduce(f))  # type: ignore[misc]  # default binds the loop value
                flat = self._finish_reduce(flat, op)
                device = tensors[members[0]].device
                if flat.device != device:
                    flat = flat.to(device)
                for j, piece in zip(members, _unflatten(flat, [tensors[j] for j in members])):
                    results[j] = piece
        return [r for r in results if r is not None]

    def all_reduce_async(
        self, tensors: Sequence[torch.Tensor], op: ReduceOp, *, name: str
    ) -> AllReduceHandle:
        """Starts one all-reduce of ``tensors`` (flattened together; one dtype).

        The caller must make every rank start the same all-reduces in the same
        order; no signature check is made (check the layout once with
        `check_same`).

        Example::

            handle = collectives.all_reduce_async([grad], ReduceOp.SUM, name="bucket 0")
            summed, = handle.wait()
        """
        templates = list(tensors)
        seq = self._next_seq()
        parts = [t.detach().reshape(-1) for t in templates]
        flat = self._on_device(torch.cat(parts) if len(parts) > 1 else parts[0])
        if self._world_size == 1:
            return AllReduceHandle(self, _DoneWork(), flat.clone(), templates, op, name, seq)
        work = self._guard(seq, "all_reduce", name, lambda: dist.all_reduce(flat, async_op=True))
        return AllReduceHandle(self, work, flat, templates, op, name, seq)

    def all_gather(self, tensor: torch.Tensor, axis: int, *, name: str) -> torch.Tensor:
        """Concatenates every rank's tensor along ``axis``, in rank order.

        Sizes along ``axis`` may differ between ranks; the other dimensions and the
        dtype must match.

        Example::

            everything = collectives.all_gather(torch.ones(rank + 1, 3), 0, name="preds")
        """
        seq = self._next_seq()
        axis = axis % max(tensor.dim(), 1)
        other_dims = [s for d, s in enumerate(tensor.shape) if d != axis]
        self._check_signature(
            seq,
            "all_gather",
            name,
            (str(tensor.dtype), tensor.dim(), axis, other_dims),
            f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)} along axis {axis}",
        )
        if self._world_size == 1:
            return tensor.detach().clone()
        size = torch.tensor([tensor.shape[axis]], dtype=torch.int64)
        sizes_dev = [self._on_device(torch.zeros_like(size)) for _ in range(self._world_size)]
        size_dev = self._on_device(size)
        self._guard(seq, "all_gather", name, lambda: dist.all_gather(sizes_dev, size_dev))
        sizes = [int(s.item()) for s in sizes_dev]
        longest = max(sizes)
        padded = tensor.detach()
        if tensor.shape[axis] < longest:
            pad_shape = list(tensor.shape)
            pad_shape[axis] = longest - tensor.shape[axis]
            padded = torch.cat([padded, padded.new_zeros(pad_shape)], dim=axis)
        padded = self._on_device(padded.contiguous())
        outputs = [torch.empty_like(padded) for _ in range(self._world_size)]
        self._guard(seq, "all_gather", name, lambda: dist.all_gather(outputs, padded))
        pieces = [o.narrow(axis, 0, s) for o, s in zip(outputs, sizes)]
        return torch.cat(pieces, dim=axis).to(tensor.device)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0, *, name: str) -> None:
        """Overwrites ``tensors`` on every rank with rank ``src``'s, in place.

        Example::

            collectives.broadcast([weight], 0, name="initial values")
        """
        tensors = list(tensors)
        seq = self._next_seq()
        self._check_signature(
            seq,
            "broadcast",
            name,
            ([(str(t.dtype), tuple(t.shape)) for t in tensors], src),
            _describe(tensors),
        )
        if self._world_size == 1 or not tensors:
            return
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(j)
        for indices in by_dtype.values():
            parts = [tensors[j].detach().reshape(-1) for j in indices]
            flat = self._on_device(torch.cat(parts) if len(parts) > 1 else parts[0].clone())
            self._guard(seq, "broadcast", name, lambda f=flat: dist.broadcast(f, src))  # type: ignore[misc]  # default binds the loop value
            for j, piece in zip(indices, _unflatten(flat, [tensors[j] for j in indices])):
                with torch.no_grad():
                    tensors[j].copy_(piece)

    def all_reduce_int(self, value: int, name: str) -> int:
        """The sum of a Python int over the ranks (one tiny collective).

        Example::

            remaining = collectives.all_reduce_int(len(local_batch), "end of data")
        """
        seq = self._next_seq()
        if self._world_size == 1:
            return value
        t = self._on_device(torch.tensor([value], dtype=torch.int64))
        self._guard(seq, "all_reduce", name, lambda: dist.all_reduce(t))
        return int(t.item())

    def barrier(self, name: str) -> None:
        """Waits until every rank reaches this point (or raises naming those that did not)."""
        self.all_reduce_int(0, f"barrier {name}")

    def shutdown(self) -> None:
        """Destroys the process group if this object created it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_group and dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # interpreter shutdown, or the group already broke
                logger.debug("destroy_process_group failed", exc_info=True)


class _DoneWork:
    def wait(self) -> bool:
        return True
