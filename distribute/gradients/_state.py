"""Optimizer state kept per local replica.

With several local replicas every replica runs the same `optimizer.step()` on its
own copy of the variables, so momentum and Adam's moments must be per replica
too (each on its replica's device). `PerReplicaState` replaces the optimizer's
``state`` and resolves to the running replica's own dict.
"""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from distribute.variables import _local_replica

__all__ = ["PerReplicaState"]


class PerReplicaState(collections.defaultdict):  # type: ignore[type-arg]
    """An optimizer's `state`, one dict per local replica, chosen by the running replica.

    Cross-replica code (e.g. `optimizer.state_dict()`) sees replica 0's state.
    During a step that gives the optimizer plain tensors (NOTE [plain tensors at
    the step]), those tensors are keys for their variables' entries.
    """

    def __init__(
        self, existing: dict[Any, Any], strategy: Any, devices: Sequence[torch.device]
    ) -> None:
        super().__init__(dict)
        self._strategy = strategy
        self._keys = threading.local()
        self._replicas: list[collections.defaultdict[Any, Any]] = [
            collections.defaultdict(dict, existing)
        ]
        for device in devices[1:]:
            self._replicas.append(collections.defaultdict(dict, _clone_state(existing, device)))

    def _current(self) -> collections.defaultdict[Any, Any]:
        return self._replicas[_local_replica(self._strategy) or 0]

    def translate(self, mapping: dict[Any, Any] | None) -> None:
        """Makes this thread's lookups of ``mapping``'s keys reach their values' entries
        (None: stop)."""
        self._keys.mapping = mapping

    def _key(self, key: Any) -> Any:
        mapping = getattr(self._keys, "mapping", None)
        return mapping.get(key, key) if mapping else key

    def __getitem__(self, key: Any) -> Any:  # the optimizer's lookups: inlined, per step
        mapping = getattr(self._keys, "mapping", None)
        if mapping:
            key = mapping.get(key, key)
        return self._replicas[_local_replica(self._strategy) or 0][key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._current()[self._key(key)] = value

    def __delitem__(self, key: Any) -> None:
        del self._current()[self._key(key)]

    def __contains__(self, key: object) -> bool:
        return self._key(key) in self._current()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    def __bool__(self) -> bool:
        return bool(self._current())

    def keys(self) -> Any:
        return self._current().keys()

    def values(self) -> Any:
        return self._current().values()

    def items(self) -> Any:
        return self._current().items()

    def get(self, key: Any, default: Any = None) -> Any:
        return self._current().get(self._key(key), default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return self._current().setdefault(self._key(key), default)

    def pop(self, key: Any, *default: Any) -> Any:
        return self._current().pop(self._key(key), *default)

    def clear(self) -> None:
        self._current().clear()

    def __repr__(self) -> str:
        return repr(dict(self._current()))

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The thread-local key map cannot be copied; a copy is replica 0's state.
        return (dict, (dict(self._replicas[0]),))


def _clone_state(state: dict[Any, Any], device: torch.device) -> dict[Any, Any]:
    def clone(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to(device, copy=True)
        if isinstance(x, dict):
            return {k: clone(v) for k, v in x.items()}
        return copy.deepcopy(x)

    return {k: clone(v) for k, v in state.items()}
