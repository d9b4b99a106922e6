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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

import torch
from torch.optim.optimizer import ParamsT

from distribute.errors import InvalidArgumentError

__all__ = ["KerasOptimizer"]

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

    Subclasses give their defaults and `_update` (Keras's ``update_step`` for one
    parameter); see NOTE [Keras's step, in torch]. Any subclass works wherever a
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

    def _update(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        step: int,
    ) -> None:
        """Keras's ``update_step``: updates ``p`` in place with this step's ``grad``."""
        raise NotImplementedError

    def _advance(
        self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], step: int
    ) -> None:
        """Per-step bookkeeping done whether or not ``p`` has a gradient (Nadam's
        ``u_product``); nothing by default."""

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
                    grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                    pairs.append((p, grad.to(p.dtype)))
            work.append((group, pairs))
        _clip(work)
        for group, pairs in work:
            lr, decay = group["lr"], group["weight_decay"]
            for p, grad in pairs:
                if decay is not None:
                    p.sub_(p * decay * lr)
                state = self.state[p]
                self._update(p, grad, state, group, int(state["step"]))
        return loss


def _clip(work: list[tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]]) -> None:
    """Keras's ``_clip_gradients``, in place on this step's gradient list.

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
                norm = torch.stack([g.square().sum().to(torch.float64) for g in grads]).sum()
                norm = norm.sqrt()
            limit = float(global_clipnorm)
            # Keras's: NaN for an infinite or NaN norm, else min(1, limit / norm).
            scale = limit * torch.minimum(1.0 / norm, torch.tensor(1.0 / limit)) + (norm - norm)
            pairs[:] = [(p, g * scale.to(g.dtype)) for p, g in pairs]
        elif clipvalue and clipvalue > 0:
            pairs[:] = [(p, g.clamp(-clipvalue, clipvalue)) for p, g in pairs]


def _clip_by_norm(grad: torch.Tensor, clipnorm: float) -> torch.Tensor:
    """``grad * clipnorm / max(||grad||, clipnorm)`` (Keras's, a zero gradient kept)."""
    l2norm = grad.square().sum().sqrt()
    return grad * clipnorm / torch.clamp(l2norm, min=clipnorm)


def slot(state: dict[str, Any], name: str, p: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """The state tensor ``name`` of ``p``, made (filled with ``fill``) at first use."""
    value = state.get(name)
    if value is None:
        value = torch.full_like(p, fill, memory_format=torch.preserve_format)
        state[name] = value
    return value
