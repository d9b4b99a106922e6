"""What a checkpoint stores of each kind of object, and how it is put back.

Every value is *logical*: a `MirroredVariable` is its one value (not one per
replica), a `SyncOnReadVariable` its aggregate, an optimizer's per-replica state
replica 0's (every replica's is the same: they apply identical updates). Writing
back goes through each variable's cross-replica ``assign``, which sets every
replica's copy on every worker.

Per-worker values (RNG state, the input position) are kept per rank: they
differ between workers and mean nothing to another worker.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from distribute._enums import VariableAggregation, VariableSynchronization
from distribute.errors import InvalidArgumentError
from distribute.variables import DistributedVariable

__all__ = ["RNGState", "apply_state", "capture_state", "direct_targets", "is_per_worker"]


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
    obj.load_state_dict(state)
    return obj


def direct_targets(
    name: str, obj: Any, skeleton: Any, wanted: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The live tensors of module ``obj`` that a checkpoint can be read straight into.

    A mirrored variable's primary copy (the others follow from it before the
    next `run`, as after any cross-replica write) and plain parameters and
    buffers, where shape and dtype match; the read then needs no copy through a
    temporary tensor. A sync-on-read variable needs `assign` (it divides a sum
    between its copies), so it is not among them.
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


def _written_through(target: torch.Tensor) -> None:
    """A parameter-server variable read straight into its local copy: its ps gets
    the value too (a write through `copy_` goes there by itself)."""
    send = getattr(target, "_send_local_value", None)
    if send is not None and getattr(target, "_ds_published", False):
        send()


def _write_sum(target: DistributedVariable, value: torch.Tensor) -> None:
    """A sync-on-read SUM variable: the whole value in the first replica of the first
    worker, zeros elsewhere. (``assign`` divides it between the replicas, which loses
    an integer's remainder: 7 over 2 replicas would read back as 6.)"""
    first_worker = getattr(target._ds_strategy.extended, "_worker_index", 0) == 0
    with torch.no_grad():
        for replica, component in enumerate(target.values):
            if replica == 0 and first_worker:
                component.copy_(value)
            else:
                component.zero_()
