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

Used where it pays: replicas on a device other than the CPU, or an optimizer
asking for ``foreach``/``fused``. On CPU replicas the default per-parameter loop
runs on the variables directly (torch's default there), with no extra work.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from distribute.gradients._local_sum import _get_grad
from distribute.variables import DistributedVariable

__all__ = ["ReplicaParamGroups", "replica_groups"]


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


def replica_groups(
    groups: list[dict[str, Any]], strategy: Any, local: int
) -> tuple[list[dict[str, Any]], dict[torch.Tensor, DistributedVariable]]:
    """Copies of ``groups`` whose variables of ``strategy`` are replica ``local``'s
    plain tensors, and the map from those tensors back to their variables."""
    mapping: dict[torch.Tensor, DistributedVariable] = {}
    copies = []
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
        copies.append({**group, "params": params})
    return copies, mapping
