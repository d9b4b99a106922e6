"""The parts a replicated engine is built from (docs/architecture.md, "Composing the
engine").

`ReplicatedExtended` keeps the local replicas, `run`, the collectives among replicas,
placement and the variables' lifecycle. What differs between the synchronous, the
sharded and the parameter-server strategies is passed to its constructor whole, so
that no strategy subclasses the engine or overrides its internals, and every engine is
complete when its constructor returns:

* `Workers`: this process's place among the strategy's workers and their collectives
  (None: one worker);
* a step handler, made from the engine's `gradients.base.ReplicaGroup` (default: the
  synchronous one);
* `ModuleCapture`: what the scope makes of the parameters and submodules that modules
  register (default: the strategy's mirrored variables);
* `VariableHome`: what a variable created in the scope is and where it lives
  (default: a mirrored variable on the replica devices);
* `ScopeLifecycle`: what happens when the outermost scope is entered and left, before
  each `run`, and inside `no_sync()` (default: nothing more).

`_sharding.ShardedModules` is the sharded strategy's capture and lifecycle;
`_ps_engine.ParameterServerVariables` is the parameter-server strategies' home and
lifecycle; `tpu._GspmdLayout` is TPUStrategy's (with a layout map) capture and
lifecycle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from distribute._enums import VariableSpec

if TYPE_CHECKING:
    from distribute.collectives.base import CrossWorker
    from distribute.gradients.base import ReplicaGroup, StepHandler
    from distribute.variables import DistributedVariable

__all__ = ["ModuleCapture", "ScopeLifecycle", "StepHandlerFactory", "VariableHome", "Workers"]

#: Makes a strategy's step handler from its engine's replicas.
StepHandlerFactory = Callable[["ReplicaGroup"], "StepHandler"]


@dataclass(frozen=True)
class Workers:
    """This process's place among a strategy's workers, and their collectives.

    Example::

        Workers(index=rank, count=world_size, collectives=process_group_collectives)
    """

    index: int
    count: int
    collectives: CrossWorker


class ModuleCapture(Protocol):
    """What a scope makes of the parameters and submodules modules register in it."""

    def captures(self, module: torch.nn.Module, tensor: torch.Tensor) -> bool:
        """Whether a parameter or buffer ``module`` registers is the strategy's to capture."""
        ...

    def capture_parameter(
        self, module: torch.nn.Module, name: str, param: torch.nn.Parameter
    ) -> torch.nn.Parameter | None:
        """What the parameter becomes (None: it stays as it is)."""
        ...

    def capture_buffer(
        self, module: torch.nn.Module, name: str, buffer: torch.Tensor
    ) -> torch.Tensor | None:
        """What the buffer becomes (None: it stays as it is); `default_capture_buffer`
        gives the strategy's mirrored variable."""
        ...

    def capture_submodule(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        """``child`` was attached to ``parent`` in the scope."""
        ...


class VariableHome(Protocol):
    """What a variable created in the scope is, and where it lives."""

    @property
    def parameter_devices(self) -> tuple[torch.device, ...]:
        """The devices holding this worker's variable copies."""
        ...

    def create_variable(self, value: torch.Tensor, spec: VariableSpec) -> Any:
        """The strategy's variable holding ``value`` (or ``value`` itself, kept as it is)."""
        ...

    def colocate_vars_with(self, variable: Any) -> contextlib.AbstractContextManager[None]:
        """A block in which new variables live where ``variable`` does."""
        ...

    def owns(self, variable: Any) -> bool:
        """Whether ``variable`` was created in this strategy's scope."""
        ...


class ScopeLifecycle(Protocol):
    """What a strategy does as its scope is entered and left, and around `run`."""

    def scope_entered(self) -> None:
        """The outermost scope was entered."""
        ...

    def scope_leaving(self) -> None:
        """The outermost scope is being left (before the engine places its variables)."""
        ...

    def scope_left(self) -> None:
        """The outermost scope was left (the engine has placed and broadcast its
        variables and popped the scope)."""
        ...

    def before_run(self) -> None:
        """`run` begins (before the engine places and broadcasts pending variables)."""
        ...

    def placed(self, variables: list[DistributedVariable]) -> None:
        """The variables the engine registered since the last call, now placed and
        holding the chief's values: called when the outermost scope has been left
        (before `scope_left`) and when `run` has prepared its variables, with an
        empty list when there are none."""
        ...

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Entered with the engine's `no_sync()`."""
        ...
