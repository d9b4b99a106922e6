"""The engine shared by every synchronous strategy: local replicas, optional workers.

`ReplicatedExtended` implements `StrategyExtended` for N local replicas (threads when
N > 1, inline when N == 1) and, optionally, several workers joined by a
cross-process collective object. OneDevice, Mirrored, CentralStorage,
MultiWorkerMirrored and the default strategy are configurations of it.

It keeps the replicas, the run and the variables' lifecycle, and composes the rest:
`VariablePlacement` (where variables live, `_placement.py`), `ReplicaCollectives`
(collectives inside `run`, `_replica_collectives.py`), `CrossReplicaReductions`
(`reduce`, `gather`, ..., `_cross_replica.py`), `BufferSync` (`_buffer_sync.py`)
and the gradient layer's `SynchronousStepHandler`. The sharded and parameter-server
strategies configure it with parts of their own, passed in at construction
(`_engine_parts.py`): nothing subclasses it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from distribute import _marks, _torch, context
from distribute._enums import (
    ReduceOp,
    StepRunner,
    VariableAggregation,
    VariableSpec,
    VariableSynchronization,
)
from distribute.collectives.base import CrossWorker, gather_bytes
from distribute.context import ReplicaContext
from distribute.errors import (
    ContextError,
    InvalidArgumentError,
)
from distribute.strategies._buffer_sync import BufferSync
from distribute.strategies._cross_replica import CrossReplicaReductions
from distribute.strategies._devices import parse_device, replica_devices
from distribute.strategies._engine_parts import (
    ModuleCapture,
    ScopeLifecycle,
    StepHandlerFactory,
    VariableHome,
    Workers,
)
from distribute.strategies._placement import VariablePlacement
from distribute.strategies._replica_collectives import ReplicaCollectives
from distribute.strategies._replica_host import ReplicaTopology
from distribute.strategies._replica_threads import Rendezvous, ReplicaThreads
from distribute.strategies.base import StrategyExtended
from distribute.values import (
    Mirrored,
    PerReplica,
    flatten,
    pack_sequence_as,
    regroup,
    select_replica,
)
from distribute.variables import (
    DistributedVariable,
    MirroredVariable,
    SyncOnReadVariable,
    _ReplicatedMirroredVariable,
)

if TYPE_CHECKING:
    from distribute.collectives.cross_device_ops import CrossDeviceOps
    from distribute.data.options import InputContext, InputOptions, ValueContext
    from distribute.gradients.base import StepHandler
    from distribute.strategies.base import Strategy

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "CrossWorker",
    "ReplicatedExtended",
    "Workers",
    "arguments_on_device",
    "parse_device",
]

DEFAULT_TIMEOUT_SECONDS = 300.0


class ReplicatedExtended(StrategyExtended):
    """`StrategyExtended` for synchronous replicas, in one process or several.

    Args:
        container_strategy: the strategy object this belongs to.
        devices: the local replica devices.
        captures_modules: whether module parameters built in scope become variables.
        wrap_single_values: whether `experimental_distribute_values_from_function`
            wraps even a single replica's value in `PerReplica`.
        central_storage: variables keep one copy that every replica aliases; only
            replica 0 applies optimizer updates.
        timeout_seconds: how long a replica waits for the others in a collective.
        bytes_per_pack: pack size for gradient aggregation (0: one pack).
        cross_device_ops: in-process reduction for `reduce_to`/`batch_reduce_to`.
        static_batch_shapes: every step must see batches of one shape (XLA).
        workers: this process's place among several workers and their collectives;
            None: one worker.
        step_handler: makes the strategy's `StepHandler` from the engine's
            `ReplicaGroup`; None: the synchronous one.
        capture: what the scope makes of modules' parameters and submodules; None:
            the strategy's mirrored variables.
        home: what variables created in the scope are and where they live; None:
            mirrored variables on ``devices``.
        lifecycle: what the strategy does as its scope is entered and left, before
            `run` and in `no_sync()`; None: nothing more.
        step_runner: how `ds.Model`'s loop runs steps on this engine.
    """

    def __init__(
        self,
        container_strategy: Strategy,
        devices: Sequence[str | torch.device],
        *,
        captures_modules: bool = True,
        wrap_single_values: bool = True,
        central_storage: bool = False,
        timeout_seconds: float | None = None,
        bytes_per_pack: int = 0,
        cross_device_ops: CrossDeviceOps | None = None,
        static_batch_shapes: bool = False,
        workers: Workers | None = None,
        step_handler: StepHandlerFactory | None = None,
        capture: ModuleCapture | None = None,
        home: VariableHome | None = None,
        lifecycle: ScopeLifecycle | None = None,
        step_runner: StepRunner = StepRunner.IN_PROCESS,
    ) -> None:
        super().__init__(container_strategy, capture=capture, lifecycle=lifecycle)
        self._step_runner = step_runner
        self._static_batch_shapes = static_batch_shapes
        #: Where the replicas are, fixed for the engine's life; what its parts read
        #: (NOTE [the replica host]).
        self.topology = ReplicaTopology.of(replica_devices(devices), workers, central_storage)
        self._home = home
        self._captures_modules = captures_modules
        # Plain tensors passed to `run` reach each replica on its device (as TF places
        # a plain argument); on CPU replicas there is nothing to move, and no walk.
        self._places_arguments = captures_modules and any(
            d.type != "cpu" for d in self.topology.devices
        )
        self._wrap_single_values = wrap_single_values
        self._timeout = float(timeout_seconds or DEFAULT_TIMEOUT_SECONDS)
        self._bytes_per_pack = bytes_per_pack
        self._cross_device_ops = cross_device_ops
        # Weak references rather than a WeakSet, whose iteration costs frames per
        # variable at every `run` (`_live_variables` drops the dead).
        self._variables: list[weakref.ref[DistributedVariable]] = []
        # Creation order, the same on every worker (a WeakSet's order is not: it
        # follows addresses), because the buffers' sync packs them in this order.
        # With the modules' slots that hold them: a buffer replaced there by a plain
        # tensor (`module.to(dtype)`) may be collected, and its slot still tells
        # where to look (NOTE [placement]).
        self._buffers: list[tuple[weakref.ref[DistributedVariable], list[Any]]] = []
        self._pending_broadcast: list[DistributedVariable] = []
        self._placement = VariablePlacement(self)
        self._collectives = ReplicaCollectives(self)
        self._reductions = CrossReplicaReductions(self)
        # Bumped when a variable's shape or dtype changes (`.data = t`, `.to(dtype)`),
        # so that per-optimizer gradient sums laid out for the old ones are rebuilt.
        self._layout_generation = 0
        # Variables registered so far (never decreases): a new model since a step ran.
        self._variables_made = 0
        self._buffer_sync: BufferSync | None = None
        n = self.topology.num_local
        self._rendezvous = Rendezvous(n, self._timeout, self.topology.devices) if n > 1 else None
        self._threads: ReplicaThreads | None = None
        self._thread_lock = threading.Lock()
        self._run_owner: threading.Thread | None = None
        self.experimental_aggregate_gradients = True
        # Variables registered since the lifecycle last heard of them (`placed`).
        self._newly_placed: list[DistributedVariable] = []
        group = _ReplicaGroup(self)
        if step_handler is None:
            from distribute.gradients.synchronous import SynchronousStepHandler

            self._step_handler: StepHandler = SynchronousStepHandler(group)
        else:
            self._step_handler = step_handler(group)
        weakref.finalize(self, _shutdown_threads, self._thread_holder())

    def _thread_holder(self) -> list[ReplicaThreads]:
        self._holder: list[ReplicaThreads] = []
        return self._holder

    # -- identity -------------------------------------------------------------------

    @property
    def worker_devices(self) -> tuple[torch.device, ...]:
        return self.topology.devices

    @property
    def parameter_devices(self) -> tuple[torch.device, ...]:
        if self._home is not None:
            return self._home.parameter_devices
        return self.topology.devices[:1] if self.topology.central else self.topology.devices

    def _num_replicas_in_sync(self) -> int:
        return self.topology.num_replicas_in_sync

    @property
    def cross_worker(self) -> CrossWorker | None:
        return self.topology.cross_worker

    @property
    def worker_index(self) -> int:
        return self.topology.worker_index

    @property
    def num_workers(self) -> int:
        return self.topology.num_workers

    @property
    def container_strategy(self) -> Any:
        """The strategy this engine serves."""
        return self._container_strategy

    @property
    def cross_device_ops(self) -> CrossDeviceOps | None:
        """The user's `CrossDeviceOps`, if one was given."""
        return self._cross_device_ops

    @property
    def rendezvous(self) -> Rendezvous | None:
        """Where the local replica threads meet (None: one local replica)."""
        return self._rendezvous

    @property
    def step_handler(self) -> StepHandler:
        return self._step_handler

    @property
    def static_batch_shapes(self) -> bool:
        return self._static_batch_shapes

    @property
    def step_runner(self) -> StepRunner:
        return self._step_runner

    # -- run --------------------------------------------------------------------------

    def _run_replicas(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        strategy = self._container_strategy
        topology = self.topology
        if topology.num_local == 1:
            # NOTE [one replica's run]: the steady step of one replica makes no call
            # that has nothing to do (issue 40): `_before_run` only where a lifecycle,
            # an unplaced variable, a pending broadcast or buffers to adopt ask for it,
            # `_after_run` only with several replicas in sync, no selection among
            # arguments that are all tensors, and the replica's context pushed inline.
            if (
                self._lifecycle is not None
                or self._placement.unplaced
                or self._pending_broadcast
                or (self._buffers and topology.num_replicas_in_sync > 1)
            ):
                self._before_run()
            try:
                # the global id of the one local replica: topology.global_id(0), inlined
                replica_ctx = ReplicaContext(strategy, topology.worker_index, 0)
                if not _TENSOR_TYPE.issuperset(map(type, args)):  # C-level: no frame
                    args = select_replica(0, args, 1)
                if kwargs:
                    kwargs = select_replica(0, kwargs, 1)
                if self._places_arguments:
                    args, kwargs = arguments_on_device((args, kwargs), topology.devices[0])
                stack = context._state.stack
                stack.append(context._Entry(strategy, replica_ctx))
                try:
                    return fn(*args, **kwargs)
                finally:
                    stack.pop()
            finally:
                if topology.num_replicas_in_sync > 1:
                    self._after_run()
        self._claim_run()
        try:
            self._before_run()
            try:
                return regroup(self._run_in_threads(fn, args, kwargs))
            finally:
                self._after_run()
        finally:
            self._run_owner = None

    def _claim_run(self) -> None:
        """Refuses a second thread's `run` while one is in progress (they share replicas)."""
        with self._thread_lock:
            owner = self._run_owner
            if owner is not None:
                raise ContextError(
                    f"`run` of {self._container_strategy!r} was called from thread "
                    f"{threading.current_thread().name!r} while thread {owner.name!r} is "
                    "inside `run` of the same strategy; its replica threads run one step at "
                    "a time: call `run` from one thread, or give each thread its own strategy"
                )
            self._run_owner = threading.current_thread()

    def _run_in_threads(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[Any]:
        assert self._rendezvous is not None
        with self._thread_lock:
            if self._threads is None:
                self._threads = ReplicaThreads(self.topology.num_local, self.topology.devices)
                self._holder.append(self._threads)
        strategy = self._container_strategy
        rendezvous = self._rendezvous
        rendezvous.reset()
        n = self.topology.num_local

        def replica_fn(local: int) -> Any:
            replica_ctx = ReplicaContext(strategy, self.topology.global_id(local), local)
            own_args = select_replica(local, args, n)
            own_kwargs = select_replica(local, kwargs, n) if kwargs else {}
            if self._places_arguments:
                own_args, own_kwargs = arguments_on_device(
                    (own_args, own_kwargs), self.topology.devices[local]
                )
            with context._push(strategy, replica_ctx):
                return fn(*own_args, **own_kwargs)

        fns = [functools.partial(replica_fn, i) for i in range(self.topology.num_local)]
        return self._threads.call(
            fns, on_error=lambda i, e: rendezvous.abort(e), on_finish=rendezvous.finish
        )

    def _live_variables(self) -> list[DistributedVariable]:
        alive = [v for ref in self._variables if (v := ref()) is not None]
        if len(alive) != len(self._variables):
            self._variables = [weakref.ref(v) for v in alive]
        return alive

    def _adopt_replaced_buffers(self) -> None:
        """A buffer that `module.to(dtype)` replaced with a plain tensor becomes a
        variable again, in its place in the creation order (NOTE [placement]): every
        replica thread would update the plain one at once."""
        entries = self._buffers
        for index, (ref, owners) in enumerate(entries):
            adopted = self._placement.adopt_replaced_buffer(ref(), owners)
            if adopted is not None:
                entries[index] = (weakref.ref(adopted), adopted._ds_owners)
                self._variables.append(weakref.ref(adopted))
                self.data_replaced(adopted)

    def _live_buffers(self) -> list[DistributedVariable]:
        """The buffers still alive, in creation order (dead references dropped)."""
        alive = [b for ref, _ in self._buffers if (b := ref()) is not None]
        if len(alive) != len(self._buffers):
            self._buffers = [(r, o) for r, o in self._buffers if r() is not None]
        return alive

    def _before_run(self) -> None:
        if self._lifecycle is not None:
            self._lifecycle.before_run()
        if self._placement.unplaced:
            self._placement.place()
            self._placement.require_materialized()
        self._broadcast_initial_values()
        topology = self.topology
        if topology.num_replicas_in_sync > 1 and self._buffers:
            self._adopt_replaced_buffers()
        if topology.num_local > 1:
            # `_sync_from_primary` of the copies written in cross-replica code only: the
            # versions read here, without a call per variable.
            with _torch.DisableTorchFunctionSubclass():
                stale = [
                    var
                    for var in self._live_variables()
                    if var._ds_synchronization is not VariableSynchronization.ON_READ
                    and var._version != var._ds_synced_version
                ]
            for var in stale:
                var._sync_from_primary()
        if self._lifecycle is not None:
            self._hand_placed(self._lifecycle)

    def _hand_placed(self, lifecycle: ScopeLifecycle) -> None:
        """Tells the lifecycle which variables were registered since it last heard."""
        placed, self._newly_placed = self._newly_placed, []
        lifecycle.placed(placed)

    def _after_run(self) -> None:
        topology = self.topology
        if topology.num_replicas_in_sync == 1:
            return
        if topology.num_local > 1:
            with _torch.DisableTorchFunctionSubclass():  # `_mark_synced`, inlined
                for var in self._live_variables():
                    if var._ds_synchronization is not VariableSynchronization.ON_READ:
                        var._ds_synced_version = var._version  # every copy updated alike
        buffers = self._live_buffers()
        if buffers:
            self._sync_buffers(buffers)

    def _sync_buffers(self, buffers: list[DistributedVariable]) -> None:
        """Makes buffers that `fn` changed (e.g. BatchNorm statistics) agree again
        (NOTE [buffer sync]: on the device, no host sync)."""
        if self._buffer_sync is None:
            self._buffer_sync = BufferSync(
                self.topology.devices,
                self.topology.num_replicas_in_sync,
                self.topology.worker_index,
                self.topology.cross_worker,
            )
        self._buffer_sync.sync(buffers)

    # -- variables --------------------------------------------------------------------

    def _create_variable(self, value: torch.Tensor, spec: VariableSpec) -> Any:
        if self._home is not None:
            return self._home.create_variable(value, spec)
        synchronization, aggregation = spec.synchronization, spec.aggregation
        if synchronization is VariableSynchronization.NONE:
            raise InvalidArgumentError(
                "`NONE` variable synchronization mode is not supported under "
                f"{self._container_strategy!r}; use AUTO, ON_WRITE or ON_READ"
            )
        floating = value.is_floating_point() or value.is_complex()
        if aggregation is VariableAggregation.MEAN and not floating:
            raise InvalidArgumentError(
                f"MEAN aggregation needs a floating variable, got dtype {value.dtype}; "
                "use SUM or ONLY_FIRST_REPLICA, or a floating initial value"
            )
        # The default strategy places nothing: its variables stay where the value is.
        # A module's parameters and buffers stay where its code made them until it
        # has initialized them (NOTE [placement]); so does any value on the meta device.
        keep = not self._captures_modules or spec.deferred or value.is_meta
        var = self.make_variable(
            value, spec, devices=(value.device,) if keep else self.topology.devices
        )
        if self._captures_modules and keep:
            self._placement.defer(var)
        else:
            self.register_variable(var)
        return var

    def make_variable(
        self, value: torch.Tensor, spec: VariableSpec, devices: Sequence[torch.device]
    ) -> DistributedVariable:
        """A variable of this strategy on ``devices``, not yet registered with it."""
        synchronization, is_buffer = spec.synchronization, spec.is_buffer
        cls: type[DistributedVariable]
        if synchronization is VariableSynchronization.ON_READ:
            cls = SyncOnReadVariable
        elif self.topology.num_local > 1:
            cls = _ReplicatedMirroredVariable
        else:
            cls = MirroredVariable
        sync = (
            VariableSynchronization.ON_READ
            if synchronization is VariableSynchronization.ON_READ
            else VariableSynchronization.ON_WRITE
        )
        return cls._create(
            value,
            self._container_strategy,
            devices,
            trainable=spec.trainable,
            aggregation=spec.aggregation,
            synchronization=sync,
            is_param=spec.is_param,
            is_buffer=is_buffer,
            # Buffers keep a copy per replica even under central storage: kernels
            # update them in place during the forward pass, each from its own batch.
            alias_components=self.topology.central
            and sync is VariableSynchronization.ON_WRITE
            and not is_buffer,
        )

    def register_variable(self, var: DistributedVariable) -> None:
        """Makes a placed variable one of this strategy's (syncs, buffers, broadcast)."""
        if var._ds_is_buffer:
            self._buffers.append((weakref.ref(var), var._ds_owners))
        if (
            self.topology.cross_worker is not None
            and var._ds_synchronization is not VariableSynchronization.ON_READ
        ):
            self._pending_broadcast.append(var)
        self._variables.append(weakref.ref(var))
        self._variables_made += 1
        if self._variables_made % 1024 == 0:  # models made and dropped without a `run`
            self._live_variables()
        if self._lifecycle is not None:
            self._newly_placed.append(var)

    def _place_variables(self, only: DistributedVariable | None = None) -> None:
        self._placement.place(only)

    def _set_variable_data(self, var: DistributedVariable, value: torch.Tensor) -> None:
        if not self._captures_modules:
            super()._set_variable_data(var, value)
            return
        self._placement.set_data(var, value)

    def variables_changed(self) -> None:
        self._layout_generation += 1

    def data_replaced(self, var: DistributedVariable) -> None:
        """Every worker takes the chief's new value before the next `run`, as for an
        initial value (a `.data` swap may hold values drawn on each worker)."""
        if (
            self.topology.cross_worker is not None
            and var._ds_synchronization is not VariableSynchronization.ON_READ
            and all(v is not var for v in self._pending_broadcast)
        ):
            self._pending_broadcast.append(var)

    def _broadcast_initial_values(self) -> None:
        """Gives every worker the chief's initial values, whatever their seeds.

        Modules initialise their parameters after registering them
        (`reset_parameters`), so the broadcast waits until the scope is left or
        the next `run`, and sends every pending variable in one packed broadcast.
        Every worker creates the same variables in the same order.
        """
        if not self._pending_broadcast or self.topology.cross_worker is None:
            return
        pending, self._pending_broadcast = self._pending_broadcast, []
        primaries = [var.values[0].detach().clone() for var in pending]
        self.topology.cross_worker.broadcast(primaries, 0, name="initial variable values")
        for var, primary in zip(pending, primaries):
            var._write_all("assign", [primary] * self.topology.num_local)

    def _scope_closing(self) -> None:
        self._placement.place()
        self._broadcast_initial_values()

    def _scope_closed(self) -> None:
        if self._lifecycle is not None:
            self._hand_placed(self._lifecycle)

    def _skip_grads_in_this_replica(self) -> bool:
        # Only central storage hides gradients (read at every `.grad` of a replica).
        return self.topology.central and self._step_handler.hides_gradients()

    def colocate_vars_with(
        self, colocate_with_variable: Any
    ) -> contextlib.AbstractContextManager[None]:
        if self._home is not None:
            return self._home.colocate_vars_with(colocate_with_variable)
        return self._colocate_same_devices(colocate_with_variable)

    def variable_created_in_scope(self, v: Any) -> bool:
        if self._home is not None:
            return self._home.owns(v)
        if not self._captures_modules:
            # The default strategy, as TF's: every variable no strategy holds is its own.
            return (
                isinstance(v, torch.Tensor)
                and not isinstance(v, DistributedVariable)
                and _marks.managed_by(v) is None
            )
        return super().variable_created_in_scope(v)

    def _update(
        self,
        var: DistributedVariable,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group: bool,
    ) -> Any:
        if not isinstance(var, DistributedVariable):  # plain (default), or a shard (FSDP)
            return self._update_one_tensor(var, fn, args, kwargs, group)
        results = []
        n = 1 if self.topology.central else self.topology.num_local
        with torch.no_grad():
            for i in range(n):
                component = var._plain_component(i)
                results.append(fn(component, *select_replica(i, args), **select_replica(i, kwargs)))
        var._mark_synced()
        if not group:
            return tuple(results)
        return regroup(results, Mirrored)

    # -- collectives in replica context (`_replica_collectives.py`) ----------------------

    def exchange(
        self, local: int, kind: str, payload: Any, combine: Callable[[list[Any]], Any]
    ) -> Any:
        """Runs `combine` over every local replica's payload (inline with one replica)."""
        if self._rendezvous is None:
            return combine([payload])

        def checked(entries: list[tuple[str, Any]]) -> Any:
            kinds = {k for k, _ in entries}
            if len(kinds) > 1:
                described = ", ".join(
                    f"replica {self.topology.global_id(i)}: {k}" for i, (k, _) in enumerate(entries)
                )
                raise ContextError(
                    f"replicas called different collectives at the same point ({described}); "
                    "every replica must make the same collective calls in the same order"
                )
            return combine([p for _, p in entries])

        return self._rendezvous.exchange(local, (kind, payload), checked, kind)

    def _replica_all_reduce(self, replica_ctx: ReplicaContext, op: ReduceOp, value: Any) -> Any:
        return self._collectives.all_reduce(replica_ctx, op, value)

    def _replica_reduce_assigned(
        self, replica_ctx: ReplicaContext, op: ReduceOp, value: Any
    ) -> torch.Tensor:
        return self._collectives.reduce_assigned(replica_ctx, op, value)

    def _replica_all_gather(self, replica_ctx: ReplicaContext, value: Any, axis: int) -> Any:
        return self._collectives.all_gather(replica_ctx, value, axis)

    def _replica_merge_call(
        self,
        replica_ctx: ReplicaContext,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        return self._collectives.merge_call(replica_ctx, merge_fn, args, kwargs)

    def _replica_once(self, replica_ctx: ReplicaContext, fn: Callable[[], None]) -> None:
        self._collectives.once(replica_ctx, fn)

    def _replica_broadcast_first(self, replica_ctx: ReplicaContext, value: torch.Tensor) -> Any:
        return self._collectives.broadcast_first(replica_ctx, value)

    # -- cross-replica reductions (`_cross_replica.py`) ---------------------------------

    def _reduce(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        return self._reductions.reduce(op, value, axis)

    def _gather(self, value: Any, axis: int) -> Any:
        return self._reductions.gather(value, axis)

    def _local_results(self, value: Any) -> tuple[Any, ...]:
        return self._reductions.local_results(value)

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any) -> Any:
        return self._reductions.reduce_to(reduce_op, value, destinations)

    def _read_sync_on_read(self, var: DistributedVariable) -> torch.Tensor:
        return self._reductions.read_sync_on_read(var)

    # -- input ------------------------------------------------------------------------

    def _input_workers(self) -> Any:
        from distribute.data._workers import InputWorkers

        cross = self.topology.cross_worker
        if cross is None:  # one worker: InputWorkers' defaults (identity sum and gather)
            return InputWorkers(devices=self.topology.devices)
        return InputWorkers(
            devices=self.topology.devices,
            worker_index=self.topology.worker_index,
            num_workers=self.topology.num_workers,
            sum_across_workers=lambda n: cross.all_reduce_int(n, "end-of-data agreement"),
            gather_across_workers=functools.partial(gather_bytes, cross),
            collectives=cross,
        )

    def _distribute_dataset(self, dataset: Any, options: InputOptions | None) -> Any:
        from distribute.data.dataset import DistributedDataset

        return DistributedDataset(dataset, self._input_workers(), options)

    def _distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None
    ) -> Any:
        from distribute.data.dataset import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(dataset_fn, self._input_workers(), options)

    def _distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        from distribute.data.options import ValueContext

        n = self.topology.num_replicas_in_sync
        results = [
            value_fn(ValueContext(self.topology.global_id(i), n))
            for i in range(self.topology.num_local)
        ]
        if len(results) == 1 and not self._wrap_single_values:
            return results[0]
        return PerReplica(results)

    # -- gradients ----------------------------------------------------------------------


class _ReplicaGroup:
    """The engine's replicas as the gradient layer sees them (`gradients.base.
    ReplicaGroup`): read-only, and weak, so that the step handler the engine holds
    does not keep the engine alive."""

    __slots__ = ("_ref",)

    def __init__(self, engine: ReplicatedExtended) -> None:
        self._ref = weakref.ref(engine)

    @property
    def _engine(self) -> ReplicatedExtended:
        engine = self._ref()
        assert engine is not None, "the strategy's engine is gone"
        return engine

    @property
    def strategy(self) -> Strategy:
        return self._engine._container_strategy

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return self._engine.topology.devices

    @property
    def central_storage(self) -> bool:
        return self._engine.topology.central

    @property
    def cross_worker(self) -> CrossWorker | None:
        return self._engine.topology.cross_worker

    @property
    def num_workers(self) -> int:
        return self._engine.topology.num_workers

    @property
    def num_replicas_in_sync(self) -> int:
        return self._engine.topology.num_replicas_in_sync

    @property
    def bytes_per_pack(self) -> int:
        return self._engine._bytes_per_pack

    @property
    def syncing(self) -> bool:
        return self._engine._no_sync_depth == 0

    @property
    def layout_generation(self) -> int:
        return self._engine._layout_generation

    @property
    def captures_modules(self) -> bool:
        return self._engine._captures_modules

    @property
    def aggregate_gradients(self) -> bool:
        return self._engine.experimental_aggregate_gradients

    def exchange(
        self, local: int, kind: str, payload: Any, combine: Callable[[list[Any]], Any]
    ) -> Any:
        return self._engine.exchange(local, kind, payload, combine)


def arguments_on_device(structure: Any, device: torch.device) -> Any:
    """``structure`` with every plain tensor not on ``device`` copied there (variables,
    which the strategy placed, are left alone)."""
    leaves = flatten(structure)
    moved = [
        leaf.to(device)
        if isinstance(leaf, torch.Tensor)
        and leaf.device != device
        and not isinstance(leaf, DistributedVariable)
        else leaf
        for leaf in leaves
    ]
    return pack_sequence_as(structure, moved)


_TENSOR_TYPE = frozenset((torch.Tensor,))


def _shutdown_threads(holder: list[ReplicaThreads]) -> None:
    for threads in holder:
        threads.shutdown()
