"""`ds.Model` compile / fit / evaluate / predict under FullyShardedStrategy (FSDP2), in
real worker processes joined by gloo on 127.0.0.1.

What these pin: a `ds.Model` built in the strategy's scope becomes the sharded root,
and fit (validation included), evaluate and predict give one device's numbers on the
same arrays, with an uneven last batch, whether `compile` runs in the scope (the
optimizer is repointed at the shards) or outside it (built on the shards); a network
sharded in the scope and wrapped in `ds.Model` outside it is trained by that
strategy; `EarlyStopping(restore_best_weights=True)` puts the best epoch's shards
back; `ModelCheckpoint` writes checkpoints every strategy reads; and a fit whose
worker was killed resumes from `BackupAndRestore` in fresh processes to the exact
weights of an uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from shared_checks import StepRecorder

import distribute as ds
from distribute import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

FEATURES, CLASSES = 6, 3
BATCH = 8  # the global batch size
EXAMPLES = 50  # 7 steps an epoch, the last of 2 examples
EPOCHS = 3
INIT_SEED, FIT_SEED = 0, 1


# -- shared by the workers and the one-device reference ------------------------------------


def _data(n: int, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, n)


def _network() -> torch.nn.Module:
    """Three linear layers of one class in a Sequential: three sharding units."""
    torch.manual_seed(INIT_SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, CLASSES),
    )


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _compile(model: ds.Model, optimizer: Any) -> None:
    model.compile(optimizer=optimizer, loss=torch.nn.CrossEntropyLoss(), metrics=["accuracy"])


def _fit(model: ds.Model, epochs: int = EPOCHS, **kwargs: Any) -> dict[str, list[float]]:
    x, y = _data(EXAMPLES)
    torch.manual_seed(FIT_SEED)  # the shuffle's seed
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, **kwargs)
    return history.history


def _stop_after_epoch_1() -> ds.callbacks.EarlyStopping:
    """The loss falls, so in "max" mode epoch 1 does not improve on epoch 0: training
    stops there and epoch 0's weights are put back."""
    return ds.callbacks.EarlyStopping(
        monitor="loss", mode="max", patience=1, restore_best_weights=True
    )


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by the wrapped network's names (``full_tensor`` is a
    collective: every worker calls this)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[name.removeprefix("module.")] = value.detach().clone()
    return out


# -- functions run in the workers ------------------------------------------------------------


def _fits(checkpoints: str) -> dict[str, Any]:
    """Several fits under one FullyShardedStrategy, each of a new model."""
    strategy = ds.experimental.FullyShardedStrategy()
    out: dict[str, Any] = {}

    # Built and compiled in the scope (Keras's Adam, repointed at the shards).
    with strategy.scope():
        model = ds.Model(_network())
        _compile(model, "adam")
    out["class"] = type(model).__name__
    out["types"] = sorted({type(p).__name__ for p in model.parameters()})
    vx, vy = _data(21, seed=8)
    history = _fit(model, validation_data=(vx, vy))
    x, y = _data(21, seed=9)
    out["adam"] = {
        "history": history,
        "params": _state(model),
        "evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True),
        "predict": model.predict(x, batch_size=4, verbose=0),
    }

    # Sharded in the scope, wrapped and compiled outside it (SGD on the shards).
    with strategy.scope():
        network = _network()
    wrapped = ds.Model(network)
    _compile(wrapped, _sgd)
    out["wrapped_strategy"] = type(wrapped.distribute_strategy).__name__
    out["wrapped"] = {"history": _fit(wrapped), "params": _state(wrapped)}

    # Callbacks: the best epoch's shards put back, a checkpoint per epoch.
    with strategy.scope():
        stopped = ds.Model(_network())
    _compile(stopped, _sgd)
    save = ds.callbacks.ModelCheckpoint(checkpoints + "/epoch-{epoch}", monitor="loss")
    history = _fit(stopped, callbacks=[save, _stop_after_epoch_1()])  # saved, then put back
    out["stopped"] = {"history": history, "params": _state(stopped), "saved": save.saved}
    strategy.shutdown()
    return out


def _backed_up_fit(
    strategy: ds.Strategy, backup: str | None, kill_rank: int | None, kill_at: tuple[int, int]
) -> dict[str, Any]:
    with strategy.scope():
        model = ds.Model(_network())
        _compile(model, "adam")
    recorder = StepRecorder(kill_rank, kill_at)
    callbacks: list[ds.callbacks.Callback] = []
    if backup is not None:
        callbacks.append(ds.callbacks.BackupAndRestore(backup, save_freq=3))
    callbacks.append(recorder)  # after the backup: a step's backup is made before the kill
    _fit(model, epochs=4, callbacks=callbacks)
    return {"params": _state(model), "steps": recorder.steps}


def _killed(backup: str, kill_at: tuple[int, int]) -> None:
    strategy = ds.experimental.FullyShardedStrategy()
    _backed_up_fit(strategy, backup, 1, kill_at)


def _resumed_and_uninterrupted(backup: str, kill_at: tuple[int, int]) -> dict[str, Any]:
    strategy = ds.experimental.FullyShardedStrategy()
    resumed = _backed_up_fit(strategy, backup, None, kill_at)
    uninterrupted = _backed_up_fit(strategy, None, None, kill_at)
    strategy.shutdown()
    return {"resumed": resumed, "uninterrupted": uninterrupted}


# -- the one-device reference ------------------------------------------------------------------


def _reference() -> dict[str, Any]:
    """The same fits on one device (the default strategy, in this process)."""
    with torch.random.fork_rng():
        model = ds.Model(_network())
        _compile(model, "adam")
        vx, vy = _data(21, seed=8)
        history = _fit(model, validation_data=(vx, vy))
        x, y = _data(21, seed=9)
        adam = {
            "history": history,
            "params": _state(model),
            "evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True),
            "predict": model.predict(x, batch_size=4, verbose=0),
        }
        sgd = ds.Model(_network())
        _compile(sgd, _sgd)
        wrapped = {"history": _fit(sgd), "params": _state(sgd)}
        stopped = ds.Model(_network())
        _compile(stopped, _sgd)
        history = _fit(stopped, callbacks=[_stop_after_epoch_1()])
        return {
            "adam": adam,
            "wrapped": wrapped,
            "stopped": {"history": history, "params": _state(stopped)},
        }


def _assert_close(actual: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert set(actual["history"]) == set(expected["history"]), what
    for key, values in expected["history"].items():
        assert actual["history"][key] == pytest.approx(values, abs=1e-5, rel=0), (what, key)
    assert actual["params"].keys() == expected["params"].keys(), what
    for name, value in expected["params"].items():
        torch.testing.assert_close(actual["params"][name], value, rtol=0, atol=1e-5, msg=name)


# -- tests ---------------------------------------------------------------------------------------


def test_fit_evaluate_predict_and_callbacks_match_one_device(tmp_path: Path) -> None:
    results = launch.run(_fits, 2, args=(str(tmp_path / "saved"),), timeout=250)
    expected = _reference()
    assert set(expected["adam"]["history"]) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert len(expected["stopped"]["history"]["loss"]) == 2  # stopped after epoch 1
    for out in results:
        assert out["class"] == "FSDPModel"  # the ds.Model is the sharded root
        assert out["types"] == ["DTensor"]
        assert out["wrapped_strategy"] == "FullyShardedStrategy"
        for what in ("adam", "wrapped", "stopped"):
            _assert_close(out[what], expected[what], what)
        evaluated = out["adam"]["evaluate"]
        for key, value in expected["adam"]["evaluate"].items():
            assert evaluated[key] == pytest.approx(value, abs=1e-6, rel=0), key
        predicted = out["adam"]["predict"]
        assert predicted.shape == (21, CLASSES)  # every row once, in order
        np.testing.assert_allclose(predicted, expected["adam"]["predict"], rtol=0, atol=1e-6)

    # Epoch 0's weights were put back: not those of epoch 1, which the last
    # checkpoint holds; that checkpoint restores in one process to the shards' values.
    saved = results[0]["stopped"]["saved"]
    assert [Path(p).name for p in saved] == ["epoch-1", "epoch-2"]
    assert saved == results[1]["stopped"]["saved"]
    network = ds.Model(_network())
    ds.Checkpoint(model=network).restore(saved[-1])
    last = {k.removeprefix("module."): v for k, v in network.state_dict().items()}
    assert any(not torch.equal(last[k], v) for k, v in results[0]["stopped"]["params"].items())
    ds.Checkpoint(model=network).restore(saved[0])
    for name, value in network.state_dict().items():
        assert torch.equal(value, results[0]["stopped"]["params"][name.removeprefix("module.")])


def test_backup_and_restore_resumes_a_killed_fit_with_the_weights_of_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    """4 epochs of 7 steps, backups every 3 steps; rank 1 is killed at the end of epoch
    1's third step (the 10th), after the backup of the 9th. Fresh processes go on after
    step 9 and end with the uninterrupted run's exact weights."""
    backup = tmp_path / "backup"
    kill_at = (1, 2)
    with pytest.raises(ds.errors.WorkerError) as killed:
        launch.run(_killed, 2, args=(str(backup), kill_at), timeout=150)
    message = str(killed.value)
    assert "rank 1 was killed by signal 9" in message or "other ranks had failed" in message
    assert (backup / "checkpoint.json").exists()

    results = launch.run(_resumed_and_uninterrupted, 2, args=(str(backup), kill_at), timeout=200)
    assert not backup.exists()  # deleted when training ended
    every_step = [(e, b) for e in range(4) for b in range(7)]
    for out in results:
        assert out["uninterrupted"]["steps"] == every_step
        assert out["resumed"]["steps"] == every_step[9:]  # after the backup of step 9
        for name, value in out["uninterrupted"]["params"].items():
            assert torch.equal(out["resumed"]["params"][name], value), name
