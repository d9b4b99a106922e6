"""Keras's loss names as per-example PyTorch losses, and optimizer names.

Every loss here returns ONE value per example (reduction happens in the model,
over the global batch: `ds.compute_average_loss`). As in Keras, the probability
losses take probabilities unless ``from_logits=True``; PyTorch models that end in
a linear layer want ``ds.training.losses.SparseCategoricalCrossentropy(from_logits=True)``
or ``torch.nn.CrossEntropyLoss()``.

Example:
    >>> import torch, distribute as ds
    >>> loss = ds.training.losses.get("mse")
    >>> loss(torch.ones(2, 3), torch.zeros(2, 3)).tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from distribute.errors import InvalidArgumentError
from distribute.training import optimizers

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "SparseCategoricalCrossentropy",
    "get",
    "get_optimizer",
]

_EPSILON = 1e-7
#: A per-example loss: ``(y_true, y_pred) -> one value per example`` (Keras's order).
PerExampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _per_example(values: torch.Tensor) -> torch.Tensor:
    """The mean over every dimension but the first."""
    return values.flatten(1).mean(1) if values.dim() > 1 else values


def mean_squared_error(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return _per_example((y_pred - y_true.reshape(y_pred.shape).to(y_pred.dtype)).square())


def mean_absolute_error(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return _per_example((y_pred - y_true.reshape(y_pred.shape).to(y_pred.dtype)).abs())


class _ProbabilityCheck:
    """Warns once when a loss that takes probabilities is given scores outside [0, 1]
    (a torch model's logits): one host read, on the first batch only."""

    def __init__(self) -> None:
        self._checked = False

    def check(self, y_pred: torch.Tensor, name: str) -> None:
        if self._checked or y_pred.numel() == 0:
            return
        self._checked = True
        if bool((y_pred < 0).any() | (y_pred > 1).any()):
            warnings.warn(
                f"{name} takes probabilities (from_logits=False, Keras's default) but got "
                "values outside [0, 1], which look like logits: pass "
                f"ds.training.losses.{name}(from_logits=True) or torch.nn.CrossEntropyLoss()",
                stacklevel=3,
            )


def _log_probabilities(y_pred: torch.Tensor, from_logits: bool) -> torch.Tensor:
    """Log-probabilities over the last dimension, from logits or from probabilities
    (renormalized and clipped, as Keras does)."""
    if from_logits:
        return F.log_softmax(y_pred, dim=-1)
    p = y_pred / y_pred.sum(-1, keepdim=True)
    return p.clamp(_EPSILON, 1 - _EPSILON).log()


class BinaryCrossentropy:
    """Per-example binary cross-entropy (mean over the last dimensions).

    Example:
        >>> import distribute as ds, torch
        >>> loss = ds.training.losses.BinaryCrossentropy(from_logits=True)
        >>> loss(torch.tensor([[1.0], [0.0]]), torch.zeros(2, 1))   # (y_true, y_pred)
        tensor([0.6931, 0.6931])
    """

    def __init__(self, from_logits: bool = False) -> None:
        self.from_logits = from_logits
        self._probabilities = _ProbabilityCheck()

    def __call__(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if not self.from_logits:
            self._probabilities.check(y_pred, "BinaryCrossentropy")
        target = y_true.reshape(y_pred.shape).to(y_pred.dtype)
        if self.from_logits:
            values = F.binary_cross_entropy_with_logits(y_pred, target, reduction="none")
        else:
            p = y_pred.clamp(_EPSILON, 1 - _EPSILON)
            values = -(target * p.log() + (1 - target) * (1 - p).log())
        return _per_example(values)


class CategoricalCrossentropy:
    """Per-example cross-entropy against one-hot (or soft) labels.

    Example:
        >>> import distribute as ds, torch
        >>> loss = ds.training.losses.CategoricalCrossentropy()   # takes probabilities
        >>> loss(torch.eye(2), torch.tensor([[0.5, 0.5], [0.25, 0.75]]))
        tensor([0.6931, 0.2877])
    """

    def __init__(self, from_logits: bool = False) -> None:
        self.from_logits = from_logits
        self._probabilities = _ProbabilityCheck()

    def __call__(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if not self.from_logits:
            self._probabilities.check(y_pred, "CategoricalCrossentropy")
        log_p = _log_probabilities(y_pred, self.from_logits)
        return _per_example(-(y_true.to(log_p.dtype) * log_p).sum(-1))


class SparseCategoricalCrossentropy:
    """Per-example cross-entropy against integer labels.

    Example:
        >>> import distribute as ds, torch
        >>> loss = ds.training.losses.SparseCategoricalCrossentropy(from_logits=True)
        >>> loss(torch.tensor([0, 1]), torch.zeros(2, 2))
        tensor([0.6931, 0.6931])
    """

    def __init__(self, from_logits: bool = False) -> None:
        self.from_logits = from_logits
        self._probabilities = _ProbabilityCheck()

    def __call__(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if not self.from_logits:
            self._probabilities.check(y_pred, "SparseCategoricalCrossentropy")
        log_p = _log_probabilities(y_pred, self.from_logits)
        labels = y_true.reshape(y_pred.shape[:-1]).long()
        return _per_example(-log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1))


_LOSSES: dict[str, Callable[[], PerExampleLoss]] = {
    "mse": lambda: mean_squared_error,
    "mean_squared_error": lambda: mean_squared_error,
    "mae": lambda: mean_absolute_error,
    "mean_absolute_error": lambda: mean_absolute_error,
    "binary_crossentropy": BinaryCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
}


def _torch_loss(module: torch.nn.Module) -> PerExampleLoss:
    """A torch loss module with ``reduction="none"``, made per example."""
    unreduced = copy.copy(module)
    if hasattr(unreduced, "reduction"):
        setattr(unreduced, "reduction", "none")  # noqa: B010  # torch's losses have it

    def loss(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return _per_example(unreduced(y_pred, y_true))  # torch's order: input, target

    return loss


def get(identifier: Any) -> PerExampleLoss:
    """A per-example loss from a Keras name, a torch loss module (any reduction: it is
    made ``"none"``) or a callable ``(y_true, y_pred) -> per-example values``.

    Example:
        >>> import distribute as ds, torch
        >>> ds.training.losses.get("mse")(torch.ones(2, 1), torch.zeros(2, 1))
        tensor([1., 1.])
        >>> ds.training.losses.get(torch.nn.L1Loss())(torch.ones(2, 3), torch.zeros(2, 3))
        tensor([1., 1.])
    """
    if isinstance(identifier, str):
        factory = _LOSSES.get(identifier.lower())
        if factory is None:
            raise InvalidArgumentError(
                f"unknown loss {identifier!r}; known: {sorted(_LOSSES)}, a torch loss module, "
                "or a function of (y_true, y_pred) giving one value per example"
            )
        return factory()
    if isinstance(identifier, torch.nn.Module):
        return _torch_loss(identifier)
    if callable(identifier):
        return identifier  # type: ignore[no-any-return]
    raise InvalidArgumentError(f"cannot make a loss of {identifier!r}")


def get_optimizer(identifier: Any, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """An optimizer of ``parameters`` from a Keras name (Keras's update rule and
    defaults: `distribute.training.optimizers`), an optimizer already made on them
    (kept as it is: a ``torch.optim`` optimizer keeps torch's rule), or a callable
    ``parameters -> optimizer``.

    Example:
        >>> import distribute as ds, torch
        >>> params = [torch.nn.Parameter(torch.zeros(1))]
        >>> type(ds.training.losses.get_optimizer("adam", params)).__module__
        'distribute.training.optimizers._adam'
        >>> sgd = ds.training.losses.get_optimizer(lambda p: torch.optim.SGD(p, lr=0.1), params)
        >>> type(sgd).__name__
        'SGD'
    """
    if isinstance(identifier, torch.optim.Optimizer):
        return identifier
    if isinstance(identifier, str):
        return optimizers.get(identifier, parameters)
    if callable(identifier):
        optimizer = identifier(parameters)
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
    raise InvalidArgumentError(f"cannot make an optimizer of {identifier!r}")
