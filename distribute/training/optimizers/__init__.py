"""Keras 3's optimizers as ``torch.optim`` optimizers: Keras's update rules and defaults.

``ds.Model.compile(optimizer="adam")`` gives `Adam` here, not ``torch.optim.Adam``:
the two differ (Keras adds epsilon before the bias correction, torch after; Keras's
RMSprop and Adagrad put epsilon inside the square root; Keras's SGD momentum holds
the learning rate), and a Keras name promises Keras's numbers. A torch optimizer
object (or a function making one) passed to ``compile`` keeps torch's rule. Each
computes as Keras does, in the variable's dtype (NOTE [Keras's arithmetic, in the
variable's dtype] in ``_base``): given the same gradients, float32 updates on a CPU
match TensorFlow's Keras bit for bit, up to torch's own rounding of a square root or
a sum in the last place.

Every class is an ordinary ``torch.optim.Optimizer``: use it in a custom loop
inside ``strategy.run``, with ``torch.optim.lr_scheduler`` or
`ds.callbacks.LearningRateScheduler` (the rate is ``param_groups[i]["lr"]``), and in
checkpoints (``state_dict`` / ``load_state_dict``). Keras's base-optimizer options
that change numbers are arguments of every class: ``weight_decay`` (applied as
``var -= var * weight_decay * lr`` before the update), ``clipnorm``, ``clipvalue``
and ``global_clipnorm``; Keras's ``learning_rate`` is accepted beside torch's
``lr``. Keras's ``exclude_from_weight_decay`` is a param group with
``weight_decay=None`` here. Not provided: ``use_ema``, ``loss_scale_factor``,
``gradient_accumulation_steps`` (use `distribute.GradScaler` and
``strategy.extended.no_sync()``), Muon, Lamb and ScheduleFreeAdamW.

Example:
    >>> import torch, distribute as ds
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = ds.optimizers.get("adam", model.parameters())
    >>> type(opt).__name__, opt.param_groups[0]["lr"], opt.param_groups[0]["epsilon"]
    ('Adam', 0.001, 1e-07)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from distribute.errors import InvalidArgumentError
from distribute.training.optimizers._adam import Adafactor, Adam, Adamax, AdamW, Lion, Nadam
from distribute.training.optimizers._base import KerasOptimizer
from distribute.training.optimizers._classic import SGD, Adadelta, Adagrad, Ftrl, RMSprop

__all__ = [
    "SGD",
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Ftrl",
    "KerasOptimizer",
    "Lion",
    "Nadam",
    "RMSprop",
    "get",
]

#: Keras's names (``keras.optimizers.get``: the class name, lower case).
OPTIMIZERS: dict[str, Callable[[Any], KerasOptimizer]] = {
    "adadelta": Adadelta,
    "adafactor": Adafactor,
    "adagrad": Adagrad,
    "adam": Adam,
    "adamax": Adamax,
    "adamw": AdamW,
    "ftrl": Ftrl,
    "lion": Lion,
    "nadam": Nadam,
    "rmsprop": RMSprop,
    "sgd": SGD,
}


def get(name: str, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> KerasOptimizer:
    """Keras's optimizer ``name`` (any case, as ``keras.optimizers.get``) over
    ``params``, with Keras's defaults.

    Args:
        name: ``"adam"``, ``"adamw"``, ``"sgd"``, ``"rmsprop"``, ``"adagrad"``,
            ``"adamax"``, ``"nadam"``, ``"adadelta"``, ``"ftrl"``, ``"lion"`` or
            ``"adafactor"``.
        params: parameters or param groups.

    Returns:
        The optimizer.

    Raises:
        InvalidArgumentError: an unknown name.

    Example:
        >>> import torch, distribute as ds
        >>> opt = ds.optimizers.get("RMSprop", [torch.nn.Parameter(torch.zeros(1))])
        >>> opt.param_groups[0]["rho"]
        0.9
    """
    cls = OPTIMIZERS.get(name.lower())
    if cls is None:
        raise InvalidArgumentError(
            f"unknown optimizer {name!r}; Keras's names here: {sorted(OPTIMIZERS)}; or pass "
            "a torch.optim optimizer, or a function of the parameters making one"
        )
    return cls(params)
