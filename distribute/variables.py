"""Distributed variables: `MirroredVariable`, `SyncOnReadVariable`, and their capture.

# NOTE [one tensor, several replicas]
A `MirroredVariable` is a `torch.Tensor` subclass whose own storage is the primary
component (local replica 0); the other local replicas hold their own tensors in
`_ds_components`. While replica i runs, `__torch_function__` swaps every variable for
component i before the op runs, so an unchanged `nn.Module` forward reads replica
i's copy and autograd accumulates replica i's gradient into component i's `.grad`.
The `grad` property follows the running replica, so an unchanged optimizer reads
and updates replica i's own copy. With one local replica the class has no active
`__torch_function__` at all (the variable behaves exactly like an `nn.Parameter`),
so single-replica training pays nothing per op.

# NOTE [writes in cross-replica context]
Cross-replica code (a module's `reset_parameters`, `load_state_dict`, user code
under `torch.no_grad()`) writes the primary in place. The variable records the
primary's version counter whenever its copies are known to agree; before the next
`run` the strategy copies a primary whose version moved to the other components.
`assign*` write every component at once.

Example:
    >>> import distribute as ds, torch
    >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> with s.scope():
    ...     layer = torch.nn.Linear(2, 1)
    >>> isinstance(layer.weight, ds.MirroredVariable), len(layer.weight.values)
    (True, 2)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules import module as _module
from torch.utils.hooks import RemovableHandle

from distribute import _torch, context
from distribute._enums import ReduceOp, VariableAggregation, VariableSpec, VariableSynchronization
from distribute.errors import ContextError, InvalidArgumentError

if TYPE_CHECKING:
    from distribute.strategies.base import Strategy

__all__ = ["DistributedVariable", "MirroredVariable", "SyncOnReadVariable", "Variable"]

_TensorBase: Any = _torch.TensorBase


def _local_replica(strategy: Strategy) -> int | None:
    """The local replica id running in this thread for `strategy`, else None."""
    stack = context._state.stack
    if stack:
        top = stack[-1]
        if top.strategy is strategy and top.replica_context is not None:
            return top.replica_context._local_replica_id  # not the property: per `.grad`
    return None


def _storage_key(tensor: torch.Tensor) -> tuple[object, int]:
    """What tells copies that share memory (central storage) from distinct ones. XLA
    tensors have no data pointer (it reads 0 on every device), and a variable's XLA
    copies are on distinct devices: the device tells them apart."""
    if tensor.device.type == "xla":
        return (tensor.device, -1)
    return (tensor.device, tensor.data_ptr())


class DistributedVariable(torch.Tensor):
    """Base class of `MirroredVariable` and `SyncOnReadVariable`.

    Example:
        >>> import distribute as ds, torch
        >>> with ds.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        ...     layer = torch.nn.Linear(2, 1)
        >>> isinstance(layer.weight, ds.DistributedVariable), len(layer.weight.values)
        (True, 2)
    """

    __torch_function__ = _torch.disabled_torch_function_impl

    _ds_strategy: Strategy
    _ds_components: tuple[torch.Tensor, ...]
    _ds_aggregation: VariableAggregation
    _ds_synchronization: VariableSynchronization
    _ds_synced_version: int
    _ds_is_buffer: bool
    _ds_trainable: bool
    #: False from creation in a scope until the strategy places the variable on its
    #: replica devices (NOTE [placement] in strategies/_placement.py).
    _ds_placed: bool
    #: Where modules hold this variable: (module, "param" or "buffer", name).
    _ds_owners: list[tuple[weakref.ref[torch.nn.Module], str, str]]
    #: Whether any strategy of several replicas in sync has made a variable in this
    #: process; until then the optimizer hooks skip their checks outside `run`.
    _ds_any_replicated: bool = False

    @classmethod
    def _create(
        cls,
        data: torch.Tensor,
        strategy: Strategy,
        devices: Sequence[torch.device],
        *,
        trainable: bool,
        aggregation: VariableAggregation,
        synchronization: VariableSynchronization,
        is_param: bool = False,
        is_buffer: bool = False,
        alias_components: bool = False,
    ) -> DistributedVariable:
        data = data.detach()
        requires_grad = trainable and (data.is_floating_point() or data.is_complex())
        primary = data.to(devices[0])
        var: DistributedVariable = _torch.make_subclass(cls, primary, requires_grad)
        components = []
        for device in devices[1:]:
            if alias_components:
                component = var.as_subclass(torch.Tensor).detach()
            else:
                component = primary.to(device, copy=True)
            components.append(component.requires_grad_(requires_grad))
        var._ds_strategy = strategy
        var._ds_components = tuple(components)
        var._ds_aggregation = aggregation
        var._ds_synchronization = synchronization
        var._ds_is_buffer = is_buffer
        var._ds_trainable = trainable
        var._ds_synced_version = var._primary_version()
        var._ds_placed = True
        var._ds_owners = []
        if strategy.num_replicas_in_sync > 1:
            DistributedVariable._ds_any_replicated = True
        if is_param:
            var._is_param = True  # nn.Parameter's isinstance check honours this flag
        return var

    # -- components ---------------------------------------------------------------

    def _primary_version(self) -> int:
        with _torch.DisableTorchFunctionSubclass():
            return int(self._version)

    def _component(self, replica: int) -> torch.Tensor:
        """Local replica `replica`'s tensor (the variable itself for replica 0)."""
        return self if replica == 0 else self._ds_components[replica - 1]

    def _plain_component(self, replica: int) -> torch.Tensor:
        """Like `_component`, but never the subclass: a detached alias for replica 0."""
        if replica == 0:
            with _torch.DisableTorchFunctionSubclass():
                return self.as_subclass(torch.Tensor).detach()
        return self._ds_components[replica - 1].detach()

    def _sync_from_primary(self) -> None:
        """Copies the primary into the other components if it was written alone."""
        version = self._primary_version()
        if version == self._ds_synced_version:
            return
        primary = self._plain_component(0)
        with torch.no_grad():
            for component in self._ds_components:
                if _storage_key(component) != _storage_key(primary):
                    component.copy_(primary)
        self._ds_synced_version = self._primary_version()

    def _mark_synced(self) -> None:
        self._ds_synced_version = self._primary_version()

    def _ds_add_owner(self, module: torch.nn.Module, kind: str, name: str) -> None:
        """Records that ``module`` holds this variable as its parameter or buffer ``name``."""
        for ref, k, n in self._ds_owners:
            if ref() is module and k == kind and n == name:
                return
        self._ds_owners.append((weakref.ref(module), kind, name))

    @property
    def data(self) -> torch.Tensor:
        """The primary component's data, as `torch.Tensor.data` (inside `run`: the
        running replica's)."""
        data: torch.Tensor = _TensorBase.data.__get__(self)
        return data

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # `p.data = t` (and `module.to(dtype)`, `.half()`, ...: `Module._apply` writes
        # `.data`) must reach every replica's copy, not only the primary.
        self._ds_strategy.extended._set_variable_data(self, value)

    @property
    def values(self) -> tuple[torch.Tensor, ...]:  # type: ignore[override]  # Tensor.values is a sparse-tensor method; here the per-replica components
        """The components, one per local replica (plain tensors sharing storage)."""
        if not self._ds_placed:
            self._ds_strategy.extended._place_variables(self)
        if self._ds_synchronization is not VariableSynchronization.ON_READ:
            self._sync_from_primary()
        return tuple(self._plain_component(i) for i in range(1 + len(self._ds_components)))

    @property
    def aggregation(self) -> VariableAggregation:
        """How replica-context writes (mirrored) or cross-replica reads (on-read) combine."""
        return self._ds_aggregation

    @property
    def synchronization(self) -> VariableSynchronization:
        """`ON_WRITE` for mirrored variables, `ON_READ` for sync-on-read ones."""
        return self._ds_synchronization

    @property
    def distribute_strategy(self) -> Strategy:
        """The strategy whose scope created this variable."""
        return self._ds_strategy

    @property
    def trainable(self) -> bool:
        """Whether optimizers should train this variable."""
        return self._ds_trainable

    # -- reads and writes ---------------------------------------------------------

    def read_value(self) -> torch.Tensor:
        """The value as seen from the current context (see the class docstring)."""
        replica = _local_replica(self._ds_strategy)
        if replica is None:
            return self._cross_replica_value().clone()
        return self._component(replica).as_subclass(torch.Tensor).clone()

    def _cross_replica_value(self) -> torch.Tensor:
        return self._plain_component(0)

    def assign(self, value: Any) -> DistributedVariable:
        """Writes `value` (see the class docstring for what each context does)."""
        return self._write("assign", value)

    def assign_add(self, delta: Any) -> DistributedVariable:
        """Adds `delta` (see `assign`)."""
        return self._write("assign_add", delta)

    def assign_sub(self, delta: Any) -> DistributedVariable:
        """Subtracts `delta` (see `assign`)."""
        return self._write("assign_sub", delta)

    def _write(self, kind: str, value: Any) -> DistributedVariable:
        raise NotImplementedError

    def _apply_to(self, component: torch.Tensor, kind: str, value: Any) -> None:
        value = torch.as_tensor(value, dtype=component.dtype, device=component.device)
        with torch.no_grad(), _torch.DisableTorchFunctionSubclass():
            target = component.as_subclass(torch.Tensor) if component is self else component
            if kind == "assign":
                target.copy_(value.expand_as(target))
            elif kind == "assign_add":
                target.add_(value)
            else:
                target.sub_(value)

    def _write_all(self, kind: str, values: Sequence[Any]) -> None:
        written: set[tuple[object, int]] = set()
        for i in range(1 + len(self._ds_components)):
            component = self._component(i)
            storage = _storage_key(self._plain_component(i))
            if storage in written:
                continue  # an alias of a copy already written (central storage)
            written.add(storage)
            self._apply_to(component, kind, values[i])
        self._mark_synced()

    def _aliases_primary(self) -> bool:
        """Whether every replica shares the primary's storage (central storage)."""
        primary = _storage_key(self._plain_component(0))
        return all(_storage_key(c) == primary for c in self._ds_components)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # same keyword as Tensor.__repr__, narrower return type
        with _torch.DisableTorchFunctionSubclass():
            body = repr(self.as_subclass(torch.Tensor).detach())
        return (
            f"{type(self).__name__}(replicas={1 + len(self._ds_components)}, "
            f"aggregation={self._ds_aggregation.name}, {body})"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickling (torch.save of a module) stores the primary as a plain tensor, or as
        # an nn.Parameter when the variable stands for one.
        is_param = bool(getattr(self, "_is_param", False))
        return (_rebuild_plain, (self._plain_component(0).clone(), self.requires_grad, is_param))

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        plain = self._plain_component(0).clone()
        if getattr(self, "_is_param", False):
            return torch.nn.Parameter(plain, requires_grad=self.requires_grad)
        return plain


def _rebuild_plain(data: torch.Tensor, requires_grad: bool, is_param: bool = False) -> torch.Tensor:
    if is_param:
        return torch.nn.Parameter(data, requires_grad=requires_grad)
    return data.requires_grad_(requires_grad) if requires_grad else data


class MirroredVariable(DistributedVariable):
    """A variable with one identical copy per local replica.

    Inside `run`, torch ops see the running replica's copy; in cross-replica context,
    reads see the primary (replica 0) and `assign*` write every copy. In replica
    context, `assign*` follow `aggregation`: SUM/MEAN all-reduce the value over all
    replicas then write every copy; ONLY_FIRST_REPLICA writes replica 0's value;
    NONE writes the local copy only.

    Example:
        >>> import distribute as ds, torch
        >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with s.scope():
        ...     v = ds.Variable(torch.zeros(()), aggregation=ds.VariableAggregation.SUM)
        >>> _ = s.run(lambda: v.assign(1.0 + ds.get_replica_context().replica_id_in_sync_group))
        >>> [float(c) for c in v.values]   # 1 + 2 on both replicas
        [3.0, 3.0]
    """

    def _write(self, kind: str, value: Any) -> DistributedVariable:
        replica_ctx = context._current_replica_context_for(self._ds_strategy)
        if replica_ctx is None:
            self._require_not_in_other_replica()
            self._sync_from_primary()
            self._write_all(kind, [value] * (1 + len(self._ds_components)))
            return self
        replica = replica_ctx.local_replica_id
        aggregation = self._ds_aggregation
        extended = self._ds_strategy.extended
        shared = len(self._ds_components) > 0 and self._aliases_primary()
        if shared and aggregation is VariableAggregation.NONE:
            raise InvalidArgumentError(
                "a variable with NONE aggregation was assigned inside `run`, but every "
                "replica shares its one copy (CentralStorageStrategy); give it SUM, MEAN or "
                "ONLY_FIRST_REPLICA aggregation, or assign it in cross-replica context"
            )
        if aggregation in (VariableAggregation.SUM, VariableAggregation.MEAN):
            op = ReduceOp.SUM if aggregation is VariableAggregation.SUM else ReduceOp.MEAN
            value = extended._replica_reduce_assigned(replica_ctx, op, value)
        elif aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            value = extended._replica_broadcast_first(replica_ctx, torch.as_tensor(value))
        if shared:  # one copy: written once, while every replica waits
            extended._replica_once(replica_ctx, lambda: self._apply_to(self, kind, value))
        else:
            self._apply_to(self._component(replica), kind, value)
        return self

    def _require_not_in_other_replica(self) -> None:
        top = context._top()
        if top is not None and top.replica_context is not None:
            raise ContextError(
                f"a variable of {self._ds_strategy!r} was assigned inside `run` of "
                f"{top.strategy!r}; assign it inside its own strategy's `run` or in "
                "cross-replica context"
            )


_METADATA = frozenset(
    [
        *(
            getattr(torch.Tensor, name).__get__
            for name in ("shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_leaf")
        ),
        *(
            getattr(torch.Tensor, name)
            for name in (
                "size",
                "dim",
                "numel",
                "nelement",
                "__len__",
                "element_size",
                "is_floating_point",
                "is_complex",
                "stride",
                "is_contiguous",
            )
        ),
    ]
)


class SyncOnReadVariable(DistributedVariable):
    """A variable whose replicas write their own copy; reads in cross-replica context
    aggregate the copies (SUM, MEAN, or ONLY_FIRST_REPLICA: replica 0's).

    Typical use: metrics. Cross-replica `assign(x)` with SUM writes x/N to each of the
    N replicas' copies (so the aggregated read gives x back); cross-replica
    `assign_add`/`assign_sub` with SUM raise `ValueError`.

    Example:
        >>> import distribute as ds, torch
        >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with s.scope():
        ...     total = ds.Variable(0.0, synchronization=ds.VariableSynchronization.ON_READ,
        ...                         aggregation=ds.VariableAggregation.SUM)
        >>> _ = s.run(lambda: total.assign_add(2.0))
        >>> float(total.read_value())   # 2 + 2
        4.0
    """

    @classmethod
    def __torch_function__(  # classmethod form of the protocol; the base disables it
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in _METADATA:  # shape, dtype, ...: the same on every copy, no aggregation
            with _torch.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        return _dispatch(func, args, kwargs or {})

    def _read_for(self, replica: int | None) -> torch.Tensor:
        if replica is not None:
            return self._component(replica)
        return self._cross_replica_value()

    def _cross_replica_value(self) -> torch.Tensor:
        return self._ds_strategy.extended._read_sync_on_read(self)

    def _write(self, kind: str, value: Any) -> DistributedVariable:
        replica_ctx = context._current_replica_context_for(self._ds_strategy)
        if replica_ctx is not None:
            self._apply_to(self._component(replica_ctx.local_replica_id), kind, value)
            return self
        n_local = 1 + len(self._ds_components)
        if self._ds_aggregation is VariableAggregation.SUM:
            if kind != "assign":
                raise InvalidArgumentError(
                    f"SyncOnReadVariable with SUM aggregation does not support {kind} in "
                    "cross-replica context (the delta cannot be split among replicas); "
                    "call assign() with the new total, or assign_add inside `run`"
                )
            n = self._ds_strategy.num_replicas_in_sync
            share = torch.as_tensor(value) / n
            self._write_all(kind, [share] * n_local)
        else:
            self._write_all(kind, [value] * n_local)
        return self


class _ReplicatedMirroredVariable(MirroredVariable):
    """A `MirroredVariable` with several local replicas: dispatches per replica."""

    @classmethod
    def __torch_function__(  # classmethod form of the protocol; the base disables it
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return _dispatch(func, args, kwargs or {})

    @property
    def grad(self) -> torch.Tensor | None:
        stack = context._state.stack  # `_local_replica`, inlined: read 16 times a step
        if stack:
            top = stack[-1]
            replica_ctx = top.replica_context
            if replica_ctx is not None and top.strategy is self._ds_strategy:
                replica = replica_ctx._local_replica_id
                if replica:
                    if self._ds_strategy._extended._skip_grads_in_this_replica():
                        return None
                    return self._ds_components[replica - 1].grad
        with _torch.DisableTorchFunctionSubclass():
            grad: torch.Tensor | None = _TensorBase.grad.__get__(self)
        return grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        replica = _local_replica(self._ds_strategy)
        if replica:
            self._ds_components[replica - 1].grad = value
            return
        with _torch.DisableTorchFunctionSubclass():
            _TensorBase.grad.__set__(self, value)
        if replica is None and value is None:
            for component in self._ds_components:  # zero_grad() in cross-replica context
                component.grad = None


def _swap(value: Any, running: tuple[Strategy, int] | None) -> Any:
    if isinstance(value, DistributedVariable):
        replica = None
        if running is not None:
            if running[0] is value._ds_strategy:
                replica = running[1]
            elif running[0].extended._captures_modules and torch.is_grad_enabled():
                _refuse_other_strategy(value, running[0])  # reading it without grad is fine
        if isinstance(value, SyncOnReadVariable):
            return value._read_for(replica)
        return value if replica is None else value._component(replica)
    # Only variables and nests are visited (a call per argument costs at every op).
    if isinstance(value, (list, tuple)):
        swapped = [_swap(v, running) if isinstance(v, _VISITED) else v for v in value]
        return swapped if isinstance(value, list) else type(value)(swapped)
    if isinstance(value, dict):
        return {k: _swap(v, running) if isinstance(v, _VISITED) else v for k, v in value.items()}
    return value


_VISITED = (DistributedVariable, list, tuple, dict)
_NESTS = (list, tuple, dict)


def _refuse_other_strategy(value: DistributedVariable, running: Strategy) -> None:
    from distribute.errors import MixedStrategyError

    raise MixedStrategyError(
        f"a variable of {value._ds_strategy!r} was used inside `run` of {running!r}; a "
        "model runs under the strategy whose scope built it: call that strategy's `run`, "
        f"or build the model inside `with strategy.scope():` of {running!r}"
    )


def _running_replica() -> tuple[Strategy, int] | None:
    stack = context._state.stack
    if stack:
        top = stack[-1]
        if top.replica_context is not None:
            return top.strategy, top.replica_context._local_replica_id
    return None


def _dispatch(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    stack = context._state.stack
    if stack:
        top = stack[-1]
        replica_ctx = top.replica_context
        if replica_ctx is not None:
            # NOTE [the op inside run]: most ops a replica makes have flat arguments,
            # each a plain value or a mirrored variable of the running strategy
            # (`F.linear(x, weight, bias)`, `param.add_(grad, alpha=...)`): they are
            # swapped in this loop, with no frame per argument (issue 40: `_swap`'s
            # frames were most of a dispatch). Anything else takes `_swap`.
            replica = replica_ctx._local_replica_id
            strategy = top.strategy
            swapped: list[Any] = []
            for value in args:
                if isinstance(value, DistributedVariable):
                    if value._ds_strategy is not strategy or isinstance(value, SyncOnReadVariable):
                        break
                    if replica:
                        value = value._ds_components[replica - 1]
                elif isinstance(value, _NESTS):
                    break
                swapped.append(value)
            else:
                if kwargs:
                    for value in kwargs.values():
                        if isinstance(value, _VISITED):
                            break
                    else:
                        with _torch.DisableTorchFunctionSubclass():
                            return func(*swapped, **kwargs)
                else:
                    with _torch.DisableTorchFunctionSubclass():
                        return func(*swapped)
    running = _running_replica()
    args = _swap(args, running)
    if kwargs:
        kwargs = _swap(kwargs, running)
    with _torch.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def Variable(
    initial_value: Any,
    trainable: bool | None = None,
    synchronization: VariableSynchronization = VariableSynchronization.AUTO,
    aggregation: VariableAggregation = VariableAggregation.NONE,
    dtype: torch.dtype | None = None,
) -> DistributedVariable:
    """Creates a variable of the current strategy.

    In a strategy's scope: a `MirroredVariable` (`AUTO`/`ON_WRITE`) or a
    `SyncOnReadVariable` (`ON_READ`); outside any scope, a single-copy variable of
    the default strategy with the same methods.

    Args:
        initial_value: a tensor, number or array-like.
        trainable: whether gradients flow to it; default True, but False for ON_READ.
        synchronization: `VariableSynchronization`.
        aggregation: `VariableAggregation`.
        dtype: optional dtype for the value.

    Raises:
        InvalidArgumentError: `NONE` synchronization under a strategy, or MEAN
            aggregation of an integer variable.
        ContextError: called inside `run` of a strategy with several replicas in
            sync (create variables in the scope, outside `run`).

    Example:
        >>> import distribute as ds
        >>> v = ds.Variable(1.0)
        >>> float(v.assign_add(2.0))
        3.0
    """
    synchronization = VariableSynchronization(synchronization)
    aggregation = VariableAggregation(aggregation)
    value = torch.as_tensor(initial_value, dtype=dtype)
    if dtype is None and not value.is_floating_point() and isinstance(initial_value, float):
        value = value.to(torch.get_default_dtype())
    if trainable is None:
        trainable = synchronization is not VariableSynchronization.ON_READ
    strategy = context.get_strategy()
    if context._current_replica_context_for(strategy) is not None:
        _refuse_in_replica_context(strategy, "ds.Variable")
    return strategy.extended._create_variable(
        value, VariableSpec(trainable, synchronization, aggregation)
    )


def _capturing_strategy(
    what: str | None, module: torch.nn.Module, tensor: torch.Tensor
) -> Strategy | None:
    """The strategy whose scope turns a new parameter or buffer into its variable.

    Inside `run` nothing is captured: each replica would make its own copy. A new
    parameter (``what``) is refused there when several replicas are in sync (see
    `_refuse_in_replica_context`) and otherwise left a plain tensor, as is a
    buffer (``what=None``). A strategy may leave some registrations alone
    (`StrategyExtended._captures`: FSDP re-registering its own parameters).
    """
    top = context._top()
    if top is None or not top.strategy.extended._captures_modules:
        return None
    if not top.strategy.extended._captures(module, tensor):
        return None
    if top.replica_context is not None:
        if what is not None:
            _refuse_in_replica_context(top.strategy, what)
        return None
    return top.strategy


def _refuse_in_replica_context(strategy: Strategy, what: str) -> None:
    """Raises when a variable is created inside `run` of a strategy of several replicas.

    tf.distribute creates one variable that every replica shares (the first
    replica creates it); here each replica thread would build its own module and
    initialise it from its own random draws, so the replicas would silently
    train different variables. Variables are created in the scope, outside `run`.
    """
    n = strategy.num_replicas_in_sync
    if n > 1:
        raise ContextError(
            f"a {what} was created inside `run` of {strategy!r}, where {n} replicas would "
            "each create their own; create variables and modules with parameters inside "
            "`with strategy.scope():` before calling `run`, and use them inside `fn`"
        )


def _slot_strategy(current: object) -> Strategy | None:
    """The strategy of the variable a module slot holds, if it captures modules.

    A tensor assigned in place of a strategy's variable outside any scope
    (`load_state_dict(..., assign=True)`, `module.weight = nn.Parameter(...)`)
    becomes that strategy's variable, as it would have inside the scope.
    """
    if isinstance(current, DistributedVariable):
        strategy = current._ds_strategy
        if strategy.extended._captures_modules and context._top() is None:
            return strategy
    return None


def _parameter_hook(
    module: torch.nn.Module, name: str, param: torch.nn.Parameter | None
) -> torch.nn.Parameter | None:
    if param is None:
        return None
    if isinstance(param, DistributedVariable):
        param._ds_add_owner(module, "param", name)  # tied weights: one variable, two slots
        return None
    strategy = _capturing_strategy("parameter", module, param) or _slot_strategy(
        module._parameters.get(name)
    )
    if strategy is None:
        return None
    return strategy.extended._capture_parameter(module, name, param)


def capture_parameter(
    strategy: Strategy, module: torch.nn.Module, name: str, param: torch.nn.Parameter
) -> torch.nn.Parameter | None:
    """A module's new parameter as ``strategy``'s variable (what a scope does by default)."""
    spec = VariableSpec(
        param.requires_grad,
        VariableSynchronization.ON_WRITE,
        VariableAggregation.NONE,
        is_param=True,
        deferred=True,
    )
    var = strategy.extended._create_variable(param.detach(), spec)
    _owned(var, param, module, "param", name)
    return var  # type: ignore[return-value]  # isinstance(var, Parameter) holds


def _buffer_hook(
    module: torch.nn.Module, name: str, buffer: torch.Tensor | None
) -> torch.Tensor | None:
    if buffer is None:
        return None
    if isinstance(buffer, DistributedVariable):
        buffer._ds_add_owner(module, "buffer", name)
        return None
    strategy = _capturing_strategy(None, module, buffer) or _slot_strategy(
        module._buffers.get(name)
    )
    if strategy is None:
        return None
    return strategy.extended._capture_buffer(module, name, buffer)


def capture_buffer(
    strategy: Strategy, module: torch.nn.Module, name: str, buffer: torch.Tensor
) -> torch.Tensor | None:
    """A module's new buffer as ``strategy``'s variable (what a scope does by default)."""
    spec = VariableSpec(
        False,
        VariableSynchronization.ON_WRITE,
        buffer_aggregation(buffer),
        is_buffer=True,
        deferred=True,
    )
    var = strategy.extended._create_variable(buffer, spec)
    if var is buffer:
        return None  # the strategy keeps this buffer as it is (parameter servers)
    _owned(var, buffer, module, "buffer", name)
    return var


def _owned(
    var: torch.Tensor, original: torch.Tensor, module: torch.nn.Module, kind: str, name: str
) -> None:
    """Records the module slot of a variable made for ``original`` and keeps its
    Python attributes (strategies whose variables are other tensors have no slots)."""
    if isinstance(var, DistributedVariable):
        carry_attributes(vars(original), var)
        var._ds_add_owner(module, kind, name)


def carry_attributes(attributes: dict[str, Any], var: torch.Tensor) -> None:
    """Copies the Python attributes a tensor carried (transformers' ``_is_hf_initialized``
    marks loaded weights; others mark weight decay or sharding) onto the variable
    that stands for it, leaving the variable's own."""
    for key, value in attributes.items():
        if not key.startswith("_ds_") and key != "_is_param":
            setattr(var, key, value)


def buffer_aggregation(buffer: torch.Tensor) -> VariableAggregation:
    """How a module buffer's copies combine: floating buffers (BatchNorm's running
    statistics) average, others (``num_batches_tracked``) take replica 0's."""
    if buffer.is_floating_point():
        return VariableAggregation.MEAN
    return VariableAggregation.ONLY_FIRST_REPLICA


def _submodule_hook(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
    """Tells the capturing strategy that ``submodule`` became part of ``module`` (a
    sharding strategy finds the roots of what its scope built this way)."""
    top = context._top()
    if submodule is None or top is None or top.replica_context is not None:
        return
    if top.strategy.extended._captures_modules:
        top.strategy.extended._capture_submodule(module, submodule)


_registration_handles: list[RemovableHandle] = []
_registration_lock = threading.Lock()


def install_registration_hooks() -> None:
    """Installs the global module, parameter and buffer registration hooks that
    capture what a strategy's scope builds (idempotent).

    Called when a strategy's scope is first entered or its `run` first called
    (`strategies/_torch_hooks.py`), never at import: until then plain PyTorch code
    in the process runs none of this library's code. Outside any scope the hooks
    act only on module slots that hold a strategy's variable.
    """
    with _registration_lock:
        if _registration_handles:
            return
        _registration_handles.extend(
            [
                _module.register_module_module_registration_hook(_submodule_hook),
                _module.register_module_parameter_registration_hook(_parameter_hook),  # type: ignore[arg-type]  # stubs say the hook returns None; returning a tensor replaces it
                _module.register_module_buffer_registration_hook(_buffer_hook),  # type: ignore[arg-type]  # stubs say the hook returns None; returning a tensor replaces it
            ]
        )
