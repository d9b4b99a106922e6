"""Parity: training under each strategy ends where single-device training ends.

An MLP trained several steps on the same global batches, per-example losses averaged
with `compute_average_loss` over the global batch, must reach the single-device
parameters within 1e-5, with every replica's copy bitwise identical.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import distribute as ds

GLOBAL_BATCH = 16
STEPS = 4

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd_momentum": lambda params, foreach: torch.optim.SGD(
        params, lr=0.1, momentum=0.9, foreach=foreach
    ),
    "adam": lambda params, foreach: torch.optim.Adam(params, lr=0.01, foreach=foreach),
    "adamw": lambda params, foreach: torch.optim.AdamW(
        params, lr=0.01, weight_decay=0.1, foreach=foreach
    ),
    "rmsprop": lambda params, foreach: torch.optim.RMSprop(
        params, lr=0.01, momentum=0.5, foreach=foreach
    ),
}

STRATEGIES: dict[str, Callable[[], ds.Strategy]] = {
    "mirrored_1": lambda: ds.MirroredStrategy(["cpu:0"]),
    "mirrored_2": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
    "mirrored_4": lambda: ds.MirroredStrategy([f"cpu:{i}" for i in range(4)]),
    "central_storage_4": lambda: ds.CentralStorageStrategy([f"cpu:{i}" for i in range(4)]),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 3),
    )


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(GLOBAL_BATCH * STEPS, 8, generator=g), torch.randn(
        GLOBAL_BATCH * STEPS, 3, generator=g
    )


def run_steps(strategy: ds.Strategy | None, step: Callable[..., Any]) -> None:
    """Runs `step(x, y)` on each global batch: directly without a strategy, else in
    `strategy.run` with the batch split evenly over the replicas."""
    x_all, y_all = data()
    for s in range(STEPS):
        x = x_all[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH]
        y = y_all[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH]
        if strategy is None:
            step(x, y)
            continue
        n = strategy.num_replicas_in_sync
        xs = x if n == 1 else ds.PerReplica(x.chunk(n))
        ys = y if n == 1 else ds.PerReplica(y.chunk(n))
        strategy.run(step, args=(xs, ys))


def train(strategy: ds.Strategy | None, opt: str, foreach: bool) -> torch.nn.Module:
    if strategy is None:
        model = make_model()
        optimizer = OPTIMIZERS[opt](model.parameters(), foreach)
    else:
        with strategy.scope():
            model = make_model()
            optimizer = OPTIMIZERS[opt](model.parameters(), foreach)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.mse_loss(model(x), y, reduction="none").mean(dim=1)
        loss = ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    run_steps(strategy, step)
    return model


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
def test_training_matches_single_device(strategy_name: str, opt: str, foreach: bool) -> None:
    reference = train(None, opt, foreach)
    model = train(STRATEGIES[strategy_name](), opt, foreach)
    for ref, param in zip(reference.parameters(), model.parameters()):
        assert isinstance(param, ds.MirroredVariable)
        torch.testing.assert_close(param.values[0], ref.detach(), rtol=0, atol=1e-5)
        for component in param.values[1:]:
            assert torch.equal(component, param.values[0]), "replica copies diverged"


def test_parameters_actually_moved() -> None:
    """Guards the parity test against a trivially passing no-op training."""
    before = make_model()
    after = train(ds.MirroredStrategy(["cpu:0", "cpu:1"]), "adam", False)
    moved = max(
        (a - b.detach()).abs().max().item() for a, b in zip(before.parameters(), after.parameters())
    )
    assert moved > 1e-3


def train_clipped(strategy: ds.Strategy | None, max_norm: float) -> torch.nn.Module:
    """SGD with clipping by global norm; under a strategy, the summed gradient is clipped
    (automatic aggregation off, gradients all-reduced by hand), as README says."""
    if strategy is None:
        model = make_model()
        optimizer = OPTIMIZERS["sgd_momentum"](model.parameters(), False)
    else:
        with strategy.scope():
            model = make_model()
            optimizer = OPTIMIZERS["sgd_momentum"](model.parameters(), False)
        strategy.extended.experimental_aggregate_gradients = False

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        per_example = torch.nn.functional.mse_loss(model(x), y, reduction="none").mean(dim=1)
        ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH).backward()
        params = list(model.parameters())
        if strategy is not None:
            ctx = ds.get_replica_context()
            assert ctx is not None
            summed = ctx.all_reduce("sum", [p.grad for p in params])
            for p, g in zip(params, summed):
                p.grad = g
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        assert norm > max_norm  # clipping is active
        optimizer.step()
        optimizer.zero_grad()

    run_steps(strategy, step)
    return model


@pytest.mark.parametrize("strategy_name", ["mirrored_2", "mirrored_4"])
def test_clipping_the_summed_gradient_by_hand_matches_single_device(strategy_name: str) -> None:
    reference = train_clipped(None, max_norm=0.05)
    model = train_clipped(STRATEGIES[strategy_name](), max_norm=0.05)
    for ref, param in zip(reference.parameters(), model.parameters()):
        assert isinstance(param, ds.MirroredVariable)
        torch.testing.assert_close(param.values[0], ref.detach(), rtol=0, atol=1e-5)
        for component in param.values[1:]:
            assert torch.equal(component, param.values[0]), "replica copies diverged"
