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
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distribute import _marks, _torch, context
from distribute._enums import ReduceOp, VariableAggregation, VariableSynchronization
from distribute.cluster_resolver import ClusterResolver, resolve_cluster
from distribute.collectives._shapes import check_axis
from distribute.collectives.options import CommunicationOptions
from distribute.context import ReplicaContext
from distribute.errors import ContextError, InvalidArgumentError
from distribute.strategies._batch_gradients import BatchAxisGradients, MeshStepHandler
from distribute.strategies._cluster import (
    backend_for,
    bind_process,
    describe_cluster,
    worker_devices,
)
from distribute.strategies._devices import parse_device
from distribute.strategies._layout import DeviceMesh, LayoutMap
from distribute.strategies._replicated import DEFAULT_TIMEOUT_SECONDS
from distribute.strategies._tensor_parallel import LaidOutModules, MeshPlan, plain_is_replicated
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
        cross = self.batch
        sizes = cross.all_gather(torch.tensor([len(data)]), 0, name="input sizes").tolist()
        mine = torch.tensor(list(data), dtype=torch.uint8)
        flat = bytes(cross.all_gather(mine, 0, name="input structure").tolist())
        offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        return [flat[offsets[i] : offsets[i + 1]] for i in range(len(sizes))]


class _NoSync:
    """How deep the strategy is inside ``no_sync()`` (shared by its engine and its sums)."""

    def __init__(self) -> None:
        self.depth = 0

    def active(self) -> bool:
        return self.depth > 0


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
        no_sync: the ``no_sync()`` depth, shared with the gradients.
    """

    _captures_modules = True

    def __init__(
        self,
        container_strategy: Strategy,
        plan: MeshPlan,
        collectives: _Collectives,
        layouts: LaidOutModules,
        gradients: BatchAxisGradients | None,
        no_sync: _NoSync,
    ) -> None:
        super().__init__(container_strategy)
        self._plan = plan
        self._collectives = collectives
        self._layouts = layouts
        self._gradients = gradients
        self._no_sync = no_sync
        self._replica_id = int(plan.batch_mesh.get_local_rank())
        world = collectives.world
        #: The workers' collectives, for checkpoints (None for a single worker).
        self._cross_worker = world if world.world_size > 1 else None
        self._step_handler = MeshStepHandler(
            no_sync.active, lambda: gradients is not None and gradients.unsummed
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

    # -- the scope --------------------------------------------------------------------

    def _captures(self, module: torch.nn.Module, tensor: torch.Tensor) -> bool:
        # Not our own layout, torch's styles or FSDP's (un)sharded parameters (neither
        # module is imported before something of this strategy has used it).
        dtensor = sys.modules.get("torch.distributed.tensor")
        if dtensor is not None and isinstance(tensor, dtensor.DTensor):
            return False
        fsdp = sys.modules.get("torch.distributed.fsdp")
        return fsdp is None or not isinstance(module, fsdp.FSDPModule)

    def _capture_parameter(
        self, module: torch.nn.Module, name: str, param: torch.nn.Parameter
    ) -> torch.nn.Parameter | None:
        self._layouts.record(module, param)
        return None  # a plain parameter until the module is laid out

    def _capture_buffer(
        self, module: torch.nn.Module, name: str, buffer: torch.Tensor
    ) -> torch.Tensor | None:
        self._layouts.record(module)
        return None

    def _capture_submodule(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        self._layouts.record_child(parent, child)

    def _create_variable(
        self,
        value: torch.Tensor,
        *,
        trainable: bool,
        synchronization: VariableSynchronization,
        aggregation: VariableAggregation,
        is_param: bool = False,
        is_buffer: bool = False,
        deferred: bool = False,
    ) -> DistributedVariable:
        if synchronization is VariableSynchronization.ON_READ and not (
            trainable or is_param or is_buffer
        ):
            # A replica's own sums (a metric's): whole on every worker, read by
            # aggregating over the batch group (each replica once).
            from distribute.variables import SyncOnReadVariable

            return SyncOnReadVariable._create(
                value,
                self._container_strategy,
                [self._plan.device],
                trainable=False,
                aggregation=aggregation,
                synchronization=synchronization,
            )
        raise InvalidArgumentError(
            f"ds.Variable(...) of shape {tuple(value.shape)} was created in the scope of "
            f"{self._container_strategy!r}, which lays out module variables only; register it "
            "on a module built in the scope (torch.nn.Parameter or a buffer) so that the "
            "layout map can place it"
        )

    def _lay_out_pending(self) -> None:
        if not self._layouts.pending:
            return
        known = len(self._layouts.trainable)
        self._layouts.lay_out_pending()
        if self._gradients is not None:
            self._gradients.track(self._layouts.trainable[known:])

    def _enter_scope(self) -> None:
        super()._enter_scope()
        if context._scope_depth(self._container_strategy) == 1:
            self._layouts.optimizers.start()  # NOTE [optimizers built in the scope]

    def _exit_scope(self) -> None:
        if context._scope_depth(self._container_strategy) == 1:
            try:
                self._layouts.optimizers.stop()
                self._lay_out_pending()
            except BaseException:
                context._exit_scope()  # leave the scope, and nothing more, on the way out
                raise
        super()._exit_scope()

    def variable_created_in_scope(self, v: Any) -> bool:
        return _marks.managed_by(v) is self._container_strategy

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        if not self.variable_created_in_scope(colocate_with_variable):
            raise InvalidArgumentError(
                f"colocate_vars_with needs a variable created in {self._container_strategy!r}'s "
                f"scope, got {type(colocate_with_variable).__name__}"
            )
        yield  # every variable of this strategy lives on the mesh already

    def update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        if not self.variable_created_in_scope(var):
            raise InvalidArgumentError(
                f"update() needs a variable of {self._container_strategy!r}, got "
                f"{type(var).__name__}"
            )
        with torch.no_grad():
            result = fn(var, *args, **(kwargs or {}))
        return result if group else (result,)

    # -- run --------------------------------------------------------------------------

    def call_for_each_replica(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        top = context._top()
        if top is not None and top.replica_context is not None:
            raise ContextError(
                f"`run` was called inside `run` of {top.strategy!r}; call `run` once per "
                "step from cross-replica code and do per-replica work inside `fn`"
            )
        if top is not None and top.in_merge:
            raise ContextError(
                f"`run` was called inside a merge_fn of {top.strategy!r}; return from "
                "merge_fn and call `run` from the outer loop"
            )
        self._layouts.optimizers.stop()
        self._lay_out_pending()
        strategy = self._container_strategy
        replica_ctx = ReplicaContext(strategy, self._replica_id, 0)
        args, kwargs = select_replica(0, (tuple(args), kwargs or {}), 1)
        if self._plan.device.type != "cpu":
            args, kwargs = _on_device((args, kwargs), self._plan.device)
        with context._push(strategy, replica_ctx), self._plain_is_replicated():
            return fn(*args, **kwargs)

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
        out = _AllReduce.apply(self._collectives.batch, op, *tensors)  # type: ignore[no-untyped-call]  # autograd.Function.apply is untyped
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
            gather = _AllGather.apply(self._collectives.batch, axis % tensor.dim(), tensor)  # type: ignore[no-untyped-call]  # autograd.Function.apply is untyped
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

    # -- gradients --------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, unsummed; the next
        backward pass outside sums everything accumulated. Step only after it."""
        self._no_sync.depth += 1
        try:
            with self._layouts.no_sync():
                yield
        finally:
            self._no_sync.depth -= 1


class ModelParallelStrategy(Strategy):
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
            path two keys match (the path and the keys), a layout naming the batch axis.

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
        world = _join(resolver, rank, world_size, backend, timeout, bound)
        plan = _mesh_plan(mesh, batch_axis, device)
        collectives = _Collectives(
            world,
            _group_collectives(plan.batch_mesh, backend, timeout, bound),
            all(plan.mesh.get_local_rank(a) == 0 for a in plan.model_axes),
        )
        layouts = LaidOutModules(self, layout_map, plan, world, fully_shard)
        no_sync = _NoSync()
        gradients = None
        if not layouts.sharded_by_fsdp:
            batch = collectives.batch if plan.batch_size > 1 else None
            gradients = BatchAxisGradients(batch, no_sync.active)
        super().__init__(_MeshExtended(self, plan, collectives, layouts, gradients, no_sync))
        self._collectives = collectives
        self._plan = plan
        self._fully_shard = fully_shard
        weakref.finalize(self, world.shutdown)
        if rank == 0 and world_size > 1:
            logger.info(
                "ModelParallelStrategy: mesh %s %s, batch axis %r, backend %s",
                mesh.shape,
                mesh.axis_names,
                batch_axis,
                backend,
            )

    # -- the cluster (as the other multi-worker strategies) ---------------------------

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
        """How many worker processes train together (the mesh's size)."""
        return self._resolver.world_size if self._resolver is not None else 1

    @property
    def is_chief(self) -> bool:
        """Whether this worker saves checkpoints and writes summaries (rank 0)."""
        return self.worker_index == 0

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
        """Destroys the process group; the strategy cannot run collectives afterwards."""
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


def _join(
    resolver: ClusterResolver | None,
    rank: int,
    world_size: int,
    backend: str,
    timeout: float,
    device: torch.device | None,
) -> ProcessGroupCollectives:
    """The workers' process group (DTensor needs one, a single worker too)."""
    from distribute.collectives.process_group import ProcessGroupCollectives

    if resolver is not None and world_size > 1:
        return ProcessGroupCollectives.create(
            rank,
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
    if dist.is_initialized():
        return ProcessGroupCollectives.adopt(timeout_seconds=timeout)
    # One worker: a group of one, served by an in-process store (no port).
    dist.init_process_group(
        backend, store=_torch.HashStore(), rank=0, world_size=1, device_id=device
    )
    return ProcessGroupCollectives(
        None, None, 0, 1, backend, timeout, owns_group=True, device=device
    )


def _mesh_plan(mesh: DeviceMesh, batch_axis: str, device: torch.device) -> MeshPlan:
    """torch's mesh over the workers (a collective: every worker builds it)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch_mesh = init_device_mesh(device.type, mesh.shape, mesh_dim_names=mesh.axis_names)
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


def _group_collectives(
    submesh: Any, backend: str, timeout: float, device: torch.device | None
) -> ProcessGroupCollectives:
    """The library's collectives (deadlines, signature checks) over a 1-D sub-mesh's group."""
    from distribute.collectives.process_group import ProcessGroupCollectives

    return ProcessGroupCollectives(
        submesh.get_group(),
        None,  # no store: a missing peer is reported at the deadline, unnamed
        int(submesh.get_local_rank()),
        int(submesh.size()),
        backend,
        timeout,
        owns_group=False,
        device=device if backend == "nccl" else None,
    )


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


def _on_device(structure: Any, device: torch.device) -> Any:
    leaves = flatten(structure)
    moved = [
        leaf.to(device) if isinstance(leaf, torch.Tensor) and leaf.device != device else leaf
        for leaf in leaves
    ]
    return pack_sequence_as(structure, moved)


class _AllReduce(torch.autograd.Function):
    """All-reduce over the replicas whose gradient is the all-reduce of the gradient."""

    @staticmethod
    def forward(
        ctx: Any, collectives: ProcessGroupCollectives, op: ReduceOp, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.collectives, ctx.op = collectives, op
        return tuple(collectives.all_reduce(list(tensors), op, name="all_reduce"))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        out = ctx.collectives.all_reduce(list(grads), ctx.op, name="all_reduce (backward)")
        return (None, None, *out)


class _AllGather(torch.autograd.Function):
    """All-gather over the replicas whose gradient is this replica's slice of the sum."""

    @staticmethod
    def forward(
        ctx: Any, collectives: ProcessGroupCollectives, axis: int, tensor: torch.Tensor
    ) -> torch.Tensor:
        size = torch.tensor([tensor.shape[axis]])
        sizes = collectives.all_gather(size, 0, name="all_gather sizes").tolist()
        ctx.collectives, ctx.axis, ctx.sizes = collectives, axis, sizes
        ctx.rank = collectives.rank
        return collectives.all_gather(tensor.detach(), axis, name="all_gather")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (summed,) = ctx.collectives.all_reduce([grad], ReduceOp.SUM, name="all_gather (backward)")
        offset = sum(ctx.sizes[: ctx.rank])
        return (None, None, summed.narrow(ctx.axis, offset, ctx.sizes[ctx.rank]))
