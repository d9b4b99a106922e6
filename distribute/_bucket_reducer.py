"""Gradient buckets all-reduced across workers while the backward pass runs.

# NOTE [overlapped gradient sync]
With one local replica per worker (the common multi-worker layout) the sum over
replicas is a pure cross-process all-reduce, so it can start before the optimizer
step, as DistributedDataParallel does:

* the optimizer's variables are grouped, last layer first (gradients become ready
  in reverse), into buckets of about ``bytes_per_pack`` bytes, the first one small
  so communication starts early;
* each bucket owns one flat buffer, allocated once; a post-accumulate-grad hook
  copies each gradient into its slot as soon as it is ready, and a full bucket's
  all-reduce is launched asynchronously, in place on that buffer, always in
  bucket order (every worker must issue the same collectives in the same order).
  Spreading the copies over the backward pass means a bucket launches right
  after its last gradient is copied, and reusing the buffer means no allocation
  (and no page faults) per step;
* at the optimizer step the remaining buckets are filled and launched, everything
  is waited for, and each ``.grad`` becomes a view of its slot in the summed
  buffer (as DDP's ``gradient_as_bucket_view=True``): no copy back.

What is summed is each worker's ``.grad`` as the optimizer step finds it, as in
one process with several replicas: the step notices a gradient changed since it
was copied (another backward pass, or user code such as clipping: a new tensor or
a bumped version counter). Deciding to reduce again must happen alike on every
worker, and a worker that made a different number of backward passes must fail
rather than pair its collectives with the others' next step. So:

* the backward passes are counted (an autograd end-of-pass callback);
* the last bucket in launch order is always launched at the step (it holds the
  first layers' gradients, ready at the very end of backward anyway); its buffer
  ends with two slots: 1 where this worker's pass count is not the usual 1, and 1
  where a gradient changed after its bucket was launched;
* each buffer also ends with one flag per variable, 1 where this worker has a
  gradient: a variable that no worker used keeps ``.grad = None``, as it would in
  one process, so optimizers skip it (a zero gradient would still apply weight
  decay and momentum to it).

After the waits, a non-zero pass slot makes the workers compare their counts
(`check_same`: a mismatch raises on every rank); a non-zero change slot, or equal
counts above 1, makes every worker fill every bucket again from the final
gradients and reduce it a second time. The common step pays for none of this but
two extra elements in one all-reduce.

A ``.grad`` handed over as a view is safe to read and modify until the next
backward pass writes the buffer again; code that keeps a gradient across steps
must clone it. While a bucket's all-reduce is in flight, no ``.grad`` may alias
its buffer (a backward pass would accumulate into memory being reduced): a
gradient that still does when its bucket launches (after
``zero_grad(set_to_none=False)``, or with no ``zero_grad``) gets a private copy.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch
from torch.autograd import Variable

from distribute._enums import ReduceOp
from distribute.collectives.packing import pack_by_bytes
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


# What a slot was filled from: the gradient (weakly) and its version, or None for zeros.
_Seen = tuple["weakref.ref[torch.Tensor]", int] | None


class _Bucket:
    """One bucket: its variables, their slots in its flat buffer, and this step's state."""

    __slots__ = ("buffer", "flags", "handle", "members", "name", "pending", "seen", "views")

    def __init__(self, index: int, members: list[int], variables: Sequence[torch.Tensor]) -> None:
        first = variables[members[0]]
        numel = sum(variables[j].numel() for j in members)
        self.members = members
        self.name = f"gradients (bucket {index})"
        # The gradients, one used-flag per member, the pass slot and the change slot.
        self.buffer = torch.empty(numel + len(members) + 2, dtype=first.dtype, device=first.device)
        self.views = _slots(self.buffer, [variables[j] for j in members])
        self.flags = self.buffer[numel:]
        self.seen: list[_Seen | Literal[False]] = [False] * len(members)  # False: not copied
        self.pending = len(members)
        self.handle: _Handle | None = None

    def reset(self) -> None:
        self.seen = [False] * len(self.members)
        self.pending = len(self.members)
        self.handle = None


def _slots(flat: torch.Tensor, variables: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat``, one per variable, shaped like it, in order."""
    views = []
    offset = 0
    for var in variables:
        numel = var.numel()
        views.append(flat[offset : offset + numel].view(var.shape))
        offset += numel
    return views


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
            same order on every worker.
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
        self._variables = list(variables)
        self._collectives = collectives
        self._skip = skip
        self._lock = threading.Lock()
        by_key: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for j, var in enumerate(self._variables):
            by_key.setdefault((var.dtype, var.device), []).append(j)
        self._buckets: list[_Bucket] = []
        for (dtype, _), indices in by_key.items():
            sizes = [self._variables[j].numel() * dtype.itemsize for j in indices]
            first = min(FIRST_BUCKET_BYTES, bytes_per_pack) if not self._buckets else None
            for pack in pack_by_bytes(sizes, bytes_per_pack, first_pack_bytes=first):
                members = [indices[k] for k in pack]
                self._buckets.append(_Bucket(len(self._buckets), members, self._variables))
        self._next_launch = 0
        self._passes = 0  # backward passes that reached a hook since the last step
        self._in_pass = False
        self._hooks = [
            var.register_post_accumulate_grad_hook(self._hook_for(bucket, k, var))  # type: ignore[no-untyped-call]  # untyped in torch
            for bucket in self._buckets
            for k, var in enumerate(self._variables[j] for j in bucket.members)
        ]

    @property
    def signature(self) -> list[tuple[str, int]]:
        """(dtype, elements) of each bucket, which every worker must share."""
        return [(str(b.buffer.dtype), b.buffer.numel()) for b in self._buckets]

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def check_layout(self) -> None:
        """Raises on every worker when the workers' bucket layouts differ."""
        self._collectives.check_same(self.signature, name="gradient bucket layout")

    def remove(self) -> None:
        """Unregisters the gradient hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _hook_for(
        self, bucket: _Bucket, k: int, var: torch.Tensor
    ) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if self._skip():
                return
            with self._lock:
                if not self._in_pass:
                    self._in_pass = True
                    self._passes += 1
                    Variable._execution_engine.queue_callback(self._end_pass)
                if bucket.handle is not None:  # in flight: the step reduces it again
                    return
                was_ready = bucket.seen[k] is not False
                self._copy(bucket, k)
                if not was_ready:
                    bucket.pending -= 1
                    if bucket.pending == 0:
                        self._launch_ready()

        return hook

    def _end_pass(self) -> None:
        with self._lock:
            self._in_pass = False

    def _copy(self, bucket: _Bucket, k: int) -> None:
        """Copies member ``k``'s gradient (zeros without one) into its slot."""
        grad = self._variables[bucket.members[k]].grad
        view = bucket.views[k]
        if grad is None:
            view.zero_()  # no gradient this step: it adds nothing to the sum
        elif grad.data_ptr() != view.data_ptr():  # else it accumulated in the slot itself
            view.copy_(grad.detach())
        bucket.seen[k] = _seen(grad)

    def _refresh(self, bucket: _Bucket) -> None:
        """Copies the members whose gradient changed since it was copied (or never was)."""
        for k, j in enumerate(bucket.members):
            if not _unchanged(bucket.seen[k], self._variables[j].grad):
                self._copy(bucket, k)

    def _changed(self, bucket: _Bucket) -> bool:
        variables = self._variables
        return any(
            not _unchanged(seen, variables[j].grad) for seen, j in zip(bucket.seen, bucket.members)
        )

    def _launch_ready(self) -> None:
        buckets = self._buckets
        while self._next_launch < len(buckets) - 1:  # the last one goes at the step
            bucket = buckets[self._next_launch]
            if bucket.pending > 0:
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket, slots: tuple[bool, bool] = (False, False)) -> None:
        flags = []
        for view, j in zip(bucket.views, bucket.members):
            var = self._variables[j]
            grad = var.grad
            flags.append(grad is not None)
            if grad is not None and grad.data_ptr() == view.data_ptr():
                var.grad = view.clone()  # the buffer is about to be reduced in place
        flags.extend(slots)
        bucket.flags.copy_(torch.tensor(flags, dtype=bucket.flags.dtype))
        bucket.handle = self._collectives.all_reduce_async(
            [bucket.buffer], ReduceOp.SUM, name=bucket.name
        )

    def finish(self) -> None:
        """Launches what is left, waits for every bucket and hands the sums to `.grad`.

        Raises:
            CollectiveMismatchError: workers made different numbers of backward
                passes since the last step (on every worker).
        """
        with self._lock:
            buckets = self._buckets
            launched, self._next_launch = self._next_launch, 0
            changed = any(self._changed(b) for b in buckets[:launched])
            passes, self._passes, self._in_pass = self._passes, 0, False
            for bucket in buckets[launched:]:
                self._refresh(bucket)
                self._launch(bucket, (passes != 1, changed))
            totals = [self._wait(bucket) for bucket in buckets]
            odd_passes, any_changed = (x != 0 for x in totals[-1][-2:].tolist())
            if odd_passes:
                self._check_passes(passes)
            if any_changed or (odd_passes and passes > 1):
                for bucket in buckets:  # reduce the final gradients again, everywhere
                    for k in range(len(bucket.members)):  # the buffer holds sums now
                        self._copy(bucket, k)
                    self._launch(bucket)
                totals = [self._wait(bucket) for bucket in buckets]
            for bucket, total in zip(buckets, totals):
                self._write(bucket, total)
                bucket.reset()

    def _check_passes(self, passes: int) -> None:
        try:
            self._collectives.check_same(
                passes, name="backward passes since the last optimizer step"
            )
        except CollectiveMismatchError as exc:
            raise CollectiveMismatchError(
                f"{exc} Gradients are summed across workers at the optimizer step, so "
                "every worker must run the same number of backward passes (outside "
                "no_sync) between two optimizer steps."
            ) from exc

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
        for k, (view, j) in enumerate(zip(bucket.views, bucket.members)):
            var = self._variables[j]
            if var.grad is None and bucket.flags[k].item() == 0:
                continue  # no worker has a gradient for it: it stays None
            var.grad = view  # see NOTE [overlapped gradient sync]: no copy back
