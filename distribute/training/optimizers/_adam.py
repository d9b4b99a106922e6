"""Keras 3's moment-based optimizers: Adam, AdamW, Adamax, Nadam, Lion, Adafactor.

Each class writes its hyperparameters, its `_scalars` and its `_update` (Keras's
``update_step``, ``keras/src/optimizers/<name>.py``, in the same order of
operations); the rest is `KerasOptimizer`'s (NOTE [Keras's step, in torch]).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from distribute.errors import InvalidArgumentError
from distribute.training.optimizers._base import (
    ClipOptions,
    Group,
    KerasOptimizer,
    KerasOptions,
    Scalars,
    State,
    cast,
    keras_defaults,
    scalar_sqrt,
    slot,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Adafactor", "Adam", "AdamW", "Adamax", "Lion", "Nadam"]


class Adam(KerasOptimizer):
    """Keras 3's Adam: epsilon added to ``sqrt(v)`` BEFORE the bias correction.

    ``var -= m * lr * sqrt(1 - beta_2**t) / (1 - beta_1**t) / (sqrt(v) + epsilon)``
    (torch's ``Adam`` adds epsilon after the correction: for a first gradient of
    1e-7, Keras steps -3.07e-5 and torch -5.0e-4). With ``amsgrad``, ``v`` is the
    running maximum of ``v``.

    Args:
        params: parameters or param groups.
        lr: the learning rate (Keras's ``learning_rate``, also accepted).
        beta_1: decay of the first moment.
        beta_2: decay of the second moment.
        epsilon: added to ``sqrt(v)``.
        amsgrad: use the maximum of the second moments so far.
        **options: Keras's base options, by keyword (`KerasOptions`).

    Example:
        >>> import torch, distribute as ds
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> opt = ds.optimizers.Adam([p])
        >>> p.grad = torch.tensor([1e-7])
        >>> opt.step()
        >>> round(p.item(), 9)
        -3.0653e-05
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | None = None,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        **options: Unpack[KerasOptions],
    ) -> None:
        defaults = keras_defaults(
            lr, 1e-3, options, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, amsgrad=amsgrad
        )
        super().__init__(params, defaults)

    def _scalars(self, group: Group, t: Tensor, lr: Tensor) -> dict[str, Tensor]:
        dtype = t.dtype
        beta_1_power = torch.pow(cast(group["beta_1"], dtype), t)
        beta_2_power = torch.pow(cast(group["beta_2"], dtype), t)
        return {
            "alpha": lr * scalar_sqrt(1 - beta_2_power) / (1 - beta_1_power),
            "1 - beta_1": cast(1 - group["beta_1"], dtype),  # Python's, as Keras's
            "1 - beta_2": cast(1 - group["beta_2"], dtype),
            "epsilon": cast(group["epsilon"], dtype),
        }

    def _update(self, p: Tensor, grad: Tensor, state: State, group: Group, s: Scalars) -> None:
        m, v = slot(state, "momentum", p), slot(state, "velocity", p)
        m.add_((grad - m).mul_(s["1 - beta_1"]))
        v.add_((grad.square() - v).mul_(s["1 - beta_2"]))
        if group["amsgrad"]:
            v_hat = slot(state, "velocity_hat", p)
            torch.maximum(v_hat, v, out=v_hat)
            v = v_hat
        p.sub_((m * s["alpha"]).div_(v.sqrt().add_(s["epsilon"])))


class AdamW(Adam):
    """Keras 3's AdamW: `Adam` with ``weight_decay`` 0.004 by default (decoupled:
    ``var -= var * weight_decay * lr`` before the Adam update).

    Args:
        params: parameters or param groups.
        lr: the learning rate (Keras's ``learning_rate``, also accepted).
        weight_decay: the decay; None is refused, as in Keras.
        beta_1: decay of the first moment.
        beta_2: decay of the second moment.
        epsilon: added to ``sqrt(v)``.
        amsgrad: use the maximum of the second moments so far.
        **options: Keras's other base options, by keyword (`ClipOptions`).

    Example:
        >>> import torch, distribute as ds
        >>> p = torch.nn.Parameter(torch.ones(1))
        >>> opt = ds.optimizers.AdamW([p], lr=0.1)
        >>> p.grad = torch.zeros(1)
        >>> opt.step()  # decay only: 1 - 1 * 0.004 * 0.1
        >>> round(p.item(), 6)
        0.9996
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | None = None,
        weight_decay: float = 0.004,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        **options: Unpack[ClipOptions],
    ) -> None:
        if weight_decay is None:
            raise InvalidArgumentError(
                "AdamW's weight_decay must be a float (Keras's default is 0.004), got None: "
                "pass a number, or use ds.optimizers.Adam for no decay"
            )
        super().__init__(
            params, lr, beta_1, beta_2, epsilon, amsgrad, weight_decay=weight_decay, **options
        )


class Adamax(KerasOptimizer):
    """Keras 3's Adamax: ``u = max(beta_2 * u, |g|)``,
    ``var -= lr * m / ((1 - beta_1**t) * (u + epsilon))``.

    Args:
        params: parameters or param groups.
        lr: the learning rate (Keras's ``learning_rate``, also accepted).
        beta_1: decay of the first moment.
        beta_2: decay of the infinity norm.
        epsilon: added to the norm.
        **options: Keras's base options, by keyword (`KerasOptions`).

    Example:
        >>> import torch, distribute as ds
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> opt = ds.optimizers.Adamax([p])
        >>> p.grad = torch.ones(1)
        >>> opt.step()
        >>> round(p.item(), 6)
        -0.001
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | None = None,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        **options: Unpack[KerasOptions],
    ) -> None:
        defaults = keras_defaults(lr, 1e-3, options, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)
        super().__init__(params, defaults)

    def _scalars(self, group: Group, t: Tensor, lr: Tensor) -> dict[str, Tensor]:
        dtype = t.dtype
        beta_1_power = torch.pow(cast(group["beta_1"], dtype), t)
        return {
            "1 - beta_1_power": 1 - beta_1_power,
            "1 - beta_1": cast(1 - group["beta_1"], dtype),  # Python's, as Keras's
            "beta_2": cast(group["beta_2"], dtype),
            "epsilon": cast(group["epsilon"], dtype),
        }

    def _update(self, p: Tensor, grad: Tensor, state: State, group: Group, s: Scalars) -> None:
        m, u = slot(state, "momentum", p), slot(state, "norm", p)
        m.add_((grad - m).mul_(s["1 - beta_1"]))
        torch.maximum(u * s["beta_2"], grad.abs(), out=u)
        p.sub_((m * s["lr"]).div_((u + s["epsilon"]).mul_(s["1 - beta_1_power"])))


class Nadam(KerasOptimizer):
    """Keras 3's Nadam (Dozat's, with the momentum schedule
    ``u_t = beta_1 * (1 - 0.5 * 0.96**t)`` and its running product ``u_product``).

    Args:
        params: parameters or param groups.
        lr: the learning rate (Keras's ``learning_rate``, also accepted).
        beta_1: decay of the first moment.
        beta_2: decay of the second moment.
        epsilon: added to ``sqrt(v_hat)``.
        **options: Keras's base options, by keyword (`KerasOptions`).

    Example:
        >>> import torch, distribute as ds
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> opt = ds.optimizers.Nadam([p])
        >>> p.grad = torch.ones(1)
        >>> opt.step()
        >>> round(p.item(), 6)  # m_hat = 1.0628, v_hat = 1
        -0.001063
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | None = None,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        **options: Unpack[KerasOptions],
    ) -> None:
        defaults = keras_defaults(lr, 1e-3, options, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)
        super().__init__(params, defaults)

    def _advance(self, p: Tensor, state: State, group: Group, step: int) -> None:
        # Keras's one `u_product` per optimizer (in the variables' dtype), advanced
        # once per step before any update: kept per parameter here, with the counter,
        # as a 0-dim CPU tensor (`load_state_dict` moves it to the parameter's device).
        product = state.get("u_product")
        if product is None:
            product = state["u_product"] = torch.tensor(1.0, dtype=p.dtype)
        elif product.device.type != "cpu":
            product = state["u_product"] = product.cpu()
        product.fill_(_next_u_product(float(product), group["beta_1"], step, product.dtype))

    def _scalars(self, group: Group, t: Tensor, lr: Tensor) -> dict[str, Tensor]:
        dtype = t.dtype
        decay = cast(0.96, dtype)  # Keras's momentum schedule: u_t = beta_1 * (1 - 0.5 * 0.96**t)
        beta_1, beta_2 = cast(group["beta_1"], dtype), cast(group["beta_2"], dtype)
        u_t = beta_1 * (1.0 - 0.5 * torch.pow(decay, t))
        return {
            "u_t": u_t,
            "1 - u_t": 1 - u_t,
            "u_t_1": beta_1 * (1.0 - 0.5 * torch.pow(decay, t + 1)),
            "1 - beta_1": 1 - beta_1,  # in the dtype: Keras's beta_1 is a tensor here
            "1 - beta_2": 1 - beta_2,
            "1 - beta_2_power": 1 - torch.pow(beta_2, t),
            "epsilon": cast(group["epsilon"], dtype),
        }

    def _update(self, p: Tensor, grad: Tensor, state: State, group: Group, s: Scalars) -> None:
        one_minus_u_product_t, one_minus_u_product_t_1 = _one_minus_u_products(
            float(state["u_product"]), s["u_t_1"], p.dtype
        )
        m, v = slot(state, "momentum", p), slot(state, "velocity", p)
        m.add_((grad - m).mul_(s["1 - beta_1"]))
        v.add_((grad.square() - v).mul_(s["1 - beta_2"]))
        m_hat = (m * s["u_t_1"]).div_(one_minus_u_product_t_1)
        m_hat.add_((grad * s["1 - u_t"]).div_(one_minus_u_product_t))
        v_hat = v / s["1 - beta_2_power"]
        p.sub_((m_hat * s["lr"]).div_(v_hat.sqrt_().add_(s["epsilon"])))


# Every parameter of a step asks for the same two: memoised (pure functions of numbers).
@functools.lru_cache(maxsize=256)
def _next_u_product(u_product: float, beta_1: float, step: int, dtype: torch.dtype) -> float:
    """Keras's ``u_product * beta_1 * (1.0 - 0.5 * 0.96**t)``, in ``dtype``."""
    decay = torch.pow(cast(0.96, dtype), cast(step, dtype))
    return float(cast(u_product, dtype) * cast(beta_1, dtype) * (1.0 - 0.5 * decay))


@functools.lru_cache(maxsize=256)
def _one_minus_u_products(
    u_product_t: float, u_t_1: float, dtype: torch.dtype
) -> tuple[float, float]:
    """Keras's ``1 - u_product_t`` and ``1 - u_product_t * u_t_1``, in ``dtype``."""
    product = cast(u_product_t, dtype)
    return float(1 - product), float(1 - product * cast(u_t_1, dtype))


class Lion(KerasOptimizer):
    """Keras 3's Lion: ``var -= lr * sign(beta_1 * m + (1 - beta_1) * g)``, then
    ``m = beta_2 * m + (1 - beta_2) * g``.

    Args:
        params: parameters or param groups.
        lr: the learning rate (Keras's ``learning_rate``, also accepted).
        beta_1: weight of the momentum in the update's sign, in (0, 1].
        beta_2: decay of the momentum.
        **options: Keras's base options, by keyword (`KerasOptions`).

    Example:
        >>> import torch, distribute as ds
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> opt = ds.optimizers.Lion([p])
        >>> p.grad = torch.tensor([0.5, -3.0])
        >>> opt.step()
        >>> p.tolist()
        [-0.0010000000474974513, 0.0010000000474974513]
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | None = None,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        **options: Unpack[KerasOptions],
    ) -> None:
        if not 0.0 < beta_1 <= 1.0:
            raise InvalidArgumentError(
                f"Lion's beta_1 must be in (0, 1] (else it is SignSGD), got {beta_1}"
            )
        defaults = keras_defaults(lr, 1e-3, options, beta_1=beta_1, beta_2=beta_2)
        super().__init__(params, defaults)

    def _scalars(self, group: Group, t: Tensor, lr: Tensor) -> dict[str, Tensor]:
        beta_1, beta_2 = cast(group["beta_1"], t.dtype), cast(group["beta_2"], t.dtype)
        # 1.0 - beta in the dtype: Keras's betas are tensors here.
        return {
            "beta_1": beta_1,
            "1 - beta_1": 1.0 - beta_1,
            "beta_2": beta_2,
            "1 - beta_2": 1.0 - beta_2,
        }

    def _update(self, p: Tensor, grad: Tensor, state: State, group: Group, s: Scalars) -> None:
        m = slot(state, "momentum", p)
        p.sub_(((m * s["beta_1"]).add_(grad * s["1 - beta_1"])).sign_().mul_(s["lr"]))
        m.mul_(s["beta_2"]).add_(grad * s["1 - beta_2"])


class Adafactor(KerasOptimizer):
    """Keras 3's Adafactor: the second moment of a parameter of 2 or more dimensions
    factored over its last two (row and column means), a relative step size.

    The learning rate is capped at ``1 / sqrt(t)`` (Keras's ``relative_step``, which
    Keras skips for a schedule object; a torch scheduler sets a number, so the cap
    applies).

    Args:
        params: parameters or param groups.
        lr: the learning rate (Keras's ``learning_rate``, also accepted).
        beta_2_decay: the second moment's decay is ``1 - t**beta_2_decay``.
        epsilon_1: added to the squared gradient.
        epsilon_2: the least parameter scale.
        clip_threshold: the update's RMS is clipped to this.
        relative_step: cap the learning rate at ``1 / sqrt(t)``.
        **options: Keras's base options, by keyword (`KerasOptions`).

    Example:
        >>> import torch, distribute as ds
        >>> p = torch.nn.Parameter(torch.ones(2, 2))
        >>> opt = ds.optimizers.Adafactor([p])
        >>> p.grad = torch.ones(2, 2)
        >>> opt.step()
        >>> round(p[0, 0].item(), 6)
        0.999
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | None = None,
        beta_2_decay: float = -0.8,
        epsilon_1: float = 1e-30,
        epsilon_2: float = 1e-3,
        clip_threshold: float = 1.0,
        relative_step: bool = True,
        **options: Unpack[KerasOptions],
    ) -> None:
        defaults = keras_defaults(
            lr,
            1e-3,
            options,
            beta_2_decay=beta_2_decay,
            epsilon_1=epsilon_1,
            epsilon_2=epsilon_2,
            clip_threshold=clip_threshold,
            relative_step=relative_step,
        )
        super().__init__(params, defaults)

    def _scalars(self, group: Group, t: Tensor, lr: Tensor) -> dict[str, Tensor]:
        dtype = t.dtype
        if group["relative_step"]:
            lr = torch.minimum(lr, 1 / scalar_sqrt(t))
        beta_2_t = 1 - torch.pow(t, cast(group["beta_2_decay"], dtype))
        return {
            "rho_t": torch.minimum(lr, 1 / scalar_sqrt(t)),
            "beta_2_t": beta_2_t,
            "1 - beta_2_t": 1 - beta_2_t,
            "epsilon_1": cast(group["epsilon_1"], dtype),
            "epsilon_2": cast(group["epsilon_2"], dtype),
            "clip_threshold": cast(group["clip_threshold"], dtype),
        }

    def _update(self, p: Tensor, grad: Tensor, state: State, group: Group, s: Scalars) -> None:
        beta_2_t, one_minus_beta_2_t = s["beta_2_t"], s["1 - beta_2_t"]
        alpha_t = torch.clamp(_rms(p), min=s["epsilon_2"]) * s["rho_t"]
        squared = grad.square().add_(s["epsilon_1"])
        v = slot(state, "velocity", p)
        if p.dim() >= 2:
            r = _factor(state, "r", p.shape[:-1], p)
            c = _factor(state, "c", (*p.shape[:-2], p.shape[-1]), p)
            r.mul_(beta_2_t).add_(squared.mean(dim=-1).mul_(one_minus_beta_2_t))
            c.mul_(beta_2_t).add_(squared.mean(dim=-2).mul_(one_minus_beta_2_t))
            v.copy_((r / r.mean(dim=-1, keepdim=True)).unsqueeze(-1) * c.unsqueeze(-2))
        else:
            v.mul_(beta_2_t).add_(squared.mul_(one_minus_beta_2_t))
        u_t = grad / v.sqrt()
        u_t_hat = u_t / torch.clamp(_rms(u_t) / s["clip_threshold"], min=1.0)
        p.sub_(u_t_hat * alpha_t)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.square().mean().sqrt()


def _factor(state: dict[str, Any], name: str, shape: Any, p: torch.Tensor) -> torch.Tensor:
    value = state.get(name)
    if value is None:
        value = state[name] = p.new_zeros(shape)
    return value
