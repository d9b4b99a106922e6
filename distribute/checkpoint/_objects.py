"""What a checkpoint stores of each kind of object, and how it is put back.

Every value is *logical*: a `MirroredVariable` is its one value (not one per
replica), a `SyncOnReadVariable` its aggregate, an optimizer's per-replica state
replica 0's (every replica's is the same: they apply identical updates). Writing
back goes through each variable's cross-replica ``assign``, which sets every
replica's copy on every worker.

Under `FullyShardedStrategy` a parameter is a DTensor holding this worker's shard,
and the optimizer's state of it too: their logical value is the DTensor's global
one (DCP writes each worker's shards of it), and restoring reads only this
worker's shard of it (`sharded_templates`; a whole value given later is split,
`_write_sharded` and `_sharded_state`).

Per-worker values (RNG state, the input position) are kept per rank: they
differ between workers and mean nothing to another worker.
"""

from __future__ import annotations

import random
import sys
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import torch

from distribute import _marks
from distribute._enums import VariableAggregation, VariableSynchronization
from distribute.errors import InvalidArgumentError
from distribute.variables import DistributedVariable

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "RNGState",
    "apply_state",
    "capture_state",
    "direct_targets",
    "is_per_worker",
    "sharded_templates",
    "strategy_of",
]


class RNGState:
    """The random number generators of this worker, for a `ds.Checkpoint`.

    Saves and restores torch's CPU generator, every CUDA device's generator,
    Python's `random` and NumPy's global generator, per worker, so that dropout and
    shuffling draw the same numbers after a resume as in an uninterrupted run.

    Example:
        >>> import distribute as ds
        >>> ckpt = ds.Checkpoint(rng=ds.RNGState())
    """

    def state_dict(self) -> dict[str, Any]:
        """The generators' states (tensors, and Python's state as numbers)."""
        version, internal, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "torch_cpu": torch.get_rng_state(),
            "python": [version, list(internal), gauss],
            "numpy": [kind, torch.from_numpy(np.asarray(keys).copy()), pos, has_gauss, cached],
        }
        if torch.cuda.is_available():
            state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Sets the generators to ``state`` (CUDA devices beyond those saved are left)."""
        torch.set_rng_state(state["torch_cpu"])
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
        cuda = state.get("torch_cuda")
        if cuda and torch.cuda.is_available():
            for device, generator in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(generator, device)


def strategy_of(value: Any) -> Any:
    """The strategy a tensor belongs to: a distributed variable's, or the strategy
    that manages it (`FullyShardedStrategy`'s shards, `_marks.managed_by`); None
    for a plain tensor."""
    if isinstance(value, DistributedVariable):
        return value._ds_strategy
    return _marks.managed_by(value)


def is_per_worker(obj: Any) -> bool:
    """Whether ``obj``'s state is this worker's own (RNG, the input position)."""
    from distribute.data._iterator import DistributedIterator

    return isinstance(obj, (RNGState, DistributedIterator))


def _logical(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DistributedVariable):
        return value._cross_replica_value().detach()
    if _on_parameter_servers(value):
        # the ps's value (the chief's copy is only as fresh as the last join), a
        # ShardedVariable's every shard
        return value.read_value()  # type: ignore[attr-defined, no-any-return]  # defined by both classes
    return value.detach()


def _is_sharded(value: Any) -> bool:
    from distribute.ps._variables import ShardedVariable

    return isinstance(value, ShardedVariable)


def _on_parameter_servers(value: Any) -> bool:
    from distribute.ps._variables import ParameterServerVariable, ShardedVariable

    return isinstance(value, (ParameterServerVariable, ShardedVariable))


def _is_ps_optimizer(obj: Any) -> bool:
    if not isinstance(obj, torch.optim.Optimizer):
        return False
    from distribute.ps._variables import is_ps_optimizer

    return is_ps_optimizer(obj)


def capture_state(name: str, obj: Any) -> Any:
    """The state of ``obj`` to store (a nest of tensors and plain values)."""
    if isinstance(obj, torch.nn.Module):
        return {k: _logical(v) for k, v in obj.state_dict(keep_vars=True).items()}
    if isinstance(obj, torch.Tensor):
        return _logical(obj)
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return obj
    if _is_ps_optimizer(obj):
        from distribute.ps._variables import optimizer_state

        return optimizer_state(obj)  # its state lives on the ps tasks
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict) and callable(getattr(obj, "load_state_dict", None)):
        return state_dict()
    raise InvalidArgumentError(
        f"ds.Checkpoint cannot save {name!r}, a {type(obj).__name__}: it takes modules, "
        "optimizers, distributed iterators, tensors, numbers, strings, ds.RNGState() and "
        "objects with state_dict() and load_state_dict()"
    )


def apply_state(name: str, obj: Any, state: Any) -> Any:
    """Puts ``state`` back into ``obj``; returns the object to keep (a new plain value)."""
    if isinstance(obj, torch.nn.Module):
        _load_module(name, obj, state)
        return obj
    if isinstance(obj, torch.Tensor):
        _write_tensor(name, obj, state)
        return obj
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return state
    if _is_ps_optimizer(obj):
        from distribute.ps._variables import load_optimizer_state

        load_optimizer_state(obj, state)
        return obj
    if isinstance(obj, torch.optim.Optimizer):
        state = _sharded_state(obj, state)
    obj.load_state_dict(state)
    return obj


def direct_targets(
    name: str, obj: Any, skeleton: Any, wanted: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The live tensors of module ``obj`` that a checkpoint can be read straight into.

    A mirrored variable's primary copy (the others follow from it before the
    next `run`, as after any cross-replica write), plain parameters and buffers,
    and `FullyShardedStrategy`'s DTensor parameters (DCP reads this worker's
    shard into them), where shape and dtype match; the read then needs no copy
    through a temporary tensor. A sync-on-read variable needs `assign` (it
    divides a sum between its copies), so it is not among them.
    """
    if not isinstance(obj, torch.nn.Module) or not isinstance(skeleton, dict):
        return {}
    direct: dict[str, torch.Tensor] = {}
    for key, target in obj.state_dict(keep_vars=True).items():
        entry = skeleton.get(key)
        if not isinstance(entry, dict) or "__tensor__" not in entry:
            continue
        template = wanted.get(entry["__tensor__"])
        if template is None or template.shape != target.shape or template.dtype != target.dtype:
            continue  # left to apply_state, which names the mismatch
        if _is_sharded(target):
            continue  # its shards live on the ps tasks: written by assign
        if isinstance(target, DistributedVariable):
            if target._ds_synchronization is VariableSynchronization.ON_READ:
                continue
            plain = target._plain_component(0)
        else:
            plain = target.detach()
        if plain.is_contiguous():
            direct[entry["__tensor__"]] = plain
    return direct


def sharded_templates(
    name: str, obj: Any, skeleton: Any, wanted: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Templates that read only this worker's shard of optimizer ``obj``'s state.

    Under `FullyShardedStrategy` a parameter is a DTensor, and so is the optimizer's
    state of it: each saved state tensor of the parameter's global shape gets an
    empty DTensor sharded like the parameter, so DCP reads this worker's chunk (a
    plain template would hold the whole value on every worker, and the optimizer
    would then mix plain tensors with DTensors). Scalars (Adam's ``step``) and
    tensors of other shapes keep plain templates. Saved parameters are matched to
    the optimizer's by position, as ``load_state_dict`` matches them.
    """
    if (
        not isinstance(obj, torch.optim.Optimizer)
        or _is_ps_optimizer(obj)
        or not isinstance(skeleton, dict)
    ):
        return {}
    from torch.distributed.tensor import empty as dtensor_empty

    params = _saved_parameters(obj, skeleton.get("param_groups"))
    sharded: dict[str, torch.Tensor] = {}
    for index, entries in _items(skeleton.get("state")):
        param = params.get(index)
        if not _is_dtensor(param) or not isinstance(entries, dict):
            continue
        for entry in entries.values():
            if not isinstance(entry, dict) or "__tensor__" not in entry:
                continue
            template = wanted.get(entry["__tensor__"])
            if template is not None and _shards_like(template, param):
                sharded[entry["__tensor__"]] = dtensor_empty(
                    param.shape,
                    dtype=template.dtype,
                    device_mesh=param.device_mesh,
                    placements=param.placements,
                )
    return sharded


def _is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor (`FullyShardedStrategy`'s parameters and their
    state), without importing DTensor where nothing has (none can exist then)."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _shards_like(value: torch.Tensor, param: DTensor) -> bool:
    """Whether optimizer state ``value`` is per element of ``param`` (its global shape)."""
    return value.dim() > 0 and tuple(value.shape) == tuple(param.shape)


def _items(skeleton: Any) -> list[tuple[Any, Any]]:
    """The (key, value) pairs of a flattened dict (`flatten` writes a dict with
    integer keys, such as an optimizer's state, as ``{"__dict__": [[k, v], ...]}``)."""
    if not isinstance(skeleton, dict):
        return []
    if "__dict__" in skeleton:
        items = skeleton["__dict__"]
        if not isinstance(items, list):
            return []
        return [(item[0], item[1]) for item in items if isinstance(item, list) and len(item) == 2]
    return list(skeleton.items())


def _saved_parameters(optimizer: torch.optim.Optimizer, groups: Any) -> dict[Any, Any]:
    """The optimizer's parameters by their saved index (``load_state_dict``'s pairing:
    the saved groups' ``params`` in order against the optimizer's); empty where the
    groups do not pair up (``load_state_dict`` then names the mismatch)."""
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        return {}
    pairs: dict[Any, Any] = {}
    for saved, group in zip(groups, optimizer.param_groups):
        indices = saved.get("params") if isinstance(saved, dict) else None
        if not isinstance(indices, list) or len(indices) != len(group["params"]):
            return {}
        pairs.update(zip(indices, group["params"]))
    return pairs


def _sharded_state(optimizer: torch.optim.Optimizer, state: Any) -> Any:
    """``state`` with each whole (plain) state tensor of a DTensor parameter replaced
    by this worker's shard of it, sharded like the parameter (a state restored
    before the optimizer was attached was read whole)."""
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        return state
    params = _saved_parameters(optimizer, state.get("param_groups"))
    per_parameter: dict[Any, Any] = {}
    for index, entries in state["state"].items():
        param = params.get(index)
        if _is_dtensor(param) and isinstance(entries, dict):
            entries = {
                key: _shard_of(value, param)
                if isinstance(value, torch.Tensor)
                and not _is_dtensor(value)
                and _shards_like(value, param)
                else value
                for key, value in entries.items()
            }
        per_parameter[index] = entries
    return {**state, "state": per_parameter}


def _shard_of(value: torch.Tensor, like: DTensor) -> DTensor:
    """This worker's shard of the whole tensor ``value``, placed as ``like`` (no
    communication: every worker holds ``value``)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        value.to(like.to_local().device),
        like.device_mesh,
        like.placements,
        src_data_rank=None,
    )


def _load_module(name: str, module: torch.nn.Module, state: dict[str, Any]) -> None:
    targets = module.state_dict(keep_vars=True)
    missing = sorted(set(targets) - set(state))
    unexpected = sorted(set(state) - set(targets))
    if missing or unexpected:
        raise InvalidArgumentError(
            f"the checkpoint's {name!r} does not fit the module: missing from the checkpoint "
            f"{missing or 'nothing'}, not in the module {unexpected or 'nothing'}; build the "
            "same model before restoring"
        )
    for key, target in targets.items():
        value = state[key]
        if isinstance(target, torch.Tensor):
            _write_tensor(f"{name}/{key}", target, value)
        else:  # `_extra_state`
            prefix, _, _ = key.rpartition(".")
            module.get_submodule(prefix).set_extra_state(value)


def _write_tensor(name: str, target: torch.Tensor, value: Any) -> None:
    if not isinstance(value, torch.Tensor) or value.shape != target.shape:
        found = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise InvalidArgumentError(
            f"the checkpoint's {name!r} has shape {found} but the object here has "
            f"{tuple(target.shape)}; build the same model before restoring"
        )
    if _is_sharded(target):
        target.assign(value)  # type: ignore[attr-defined]  # a ShardedVariable: shard by shard, on the ps
        return
    if _is_dtensor(target):
        _write_sharded(target, value)
        return
    primary = target._plain_component(0) if isinstance(target, DistributedVariable) else target
    if value.data_ptr() == primary.data_ptr() and value.numel():
        _written_through(target)
        return  # read straight into it (`direct_targets`)
    if isinstance(target, DistributedVariable):
        if (
            target._ds_synchronization is VariableSynchronization.ON_READ
            and target._ds_aggregation is VariableAggregation.SUM
        ):
            _write_sum(target, value)
        else:
            target.assign(value)
        return
    with torch.no_grad():
        target.copy_(value)


def _write_sharded(target: DTensor, value: torch.Tensor) -> None:
    """A DTensor (`FullyShardedStrategy`'s shard of a parameter): this worker's part
    of ``value`` goes into its shard, in place (FSDP gathers from that storage).

    A DTensor has no storage of its own (its ``data_ptr()`` is 0 for every one), so
    a value read straight into the target is recognized by its local tensor.
    """
    with torch.no_grad():
        local = target.to_local()
        if _is_dtensor(value):
            if value.to_local().data_ptr() == local.data_ptr():
                return  # read straight into it (`direct_targets`)
            if value.device_mesh != target.device_mesh or value.placements != target.placements:
                value = _shard_of(value.full_tensor(), target)
        else:
            value = _shard_of(value, target)
        local.copy_(value.to_local())


def _written_through(target: torch.Tensor) -> None:
    """A parameter-server variable read straight into its local copy: its ps gets
    the value too (a write through `copy_` goes there by itself)."""
    send = getattr(target, "_send_local_value", None)
    if send is not None and _marks.is_published(target):
        send()


def _write_sum(target: DistributedVariable, value: torch.Tensor) -> None:
    """A sync-on-read SUM variable: the whole value in the first replica of the first
    worker, zeros elsewhere. (``assign`` divides it between the replicas, which loses
    an integer's remainder: 7 over 2 replicas would read back as 6.)"""
    first_worker = target._ds_strategy.extended.worker_index == 0
    with torch.no_grad():
        for replica, component in enumerate(target.values):
            if replica == 0 and first_worker:
                component.copy_(value)
            else:
                component.zero_()
