"""Keras 3's SGD and accumulator optimizers: SGD, RMSprop, Adagrad, Adadelta, Ftrl.

Each class gives Keras's ``update_step`` (``keras/src/optimizers/<name>.py``) for
one parameter as `_update`, in Keras's order of operations, and the step's numbers as
`_scalars`; `KerasOptimizer` does the rest (NOTE [Keras's step, in torch]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor
from torch.optim.optimizer import ParamsT

from distribute.errors import InvalidArgumentError
from distribute.training.optimizers._base import (
    Group,
    KerasOptimizer,
    KerasOptions,
    Scalars,
    State,
    cast,
    keras_defaults,
    slot,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["SGD", "Adadelta", "Adagrad", "Ftrl", "RMSprop"]


class SGD(KerasOptimizer):
    """Keras 3's SGD: the momentum holds the learning rate,
    ``m = momentum * m - lr * g; var += m`` (Nesterov:
    ``var += momentum * m - lr * g``), where torch's keeps ``lr`` outside the buffer
    (the same numbers while ``lr`` is constant, not once a schedule changes it).

    Args:
        params: parameters or param groups.
        lr: the learning rate (Keras's ``learning_rate``, also accepted).
        momentum: a float in [0, 1]; 0 keeps no momentum.
        nesterov: Nesterov momentum.
        **options: Keras's base options, by keyword (`KerasOptions`).

    Example:
        >>> import torch, distribute as ds
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> opt = ds.optimizers.SGD([p], momentum=0.9)
        >>> for _ in range(2):
        ...     p.grad = torch.ones(1)
        ...     opt.step()
        >>> round(p.item(), 6)  # -0.01, then -0.01 * 0.9 - 0.01
        -0.029
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | None = None,
        momentum: float = 0.0,
        nesterov: bool = False,
        **options: Unpack[KerasOptions],
    ) -> None:
        if not 0.0 <= momentum <= 1.0:
            raise InvalidArgumentError(f"SGD's momentum must be in [0, 1], got {momentum}")
        defaults = keras_defaults(lr, 0.01, options, momentum=momentum, nesterov=nesterov)
        super().__init__(params, defaults)

    def _scalars(self, group: Group, t: Tensor, lr: Tensor) -> dict[str, Tensor]:
        return {"momentum": cast(group["momentum"], t.dtype)}

    def _update(self, p: Tensor, grad: Tensor, state: State, group: Group, s: Scalars) -> None:
        lr = s["lr"]
        if group["momentum"] == 0:
            p.sub_(grad * lr)
            return
        momentum = s["momentum"]
        m = slot(state, "momentum", p)
        m.mul_(momentum).sub_(grad * lr)
        if group["nesterov"]:
            p.add_((m * momentum).sub_(grad * lr))
        else:
            p.add_(m)


class RMSprop(KerasOptimizer):
    """Keras 3's RMSprop: epsilon INSIDE the square root,
    ``var -= lr * g / sqrt(v + epsilon)`` (torch's adds it outside), with
    ``v = rho * v + (1 - rho) * g**2``; ``centered`` subtracts the squared mean
    gradient; ``momentum`` accumulates the increments.

    Args:
        params: parameters or param groups.
        lr: the learning rate (Keras's ``learning_rate``, also accepted).
        rho: decay of the squared-gradient average.
        momentum: momentum of the increments (0: none).
        epsilon: added to the average before the square root.
        centered: divide by the variance estimate rather than the second moment.
        **options: Keras's base options, by keyword (`KerasOptions`).

    Example:
        >>> import torch, distribute as ds
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> opt = ds.optimizers.RMSprop([p])
        >>> p.grad = torch.ones(1)
        >>> opt.step()
        >>> round(p.item(), 6)  # -0.001 / sqrt(0.1 + 1e-7)
        -0.003162
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | None = None,
        rho: float = 0.9,
        momentum: float = 0.0,
        epsilon: float = 1e-7,
        centered: bool = False,
        **options: Unpack[KerasOptions],
    ) -> None:
        defaults = keras_defaults(
            lr, 1e-3, options, rho=rho, momentum=momentum, epsilon=epsilon, centered=centered
        )
        super().__init__(params, defaults)

    def _scalars(self, group: Group, t: Tensor, lr: Tensor) -> dict[str, Tensor]:
        names = {
            "rho": group["rho"],
            "1 - rho": 1 - group["rho"],  # in Python, as Keras's (rho is a number there)
            "epsilon": group["epsilon"],
            "momentum": group["momentum"],
        }
        return {name: cast(value, t.dtype) for name, value in names.items()}

    def _update(self, p: Tensor, grad: Tensor, state: State, group: Group, s: Scalars) -> None:
        rho, one_minus_rho, epsilon = s["rho"], s["1 - rho"], s["epsilon"]
        velocity = slot(state, "velocity", p)
        velocity.mul_(rho).add_(grad.square().mul_(one_minus_rho))
        if group["centered"]:
            average = slot(state, "average_gradient", p)
            average.mul_(rho).add_(grad * one_minus_rho)
            denominator = (velocity - average.square()).add_(epsilon)
        else:
            denominator = velocity + epsilon
        increment = (grad * s["lr"]).div_(denominator.sqrt_())
        if group["momentum"] > 0:
            buffer = slot(state, "momentum", p)
            buffer.mul_(s["momentum"]).add_(increment)
            p.sub_(buffer)
        else:
            p.sub_(increment)


class Adagrad(KerasOptimizer):
    """Keras 3's Adagrad: ``acc += g**2; var -= lr * g / sqrt(acc + epsilon)``, the
    accumulator starting at ``initial_accumulator_value``.

    Args:
        params: parameters or param groups.
        lr: the learning rate (Keras's ``learning_rate``, also accepted).
        initial_accumulator_value: the accumulator's starting value.
        epsilon: added to the accumulator before the square root.
        **options: Keras's base options, by keyword (`KerasOptions`).

    Example:
        >>> import torch, distribute as ds
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> opt = ds.optimizers.Adagrad([p])
        >>> p.grad = torch.ones(1)
        >>> opt.step()
        >>> round(p.item(), 6)  # -0.001 / sqrt(0.1 + 1 + 1e-7)
        -0.000953
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | None = None,
        initial_accumulator_value: float = 0.1,
        epsilon: float = 1e-7,
        **options: Unpack[KerasOptions],
    ) -> None:
        defaults = keras_defaults(
            lr, 1e-3, options, initial_accumulator_value=initial_accumulator_value, epsilon=epsilon
        )
        super().__init__(params, defaults)

    def _scalars(self, group: Group, t: Tensor, lr: Tensor) -> dict[str, Tensor]:
        return {"epsilon": cast(group["epsilon"], t.dtype)}

    def _update(self, p: Tensor, grad: Tensor, state: State, group: Group, s: Scalars) -> None:
        accumulator = slot(state, "accumulator", p, group["initial_accumulator_value"])
        accumulator.add_(grad.square())
        p.sub_((grad * s["lr"]).div_((accumulator + s["epsilon"]).sqrt_()))


class Adadelta(KerasOptimizer):
    """Keras 3's Adadelta: ``delta = -g * sqrt(acc_delta + eps) / sqrt(acc_g + eps)``
    after updating ``acc_g``, then ``acc_delta``, then ``var += lr * delta``.

    Args:
        params: parameters or param groups.
        lr: the learning rate (Keras's ``learning_rate``, also accepted).
        rho: decay of both accumulators.
        epsilon: added inside the square roots.
        **options: Keras's base options, by keyword (`KerasOptions`).

    Example:
        >>> import torch, distribute as ds
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> opt = ds.optimizers.Adadelta([p], lr=1.0)
        >>> p.grad = torch.ones(1)
        >>> opt.step()
        >>> round(p.item(), 7)  # -sqrt(1e-7) / sqrt(0.05 + 1e-7)
        -0.0014142
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | None = None,
        rho: float = 0.95,
        epsilon: float = 1e-7,
        **options: Unpack[KerasOptions],
    ) -> None:
        defaults = keras_defaults(lr, 1e-3, options, rho=rho, epsilon=epsilon)
        super().__init__(params, defaults)

    def _scalars(self, group: Group, t: Tensor, lr: Tensor) -> dict[str, Tensor]:
        # 1 - rho in Python, as Keras's (rho is a number there).
        names = {"rho": group["rho"], "1 - rho": 1 - group["rho"], "epsilon": group["epsilon"]}
        return {name: cast(value, t.dtype) for name, value in names.items()}

    def _update(self, p: Tensor, grad: Tensor, state: State, group: Group, s: Scalars) -> None:
        rho, one_minus_rho, epsilon = s["rho"], s["1 - rho"], s["epsilon"]
        accumulated_grad = slot(state, "accumulated_grad", p)
        accumulated_delta = slot(state, "accumulated_delta_var", p)
        accumulated_grad.mul_(rho).add_(grad.square().mul_(one_minus_rho))
        delta = -((accumulated_delta + epsilon).sqrt_().mul_(grad)).div_(
            (accumulated_grad + epsilon).sqrt_()
        )
        accumulated_delta.mul_(rho).add_(delta.square().mul_(one_minus_rho))
        p.add_(delta * s["lr"])


class Ftrl(KerasOptimizer):
    """Keras 3's FTRL-proximal (McMahan et al.), with L1, L2 and L2-shrinkage
    regularization and ``beta``.

    Args:
        params: parameters or param groups.
        lr: the learning rate (Keras's ``learning_rate``, also accepted).
        learning_rate_power: <= 0; how the rate shrinks with the accumulator.
        initial_accumulator_value: >= 0; the accumulator's starting value.
        l1_regularization_strength: >= 0.
        l2_regularization_strength: >= 0.
        l2_shrinkage_regularization_strength: >= 0; applied to the gradient.
        beta: added to the L2 strength as ``beta / (2 * lr)``.
        **options: Keras's base options, by keyword (`KerasOptions`).

    Example:
        >>> import torch, distribute as ds
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> opt = ds.optimizers.Ftrl([p])
        >>> p.grad = torch.ones(1)
        >>> opt.step()
        >>> round(p.item(), 6)  # -linear / quadratic = -1 / (sqrt(1.1) / 0.001)
        -0.000953
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | None = None,
        learning_rate_power: float = -0.5,
        initial_accumulator_value: float = 0.1,
        l1_regularization_strength: float = 0.0,
        l2_regularization_strength: float = 0.0,
        l2_shrinkage_regularization_strength: float = 0.0,
        beta: float = 0.0,
        **options: Unpack[KerasOptions],
    ) -> None:
        if learning_rate_power > 0.0:
            raise InvalidArgumentError(
                f"Ftrl's learning_rate_power must be <= 0, got {learning_rate_power}"
            )
        for name, value in (
            ("initial_accumulator_value", initial_accumulator_value),
            ("l1_regularization_strength", l1_regularization_strength),
            ("l2_regularization_strength", l2_regularization_strength),
            ("l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength),
        ):
            if value < 0.0:
                raise InvalidArgumentError(f"Ftrl's {name} must be >= 0, got {value}")
        defaults = keras_defaults(
            lr,
            1e-3,
            options,
            learning_rate_power=learning_rate_power,
            initial_accumulator_value=initial_accumulator_value,
            l1_regularization_strength=l1_regularization_strength,
            l2_regularization_strength=l2_regularization_strength,
            l2_shrinkage_regularization_strength=l2_shrinkage_regularization_strength,
            beta=beta,
        )
        super().__init__(params, defaults)

    def _scalars(self, group: Group, t: Tensor, lr: Tensor) -> dict[str, Tensor]:
        dtype = t.dtype
        # Keras's l2 + beta / (2.0 * lr), in the dtype (lr is a tensor there).
        l2 = cast(group["l2_regularization_strength"], dtype)
        l2 = l2 + cast(group["beta"], dtype) / (2.0 * lr)
        return {
            "-learning_rate_power": cast(-group["learning_rate_power"], dtype),
            "l1": cast(group["l1_regularization_strength"], dtype),
            "2 * l2": 2 * l2,
            "2 * l2_shrinkage": cast(2 * group["l2_shrinkage_regularization_strength"], dtype),
        }

    def _update(self, p: Tensor, grad: Tensor, state: State, group: Group, s: Scalars) -> None:
        lr, power, l1 = s["lr"], s["-learning_rate_power"], s["l1"]
        accumulator = slot(state, "accumulator", p, group["initial_accumulator_value"])
        linear = slot(state, "linear", p)
        grad_to_use = grad + p * s["2 * l2_shrinkage"]
        new_accumulator = accumulator + grad.square()
        linear.add_(grad_to_use - (new_accumulator.pow(power) - accumulator.pow(power)) / lr * p)
        quadratic = new_accumulator.pow(power) / lr + s["2 * l2"]
        p.copy_((linear.clamp(-l1, l1) - linear) / quadratic)
        accumulator.copy_(new_accumulator)
