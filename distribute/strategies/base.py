"""`Strategy` and `StrategyExtended`: the surface every strategy shares.

Glossary (as in tf.distribute):
    replica: one copy of the model, running the user's step on its share of a batch.
    worker: one process; it drives one or more local replicas.
    replica context: inside `strategy.run`; `ds.get_replica_context()` is a
        `ReplicaContext` and torch ops see the running replica's variable copies.
    cross-replica context: inside `strategy.scope()` outside `run` (or in a
        `merge_call`); one sees every replica's values, as `PerReplica`/`Mirrored`.
    synchronization: when variable copies agree (ON_WRITE: always; ON_READ: when read
        in cross-replica context). aggregation: how replicas' writes combine.

Concrete strategies subclass `Strategy` directly and compose a `StrategyExtended`
implementation; behaviour is shared by composition, never by subclassing a concrete
strategy.
"""

from __future__ import annotations

import abc
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from distribute import _marks, _torch, context
from distribute._enums import (
    REDUCE_OP_NAMES,
    ReduceOp,
    StepRunner,
    VariableSpec,
)
from distribute.errors import ContextError, InvalidArgumentError
from distribute.strategies import _torch_hooks

if TYPE_CHECKING:
    from distribute.collectives.base import CrossWorker
    from distribute.context import ReplicaContext
    from distribute.data.options import InputContext, InputOptions, ValueContext
    from distribute.gradients.base import StepHandler
    from distribute.strategies._engine_parts import ModuleCapture, ScopeLifecycle
    from distribute.variables import DistributedVariable

__all__ = ["Strategy", "StrategyExtended", "StrategyScope"]


class StrategyExtended(abc.ABC):
    """Additional strategy methods for library and advanced users; the engine's contract.

    An engine (docs/architecture.md, "Adding an engine") implements the abstract
    methods; the checks every engine shares (`run` nested in `run` or in a merge_fn,
    `update` and `colocate_vars_with` of a variable of another strategy) are template
    methods here, so that no engine repeats or forgets them. Everything else has a
    typed default.

    Example:
        >>> import distribute as ds
        >>> ds.OneDeviceStrategy("cpu").extended.worker_devices
        (device(type='cpu'),)
    """

    _captures_modules: bool = False

    def __init__(
        self,
        container_strategy: Strategy,
        *,
        capture: ModuleCapture | None = None,
        lifecycle: ScopeLifecycle | None = None,
    ) -> None:
        self._container_strategy = container_strategy
        #: What the scope makes of modules' parameters, buffers and submodules (None:
        #: the strategy's mirrored variables) and what happens as the outermost scope is
        #: entered and left, before `run` and in `no_sync()` (None: nothing more):
        #: the parts an engine is composed of (`_engine_parts.py`).
        self._capture = capture
        self._lifecycle = lifecycle
        self._no_sync_depth = 0

    # -- public surface (API.md) --------------------------------------------------

    @property
    @abc.abstractmethod
    def worker_devices(self) -> tuple[torch.device, ...]:
        """The devices of this worker's replicas, in local replica order."""

    @property
    @abc.abstractmethod
    def parameter_devices(self) -> tuple[torch.device, ...]:
        """The devices holding this worker's variable copies."""

    def call_for_each_replica(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Runs `fn` once per local replica in replica context (what `run` does).

        Refuses `run` inside `run` or inside a merge_fn (every engine), then runs the
        engine's `_run_replicas`.
        """
        stack = context._state.stack  # `context._top()`, inlined: once every step
        top = stack[-1] if stack else None
        if top is not None and top.replica_context is not None:
            raise ContextError(
                f"`run` was called inside `run` of {top.strategy!r}; call `run` once per "
                "step from cross-replica code and do per-replica work inside `fn`"
            )
        if top is not None and top.in_merge:
            raise ContextError(
                f"`run` was called inside a merge_fn of {top.strategy!r}; a merge_fn runs "
                "while every replica is paused in merge_call, so it cannot start new "
                "replicas. Return from merge_fn and call `run` from the outer loop"
            )
        return self._run_replicas(fn, tuple(args), kwargs or {})

    @abc.abstractmethod
    def _run_replicas(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """`fn` once per local replica in replica context (the checks are done)."""

    def colocate_vars_with(
        self, colocate_with_variable: Any
    ) -> contextlib.AbstractContextManager[None]:
        """A scope in which new variables are placed like `colocate_with_variable`.

        By default every variable of the strategy lives on the same devices: the
        variable must be this strategy's, and nothing else changes.
        """
        return self._colocate_same_devices(colocate_with_variable)

    @contextlib.contextmanager
    def _colocate_same_devices(self, colocate_with_variable: Any) -> Iterator[None]:
        if not self.variable_created_in_scope(colocate_with_variable):
            raise InvalidArgumentError(
                f"colocate_vars_with needs a variable created in {self._container_strategy!r}'s "
                f"scope, got {type(colocate_with_variable).__name__}"
            )
        yield  # every variable of this strategy already lives on the same devices

    @abc.abstractmethod
    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any) -> Any:
        """Reduces `value` across replicas and places the result on `destinations`."""

    def batch_reduce_to(
        self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]
    ) -> list[Any]:
        """`reduce_to` for several (value, destinations) pairs."""
        return [self.reduce_to(reduce_op, v, d) for v, d in value_destination_pairs]

    def update(
        self,
        var: DistributedVariable,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Calls `fn(component, *args, **kwargs)` on every component of `var`.

        Refuses a variable of another strategy (every engine), then runs the engine's
        `_update`.
        """
        if not self.variable_created_in_scope(var):
            raise InvalidArgumentError(
                f"update() needs a variable of {self._container_strategy!r}, got "
                f"{type(var).__name__}"
            )
        return self._update(var, fn, tuple(args), kwargs or {}, group)

    @abc.abstractmethod
    def _update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group: bool,
    ) -> Any:
        """`update` of a variable of this strategy (the check is done)."""

    def _update_one_tensor(
        self,
        var: torch.Tensor,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group: bool,
    ) -> Any:
        """`_update` of a variable that is one tensor (the default strategy's plain one,
        a DTensor an engine laid out or sharded): ``fn`` on it without gradients; a
        plain tensor argument meeting a DTensor variable is taken as replicated."""
        with torch.no_grad(), _replicated_if_dtensor(var):
            result = fn(var, *args, **kwargs)
        return result if group else (result,)

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether `v` is a variable created in this strategy's scope."""
        from distribute.variables import DistributedVariable

        if isinstance(v, DistributedVariable):
            return v._ds_strategy is self._container_strategy
        # Variables an engine replaced by torch's own (FSDP's shards, laid-out DTensors).
        return _marks.managed_by(v) is self._container_strategy

    # -- the engine's seams: what the layers above read (docs/architecture.md) ----------

    @property
    def cross_worker(self) -> CrossWorker | None:
        """The collectives joining this strategy's workers (rank, world size, barrier,
        reductions), or None when one worker trains alone (nothing to agree on).

        Training, checkpoints and callbacks use it to agree across workers.
        """
        return None

    @property
    def counts_in_worker_sums(self) -> bool:
        """Whether this worker adds its replicas' values to a sum over `cross_worker`
        (a count of examples, a loss, a metric's totals). False where another worker
        holds the same replica and adds them (`ModelParallelStrategy`: the workers off
        the first model coordinates), so that such a sum counts each replica once."""
        return True

    @property
    def worker_index(self) -> int:
        """This worker's index among the strategy's workers (0: the chief)."""
        return 0

    @property
    def num_workers(self) -> int:
        """How many worker processes the strategy's replicas span."""
        return 1

    @property
    def step_handler(self) -> StepHandler | None:
        """What `optimizer.step()` inside this strategy's `run` does with gradients
        (`distribute.gradients.base.StepHandler`); None: the optimizer hooks leave
        its steps alone."""
        return None

    @property
    def step_runner(self) -> StepRunner:
        """How `ds.Model`'s loop runs its steps on this engine (each one `run` here; as
        one XLA execution per ``steps_per_execution``; as closures a coordinator
        schedules on the workers)."""
        return StepRunner.IN_PROCESS

    @property
    def static_batch_shapes(self) -> bool:
        """Whether every step must see batches of one shape (XLA compiles per shape):
        input the library builds pads a partial last batch with weight-0 rows."""
        return False

    # -- internals the rest of the library calls ----------------------------------

    @abc.abstractmethod
    def _create_variable(self, value: torch.Tensor, spec: VariableSpec) -> DistributedVariable:
        """A variable of this strategy holding ``value``, as ``spec`` says.

        ``spec.deferred``: a module's parameter or buffer registered in the scope, which
        the module's code initializes after registering it; a strategy may keep it
        where it is until then (NOTE [placement] in strategies/_placement.py).
        """

    # The scope's hooks (template methods): the engine's capture part decides.

    def _captures(self, module: torch.nn.Module, tensor: torch.Tensor) -> bool:
        """Whether a parameter or buffer ``module`` registers in the scope is this
        strategy's to capture (see `_capture_parameter`)."""
        return self._capture is None or self._capture.captures(module, tensor)

    def _capture_parameter(
        self, module: torch.nn.Module, name: str, param: torch.nn.Parameter
    ) -> torch.nn.Parameter | None:
        """What a parameter registered in the scope becomes (None: itself)."""
        if self._capture is not None:
            return self._capture.capture_parameter(module, name, param)
        from distribute.variables import capture_parameter

        return capture_parameter(self._container_strategy, module, name, param)

    def _capture_buffer(
        self, module: torch.nn.Module, name: str, buffer: torch.Tensor
    ) -> torch.Tensor | None:
        """What a buffer registered in the scope becomes (None: itself)."""
        if self._capture is not None:
            return self._capture.capture_buffer(module, name, buffer)
        from distribute.variables import capture_buffer

        return capture_buffer(self._container_strategy, module, name, buffer)

    def _capture_submodule(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        """``child`` was attached to ``parent`` in the scope."""
        if self._capture is not None:
            self._capture.capture_submodule(parent, child)

    def _place_variables(self, only: DistributedVariable | None = None) -> None:
        """Places variables kept where they were created (see `_create_variable`)."""
        return None

    def _set_variable_data(self, var: DistributedVariable, value: torch.Tensor) -> None:
        """``var.data = value``: every copy of ``var`` takes ``value``."""
        tensor_base: Any = _torch.TensorBase
        with torch.no_grad():
            tensor_base.data.__set__(var, value)

    @abc.abstractmethod
    def _replica_all_reduce(self, replica_ctx: ReplicaContext, op: ReduceOp, value: Any) -> Any:
        """The engine's; see `ReplicatedExtended`."""

    @abc.abstractmethod
    def _replica_all_gather(self, replica_ctx: ReplicaContext, value: Any, axis: int) -> Any:
        """The engine's; see `ReplicatedExtended`."""

    def _replica_reduce_assigned(
        self, replica_ctx: ReplicaContext, op: ReduceOp, value: Any
    ) -> torch.Tensor:
        """What an aggregated variable's `assign*(value)` in replica context writes."""
        result: torch.Tensor = self._replica_all_reduce(replica_ctx, op, torch.as_tensor(value))
        return result

    @abc.abstractmethod
    def _replica_merge_call(
        self,
        replica_ctx: ReplicaContext,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The engine's; see `ReplicatedExtended`."""

    @abc.abstractmethod
    def _replica_broadcast_first(self, replica_ctx: ReplicaContext, value: torch.Tensor) -> Any:
        """The engine's; see `ReplicatedExtended`."""

    @abc.abstractmethod
    def _replica_once(self, replica_ctx: ReplicaContext, fn: Callable[[], None]) -> None:
        """The engine's; see `ReplicatedExtended`."""

    @abc.abstractmethod
    def _read_sync_on_read(self, var: DistributedVariable) -> torch.Tensor:
        """The engine's; see `ReplicatedExtended`."""

    def _skip_grads_in_this_replica(self) -> bool:
        return False

    @abc.abstractmethod
    def _num_replicas_in_sync(self) -> int:
        """The engine's; see `ReplicatedExtended`."""

    @abc.abstractmethod
    def _reduce(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        """The engine's; see `ReplicatedExtended`."""

    @abc.abstractmethod
    def _gather(self, value: Any, axis: int) -> Any:
        """The engine's; see `ReplicatedExtended`."""

    @abc.abstractmethod
    def _local_results(self, value: Any) -> tuple[Any, ...]:
        """The engine's; see `ReplicatedExtended`."""

    @abc.abstractmethod
    def _distribute_dataset(self, dataset: Any, options: InputOptions | None) -> Any:
        """The engine's; see `ReplicatedExtended`."""

    @abc.abstractmethod
    def _distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None
    ) -> Any:
        """The engine's; see `ReplicatedExtended`."""

    @abc.abstractmethod
    def _distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """The engine's; see `ReplicatedExtended`."""

    def _enter_scope(self) -> None:
        """Pushes the scope; the lifecycle hears of the outermost one."""
        context._enter_scope(self._container_strategy)
        if self._lifecycle is not None and context._scope_depth(self._container_strategy) == 1:
            self._lifecycle.scope_entered()

    def _exit_scope(self) -> None:
        """Leaves the scope in a fixed order (NOTE in docs/architecture.md, "Composing the
        engine"): the lifecycle's `scope_leaving`, the engine's `_scope_closing`, the
        context popped, the engine's `_scope_closed`, the lifecycle's `scope_left`; an
        error on the way still pops the scope."""
        outermost = context._scope_depth(self._container_strategy) == 1
        if outermost and self._lifecycle is not None:
            try:
                self._lifecycle.scope_leaving()
            except BaseException:
                context._exit_scope()  # leave the scope, and nothing more, on the way out
                raise
        try:
            if outermost:
                self._scope_closing()
        finally:
            context._exit_scope()
        if outermost:
            self._scope_closed()
            if self._lifecycle is not None:
                self._lifecycle.scope_left()

    def _scope_closing(self) -> None:
        """The outermost scope is being left, still pushed (the engine places and
        broadcasts its variables here)."""
        return None

    def _scope_closed(self) -> None:
        """The outermost scope was popped, before the lifecycle's `scope_left`."""
        return None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skips gradient communication during backward passes inside the block.

        Gradients accumulate locally; the next optimizer step (or backward pass, where
        the engine sums in backward) outside the block aggregates everything
        accumulated so far. Blocks nest.

        Example::

            with strategy.extended.no_sync():
                strategy.run(accumulate, args=(first_half,))
            strategy.run(accumulate_and_step, args=(second_half,))
        """
        self._no_sync_depth += 1
        try:
            if self._lifecycle is None:
                yield
            else:
                with self._lifecycle.no_sync():
                    yield
        finally:
            self._no_sync_depth -= 1


class StrategyScope:
    """What `Strategy.scope()` returns: a reusable, re-entrant context manager.

    Example:
        >>> import distribute as ds
        >>> s = ds.OneDeviceStrategy("cpu")
        >>> scope = s.scope()
        >>> with scope as entered, scope:
        ...     entered is s
        True
    """

    __slots__ = ("_strategy",)

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy

    def __enter__(self) -> Strategy:
        _torch_hooks.ensure_installed()  # NOTE [hooks at first use]
        self._strategy.extended._enter_scope()
        return self._strategy

    def __exit__(self, *exc: object) -> None:
        self._strategy.extended._exit_scope()


class Strategy:
    """Base class of every strategy: how a training step is distributed.

    Users do not build a `Strategy` directly; they pick a concrete strategy and change
    only that object to move a training step between one CPU, several devices and
    several machines.

    Example:
        >>> import distribute as ds, torch
        >>> strategy = ds.OneDeviceStrategy("cpu")
        >>> with strategy.scope():
        ...     model = torch.nn.Linear(2, 1)
        >>> out = strategy.run(lambda x: model(x).sum(), args=(torch.ones(4, 2),))
        >>> float(strategy.reduce("sum", out, axis=None)) == float(out)
        True
    """

    def __init__(self, extended: StrategyExtended) -> None:
        self._extended = extended

    @property
    def extended(self) -> StrategyExtended:
        """The `StrategyExtended` with the advanced methods."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas over all workers."""
        return self._extended._num_replicas_in_sync()

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver, or `None` for single-process strategies."""
        return None

    def scope(self) -> StrategyScope:
        """Makes this strategy current; modules built inside get distributed variables.

        The returned object can be entered any number of times, in sequence or
        nested. Re-entering the same strategy's scope is fine; entering a different
        strategy's scope inside it raises `RuntimeError` naming both, and so does
        entering a scope inside `run`.

        Example:
            >>> import distribute as ds, torch
            >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with s.scope():
            ...     w = torch.nn.Linear(1, 1).weight
            >>> type(w).__name__.endswith("MirroredVariable")
            True
        """
        return StrategyScope(self)

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: Any = None,
    ) -> Any:
        """Runs `fn` once per local replica, in replica context.

        `DistributedValues` in `args`/`kwargs` (at any depth) are replaced by each
        replica's own component.

        Returns:
            A `PerReplica` (leaves of a nest) of the replicas' results; a plain
                value where there is one local replica or every replica returned the
                same object.

        Raises:
            InvalidArgumentError: `args` is not a list or tuple.

        Example:
            >>> import distribute as ds
            >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> s.run(lambda: ds.get_replica_context().replica_id_in_sync_group)
            PerReplica(0, 1)
        """
        if not isinstance(args, (list, tuple)):
            raise InvalidArgumentError(
                f"run(fn, args=...) expects args to be a list or tuple, got "
                f"{type(args).__name__}; wrap a single argument as args=(x,)"
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise InvalidArgumentError(
                f"run(fn, kwargs=...) expects a dict, got {type(kwargs).__name__}"
            )
        _torch_hooks.ensure_installed()  # NOTE [hooks at first use]
        return self._extended.call_for_each_replica(fn, args, kwargs)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduces `value` across all replicas (cross-replica context only).

        Args:
            reduce_op: SUM or MEAN (or their names, any case).
            value: a `PerReplica`/`Mirrored`, a distributed variable, a plain value,
                or a nest of them.
            axis: None reduces across replicas only; `k` also reduces along dim k, and
                MEAN then divides by the total number of elements along k.

        Example:
            >>> import distribute as ds, torch
            >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> v = ds.PerReplica((torch.tensor([1., 2., 3., 4.]), torch.tensor([5., 6.])))
            >>> float(s.reduce("mean", v, axis=0))   # 21 / 6
            3.5
        """
        stack = context._state.stack  # the cross-replica check, inlined: once every step
        if stack and stack[-1].replica_context is not None:
            context.require_cross_replica(
                self, "reduce", "use ds.get_replica_context().all_reduce() or merge_call() there"
            )
        op = (
            reduce_op
            if type(reduce_op) is ReduceOp
            else (type(reduce_op) is str and REDUCE_OP_NAMES.get(reduce_op))
            or ReduceOp.from_value(reduce_op)
        )
        return self._extended._reduce(op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates every replica's component along `axis` (cross-replica only).

        Example:
            >>> import distribute as ds, torch
            >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> s.gather(ds.PerReplica((torch.tensor([1]), torch.tensor([2, 3]))), axis=0)
            tensor([1, 2, 3])
        """
        context.require_cross_replica(
            self, "gather", "use ds.get_replica_context().all_gather() there"
        )
        return self._extended._gather(value, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of `value` on this worker, as a tuple.

        Example:
            >>> import distribute as ds
            >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> s.experimental_local_results(ds.PerReplica((1, 2)))
            (1, 2)
        """
        return self._extended._local_results(value)

    def experimental_distribute_dataset(
        self, dataset: Any, options: InputOptions | None = None
    ) -> Any:
        """Distributes a DataLoader (or iterable of global batches) over the replicas.

        Each step yields the global batch split per replica (see `ds.data`).
        """
        return self._extended._distribute_dataset(dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None = None
    ) -> Any:
        """Builds one input pipeline per worker (or replica) with `dataset_fn(InputContext)`."""
        return self._extended._distribute_datasets_from_function(dataset_fn, options)

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> Any:
        """Calls `value_fn(ValueContext)` once per local replica; results in a `PerReplica`.

        Example:
            >>> import distribute as ds
            >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> s.experimental_distribute_values_from_function(
            ...     lambda ctx: ctx.replica_id_in_sync_group * 10)
            PerReplica(0, 10)
        """
        return self._extended._distribute_values_from_function(value_fn)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync})"


def _replicated_if_dtensor(var: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """A DTensor variable takes a plain tensor it meets as replicated."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # imported once something uses it
    if dtensor is None or not isinstance(var, dtensor.DTensor):
        return contextlib.nullcontext()
    from distribute.strategies._tensor_parallel import plain_is_replicated

    return plain_is_replicated()
