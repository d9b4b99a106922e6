"""The global optimizer step hooks: check the step, then call the strategy's handler.

# NOTE [refused steps]
`torch.optim` has no `apply_gradients` to override, so every optimizer in the
process runs these hooks. Inside a strategy's `run` they act only for optimizers
holding that strategy's variables (an unrelated optimizer must never meet a
replica barrier), after refusing the steps that would give wrong numbers:

* plain parameters (a model built outside `strategy.scope()`) with more than one
  replica in sync: every replica thread would update the one tensor in place
  while the others read it (wrong weights, or a crash), and workers would
  drift apart. `InvalidArgumentError`, as tf.distribute's ValueError.
* another strategy's variables: they would be stepped with the wrong replica's
  copy and never summed. `MixedStrategyError`, naming both strategies.
* `torch.amp.GradScaler`: it unscales and checks each replica's own gradient
  before the sum, so replicas and workers disagree on the scale and on whether
  to step. `distribute.GradScaler` sums first.

Outside `run`, a step over variables whose gradients were computed inside `run`
(another replica's copy holds a gradient, or another worker's sum is missing)
would apply one replica's gradient alone: `ContextError`, asking for the step
inside `run`. With a strategy of one replica in sync nothing is refused.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING, Any

from torch.optim.optimizer import (
    Optimizer,
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from distribute import context
from distribute.errors import ContextError, InvalidArgumentError, MixedStrategyError
from distribute.variables import DistributedVariable

if TYPE_CHECKING:
    from distribute.gradients.base import StepHandler
    from distribute.strategies.base import Strategy

__all__ = ["sum_before_step", "forget_early_sums"]

# Per optimizer: (ids of its parameters, the strategy, that strategy's variables).
_plans: weakref.WeakKeyDictionary[
    Optimizer, tuple[tuple[int, ...], Strategy, list[DistributedVariable]]
] = weakref.WeakKeyDictionary()


class _Early(threading.local):
    def __init__(self) -> None:
        # Optimizers whose gradients this replica thread summed before the step.
        self.summed: set[int] = set()


_early = _Early()


def _handler(strategy: Strategy) -> StepHandler | None:
    handler: StepHandler | None = getattr(strategy.extended, "_step_handler", None)
    return handler


def _variables_of(optimizer: Optimizer, strategy: Strategy) -> list[DistributedVariable]:
    """`strategy`'s variables among the optimizer's parameters; refuses what would
    give wrong numbers (NOTE [refused steps])."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    key = tuple(map(id, params))
    cached = _plans.get(optimizer)
    if cached is not None and cached[0] == key and cached[1] is strategy:
        return cached[2]
    own: list[DistributedVariable] = []
    foreign: list[DistributedVariable] = []
    plain = 0
    for p in params:
        if not isinstance(p, DistributedVariable) or not p._ds_strategy.extended._captures_modules:
            plain += 1  # a default-strategy variable is as good as a plain tensor
        elif p._ds_strategy is strategy:
            own.append(p)
        else:
            foreign.append(p)
    if foreign:
        raise MixedStrategyError(
            f"optimizer.step() inside `run` of {strategy!r} got {len(foreign)} variables of "
            f"{foreign[0]._ds_strategy!r}; a model is trained by the strategy whose scope "
            "built it: call that strategy's `run`, or build the model and optimizer inside "
            f"`with strategy.scope():` of {strategy!r}"
        )
    n = strategy.num_replicas_in_sync
    if plain and n > 1:
        raise InvalidArgumentError(
            f"optimizer.step() inside `run` of {strategy!r} got {plain} plain parameters "
            f"(of {len(params)}), but {n} replicas train in sync: each replica would update "
            "the same tensor unsynchronized. Build the model and its optimizer inside "
            "`with strategy.scope():` so that its parameters become MirroredVariables"
        )
    _plans[optimizer] = (key, strategy, own)
    return own


def _has_replica_gradients(var: DistributedVariable) -> bool:
    """Whether ``var`` holds gradients made inside `run` of a strategy of several replicas."""
    strategy = var._ds_strategy
    if strategy.num_replicas_in_sync == 1 or not strategy.extended._captures_modules:
        return False
    if any(c.grad is not None for c in var._ds_components):
        return True  # another local replica's gradient, which this step would ignore
    # Across workers, any gradient is one worker's alone.
    return strategy.num_replicas_in_sync > 1 + len(var._ds_components) and var.grad is not None


def _refuse_partial_step(optimizer: Optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, DistributedVariable) and _has_replica_gradients(p):
                raise ContextError(
                    f"optimizer.step() was called in cross-replica context, but its variables "
                    f"of {p._ds_strategy!r} hold gradients computed inside `run`: this step "
                    "would apply one replica's gradient alone. Call optimizer.step() inside "
                    "the function given to strategy.run, after loss.backward()"
                )


def _refuse_torch_grad_scaler() -> None:
    """Raises when `torch.amp.GradScaler.step` (not `distribute.GradScaler`) is stepping."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return
        if frame.f_code.co_name == "_maybe_opt_step":
            scaler = frame.f_locals.get("self")
            if scaler is not None and not getattr(scaler, "_ds_sums_first", False):
                raise InvalidArgumentError(
                    "torch.amp.GradScaler unscales and checks each replica's own gradient "
                    "before gradients are summed, so replicas disagree on the scale and on "
                    "whether to step; use distribute.GradScaler (the same API) instead"
                )
            return
        frame = frame.f_back


def sum_before_step(optimizer: Optimizer) -> None:
    """Sums the optimizer's gradients over the replicas now, if inside a strategy's `run`.

    The optimizer's next step in this replica then does not sum again.
    """
    top = context._top()
    if top is None or top.replica_context is None:
        return
    handler = _handler(top.strategy)
    if handler is None:
        return
    variables = _variables_of(optimizer, top.strategy)
    if variables:
        handler.sum_gradients(optimizer, variables, top.replica_context.local_replica_id)
        _early.summed.add(id(optimizer))


def forget_early_sums(optimizer_ids: Iterable[int]) -> None:
    """Forgets early sums whose step was skipped (an infinite gradient)."""
    _early.summed.difference_update(optimizer_ids)


def _pre_step_hook(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    top = context._top()
    if top is None or top.replica_context is None:
        _refuse_partial_step(optimizer)
        return
    handler = _handler(top.strategy)
    if handler is None:
        return
    variables = _variables_of(optimizer, top.strategy)
    if not variables:
        return
    summed = id(optimizer) in _early.summed
    if summed:
        _early.summed.discard(id(optimizer))
    elif top.strategy.num_replicas_in_sync > 1:
        _refuse_torch_grad_scaler()
    handler.before_step(optimizer, variables, top.replica_context.local_replica_id, summed=summed)


def _post_step_hook(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    top = context._top()
    if top is None or top.replica_context is None:
        return
    handler = _handler(top.strategy)
    cached = _plans.get(optimizer)
    if handler is None or cached is None or cached[1] is not top.strategy or not cached[2]:
        return
    handler.after_step(optimizer, cached[2], top.replica_context.local_replica_id)


register_optimizer_step_pre_hook(_pre_step_hook)
register_optimizer_step_post_hook(_post_step_hook)
