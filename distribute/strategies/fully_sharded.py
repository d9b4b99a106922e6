"""`FullyShardedStrategy`: data parallelism with parameters, gradients and optimizer
state sharded across the workers by PyTorch's FSDP2 (ZeRO-3 by default).

Constructed like `MultiWorkerMirroredStrategy` (torchrun, ``TF_CONFIG`` or SLURM; gloo
on CPUs, nccl on GPUs), one replica per worker process. Modules built in its scope
are sharded when the scope is left (or at the first `run`): afterwards each worker
holds only its shard of every parameter (a DTensor), its gradients and its optimizer
state. See NOTE [sharding] in `_sharding.py` for what is sharded and how the
library's rules (the chief's initial values, summed gradients, no silent hangs) are
kept around FSDP.

Launch with torchrun::

    torchrun --nproc_per_node=2 examples/train_digits.py --strategy fully_sharded
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distribute.cluster_resolver import ClusterResolver, resolve_cluster
from distribute.collectives.options import CommunicationOptions
from distribute.errors import InvalidArgumentError
from distribute.gradients.sharded import ShardedStepHandler
from distribute.strategies import _cluster
from distribute.strategies._cluster import WorkerIdentity
from distribute.strategies._devices import device_list, replica_devices
from distribute.strategies._replicated import (
    DEFAULT_TIMEOUT_SECONDS,
    ReplicatedExtended,
    Workers,
)
from distribute.strategies.base import Strategy

if TYPE_CHECKING:
    from distribute.strategies._sharding import ShardingOptions

__all__ = ["FullyShardedStrategy"]

logger = logging.getLogger(__name__)


class FullyShardedStrategy(WorkerIdentity, Strategy):
    """Synchronous training with parameters, gradients and optimizer state sharded
    across the workers (FSDP2), for models larger than one device.

    Every worker is one replica. A module built in the scope is sharded when the
    outermost scope is left (or at the next `run`): each worker then holds only its
    shard of each parameter (a DTensor), and gradients and optimizer state follow.
    Initial values are the chief's, as under `MultiWorkerMirroredStrategy`; gradients
    are summed over the workers before the step (scale the loss by the global batch:
    `ds.compute_average_loss`). Unmodified `torch.optim` optimizers built in the scope
    (or later, from `model.parameters()`) train the shards.

    Args:
        cluster_resolver: who is in the cluster; None reads torchrun's variables, else
            ``TF_CONFIG``, else SLURM, else runs as a single worker.
        communication_options: `ds.experimental.CommunicationOptions` (timeout,
            implementation: RING = gloo, NCCL = nccl, AUTO: nccl on CUDA).
        reshard_after_forward: True (ZeRO-3): units free their gathered parameters
            after forward and gather them again in backward; False (ZeRO-2): they keep
            them until backward.
        mesh_shape: ``(replicate, shard)`` for hybrid sharding (HSDP): parameters are
            sharded within groups of ``shard`` workers and replicated across the
            ``replicate`` groups; None shards over every worker.
        shard_units: the sharding units: module classes, or a predicate
            ``fn(name, module) -> bool``; None: the repeated blocks of every
            `ModuleList`/`Sequential` (two or more modules of one class) and the root.
        mixed_precision: a `torch.distributed.fsdp.MixedPrecisionPolicy` (parameter
            and reduce dtypes), or None.
        cpu_offload: keep the shards (and optimizer state) on the CPU between uses.
        deferred_init: build the model without any worker ever holding it whole: every
            worker runs the constructor drawing the chief's numbers and keeps only its
            shard of each module's parameters once the next module registers its own
            (NOTE [deferred init]). The values are exactly the chief's; code that
            initializes a module's parameters after its __init__ (a parent's
            ``self.apply(init_weights)``) is refused with `LateInitError`.
        devices: this worker's device (one); None: its GPU, else the CPU.

    Raises:
        InvalidArgumentError: several devices for one worker, a ``mesh_shape`` that
            does not multiply to the number of workers.

    Example:
        >>> import distribute as ds, torch
        >>> strategy = ds.experimental.FullyShardedStrategy()  # one worker without a launcher
        >>> with strategy.scope():
        ...     model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> type(model[0].weight).__name__
        'DTensor'
        >>> strategy.shutdown()
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        *,
        reshard_after_forward: bool = True,
        mesh_shape: tuple[int, int] | None = None,
        shard_units: Sequence[type[torch.nn.Module]]
        | Callable[[str, torch.nn.Module], bool]
        | None = None,
        mixed_precision: Any = None,
        cpu_offload: bool = False,
        deferred_init: bool = False,
        devices: str | torch.device | Sequence[str | torch.device] | None = None,
    ) -> None:
        from distribute.strategies._sharding import (
            ShardedModules,
            ShardingOptions,
            device_mesh,
        )

        options = communication_options or CommunicationOptions()
        resolver = cluster_resolver if cluster_resolver is not None else resolve_cluster()
        self._resolver = resolver
        names = device_list(devices if devices is not None else _cluster.worker_devices(resolver))
        if len(names) != 1:
            raise InvalidArgumentError(
                f"FullyShardedStrategy runs one replica per worker process, got {len(names)} "
                f"devices {names}; start one process per device (torchrun "
                "--nproc_per_node=<devices>), or use MultiWorkerMirroredStrategy for several "
                "local replicas"
            )
        (device,) = replica_devices(names)
        timeout = float(options.timeout_seconds or DEFAULT_TIMEOUT_SECONDS)
        world_size = resolver.world_size if resolver is not None else 1
        rank = resolver.rank if resolver is not None else 0
        shape = _mesh_shape(mesh_shape, world_size)
        bound = _cluster.bind_process([device])
        backend = _cluster.backend_for(options.implementation, [device])
        collectives = _cluster.join_cluster(resolver, backend, timeout, bound, group_of_one=True)
        assert collectives is not None  # group_of_one
        self._collectives = collectives
        weakref.finalize(self, self._collectives.shutdown)
        mesh, replicate_group = device_mesh(device, dist.get_world_size(), shape)
        self._sharding_options = ShardingOptions(
            reshard_after_forward=reshard_after_forward,
            mesh_shape=shape,
            shard_units=shard_units,
            mixed_precision=mixed_precision,
            cpu_offload=cpu_offload,
            deferred_init=deferred_init,
        )
        sharding = ShardedModules(
            self, self._sharding_options, self._collectives, device, mesh, replicate_group
        )
        super().__init__(
            ReplicatedExtended(
                self,
                names,
                timeout_seconds=timeout,
                workers=(Workers(rank, world_size, self._collectives) if world_size > 1 else None),
                # FSDP reduce-scattered every gradient in backward: nothing to sum.
                step_handler=lambda group: ShardedStepHandler(lambda: not group.syncing),
                capture=sharding,
                lifecycle=sharding,
            )
        )
        self._device = names[0]
        if rank == 0 and world_size > 1:
            logger.info(
                "FullyShardedStrategy: %d workers, mesh %s, backend %s",
                world_size,
                shape or (world_size,),
                backend,
            )

    @property
    def sharding_options(self) -> ShardingOptions:
        """How modules built in the scope are sharded."""
        return self._sharding_options

    def shutdown(self) -> None:
        """Leaves the process group, destroying it unless another strategy still uses it
        (NOTE [shared groups]); the strategy cannot run collectives afterwards."""
        self._collectives.shutdown()

    def __repr__(self) -> str:
        return (
            f"FullyShardedStrategy(worker={self.worker_index}/{self.num_workers}, "
            f"device={self._device!r})"
        )


def _mesh_shape(shape: tuple[int, int] | None, world_size: int) -> tuple[int, int] | None:
    if shape is None:
        return None
    if len(shape) != 2 or any(int(n) < 1 for n in shape):
        raise InvalidArgumentError(
            f"mesh_shape must be (replicate, shard) with positive sizes, got {shape}"
        )
    replicate, shard = int(shape[0]), int(shape[1])
    if replicate * shard != world_size:
        raise InvalidArgumentError(
            f"mesh_shape {shape}: replicate({replicate}) * shard({shard}) = "
            f"{replicate * shard} != the {world_size} workers; pick sizes whose product is "
            "the number of workers"
        )
    return (replicate, shard)
