"""MirroredStrategy's design written in plain PyTorch, with no library: the floor of
replica threads on this machine (issue 40).

One persistent thread per replica, each with its own copy of the model and its own
optimizer. A step hands every thread its shard of the batch; each runs forward and
backward; they meet once, where the last to arrive sums the gradients in replica
order (``foreach_add``) and every replica copies the sums in, in its own thread
(``foreach_copy_``);
each steps its own optimizer and zeroes its gradients; the last to finish wakes the
caller, which sums the losses. This is what `distribute.MirroredStrategy` does on
logical CPU devices, less its checks, contexts and hooks: the figure a threaded
replica design cannot beat, against which the library's own cost is read.

Imported by the benchmark scripts (this directory is first on ``sys.path``).
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["PlainReplicas", "cross_entropy"]

LossOf = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(global_batch: int) -> LossOf:
    """A replica's loss as `ds.compute_average_loss` makes it: the sum of its examples'
    cross-entropies over the global batch size."""

    def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        return per_example.sum() / global_batch

    return loss_of


def _total(losses: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The replicas' losses summed in replica order (as `reduce("sum")` sums them)."""
    total = losses[0]
    assert total is not None
    for loss in losses[1:]:
        assert loss is not None
        total = total + loss
    return total


class PlainReplicas:
    """``n`` replica threads over copies of ``model``, one step at a time.

    Args:
        model: copied once per replica (replica 0 keeps the original).
        make_optimizer: builds a replica's optimizer from its parameters.
        loss_of: ``loss_of(model, x, y)``, the replica's loss (already divided by the
            global batch size; `cross_entropy`).
        n: the number of replicas.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        make_optimizer: Callable[[Any], torch.optim.Optimizer],
        loss_of: LossOf,
        n: int,
    ) -> None:
        if n < 2:
            raise ValueError(f"PlainReplicas needs at least 2 replicas, got {n}")
        self.models = [model] + [copy.deepcopy(model) for _ in range(n - 1)]
        self._optimizers = [make_optimizer(m.parameters()) for m in self.models]
        self._loss_of = loss_of
        self._params = [list(m.parameters()) for m in self.models]
        self._barrier = threading.Barrier(n, action=self._sum)
        self._totals: list[torch.Tensor] = []
        self._error: BaseException | None = None
        self._tasks: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(n)]
        self._losses: list[torch.Tensor | None] = [None] * n
        self._done = threading.Event()
        self._left = [0]
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, args=(r,), daemon=True) for r in range(n)
        ]
        for t in self._threads:
            t.start()

    def _sum(self) -> None:
        """The sums, in replica order (run once, by the last replica to arrive)."""
        grads = [[p.grad for p in params] for params in self._params]
        totals = torch._foreach_add(grads[0], grads[1])
        for more in grads[2:]:
            torch._foreach_add_(totals, more)
        self._totals = totals

    def _copy_in(self, r: int) -> None:
        torch._foreach_copy_([p.grad for p in self._params[r]], self._totals)

    def _loop(self, r: int) -> None:
        model, optimizer = self.models[r], self._optimizers[r]
        while True:
            task = self._tasks[r].get()
            if task is None:
                return
            x, y = task
            try:
                loss = self._loss_of(model, x, y)
                loss.backward()
                self._barrier.wait()
                self._copy_in(r)  # each replica in its own thread, as the library does
                optimizer.step()
                optimizer.zero_grad()
                self._losses[r] = loss.detach()
            except BaseException as e:  # never leave the caller waiting
                self._error = self._error or e
                self._barrier.abort()
            with self._lock:
                self._left[0] -= 1
                last = self._left[0] == 0
            if last:
                self._done.set()

    def step(self, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> torch.Tensor:
        """One step over the shards ``xs``, ``ys`` (one per replica): the summed loss."""
        self._left[0] = len(self._tasks)
        self._done.clear()
        for task, x, y in zip(self._tasks, xs, ys):
            task.put((x, y))
        self._done.wait()
        if self._error is not None:
            raise RuntimeError("a plain replica failed") from self._error
        return _total(self._losses)

    def step_in_turn(self, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> torch.Tensor:
        """The same step with no threads: the replicas one after the other in the
        caller's thread (what replicas as coroutines would cost, without their hazard:
        `docs/architecture.md`, "Replicas in one process")."""
        losses = []
        for model, x, y in zip(self.models, xs, ys):
            loss = self._loss_of(model, x, y)
            loss.backward()
            losses.append(loss.detach())
        self._sum()
        for r, optimizer in enumerate(self._optimizers):
            self._copy_in(r)
            optimizer.step()
            optimizer.zero_grad()
        return _total(losses)

    def close(self) -> None:
        """Stops the threads."""
        for task in self._tasks:
            task.put(None)
        for t in self._threads:
            t.join()
