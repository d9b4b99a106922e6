"""`MultiWorkerMirroredStrategy`: synchronous data parallelism across processes.

Each process (a *worker*) runs one or more local replicas; a `torch.distributed`
process group (gloo on CPUs, nccl on GPUs) joins the workers. Global replica ids
are ``worker_index * local_replicas + local_id``.

Launch with torchrun (the cluster is read from its variables)::

    torchrun --nproc_per_node=2 examples/train_digits.py --strategy multi_worker

or with one ``TF_CONFIG`` per process, or under SLURM (``srun``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from distribute.cluster_resolver import ClusterResolver, resolve_cluster
from distribute.collectives.options import CommunicationOptions
from distribute.strategies._cluster import (
    WorkerIdentity,
    backend_for,
    bind_process,
    join_cluster,
    worker_devices,
)
from distribute.strategies._devices import device_list, replica_devices
from distribute.strategies._replicated import (
    DEFAULT_TIMEOUT_SECONDS,
    ReplicatedExtended,
    Workers,
)
from distribute.strategies.base import Strategy

if TYPE_CHECKING:
    from distribute.collectives.process_group import ProcessGroupCollectives

__all__ = ["MultiWorkerMirroredStrategy"]

logger = logging.getLogger(__name__)

#: DistributedDataParallel's default bucket size, used when bytes_per_pack is 0.
DEFAULT_BYTES_PER_PACK = 25 * 1024 * 1024


class MultiWorkerMirroredStrategy(WorkerIdentity, Strategy):
    """Synchronous training on every replica of every worker process.

    Variables created in scope are mirrored on the local replicas and start from
    the chief's (rank 0's) values on every worker, whatever each worker's seed.
    Gradients are summed over all replicas of all workers at each optimizer step;
    with one local replica the sum is overlapped with the backward pass in
    buckets of ``bytes_per_pack`` bytes (25 MiB by default), as
    DistributedDataParallel does.

    Args:
        cluster_resolver: who is in the cluster; None reads torchrun's variables,
            else ``TF_CONFIG``, else SLURM, else runs as a single worker.
        communication_options: `ds.experimental.CommunicationOptions` (pack size,
            timeout, implementation: RING = gloo, NCCL = nccl, AUTO picks nccl
            when every replica is a CUDA device).
        devices: this worker's replica devices; None: this process's own GPU
            (``cuda:<local_rank>``, or a SLURM task's first GPU) when CUDA is
            available, else one CPU. Logical CPUs (``["cpu:0", "cpu:1"]``) give
            several replicas per process. The process is bound to its first CUDA
            device (``torch.cuda.set_device``), which nccl's group also uses.

    Example:
        >>> import distribute as ds
        >>> strategy = ds.MultiWorkerMirroredStrategy()  # one worker without a launcher
        >>> strategy.num_replicas_in_sync
        1
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        devices: str | torch.device | Sequence[str | torch.device] | None = None,
    ) -> None:
        options = communication_options or CommunicationOptions()
        resolver = cluster_resolver if cluster_resolver is not None else resolve_cluster()
        self._resolver = resolver
        self._options = options
        names = device_list(devices if devices is not None else worker_devices(resolver))
        replicas = replica_devices(names)  # checked before any process group exists
        bytes_per_pack = options.bytes_per_pack or DEFAULT_BYTES_PER_PACK
        timeout = float(options.timeout_seconds or DEFAULT_TIMEOUT_SECONDS)
        self._collectives: ProcessGroupCollectives | None = None
        world_size = resolver.world_size if resolver is not None else 1
        bound = bind_process(replicas)
        workers = None
        if resolver is not None and world_size > 1:
            backend = backend_for(options.implementation, replicas)
            self._collectives = join_cluster(resolver, backend, timeout, bound, group_of_one=False)
            assert self._collectives is not None  # several workers
            workers = Workers(resolver.rank, world_size, self._collectives)
            weakref.finalize(self, self._collectives.shutdown)
            if resolver.rank == 0:
                logger.info(
                    "MultiWorkerMirroredStrategy: %d workers x %d local replicas, backend %s",
                    world_size,
                    len(names),
                    backend,
                )
        super().__init__(
            ReplicatedExtended(
                self,
                names,
                timeout_seconds=timeout,
                bytes_per_pack=bytes_per_pack,
                workers=workers,
            )
        )
        self._devices = names

    def shutdown(self) -> None:
        """Leaves the process group, destroying it unless another strategy still uses it
        (NOTE [shared groups]); the strategy cannot run collectives afterwards."""
        handler = self._extended.step_handler
        if handler is not None:
            handler.close()  # a later backward must not reach them
        if self._collectives is not None:
            self._collectives.shutdown()

    def __repr__(self) -> str:
        return (
            f"MultiWorkerMirroredStrategy(worker={self.worker_index}/{self.num_workers}, "
            f"devices={self._devices})"
        )
