"""Gradient buckets all-reduced across workers while the backward pass runs.

# NOTE [overlapped gradient sync]
With one local replica per worker (the common multi-worker layout) the sum over
replicas is a pure cross-process all-reduce, so it can start before the optimizer
step, as DistributedDataParallel does:

* the optimizer's variables that require grad are grouped into buckets of about
  ``bytes_per_pack`` bytes per dtype and device, the first one small so
  communication starts early, and the buckets are launched in the order their
  gradients are expected (last layers first, across dtypes);
* each bucket owns one flat buffer, allocated once; a post-accumulate-grad hook
  copies each gradient into its slot as soon as it is ready, and a full bucket's
  all-reduce is launched asynchronously, in place on that buffer;
* every worker must issue the same collectives in the same order, also when
  workers use different parameters (data-dependent branches) and when user code
  runs collectives between backward and the step (logging the loss). So buckets
  launch strictly in order, and at the end of every backward pass (an autograd
  callback) every bucket not launched yet is launched, as DDP's
  ``find_unused_parameters`` does, except the last one;
* the last bucket is launched at the optimizer step (it holds the first layers'
  gradients, ready at the very end of backward anyway). The step waits for
  everything, and each ``.grad`` becomes a view of its slot in the summed buffer
  (as DDP's ``gradient_as_bucket_view=True``): no copy back.

What is summed is each worker's ``.grad`` as the optimizer step finds it, as in
one process with several replicas. A gradient that changed after its bucket was
launched (another backward pass, or user code between backward and the step
replacing ``.grad`` or modifying it in place) is noticed by its identity and
version counter, and then this worker fills every bucket again from its final
gradients and reduces it a second time. That decision is taken from what this
worker saw, without asking the others (asking is a host sync on every step), so
every worker must run the same number of backward passes and the same edits
between backward and the step: true of gradient accumulation and clipping
loops. Each worker also puts its decision in a slot at the end of the last
bucket; the summed slot says whether the workers agreed. A worker that redoes
reads it at once (the redo is the slow path anyway) and raises before reducing
again; the others copy it to the host without waiting and check it when their
next backward pass or step begins, before launching anything. So a disagreement
raises `CollectiveMismatchError` on every worker instead of pairing one worker's
second reduction with another's next step. Edits that do not bump
the version counter (through ``.grad.data``, or ``torch.amp.GradScaler.
unscale_``'s fused kernel) are not noticed.

Each buffer also ends with one flag per variable, 1 where this worker has a
gradient: a variable that no worker used keeps ``.grad = None``, as it would in
one process, so optimizers skip it (a zero gradient would still apply weight
decay and momentum to it). The flags are read on the host only when this
worker lacks a gradient of the bucket (DDP's ``find_unused_parameters`` pays
the same); frozen variables (``requires_grad=False``) are not in any bucket.

A ``.grad`` handed over as a view is safe to read and modify until the next
backward pass writes the buffer again; code that keeps a gradient across steps
must clone it. While a bucket's all-reduce is in flight, no ``.grad`` may alias
its buffer (a backward pass would accumulate into memory being reduced, and
the local gradient must stay readable until the step): gradients that still
alias it when it launches (after ``zero_grad(set_to_none=False)``, or with no
``zero_grad``) move to the same slots of a second buffer of the bucket, filled
by one copy of the whole bucket (no allocation per gradient).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch

from distribute import _torch
from distribute._enums import ReduceOp
from distribute.collectives.packing import pack_by_bytes, slot_views
from distribute.errors import CollectiveMismatchError

__all__ = ["BucketReducer", "FIRST_BUCKET_BYTES"]

#: Size of the first bucket, so that the first all-reduce starts early (DDP: 1 MiB).
FIRST_BUCKET_BYTES = 1024 * 1024


class _Handle(Protocol):
    def wait(self) -> list[torch.Tensor]: ...


class _AsyncCollectives(Protocol):
    def all_reduce_async(
        self, tensors: Sequence[torch.Tensor], op: ReduceOp, *, name: str
    ) -> _Handle: ...

    def check_same(self, signature: Any, *, name: str) -> None: ...

    @property
    def world_size(self) -> int: ...


# What a slot was filled from: the gradient (weakly) and its version, or None for zeros.
_Seen = tuple["weakref.ref[torch.Tensor]", int] | None


class _Bucket:
    """One bucket: its variables, their slots in its flat buffer, and this step's state."""

    __slots__ = (
        "buffer",
        "flags",
        "handle",
        "hooked",
        "members",
        "name",
        "numel",
        "pending",
        "seen",
        "shadow",
        "shadow_views",
        "views",
    )

    def __init__(self, members: list[int], variables: Sequence[torch.Tensor]) -> None:
        first = variables[members[0]]
        numel = sum(variables[j].numel() for j in members)
        self.members = members
        self.name = ""  # set once the launch order is known
        # The gradients, one used-flag per member, then the redo slot.
        self.buffer = torch.empty(numel + len(members) + 1, dtype=first.dtype, device=first.device)
        self.views = slot_views(self.buffer, [variables[j] for j in members])
        self.flags = self.buffer[numel:]
        self.numel = numel
        # Where aliasing gradients go while the buffer is reduced (made when first needed).
        self.shadow: torch.Tensor | None = None
        self.shadow_views: list[torch.Tensor] = []
        # Members whose hook marks them ready; the others are copied at launch.
        self.hooked = sum(1 for j in members if variables[j].requires_grad)
        self.seen: list[_Seen | Literal[False]] = [False] * len(members)  # False: not copied
        self.pending = self.hooked
        self.handle: _Handle | None = None

    def reset(self) -> None:
        self.seen = [False] * len(self.members)
        self.pending = self.hooked
        self.handle = None


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _seen(grad: torch.Tensor | None) -> _Seen:
    return None if grad is None else (weakref.ref(grad), grad._version)


def _unchanged(seen: _Seen | Literal[False], grad: torch.Tensor | None) -> bool:
    """Whether the slot still holds ``grad`` (as it was when copied)."""
    if seen is False:
        return False
    if seen is None:
        return grad is None
    ref, version = seen
    return ref() is grad and grad is not None and grad._version == version


class BucketReducer:
    """Sums the gradients of ``variables`` across workers, overlapped with backward.

    Args:
        variables: the optimizer's variables (one local replica each), in the
            same order on every worker; those that do not require grad stay out
            of the buckets (see `stale`).
        collectives: the cross-worker collectives (`all_reduce_async`, `check_same`).
        bytes_per_pack: bucket size in bytes.
        skip: returns True while gradients must only accumulate locally
            (``no_sync``).
    """

    def __init__(
        self,
        variables: Sequence[torch.Tensor],
        collectives: _AsyncCollectives,
        bytes_per_pack: int,
        skip: Callable[[], bool],
    ) -> None:
        self._frozen = [v for v in variables if not v.requires_grad]
        self._variables = [v for v in variables if v.requires_grad]
        self._collectives = collectives
        self._skip = skip
        self._lock = threading.Lock()
        by_key: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for j, var in enumerate(self._variables):
            by_key.setdefault((var.dtype, var.device), []).append(j)
        last = self._variables[-1]
        self._buckets: list[_Bucket] = []
        for (dtype, device), indices in by_key.items():
            sizes = [self._variables[j].numel() * dtype.itemsize for j in indices]
            # The small first bucket goes to the group whose gradients come first.
            early = (dtype, device) == (last.dtype, last.device)
            first = min(FIRST_BUCKET_BYTES, bytes_per_pack) if early else None
            for pack in pack_by_bytes(sizes, bytes_per_pack, first_pack_bytes=first):
                self._buckets.append(_Bucket([indices[k] for k in pack], self._variables))
        # Launch order: the order gradients are expected in (reverse registration),
        # across dtypes, so that no bucket waits behind one that is ready later.
        self._buckets.sort(key=lambda b: -max(b.members))
        for index, bucket in enumerate(self._buckets):
            bucket.name = f"gradients (bucket {index})"
        self._next_launch = 0
        self._in_pass = False
        self._pending_redo: _HostCopy | None = None
        self._hooks = [
            var.register_post_accumulate_grad_hook(self._hook_for(bucket, k))  # type: ignore[no-untyped-call]  # untyped in torch
            for bucket in self._buckets
            for k, var in enumerate(self._variables[j] for j in bucket.members)
            if var.requires_grad
        ]
        # Unregister the hooks when the reducer goes (its optimizer went) or on `close`.
        self._finalizer = weakref.finalize(self, _remove_hooks, self._hooks)

    @property
    def signature(self) -> list[tuple[str, int]]:
        """(dtype, elements) of each bucket, which every worker must share."""
        return [(str(b.buffer.dtype), b.buffer.numel()) for b in self._buckets]

    def check_layout(self) -> None:
        """Raises on every worker when the workers' bucket layouts differ."""
        self._collectives.check_same(self.signature, name="gradient bucket layout")

    def close(self) -> None:
        """Unregisters the gradient hooks."""
        self._finalizer()

    @property
    def stale(self) -> bool:
        """Whether a variable left out as frozen now requires grad (rebuild the buckets)."""
        return any(v.requires_grad for v in self._frozen)

    def _hook_for(self, bucket: _Bucket, k: int) -> Callable[[torch.Tensor], None]:
        ref = weakref.ref(self)  # the variables hold the hooks; they must not hold us

        def hook(_: torch.Tensor) -> None:
            reducer = ref()
            if reducer is not None:
                reducer._on_gradient(bucket, k)

        return hook

    def _on_gradient(self, bucket: _Bucket, k: int) -> None:
        if self._skip():
            return
        with self._lock:
            if not self._in_pass:
                self._check_previous_redo()  # before this pass launches anything
                self._in_pass = True
                _torch.autograd_execution_engine.queue_callback(self._end_pass)
            if bucket.handle is not None:  # in flight: noticed as a change at the step
                return
            was_ready = bucket.seen[k] is not False
            self._copy(bucket, k)
            if not was_ready:
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._launch_ready(ready_only=True)

    def _end_pass(self) -> None:
        """End of a backward pass: launch every bucket but the last, ready or not."""
        with self._lock:
            self._in_pass = False
            self._launch_ready(ready_only=False)

    def _copy(self, bucket: _Bucket, k: int) -> None:
        """Copies member ``k``'s gradient (zeros without one) into its slot."""
        grad = self._variables[bucket.members[k]].grad
        view = bucket.views[k]
        if grad is None:
            view.zero_()  # no gradient this step: it adds nothing to the sum
        elif grad.data_ptr() != view.data_ptr():  # else it accumulated in the slot itself
            view.copy_(grad.detach())
        bucket.seen[k] = _seen(grad)

    def _changed(self, bucket: _Bucket) -> bool:
        variables = self._variables
        return any(
            not _unchanged(seen, variables[j].grad) for seen, j in zip(bucket.seen, bucket.members)
        )

    def _launch_ready(self, *, ready_only: bool) -> None:
        buckets = self._buckets
        while self._next_launch < len(buckets) - 1:  # the last one goes at the step
            bucket = buckets[self._next_launch]
            if ready_only and bucket.pending > 0:
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket, redo: bool = False) -> None:
        """Brings the slots up to date and launches the bucket's all-reduce."""
        variables = self._variables
        missing: list[int] = []
        aliased: list[int] = []
        for k, (view, j) in enumerate(zip(bucket.views, bucket.members)):
            var = variables[j]
            if not _unchanged(bucket.seen[k], var.grad):
                self._copy(bucket, k)
            grad = var.grad
            if grad is None:
                missing.append(k)
            elif grad.data_ptr() == view.data_ptr():
                aliased.append(k)
        if aliased:  # the buffer is about to be reduced in place: see the NOTE
            self._move_to_shadow(bucket, aliased)
        # Flags written on the device (no host-to-device copy of a Python list).
        bucket.flags[:-1].fill_(1)
        for k in missing:
            bucket.flags[k].fill_(0)
        bucket.flags[-1:].fill_(1 if redo else 0)
        bucket.handle = self._collectives.all_reduce_async(
            [bucket.buffer], ReduceOp.SUM, name=bucket.name
        )

    def _move_to_shadow(self, bucket: _Bucket, aliased: list[int]) -> None:
        if bucket.shadow is None:
            bucket.shadow = torch.empty_like(bucket.buffer[: bucket.numel])
            bucket.shadow_views = slot_views(
                bucket.shadow, [self._variables[j] for j in bucket.members]
            )
        bucket.shadow.copy_(bucket.buffer[: bucket.numel])
        for k in aliased:
            var = self._variables[bucket.members[k]]
            var.grad = bucket.shadow_views[k]
            bucket.seen[k] = _seen(var.grad)

    def sum(self, local: int = 0) -> None:
        """Launches what is left, waits for every bucket and hands the sums to `.grad`.

        On the first step no hook has fired yet, so every bucket is filled and
        launched here.
        """
        with self._lock:
            buckets = self._buckets
            self._check_previous_redo()
            launched, self._next_launch = self._next_launch, 0
            self._in_pass = False
            changed = any(self._changed(b) for b in buckets[:launched])
            for bucket in buckets[launched:]:
                self._launch(bucket, redo=changed)  # the last one carries the redo slot
            totals = [self._wait(bucket) for bucket in buckets]
            redo_count = totals[-1][-1:]
            if changed:  # this worker's gradients changed after launch: reduce again
                self._check_redo(float(redo_count.item()), redid=True)
                for bucket in buckets:  # the buffer holds sums now
                    for k in range(len(bucket.members)):
                        self._copy(bucket, k)
                    self._launch(bucket)
                totals = [self._wait(bucket) for bucket in buckets]
            else:
                self._pending_redo = _HostCopy(redo_count)
            for bucket, total in zip(buckets, totals):
                self._write(bucket, total)
                bucket.reset()

    def _check_previous_redo(self) -> None:
        """Checks the last step's redo slot, copied to the host without waiting."""
        pending, self._pending_redo = self._pending_redo, None
        if pending is not None:
            self._check_redo(pending.value(), redid=False)

    def _check_redo(self, count: float, *, redid: bool) -> None:
        expected = self._collectives.world_size if redid else 0
        if count != expected:
            raise CollectiveMismatchError(
                f"workers disagree on reducing their gradients again: {int(count)} of "
                f"{self._collectives.world_size} workers changed theirs after their buckets "
                f"were launched (this worker {'did' if redid else 'did not'}), so they issue "
                "different collectives. Every worker must run the same number of backward "
                "passes and the same gradient edits before optimizer.step(); accumulate "
                "with strategy.extended.no_sync()"
            )

    def _wait(self, bucket: _Bucket) -> torch.Tensor:
        assert bucket.handle is not None
        total = bucket.handle.wait()[0]
        bucket.handle = None
        return total

    def _write(self, bucket: _Bucket, total: torch.Tensor) -> None:
        # ``total`` is the buffer itself unless the backend needed a copy on another
        # device; then the sums are copied into the buffer's slots.
        if total.data_ptr() != bucket.buffer.data_ptr():
            bucket.buffer.copy_(total)
        variables = self._variables
        used: list[float] | None = None
        if any(variables[j].grad is None for j in bucket.members):
            used = bucket.flags.tolist()  # a host read, only when a gradient is missing here
        for k, (view, j) in enumerate(zip(bucket.views, bucket.members)):
            var = variables[j]
            if used is not None and var.grad is None and used[k] == 0:
                continue  # no worker has a gradient for it: it stays None
            var.grad = view  # see NOTE [overlapped gradient sync]: no copy back


class _HostCopy:
    """A small device tensor copied to the host without waiting; read later."""

    __slots__ = ("event", "host")

    def __init__(self, tensor: torch.Tensor) -> None:
        cuda = tensor.is_cuda
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda)
        self.host.copy_(tensor, non_blocking=cuda)
        self.event: Any = None
        if cuda:
            self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
            self.event.record()

    def value(self) -> float:
        # Long done by the next step: a query (no host sync) tells, and only a copy
        # still in flight is waited for (cudaEventSynchronize counts as a sync).
        if self.event is not None and not self.event.query():
            self.event.synchronize()
        return float(self.host.double().numpy()[0])
