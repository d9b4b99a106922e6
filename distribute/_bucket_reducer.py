"""Gradient buckets all-reduced across workers while the backward pass runs.

# NOTE [overlapped gradient sync]
With one local replica per worker (the common multi-worker layout) the sum over
replicas is a pure cross-process all-reduce, so it can start before the optimizer
step, as DistributedDataParallel does:

* the optimizer's variables are grouped, last layer first (gradients become ready
  in reverse), into buckets of about ``bytes_per_pack`` bytes, the first one small
  so communication starts early;
* a post-accumulate-grad hook counts each bucket's ready gradients; a full bucket
  is flattened and its all-reduce launched asynchronously, always in bucket order
  (every worker must issue the same collectives in the same order);
* at the optimizer step, buckets not launched yet (unused variables, or backward
  passes under ``no_sync``) are launched, everything is waited for, and the sums are
  copied back into ``.grad``.

A variable whose gradient accumulates again after its bucket was launched (two
backward passes without a step, outside ``no_sync``) makes that bucket stale: its
result is discarded and the bucket is reduced again at the step with the final
gradients, so accumulation stays exact.
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
    def __init__(self, members: list[int], dtype: torch.dtype) -> None:
        self.members = members
        self.dtype = dtype
        self.pending = len(members)
        self.handle: _Handle | None = None
        self.stale = False


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
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j, var in enumerate(self._variables):
            by_dtype.setdefault(var.dtype, []).append(j)
        self._buckets: list[_Bucket] = []
        for dtype, indices in by_dtype.items():
            sizes = [self._variables[j].numel() * dtype.itemsize for j in indices]
            first = min(FIRST_BUCKET_BYTES, bytes_per_pack) if not self._buckets else None
            for pack in pack_by_bytes(sizes, bytes_per_pack, first_pack_bytes=first):
                self._buckets.append(_Bucket([indices[k] for k in pack], dtype))
        self._bucket_of = {j: b for b, bucket in enumerate(self._buckets) for j in bucket.members}
        self._next_launch = 0
        self._hooks = [
            var.register_post_accumulate_grad_hook(self._hook_for(j))  # type: ignore[no-untyped-call]  # untyped in torch
            for j, var in enumerate(self._variables)
        ]

    @property
    def signature(self) -> list[tuple[str, int]]:
        """(dtype, elements) of each bucket, which every worker must share."""
        return [
            (str(b.dtype), sum(self._variables[j].numel() for j in b.members))
            for b in self._buckets
        ]

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

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if self._skip():
                return
            with self._lock:
                bucket = self._buckets[self._bucket_of[index]]
                if bucket.handle is not None:
                    bucket.stale = True
                    return
                bucket.pending -= 1
                self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.pending > 0:
                return
            self._launch(self._next_launch)
            self._next_launch += 1

    def _flat(self, bucket: _Bucket) -> torch.Tensor:
        parts = []
        for j in bucket.members:
            var = self._variables[j]
            grad = var.grad
            parts.append(
                grad.detach().reshape(-1)
                if grad is not None
                else torch.zeros(var.numel(), dtype=bucket.dtype, device=var.device)
            )
        return torch.cat(parts) if len(parts) > 1 else parts[0].clone()

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        bucket.handle = self._collectives.all_reduce_async(
            [self._flat(bucket)], ReduceOp.SUM, name=f"gradients (bucket {b})"
        )

    def finish(self) -> None:
        """Launches what is left, waits for every bucket and writes the sums to `.grad`."""
        with self._lock:
            while self._next_launch < len(self._buckets):
                self._launch(self._next_launch)
                self._next_launch += 1
            for b, bucket in enumerate(self._buckets):
                assert bucket.handle is not None
                total = bucket.handle.wait()[0]
                if bucket.stale:
                    self._launch(b)
                    assert bucket.handle is not None
                    total = bucket.handle.wait()[0]
                self._write(bucket, total)
                bucket.handle = None
                bucket.stale = False
                bucket.pending = len(bucket.members)
            self._next_launch = 0

    def _write(self, bucket: _Bucket, total: torch.Tensor) -> None:
        offset = 0
        for j in bucket.members:
            var = self._variables[j]
            numel = var.numel()
            view = total[offset : offset + numel].view(var.shape)
            offset += numel
            if var.grad is None:
                var.grad = view.clone()
            else:
                var.grad.copy_(view)
