"""Variables that live on ps tasks: `ParameterServerVariable` and `ShardedVariable`.

A variable created in a `ParameterServerStrategy` scope is stored on one ps task;
the process that made it keeps a local copy with a handle (id, ps task). Pickled
(a closure shipped to a worker), a variable travels as its handle: the worker makes
its own local copy once and refreshes it from the ps at the start of every closure.
Gradients never touch the local copy's value: `optimizer.step()` on a worker sends
them to the ps tasks, whose optimizers apply them (NOTE [ps updates]).

A `ShardedVariable` is split along dim 0 into shards on several ps tasks (a
`variable_partitioner`). It is a tensor with no storage of its own: an embedding
lookup fetches only the rows it needs from each shard, and any other op reads the
whole variable first.

# NOTE [ps updates]
An optimizer step hook (on every optimizer, doing nothing unless its params are ps
variables) sends each ps the gradients of its variables (a sharded variable's
looked-up rows as (rows, row gradients)), with the optimizer's class and current
hyperparameters; the ps builds that optimizer over its variables once and steps
it. The local step then finds no gradients and changes nothing. Workers do not
wait for each other: each update is applied when it arrives (asynchronous
training, as tf.distribute's parameter servers do).

Example::

    with strategy.scope():                       # a ParameterServerStrategy
        v = ds.Variable(0.0)                     # a ParameterServerVariable on ps_0
    v.assign_add(1.0)                            # applied on the ps
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from distribute import _marks, _torch, context
from distribute._enums import VariableAggregation
from distribute.errors import InvalidArgumentError
from distribute.partitioners import shard_sizes
from distribute.ps import _runtime

__all__ = ["ParameterServerVariable", "ShardedVariable", "VarHandle"]


@dataclass(frozen=True)
class VarHandle:
    """Where a variable lives: its id and ps task, and what it is."""

    var_id: int
    task: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool
    aggregation: VariableAggregation


@_marks.parameter_server_class  # the optimizer hooks leave it to the ps
class ParameterServerVariable(torch.nn.Parameter):
    """A variable stored on a ps task; this tensor is the local copy.

    Inside a closure on a worker, ops read the copy refreshed at the closure's
    start; `assign*` are applied on the ps (and returned). On the chief, the copy is
    refreshed by `ClusterCoordinator.join()`, and `read_value()` always asks the ps.

    Example::

        with strategy.scope():
            counter = ds.Variable(0, aggregation=ds.VariableAggregation.SUM)
        coordinator.schedule(lambda: counter.assign_add(1))
    """

    _ds_handle: VarHandle

    @staticmethod
    def _make(value: torch.Tensor, handle: VarHandle) -> ParameterServerVariable:
        var = ParameterServerVariable(value.detach().clone(), requires_grad=handle.trainable)
        var._ds_handle = handle
        return var

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True) -> ParameterServerVariable:
        return super().__new__(cls, data, requires_grad)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_rebuild_variable, (self._ds_handle,))

    def __deepcopy__(self, memo: dict[int, Any]) -> ParameterServerVariable:
        return self  # one variable, wherever it is referred to

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Ops see the local copy; an in-place write outside a closure (the chief's
        `load_state_dict`, a checkpoint's restore) goes on to the ps as well."""
        with _torch.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        target = args[0] if args else None
        if (
            isinstance(target, ParameterServerVariable)
            and _marks.is_published(target)
            and _writes_in_place(func)
            and _runtime.current().writes_through()
        ):
            target._send_local_value()
        return result

    def _send_local_value(self) -> None:
        value = self.detach().as_subclass(torch.Tensor).clone()
        _runtime.current().ps_call(
            self._ds_handle.task, _runtime.ps_write, self._ds_handle.var_id, "assign", value
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # narrower than Tensor.__repr__
        h = self._ds_handle
        return f"ParameterServerVariable(id={h.var_id}, on={h.task}, shape={list(h.shape)})"

    @property
    def handle(self) -> VarHandle:
        """Where this variable lives."""
        return self._ds_handle

    @property
    def aggregation(self) -> VariableAggregation:
        return self._ds_handle.aggregation

    def read_value(self) -> torch.Tensor:
        """The ps's current value (the local copy is updated too)."""
        (value,) = _runtime.current().ps_call(
            self._ds_handle.task, _runtime.ps_read, [self.handle.var_id]
        )
        with torch.no_grad():
            torch.Tensor.copy_(self.as_subclass(torch.Tensor), value)
        assert isinstance(value, torch.Tensor)
        return value

    def _write(self, kind: str, value: Any) -> torch.Tensor:
        tensor = torch.as_tensor(value, dtype=self.dtype).detach().cpu()
        replica = context.get_replica_context()
        replicas = replica.num_replicas_in_sync if replica else 1
        if replicas > 1:  # several local replicas (compat.v1): follow the aggregation
            aggregation = self._ds_handle.aggregation
            if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
                if replica is not None and replica.local_replica_id != 0:
                    return self.detach().as_subclass(torch.Tensor).clone()
            elif aggregation is VariableAggregation.MEAN:
                if kind == "assign":
                    raise InvalidArgumentError(
                        "assign of a MEAN variable in replica context: use assign_add or "
                        "assign_sub (each replica's share is added), or ONLY_FIRST_REPLICA"
                    )
                tensor = tensor / replicas
            elif aggregation is VariableAggregation.NONE and kind == "assign":
                raise InvalidArgumentError(
                    f"{replicas} replicas would each assign this variable (aggregation NONE); "
                    "give it aggregation=ONLY_FIRST_REPLICA, SUM or MEAN"
                )
        new = _runtime.current().ps_call(
            self._ds_handle.task, _runtime.ps_write, self._ds_handle.var_id, kind, tensor
        )
        with torch.no_grad():
            torch.Tensor.copy_(self.as_subclass(torch.Tensor), new)
        assert isinstance(new, torch.Tensor)
        return new

    def assign(self, value: Any) -> torch.Tensor:
        """Writes `value` on the ps; returns the new value."""
        return self._write("assign", value)

    def assign_add(self, value: Any) -> torch.Tensor:
        """Adds `value` on the ps (atomically: concurrent closures all count)."""
        return self._write("assign_add", value)

    def assign_sub(self, value: Any) -> torch.Tensor:
        """Subtracts `value` on the ps."""
        return self._write("assign_sub", value)


def _writes_in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name.startswith("__"):
        return name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")
    return name.endswith("_")


def _rebuild_variable(handle: VarHandle) -> ParameterServerVariable:
    """A variable unpickled in a task: that task's one local copy of it."""
    runtime = _runtime.current()
    _runtime.note_variable(handle.var_id)
    local = runtime.variables.get(handle.var_id)
    if local is None:
        local = ParameterServerVariable._make(torch.zeros(handle.shape, dtype=handle.dtype), handle)
        _marks.mark_published(local)  # it lives on its ps
        runtime.variables[handle.var_id] = local
        runtime.locations[handle.var_id] = handle.task
    assert isinstance(local, ParameterServerVariable)
    return local


@_marks.parameter_server_class
class ShardedVariable(torch.Tensor):
    """A variable split along dim 0 into shards on several ps tasks.

    It reads, assigns and indexes like one tensor; `torch.nn.functional.embedding`
    (an `nn.Embedding` built in scope) fetches only the looked-up rows from each
    shard, and their gradients go back as rows.

    Example::

        strategy = ds.ParameterServerStrategy(
            resolver, variable_partitioner=ds.experimental.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            table = torch.nn.Embedding(1000, 16)       # table.weight is a ShardedVariable
        [v.shape[0] for v in table.weight.variables]    # [500, 500]
    """

    _ds_shards: tuple[ParameterServerVariable, ...]
    _ds_lock: threading.Lock
    _ds_reads: list[tuple[torch.Tensor | None, torch.Tensor]]

    @staticmethod
    def __new__(cls, shards: Sequence[ParameterServerVariable]) -> ShardedVariable:
        first = shards[0]
        rows = sum(s.shape[0] for s in shards)
        shape = (rows, *first.shape[1:])
        self: ShardedVariable = _torch.make_wrapper_subclass(
            cls, shape, dtype=first.dtype, requires_grad=first.requires_grad
        )
        self._ds_shards = tuple(shards)
        self._ds_lock = threading.Lock()
        self._ds_reads = []
        return self

    def __init__(self, shards: Sequence[ParameterServerVariable]) -> None:
        pass

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_rebuild_sharded, (tuple(s.handle for s in self._ds_shards),))

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedVariable:
        return self

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # narrower than Tensor.__repr__
        sizes = [s.shape[0] for s in self._ds_shards]
        return f"ShardedVariable(shape={list(self.shape)}, shards={sizes})"

    @property
    def variables(self) -> tuple[ParameterServerVariable, ...]:
        """The shards, in row order."""
        return self._ds_shards

    def _offsets(self) -> list[int]:
        return list(itertools.accumulate([0, *(s.shape[0] for s in self._ds_shards)]))

    def read_value(self) -> torch.Tensor:
        """The whole variable, read from every shard's ps."""
        return self._fetch_all().detach()

    def assign(self, value: Any) -> ShardedVariable:
        """Writes `value` (the full shape) into the shards."""
        tensor = torch.as_tensor(value, dtype=self.dtype)
        if tuple(tensor.shape) != tuple(self.shape):
            raise InvalidArgumentError(
                f"assign of shape {tuple(tensor.shape)} to a ShardedVariable of shape "
                f"{tuple(self.shape)}; assign a value of the variable's full shape"
            )
        offsets = self._offsets()
        for shard, lo, hi in zip(self._ds_shards, offsets, offsets[1:]):
            shard.assign(tensor[lo:hi])
        return self

    def _fetch_all(self) -> torch.Tensor:
        runtime = _runtime.current()
        runtime.refresh([s.handle.var_id for s in self._ds_shards])
        return torch.cat([s.detach().as_subclass(torch.Tensor) for s in self._ds_shards])

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows `ids` as a leaf tensor, fetched shard by shard (rows only)."""
        runtime = _runtime.current()
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        offsets = self._offsets()
        parts = []
        for shard, lo, hi in zip(self._ds_shards, offsets, offsets[1:]):
            mine = unique[(unique >= lo) & (unique < hi)]
            if mine.numel():
                parts.append(
                    runtime.ps_call(
                        shard.handle.task, _runtime.ps_read_rows, shard.handle.var_id, mine - lo
                    )
                )
        rows = torch.cat(parts).requires_grad_(self.requires_grad and torch.is_grad_enabled())
        if rows.requires_grad:
            with self._ds_lock:
                self._ds_reads.append((unique, rows))
        return rows[inverse].reshape(*ids.shape, *self.shape[1:])

    def _take_gradients(self) -> dict[int, Any]:
        """Per shard id: a dense gradient, or (rows, row gradients), of the reads
        since the last step (then forgotten)."""
        with self._ds_lock:
            reads, self._ds_reads = self._ds_reads, []
        offsets = self._offsets()
        out: dict[int, Any] = {}
        for ids, leaf in reads:
            if leaf.grad is None:
                continue
            grad = leaf.grad
            if ids is None:  # a whole read
                for shard, lo, hi in zip(self._ds_shards, offsets, offsets[1:]):
                    _add_dense(out, shard.handle.var_id, grad[lo:hi])
                continue
            for shard, lo, hi in zip(self._ds_shards, offsets, offsets[1:]):
                mask = (ids >= lo) & (ids < hi)
                if bool(mask.any()):
                    _add_rows(out, shard.handle.var_id, ids[mask] - lo, grad[mask])
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.embedding:
            ids, weight = args[0], args[1]
            options = dict(
                zip(("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq"), args[2:])
            )
            options.update(kwargs)
            plain = (
                options.get("padding_idx") is None
                and options.get("max_norm") is None
                and not options.get("scale_grad_by_freq")
            )
            if (
                plain
                and isinstance(weight, ShardedVariable)
                and not isinstance(ids, ShardedVariable)
                and _marks.pending(weight) is None
            ):
                return weight._lookup(ids)
            # padding_idx, max_norm and scale_grad_by_freq shape the gradient (or the
            # rows, in place): they take the whole variable, read below.
        if func in (torch.Tensor.__repr__, torch.Tensor.__format__):
            return func(*args, **kwargs)

        def whole(x: Any) -> Any:
            if not isinstance(x, ShardedVariable):
                return x
            pending = _marks.pending(x)
            if pending is not None:  # created in scope, not yet on the ps (initializing)
                return pending
            value = x._fetch_all().requires_grad_(x.requires_grad and torch.is_grad_enabled())
            if value.requires_grad:
                with x._ds_lock:
                    x._ds_reads.append((None, value))
            return value

        with _torch.DisableTorchFunctionSubclass():
            return func(*_torch.tree_map(whole, args), **_torch.tree_map(whole, kwargs))

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's stub omits func
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        """Ops below autograd (a detach, a copy) see the whole value."""

        def whole(x: Any) -> Any:
            if not isinstance(x, ShardedVariable):
                return x
            pending = _marks.pending(x)
            return pending if pending is not None else x._fetch_all()

        return func(*_torch.tree_map(whole, args), **_torch.tree_map(whole, kwargs or {}))


def _add_dense(out: dict[int, Any], var_id: int, grad: torch.Tensor) -> None:
    rows = torch.arange(grad.shape[0])
    _add_rows(out, var_id, rows, grad)


def _add_rows(out: dict[int, Any], var_id: int, rows: torch.Tensor, grad: torch.Tensor) -> None:
    if var_id in out:
        old_rows, old_grad = out[var_id]
        out[var_id] = (torch.cat([old_rows, rows]), torch.cat([old_grad, grad]))
    else:
        out[var_id] = (rows, grad.detach())


def _rebuild_sharded(handles: tuple[VarHandle, ...]) -> ShardedVariable:
    runtime = _runtime.current()
    key = tuple(h.var_id for h in handles)
    existing = runtime.sharded.get(key)
    if existing is None:
        existing = ShardedVariable([_rebuild_variable(h) for h in handles])
        runtime.add_sharded(key, existing)
    assert isinstance(existing, ShardedVariable)
    return existing


def split_rows(value: torch.Tensor, shards: int) -> list[torch.Tensor]:
    """`value` cut along dim 0 by the div rule."""
    return list(torch.split(value, shard_sizes(value.shape[0], shards)))


# -- the optimizer step (NOTE [ps updates]) -----------------------------------------------


def _push_gradients(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    groups = optimizer.param_groups
    if not any(
        isinstance(p, (ParameterServerVariable, ShardedVariable))
        for g in groups
        for p in g["params"]
    ):
        return
    replica = context.get_replica_context()
    if replica is not None and replica.num_replicas_in_sync > 1:
        # Local replicas share each variable's copy, so its gradient already holds
        # their sum once all have arrived: one of them sends it, once.
        replica.merge_call(lambda strategy: _send_gradients(optimizer))
        return
    _send_gradients(optimizer)


def _send_gradients(optimizer: torch.optim.Optimizer) -> None:
    runtime = _runtime.current()
    dense: dict[str, dict[int, torch.Tensor]] = {}
    sparse: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, ShardedVariable):
                tasks = {shard.handle.var_id: shard.handle.task for shard in p.variables}
                for var_id, rows in p._take_gradients().items():
                    sparse.setdefault(tasks[var_id], {})[var_id] = rows
            elif isinstance(p, ParameterServerVariable) and p.grad is not None:
                dense.setdefault(p.handle.task, {})[p.handle.var_id] = p.grad.detach()
                p.grad = None  # the local step finds nothing to apply
    futures = [
        (
            task,
            runtime.transport.call(
                task,
                _runtime.ps_apply,
                (key, type(optimizer), groups, dense.get(task, {}), sparse.get(task, {})),
                runtime.timeout,
            ),
        )
        for task, (key, groups) in ps_optimizers(optimizer).items()
    ]
    for task, future in futures:
        try:
            future.wait()
        except RuntimeError as e:
            if _runtime._is_remote_user_error(e):
                raise
            raise runtime.unavailable(task, e) from None


def ps_optimizers(
    optimizer: torch.optim.Optimizer,
) -> dict[str, tuple[tuple[Any, ...], list[dict[str, Any]]]]:
    """Where `optimizer` lives on the ps tasks: for each ps holding some of its
    variables, the key of its optimizer there and its param groups (the current
    hyperparameters, with variable ids for params)."""
    per_task: dict[str, list[dict[str, Any]]] = {}
    for index, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            shards = p.variables if isinstance(p, ShardedVariable) else [p]
            for shard in shards:
                if isinstance(shard, ParameterServerVariable):
                    task_groups = per_task.setdefault(shard.handle.task, [])
                    _group_for(task_groups, index, hyper)["params"].append(shard.handle.var_id)
    base = (type(optimizer).__module__, type(optimizer).__qualname__)
    placed = {}
    for task, indexed in per_task.items():
        groups = [{k: v for k, v in g.items() if k != "_index"} for g in indexed]
        placed[task] = ((*base, tuple(tuple(g["params"]) for g in groups)), groups)
    return placed


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with the state its ps tasks keep (a checkpoint's):
    a sharded variable's entry is ``{"shards": [state of each shard]}``."""
    runtime = _runtime.current()
    by_id: dict[int, dict[str, Any]] = {}
    for task, (key, _) in ps_optimizers(optimizer).items():
        by_id.update(runtime.ps_call(task, _runtime.ps_optimizer_state, key))
    saved = optimizer.state_dict()  # hyperparameters, and any local param's state
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, p in enumerate(params):
        if isinstance(p, ShardedVariable):
            shards = [by_id.get(s.handle.var_id, {}) for s in p.variables]
            if any(shards):
                saved["state"][index] = {"shards": shards}
        elif isinstance(p, ParameterServerVariable) and p.handle.var_id in by_id:
            saved["state"][index] = by_id[p.handle.var_id]
    return saved


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Puts `optimizer_state`'s result back: hyperparameters and local params' state
    here, the ps variables' state on their ps.

    Raises:
        InvalidArgumentError: a variable saved sharded is not now, or is sharded
            differently (or the other way round).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    on_ps = (ParameterServerVariable, ShardedVariable)
    local = {i: e for i, e in saved["state"].items() if not isinstance(params[int(i)], on_ps)}
    optimizer.load_state_dict({**saved, "state": local})
    by_id: dict[int, dict[str, Any]] = {}
    for index, entry in saved["state"].items():
        p = params[int(index)]
        was_sharded = isinstance(entry, dict) and "shards" in entry
        if isinstance(p, ShardedVariable):
            if not was_sharded or len(entry["shards"]) != len(p.variables):
                saved_as = f"{len(entry['shards'])} shards" if was_sharded else "one variable"
                raise InvalidArgumentError(
                    f"the optimizer's parameter {index} was saved as {saved_as} but is now "
                    f"{len(p.variables)} shards: restore with the variable_partitioner it "
                    "was saved with"
                )
            for shard, shard_state in zip(p.variables, entry["shards"]):
                if shard_state:
                    by_id[shard.handle.var_id] = shard_state
        elif isinstance(p, ParameterServerVariable):
            if was_sharded:
                raise InvalidArgumentError(
                    f"the optimizer's parameter {index} was saved as "
                    f"{len(entry['shards'])} shards but is now one variable: restore with "
                    "the variable_partitioner it was saved with"
                )
            by_id[p.handle.var_id] = entry
    runtime = _runtime.current()
    for task, (key, groups) in ps_optimizers(optimizer).items():
        mine = {i: s for g in groups for i in g["params"] if (s := by_id.get(i)) is not None}
        runtime.ps_call(task, _runtime.ps_load_optimizer_state, key, type(optimizer), groups, mine)


def is_ps_optimizer(obj: Any) -> bool:
    """Whether `obj` is an optimizer of parameter-server variables."""
    return isinstance(obj, torch.optim.Optimizer) and any(
        isinstance(p, (ParameterServerVariable, ShardedVariable))
        for g in obj.param_groups
        for p in g["params"]
    )


def _group_for(groups: list[dict[str, Any]], index: int, hyper: dict[str, Any]) -> dict[str, Any]:
    for g in groups:
        if g.get("_index") == index:
            return g
    group = {**hyper, "params": [], "_index": index}
    groups.append(group)
    return group


_push_handles: list[RemovableHandle] = []
_push_lock = threading.Lock()


def install_gradient_push() -> None:
    """Installs the global optimizer pre-hook that sends parameter-server variables'
    gradients to their ps tasks (idempotent). A parameter-server strategy installs it
    when it is built, never at import."""
    with _push_lock:
        if not _push_handles:
            _push_handles.append(register_optimizer_step_pre_hook(_push_gradients))
