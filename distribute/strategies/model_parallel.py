"""`ModelParallelStrategy`: Keras 3's ``ModelParallel`` on PyTorch's DTensor.

One process per device (torchrun, ``TF_CONFIG`` or SLURM, as
`MultiWorkerMirroredStrategy`; gloo on CPUs, nccl on GPUs). The workers form a
`DeviceMesh` of any rank; variables built in the scope are laid out on it by a
`LayoutMap` (NOTE [model parallel layout] in `_tensor_parallel.py`); the batch is split
along the mesh axis ``batch_dim_name``, whose workers hold copies of the model and sum
their gradients (NOTE [batch-axis sums] in `_batch_gradients.py`). A replica is a
group of workers that share a coordinate on the batch axis: they receive the same rows,
and ``num_replicas_in_sync`` is the batch axis's size.

Launch with torchrun::

    torchrun --nproc_per_node=4 examples/train_transformer_mp.py --mesh 2,2

# NOTE [watched mesh collectives]
Inside a step most collectives are torch's own (DTensor's redistributions, FSDP's
gathers under ``fully_shard=True``), issued on the mesh axes' groups and waited for
inside torch, where the library's sliced waits cannot reach. So: every axis's group is
made with the library's timeout (gloo raises within it; nccl's is longer, as for the
default group), and a transport failure escaping the step (`is_transport_error`: a
peer's connection closed, the backend's timeout) is diagnosed by the world's watchers
(`ProcessGroupCollectives.transport_failure`): the lost ranks are named by their global
rank and mesh coordinate, the live ones are told the group broke, and the step raises
`CollectiveTimeoutError`. The library's own sums along the batch axis run on a sub-group
of the world's collectives (`ProcessGroupCollectives.subgroup`), diagnosed the same way.
Errors of the user's own code pass through untouched.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from distribute import _torch, context
from distribute._enums import ReduceOp, VariableAggregation, VariableSpec, VariableSynchronization
from distribute.cluster_resolver import ClusterResolver, resolve_cluster
from distribute.collectives._calls import is_transport_error
from distribute.collectives._deadlines import nccl_group_timeout
from distribute.collectives._shapes import check_axis
from distribute.collectives.base import gather_bytes
from distribute.collectives.options import CommunicationOptions
from distribute.context import ReplicaContext
from distribute.errors import InvalidArgumentError
from distribute.strategies._autograd_collectives import AllGather, AllReduce
from distribute.strategies._batch_gradients import BatchAxisGradients, MeshStepHandler
from distribute.strategies._cluster import (
    WorkerIdentity,
    backend_for,
    bind_process,
    join_cluster,
    worker_devices,
)
from distribute.strategies._devices import parse_device
from distribute.strategies._layout import DeviceMesh, LayoutMap
from distribute.strategies._replicated import DEFAULT_TIMEOUT_SECONDS, arguments_on_device
from distribute.strategies._tensor_parallel import (
    LaidOutModules,
    MeshPlan,
    NoSyncDepth,
    plain_is_replicated,
)
from distribute.strategies.base import Strategy, StrategyExtended
from distribute.values import (
    DistributedValues,
    PerReplica,
    flatten,
    pack_sequence_as,
    select_replica,
)

if TYPE_CHECKING:
    from distribute.collectives.process_group import ProcessGroupCollectives
    from distribute.data.options import InputContext, InputOptions, ValueContext
    from distribute.variables import DistributedVariable

__all__ = ["ModelParallelStrategy"]

logger = logging.getLogger(__name__)


class _Collectives:
    """The two groups a worker talks in: every worker, and its batch group (the workers
    that share its model coordinates, one per replica)."""

    def __init__(
        self,
        world: ProcessGroupCollectives,
        batch: ProcessGroupCollectives,
        first_column: bool,
    ) -> None:
        self.world = world
        self.batch = batch
        self.first_column = first_column  # model coordinates all 0

    def sum_over_replicas(self, value: int, name: str) -> int:
        """The sum over the replicas of an int every replica's workers agree on (the
        input's counts and seeds): the workers of the first model column add theirs,
        so every worker of the mesh gets the same number."""
        return self.world.all_reduce_int(value if self.first_column else 0, name)

    def gather_over_replicas(self, data: bytes) -> list[bytes]:
        """Every replica's bytes, in replica order (within this batch group)."""
        return gather_bytes(self.batch, data)


class _PeersDrawAlike:
    """A distributed dataset read by several workers of one replica (a batch axis of
    size 1), which must see the same rows: every epoch starts from the chief's random
    state (torch's generator and the loader's own), so a shuffling loader draws the
    chief's order on every worker. (With several replicas the input layer agrees on
    the chief's seed itself.) Everything else is the dataset's."""

    def __init__(self, distributed: Any, source: Any, world: ProcessGroupCollectives) -> None:
        self._distributed = distributed
        self._source = source  # the user's loader, whose generators draw the order
        self._world = world

    def __iter__(self) -> Any:
        from distribute.data._position import generators_of

        generators = generators_of(self._source)
        states = [torch.get_rng_state(), *(g.get_state() for g in generators)]
        self._world.broadcast(states, 0, name="the chief's random state (input order)")
        torch.set_rng_state(states[0])
        for generator, state in zip(generators, states[1:]):
            generator.set_state(state)
        return iter(self._distributed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._distributed, name)


class _MeshExtended(StrategyExtended):
    """`StrategyExtended` of `ModelParallelStrategy`: one replica per worker process,
    composed of the parts the strategy builds (NOTE [model parallel layout]).

    Args:
        container_strategy: the strategy.
        plan: the mesh, its axes and this worker's device.
        collectives: over every worker, and over this worker's batch group.
        layouts: the modules the scope builds, laid out on the mesh.
        gradients: the batch-axis sums (None under FSDP).
    """

    _captures_modules = True

    def __init__(
        self,
        container_strategy: Strategy,
        plan: MeshPlan,
        collectives: _Collectives,
        layouts: LaidOutModules,
        gradients: BatchAxisGradients | None,
    ) -> None:
        # The layout is the scope's capture and lifecycle (NOTE [model parallel layout]).
        super().__init__(container_strategy, capture=layouts, lifecycle=layouts)
        self._plan = plan
        self._collectives = collectives
        self._layouts = layouts
        self._gradients = gradients
        self._replica_id = int(plan.batch_mesh.get_local_rank())
        world = collectives.world
        #: The workers' collectives, for checkpoints (None for a single worker).
        self._cross_worker = world if world.world_size > 1 else None
        self._step_handler = MeshStepHandler(
            layouts.in_no_sync, lambda: gradients is not None and gradients.unsummed
        )

    # -- identity ---------------------------------------------------------------------

    @property
    def worker_devices(self) -> tuple[torch.device, ...]:
        return (self._plan.device,)

    @property
    def parameter_devices(self) -> tuple[torch.device, ...]:
        return (self._plan.device,)

    def _num_replicas_in_sync(self) -> int:
        return self._plan.batch_size

    # -- the engine's seams (docs/architecture.md, "The engine's seams") ------------------

    @property
    def cross_worker(self) -> ProcessGroupCollectives | None:
        return self._cross_worker

    @property
    def counts_in_worker_sums(self) -> bool:
        # The workers of a replica hold the same rows and loss: the first model
        # column's add them, the others 0 (a sum over every worker counts each replica
        # once; barriers and agreements still join every worker).
        return self._collectives.first_column

    @property
    def worker_index(self) -> int:
        return self._collectives.world.rank

    @property
    def num_workers(self) -> int:
        return self._collectives.world.world_size

    @property
    def step_handler(self) -> MeshStepHandler:
        return self._step_handler

    # -- the scope: the layout's (`LaidOutModules`: capture and lifecycle) --------------

    def _create_variable(self, value: torch.Tensor, spec: VariableSpec) -> DistributedVariable:
        if spec.synchronization is VariableSynchronization.ON_READ and not (
            spec.trainable or spec.is_param or spec.is_buffer
        ):
            # A replica's own sums (a metric's): whole on every worker, read by
            # aggregating over the batch group (each replica once).
            from distribute.variables import SyncOnReadVariable

            return SyncOnReadVariable._create(
                value,
                self._container_strategy,
                [self._plan.device],
                trainable=False,
                aggregation=spec.aggregation,
                synchronization=spec.synchronization,
            )
        raise InvalidArgumentError(
            f"ds.Variable(...) of shape {tuple(value.shape)} was created in the scope of "
            f"{self._container_strategy!r}, which lays out module variables only; register it "
            "on a module built in the scope (torch.nn.Parameter or a buffer) so that the "
            "layout map can place it"
        )

    def _update(
        self,
        var: torch.Tensor,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group: bool,
    ) -> Any:
        return self._update_one_tensor(var, fn, args, kwargs, group)  # a DTensor

    # -- run --------------------------------------------------------------------------

    def _run_replicas(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        self._layouts.before_run()
        strategy = self._container_strategy
        replica_ctx = ReplicaContext(strategy, self._replica_id, 0)
        args, kwargs = select_replica(0, (args, kwargs), 1)
        if self._plan.device.type != "cpu":
            args, kwargs = arguments_on_device((args, kwargs), self._plan.device)
        with context._push(strategy, replica_ctx), self._plain_is_replicated():
            try:
                return fn(*args, **kwargs)
            except RuntimeError as exc:  # NOTE [watched mesh collectives]
                if not is_transport_error(exc):
                    raise
                world = self._collectives.world
                raise world.transport_failure(
                    "a collective of the step (DTensor's or FSDP's)",
                    exc,
                    describe=self._plan.describe_rank,
                ) from exc

    def _plain_is_replicated(self) -> contextlib.AbstractContextManager[None]:
        """Inside `run`, a plain tensor that meets a DTensor is taken as replicated
        (NOTE [model parallel layout]): every worker of a replica holds the same one.
        Backward passes need it too (autograd runs them under the thread-local state
        of the ``backward()`` call), which a module's hooks cannot give."""
        if self._plan.model_mesh is None:
            return contextlib.nullcontext()
        return plain_is_replicated()

    # -- collectives in replica context -----------------------------------------------

    def _replica_all_reduce(self, replica_ctx: ReplicaContext, op: ReduceOp, value: Any) -> Any:
        leaves = flatten(value)
        tensors = [_whole(torch.as_tensor(leaf)) for leaf in leaves]
        if not tensors:
            return value
        reducer = _BatchReducer(self._collectives.batch)
        out = AllReduce.apply(reducer, op, "all_reduce", *tensors)  # type: ignore[no-untyped-call]  # autograd.Function.apply is untyped
        reduced = [
            r if isinstance(leaf, torch.Tensor) else (r.item() if r.dim() == 0 else r)
            for leaf, r in zip(leaves, out)
        ]
        return pack_sequence_as(value, reduced)

    def _replica_all_gather(self, replica_ctx: ReplicaContext, value: Any, axis: int) -> Any:
        outs = []
        for leaf in flatten(value):
            tensor = _whole(torch.as_tensor(leaf))
            check_axis(tensor, axis, "all_gather")
            reducer = _BatchReducer(self._collectives.batch)
            gather = AllGather.apply(reducer, axis % tensor.dim(), tensor)  # type: ignore[no-untyped-call]  # autograd.Function.apply is untyped
            outs.append(gather)
        return pack_sequence_as(value, outs)

    def _replica_merge_call(
        self,
        replica_ctx: ReplicaContext,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        strategy = self._container_strategy
        with context._push(strategy, None, in_merge=True):
            return merge_fn(strategy, *args, **kwargs)

    def _replica_broadcast_first(self, replica_ctx: ReplicaContext, value: torch.Tensor) -> Any:
        """The first replica's value (along the batch axis) on every worker."""
        tensor = _whole(torch.as_tensor(value)).detach().clone()
        self._collectives.batch.broadcast([tensor], 0, name="the first replica's value")
        return tensor

    def _replica_once(self, replica_ctx: ReplicaContext, fn: Callable[[], None]) -> None:
        fn()  # one replica per worker

    # -- cross-replica reductions -----------------------------------------------------

    def _read_sync_on_read(self, var: DistributedVariable) -> torch.Tensor:
        """The replicas' copies aggregated over the batch group (each replica once:
        the workers of a replica hold the same copy)."""
        local = var._plain_component(0).clone()
        batch = self._collectives.batch
        if var._ds_aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            batch.broadcast([local], 0, name="SyncOnReadVariable read")
            return local
        (total,) = batch.all_reduce([local], ReduceOp.SUM, name="SyncOnReadVariable read")
        if var._ds_aggregation is VariableAggregation.MEAN:
            total = total / self._plan.batch_size
        return total

    def _reduce(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        return pack_sequence_as(value, [self._reduce_leaf(op, v, axis) for v in flatten(value)])

    def _reduce_leaf(self, op: ReduceOp, leaf: Any, axis: int | None) -> torch.Tensor:
        """One value per replica (its workers hold the same one), reduced over the
        replicas: the batch group's all-reduce."""
        tensor = _whole(torch.as_tensor(_component(leaf))).detach()
        count = 1
        if axis is not None:
            check_axis(tensor, axis, "reduce")
            count = int(tensor.shape[axis])
            tensor = tensor.sum(dim=axis)
        total, counted = self._collectives.batch.all_reduce(
            [tensor, torch.tensor([float(count)], dtype=torch.float64)],
            ReduceOp.SUM,
            name="reduce",
        )
        if op is ReduceOp.SUM:
            return total
        divisor = float(counted.item()) if axis is not None else float(self._plan.batch_size)
        total = total if total.is_floating_point() else total.double()
        return total / divisor if divisor else total * float("nan")

    def _gather(self, value: Any, axis: int) -> Any:
        gathered = []
        for leaf in flatten(value):
            tensor = _whole(torch.as_tensor(_component(leaf))).detach()
            check_axis(tensor, axis, "gather")
            gathered.append(self._collectives.batch.all_gather(tensor, axis, name="gather"))
        return pack_sequence_as(value, gathered)

    def _local_results(self, value: Any) -> tuple[Any, ...]:
        if isinstance(value, DistributedValues):
            return tuple(value.values)
        return (value,)

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any) -> Any:
        reduced = self._reduce(ReduceOp.from_value(reduce_op), value, None)
        if isinstance(destinations, torch.Tensor):
            return reduced.to(destinations.device)
        return reduced

    # -- input ------------------------------------------------------------------------

    def _input_workers(self) -> Any:
        from distribute.data._workers import InputWorkers

        collectives = self._collectives
        if self._plan.batch_size == 1 and collectives.world.world_size == 1:
            return InputWorkers(devices=(self._plan.device,))
        return InputWorkers(
            devices=(self._plan.device,),
            worker_index=self._replica_id,
            num_workers=self._plan.batch_size,
            sum_across_workers=lambda n: collectives.sum_over_replicas(n, "input agreement"),
            gather_across_workers=collectives.gather_over_replicas,
            collectives=self._cross_worker,
        )

    def _distribute_dataset(self, dataset: Any, options: InputOptions | None) -> Any:
        from distribute.data.dataset import DistributedDataset

        distributed = DistributedDataset(dataset, self._input_workers(), options)
        if self._plan.batch_size == 1 and self._collectives.world.world_size > 1:
            return _PeersDrawAlike(distributed, dataset, self._collectives.world)
        return distributed

    def _distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None
    ) -> Any:
        from distribute.data.dataset import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(dataset_fn, self._input_workers(), options)

    def _distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        from distribute.data.options import ValueContext

        return PerReplica([value_fn(ValueContext(self._replica_id, self._plan.batch_size))])


class ModelParallelStrategy(WorkerIdentity, Strategy):
    """Model parallelism (Keras 3's ``ModelParallel``) over worker processes, on DTensor.

    The workers form the layout map's `DeviceMesh`. Modules built in the scope are laid
    out when the outermost scope is left (or at the next `run`): each variable whose
    path the map names becomes a DTensor split along the named mesh axes (``Shard``),
    whole along the others; every other variable is whole on every worker. Initial
    values are the chief's (the same seed gives one device's weights). The batch is
    split along ``batch_dim_name``: the workers that share a coordinate on it receive
    the same rows, and ``num_replicas_in_sync`` is its size. The step is one device's:
    forward, `ds.compute_average_loss`, backward (gradients are summed along the batch
    axis before it returns), ``clip_grad_norm_``, an unmodified `torch.optim` optimizer.

    A column-parallel ``nn.Linear`` (weight ``("model", None)``, bias ``("model",)``)
    followed by a row-parallel one (weight ``(None, "model")``) runs as torch's
    ``ColwiseParallel``/``RowwiseParallel``: one all-reduce per pair in forward and one
    in backward. Other layouts run by DTensor's sharding propagation.

    Args:
        layout_map: a `ds.experimental.LayoutMap` over the mesh.
        batch_dim_name: the mesh axis the batch is split along; None: the first axis.
        cluster_resolver: who is in the cluster; None reads torchrun's variables, else
            ``TF_CONFIG``, else SLURM, else runs as a single worker.
        communication_options: `ds.experimental.CommunicationOptions` (timeout,
            implementation: RING = gloo, NCCL = nccl, AUTO: nccl on CUDA).
        fully_shard: also shard every variable along the batch axis with FSDP2 (2-D, as
            torchtitan composes tensor and data parallelism): each worker keeps
            1/(batch size) of what the layout leaves it.

    Raises:
        InvalidArgumentError: the mesh's size is not the number of workers (both are
            named), a mesh listing several devices for one worker, an unknown
            ``batch_dim_name``; when the model is laid out: a layout of the wrong rank or
            naming an unknown axis (the variable's path and the layout are named), a
            path two keys match (the path and the keys).

    A layout may name the batch axis (as Keras allows): that dimension is split along
    it by FSDP2, which then shards the whole model along the batch axis (its other
    variables on their first dimension, as ``fully_shard=True``) and sums the
    gradients there.

    Example:
        >>> import distribute as ds, torch
        >>> mesh = ds.experimental.DeviceMesh((1, 1), ("batch", "model"))  # one worker
        >>> layout_map = ds.experimental.LayoutMap(mesh)
        >>> layout_map[r"0\\.weight"] = ("model", None)
        >>> strategy = ds.experimental.ModelParallelStrategy(layout_map)
        >>> with strategy.scope():
        ...     model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> type(model[0].weight).__name__, strategy.num_replicas_in_sync
        ('DTensor', 1)
        >>> strategy.shutdown()
    """

    def __init__(
        self,
        layout_map: LayoutMap,
        batch_dim_name: str | None = None,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        *,
        fully_shard: bool = False,
    ) -> None:
        if not isinstance(layout_map, LayoutMap):
            raise InvalidArgumentError(
                f"ModelParallelStrategy needs a ds.experimental.LayoutMap, got "
                f"{type(layout_map).__name__}; build one over a DeviceMesh: "
                "LayoutMap(DeviceMesh(shape, axis_names))"
            )
        mesh = layout_map.device_mesh
        batch_axis = mesh.axis_names[0] if batch_dim_name is None else batch_dim_name
        if batch_axis not in mesh.axis_names:
            raise InvalidArgumentError(
                f"batch_dim_name={batch_dim_name!r} is not an axis of {mesh}; name one of "
                f"{mesh.axis_names}, or None for the first"
            )
        options = communication_options or CommunicationOptions()
        resolver = cluster_resolver if cluster_resolver is not None else resolve_cluster()
        rank = resolver.rank if resolver is not None else 0
        world_size = resolver.world_size if resolver is not None else 1
        device = _this_device(mesh, resolver, rank, world_size)
        self._resolver = resolver
        self._layout_map = layout_map
        timeout = float(options.timeout_seconds or DEFAULT_TIMEOUT_SECONDS)
        bound = bind_process([device])
        backend = backend_for(options.implementation, [device])
        world = join_cluster(resolver, backend, timeout, bound, group_of_one=True)
        assert world is not None  # group_of_one
        plan = _mesh_plan(mesh, batch_axis, device, backend, timeout)
        collectives = _Collectives(
            world,
            world.subgroup(
                plan.batch_mesh.get_group(),
                plan.batch_mesh.mesh.flatten().tolist(),
                plan.describe_rank,
            ),
            all(plan.mesh.get_local_rank(a) == 0 for a in plan.model_axes),
        )
        no_sync = NoSyncDepth()
        gradients = None
        if not (fully_shard and plan.batch_size > 1):  # else FSDP sums along the batch axis
            batch = collectives.batch if plan.batch_size > 1 else None
            gradients = BatchAxisGradients(batch, no_sync.active)
        layouts = LaidOutModules(
            self,
            layout_map,
            plan,
            world,
            fully_shard,
            no_sync,
            track=gradients.track if gradients is not None else None,
        )
        super().__init__(_MeshExtended(self, plan, collectives, layouts, gradients))
        self._collectives = collectives
        self._plan = plan
        weakref.finalize(self, world.shutdown)
        if rank == 0 and world_size > 1:
            logger.info(
                "ModelParallelStrategy: mesh %s %s, batch axis %r, backend %s",
                mesh.shape,
                mesh.axis_names,
                batch_axis,
                backend,
            )

    # -- the mesh ---------------------------------------------------------------------

    @property
    def layout_map(self) -> LayoutMap:
        """The layout map the variables are laid out by."""
        return self._layout_map

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh (the layout map's)."""
        return self._layout_map.device_mesh

    @property
    def batch_dim_name(self) -> str:
        """The mesh axis the batch is split along."""
        return self._plan.batch_axis

    @property
    def torch_device_mesh(self) -> Any:
        """torch's `DeviceMesh` over the workers, with the same axis names."""
        return self._plan.mesh

    def shutdown(self) -> None:
        """Leaves the process group, destroying it unless another strategy still uses it
        (NOTE [shared groups]); the strategy cannot run collectives afterwards."""
        self._collectives.world.shutdown()

    def __repr__(self) -> str:
        mesh = self._layout_map.device_mesh
        return (
            f"ModelParallelStrategy(mesh={mesh.shape} {mesh.axis_names}, "
            f"worker={self.worker_index}/{self.num_workers}, device={str(self._plan.device)!r})"
        )


# -- building the strategy's parts ---------------------------------------------------------


def _this_device(
    mesh: DeviceMesh, resolver: ClusterResolver | None, rank: int, world_size: int
) -> torch.device:
    """This worker's device; refuses a mesh that does not hold one device per worker."""
    if mesh.devices is not None and len(mesh.devices) > world_size:
        raise InvalidArgumentError(
            f"{mesh} lists {len(mesh.devices)} devices ({list(mesh.devices)}) for "
            f"{world_size} worker process(es): ModelParallelStrategy runs one process per "
            "device, not several local replicas per worker; start one process per device "
            f"(torchrun --nproc_per_node={len(mesh.devices)}), or give devices=None"
        )
    if mesh.size != world_size:
        raise InvalidArgumentError(
            f"{mesh} holds {mesh.size} devices but the cluster has {world_size} worker "
            f"process(es); ModelParallelStrategy runs one process per device: start "
            f"{mesh.size} (torchrun --nproc_per_node={mesh.size}), or give the mesh a shape "
            f"whose product is {world_size}"
        )
    if mesh.devices is not None:
        return parse_device(mesh.devices[rank])[1]
    return parse_device(worker_devices(resolver)[0])[1]


def _mesh_plan(
    mesh: DeviceMesh, batch_axis: str, device: torch.device, backend: str, timeout: float
) -> MeshPlan:
    """torch's mesh over the workers (a collective: every worker builds it). Each axis's
    group has the library's timeout (NOTE [watched mesh collectives])."""
    from torch.distributed.device_mesh import init_device_mesh

    options = _torch.backend_options(backend, _group_timeout(backend, timeout))
    torch_mesh = init_device_mesh(
        device.type,
        mesh.shape,
        mesh_dim_names=mesh.axis_names,
        backend_override={name: (backend, options) for name in mesh.axis_names},
    )
    model_axes = tuple(a for a in mesh.axis_names if a != batch_axis)
    model_mesh = torch_mesh[model_axes] if model_axes else None
    return MeshPlan(
        mesh=torch_mesh,
        batch_axis=batch_axis,
        model_axes=model_axes,
        model_mesh=model_mesh,
        batch_mesh=torch_mesh[batch_axis],
        device=device,
    )


def _group_timeout(backend: str, timeout: float) -> datetime.timedelta:
    """A mesh axis's group timeout: the library's deadline (gloo: a dead peer is named
    within it); past it under nccl, whose deadlines the library watches itself."""
    if backend == "nccl":
        return nccl_group_timeout(timeout)
    return datetime.timedelta(seconds=timeout)


# -- values ----------------------------------------------------------------------------------


def _component(leaf: Any) -> Any:
    """A per-replica value's one local component."""
    if isinstance(leaf, DistributedValues):
        return leaf.values[0]
    return leaf


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective over the model axes); a tensor as it is."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        whole: torch.Tensor = t.full_tensor()
        return whole
    return t


class _BatchReducer:
    """This worker's replica's collectives over the batch axis
    (`_autograd_collectives.Reducer`)."""

    __slots__ = ("_batch",)

    def __init__(self, batch: ProcessGroupCollectives) -> None:
        self._batch = batch

    def all_reduce(
        self, op: ReduceOp, tensors: Sequence[torch.Tensor], name: str
    ) -> Sequence[torch.Tensor]:
        return self._batch.all_reduce(list(tensors), op, name=name)

    def all_gather(
        self, tensor: torch.Tensor, axis: int, name: str
    ) -> tuple[torch.Tensor, list[int], int]:
        batch = self._batch
        size = torch.tensor([tensor.shape[axis]])
        sizes = batch.all_gather(size, 0, name=f"{name} sizes").tolist()
        return batch.all_gather(tensor, axis, name=name), sizes, batch.rank
