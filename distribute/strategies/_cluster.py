"""Joining a cluster of worker processes: the one device each process drives, the
process group's backend, and what every worker must agree on at start-up.

Shared by the strategies that run one process per worker over a torch.distributed
process group (`MultiWorkerMirroredStrategy`, `FullyShardedStrategy`,
`ModelParallelStrategy`): `join_cluster` is the one way they join.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from distribute import _env, _torch
from distribute.cluster_resolver import ClusterResolver
from distribute.collectives.options import CommunicationImplementation
from distribute.errors import InvalidArgumentError
from distribute.strategies._devices import local_gpu

if TYPE_CHECKING:
    from distribute.collectives.process_group import ProcessGroupCollectives

__all__ = [
    "WorkerIdentity",
    "backend_for",
    "bind_process",
    "describe_cluster",
    "join_cluster",
    "worker_devices",
]


class WorkerIdentity:
    """This worker's place in its cluster, read from the strategy's resolver (None
    for a single worker): the properties of a strategy with one process per worker."""

    _resolver: ClusterResolver | None

    @property
    def cluster_resolver(self) -> ClusterResolver | None:
        """The resolver this strategy was built from (None for a single worker)."""
        return self._resolver

    @property
    def worker_index(self) -> int:
        """This worker's index (its rank in the process group)."""
        return self._resolver.rank if self._resolver is not None else 0

    @property
    def num_workers(self) -> int:
        """How many worker processes train together."""
        return self._resolver.world_size if self._resolver is not None else 1

    @property
    def is_chief(self) -> bool:
        """Whether this worker saves checkpoints and writes summaries (rank 0)."""
        return self.worker_index == 0


def worker_devices(resolver: ClusterResolver | None) -> list[str]:
    """``cuda:<this process's GPU>`` (see `local_gpu`) where CUDA is available, else the CPU."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return ["cpu"]
    if resolver is None:
        return ["cuda:0"]
    index = local_gpu(
        resolver.local_rank,
        resolver.local_world_size,
        count,
        _env.read_environment().cuda_visible_devices,
        assigned=getattr(resolver, "gpu_ids", ()),
    )
    return [f"cuda:{index}"]


def bind_process(devices: Sequence[torch.device]) -> torch.device | None:
    """Makes this process's first CUDA replica device its current device.

    Without it every process's plain ``.cuda()`` (and NCCL's own buffers) land on GPU 0.
    """
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return None
    torch.cuda.set_device(cuda[0])
    return cuda[0]


def describe_cluster(resolver: ClusterResolver, world_size: int) -> str:
    """What every worker must agree on: the training world and the cluster spec."""
    spec = {str(job): tasks for job, tasks in resolver.cluster_spec().as_dict().items()}
    return json.dumps({"world_size": world_size, "cluster": spec}, sort_keys=True, default=str)


def backend_for(
    implementation: CommunicationImplementation, devices: Sequence[torch.device]
) -> str:
    all_cuda = all(d.type == "cuda" for d in devices)
    if implementation is CommunicationImplementation.NCCL:
        if not all_cuda:
            raise InvalidArgumentError(
                "CommunicationImplementation.NCCL needs every replica on a CUDA device, got "
                f"{[str(d) for d in devices]}; use RING (gloo) for CPU replicas."
            )
        return "nccl"
    if implementation is CommunicationImplementation.RING:
        return "gloo"
    return "nccl" if all_cuda and torch.distributed.is_nccl_available() else "gloo"


def join_cluster(
    resolver: ClusterResolver | None,
    backend: str,
    timeout: float,
    device: torch.device | None,
    *,
    group_of_one: bool,
) -> ProcessGroupCollectives | None:
    """This worker's collectives over the cluster's workers: the default process group,
    created at the rendezvous the resolver names (or adopted where torch.distributed
    is already initialised for the same world).

    One worker: with ``group_of_one`` (DTensor and FSDP need a group) an adopted
    default group, else a group of one served by an in-process store (no port);
    without it None (nothing to agree on).

    Args:
        resolver: the cluster (None: one worker).
        backend: ``"gloo"`` or ``"nccl"`` (`backend_for`).
        timeout: the collectives' timeout, in seconds.
        device: this process's GPU (`bind_process`), for nccl.
        group_of_one: whether a single worker gets a group too.

    Example::

        collectives = join_cluster(resolve_cluster(), "gloo", 300.0, None, group_of_one=False)
    """
    from distribute.collectives.process_group import ProcessGroupCollectives

    world_size = resolver.world_size if resolver is not None else 1
    if resolver is not None and world_size > 1:
        return ProcessGroupCollectives.create(
            resolver.rank,
            world_size,
            resolver.master_addr,
            resolver.master_port,
            backend=backend,
            timeout_seconds=timeout,
            cluster=describe_cluster(resolver, world_size),
            prefix=resolver.rendezvous_prefix,
            launcher_serves=resolver.launcher_serves_rendezvous,
            device=device if backend == "nccl" else None,
        )
    if not group_of_one:
        return None
    if dist.is_initialized():
        return ProcessGroupCollectives.adopt(timeout_seconds=timeout)
    dist.init_process_group(
        backend, store=_torch.HashStore(), rank=0, world_size=1, device_id=device
    )
    return ProcessGroupCollectives(
        None, None, 0, 1, backend, timeout, owns_group=True, device=device
    )
