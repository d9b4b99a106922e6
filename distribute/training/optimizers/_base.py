"""`KerasOptimizer`: the base of Keras 3's optimizers, written as torch optimizers.

# NOTE [Keras's step, in torch]
Keras 3's base optimizer (``keras/src/optimizers/base_optimizer.py``) does, at
each ``apply``: drop the variables without a gradient; clip the gradients
(``clipnorm`` per gradient, ``global_clipnorm`` over all of them, or
``clipvalue``: at most one); decay every variable left, ``var -= var * wd * lr``,
BEFORE its update; run the optimizer's own ``update_step(gradient, var, lr)``;
count one iteration, whether or not a variable had a gradient.

Here the same order runs in `step`. Keras's one ``iterations`` counter becomes
``state[p]["step"]``, advanced at every step for every parameter that could have
a gradient (so a parameter that missed steps still uses the optimizer's step
count in its bias corrections, as in Keras). The counter lives in the
per-parameter ``state``, never in ``param_groups``: `distribute` gives each
replica thread its own ``optimizer.state`` but shares ``param_groups`` between
them. Every hyperparameter lives in the param groups (``lr`` under torch's name,
so `LearningRateScheduler` and ``torch.optim.lr_scheduler`` work), and state
tensors are created when a parameter first needs them, so ``state_dict`` and
``load_state_dict`` round-trip as for any torch optimizer.

# NOTE [Keras's arithmetic, in the variable's dtype]
Keras computes an update's scalars as tensors of the variable's dtype: the
learning rate (a float32 variable, Keras's ``floatx``) cast to it, the step
``iterations + 1`` cast to it, ``ops.power(ops.cast(beta_1, dtype), step)``
in it, and a Python number meeting a tensor in an op becomes a tensor of that
tensor's dtype. The same formulas in Python floats (float64) give other
numbers: in float32, ``1 - 0.999**t`` differs from float64's rounded for every
``t`` from 1 to 5,000, so Adam's steps drift from Keras's over a ``fit``.

Here each optimizer's `_scalars` computes them the Keras way, once per param
group, step count and dtype, as 0-dim CPU tensors of the variable's dtype
(torch's CPU ``pow`` of two such numbers is C's ``powf``, as TensorFlow's is; their
square roots are `scalar_sqrt`'s, correctly rounded as TensorFlow's),
and `_update` gets them as Python floats holding exactly those values. A
float32 tensor times such a number is the float32 product Keras computes, with
no tensor crossing devices and no synchronisation. Every number `_update` uses
comes from there, rounded to the dtype: torch keeps a Python number in float32
in a half tensor's op where Keras rounds it to half first. Which scalars Keras
computes in the dtype (``1 - beta_1`` with ``beta_1`` a dtype tensor, in Nadam
and Lion) and which it computes in Python before converting (``1 - self.beta_1``
in Adam) differs between optimizers; each `_scalars` follows its own.

What still differs from TensorFlow's Keras, in the last place: torch's kernels.
On an x86 CPU torch's ``sqrt`` of a float32 tensor is MKL's, one unit off the
correctly rounded root (TensorFlow's) for about one element in six; a correctly
rounded one, through float64, made the update several times slower. Reductions
(norms, Adafactor's means) sum in another order, tensor powers (Ftrl's) round
otherwise, TensorFlow flushes subnormal numbers to zero, and on CUDA torch
divides by a Python number as a multiplication by its reciprocal. The figures
against TensorFlow 2.21: ``benchmarks/bench_keras_optimizers.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypedDict, overload

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from distribute.errors import InvalidArgumentError

__all__ = ["ClipOptions", "KerasOptimizer", "KerasOptions"]

#: This step's scalars of one param group in one dtype, by name (`_scalars`).
Scalars = dict[str, float]
#: A parameter's optimizer state (``optimizer.state[p]``).
State = dict[str, Any]
#: A param group (``optimizer.param_groups[i]``).
Group = dict[str, Any]


class ClipOptions(TypedDict, total=False):
    """Keras's base-optimizer options every optimizer takes by keyword, but for
    ``weight_decay`` (`KerasOptions`).

    Attributes:
        clipnorm: clip each gradient to this norm.
        clipvalue: clip each gradient's elements to ``[-clipvalue, clipvalue]``.
        global_clipnorm: clip all gradients together to this global norm.
        learning_rate: Keras's name of ``lr`` (pass one of the two).
    """

    clipnorm: float | None
    clipvalue: float | None
    global_clipnorm: float | None
    learning_rate: float | None


class KerasOptions(ClipOptions, total=False):
    """`ClipOptions` and ``weight_decay``: ``var -= var * weight_decay * lr`` before
    each update (None: off)."""

    weight_decay: float | None


#: The constructor arguments of Keras's base optimizer that change numbers.
BASE_DEFAULTS: dict[str, Any] = {
    "weight_decay": None,
    "clipnorm": None,
    "clipvalue": None,
    "global_clipnorm": None,
}


def resolve_lr(lr: float | None, learning_rate: float | None, default: float) -> float:
    """The learning rate from torch's ``lr`` or Keras's ``learning_rate`` (not both)."""
    if lr is not None and learning_rate is not None:
        raise InvalidArgumentError(
            f"got lr={lr} and learning_rate={learning_rate}: they are the same "
            "argument (torch's and Keras's name), pass one"
        )
    value = lr if lr is not None else learning_rate if learning_rate is not None else default
    if not value >= 0.0:
        raise InvalidArgumentError(f"the learning rate must be >= 0, got {value}")
    return float(value)


def cast(value: float, dtype: torch.dtype) -> torch.Tensor:
    """A Python number as Keras puts it in an op with a tensor of ``dtype``
    (``ops.cast(value, dtype)``): a 0-dim CPU tensor of that dtype."""
    return torch.tensor(value, dtype=dtype)


def scalar_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sqrt`` of a 0-dim tensor, correctly rounded as TensorFlow's (and C's
    ``sqrt``) in any dtype: torch's CPU kernel (MKL's on x86) is one unit in the
    last place off for about one value in five, even for one number."""
    value = float(x)
    return cast(math.sqrt(value) if value >= 0 else math.nan, x.dtype)


def keras_lr(lr: float, dtype: torch.dtype) -> torch.Tensor:
    """Keras's ``ops.cast(learning_rate, variable.dtype)``: the rate is a float32
    variable (``floatx``), so a float64 variable sees it rounded to float32."""
    return torch.tensor(lr, dtype=torch.float32).to(dtype)


def keras_defaults(
    lr: float | None, default_lr: float, options: KerasOptions, **hyperparameters: Any
) -> dict[str, Any]:
    """An optimizer's param-group defaults: the learning rate (torch's ``lr`` or
    Keras's ``learning_rate`` in ``options``, else ``default_lr``), its own
    ``hyperparameters``, then Keras's base options (`KerasOptions`)."""
    base = {name: options.get(name) for name in BASE_DEFAULTS}
    lr = resolve_lr(lr, options.get("learning_rate"), default_lr)
    return {"lr": lr, **hyperparameters, **base}


def _check_clipping(group: dict[str, Any]) -> None:
    names = ("clipnorm", "clipvalue", "global_clipnorm")
    given = {n: group.get(n) for n in names if group.get(n) is not None}
    if len(given) > 1:
        raise InvalidArgumentError(
            f"at most one of clipnorm, clipvalue and global_clipnorm may be set (as in "
            f"Keras), got {given}: keep one"
        )


class KerasOptimizer(torch.optim.Optimizer):
    """A torch optimizer with Keras 3's step: clip, decay, update, count.

    Subclasses give their defaults (their own hyperparameters, and Keras's base options
    taken as ``**options: Unpack[KerasOptions]``, joined by `keras_defaults`),
    `_scalars` (the step's numbers, NOTE [Keras's arithmetic, in the variable's dtype])
    and `_update` (Keras's ``update_step`` for one parameter); see NOTE [Keras's step,
    in torch]. Any subclass works wherever a
    ``torch.optim`` optimizer does: inside ``strategy.run``, with learning-rate
    schedulers, in checkpoints.

    Args:
        params: parameters or param groups, as for any torch optimizer.
        defaults: every hyperparameter's default (``lr`` among them).

    Example:
        >>> import torch, distribute as ds
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = ds.optimizers.SGD([p], lr=0.1, weight_decay=0.5)
        >>> isinstance(opt, torch.optim.Optimizer)
        True
        >>> p.grad = torch.ones(2)
        >>> opt.step()  # decay first: 1 - 1 * 0.5 * 0.1, then - 0.1 * 1
        >>> [round(v, 6) for v in p.tolist()], opt.state[p]["step"].item()
        ([0.85, 0.85], 1.0)
    """

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        _check_clipping(defaults)
        super().__init__(params, {**BASE_DEFAULTS, **defaults})
        for group in self.param_groups:
            _check_clipping(group)

    def _scalars(self, group: Group, t: Tensor, lr: Tensor) -> dict[str, Tensor]:
        """This step's scalars for `_update`, computed as Keras computes them (NOTE
        [Keras's arithmetic, in the variable's dtype]).

        Args:
            group: the param group.
            t: the step count ``iterations + 1``, a 0-dim CPU tensor of the
                variables' dtype.
            lr: the learning rate as Keras casts it (`keras_lr`), same dtype.

        Returns:
            Name to value: 0-dim tensors of ``t``'s dtype (Python numbers are
                rounded to it).
        """
        return {}

    def _update(self, p: Tensor, grad: Tensor, state: State, group: Group, s: Scalars) -> None:
        """Keras's ``update_step``: updates ``p`` in place with this step's ``grad``
        (in ``p``'s dtype) and scalars ``s`` (`_scalars`, with ``"lr"``)."""
        raise NotImplementedError

    def _advance(self, p: Tensor, state: State, group: Group, step: int) -> None:
        """Per-step bookkeeping done whether or not ``p`` has a gradient (Nadam's
        ``u_product``); nothing by default."""

    def _step_scalars(self, group: dict[str, Any], step: int, dtype: torch.dtype) -> Scalars:
        """`_scalars` with the learning rate and weight decay, as Python floats."""
        lr = keras_lr(group["lr"], dtype)
        values = {"lr": lr, **self._scalars(group, cast(step, dtype), lr)}
        if group["weight_decay"] is not None:
            values["weight_decay"] = cast(group["weight_decay"], dtype)
        return {name: float(value) for name, value in values.items()}

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Keras step over every parameter with a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work: list[tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]] = []
        for group in self.param_groups:
            pairs = []
            for p in group["params"]:
                if p.grad is None and not p.requires_grad:
                    continue  # frozen: Keras's trainable variables only
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["step"] += 1
                self._advance(p, state, group, int(state["step"]))
                if p.grad is not None:
                    pairs.append((p, p.grad.to_dense() if p.grad.is_sparse else p.grad))
            work.append((group, pairs))
        _clip(work)
        for group, pairs in work:
            scalars: dict[tuple[int, torch.dtype], Scalars] = {}
            for p, grad in pairs:
                state = self.state[p]
                key = (int(state["step"]), p.dtype)
                if key not in scalars:
                    scalars[key] = self._step_scalars(group, *key)
                s = scalars[key]
                if group["weight_decay"] is not None:
                    p.sub_(p * s["weight_decay"] * s["lr"])
                self._update(p, grad.to(p.dtype), state, group, s)
        return loss


def _clip(work: list[tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]]) -> None:
    """Keras's ``_clip_gradients``, in place on this step's gradient list, in the
    gradients' dtype (Keras casts them to the variable's afterwards).

    ``global_clipnorm``'s norm is over every gradient of the optimizer, as Keras's.
    """
    norm: torch.Tensor | None = None
    for group, pairs in work:
        clipnorm, clipvalue = group["clipnorm"], group["clipvalue"]
        global_clipnorm = group["global_clipnorm"]
        if clipnorm and clipnorm > 0:
            pairs[:] = [(p, _clip_by_norm(g, clipnorm)) for p, g in pairs]
        elif global_clipnorm and global_clipnorm > 0:
            if norm is None:
                grads = [g for _, ps in work for _, g in ps]
                if not grads:
                    return
                norm = _global_norm(grads)
            limit, inverse = (
                float(cast(v, norm.dtype)) for v in (global_clipnorm, 1.0 / global_clipnorm)
            )
            # Keras's: NaN for an infinite or NaN norm, else min(1, limit / norm).
            scale = limit * torch.clamp(1 / norm, max=inverse) + (norm - norm)
            pairs[:] = [(p, g * scale.to(g.dtype)) for p, g in pairs]
        elif clipvalue and clipvalue > 0:
            pairs[:] = [(p, g.clamp(-clipvalue, clipvalue)) for p, g in pairs]


def _global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Keras's ``global_norm``: ``sqrt(sum(stack([sum(g**2) for g in grads])))``."""
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
    return torch.stack([g.square().sum().to(dtype) for g in grads]).sum().sqrt()


def _clip_by_norm(grad: torch.Tensor, clipnorm: float) -> torch.Tensor:
    """``grad * clipnorm / max(||grad||, clipnorm)`` (TensorFlow's ``clip_by_norm``,
    which Keras's TensorFlow backend calls; a zero gradient kept)."""
    limit = float(cast(clipnorm, grad.dtype))
    l2norm = grad.square().sum().sqrt()
    return grad * limit / torch.clamp(l2norm, min=limit)


def slot(state: dict[str, Any], name: str, p: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """The state tensor ``name`` of ``p``, made (filled with ``fill``) at first use."""
    value = state.get(name)
    if value is None:
        value = torch.full_like(p, fill, memory_format=torch.preserve_format)
        state[name] = value
    return value
