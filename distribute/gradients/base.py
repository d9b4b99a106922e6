"""The two small interfaces of the gradient layer.

A strategy decides what `optimizer.step()` means for its variables by providing a
`StepHandler` (``strategy.extended.step_handler``). The optimizer hooks
(`distribute.gradients._hooks`) check the step (see NOTE [refused steps]) and then
call the running strategy's handler in every local replica. A synchronous handler
sums gradients with a `GradientSum`; a parameter-server handler would send them
to the ps tasks instead; an XLA handler would reduce them in the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch.optim import Optimizer

    from distribute.collectives.base import CrossWorker
    from distribute.variables import DistributedVariable

__all__ = ["GradientSum", "ReplicaGroup", "RunningStrategy", "StepHandler"]


class RunningStrategy(Protocol):
    """A strategy as the optimizer hooks see it: its size and its handler's owner."""

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def extended(self) -> Any: ...


class ReplicaGroup(Protocol):
    """What the synchronous handler and the in-process sum need of a replicated
    strategy's engine (`strategies._replicated.ReplicatedExtended` provides one): its
    local replicas, their meeting point, the workers, and the switches users set.

    The gradient layer names no strategy class and reads no engine attribute: new
    strategies plug in by providing this, or a `StepHandler` of their own. Nothing
    here is written by the gradient layer.
    """

    @property
    def strategy(self) -> Any:
        """The strategy the replicas belong to."""
        ...

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """This worker's replica devices, in local replica order."""
        ...

    @property
    def central_storage(self) -> bool:
        """Whether the replicas share one copy of each variable (replica 0 updates it)."""
        ...

    @property
    def cross_worker(self) -> CrossWorker | None:
        """The collectives joining the workers; None with one worker."""
        ...

    @property
    def num_workers(self) -> int: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def bytes_per_pack(self) -> int:
        """How many bytes of gradients go in one collective (0: one pack)."""
        ...

    @property
    def syncing(self) -> bool:
        """False inside the engine's `no_sync()`: gradients accumulate locally."""
        ...

    @property
    def layout_generation(self) -> int:
        """Changes when a variable's shape or dtype changes (sums laid out for the
        old ones are rebuilt)."""
        ...

    @property
    def captures_modules(self) -> bool:
        """Whether the scope makes module parameters the strategy's variables."""
        ...

    @property
    def aggregate_gradients(self) -> bool:
        """`experimental_aggregate_gradients`: False leaves gradients unsummed."""
        ...

    def exchange(
        self, local: int, kind: str, payload: Any, combine: Callable[[list[Any]], Any]
    ) -> Any:
        """Runs ``combine`` once over every local replica's ``payload`` (all replicas
        wait for it) and gives each replica the result."""
        ...


class StepHandler(Protocol):
    """What a strategy does with gradients when `optimizer.step()` runs inside its `run`.

    Every method is called in every local replica's thread, with that replica's
    local id, and with this strategy's variables among the optimizer's
    parameters (never empty; the hooks have already refused plain parameters and
    other strategies' variables where those would give wrong numbers).

    Example::

        class SumThenStep:             # a new strategy's handler (see synchronous.py)
            def sum_gradients(self, optimizer, variables, local):
                ...                    # every replica's .grad becomes the sum
            # ... and the Protocol's other methods, each called in every replica's thread
    """

    def sum_gradients(
        self, optimizer: Optimizer, variables: Sequence[DistributedVariable], local: int
    ) -> None:
        """Combines every replica's gradients now, before the step.

        For code that must see the combined gradients before `optimizer.step()`
        (`distribute.GradScaler.unscale_` checks them for infinities); the step
        that follows then does not combine them again.
        """
        ...

    def before_step(
        self,
        optimizer: Optimizer,
        variables: Sequence[DistributedVariable],
        local: int,
        *,
        summed: bool,
    ) -> None:
        """Prepares the update (``summed``: `sum_gradients` already ran this step)."""
        ...

    def after_step(
        self, optimizer: Optimizer, variables: Sequence[DistributedVariable], local: int
    ) -> None:
        """Finishes the update (e.g. waits until a shared copy is written)."""
        ...

    def steps_quietly(self, optimizer: Optimizer) -> bool:
        """Whether `before_step` and `after_step` would do nothing for ``optimizer``'s
        steps for as long as its parameters stay the same (one replica in sync): the
        hooks then skip them (NOTE [quiet steps] in `_hooks.py`)."""
        ...

    def check_step_outside_run(
        self, optimizer: Optimizer, variables: Sequence[DistributedVariable]
    ) -> None:
        """Raises if `optimizer.step()` outside `run` would give wrong numbers for
        ``variables`` (this strategy's, among the optimizer's parameters)."""
        ...

    def hides_gradients(self) -> bool:
        """Whether the optimizer step running in this thread is to find no gradients
        (central storage: replica 0 alone updates the one shared copy; the others'
        variables read ``grad`` as None during the step)."""
        ...

    def close(self) -> None:
        """Releases hooks and buffers (the strategy shuts down)."""
        ...


class GradientSum(Protocol):
    """Sums one optimizer's gradients over every replica of every worker.

    After `sum(local)` each local replica's ``.grad`` of every variable is the sum
    over all replicas; a variable that no replica has a gradient for keeps
    ``grad = None``.

    Example::

        class LocalOnly:               # one process, replicas summed by hand
            def __init__(self, variables): self.variables = variables
            def sum(self, local): ...  # every local replica calls it; sum into .grad
            def close(self): ...       # release buffers when the optimizer goes away
    """

    def sum(self, local: int) -> None:
        """Called by every local replica at the step; returns when the sum is in `.grad`."""
        ...

    def close(self) -> None:
        """Releases hooks and buffers."""
        ...

    @property
    def stale(self) -> bool:
        """Whether it no longer fits its variables (one left out was unfrozen)."""
        ...
