"""This worker's place among the input pipelines (`InputWorkers`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from distribute.errors import InvalidArgumentError

__all__ = ["InputWorkers"]


def _identity(n: int) -> int:
    return n


@dataclass(frozen=True)
class InputWorkers:
    """The devices of this worker's replicas and this worker's place among workers.

    Args:
      devices: one device per local replica.
      worker_index: this worker's index.
      num_workers: how many workers read input.
      sum_across_workers: sums an int over all workers; the end-of-data
        agreement calls it once per step (an all-reduce across processes,
        the identity in one process).
      gather_across_workers: every worker's bytes, in worker order (an
        all-gather across processes); used only when a worker without any data
        needs the others' element structure.

    Example:
        >>> import distribute as ds, torch
        >>> cpus = (torch.device("cpu"),) * 2
        >>> workers = ds.data.InputWorkers(cpus, worker_index=1, num_workers=2)
        >>> len(workers.devices), workers.worker_index, workers.sum_across_workers(3)
        (2, 1, 3)
    """

    devices: tuple[torch.device, ...]
    worker_index: int = 0
    num_workers: int = 1
    sum_across_workers: Callable[[int], int] = field(default=_identity, compare=False)
    gather_across_workers: Callable[[bytes], list[bytes]] = field(
        default=lambda data: [data], compare=False
    )
    #: The cross-worker collectives, for whoever needs every worker (a checkpoint).
    collectives: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(torch.device(d) for d in self.devices))
        if not self.devices:
            raise InvalidArgumentError("InputWorkers needs at least one device.")
        if not 0 <= self.worker_index < self.num_workers:
            raise InvalidArgumentError(
                f"worker_index must be in [0, num_workers={self.num_workers}), got "
                f"{self.worker_index}."
            )

    @property
    def local_replicas(self) -> int:
        return len(self.devices)

    @property
    def num_replicas_in_sync(self) -> int:
        return self.num_workers * len(self.devices)

    @property
    def cpu_only(self) -> bool:
        """Whether every local replica's device is a CPU."""
        return all(d.type == "cpu" for d in self.devices)
