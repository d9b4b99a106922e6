"""The global optimizer step hooks: check the step, then call the strategy's handler.

# NOTE [refused steps]
`torch.optim` has no `apply_gradients` to override, so every optimizer in the
process runs these hooks. Inside a strategy's `run` they act only for optimizers
holding that strategy's variables (an unrelated optimizer must never meet a
replica barrier), after refusing the steps that would give wrong numbers:

* plain parameters (`nn.Parameter`s of a model built outside `strategy.scope()`,
  or variables made outside any scope) with more than one replica in sync: every
  replica thread would update the one tensor in place while the others read it
  (wrong weights, or a crash), and workers would drift apart.
  `InvalidArgumentError`, as tf.distribute's ValueError. Plain tensors that are not
  parameters (a per-replica perturbation optimized inside `fn`) are the replica's
  own business and pass.
* another strategy's variables: they would be stepped with the wrong replica's
  copy and never summed. `MixedStrategyError`, naming both strategies.

The handler then refuses what only it can judge (the synchronous one refuses
`torch.amp.GradScaler`, which unscales each replica's own gradient before the
sum). Outside `run`, a step over a strategy's variables asks that strategy's
handler whether it would lose gradients made inside `run` (the synchronous one:
another replica's copy holds a gradient, or another worker's share is missing),
which raises `ContextError` asking for the step inside `run`. That check costs
nothing until some strategy of several replicas has made a variable.
"""

from __future__ import annotations

import functools
import itertools
import operator
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from torch.nn import Parameter
from torch.optim.optimizer import (
    Optimizer,
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from distribute import _marks, context
from distribute.errors import InvalidArgumentError, MixedStrategyError
from distribute.variables import DistributedVariable

if TYPE_CHECKING:
    from distribute.gradients.base import RunningStrategy as Strategy
    from distribute.gradients.base import StepHandler

__all__ = ["forget_early_sums", "sum_before_step"]

# Per optimizer: (ids of its parameters, the strategy, its variables), all weakly.
# A module-level table is a root for the garbage collector until its key dies: a
# strong reference from here to a variable (and through it to its strategy) would
# keep a dropped strategy alive through the collection that frees the optimizer.
_plans: weakref.WeakKeyDictionary[
    Optimizer,
    tuple[tuple[int, ...], weakref.ref[Strategy], list[weakref.ref[DistributedVariable]]],
] = weakref.WeakKeyDictionary()


# NOTE [quiet steps]
# Where the handler says an optimizer's steps need nothing from it (one replica in
# sync: no sum, no per-replica groups, no shared copy; `StepHandler.steps_quietly`),
# its plan is also kept here, by the optimizer's id, and the hooks of a later step
# only check, with C-level calls, that the plan still holds (the same optimizer,
# strategy and parameters, every variable alive, no early sum pending): the one-
# replica step's hooks cost two Python calls instead of a dozen (issue 40).
_quiet: dict[
    int,
    tuple[
        weakref.ref[Optimizer],
        tuple[int, ...],
        weakref.ref[Strategy],
        list[weakref.ref[DistributedVariable]],
    ],
] = {}
_PARAMS = operator.itemgetter("params")
_NONES = itertools.repeat(None)


def _forget_quiet(key: int, ref: weakref.ref[Optimizer]) -> None:
    entry = _quiet.get(key)
    if entry is not None and entry[0] is ref:
        del _quiet[key]


def _params_key(optimizer: Optimizer) -> tuple[int, ...]:
    """The ids of the optimizer's parameters, in order (C-level maps: no frame each)."""
    return tuple(map(id, itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups))))


def _planned(
    optimizer: Optimizer, strategy: Strategy, cached: Any = None
) -> list[DistributedVariable] | None:
    """The variables `_variables_of` found for ``optimizer`` under ``strategy``, if all
    are still alive; else None. ``cached``: its plan, if the caller has read it."""
    if cached is None:
        cached = _plans.get(optimizer)
    if cached is None or cached[1]() is not strategy:
        return None
    # C-level maps (no Python frame per variable: the step's host budget).
    variables: list[Any] = list(map(weakref.ref.__call__, cached[2]))  # no cast(): a frame
    if any(map(operator.is_, variables, itertools.repeat(None))):
        return None
    return variables


class _Early(threading.local):
    def __init__(self) -> None:
        # Optimizers whose gradients this replica thread summed before the step.
        self.summed: set[int] = set()


_early = _Early()


def _running() -> tuple[Strategy, StepHandler, int] | None:
    """The strategy running a replica in this thread, its handler and the local id."""
    stack = context._state.stack  # read directly: twice in every replica's step
    if not stack:
        return None
    top = stack[-1]
    replica_ctx = top.replica_context
    if replica_ctx is None:
        return None
    handler = top.strategy.extended.step_handler
    if handler is None:
        return None
    return top.strategy, handler, replica_ctx._local_replica_id


def _variables_of(optimizer: Optimizer, strategy: Strategy) -> list[DistributedVariable]:
    """`strategy`'s variables among the optimizer's parameters; refuses what would
    give wrong numbers (NOTE [refused steps])."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    key = tuple(map(id, params))
    cached = _plans.get(optimizer)
    if cached is not None and cached[0] == key:
        planned = _planned(optimizer, strategy, cached)
        if planned is not None:
            return planned
    _quiet.pop(id(optimizer), None)  # a new plan: made quiet again below, if it is
    own: list[DistributedVariable] = []  # or tensors a strategy manages (`_marks.managed_by`)
    foreign: list[DistributedVariable] = []
    foreign_managers: list[Any] = []
    shared = 0  # parameters every replica thread would update unsynchronized
    for p in params:
        if _marks.on_parameter_server(p):
            continue  # updated on its ps, once per step (ps/_variables.py)
        manager = _marks.managed_by(p)  # a strategy's own tensor (FSDP's shards)
        if manager is not None:
            if manager is strategy:
                own.append(p)
            else:
                foreign_managers.append(manager)
            continue
        if _marks.is_sharded_away(p):
            raise InvalidArgumentError(
                "optimizer.step() got a parameter that FullyShardedStrategy has replaced by "
                "its shards: the optimizer was built from the parameters before they were "
                "sharded and would train nothing. Build it from model.parameters() after "
                "the model's scope was left (or inside the scope, where it is repointed)"
            )
        if not isinstance(p, DistributedVariable):
            shared += isinstance(p, Parameter)
        elif not p._ds_strategy.extended._captures_modules:
            shared += 1  # a variable made outside any scope is one plain tensor
        elif p._ds_strategy is strategy:
            own.append(p)
        else:
            foreign.append(p)
    if foreign_managers:
        raise MixedStrategyError(
            f"optimizer.step() inside `run` of {strategy!r} got parameters of "
            f"{foreign_managers[0]!r}; a model is trained by the strategy whose scope "
            "built it: call that strategy's `run`"
        )
    if foreign:
        raise MixedStrategyError(
            f"optimizer.step() inside `run` of {strategy!r} got {len(foreign)} variables of "
            f"{foreign[0]._ds_strategy!r}; a model is trained by the strategy whose scope "
            "built it: call that strategy's `run`, or build the model and optimizer inside "
            f"`with strategy.scope():` of {strategy!r}"
        )
    n = strategy.num_replicas_in_sync
    if shared and n > 1:
        raise InvalidArgumentError(
            f"optimizer.step() inside `run` of {strategy!r} got {shared} plain parameters "
            f"(of {len(params)}), but {n} replicas train in sync: each replica would update "
            "the same tensor unsynchronized. Build the model and its optimizer inside "
            "`with strategy.scope():` so that its parameters become MirroredVariables"
        )
    refs = [weakref.ref(v) for v in own]
    _plans[optimizer] = (key, weakref.ref(strategy), refs)
    handler = strategy.extended.step_handler
    if own and handler is not None and handler.steps_quietly(optimizer):
        key_of = id(optimizer)
        ref = weakref.ref(optimizer, functools.partial(_forget_quiet, key_of))
        _quiet[key_of] = (ref, key, weakref.ref(strategy), refs)
    return own


def _check_step_outside_run(optimizer: Optimizer) -> None:
    """Lets each strategy whose variables the optimizer holds refuse a step outside `run`."""
    by_strategy: dict[int, list[DistributedVariable]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, DistributedVariable):
                by_strategy.setdefault(id(p._ds_strategy), []).append(p)
    for variables in by_strategy.values():
        handler = variables[0]._ds_strategy.extended.step_handler
        if handler is not None:
            handler.check_step_outside_run(optimizer, variables)


def sum_before_step(optimizer: Optimizer) -> None:
    """Sums the optimizer's gradients over the replicas now, if inside a strategy's `run`.

    The optimizer's next step in this replica then does not sum again.
    """
    running = _running()
    if running is None:
        return
    strategy, handler, local = running
    variables = _variables_of(optimizer, strategy)
    if variables:
        handler.sum_gradients(optimizer, variables, local)
        _early.summed.add(id(optimizer))


def forget_early_sums(optimizer_ids: Iterable[int]) -> None:
    """Forgets early sums whose step was skipped (an infinite gradient)."""
    _early.summed.difference_update(optimizer_ids)


def _pre_step_hook(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    stack = context._state.stack
    top = stack[-1] if stack else None
    if top is None or top.replica_context is None:
        if DistributedVariable._ds_any_replicated:
            _check_step_outside_run(optimizer)
        return
    quiet = _quiet.get(id(optimizer))
    if (  # NOTE [quiet steps]
        quiet is not None
        and quiet[0]() is optimizer
        and quiet[2]() is top.strategy
        and quiet[1] == _params_key(optimizer)
        and not any(map(operator.is_, map(weakref.ref.__call__, quiet[3]), _NONES))
        and not _early.summed
    ):
        return
    running = _running()
    if running is None:
        return
    strategy, handler, local = running
    variables = _variables_of(optimizer, strategy)
    if not variables:
        return
    summed = id(optimizer) in _early.summed
    if summed:
        _early.summed.discard(id(optimizer))
    handler.before_step(optimizer, variables, local, summed=summed)


def _post_step_hook(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    stack = context._state.stack
    if not stack or stack[-1].replica_context is None:
        return
    quiet = _quiet.get(id(optimizer))
    if quiet is not None and quiet[0]() is optimizer and quiet[2]() is stack[-1].strategy:
        return  # NOTE [quiet steps]: nothing to finish
    running = _running()
    if running is None:
        return
    strategy, handler, local = running
    planned = _planned(optimizer, strategy)
    if planned:
        handler.after_step(optimizer, planned, local)


_handles: list[RemovableHandle] = []
_install_lock = threading.Lock()


def install() -> None:
    """Installs the global optimizer step hooks (idempotent).

    Called when a strategy's scope is first entered or its `run` first called
    (`strategies/_torch_hooks.py`), never at import. Outside `run` they cost one
    class-attribute read per step until a strategy of several replicas has made a
    variable.
    """
    with _install_lock:
        if not _handles:
            _handles.append(register_optimizer_step_pre_hook(_pre_step_hook))
            _handles.append(register_optimizer_step_post_hook(_post_step_hook))
