"""Cross-process collectives over one `torch.distributed` process group.

`ProcessGroupCollectives` is what `MultiWorkerMirroredStrategy` plugs into its
replica engine: all-reduce (packed), asynchronous all-reduce (gradient buckets),
all-gather of tensors whose sizes differ along one axis, broadcast, the small
integer sum the input pipeline uses to agree on the end of data, and a layout
check.

# NOTE [no silent hangs]
Every collective completes or raises within ``timeout_seconds``, and the error
names the operation and the ranks that never arrived, saying whether each is
dead, alive but elsewhere, or not answering.

* Hot path. A collective is launched with ``async_op=True`` and waited for in
  slices of a quarter second (``Work.wait(timeout)``); a collective that finishes
  inside the first slice costs what ``torch.distributed`` costs. Nothing is
  written to the store and no extra message is exchanged while collectives
  succeed (apart from the signature check below, which hot paths skip).
* Failure path: a rank gives up when the backend raises (a peer's connection closed)
  or its deadline passes, then probes every other rank's watcher, naming the dead
  within milliseconds and telling the ranks blocked in the same collective to stop
  waiting (NOTE [failure diagnosis] in `_liveness.py`, which also says why not
  ``monitored_barrier`` or arrival marks in the store). After a failure the group is
  marked broken and later collectives raise at once.
* Mismatch. Before the data moves, the ranks exchange a 64-bit hash of their
  call (operation, name, dtypes, shapes) with one 8-byte all-gather (16 bytes for
  `all_gather`, whose per-rank sizes ride along). On a mismatch every rank posts
  a description of its call to the store and raises `CollectiveMismatchError`
  naming both ranks. Pass ``check=False`` where the layout was checked once
  (gradient buckets do this with `check_same`).

Example::

    collectives = ProcessGroupCollectives.create(rank, 2, "127.0.0.1", 29500)
    total = collectives.all_reduce([torch.ones(3)], ReduceOp.SUM, name="x")[0]
    collectives.shutdown()
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from distribute import _torch
from distribute._enums import ReduceOp
from distribute._torch import Store
from distribute.collectives._calls import (
    AllReduceHandle,
    describe,
    flatten,
    items,
    signature_hash,
)
from distribute.collectives._deadlines import SLICE, CallInThread, StreamWatch, grace
from distribute.collectives._group_setup import (
    close_group,
    default_group_matches,
    init_default_group,
    share_group,
    work_done,
)
from distribute.collectives._liveness import (
    Position,
    WatchState,
    diagnose,
    diagnose_transport,
    local_address_towards,
    mismatch_error,
    start_watcher,
)
from distribute.collectives.packing import pack_by_bytes, slot_views
from distribute.errors import CollectiveTimeoutError, InvalidArgumentError

__all__ = ["AllReduceHandle", "ProcessGroupCollectives"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class ProcessGroupCollectives:
    """Collectives among the worker processes of one process group.

    Build it with `create` (which adopts an already initialised default group) or
    `adopt`. Every method must be called by every rank in the same order, as with
    `torch.distributed`; each call is one numbered *collective* in the messages.

    Args:
        group: the process group (None: the default group).
        store: the rendezvous store, used only on failure paths (None disables
            the diagnosis of missing ranks).
        rank: this process's rank.
        world_size: the number of processes.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_seconds: how long a collective may take before it raises.
        owns_group: whether the caller initialised the group for this object. A
            group the library initialised is destroyed by its last user, this
            object or another that adopted it (NOTE [shared groups] in
            _group_setup.py); one the user initialised never is.
        host: the address other ranks reach this one at (for the failure
            diagnosis); None: this machine's address on the route to the store.
        device: where nccl's tensors go (this process's GPU); None: the current
            CUDA device for nccl. Gloo works on CPU tensors.

    Example::

        c = ProcessGroupCollectives.create(rank, 2, "127.0.0.1", 29500, timeout_seconds=60)
        # rank 0 passes [1., 1.], rank 1 passes [2., 2.]; both get [3., 3.]
        total, = c.all_reduce([torch.full((2,), rank + 1.0)], ReduceOp.SUM, name="x")
        c.shutdown()
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        store: Store | None,
        rank: int,
        world_size: int,
        backend: str,
        timeout_seconds: float,
        owns_group: bool,
        host: str | None = None,
        device: torch.device | None = None,
    ) -> None:
        if timeout_seconds <= 0:
            raise InvalidArgumentError(
                f"timeout_seconds must be positive, got {timeout_seconds}; pass e.g. 300."
            )
        self._group = group
        self._rank = rank
        self._world_size = world_size
        self._backend = backend
        self._device = torch.device("cpu")
        if backend == "nccl":
            self._device = device or torch.device("cuda", torch.cuda.current_device())
        self._timeout = float(timeout_seconds)
        self._grace = grace(self._timeout)
        self._sliced = backend != "nccl"
        self._watch: StreamWatch | None = None
        if not self._sliced:
            self._watch = StreamWatch(
                weakref.WeakMethod(self._overdue), self._timeout - self._grace
            )
        self._counter = itertools.count(1)
        self._closed = False
        self._broken: list[CollectiveTimeoutError | None] = [None]
        self._liveness = start_watcher(store, rank, world_size, host, self._timeout)
        self._state = self._liveness.state if self._liveness is not None else WatchState()
        #: A sub-group's world (weakly) and how it names a rank: `subgroup`.
        self._world: tuple[weakref.ref[ProcessGroupCollectives], Any] | None = None
        self._int_buffer = self._on_device(torch.zeros(1, dtype=torch.int64))
        # Works maybe not waited for (`_close`; NOTE [works at exit]).
        self._launched: list[Any] = []
        self._users = share_group(group, created=owns_group)
        held = (self._liveness, self._users, self._broken, self._launched)
        self._finalizer = weakref.finalize(self, close_group, *held)

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
        cluster: str = "",
        prefix: str = "",
        launcher_serves: bool = False,
        device: torch.device | None = None,
    ) -> ProcessGroupCollectives:
        """Joins (rank 0: serves) the rendezvous at ``master_addr:master_port`` and
        creates the default process group.

        ``cluster``, ``prefix`` and ``launcher_serves`` go to the rendezvous (see
        NOTE [rendezvous]): what every rank must agree on, this attempt's key
        prefix, and whether the launcher serves the store. ``device`` is this
        process's GPU for nccl (given to ``init_process_group`` as ``device_id``).

        Adopts the default group instead when `torch.distributed` is already
        initialised with the same rank and world size.

        Raises:
            InvalidArgumentError: a bad rank, or a group initialised differently.
            CollectiveTimeoutError: some ranks did not join within the timeout
                (they are named).

        Example::

            c = ProcessGroupCollectives.create(0, 1, "127.0.0.1", 29500)
        """
        if default_group_matches(rank, world_size):
            return cls.adopt(timeout_seconds=timeout_seconds)
        store = init_default_group(
            rank, world_size, master_addr, master_port, backend=backend,
            timeout_seconds=timeout_seconds, cluster=cluster, prefix=prefix,
            launcher_serves=launcher_serves, device=device,
        )  # fmt: skip
        host = local_address_towards(master_addr)
        return cls(
            None, store, rank, world_size, backend, timeout_seconds, owns_group=True,
            host=host, device=device,
        )  # fmt: skip

    @classmethod
    def adopt(cls, *, timeout_seconds: float = 300.0) -> ProcessGroupCollectives:
        """Wraps the default process group someone else initialised.

        A group the user initialised is never destroyed; one that another strategy
        of this library initialised is shared, and destroyed by its last user
        (NOTE [shared groups] in _group_setup.py).

        Example::

            dist.init_process_group("gloo", ...)
            c = ProcessGroupCollectives.adopt(timeout_seconds=60)
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidArgumentError(
                "adopt() needs an initialised default process group, found none; call "
                "torch.distributed.init_process_group first or use create()."
            )
        store: Store | None = None
        try:
            store = _torch.default_store()
        except (RuntimeError, ValueError):  # no store to share: no diagnosis of missing ranks
            store = None
        rank, world_size, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
        return cls(None, store, rank, world_size, str(backend), timeout_seconds, owns_group=False)

    # -- identity ------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """How many processes take part."""
        return self._world_size

    @property
    def backend(self) -> str:
        """The process group's backend, ``"gloo"`` or ``"nccl"``."""
        return self._backend

    @property
    def timeout_seconds(self) -> float:
        """How long a collective may take before it raises."""
        return self._timeout

    # -- bookkeeping and failure ------------------------------------------------------

    def _begin(self, kind: str, name: str) -> tuple[Position, float]:
        if self._closed:
            raise InvalidArgumentError(
                f"{kind} '{name}' was called after shutdown(); create a new strategy (or "
                "ProcessGroupCollectives) to run collectives again."
            )
        broken = self._broken[0]
        position = (next(self._counter), f"{kind} '{name}'")
        if broken is not None:
            raise CollectiveTimeoutError(
                f"{position[1]} cannot run: the process group broke in an earlier collective "
                f"({broken}). Restart every worker."
            )
        if self._state.interrupt is not None:  # a peer gave up while this rank was elsewhere
            raise self._fail(position, time.monotonic(), None)
        return position, time.monotonic()

    def _finished(self, position: Position) -> None:
        self._state.waiting = None
        self._state.done = position

    def _wait(self, work: Any, position: Position, start: float) -> None:
        """Waits for ``work`` in slices; raises a diagnosed error on failure."""
        state = self._state
        state.waiting = position
        try:
            self._wait_until_done(work, position, start)
            work_done()  # NOTE [works at exit]
        except (KeyboardInterrupt, SystemExit) as exc:
            # Ctrl-C (or an exit) while a peer has not arrived: the group is left
            # broken, so that the process can exit now instead of waiting for the
            # collective in `destroy_process_group`; the peers name it as gone.
            if not work.is_completed():
                self._broken[0] = CollectiveTimeoutError(
                    f"{position[1]} was abandoned on rank {self._rank} ({type(exc).__name__})"
                )
            state.waiting = None
            raise

    def _wait_until_done(self, work: Any, position: Position, start: float) -> None:
        state = self._state
        if not self._sliced:  # nccl: order the stream, watch the work off this thread
            try:
                work.wait()
            except RuntimeError as exc:
                raise self._fail(position, start, exc) from exc
            assert self._watch is not None
            self._watch.add(work, position, start)
            return
        deadline = start + self._timeout - self._grace
        while True:
            try:
                work.wait(SLICE)
                return
            except RuntimeError as exc:
                if work.is_completed():  # the backend failed: typically a peer died
                    raise self._fail(position, start, exc) from exc
            if state.interrupt is not None or time.monotonic() > deadline:
                if work.is_completed():
                    continue  # finished just now: collect the result (or its error)
                raise self._fail(position, start, None)

    def _overdue(self, position: Position, start: float) -> None:
        """A nccl collective still runs past the deadline (from the watch thread):
        name the missing ranks now, then abort the communicators so the GPU is freed
        and the next collective raises."""
        error = self._fail(position, start, None)
        logger.error("%s", error)
        try:
            _torch.abort_process_group(self._group)
        except Exception:  # already aborted, or torch without abort
            logger.debug("aborting the process group failed", exc_info=True)

    def _fail(
        self, position: Position, start: float, exc: BaseException | None
    ) -> CollectiveTimeoutError:
        """Diagnoses a failed or overdue collective; marks the group broken."""
        parent, describe = self._world if self._world is not None else (None, None)
        world = parent() if parent is not None else None
        if world is not None:  # a sub-group's failure: the world names the lost ranks
            what = f"{position[1]} (collective #{position[0]} of a mesh axis's group)"
            elapsed = time.monotonic() - start
            error = world.transport_failure(what, exc, elapsed=elapsed, describe=describe)
            self._broken[0] = error
            return error
        error = diagnose(
            self._liveness,
            self._state,
            position,
            rank=self._rank,
            timeout=self._timeout,
            grace=self._grace,
            elapsed=time.monotonic() - start,
            exc=exc,
        )
        self._broken[0] = error
        self._state.waiting = None
        return error

    # -- signatures --------------------------------------------------------------------

    def check_same(self, signature: Any, *, name: str) -> None:
        """Raises `CollectiveMismatchError` on every rank unless all pass equal signatures.

        ``signature`` is any value with a deterministic ``repr`` (lists, tuples,
        strings, numbers).

        Example::

            collectives.check_same([("float32", 1024)], name="gradient bucket layout")
        """
        position, start = self._begin("check_same", name)
        self._check_signature(position, start, signature, ([repr(signature)], ""))
        self._finished(position)

    def _check_signature(
        self,
        position: Position,
        start: float,
        signature: Any,
        description: tuple[list[str], str],
        extra: Sequence[int] = (),
    ) -> list[list[int]]:
        """Exchanges the call's hash (and ``extra`` ints); returns every rank's ``extra``."""
        if self._world_size == 1:
            return [list(extra)]
        mine = torch.tensor([signature_hash((position[1], signature)), *extra], dtype=torch.int64)
        gathered = self._on_device(torch.empty(self._world_size * mine.numel(), dtype=torch.int64))
        work = _all_gather_single(gathered, self._on_device(mine), group=self._group, async_op=True)
        self._wait(work, position, start)
        rows = gathered.cpu().view(self._world_size, -1).tolist()
        hashes = [row[0] for row in rows]
        if any(h != hashes[0] for h in hashes):
            odd = next(r for r, h in enumerate(hashes) if h != hashes[0])
            self._state.waiting = None
            raise mismatch_error(
                self._liveness, position, description, rank=self._rank, odd=odd, grace=self._grace
            )
        return [row[1:] for row in rows]

    # -- data movement -----------------------------------------------------------------

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where the backend works on it: this process's GPU (nccl) or the CPU."""
        return t if t.device == self._device else t.to(self._device)

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
        in_place: bool = False,
    ) -> list[torch.Tensor]:
        """Sums (or averages) each tensor over the ranks; returns new tensors.

        Tensors of one dtype travel together in packs of about ``bytes_per_pack``
        bytes (0: one pack per dtype), so a thousand small tensors cost a few
        collectives. The inputs are not modified unless ``in_place``. MEAN divides
        by the world size (integer tensors come back as float64).

        Args:
            tensors: the tensors to reduce; every rank passes the same shapes and
                dtypes in the same order.
            op: `ReduceOp.SUM` or `ReduceOp.MEAN`.
            name: what the tensors are, for error messages.
            bytes_per_pack: pack size in bytes; 0 puts each dtype in one pack.
            check: exchange a hash of the layout first so that a mismatch raises
                `CollectiveMismatchError` instead of hanging; skip it on hot paths
                whose layout was checked once.
            in_place: write the results into ``tensors`` and return them. A
                contiguous tensor alone in its pack is then reduced without any
                copy (as raw ``torch.distributed.all_reduce``), which matters for
                large tensors: a fresh output buffer costs a copy plus its page
                faults. Not for integer tensors with MEAN.

        Raises:
            CollectiveMismatchError: ranks passed different shapes or dtypes.
            CollectiveTimeoutError: a peer died or never arrived (it is named).
            InvalidArgumentError: ``in_place`` MEAN of an integer tensor.

        Example::

            # rank 0 passes [1.], rank 1 passes [3.]
            mean, = collectives.all_reduce([torch.tensor([1.0 + 2 * rank])], ReduceOp.MEAN,
                                           name="loss")
            # both ranks get tensor([2.])
        """
        tensors = list(tensors)
        if in_place and op is ReduceOp.MEAN and any(not t.is_floating_point() for t in tensors):
            raise InvalidArgumentError(
                f"all_reduce '{name}': MEAN in place needs floating-point tensors, got "
                f"{describe(tensors)}; the mean of integers is float64, so drop in_place."
            )
        position, start = self._begin("all_reduce", name)
        if check:
            self._check_signature(
                position,
                start,
                ([(str(t.dtype), tuple(t.shape)) for t in tensors], op.name),
                (items(tensors), f"({op.name})"),
            )
        if self._world_size == 1:
            self._finished(position)
            if in_place:
                return tensors
            return [self._finish_reduce(t.detach().clone(), op) for t in tensors]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(j)
        in_flight: list[tuple[list[int], torch.Tensor, Any]] = []
        for dtype, indices in by_dtype.items():
            sizes = [tensors[j].numel() * dtype.itemsize for j in indices]
            for pack in pack_by_bytes(sizes, bytes_per_pack, reverse=False):
                members = [indices[k] for k in pack]
                flat = self._on_device(flatten([tensors[j] for j in members], copy=not in_place))
                work = dist.all_reduce(flat, group=self._group, async_op=True)
                in_flight.append((members, flat, work))
        results: list[torch.Tensor | None] = [None] * len(tensors)
        for members, flat, work in in_flight:
            self._wait(work, position, start)
            templates = [tensors[j] for j in members]
            if in_place:
                if op is ReduceOp.MEAN:
                    flat.div_(self._world_size)
                if flat.data_ptr() != templates[0].data_ptr() or len(members) > 1:
                    with torch.no_grad():
                        for t, piece in zip(templates, slot_views(flat, templates)):
                            t.copy_(piece)
                continue
            reduced = self._finish_reduce(flat, op).to(templates[0].device)
            for j, piece in zip(members, slot_views(reduced, templates)):
                results[j] = piece
        self._finished(position)
        if in_place:
            return tensors
        return [r for r in results if r is not None]

    def all_reduce_async(
        self, tensors: Sequence[torch.Tensor], op: ReduceOp, *, name: str
    ) -> AllReduceHandle:
        """Starts one all-reduce of ``tensors`` (flattened together; one dtype).

        For overlapping gradient buckets with backward: every rank must start the
        same all-reduces in the same order, and no signature check is made (check
        the layout once with `check_same`). Several tensors are copied into one
        buffer; a single contiguous tensor is reduced in place, without a copy.

        Raises:
            InvalidArgumentError: the tensors do not share one dtype.

        Example::

            handle = collectives.all_reduce_async([bucket], ReduceOp.SUM, name="bucket 0")
            # ... more backward ...
            summed, = handle.wait()
        """
        templates = list(tensors)
        if not templates or len({t.dtype for t in templates}) != 1:
            raise InvalidArgumentError(
                f"all_reduce_async '{name}' needs at least one tensor and one dtype, got "
                f"{describe(templates) if templates else 'no tensors'}; split the tensors by "
                "dtype."
            )
        position, start = self._begin("all_reduce", name)
        flat = self._on_device(flatten(templates, copy=False))

        def finish(reduced: torch.Tensor) -> torch.Tensor:
            return self._finish_reduce(reduced, op)

        if self._world_size == 1:
            self._finished(position)
            return AllReduceHandle(None, flat.clone(), templates, finish)
        work = dist.all_reduce(flat, group=self._group, async_op=True)
        self._launched[:] = [w for w in self._launched if not w.is_completed()]
        self._launched.append(work)

        def wait() -> None:
            self._wait(work, position, start)
            self._finished(position)

        return AllReduceHandle(wait, flat, templates, finish)

    def all_gather(self, tensor: torch.Tensor, axis: int, *, name: str) -> torch.Tensor:
        """Concatenates every rank's tensor along ``axis``, in rank order.

        Sizes along ``axis`` may differ between ranks; the other dimensions and the
        dtype must match (else `CollectiveMismatchError` on every rank).

        Example::

            # rank 0 passes a [1, 3] tensor, rank 1 a [2, 3] tensor
            everything = collectives.all_gather(torch.ones(rank + 1, 3), 0, name="preds")
            # both ranks get a [3, 3] tensor: rank 0's row, then rank 1's two rows
        """
        position, start = self._begin("all_gather", name)
        if tensor.dim() == 0:
            raise InvalidArgumentError(
                f"all_gather '{name}' needs a tensor with at least one dimension, got a scalar; "
                "reshape it to [1]."
            )
        axis = axis % tensor.dim()
        other_dims = [s for d, s in enumerate(tensor.shape) if d != axis]
        extras = self._check_signature(
            position,
            start,
            (str(tensor.dtype), tensor.dim(), axis, other_dims),
            (items([tensor]), f"(axis {axis})"),
            extra=[tensor.shape[axis]],
        )
        if self._world_size == 1:
            self._finished(position)
            return tensor.detach().clone()
        sizes = [row[0] for row in extras]
        longest = max(sizes)
        moved = torch.movedim(tensor.detach(), axis, 0)
        if moved.shape[0] < longest:
            pad = moved.new_zeros((longest - moved.shape[0], *moved.shape[1:]))
            moved = torch.cat([moved, pad])
        padded = self._on_device(moved.contiguous())
        out = torch.empty(
            (self._world_size * longest, *padded.shape[1:]),
            dtype=padded.dtype,
            device=padded.device,
        )
        work = _all_gather_single(out, padded, group=self._group, async_op=True)
        self._wait(work, position, start)
        self._finished(position)
        pieces = [out[r * longest : r * longest + s] for r, s in enumerate(sizes)]
        return torch.movedim(torch.cat(pieces), 0, axis).to(tensor.device)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0, *, name: str) -> None:
        """Overwrites ``tensors`` on every rank with rank ``src``'s, in place.

        Example::

            collectives.broadcast([weight, bias], 0, name="initial values")
            # every rank now holds rank 0's weight and bias
        """
        tensors = list(tensors)
        position, start = self._begin("broadcast", name)
        if not 0 <= src < self._world_size:
            raise InvalidArgumentError(
                f"broadcast '{name}': src must be a rank in [0, {self._world_size}), got {src}."
            )
        self._check_signature(
            position,
            start,
            ([(str(t.dtype), tuple(t.shape)) for t in tensors], src),
            (items(tensors), f"(from rank {src})"),
        )
        if self._world_size == 1 or not tensors:
            self._finished(position)
            return
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(j)
        in_flight = []
        for indices in by_dtype.values():
            flat = self._on_device(flatten([tensors[j] for j in indices], copy=True))
            work = dist.broadcast(flat, src, group=self._group, async_op=True)
            in_flight.append((indices, flat, work))
        for indices, flat, work in in_flight:
            self._wait(work, position, start)
            with torch.no_grad():
                for j, piece in zip(indices, slot_views(flat, [tensors[j] for j in indices])):
                    tensors[j].copy_(piece)
        self._finished(position)

    def all_reduce_int(self, value: int, name: str) -> int:
        """The sum of a Python int over the ranks: one 8-byte all-reduce, no check.

        Example::

            # each rank passes how many examples it still has
            remaining = collectives.all_reduce_int(len(local_batch), "end of data")
        """
        return self._sum_int(value, "all_reduce_int", name)

    def _sum_int(self, value: int, kind: str, name: str) -> int:
        position, start = self._begin(kind, name)
        if self._world_size == 1:
            self._finished(position)
            return value
        t = self._int_buffer  # reused: a fresh tensor per call costs more than the call
        t.fill_(value)
        work = dist.all_reduce(t, group=self._group, async_op=True)
        self._wait(work, position, start)
        self._finished(position)
        return int(t.item())

    def watch(self, kind: str, name: str, launch: Callable[[], Any]) -> None:
        """Runs a collective issued elsewhere under this object's deadline and diagnosis.

        ``launch`` issues the collective with ``async_op=True`` (on any group of these
        processes) and returns its work; it is waited for as this object's own
        collectives are (NOTE [no silent hangs]): within the timeout, or an error
        naming the operation and the ranks that did not arrive. FSDP's all-gathers
        and reduce-scatters go through here (strategies/_sharding.py).

        Example::

            collectives.watch(
                "all_gather",
                "FSDP all-gather of 'blocks.0' (forward)",
                lambda: dist.all_gather_into_tensor(out, inp, group=group, async_op=True),
            )
        """
        position, start = self._begin(kind, name)
        work = launch()
        self._wait(work, position, start)
        self._finished(position)

    def subgroup(
        self, group: Any, ranks: Sequence[int], describe: Callable[[int], str] | None = None
    ) -> ProcessGroupCollectives:
        """Collectives over ``group``, a sub-group (a mesh axis) of these processes
        with global ``ranks``, whose failures name the lost ranks globally (``describe``
        names a rank, e.g. with its mesh coordinates).

        Example::

            batch = world.subgroup(mesh["batch"].get_group(), [1, 3])
        """
        members = [int(r) for r in ranks]
        device = self._device if self._backend == "nccl" else None
        sub = ProcessGroupCollectives(
            group, None, members.index(self._rank), len(members), self._backend,
            self._timeout, owns_group=False, device=device,
        )  # fmt: skip
        sub._world = (weakref.ref(self), describe)
        return sub

    def transport_failure(
        self, what: str, exc: BaseException | None, *, elapsed: float = 0.0, describe: Any = None
    ) -> CollectiveTimeoutError:
        """The error for a collective that failed outside this object (torch's own:
        DTensor's, FSDP's inside a mesh; a sub-group's), naming the lost ranks by their
        global rank (``describe``). Marks the group broken: later collectives raise.

        Example::

            except RuntimeError as exc:
                raise world.transport_failure("a DTensor collective", exc) from exc
        """
        error = diagnose_transport(
            self._liveness, self._state, what, rank=self._rank, timeout=self._timeout,
            grace=self._grace, elapsed=elapsed, exc=exc,
            describe=describe or (lambda r: f"rank {r}"),
        )  # fmt: skip
        self._broken[0] = error
        self._state.waiting = None
        return error

    def run_watched(self, name: str, call: Callable[[], _T]) -> _T:
        """Runs ``call``, a blocking function running collectives of its own over these
        processes (DCP's checkpoint save and load), so that a dead worker is named
        within seconds: the call runs in a helper thread (`CallInThread`) while this
        one waits as in a collective of this object, so every rank still blocked in it
        stops when a peer that saw the death probes the others. No deadline of its
        own (a large write may outlast a collective's timeout); the call's own error
        is raised as it is; an abandoned call leaves the group broken.

        Raises:
            CollectiveTimeoutError: a peer gave up on the group meanwhile (its
                diagnosis, naming the dead or missing ranks, is quoted).

        Example::

            metadata = collectives.run_watched("checkpoint write", lambda: dcp.save(state))
        """
        position, start = self._begin("call", name)
        if self._world_size == 1:
            alone = call()
            self._finished(position)
            return alone
        # Not a daemon thread (see `CallInThread`); the call's per-thread torch state
        # that matters: the grad mode, and the CUDA device (nccl's object collectives).
        cuda = self._device if self._device.type == "cuda" else None
        worker = CallInThread(call, f"distribute-watched {name}", cuda)
        state = self._state
        state.waiting = position
        try:
            while not worker.wait(SLICE.total_seconds()):
                if state.interrupt is not None and not worker.done:
                    raise self._fail(position, start, None)
        except (KeyboardInterrupt, SystemExit) as exc:
            self._broken[0] = CollectiveTimeoutError(
                f"{position[1]} was abandoned on rank {self._rank} ({type(exc).__name__})"
            )
            state.waiting = None
            raise
        ok, value = worker.outcome
        if not ok:
            state.waiting = None
            raise value
        self._finished(position)
        result: _T = value
        return result

    def barrier(self, name: str) -> None:
        """Waits until every rank reaches this point (or raises naming those that did not).

        Example::

            collectives.barrier("checkpoint written")
        """
        self._sum_int(0, "barrier", name)

    def shutdown(self) -> None:
        """Stops the watcher and leaves the process group: destroys it if the library
        initialised it and no other collectives object uses it any more.

        Idempotent, and run automatically when the object is collected or the interpreter
        exits. A group broken by a failed collective is left to the process's exit, since
        destroying it would wait for the abandoned collective.
        """
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.stop()
        self._finalizer()
