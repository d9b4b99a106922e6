"""Keras names give Keras 3's optimizers: update rules and defaults (#23, item 3).

Every rule is checked against Keras 3's formula written out here in NumPy
(``keras/src/optimizers/<name>.py`` and the base optimizer's clipping, weight decay
and iteration counting), never against TensorFlow at test time.
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


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x))))


class KerasReference:
    """Keras 3's ``apply``, in float64 NumPy: drop variables without a gradient,
    clip, decay (``var - var * wd * lr``), ``update_step`` each, ``iterations += 1``."""

    def __init__(self, name: str, config: dict[str, Any], variables: Arrays) -> None:
        self.name = name
        self.c = {**BASE_DEFAULTS, **KERAS_DEFAULTS[name], **config}
        self.vars = [v.astype(np.float64).copy() for v in variables]
        self.iterations = 0
        zeros = [np.zeros_like(v) for v in self.vars]
        self.s: dict[str, Arrays] = {
            k: copy.deepcopy(zeros) for k in ("m", "v", "vhat", "avg", "acc_d", "linear")
        }
        init = self.c.get("initial_accumulator_value", 0.0)
        self.s["acc"] = [np.full_like(v, init) for v in self.vars]
        self.r = [np.zeros(v.shape[:-1]) if v.ndim >= 2 else None for v in self.vars]
        self.col = [
            np.zeros(v.shape[:-2] + v.shape[-1:]) if v.ndim >= 2 else None for v in self.vars
        ]
        self.u_product = 1.0

    def apply(self, grads: list[np.ndarray | None], lr: float) -> None:
        c = self.c
        present = {i: g.astype(np.float64) for i, g in enumerate(grads) if g is not None}
        if c["clipnorm"]:
            for i, g in present.items():
                present[i] = g * c["clipnorm"] / max(np.sqrt(np.sum(g * g)), c["clipnorm"])
        elif c["global_clipnorm"]:
            norm = np.sqrt(sum(np.sum(g * g) for g in present.values()))
            scale = c["global_clipnorm"] * min(1.0 / norm, 1.0 / c["global_clipnorm"])
            present = {i: g * scale for i, g in present.items()}
        elif c["clipvalue"]:
            present = {i: np.clip(g, -c["clipvalue"], c["clipvalue"]) for i, g in present.items()}
        if c["weight_decay"] is not None:
            for i in present:
                self.vars[i] = self.vars[i] - self.vars[i] * c["weight_decay"] * lr
        t = self.iterations + 1
        if self.name == "nadam":
            self.u_product *= c["beta_1"] * (1.0 - 0.5 * 0.96**t)
        for i, g in present.items():
            self.vars[i] = getattr(self, f"_{self.name}")(i, self.vars[i], g, lr, t)
        self.iterations += 1

    def _sgd(self, i: int, var: np.ndarray, g: np.ndarray, lr: float, t: int) -> np.ndarray:
        mom = self.c["momentum"]
        if mom == 0:
            return var - g * lr
        m = self.s["m"][i] = self.s["m"][i] * mom - g * lr
        return var + (m * mom - g * lr if self.c["nesterov"] else m)

    def _adam(self, i: int, var: np.ndarray, g: np.ndarray, lr: float, t: int) -> np.ndarray:
        b1, b2 = self.c["beta_1"], self.c["beta_2"]
        alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        m = self.s["m"][i] = self.s["m"][i] + (g - self.s["m"][i]) * (1 - b1)
        v = self.s["v"][i] = self.s["v"][i] + (g * g - self.s["v"][i]) * (1 - b2)
        if self.c["amsgrad"]:
            v = self.s["vhat"][i] = np.maximum(self.s["vhat"][i], v)
        return var - m * alpha / (np.sqrt(v) + self.c["epsilon"])

    _adamw = _adam

    def _rmsprop(self, i: int, var: np.ndarray, g: np.ndarray, lr: float, t: int) -> np.ndarray:
        rho, eps = self.c["rho"], self.c["epsilon"]
        vel = self.s["v"][i] = rho * self.s["v"][i] + (1 - rho) * g * g
        if self.c["centered"]:
            avg = self.s["avg"][i] = rho * self.s["avg"][i] + (1 - rho) * g
            denominator = vel - avg * avg + eps
        else:
            denominator = vel + eps
        increment = lr * g / np.sqrt(denominator)
        if self.c["momentum"] > 0:
            m = self.s["m"][i] = self.c["momentum"] * self.s["m"][i] + increment
            return var - m
        return var - increment

    def _adagrad(self, i: int, var: np.ndarray, g: np.ndarray, lr: float, t: int) -> np.ndarray:
        acc = self.s["acc"][i] = self.s["acc"][i] + g * g
        return var - lr * g / np.sqrt(acc + self.c["epsilon"])

    def _adamax(self, i: int, var: np.ndarray, g: np.ndarray, lr: float, t: int) -> np.ndarray:
        b1, b2 = self.c["beta_1"], self.c["beta_2"]
        m = self.s["m"][i] = self.s["m"][i] + (g - self.s["m"][i]) * (1 - b1)
        u = self.s["v"][i] = np.maximum(b2 * self.s["v"][i], np.abs(g))
        return var - lr * m / ((1 - b1**t) * (u + self.c["epsilon"]))

    def _nadam(self, i: int, var: np.ndarray, g: np.ndarray, lr: float, t: int) -> np.ndarray:
        b1, b2 = self.c["beta_1"], self.c["beta_2"]
        u_t = b1 * (1.0 - 0.5 * 0.96**t)
        u_t_1 = b1 * (1.0 - 0.5 * 0.96 ** (t + 1))
        u_product_t_1 = self.u_product * u_t_1
        m = self.s["m"][i] = self.s["m"][i] + (g - self.s["m"][i]) * (1 - b1)
        v = self.s["v"][i] = self.s["v"][i] + (g * g - self.s["v"][i]) * (1 - b2)
        m_hat = u_t_1 * m / (1 - u_product_t_1) + (1 - u_t) * g / (1 - self.u_product)
        v_hat = v / (1 - b2**t)
        return var - m_hat * lr / (np.sqrt(v_hat) + self.c["epsilon"])

    def _adadelta(self, i: int, var: np.ndarray, g: np.ndarray, lr: float, t: int) -> np.ndarray:
        rho, eps = self.c["rho"], self.c["epsilon"]
        acc_g = self.s["acc"][i] = rho * self.s["acc"][i] + (1 - rho) * g * g
        delta = -np.sqrt(self.s["acc_d"][i] + eps) * g / np.sqrt(acc_g + eps)
        self.s["acc_d"][i] = rho * self.s["acc_d"][i] + (1 - rho) * delta * delta
        return var + lr * delta

    def _ftrl(self, i: int, var: np.ndarray, g: np.ndarray, lr: float, t: int) -> np.ndarray:
        c = self.c
        power = -c["learning_rate_power"]
        l1 = c["l1_regularization_strength"]
        l2 = c["l2_regularization_strength"] + c["beta"] / (2.0 * lr)
        acc = self.s["acc"][i]
        new_acc = acc + g * g
        grad_to_use = g + 2 * c["l2_shrinkage_regularization_strength"] * var
        self.s["linear"][i] = (
            self.s["linear"][i] + grad_to_use - (new_acc**power - acc**power) / lr * var
        )
        linear = self.s["linear"][i]
        quadratic = new_acc**power / lr + 2 * l2
        self.s["acc"][i] = new_acc
        return (np.clip(linear, -l1, l1) - linear) / quadratic

    def _lion(self, i: int, var: np.ndarray, g: np.ndarray, lr: float, t: int) -> np.ndarray:
        b1, b2 = self.c["beta_1"], self.c["beta_2"]
        out = var - lr * np.sign(self.s["m"][i] * b1 + g * (1 - b1))
        self.s["m"][i] = self.s["m"][i] * b2 + g * (1 - b2)
        return out

    def _adafactor(self, i: int, var: np.ndarray, g: np.ndarray, lr: float, t: int) -> np.ndarray:
        c = self.c
        if c["relative_step"]:
            lr = min(lr, 1 / np.sqrt(t))
        rho_t = min(lr, 1 / np.sqrt(t))
        alpha_t = max(c["epsilon_2"], _rms(var)) * rho_t
        sq = g * g + c["epsilon_1"]
        beta_2_t = 1 - t ** c["beta_2_decay"]
        if var.ndim >= 2:
            r = self.r[i] = beta_2_t * self.r[i] + (1 - beta_2_t) * sq.mean(axis=-1)
            col = self.col[i] = beta_2_t * self.col[i] + (1 - beta_2_t) * sq.mean(axis=-2)
            v = (r / r.mean(axis=-1, keepdims=True))[..., None] * col[..., None, :]
        else:
            v = self.s["v"][i] = beta_2_t * self.s["v"][i] + (1 - beta_2_t) * sq
        u_t = g / np.sqrt(v)
        u_t_hat = u_t / max(1.0, _rms(u_t) / c["clip_threshold"])
        return var - alpha_t * u_t_hat


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
    epsilon's place decides the step), and a rate per step (halved midway, as a
    schedule would)."""
    rng = np.random.default_rng(seed)
    initial = [rng.normal(size=s) for s in SHAPES]
    grads: list[list[np.ndarray | None]] = []
    for step in range(STEPS):
        row: list[np.ndarray | None] = [rng.normal(size=s) for s in SHAPES]
        row[0] = row[0] * 1e-7  # type: ignore[operator]  # never None here
        if step == SKIPPED[0]:
            row[SKIPPED[1]] = None
        grads.append(row)
    return initial, grads, [1.0] * 3 + [0.5] * 3


def _run_torch(
    name: str, config: dict[str, Any], initial: Arrays, grads: Any, scales: list[float]
) -> Arrays:
    params = [torch.nn.Parameter(torch.tensor(v, dtype=torch.float64)) for v in initial]
    optimizer = ds.optimizers.get(name, params)
    for group in optimizer.param_groups:
        group.update(config)
    base = optimizer.param_groups[0]["lr"]
    for row, scale in zip(grads, scales):
        for group in optimizer.param_groups:
            group["lr"] = base * scale
        for p, g in zip(params, row):
            p.grad = None if g is None else torch.tensor(g)
        optimizer.step()
    return [p.detach().numpy() for p in params]


@pytest.mark.parametrize(("name", "config"), CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_every_keras_name_follows_keras_3s_formula_step_by_step(
    name: str, config: dict[str, Any]
) -> None:
    initial, grads, scales = _problem()
    reference = KerasReference(name, config, initial)
    lr = reference.c["lr"]
    for row, scale in zip(grads, scales):
        reference.apply(row, lr * scale)
    got = _run_torch(name, config, initial, grads, scales)
    for g, e, v0 in zip(got, reference.vars, initial):
        np.testing.assert_allclose(g, e, rtol=1e-11, atol=1e-15)
        assert not np.array_equal(g, v0)  # it did move


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
    # Keras: 1e-3 * sqrt(1 - 0.999) / (1 - 0.9) * 1e-8 / (sqrt(1e-17) + 1e-7)
    expected = -1e-3 * math.sqrt(1 - 0.999) / 0.1 * 1e-8 / (math.sqrt(1e-17) + 1e-7)
    assert keras_p.item() == pytest.approx(expected, rel=1e-6)
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
            keras.apply([p.grad.double().numpy() for p in params], keras.c["lr"])  # type: ignore[union-attr]
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
