"""Marks the library puts on tensors it does not own the class of, read and written here alone.

# NOTE [tensor marks]
A few facts about a tensor must travel with the tensor itself, because the code that
needs them later gets only the tensor (an optimizer's parameter list, a checkpoint's
state dict), and the tensor's class is torch's (an FSDP shard, a DTensor) or a class of
a higher layer (a parameter-server variable, which the optimizer hooks below it must
recognize). Each such fact is an attribute on the tensor, named and typed here, with
one writer function and one reader function; no other module spells the attribute
(``tests/unit/test_marks.py`` checks it):

* managed by (`mark_managed` / `managed_by`): the strategy whose engine made the
  tensor (FSDP's shards, the model-parallel engine's DTensors and buffers): the step
  hooks take it as that strategy's own, checkpoints ask it for the strategy.
* sharded away (`mark_sharded_away` / `is_sharded_away`): a parameter FSDP replaced by
  its shards: a step over it is refused (it would train nothing).
* on a parameter server (`parameter_server_class` / `on_parameter_server`): a mark on
  the classes of the ps variables: their updates happen on the ps.
* published (`mark_published` / `is_published`): a ps variable's value is on its ps,
  so an in-place write to the local copy goes on to the ps.
* pending (`set_pending` / `pending` / `take_pending`): a sharded ps variable's whole
  initial value, kept on the chief until the shards are published.

Attributes on a tensor are the mechanism (torch's own FSDP keeps per-module state
behind typed functions, not on tensors, but these tensors belong to torch or to a higher
layer); the functions here are the only way in, so the mechanism can change in one
place.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

__all__ = [
    "is_published",
    "is_sharded_away",
    "managed_by",
    "mark_managed",
    "mark_published",
    "mark_sharded_away",
    "on_parameter_server",
    "parameter_server_class",
    "pending",
    "set_pending",
    "take_pending",
]

_T = TypeVar("_T", bound=type)

_ON_PARAMETER_SERVER = "_ds_on_parameter_server"
_MANAGED_BY = "_ds_managed_by"
_SHARDED_AWAY = "_ds_sharded_away"
_PUBLISHED = "_ds_published"
_PENDING = "_ds_pending"


def mark_managed(tensor: torch.Tensor, strategy: Any) -> None:
    """``tensor`` was made by ``strategy``'s engine (a shard, a DTensor, a buffer of a
    laid-out module): the step hooks and checkpoints take it as the strategy's own."""
    setattr(tensor, _MANAGED_BY, strategy)


def managed_by(tensor: Any) -> Any:
    """The strategy `mark_managed` named for ``tensor``; None for any other value."""
    return getattr(tensor, _MANAGED_BY, None)


def mark_sharded_away(tensor: torch.Tensor) -> None:
    """FSDP replaced the parameter ``tensor`` by its shards: a step over it is refused."""
    setattr(tensor, _SHARDED_AWAY, True)


def is_sharded_away(tensor: Any) -> bool:
    """Whether `mark_sharded_away` marked ``tensor``."""
    return bool(getattr(tensor, _SHARDED_AWAY, False))


def parameter_server_class(cls: _T) -> _T:
    """Class decorator: the instances of ``cls`` are parameter-server variables."""
    setattr(cls, _ON_PARAMETER_SERVER, True)
    return cls


def on_parameter_server(tensor: Any) -> bool:
    """Whether ``tensor`` is a parameter-server variable (its class is a
    `parameter_server_class`): its update happens on its ps, not in the optimizer hooks."""
    return bool(getattr(tensor, _ON_PARAMETER_SERVER, False))


def mark_published(tensor: torch.Tensor) -> None:
    """The ps variable ``tensor``'s value is on its ps: in-place writes go on there."""
    setattr(tensor, _PUBLISHED, True)


def is_published(tensor: Any) -> bool:
    """Whether `mark_published` marked ``tensor``."""
    return bool(getattr(tensor, _PUBLISHED, False))


def set_pending(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """``value`` is the whole initial value of the sharded ps variable ``tensor``, kept
    until its shards are published."""
    setattr(tensor, _PENDING, value)


def pending(tensor: Any) -> torch.Tensor | None:
    """The value `set_pending` kept for ``tensor``, or None (none, or taken)."""
    value = getattr(tensor, _PENDING, None)
    return value if isinstance(value, torch.Tensor) else None


def take_pending(tensor: torch.Tensor) -> torch.Tensor:
    """The value `set_pending` kept for ``tensor``, removed from it (its shards are being
    published).

    Raises:
        AttributeError: none was kept.
    """
    value: torch.Tensor = getattr(tensor, _PENDING)
    delattr(tensor, _PENDING)
    return value
