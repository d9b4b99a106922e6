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
* at the optimizer step, buckets not launched yet (unused variables, or backward
  passes under ``no_sync``) are filled and launched, everything is waited for, and
  the sums are copied back into ``.grad``.

Each buffer ends with one flag per variable (1 where this worker has a gradient),
summed with the gradients at no extra collective: a variable that no worker used
keeps ``.grad = None``, as it would in one process, so optimizers skip it (a zero
gradient would still apply weight decay and momentum to it).

The sums are copied back rather than handed over as views of the buffer: the
buffer is written again at the next step, so a ``.grad`` aliasing it would change
under anyone who kept it, and a backward pass accumulating into it would race
with an all-reduce in flight.

A variable whose gradient accumulates again after its bucket was launched (two
backward passes without a step, outside ``no_sync``) makes that bucket stale: its
result is discarded and the bucket is reduced again at the step with the final
gradients, so accumulation stays exact. A gradient that accumulates again before
its bucket launched is simply copied again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from distribute._enums import ReduceOp
from distribute.collectives.packing import pack_by_bytes

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


class _Bucket:
    """One bucket: its variables, their slots in its flat buffer, and this step's state."""

    __slots__ = (
        "buffer",
        "flags",
        "handle",
        "members",
        "name",
        "numel",
        "pending",
        "ready",
        "stale",
        "views",
    )

    def __init__(self, index: int, members: list[int], variables: Sequence[torch.Tensor]) -> None:
        first = variables[members[0]]
        numel = sum(variables[j].numel() for j in members)
        self.members = members
        self.name = f"gradients (bucket {index})"
        self.numel = numel
        self.buffer = torch.empty(numel + len(members), dtype=first.dtype, device=first.device)
        self.views = _slots(self.buffer, [variables[j] for j in members])
        self.flags = self.buffer[numel:]
        self.ready = [False] * len(members)
        self.pending = len(members)
        self.handle: _Handle | None = None
        self.stale = False

    def reset(self) -> None:
        self.ready = [False] * len(self.members)
        self.pending = len(self.members)
        self.handle = None
        self.stale = False


def _slots(flat: torch.Tensor, variables: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat``, one per variable, shaped like it, in order."""
    views = []
    offset = 0
    for var in variables:
        numel = var.numel()
        views.append(flat[offset : offset + numel].view(var.shape))
        offset += numel
    return views


def _copy_in(view: torch.Tensor, var: torch.Tensor) -> None:
    grad = var.grad
    if grad is None:
        view.zero_()  # no gradient this step: it adds nothing to the sum
    else:
        view.copy_(grad.detach())


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
        view = bucket.views[k]

        def hook(_: torch.Tensor) -> None:
            if self._skip():
                return
            with self._lock:
                if bucket.handle is not None:  # launched already: redo it at the step
                    bucket.stale = True
                    return
                _copy_in(view, var)
                if not bucket.ready[k]:
                    bucket.ready[k] = True
                    bucket.pending -= 1
                    if bucket.pending == 0:
                        self._launch_ready()

        return hook

    def _fill(self, bucket: _Bucket) -> None:
        """Copies every member's current gradient into the bucket's buffer."""
        for view, j in zip(bucket.views, bucket.members):
            _copy_in(view, self._variables[j])

    def _launch_ready(self) -> None:
        buckets = self._buckets
        while self._next_launch < len(buckets):
            bucket = buckets[self._next_launch]
            if bucket.pending > 0:
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        used = [self._variables[j].grad is not None for j in bucket.members]
        bucket.flags.copy_(torch.tensor(used, dtype=bucket.flags.dtype))
        bucket.handle = self._collectives.all_reduce_async(
            [bucket.buffer], ReduceOp.SUM, name=bucket.name
        )

    def finish(self) -> None:
        """Launches what is left, waits for every bucket and writes the sums to `.grad`."""
        with self._lock:
            buckets = self._buckets
            while self._next_launch < len(buckets):
                bucket = buckets[self._next_launch]
                self._fill(bucket)
                self._launch(bucket)
                self._next_launch += 1
            for bucket in buckets:
                assert bucket.handle is not None
                total = bucket.handle.wait()[0]
                if bucket.stale:
                    self._fill(bucket)
                    self._launch(bucket)
                    assert bucket.handle is not None
                    total = bucket.handle.wait()[0]
                self._write(bucket, total)
                bucket.reset()
            self._next_launch = 0

    def _write(self, bucket: _Bucket, total: torch.Tensor) -> None:
        # ``total`` is the buffer itself unless the backend needed a copy on another
        # device. The buffer is reused, so gradients get copies, never views.
        in_place = total.data_ptr() == bucket.buffer.data_ptr()
        views = bucket.views if in_place else _slots(total, bucket.views)
        for k, (view, j) in enumerate(zip(views, bucket.members)):
            var = self._variables[j]
            grad = var.grad
            if grad is None:
                if total[bucket.numel + k].item() == 0:
                    continue  # no worker has a gradient for it: it stays None
                var.grad = view.clone()
            else:
                grad.copy_(view)
