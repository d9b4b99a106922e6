"""Buffers (batch-norm statistics) made to agree after each `run`, with no host sync.

# NOTE [buffer sync]
Kernels such as batch norm update ``running_mean``/``running_var`` in place inside
the kernel, so after a `run` with several replicas in sync every replica's copy of
a buffer may differ. After each such `run`:

* floating buffers (MEAN aggregation, TF's rule for BatchNorm's moving
  statistics) take the mean over all replicas, *element by element where some
  replica changed them*: an element that no replica changed keeps its value bit
  for bit, so a constant floating buffer (a mask, a positional table) never
  drifts by rounding. "Changed" compares with the value every replica agreed on
  at the last sync (one worker: replica 0's copy);
* other buffers (``num_batches_tracked``) take replica 0's value on worker 0.

Everything stays on the device: the copies are concatenated per dtype on the
first replica's device, compared there, and, across workers, summed with one
all-reduce per dtype whose payload carries both the sums and the per-element
"changed" counts (worker 0's value for the others: every other worker
contributes zeros). Then ``torch.where`` picks, and every copy is overwritten.
No ``.item()``, no ``torch.equal``, no flags read on the host: a step keeps the
GPU's queue full, as DistributedDataParallel's buffer broadcast does. The price
is that every buffer's data travels every step (DDP broadcasts them all too)
and is rewritten, changed or not. The layout (which buffers, their dtypes and
shapes) is checked across workers once, and again whenever it changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from distribute import _torch
from distribute._enums import ReduceOp, VariableAggregation
from distribute.collectives.packing import slot_views

if TYPE_CHECKING:
    from distribute.collectives.base import CrossWorker
    from distribute.variables import DistributedVariable

__all__ = ["BufferSync"]


class _Group:
    """Buffers of one dtype and one rule (mean, or worker 0's replica 0)."""

    __slots__ = ("agreed", "dtype", "mean", "members")

    def __init__(self, dtype: torch.dtype, mean: bool) -> None:
        self.dtype = dtype
        self.mean = mean
        self.members: list[DistributedVariable] = []
        self.agreed: torch.Tensor | None = None  # across workers: the last synced value


def _transport_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype is torch.bool else dtype


class BufferSync:
    """Makes a strategy's buffers agree over every replica (see NOTE [buffer sync]).

    Args:
        devices: the local replica devices.
        num_replicas: replicas in sync over all workers.
        worker_index: this worker's index.
        collectives: the cross-worker collectives, None for one worker.
    """

    def __init__(
        self,
        devices: Sequence[torch.device],
        num_replicas: int,
        worker_index: int,
        collectives: CrossWorker | None,
    ) -> None:
        self._devices = list(devices)
        self._n = num_replicas
        self._worker_index = worker_index
        self._collectives = collectives
        self._key: tuple[tuple[int, torch.dtype, tuple[int, ...]], ...] = ()
        self._groups: list[_Group] = []
        self._checked = False

    def _plan(self, buffers: Sequence[DistributedVariable]) -> list[_Group]:
        key = tuple((id(b), b.dtype, tuple(b.shape)) for b in buffers)
        if key != self._key:
            groups: dict[tuple[torch.dtype, bool], _Group] = {}
            for b in buffers:
                mean = b._ds_aggregation is VariableAggregation.MEAN and b.is_floating_point()
                group = groups.setdefault((b.dtype, mean), _Group(b.dtype, mean))
                group.members.append(b)
            self._key = key
            self._groups = list(groups.values())
            self._checked = False  # a new layout: check it across workers once
        return self._groups

    def sync(self, buffers: Sequence[DistributedVariable]) -> None:
        """Averages (or takes worker 0's replica 0 of) every buffer, on the device."""
        groups = self._plan(buffers)
        device = self._devices[0]
        cross = self._collectives
        local = [self._flatten(g, device) for g in groups]  # [group][replica] flat copies
        payloads = []
        for group, flats in zip(groups, local):
            if not group.mean:
                first = flats[0]
                payloads.append(first if self._worker_index == 0 else torch.zeros_like(first))
                continue
            reference = group.agreed if cross is not None else flats[0]
            total = flats[0].clone() if len(flats) == 1 else torch.stack(flats).sum(0)
            if reference is None:  # nothing agreed yet: every element counts as changed
                changed = torch.ones_like(total)
            else:
                changed = (torch.stack(flats) != reference).any(0).to(total.dtype)
            payloads.append(torch.cat([total, changed]))
        if cross is not None:
            wire = [p.to(_transport_dtype(p.dtype)) for p in payloads]
            wire = cross.all_reduce(wire, ReduceOp.SUM, name="buffers", check=not self._checked)
            self._checked = True
            payloads = [w.to(p.dtype) for w, p in zip(wire, payloads)]
        for group, flats, payload in zip(groups, local, payloads):
            if group.mean:
                numel = flats[0].numel()
                total, changed = payload[:numel], payload[numel:]
                reference = group.agreed if cross is not None else flats[0]
                result = (
                    total / self._n
                    if reference is None
                    else (torch.where(changed > 0, total / self._n, reference))
                )
                if cross is not None:
                    group.agreed = result
            else:
                result = payload
            self._write(group, result)

    def _flatten(self, group: _Group, device: torch.device) -> list[torch.Tensor]:
        """One flat copy of the group's buffers per local replica, on ``device``."""
        flats = []
        for replica in range(len(self._devices)):
            parts = [b._plain_component(replica).reshape(-1) for b in group.members]
            flats.append(torch.cat(parts).to(device, non_blocking=True))
        return flats

    def _write(self, group: _Group, result: torch.Tensor) -> None:
        with torch.no_grad():
            for replica, device in enumerate(self._devices):
                source = result if result.device == device else result.to(device)
                targets = [b._plain_component(replica) for b in group.members]
                _torch.foreach_copy_(targets, slot_views(source, targets))
        for b in group.members:
            b._mark_synced()
