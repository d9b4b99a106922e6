"""The `StepHandler` of `FullyShardedStrategy`: FSDP has summed the gradients already.

FSDP2 reduce-scatters each unit's gradients during backward (summed over the workers:
NOTE [sharding] in strategies/_sharding.py), so at `optimizer.step()` every worker
holds the summed gradient of its shards and steps its shards: there is nothing left
to combine. What the handler still refuses is a step inside `no_sync()`, whose
backward passes reduced nothing (the shards' gradients are still None, so the step
would silently skip them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from distribute.errors import ContextError

if TYPE_CHECKING:
    from torch.optim import Optimizer

__all__ = ["ShardedStepHandler"]


class ShardedStepHandler:
    """Steps shards whose gradients FSDP has already summed.

    Args:
        in_no_sync: whether the strategy is inside `no_sync()` now.
    """

    def __init__(self, in_no_sync: Any) -> None:
        self._in_no_sync = in_no_sync

    def sum_gradients(self, optimizer: Optimizer, variables: Sequence[Any], local: int) -> None:
        """Nothing to combine: backward reduce-scattered every gradient."""

    def before_step(
        self, optimizer: Optimizer, variables: Sequence[Any], local: int, *, summed: bool
    ) -> None:
        if self._in_no_sync():
            raise ContextError(
                "optimizer.step() was called inside strategy.extended.no_sync(): the backward "
                "passes there kept their gradients whole and unreduced, so the shards have "
                "none to step with. Run the last backward pass of the accumulation outside "
                "no_sync(), then step"
            )

    def after_step(self, optimizer: Optimizer, variables: Sequence[Any], local: int) -> None:
        """Nothing to finish."""

    def check_step_outside_run(self, optimizer: Optimizer, variables: Sequence[Any]) -> None:
        """A step outside `run` is exact too: the gradients were summed in backward."""

    def steps_quietly(self, optimizer: Optimizer) -> bool:
        """Never: each step gathers or reshards."""
        return False

    def hides_gradients(self) -> bool:
        """Never: each worker steps its own shards."""
        return False

    def close(self) -> None:
        """Holds nothing."""
