"""The optimizer sees each replica's own plain tensors during that replica's step.

# NOTE [plain tensors at the step]
torch.optim picks its fast paths (``foreach``, the default on CUDA, and
``fused``) only for plain ``torch.Tensor`` / ``nn.Parameter`` objects, and groups
tensors by the device each reports. A `MirroredVariable` is a subclass whose
``device`` is replica 0's, while replica ``k``'s optimizer state lives on replica
``k``'s device: the optimizer silently takes its per-parameter loop on CUDA, and
an explicit ``foreach=True`` or ``fused=True`` raises "Tensors of the same index
must be on the same device". So, while replica ``k`` steps, the optimizer's
``param_groups`` hold copies of the groups whose ``params`` are replica ``k``'s
component tensors (a plain alias of the variable's own storage for replica 0,
given its gradient), and its ``state`` maps those tensors back to their
variables, so that the state is still keyed by the variables (``state_dict`` and
checkpoints see no difference). Outside the step, and in other threads,
``param_groups`` is the optimizer's own list. Hyper-parameters are read from the
original groups at each step, so schedulers keep working.

Used where it pays: replicas on GPUs, or an optimizer asking for
``foreach``/``fused``. Not on XLA devices by default: torch steps them per
parameter anyway, and an in-place update through replica 0's alias is not donated
to the parameter's buffer, so device 0 compiled a program of its own for every
input shape. On CPU replicas the default per-parameter loop
runs on the variables directly (torch's default there), with no extra work.

# NOTE [group state per replica]
Some optimizers keep state in their param groups, not per parameter: timm's and
pytorch_optimizer's Lamb and Adan count ``group["step"] += 1``. Replica threads
sharing the groups would count N steps per step (4 after 2 steps under 2
replicas: wrong bias corrections, copies drifting apart). So with several local
replicas each replica steps on its own copies of the groups, taken while every
replica waits at the start of the step (before replica 0 can change anything);
replica 0 steps on the optimizer's own groups, so `state_dict` and schedulers see
its values, and the others' copies are dropped after the step (they computed the
same). Where replica 0 too steps on copies (plain tensors, above), what its step
wrote is put back into the optimizer's groups.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from distribute.gradients._local_sum import _get_grad
from distribute.variables import DistributedVariable

__all__ = ["ReplicaParamGroups", "snapshot_groups", "with_plain_params", "write_back"]


class ReplicaParamGroups(list):  # type: ignore[type-arg]
    """An optimizer's ``param_groups`` that shows a replica thread its own groups
    while that replica steps (see NOTE [plain tensors at the step])."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        super().__init__(groups)
        self._local = threading.local()

    def _view(self) -> list[dict[str, Any]] | None:
        view: list[dict[str, Any]] | None = getattr(self._local, "groups", None)
        return view

    def begin(self, groups: list[dict[str, Any]]) -> None:
        """Shows ``groups`` to this thread until `end`."""
        self._local.groups = groups

    def end(self) -> None:
        self._local.groups = None

    def current(self) -> list[dict[str, Any]] | None:
        """The groups this thread sees since `begin`, or None."""
        return self._view()

    def originals(self) -> list[dict[str, Any]]:
        """The optimizer's own groups, whoever asks."""
        return list(super().__iter__())

    def __iter__(self) -> Any:
        view = self._view()
        return iter(view) if view is not None else super().__iter__()

    def __getitem__(self, index: Any) -> Any:
        view = self._view()
        return view[index] if view is not None else super().__getitem__(index)

    def __len__(self) -> int:
        view = self._view()
        return len(view) if view is not None else super().__len__()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (list, (self.originals(),))  # copies and pickles are plain lists


def snapshot_groups(
    groups: list[dict[str, Any]], num_local: int, plain: bool
) -> list[list[dict[str, Any]] | None]:
    """Each local replica's own copy of the optimizer's groups (NOTE [group state per
    replica]); None for replica 0 when it steps on the originals.

    Taken while every replica waits, before any steps. Tensors in a group (a
    capturable ``lr``, a group-level ``step``) are cloned for replicas 1..N-1, whose
    in-place updates must not reach the originals.
    """
    views: list[list[dict[str, Any]] | None] = []
    for local in range(num_local):
        if local == 0 and not plain:
            views.append(None)
            continue
        views.append(
            [
                {
                    key: value.clone() if local and isinstance(value, torch.Tensor) else value
                    for key, value in group.items()
                }
                for group in groups
            ]
        )
    return views


def write_back(originals: list[dict[str, Any]], view: list[dict[str, Any]]) -> None:
    """Keeps what replica 0's step wrote into its copies of the groups (a group-level
    ``step``) in the optimizer's own groups, so that `state_dict` has it."""
    for group, copy in zip(originals, view):
        for key, value in copy.items():
            if key != "params" and group.get(key, _MISSING) is not value:
                group[key] = value


_MISSING = object()


def with_plain_params(
    groups: list[dict[str, Any]], strategy: Any, local: int
) -> dict[torch.Tensor, DistributedVariable]:
    """Puts replica ``local``'s plain tensors in place of ``strategy``'s variables in
    ``groups`` (its own copies); returns the map from those tensors back to their
    variables."""
    mapping: dict[torch.Tensor, DistributedVariable] = {}
    for group in groups:
        params = []
        for p in group["params"]:
            if isinstance(p, DistributedVariable) and p._ds_strategy is strategy:
                if local:
                    plain = p._ds_components[local - 1]
                else:
                    plain = p._plain_component(0)
                    grad = _get_grad(p, 0)
                    if grad is not None:
                        plain.grad = grad
                mapping[plain] = p
                params.append(plain)
            else:
                params.append(p)
        group["params"] = params
    return mapping
