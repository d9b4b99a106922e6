"""Keras names give Keras 3's optimizers: update rules and defaults (#23, item 3), in
Keras's arithmetic (#30).

Every rule is checked against Keras 3's formula written out here in NumPy
(``keras/src/optimizers/<name>.py`` and the base optimizer's clipping, weight decay
and iteration counting), in the variables' dtype and in Keras's order of
operations, never against TensorFlow at test time
(``benchmarks/bench_keras_optimizers.py`` runs TensorFlow's Keras itself).
"""

from __future__ import annotations

import copy
import doctest
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import distribute as ds
from distribute.training.optimizers import _adam, _base, _classic

# -- Keras 3's formulas, in NumPy --------------------------------------------------------

#: Keras 3's constructor defaults (keras/src/optimizers/*.py), ``learning_rate`` as ``lr``.
KERAS_DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 0.01, "momentum": 0.0, "nesterov": False},
    "adam": {"lr": 1e-3, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "amsgrad": False},
    "adamw": {
        "lr": 1e-3,
        "weight_decay": 0.004,
        "beta_1": 0.9,
        "beta_2": 0.999,
        "epsilon": 1e-7,
        "amsgrad": False,
    },
    "rmsprop": {"lr": 1e-3, "rho": 0.9, "momentum": 0.0, "epsilon": 1e-7, "centered": False},
    "adagrad": {"lr": 1e-3, "initial_accumulator_value": 0.1, "epsilon": 1e-7},
    "adamax": {"lr": 1e-3, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7},
    "nadam": {"lr": 1e-3, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7},
    "adadelta": {"lr": 1e-3, "rho": 0.95, "epsilon": 1e-7},
    "ftrl": {
        "lr": 1e-3,
        "learning_rate_power": -0.5,
        "initial_accumulator_value": 0.1,
        "l1_regularization_strength": 0.0,
        "l2_regularization_strength": 0.0,
        "l2_shrinkage_regularization_strength": 0.0,
        "beta": 0.0,
    },
    "lion": {"lr": 1e-3, "beta_1": 0.9, "beta_2": 0.99},
    "adafactor": {
        "lr": 1e-3,
        "beta_2_decay": -0.8,
        "epsilon_1": 1e-30,
        "epsilon_2": 1e-3,
        "clip_threshold": 1.0,
        "relative_step": True,
    },
}
BASE_DEFAULTS = {"weight_decay": None, "clipnorm": None, "clipvalue": None, "global_clipnorm": None}

Arrays = list[np.ndarray]


def _sqrt(x: Any) -> Any:
    """The square root of a scalar, correctly rounded as TensorFlow's, keeping its
    type (a Python float stays one)."""
    return type(x)(np.sqrt(x))


def _kernel_sqrt(x: np.ndarray) -> np.ndarray:
    """The square root of a tensor as torch's kernel computes it (on an x86 CPU MKL's,
    a unit in the last place off TensorFlow's correctly rounded one for about one
    element in six, for speed: NOTE [Keras's arithmetic, in the variable's dtype]).
    The reference pins Keras's arithmetic, not that kernel's last bit."""
    return torch.from_numpy(np.asarray(x)).sqrt().numpy()


def _rms(x: np.ndarray) -> Any:
    return _kernel_sqrt(np.mean(np.square(x)))


class KerasReference:
    """Keras 3's ``apply`` in NumPy: drop variables without a gradient, clip, decay
    (``var - var * wd * lr``), ``update_step`` each, ``iterations += 1``.

    In the variables' ``dtype``, as Keras computes: the learning rate is a float32
    variable cast to the dtype, the step ``iterations + 1`` is cast to it, powers are
    of scalars of the dtype (``self.x``), and a Python number meeting an array takes
    the array's dtype (NumPy 2's rule, as Keras's). Each formula keeps Keras's order
    of operations. ``python_scalars=True`` computes the scalars in Python floats
    (float64) instead, rounded where they meet an array: the arithmetic
    ``ds.optimizers`` had before #30, which drifts from Keras's.
    """

    def __init__(
        self,
        name: str,
        config: dict[str, Any],
        variables: Arrays,
        dtype: Any = np.float32,
        python_scalars: bool = False,
    ) -> None:
        self.name = name
        self.c = {**BASE_DEFAULTS, **KERAS_DEFAULTS[name], **config}
        self.dtype = np.dtype(dtype).type
        self.python_scalars = python_scalars
        self.vars = [v.astype(self.dtype) for v in variables]
        self.iterations = 0
        zeros = [np.zeros_like(v) for v in self.vars]
        self.s: dict[str, Arrays] = {
            k: copy.deepcopy(zeros) for k in ("m", "v", "vhat", "avg", "acc_d", "linear")
        }
        init = self.c.get("initial_accumulator_value", 0.0)
        self.s["acc"] = [np.full_like(v, init) for v in self.vars]
        self.r = [np.zeros(v.shape[:-1], self.dtype) if v.ndim >= 2 else None for v in self.vars]
        self.col = [
            np.zeros(v.shape[:-2] + v.shape[-1:], self.dtype) if v.ndim >= 2 else None
            for v in self.vars
        ]
        self.u_product = self.x(1.0)

    def x(self, value: float) -> Any:
        """A scalar as Keras has it, a number of the variables' dtype (``ops.cast``);
        a Python float with ``python_scalars``."""
        return float(value) if self.python_scalars else self.dtype(value)

    def apply(self, grads: list[np.ndarray | None], lr: float) -> None:
        c, x = self.c, self.x
        lr = float(lr) if self.python_scalars else self.dtype(np.float32(lr))
        present = {i: g.astype(self.dtype) for i, g in enumerate(grads) if g is not None}
        if c["clipnorm"]:
            for i, g in present.items():
                limit = x(c["clipnorm"])
                present[i] = g * limit / max(_kernel_sqrt(np.sum(g * g)), limit)
        elif c["global_clipnorm"]:
            limit = c["global_clipnorm"]
            if self.python_scalars:  # the norm in float64
                norm = math.sqrt(
                    sum(float(np.sum(np.square(g, dtype=float))) for g in present.values())
                )
            else:
                norm = _kernel_sqrt(np.sum(np.stack([np.sum(g * g) for g in present.values()])))
            scale = x(limit) * min(1 / norm, x(1.0 / limit)) + (norm - norm)
            present = {i: g * scale for i, g in present.items()}
        elif c["clipvalue"]:
            present = {i: np.clip(g, -c["clipvalue"], c["clipvalue"]) for i, g in present.items()}
        if c["weight_decay"] is not None:
            for i in present:
                self.vars[i] = self.vars[i] - self.vars[i] * x(c["weight_decay"]) * lr
        t = x(self.iterations + 1)
        if self.name == "nadam":  # Keras's _backend_update_step, before the updates
            self.u_product = self.u_product * x(c["beta_1"]) * (1.0 - 0.5 * x(0.96) ** t)
        for i, g in present.items():
            self.vars[i] = getattr(self, f"_{self.name}")(i, self.vars[i], g, lr, t)
        self.iterations += 1

    def _sgd(self, i: int, var: np.ndarray, g: np.ndarray, lr: Any, t: Any) -> np.ndarray:
        if self.c["momentum"] == 0:
            return var - g * lr
        momentum = self.x(self.c["momentum"])
        m = self.s["m"][i] = self.s["m"][i] * momentum - g * lr
        return var + (m * momentum - g * lr if self.c["nesterov"] else m)

    def _adam(self, i: int, var: np.ndarray, g: np.ndarray, lr: Any, t: Any) -> np.ndarray:
        b1, b2 = self.c["beta_1"], self.c["beta_2"]
        alpha = lr * _sqrt(1 - self.x(b2) ** t) / (1 - self.x(b1) ** t)
        m = self.s["m"][i] = self.s["m"][i] + (g - self.s["m"][i]) * (1 - b1)
        v = self.s["v"][i] = self.s["v"][i] + (g * g - self.s["v"][i]) * (1 - b2)
        if self.c["amsgrad"]:
            v = self.s["vhat"][i] = np.maximum(self.s["vhat"][i], v)
        return var - m * alpha / (_kernel_sqrt(v) + self.c["epsilon"])

    _adamw = _adam

    def _rmsprop(self, i: int, var: np.ndarray, g: np.ndarray, lr: Any, t: Any) -> np.ndarray:
        rho, eps = self.c["rho"], self.c["epsilon"]
        vel = self.s["v"][i] = rho * self.s["v"][i] + (1 - rho) * (g * g)
        if self.c["centered"]:
            avg = self.s["avg"][i] = rho * self.s["avg"][i] + (1 - rho) * g
            denominator = vel - avg * avg + eps
        else:
            denominator = vel + eps
        increment = lr * g / _kernel_sqrt(denominator)
        if self.c["momentum"] > 0:
            m = self.s["m"][i] = self.c["momentum"] * self.s["m"][i] + increment
            return var - m
        return var - increment

    def _adagrad(self, i: int, var: np.ndarray, g: np.ndarray, lr: Any, t: Any) -> np.ndarray:
        acc = self.s["acc"][i] = self.s["acc"][i] + g * g
        return var - lr * g / _kernel_sqrt(acc + self.c["epsilon"])

    def _adamax(self, i: int, var: np.ndarray, g: np.ndarray, lr: Any, t: Any) -> np.ndarray:
        b1, b2 = self.c["beta_1"], self.c["beta_2"]
        beta_1_power = self.x(b1) ** t
        m = self.s["m"][i] = self.s["m"][i] + (g - self.s["m"][i]) * (1 - b1)
        u = self.s["v"][i] = np.maximum(b2 * self.s["v"][i], np.abs(g))
        return var - lr * m / ((1 - beta_1_power) * (u + self.c["epsilon"]))

    def _nadam(self, i: int, var: np.ndarray, g: np.ndarray, lr: Any, t: Any) -> np.ndarray:
        b1, b2, decay = self.x(self.c["beta_1"]), self.x(self.c["beta_2"]), self.x(0.96)
        u_t = b1 * (1.0 - 0.5 * decay**t)
        u_t_1 = b1 * (1.0 - 0.5 * decay ** (t + 1))
        u_product_t_1 = self.u_product * u_t_1
        m = self.s["m"][i] = self.s["m"][i] + (g - self.s["m"][i]) * (1 - b1)
        v = self.s["v"][i] = self.s["v"][i] + (g * g - self.s["v"][i]) * (1 - b2)
        m_hat = u_t_1 * m / (1 - u_product_t_1) + (1 - u_t) * g / (1 - self.u_product)
        v_hat = v / (1 - b2**t)
        return var - m_hat * lr / (_kernel_sqrt(v_hat) + self.c["epsilon"])

    def _adadelta(self, i: int, var: np.ndarray, g: np.ndarray, lr: Any, t: Any) -> np.ndarray:
        rho, eps = self.c["rho"], self.c["epsilon"]
        acc_g = self.s["acc"][i] = rho * self.s["acc"][i] + (1 - rho) * (g * g)
        delta = -(_kernel_sqrt(self.s["acc_d"][i] + eps) * g / _kernel_sqrt(acc_g + eps))
        self.s["acc_d"][i] = rho * self.s["acc_d"][i] + (1 - rho) * (delta * delta)
        return var + lr * delta

    def _ftrl(self, i: int, var: np.ndarray, g: np.ndarray, lr: Any, t: Any) -> np.ndarray:
        c, x = self.c, self.x
        power = x(-c["learning_rate_power"])
        l1 = c["l1_regularization_strength"]
        l2 = x(c["l2_regularization_strength"]) + x(c["beta"]) / (2.0 * lr)
        acc = self.s["acc"][i]
        new_acc = acc + g * g
        grad_to_use = g + 2 * c["l2_shrinkage_regularization_strength"] * var
        self.s["linear"][i] = self.s["linear"][i] + (
            grad_to_use - (new_acc**power - acc**power) / lr * var
        )
        linear = self.s["linear"][i]
        quadratic = new_acc**power / lr + 2 * l2
        self.s["acc"][i] = new_acc
        return (np.clip(linear, -l1, l1) - linear) / quadratic

    def _lion(self, i: int, var: np.ndarray, g: np.ndarray, lr: Any, t: Any) -> np.ndarray:
        b1, b2 = self.x(self.c["beta_1"]), self.x(self.c["beta_2"])
        out = var - lr * np.sign(self.s["m"][i] * b1 + g * (1.0 - b1))
        self.s["m"][i] = self.s["m"][i] * b2 + g * (1.0 - b2)
        return out

    def _adafactor(self, i: int, var: np.ndarray, g: np.ndarray, lr: Any, t: Any) -> np.ndarray:
        c, x = self.c, self.x
        if c["relative_step"]:
            lr = min(lr, 1 / _sqrt(t))
        rho_t = min(lr, 1 / _sqrt(t))
        alpha_t = max(x(c["epsilon_2"]), _rms(var)) * rho_t
        sq = g * g + c["epsilon_1"]
        beta_2_t = 1 - t ** x(c["beta_2_decay"])
        if var.ndim >= 2:
            r = self.r[i] = beta_2_t * self.r[i] + (1 - beta_2_t) * sq.mean(axis=-1)
            col = self.col[i] = beta_2_t * self.col[i] + (1 - beta_2_t) * sq.mean(axis=-2)
            v = (r / r.mean(axis=-1, keepdims=True))[..., None] * col[..., None, :]
        else:
            v = self.s["v"][i] = beta_2_t * self.s["v"][i] + (1 - beta_2_t) * sq
        u_t = g / _kernel_sqrt(v)
        u_t_hat = u_t / max(x(1.0), _rms(u_t) / c["clip_threshold"])
        return var - alpha_t * u_t_hat


def _ulps(got: np.ndarray, expected: np.ndarray) -> float:
    """How far apart, in units in the last place of ``expected``'s dtype (0: bitwise,
    NaN where the other has NaN too)."""
    assert got.dtype == expected.dtype
    if np.array_equal(got, expected, equal_nan=True):
        return 0.0
    if not np.array_equal(np.isnan(got), np.isnan(expected)):
        return math.inf
    spacing = np.spacing(np.abs(expected)).astype(np.float64)
    return float(np.nanmax(np.abs(got.astype(np.float64) - expected.astype(np.float64)) / spacing))


# -- the cases ---------------------------------------------------------------------------

CASES: list[tuple[str, dict[str, Any]]] = [
    ("sgd", {}),
    ("sgd", {"momentum": 0.9}),
    ("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01, "clipnorm": 0.5}),
    ("adam", {}),
    ("adam", {"amsgrad": True}),
    ("adam", {"weight_decay": 0.1, "global_clipnorm": 0.5}),
    ("adamw", {}),
    ("adamw", {"clipvalue": 0.05, "amsgrad": True}),
    ("rmsprop", {}),
    ("rmsprop", {"momentum": 0.9}),
    ("rmsprop", {"centered": True}),
    ("rmsprop", {"centered": True, "momentum": 0.5, "weight_decay": 0.01}),
    ("adagrad", {}),
    ("adagrad", {"initial_accumulator_value": 0.5, "epsilon": 1e-3}),
    ("adamax", {}),
    ("adamax", {"weight_decay": 0.05}),
    ("nadam", {}),
    ("nadam", {"beta_1": 0.8, "clipnorm": 0.1}),
    ("adadelta", {}),
    ("adadelta", {"lr": 1.0, "rho": 0.9}),
    ("ftrl", {}),
    (
        "ftrl",
        {
            "l1_regularization_strength": 0.01,
            "l2_regularization_strength": 0.02,
            "l2_shrinkage_regularization_strength": 0.03,
            "beta": 0.1,
            "learning_rate_power": -0.7,
        },
    ),
    ("lion", {}),
    ("lion", {"weight_decay": 0.1, "beta_1": 0.5}),
    ("adafactor", {}),
    ("adafactor", {"relative_step": False, "lr": 0.01, "clip_threshold": 0.5}),
]
SHAPES = [(3,), (2, 3), (2, 2, 3)]
STEPS = 6
SKIPPED = (2, 1)  # at step 2, variable 1 has no gradient


def _problem(seed: int = 0) -> tuple[Arrays, list[list[np.ndarray | None]], list[float]]:
    """Initial values, gradients per step (one missing; variable 0's tiny, where
    epsilon's place decides the step, and its values small enough for float32 to
    show those steps), and a rate per step (halved midway, as a schedule would)."""
    rng = np.random.default_rng(seed)
    initial = [rng.normal(size=s) for s in SHAPES]
    initial[0] = initial[0] * 1e-4
    grads: list[list[np.ndarray | None]] = []
    for step in range(STEPS):
        row: list[np.ndarray | None] = [rng.normal(size=s) for s in SHAPES]
        row[0] = row[0] * 1e-7  # type: ignore[operator]  # never None here
        if step == SKIPPED[0]:
            row[SKIPPED[1]] = None
        grads.append(row)
    return initial, grads, [1.0] * 3 + [0.5] * 3


def _run_torch(
    name: str,
    config: dict[str, Any],
    initial: Arrays,
    grads: Any,
    scales: list[float],
    dtype: torch.dtype = torch.float32,
) -> tuple[Arrays, torch.optim.Optimizer]:
    params = [torch.nn.Parameter(torch.tensor(v, dtype=dtype)) for v in initial]
    optimizer = ds.optimizers.get(name, params)
    for group in optimizer.param_groups:
        group.update(config)
    base = optimizer.param_groups[0]["lr"]
    for row, scale in zip(grads, scales):
        for group in optimizer.param_groups:
            group["lr"] = base * scale
        for p, g in zip(params, row):
            p.grad = None if g is None else torch.tensor(g, dtype=dtype)
        optimizer.step()
    return [p.detach().numpy() for p in params], optimizer


def _run_reference(
    name: str,
    config: dict[str, Any],
    initial: Arrays,
    grads: Any,
    scales: list[float],
    dtype: Any = np.float32,
    python_scalars: bool = False,
) -> KerasReference:
    reference = KerasReference(name, config, initial, dtype, python_scalars)
    lr = reference.c["lr"]
    with np.errstate(invalid="ignore", divide="ignore"):  # half's 0 / 0 is Keras's NaN too
        for row, scale in zip(grads, scales):
            reference.apply([None if g is None else g.astype(dtype) for g in row], lr * scale)
    return reference


DTYPES = {
    "float32": (torch.float32, np.float32),
    "float64": (torch.float64, np.float64),
    "float16": (torch.float16, np.float16),
}


def _assert_keras_numbers(name: str, config: dict[str, Any], got: Arrays, expected: Arrays) -> None:
    """Bitwise where every operation is elementwise. A reduction (a norm, Adafactor's
    means) may sum in another order in NumPy than in torch, and a tensor power
    (Ftrl's) may round otherwise in the last place, which Ftrl's ``clip(linear) -
    linear`` can magnify: there, within 64 units in the last place of the largest
    value."""
    reduces = (
        name in ("adafactor", "ftrl") or config.get("clipnorm") or config.get("global_clipnorm")
    )
    for g, e in zip(got, expected):
        if not reduces:
            assert _ulps(g, e) == 0, f"{_ulps(g, e)} units in the last place apart"
        else:
            eps = float(np.finfo(e.dtype).eps)
            scale = float(np.max(np.abs(e)))
            np.testing.assert_allclose(g, e, rtol=64 * eps, atol=64 * eps * scale)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("name", "config"), CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_every_keras_name_follows_keras_3s_formula_step_by_step_in_the_variables_dtype(
    name: str, config: dict[str, Any], dtype: str
) -> None:
    """float32 is Keras's default; float16 shows every scalar rounded to the
    variable's dtype (torch keeps a Python number in float32 in a half op); float64
    the learning rate rounded to float32 (Keras's is a float32 variable)."""
    initial, grads, scales = _problem()
    expected = _run_reference(name, config, initial, grads, scales, DTYPES[dtype][1]).vars
    got, _ = _run_torch(name, config, initial, grads, scales, DTYPES[dtype][0])
    _assert_keras_numbers(name, config, got, expected)
    if dtype != "float16":  # half rounds the steps of 1e-7 gradients (Adadelta's all) away
        assert all(not np.array_equal(g, v0.astype(g.dtype)) for g, v0 in zip(got, initial))


#: Where Python floats (float64) give float32 variables Keras's numbers anyway: their
#: scalars are Python numbers meeting arrays. Elsewhere powers of the step (bias
#: corrections, Nadam's schedule, Adafactor's decay) and ``1 - beta`` of a dtype tensor
#: (Nadam's, Lion's momentum) round otherwise. In float64 every optimizer differs:
#: Keras's learning rate is a float32 variable.
SAME_IN_FLOAT32 = {"sgd", "rmsprop", "adagrad", "adadelta"}
LONG_RUN = {"float32": 3000, "float64": 300}


@pytest.mark.parametrize("dtype", list(LONG_RUN))
@pytest.mark.parametrize("name", sorted(KERAS_DEFAULTS))
def test_thousands_of_steps_keep_keras_dtype_arithmetic_where_python_floats_drift(
    name: str, dtype: str
) -> None:
    """Over 3,000 steps (float32; ``1 - 0.999**t`` in float32 differs from float64's
    rounded at every one of them) each optimizer's variable and first moment stay on
    Keras's numbers, and the same formulas with Python-float scalars (the arithmetic
    before #30) fail that same check. In float32 Adafactor's and Ftrl's drift is
    inside the margin their reductions and powers need: the next test pins their
    scalars bit for bit."""
    config = {"beta": 1.0} if name == "ftrl" else {}  # Ftrl's beta / (2 * lr) rounds
    steps, (torch_dtype, np_dtype) = LONG_RUN[dtype], DTYPES[dtype]
    rng = np.random.default_rng(7)
    initial = [rng.normal(size=(2, 4)).astype(np_dtype)]
    grads = [[rng.normal(size=(2, 4)).astype(np_dtype)] for _ in range(steps)]
    scales = [1.0] * steps
    got, optimizer = _run_torch(name, config, initial, grads, scales, torch_dtype)
    state = next(iter(optimizer.state.values()))
    has_momentum = "momentum" in state
    if has_momentum:  # Lion's drift shows in its momentum: its step is lr * sign(...)
        got.append(state["momentum"].numpy())

    def numbers(reference: KerasReference) -> Arrays:
        return reference.vars + reference.s["m"][:1] if has_momentum else reference.vars

    keras = numbers(_run_reference(name, config, initial, grads, scales, np_dtype))
    _assert_keras_numbers(name, config, got, keras)
    python = numbers(_run_reference(name, config, initial, grads, scales, np_dtype, True))
    if dtype == "float32" and name in SAME_IN_FLOAT32:
        assert all(_ulps(p, k) == 0 for p, k in zip(python, keras))
    elif dtype == "float64" or name not in ("adafactor", "ftrl"):
        with pytest.raises(AssertionError):
            _assert_keras_numbers(name, config, python, keras)


def _step_scalars(name: str, t: int, python_floats: bool = False) -> dict[str, Any]:
    """The scalars of step ``t`` that Keras computes from the step or from dtype
    tensors (Keras's defaults; Ftrl's beta 1.0), in float32 as Keras, or in Python
    floats (float64)."""
    c = {**KERAS_DEFAULTS[name], **({"beta": 1.0} if name == "ftrl" else {})}
    x: Callable[[float], Any] = float if python_floats else np.float32
    sqrt: Callable[[Any], Any] = math.sqrt if python_floats else np.sqrt
    step, lr = x(t), x(np.float32(c["lr"]) if not python_floats else c["lr"])
    if name == "adamax":
        return {"1 - beta_1_power": 1 - x(c["beta_1"]) ** step}
    if name == "nadam":
        beta_1, beta_2, decay = x(c["beta_1"]), x(c["beta_2"]), x(0.96)
        u_t = beta_1 * (1.0 - 0.5 * decay**step)
        return {
            "u_t": u_t,
            "1 - u_t": 1 - u_t,
            "u_t_1": beta_1 * (1.0 - 0.5 * decay ** (step + 1)),
            "1 - beta_1": 1 - beta_1,
            "1 - beta_2": 1 - beta_2,
            "1 - beta_2_power": 1 - beta_2**step,
        }
    if name == "lion":
        return {"1 - beta_1": 1.0 - x(c["beta_1"]), "1 - beta_2": 1.0 - x(c["beta_2"])}
    if name == "adafactor":
        lr = min(lr, 1 / sqrt(step))  # relative_step
        beta_2_t = 1 - step ** x(c["beta_2_decay"])
        return {
            "rho_t": min(lr, 1 / sqrt(step)),
            "beta_2_t": beta_2_t,
            "1 - beta_2_t": 1 - beta_2_t,
        }
    assert name == "ftrl"
    return {"2 * l2": 2 * (x(c["l2_regularization_strength"]) + x(c["beta"]) / (2.0 * lr))}


@pytest.mark.parametrize("name", ["adamax", "nadam", "lion", "adafactor", "ftrl"])
def test_step_scalars_are_keras_float32_arithmetic_where_python_floats_round_otherwise(
    name: str,
) -> None:
    optimizer = ds.optimizers.get(name, [torch.nn.Parameter(torch.zeros(1))])
    group = optimizer.param_groups[0]
    if name == "ftrl":
        group["beta"] = 1.0
    differ = 0
    for t in range(1, 3001):
        got = optimizer._step_scalars(group, t, torch.float32)
        python = _step_scalars(name, t, python_floats=True)
        for key, keras in _step_scalars(name, t).items():
            assert got[key] == float(keras), (key, t)
            differ += got[key] != float(np.float32(python[key]))
    assert differ > 0


def test_adams_bias_correction_is_keras_float32_arithmetic_at_every_step_to_3000() -> None:
    """``alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)`` as Keras computes it,
    in float32 tensors, bit for bit; in Python floats it differs at most steps."""
    adam = ds.optimizers.Adam([torch.nn.Parameter(torch.zeros(1))])
    group, f32 = adam.param_groups[0], np.float32
    differs = 0
    for t in range(1, 3001):
        got = adam._step_scalars(group, t, torch.float32)["alpha"]
        keras = f32(1e-3) * np.sqrt(1 - f32(0.999) ** f32(t)) / (1 - f32(0.9) ** f32(t))
        assert got == float(keras), t
        differs += float(f32(1e-3 * math.sqrt(1 - 0.999**t) / (1 - 0.9**t))) != got
    assert differs > 2000


def test_every_name_compile_accepts_has_keras_defaults() -> None:
    assert set(ds.optimizers.OPTIMIZERS) == set(KERAS_DEFAULTS)  # a new name needs a row
    torch.manual_seed(0)
    for name, defaults in KERAS_DEFAULTS.items():
        model = ds.Model(torch.nn.Linear(2, 1))
        model.compile(optimizer=name.upper() if name == "sgd" else name, loss="mse")
        group = model.optimizer.param_groups[0]  # type: ignore[union-attr]
        assert type(model.optimizer).__name__.lower() == name
        assert {k: group[k] for k in {**BASE_DEFAULTS, **defaults}} == {
            **BASE_DEFAULTS,
            **defaults,
        }, name


def test_keras_adam_steps_3_07e_5_on_a_first_gradient_of_1e_7_where_torch_steps_5e_4() -> None:
    keras_p = torch.nn.Parameter(torch.zeros(1))
    torch_p = torch.nn.Parameter(torch.zeros(1))
    model = ds.Model(torch.nn.Linear(1, 1))
    model.compile(optimizer="adam", loss="mse")
    keras_adam = ds.training.losses.get_optimizer("adam", [keras_p])
    torch_adam = torch.optim.Adam([torch_p], lr=1e-3, eps=1e-7)
    for p, optimizer in ((keras_p, keras_adam), (torch_p, torch_adam)):
        p.grad = torch.tensor([1e-7])
        optimizer.step()
    # Keras, in float32: alpha * m / (sqrt(v) + 1e-7), alpha = lr * sqrt(1 - 0.999) / (1 - 0.9)
    f32, g = np.float32, np.float32(1e-7)
    alpha = f32(1e-3) * np.sqrt(1 - f32(0.999)) / (1 - f32(0.9))
    expected = -(g * f32(1 - 0.9) * alpha) / (_kernel_sqrt(g * g * f32(1 - 0.999)) + f32(1e-7))
    assert keras_p.item() == float(expected)
    assert keras_p.item() == pytest.approx(-3.07e-5, abs=5e-8)
    assert torch_p.item() == pytest.approx(-5.0e-4, rel=1e-3)  # torch's rule, kept for objects


def test_a_torch_optimizer_passed_to_compile_is_used_as_it_is() -> None:
    model = ds.Model(torch.nn.Linear(1, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    model.compile(optimizer=optimizer, loss="mse")
    assert model.optimizer is optimizer
    model.compile(optimizer=lambda p: torch.optim.RMSprop(p), loss="mse")
    assert type(model.optimizer) is torch.optim.RMSprop


@pytest.mark.parametrize("name", sorted(KERAS_DEFAULTS))
def test_state_dict_round_trips_mid_training(name: str) -> None:
    initial, grads, _ = _problem(1)

    def params() -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.tensor(v, dtype=torch.float32)) for v in initial]

    def step(ps: list[torch.nn.Parameter], opt: torch.optim.Optimizer, row: Any) -> None:
        for p, g in zip(ps, row):
            p.grad = None if g is None else torch.tensor(g, dtype=torch.float32)
        opt.step()

    straight = params()
    first = ds.optimizers.get(name, straight)
    for row in grads:
        step(straight, first, row)
    resumed = params()
    before = ds.optimizers.get(name, resumed)
    for row in grads[:3]:
        step(resumed, before, row)
    saved = copy.deepcopy(before.state_dict())
    again = [torch.nn.Parameter(p.detach().clone()) for p in resumed]
    after = ds.optimizers.get(name, again)
    after.load_state_dict(saved)
    for row in grads[3:]:
        step(again, after, row)
    for a, b in zip(straight, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all("step" in s for s in after.state.values())
    assert all("step" not in g for g in after.param_groups)  # counters are per parameter


def test_a_checkpoint_restores_nadams_state_under_mirrored(tmp_path: Path) -> None:
    def build(strategy: ds.Strategy) -> ds.Model:
        torch.manual_seed(0)
        with strategy.scope():
            model = ds.Model(torch.nn.Linear(3, 2))
        model.compile(optimizer="nadam", loss="mse")
        return model

    x = np.random.default_rng(0).normal(size=(24, 3)).astype(np.float32)
    y = x[:, :2] * 2.0
    straight = build(ds.MirroredStrategy(["cpu:0", "cpu:1"]))
    straight.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    first = build(ds.MirroredStrategy(["cpu:0", "cpu:1"]))
    first.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = ds.Checkpoint(model=first, optimizer=first.optimizer).save(str(tmp_path / "ckpt"))
    second = build(ds.get_strategy())
    ds.Checkpoint(model=second, optimizer=second.optimizer).restore(path)
    second.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for (k, a), b in zip(straight.state_dict().items(), second.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=k)


def test_torch_lr_schedulers_drive_the_rate() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = ds.optimizers.SGD([p], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(3):
        p.grad = torch.ones(1)
        optimizer.step()
        scheduler.step()
    assert p.item() == pytest.approx(-(0.1 + 0.05 + 0.025))


def test_misuse_says_what_to_do() -> None:
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ds.errors.InvalidArgumentError, match=r"unknown optimizer 'adamm'.*adam"):
        ds.optimizers.get("adamm", p)
    with pytest.raises(ds.errors.InvalidArgumentError, match="at most one of clipnorm"):
        ds.optimizers.Adam(p, clipnorm=1.0, clipvalue=0.5)
    with pytest.raises(ValueError, match="weight_decay must be a float"):
        ds.optimizers.AdamW(p, weight_decay=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass one"):
        ds.optimizers.SGD(p, lr=0.1, learning_rate=0.2)
    with pytest.raises(ValueError, match="momentum must be in"):
        ds.optimizers.SGD(p, momentum=1.5)
    assert ds.optimizers.RMSprop(p, learning_rate=0.2).param_groups[0]["lr"] == 0.2


@pytest.mark.parametrize(
    "module", [_adam, _base, _classic, ds.optimizers], ids=lambda m: m.__name__
)
def test_the_docstring_examples_hold(module: Any) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# -- ds.Model.fit with a Keras name, under the default strategy and Mirrored --------------


def _fit_data() -> tuple[np.ndarray, np.ndarray]:
    """Small features: the first layer's gradients are ~1e-5, where Keras's and
    torch's epsilon placements give clearly different Adam steps."""
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(40, 4)) * 1e-4).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    return x, y


def _reference_fit(
    initial: dict[str, torch.Tensor],
    make_apply: Callable[[list[torch.nn.Parameter]], Callable[[], None]],
) -> dict[str, torch.Tensor]:
    """One device by hand: each global batch of 8 in order, then ``apply()``, made
    by ``make_apply`` over the network's parameters (which hold their gradients)."""
    net = torch.nn.Linear(4, 3)
    net.load_state_dict(initial)
    apply = make_apply(list(net.parameters()))
    x, y = _fit_data()
    for start in range(0, len(x), 8):
        net.zero_grad()
        batch = torch.as_tensor(x[start : start + 8]), torch.as_tensor(y[start : start + 8])
        torch.nn.functional.cross_entropy(net(batch[0]), batch[1]).backward()
        apply()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _keras_by_hand(name: str) -> Callable[[list[torch.nn.Parameter]], Callable[[], None]]:
    def make(params: list[torch.nn.Parameter]) -> Callable[[], None]:
        keras = KerasReference(name, {}, [p.detach().numpy() for p in params])

        def apply() -> None:
            keras.apply([p.grad.numpy() for p in params], keras.c["lr"])  # type: ignore[union-attr]
            with torch.no_grad():
                for p, v in zip(params, keras.vars):
                    p.copy_(torch.as_tensor(v))

        return apply

    return make


def _torch_adam_by_hand(params: list[torch.nn.Parameter]) -> Callable[[], None]:
    optimizer = torch.optim.Adam(params, eps=1e-7)
    return lambda: optimizer.step()  # type: ignore[func-returns-value]


@pytest.mark.parametrize("strategy", ["default", "mirrored_2"])
@pytest.mark.parametrize("optimizer", ["adam", "nadam", "torch_adam"])
def test_fit_with_a_keras_name_gives_keras_weights_under_every_strategy(
    strategy: str, optimizer: str
) -> None:
    """A Keras name gives Keras's weights (a torch object torch's), and the
    strategy changes nothing."""
    made = ds.get_strategy() if strategy == "default" else ds.MirroredStrategy(["cpu:0", "cpu:1"])
    torch.manual_seed(0)
    with made.scope():
        model = ds.Model(torch.nn.Linear(4, 3))
    initial = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    if optimizer == "torch_adam":
        model.compile(torch.optim.Adam(model.parameters(), eps=1e-7), torch.nn.CrossEntropyLoss())
        expected = _reference_fit(initial, _torch_adam_by_hand)
    else:
        model.compile(optimizer, torch.nn.CrossEntropyLoss())
        expected = _reference_fit(initial, _keras_by_hand(optimizer))
    x, y = _fit_data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for key, value in model.module.state_dict().items():
        torch.testing.assert_close(value.detach(), expected[key], rtol=1e-5, atol=1e-7, msg=key)
