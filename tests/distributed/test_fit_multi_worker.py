"""`ds.Model` fit / evaluate / predict under MultiWorkerMirroredStrategy, in real processes.

Every multi-worker run is compared with one device (the default strategy, in this
process) on the same NumPy arrays, whose number of examples is never a multiple
of the global batch size: the last batch is partial and split unevenly.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from shared_checks import StepRecorder

import distribute as ds
from distribute import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

FEATURES, CLASSES = 6, 3
BATCH = 8  # the global batch size
EPOCHS = 3
INIT_SEED, FIT_SEED = 0, 1


# -- shared by the workers and the single-device reference ---------------------------------


def _data(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` examples: float64 features (fed as float32) and integer labels."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, FEATURES))
    y = rng.integers(0, CLASSES, size=n)
    return x, y


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _model() -> ds.Model:
    """Linear-ReLU-Linear, seeded, compiled; built in the current strategy's scope."""
    torch.manual_seed(INIT_SEED)
    model = ds.Model(
        torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES)
        )
    )
    model.compile(optimizer=_optimizer, loss=torch.nn.CrossEntropyLoss(), metrics=["accuracy"])
    return model


def _batchnorm_model() -> ds.Model:
    """Linear-BatchNorm-Linear, seeded, with running statistics that differ from any
    batch's (so a forward in training mode gives other numbers)."""
    torch.manual_seed(INIT_SEED)
    network = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, CLASSES)
    )
    with torch.no_grad():
        network[1].running_mean.fill_(0.5)
        network[1].running_var.fill_(4.0)
    model = ds.Model(network)
    model.compile(optimizer="sgd", loss=torch.nn.CrossEntropyLoss())
    return model


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the model's parameters and buffers."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _strategy(local_replicas: int) -> ds.MultiWorkerMirroredStrategy:
    devices = [f"cpu:{i}" for i in range(local_replicas)] if local_replicas > 1 else None
    return ds.MultiWorkerMirroredStrategy(devices=devices)


def _fit(model: ds.Model, n: int, shuffle: bool, epochs: int = EPOCHS, **kwargs: Any) -> Any:
    x, y = _data(n)
    torch.manual_seed(FIT_SEED)  # the shuffling generator is seeded from torch's
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=shuffle, **kwargs)


# -- functions run in the workers (module level: pickled by reference) -------------------


def _fit_worker(local_replicas: int, n: int, shuffle: bool) -> dict[str, Any]:
    strategy = _strategy(local_replicas)
    with strategy.scope():
        model = _model()
    history = _fit(model, n, shuffle, verbose=0)
    out = {"history": history.history, "params": _state(model)}
    strategy.shutdown()
    return out


def _evaluate_predict_worker(
    local_replicas: int, n_eval: int, n_predict: int, predict_batch: int
) -> dict[str, Any]:
    strategy = _strategy(local_replicas)
    with strategy.scope():
        model = _model()
        identity = ds.Model(torch.nn.Identity())
    x, y = _data(n_eval)
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    px, _ = _data(n_predict)
    predictions = model.predict(px, batch_size=predict_batch, verbose=0)
    rows = np.arange(n_predict * 2, dtype=np.float32).reshape(n_predict, 2)
    echoed = identity.predict(rows, batch_size=predict_batch, verbose=0)
    with strategy.scope():
        normalized = _batchnorm_model()
    before = _state(normalized)
    normalized.evaluate(x, y, batch_size=BATCH, verbose=0)
    normalized_predictions = normalized.predict(px, batch_size=predict_batch, verbose=0)
    strategy.shutdown()
    return {
        "evaluate": evaluated,
        "predict": predictions,
        "echoed": echoed,
        "batchnorm": {
            "before": before,
            "after": _state(normalized),
            "predict": normalized_predictions,
            "training": [m.training for m in normalized.modules()],
        },
    }


def _progress_worker() -> dict[str, str]:
    strategy = _strategy(1)
    with strategy.scope():
        model = _model()
    x, y = _data(20)
    out = {}
    for verbose in (1, 2):
        captured = io.StringIO()
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            model.fit(x, y, batch_size=BATCH, epochs=2, verbose=verbose)
            model.evaluate(x, y, batch_size=BATCH, verbose=verbose)
        out[f"verbose={verbose}"] = captured.getvalue()
    strategy.shutdown()
    return out


class _Examples(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """(x, y) pairs of unknown length: a DataLoader over it cannot say its batch sizes."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self) -> Any:
        return iter(zip(self.x, self.y))


def _unknown_sizes_worker(kind: str, n: int) -> dict[str, Any]:
    strategy = _strategy(1)
    with strategy.scope():
        model = _model()
    x, y = (torch.as_tensor(a) for a in _data(n))
    x = x.float()
    if kind == "iterable":
        loader = torch.utils.data.DataLoader(_Examples(x, y), batch_size=BATCH)
        data: Any = loader
    else:
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), BATCH)
        data = strategy.experimental_distribute_dataset(loader)
    history = model.fit(data, epochs=1, verbose=0)
    evaluated = model.evaluate(data, verbose=0, return_dict=True)
    out = {"history": history.history, "evaluate": evaluated, "params": _state(model)}
    strategy.shutdown()
    return out


def _backup_worker(
    backup_dir: str | None, kill_rank: int | None, kill_at: tuple[int, int]
) -> dict[str, Any]:
    strategy = _strategy(1)
    with strategy.scope():
        model = _model()
    recorder = StepRecorder(kill_rank, kill_at)
    callbacks: list[ds.callbacks.Callback] = []
    if backup_dir is not None:
        callbacks.append(ds.callbacks.BackupAndRestore(backup_dir, save_freq=3))
    callbacks.append(recorder)  # after the backup: a step's backup is made before the kill
    history = _fit(model, 50, True, epochs=4, verbose=0, callbacks=callbacks)
    out = {"params": _state(model), "steps": recorder.steps, "history": history.history}
    strategy.shutdown()
    return out


# -- the single-device reference -----------------------------------------------------------


def _reference_fit(n: int, shuffle: bool) -> dict[str, Any]:
    """One device's `fit` with the same seed: the shuffle is a function of (seed,
    epoch) alone, agreed by the workers, so every strategy draws the same order."""
    with torch.random.fork_rng():
        model = _model()
        torch.manual_seed(FIT_SEED)
        history = _fit(model, n, shuffle=shuffle, verbose=0)
    return {"history": history.history, "params": _state(model)}


# -- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("local_replicas", [1, 2], ids=["2x1", "2x2"])
def test_fit_matches_one_device_with_an_uneven_last_batch(
    local_replicas: int, shuffle: bool
) -> None:
    """50 examples in global batches of 8: the last batch (2 examples) is split
    1/1 over 2 replicas, 1/1/0/0 over 4; loss, accuracy and weights are one device's."""
    n = 50
    results = launch.run(_fit_worker, 2, args=(local_replicas, n, shuffle), timeout=150)
    expected = _reference_fit(n, shuffle)
    assert len(expected["history"]["loss"]) == EPOCHS
    for out in results:
        assert set(out["history"]) == {"loss", "accuracy"}
        for key in ("loss", "accuracy"):
            assert out["history"][key] == pytest.approx(
                expected["history"][key], abs=1e-5, rel=0
            ), key
        assert out["params"].keys() == expected["params"].keys()
        for name, value in expected["params"].items():
            torch.testing.assert_close(out["params"][name], value, rtol=0, atol=1e-5)


@pytest.mark.parametrize("local_replicas", [1, 2], ids=["2x1", "2x2"])
def test_evaluate_is_exact_and_predict_returns_every_row_once_in_order_in_eval_mode(
    local_replicas: int,
) -> None:
    """evaluate: 21 examples in batches of 8 (last: 5, split 3/2 or 2/1/1/1) give the
    loss and accuracy of one device over all examples; predict: 21 rows in batches
    of 4 (last: 1 row, so some replicas get none) come back once each, in input
    order, on every worker. Both run in eval mode: a BatchNorm network's predictions
    are an eval-mode forward's, its buffers unchanged, its mode restored."""
    n_eval, n_predict = 21, 21
    results = launch.run(
        _evaluate_predict_worker, 2, args=(local_replicas, n_eval, n_predict, 4), timeout=150
    )
    with torch.random.fork_rng():
        reference = _model()
    x, y = (torch.as_tensor(a) for a in _data(n_eval))
    with torch.no_grad():
        logits = reference(x.float())
    loss = torch.nn.functional.cross_entropy(logits.double(), y).item()
    accuracy = (logits.argmax(-1) == y).double().mean().item()
    assert 0.0 < accuracy < 1.0  # a metric that could be wrong either way
    px, _ = _data(n_predict)
    with torch.no_grad():
        predictions = reference(torch.as_tensor(px).float()).numpy()
    rows = np.arange(n_predict * 2, dtype=np.float32).reshape(n_predict, 2)
    for out in results:
        assert set(out["evaluate"]) == {"loss", "accuracy"}
        assert out["evaluate"]["accuracy"] == pytest.approx(accuracy, abs=1e-6, rel=0)
        assert out["evaluate"]["loss"] == pytest.approx(loss, abs=1e-6, rel=0)
        assert isinstance(out["echoed"], np.ndarray)
        np.testing.assert_array_equal(out["echoed"], rows)  # each row once, in order
        assert out["predict"].shape == (n_predict, CLASSES)
        np.testing.assert_allclose(out["predict"], predictions, rtol=0, atol=1e-6)
    with torch.random.fork_rng():
        normalized = _batchnorm_model().eval()
    with torch.no_grad():
        expected = normalized(torch.as_tensor(px).float()).numpy()
    for out in results:
        batchnorm = out["batchnorm"]
        for key, value in batchnorm["before"].items():
            torch.testing.assert_close(batchnorm["after"][key], value, rtol=0, atol=0, msg=key)
        assert all(batchnorm["training"])
        np.testing.assert_allclose(batchnorm["predict"], expected, rtol=0, atol=1e-6)


def test_only_the_chief_prints_progress() -> None:
    chief, other = launch.run(_progress_worker, 2, timeout=150)
    assert "Epoch 1/2" in chief["verbose=1"] and "Epoch 2/2" in chief["verbose=1"]
    assert "3/3" in chief["verbose=1"]  # tqdm's counter: 20 examples, 3 steps
    assert "evaluate" in chief["verbose=1"]
    lines = chief["verbose=2"].splitlines()
    assert [line.split(" - ")[0] for line in lines] == ["Epoch 1/2", "Epoch 2/2", "evaluate"]
    assert all("loss: " in line and "accuracy: " in line for line in lines), lines
    assert other == {"verbose=1": "", "verbose=2": ""}


def test_backup_and_restore_resumes_a_killed_fit_with_the_weights_of_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    """4 epochs of 7 steps, backups every 3 steps; rank 1 is killed at the end of
    epoch 1's third step (the 10th), after the backup of the 9th. Run again, fit
    goes on after step 9 and ends with the uninterrupted run's exact weights."""
    backup = tmp_path / "backup"
    kill_at = (1, 2)
    with pytest.raises(ds.errors.WorkerError) as killed:
        launch.run(_backup_worker, 2, args=(str(backup), 1, kill_at), timeout=150)
    # Rank 0 may fail on the dead peer in the same poll; the first failure is named.
    message = str(killed.value)
    assert "rank 1 was killed by signal 9" in message or "other ranks had failed" in message
    assert (backup / "checkpoint.json").exists()

    resumed = launch.run(_backup_worker, 2, args=(str(backup), None, kill_at), timeout=150)
    assert not backup.exists()
    uninterrupted = launch.run(_backup_worker, 2, args=(None, None, kill_at), timeout=150)

    steps_per_epoch = 7  # 50 examples in batches of 8
    every_step = [(e, b) for e in range(4) for b in range(steps_per_epoch)]
    for out in uninterrupted:
        assert out["steps"] == every_step
    for out, full in zip(resumed, uninterrupted):
        assert out["steps"] == every_step[9:]  # after the backup of step 9: (1, 1)
        assert out["params"].keys() == full["params"].keys()
        for name, value in full["params"].items():
            assert torch.equal(out["params"][name], value), name


@pytest.mark.parametrize("kind", ["iterable", "distributed"])
def test_logged_losses_are_exact_when_batch_sizes_are_unknown_up_front(kind: str) -> None:
    """A DataLoader over an IterableDataset, or a dataset already distributed: 21
    examples in batches of 8, the last (5) split 3/2 between the workers."""
    n = 21
    results = launch.run(_unknown_sizes_worker, 2, args=(kind, n), timeout=150)
    with torch.random.fork_rng():
        model = _model()
        x, y = _data(n)
        history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        evaluated: Any = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    for out in results:  # the weights are right: the step sums the global batch size
        for name, value in _state(model).items():
            torch.testing.assert_close(out["params"][name], value, rtol=0, atol=1e-5)
        assert out["history"]["accuracy"] == pytest.approx(history.history["accuracy"], abs=1e-6)
        assert out["evaluate"]["accuracy"] == pytest.approx(evaluated["accuracy"], abs=1e-6)
    rank0, rank1 = results
    assert rank0["history"]["loss"] == pytest.approx(rank1["history"]["loss"], abs=1e-6, rel=0)
    assert rank0["evaluate"]["loss"] == pytest.approx(rank1["evaluate"]["loss"], abs=1e-6, rel=0)
    for out in results:
        assert out["history"]["loss"] == pytest.approx(history.history["loss"], abs=1e-5, rel=0)
        assert out["evaluate"]["loss"] == pytest.approx(evaluated["loss"], abs=1e-6, rel=0)


class _StopOnChief(ds.callbacks.Callback):
    """Stops training from rank 0 alone, at one step (as a time limit would)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches += 1
        if int(os.environ["RANK"]) == 0 and self.batches == 2:
            assert self.model is not None
            self.model.stop_training = True


def _stop_on_one_worker() -> dict[str, Any]:
    strategy = _strategy(1)
    with strategy.scope():
        model = _model()
    stop = _StopOnChief()
    history = _fit(model, 50, shuffle=False, callbacks=[stop], verbose=0)
    out = {"batches": stop.batches, "epochs": len(history.history["loss"])}
    strategy.shutdown()
    return out


def test_a_stop_asked_by_one_worker_stops_every_worker_after_the_same_step() -> None:
    """The stop travels with the next step's loss all-reduce, so every worker runs
    the same steps (the review found rank 0 stopping alone hung the others)."""
    rank0, rank1 = launch.run(_stop_on_one_worker, 2, timeout=120)
    assert rank0 == rank1 == {"batches": 3, "epochs": 1}
