"""ds.Model: compile / fit / evaluate / predict and the callbacks, in one process (#16).

Multi-worker fit is in tests/distributed/test_fit_multi_worker.py.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import distribute as ds

STRATEGY_FACTORIES: dict[str, Callable[[], ds.Strategy]] = {
    "default": ds.get_strategy,
    "one_device": lambda: ds.OneDeviceStrategy("cpu"),
    "mirrored_1": lambda: ds.MirroredStrategy(["cpu:0"]),
    "mirrored_4": lambda: ds.MirroredStrategy([f"cpu:{i}" for i in range(4)]),
    "central_storage": lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}
ALL = sorted(STRATEGY_FACTORIES)


def _classifier() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _data(n: int = 50, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
    return x, y


def _built(
    make: Callable[[], ds.Strategy], metrics: list[Any] | None = None, optimizer: Any = "adam"
) -> ds.Model:
    strategy = make()
    torch.manual_seed(0)
    with strategy.scope():
        model = ds.Model(_classifier())
    model.compile(  # outside the scope: still the strategy's
        optimizer=optimizer,
        loss=torch.nn.CrossEntropyLoss(),
        metrics=metrics if metrics is not None else ["accuracy"],
    )
    return model


def _weights(model: ds.Model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ALL)
def test_the_guides_lines_run_as_written_under_every_strategy(name: str) -> None:
    results = {}
    for which in ("default", name):
        strategy = STRATEGY_FACTORIES[which]()
        torch.manual_seed(0)
        with strategy.scope():
            model = ds.Model(torch.nn.Linear(1, 1))
            model.compile(loss="mse", optimizer="sgd")
        dataset = DataLoader(TensorDataset(torch.ones(100, 1), torch.ones(100, 1)), batch_size=10)
        first = model.fit(dataset, epochs=2, verbose=0).history["loss"]
        evaluated = model.evaluate(dataset, verbose=0)
        second = model.fit(
            np.ones((100, 1)), np.ones((100, 1)), epochs=2, batch_size=10, verbose=0
        ).history["loss"]
        results[which] = [*first, evaluated, *second]
    np.testing.assert_allclose(results[name], results["default"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shuffle", [False, True])
def test_fit_matches_single_device_fit_with_a_partial_last_batch(name: str, shuffle: bool) -> None:
    x, y = _data(50)  # 50 = 6 x 8 + 2: the last global batch is split unevenly
    runs = {}
    for which in ("default", name):
        model = _built(STRATEGY_FACTORIES[which])
        torch.manual_seed(1)
        history = model.fit(x, y, batch_size=8, epochs=3, shuffle=shuffle, verbose=0)
        runs[which] = (history.history, _weights(model))
    (mine, my_weights), (theirs, their_weights) = runs[name], runs["default"]
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for key, value in their_weights.items():
        torch.testing.assert_close(my_weights[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", ["mirrored_4", "central_storage"])
def test_metrics_are_exact_over_replicas_with_an_uneven_last_batch(name: str) -> None:
    x, y = _data(23)
    model = _built(STRATEGY_FACTORIES[name])
    logs = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert isinstance(logs, dict)
    with torch.no_grad():
        logits = model(torch.as_tensor(x))
    expected_accuracy = float((logits.argmax(1).numpy() == y).mean())
    expected_loss = float(torch.nn.functional.cross_entropy(logits, torch.as_tensor(y)))
    assert logs["accuracy"] == pytest.approx(expected_accuracy, abs=1e-9)
    assert logs["loss"] == pytest.approx(expected_loss, rel=1e-5)


@pytest.mark.parametrize("name", ["mirrored_4", "central_storage"])
def test_binary_metrics_auc_and_mae_match_one_device(name: str) -> None:
    x, y = _data(23)
    labels = (y > 0).astype(np.float32)[:, None]
    results = {}
    for which in ("default", name):
        strategy = STRATEGY_FACTORIES[which]()
        torch.manual_seed(0)
        with strategy.scope():
            model = ds.Model(torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Sigmoid()))
        model.compile("sgd", "binary_crossentropy", metrics=["binary_accuracy", "auc", "mae"])
        results[which] = model.evaluate(x, labels, batch_size=8, verbose=0, return_dict=True)
    mine, theirs = results[name], results["default"]
    assert isinstance(mine, dict) and isinstance(theirs, dict)
    for key in ("loss", "binary_accuracy", "auc", "mae"):
        assert mine[key] == pytest.approx(theirs[key], rel=1e-6), key
    assert 0.0 < theirs["auc"] <= 1.0


@pytest.mark.parametrize("name", ALL)
def test_predict_returns_every_row_once_in_input_order(name: str) -> None:
    x, _ = _data(21)
    model = _built(STRATEGY_FACTORIES[name])
    predictions = model.predict(x, batch_size=4, verbose=0)
    with torch.no_grad():
        expected = model(torch.as_tensor(x)).numpy()
    assert predictions.shape == (21, 3)
    np.testing.assert_allclose(predictions, expected, rtol=1e-6, atol=1e-6)


def test_a_subclassed_model_with_its_own_train_step() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    seen: list[int] = []

    class Regression(ds.Model):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x)

        def train_step(self, data: Any) -> dict[str, torch.Tensor]:
            seen.append(int(data[0].shape[0]))  # this replica's part of the batch
            return super().train_step(data)

    with strategy.scope():
        model = Regression()
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
    x = np.random.default_rng(0).normal(size=(10, 2)).astype(np.float32)
    history = model.fit(x, x.sum(1, keepdims=True), batch_size=4, epochs=20, verbose=0)
    assert sorted(seen[:6]) == [1, 1, 2, 2, 2, 2]  # 4 + 4 + 2 over 2 replicas
    assert history.history["loss"][-1] < history.history["loss"][0] / 10


def test_validation_data_and_split_log_val_metrics() -> None:
    x, y = _data(60)
    model = _built(STRATEGY_FACTORIES["mirrored_4"])
    history = model.fit(x, y, batch_size=8, epochs=2, validation_split=0.25, verbose=0)
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    again = model.fit(x, y, batch_size=8, epochs=2, validation_data=(x[:10], y[:10]), verbose=0)
    assert len(again.history["val_loss"]) == 2
    expected = model.evaluate(x[:10], y[:10], batch_size=8, verbose=0, return_dict=True)
    assert isinstance(expected, dict)
    assert again.history["val_loss"][-1] == pytest.approx(expected["loss"], rel=1e-6)


def test_errors_say_what_to_do() -> None:
    with ds.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = ds.Model(torch.nn.Linear(1, 1))
    with pytest.raises(ds.errors.ContextError, match="compile"):
        model.fit(np.ones((4, 1)), np.ones((4, 1)))
    with pytest.raises(ds.errors.InvalidArgumentError, match=r"unknown loss 'msa'.*mse"):
        model.compile(optimizer="sgd", loss="msa")
    with pytest.raises(ds.errors.InvalidArgumentError, match="unknown optimizer"):
        model.compile(optimizer="sgdd", loss="mse")
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ds.errors.InvalidArgumentError, match="as many examples"):
        model.fit(np.ones((4, 1)), np.ones((3, 1)), verbose=0)


# -- callbacks ------------------------------------------------------------------------------


def test_history_and_callback_hooks_are_called_in_keras_order() -> None:
    calls: list[str] = []

    class Recorder(ds.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            calls.append("train_begin")

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            calls.append(f"epoch_begin {epoch}")

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            calls.append(f"batch_end {batch}")

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            calls.append(f"epoch_end {epoch} {sorted(logs)}")

        def on_train_end(self, logs: Any = None) -> None:
            calls.append("train_end")

    x, y = _data(16)
    model = _built(STRATEGY_FACTORIES["mirrored_4"])
    history = model.fit(x, y, batch_size=8, epochs=2, callbacks=[Recorder()], verbose=0)
    assert calls == [
        "train_begin",
        "epoch_begin 0",
        "batch_end 0",
        "batch_end 1",
        "epoch_end 0 ['accuracy', 'loss']",
        "epoch_begin 1",
        "batch_end 0",
        "batch_end 1",
        "epoch_end 1 ['accuracy', 'loss']",
        "train_end",
    ]
    assert history.epoch == [0, 1] and model.history is history


def test_early_stopping_stops_and_restores_the_best_weights() -> None:
    x, y = _data(16)
    model = _built(STRATEGY_FACTORIES["mirrored_4"], optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    stop = ds.callbacks.EarlyStopping(monitor="loss", patience=2, restore_best_weights=True)
    history = model.fit(x, y, batch_size=8, epochs=10, callbacks=[stop], verbose=0)
    assert len(history.history["loss"]) == 3  # no improvement with lr 0: stops after 2 more
    assert stop.stopped_epoch == 2


def test_learning_rate_scheduler_sets_every_groups_rate_each_epoch() -> None:
    x, y = _data(16)
    model = _built(STRATEGY_FACTORIES["mirrored_4"], optimizer="sgd")
    schedule = ds.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 * (epoch + 1))
    history = model.fit(x, y, batch_size=8, epochs=3, callbacks=[schedule], verbose=0)
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.2, 0.3])
    assert model.optimizer is not None and model.optimizer.param_groups[0]["lr"] == pytest.approx(
        0.3
    )


def test_model_checkpoint_saves_what_restores_the_model(tmp_path: Path) -> None:
    x, y = _data(16)
    model = _built(STRATEGY_FACTORIES["mirrored_4"])
    save = ds.callbacks.ModelCheckpoint(str(tmp_path / "ckpt-{epoch:02d}"), monitor="loss")
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[save], verbose=0)
    assert [Path(p).name for p in save.saved] == ["ckpt-01", "ckpt-02"]
    fresh = _built(STRATEGY_FACTORIES["one_device"])
    ds.Checkpoint(model=fresh).restore(save.saved[-1])
    for key, value in _weights(model).items():
        assert torch.equal(_weights(fresh)[key], value)
    best = ds.callbacks.ModelCheckpoint(tmp_path / "best", monitor="loss", save_best_only=True)
    model.fit(x, y, batch_size=8, epochs=3, callbacks=[best], verbose=0)
    assert 1 <= len(best.saved) <= 3


def test_csv_logger_writes_a_row_per_epoch(tmp_path: Path) -> None:
    x, y = _data(16)
    model = _built(STRATEGY_FACTORIES["mirrored_4"])
    path = tmp_path / "log.csv"
    model.fit(x, y, batch_size=8, epochs=3, callbacks=[ds.callbacks.CSVLogger(path)], verbose=0)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]
    assert set(rows[0]) == {"epoch", "loss", "accuracy"}


def test_tensorboard_writes_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    x, y = _data(16)
    model = _built(STRATEGY_FACTORIES["mirrored_4"])
    board = ds.callbacks.TensorBoard(tmp_path / "tb")
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[board], verbose=0)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("epoch_loss")] == [0, 1]


class _Interrupt(ds.callbacks.Callback):
    """Stops a fit by raising at one step, as a preempted machine would."""

    def __init__(self, epoch: int, step: int) -> None:
        super().__init__()
        self.at, self.epoch = (epoch, step), -1

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if (self.epoch, batch) == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("save_freq", ["epoch", 2])
def test_backup_and_restore_resumes_an_interrupted_fit_to_the_same_weights(
    tmp_path: Path, save_freq: str | int
) -> None:
    x, y = _data(40)

    def fit(callbacks: list[Any]) -> ds.Model:
        model = _built(STRATEGY_FACTORIES["mirrored_4"])
        torch.manual_seed(5)
        model.fit(x, y, batch_size=8, epochs=4, callbacks=callbacks, verbose=0)
        return model

    straight = fit([])
    backup = tmp_path / "backup"
    with pytest.raises(KeyboardInterrupt):
        fit([ds.callbacks.BackupAndRestore(backup, save_freq=save_freq), _Interrupt(2, 3)])
    assert backup.exists()
    resumed = fit([ds.callbacks.BackupAndRestore(backup, save_freq=save_freq)])
    for key, value in _weights(straight).items():
        assert torch.equal(_weights(resumed)[key], value), key
    assert not backup.exists()  # deleted when training ended


class _Epochs(ds.callbacks.Callback):
    """Records the epochs a fit runs."""

    def __init__(self) -> None:
        super().__init__()
        self.run: list[int] = []

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.run.append(epoch)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing"])
def test_backup_and_restore_resumes_after_its_index_was_damaged(
    tmp_path: Path, damage: str
) -> None:
    """Before: three bytes cut from the backup's checkpoint.json made the rerun start
    at epoch 0, silently."""
    x, y = _data(40)

    def fit(callbacks: list[Any]) -> ds.Model:
        model = _built(STRATEGY_FACTORIES["one_device"])
        torch.manual_seed(5)
        model.fit(x, y, batch_size=8, epochs=5, callbacks=callbacks, verbose=0)
        return model

    straight = fit([])
    backup = tmp_path / "backup"
    with pytest.raises(KeyboardInterrupt):  # in epoch 3: epochs 0-2 are backed up
        fit([ds.callbacks.BackupAndRestore(backup), _Interrupt(3, 1)])
    index = backup / "checkpoint.json"
    if damage == "truncated":
        index.write_bytes(index.read_bytes()[:-3])
    elif damage == "garbage":
        index.write_bytes(b"\x00garbage\xff")
    else:
        index.unlink()
    epochs = _Epochs()
    resumed = fit([ds.callbacks.BackupAndRestore(backup), epochs])
    assert epochs.run == [3, 4]
    for key, value in _weights(straight).items():
        assert torch.equal(_weights(resumed)[key], value), key


@pytest.mark.parametrize(("verbose", "expect"), [(0, None), (1, "Epoch 2/2"), (2, "Epoch 2/2 - ")])
def test_the_progress_bar_follows_verbose(
    capsys: pytest.CaptureFixture[str], verbose: int, expect: str | None
) -> None:
    x, y = _data(16)
    model = _built(STRATEGY_FACTORIES["mirrored_4"])
    model.fit(x, y, batch_size=8, epochs=2, verbose=verbose)
    err = capsys.readouterr().err
    if expect is None:
        assert err == ""
    else:
        assert expect in err and "loss:" in err and "accuracy:" in err


@pytest.mark.parametrize("name", ["mirrored_4", "central_storage"])
def test_torchmetrics_metrics_are_merged_over_replicas(name: str) -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    x, y = _data(23)  # an uneven last batch: some replicas see no example
    metric = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    model = _built(STRATEGY_FACTORIES[name], metrics=["accuracy", metric])
    logs = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert isinstance(logs, dict)
    assert logs["multiclass_accuracy"] == pytest.approx(logs["accuracy"], abs=1e-6)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert history.history["multiclass_accuracy"] == pytest.approx(
        history.history["accuracy"], abs=1e-6
    )


# -- fixes from the review ------------------------------------------------------------------


def test_empty_data_raises_instead_of_looping_or_logging_zero() -> None:
    model = _built(STRATEGY_FACTORIES["mirrored_4"])
    empty_x, empty_y = np.zeros((0, 4), np.float32), np.zeros((0,), np.int64)
    with pytest.raises(ds.errors.InvalidArgumentError, match="no data"):
        model.fit(empty_x, empty_y, steps_per_epoch=3, verbose=0)
    with pytest.raises(ds.errors.InvalidArgumentError, match="no data"):
        model.fit(empty_x, empty_y, verbose=0)
    with pytest.raises(ds.errors.InvalidArgumentError, match="no data"):
        model.evaluate(empty_x, empty_y, verbose=0)


def test_a_distributed_samplers_batch_size_is_not_taken_for_the_global_one() -> None:
    from distribute.training._data import adapt

    x, y = _data(16)
    dataset = TensorDataset(torch.as_tensor(x), torch.as_tensor(y))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=0)
    data = adapt(ds.get_strategy(), DataLoader(dataset, batch_size=4, sampler=sampler))
    assert data.sizes is None  # counted from the batches instead


def test_validation_every_other_epoch_with_early_stopping_and_csv(tmp_path: Path) -> None:
    x, y = _data(32)
    model = _built(STRATEGY_FACTORIES["mirrored_4"])
    path = tmp_path / "log.csv"
    callbacks = [
        ds.callbacks.EarlyStopping(monitor="val_loss", patience=5),
        ds.callbacks.CSVLogger(path),
    ]
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=4,
        validation_data=(x, y),
        validation_freq=2,
        callbacks=callbacks,
        verbose=0,
    )
    assert len(history.history["val_loss"]) == 2
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert len({len(row) for row in rows}) == 1 and len(rows) == 5  # header + 4 epochs


def test_the_bar_counts_every_step_with_steps_per_execution(
    capsys: pytest.CaptureFixture[str],
) -> None:
    x, y = _data(80)
    model = _built(STRATEGY_FACTORIES["one_device"])
    assert model.optimizer is not None
    model.compile(model.optimizer, torch.nn.CrossEntropyLoss(), ["accuracy"], steps_per_execution=4)
    model.fit(x, y, batch_size=8, epochs=1, verbose=1)
    assert "10/10" in capsys.readouterr().err


def test_a_model_wrapped_outside_the_scope_uses_its_networks_strategy() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        network = _classifier()
    model = ds.Model(network)  # outside the scope
    assert model.distribute_strategy is strategy
    model.compile("sgd", torch.nn.CrossEntropyLoss())
    x, y = _data(16)
    model.fit(x, y, batch_size=8, verbose=0)


def test_validation_inside_fit_calls_the_callbacks_test_hooks() -> None:
    calls: list[str] = []

    class Recorder(ds.callbacks.Callback):
        def on_test_begin(self, logs: Any = None) -> None:
            calls.append("test_begin")

        def on_test_end(self, logs: Any = None) -> None:
            calls.append(f"test_end {sorted(logs or {})}")

    x, y = _data(16)
    model = _built(STRATEGY_FACTORIES["mirrored_4"])
    model.fit(
        x, y, batch_size=8, epochs=2, validation_data=(x, y), callbacks=[Recorder()], verbose=1
    )
    assert calls == ["test_begin", "test_end ['accuracy', 'loss']"] * 2


def test_a_probability_loss_given_logits_warns_once() -> None:
    model = _built(STRATEGY_FACTORIES["one_device"])
    model.compile("sgd", "sparse_categorical_crossentropy")  # Keras's: probabilities
    x, y = _data(16)
    with pytest.warns(UserWarning, match="from_logits=True") as caught:
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert len([w for w in caught if "from_logits" in str(w.message)]) == 1


# -- evaluate, predict and validation run in eval mode (#23, item 4) ---------------------


def _batchnorm_network() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.5),
        torch.nn.Linear(8, 3),
    )


def _buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_buffers()}


class _ModeRecorder(ds.callbacks.Callback):
    """Records each submodule's mode during validation, and the BatchNorm buffers
    at its start and end."""

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[set[bool]] = []
        self.buffers: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        self._start: dict[str, torch.Tensor] = {}

    def on_test_begin(self, logs: Any = None) -> None:
        self._start = _buffers(self.model)

    def on_test_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.modes.append({m.training for m in self.model.modules()})

    def on_test_end(self, logs: Any = None) -> None:
        self.buffers.append((self._start, _buffers(self.model)))


@pytest.mark.parametrize(
    "name", ["default", "one_device", "mirrored_2", "mirrored_4", "central_storage"]
)
def test_predict_evaluate_and_validation_run_in_eval_mode_and_restore_the_mode(
    name: str,
) -> None:
    """Keras's training=False: after fit of a BatchNorm network, predict equals an
    eval-mode forward, and neither predict, evaluate nor fit's validation changes a
    buffer; every submodule's own mode comes back, a frozen one included."""
    make = (
        (lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]))
        if name == "mirrored_2"
        else STRATEGY_FACTORIES[name]
    )
    strategy = make()
    torch.manual_seed(0)
    with strategy.scope():
        model = ds.Model(_batchnorm_network())
    model.compile("sgd", torch.nn.CrossEntropyLoss())
    x, y = _data(40)
    recorder = _ModeRecorder()
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        validation_data=(x[:16], y[:16]),
        callbacks=[recorder],
        verbose=0,
    )
    assert recorder.modes and all(modes == {False} for modes in recorder.modes)
    for start, end in recorder.buffers:
        for key in start:
            torch.testing.assert_close(end[key], start[key], rtol=0, atol=0, msg=key)
    assert all(m.training for m in model.modules())  # fit went on training after validation

    model.module[3].eval()  # a user's frozen submodule stays frozen
    trained = _buffers(model)
    predictions = model.predict(x, batch_size=8, verbose=0)
    model.evaluate(x, y, batch_size=8, verbose=0)
    for key, value in _buffers(model).items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)
    assert [m.training for m in model.modules()] == [True, True, True, True, True, False, True]

    twin = _batchnorm_network()
    twin.load_state_dict({k: v.detach().clone() for k, v in model.module.state_dict().items()})
    with torch.no_grad():
        expected = twin.eval()(torch.as_tensor(x)).numpy()
    np.testing.assert_allclose(predictions, expected, rtol=1e-5, atol=1e-6)


def test_the_mode_is_restored_when_predict_or_evaluate_raises() -> None:
    class Boom(ds.callbacks.Callback):
        def on_predict_batch_end(self, batch: int, logs: Any = None) -> None:
            raise RuntimeError("boom")

        def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
            raise RuntimeError("boom")

    with ds.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = ds.Model(_batchnorm_network())
    model.compile("sgd", torch.nn.CrossEntropyLoss())
    x, y = _data(16)
    with pytest.raises(RuntimeError, match="boom"):
        model.predict(x, batch_size=8, verbose=0, callbacks=[Boom()])
    assert all(m.training for m in model.modules())
    with pytest.raises(RuntimeError, match="boom"):
        model.evaluate(x, y, batch_size=8, verbose=0, callbacks=[Boom()])
    assert all(m.training for m in model.modules())


def test_a_mean_metric_is_named_mean_by_default_as_in_keras() -> None:
    mean = ds.metrics.Mean()
    assert mean.name == "mean"
    ds.get_strategy().run(mean.update_state, args=(torch.tensor([2.0, 4.0]),))
    assert mean.result() == 3.0


class _InferenceBatchCalls(ds.callbacks.Callback):
    """evaluate's and predict's batch hooks, and the loss each test batch end sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []
        self.losses: list[float] = []

    def on_test_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.calls.append(("test_begin", batch))

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        self.calls.append(("test_end", batch))
        self.losses.append(float(logs["loss"]))

    def on_predict_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.calls.append(("predict_begin", batch))

    def on_predict_batch_end(self, batch: int, logs: Any = None) -> None:
        self.calls.append(("predict_end", batch))


@pytest.mark.parametrize("name", ["default", "mirrored_4"])
def test_evaluate_and_predict_call_batch_hooks_every_steps_per_execution_steps(
    name: str,
) -> None:
    """Keras's rule, as fit's: begin at a group's first step, end at its last (the
    last group short) with the logs of that step; the results as with one step."""
    x, y = _data(80)  # 10 steps of 8
    runs = {}
    for every in (1, 4):
        model = _built(STRATEGY_FACTORIES[name])
        assert model.optimizer is not None
        model.compile(
            model.optimizer, torch.nn.CrossEntropyLoss(), ["accuracy"], steps_per_execution=every
        )
        calls = _InferenceBatchCalls()
        result = model.evaluate(x, y, batch_size=8, verbose=0, callbacks=[calls])
        predictions = model.predict(x, batch_size=8, verbose=0, callbacks=[calls])
        runs[every] = (calls, result, predictions)
    calls, result, predictions = runs[4]
    groups = [("begin", 0), ("end", 3), ("begin", 4), ("end", 7), ("begin", 8), ("end", 9)]
    assert calls.calls == [
        (f"{kind}_{hook}", step) for kind in ("test", "predict") for hook, step in groups
    ]
    one_step, one_result, one_predictions = runs[1]
    np.testing.assert_allclose(calls.losses, [one_step.losses[i] for i in (3, 7, 9)], rtol=1e-6)
    np.testing.assert_allclose(result, one_result, rtol=1e-6)
    np.testing.assert_allclose(predictions, one_predictions, rtol=1e-6)


def test_the_bar_counts_every_step_of_evaluate_and_predict_with_steps_per_execution(
    capsys: pytest.CaptureFixture[str],
) -> None:
    x, y = _data(80)
    model = _built(STRATEGY_FACTORIES["one_device"])
    assert model.optimizer is not None
    model.compile(model.optimizer, torch.nn.CrossEntropyLoss(), ["accuracy"], steps_per_execution=4)
    model.evaluate(x, y, batch_size=8, verbose=1)
    model.predict(x, batch_size=8, verbose=1)
    err = capsys.readouterr().err
    assert "evaluate: 100%" in err and "predict: 100%" in err and "10/10" in err, err


@pytest.mark.parametrize("name", ["default", "mirrored_4"])
def test_losses_read_in_one_batch_give_the_history_of_losses_read_step_by_step(
    name: str,
) -> None:
    """The built-in steps' losses wait and are read in one stacked reduce (issue 40);
    an overridden step's are read after each step (its loss may hold a graph): the
    same epoch losses and evaluate loss, to the bit."""

    class Overridden(ds.Model):
        def train_step(self, data: Any) -> dict[str, torch.Tensor]:
            return super().train_step(data)

        def test_step(self, data: Any) -> dict[str, torch.Tensor]:
            return super().test_step(data)

    x, y = _data(84)  # 10 steps of 8 and a partial one of 4
    results = []
    for kind in (ds.Model, Overridden):
        strategy = STRATEGY_FACTORIES[name]()
        torch.manual_seed(0)
        with strategy.scope():
            model = kind(_classifier())
        model.compile("sgd", torch.nn.CrossEntropyLoss(), ["accuracy"])
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        results.append((history.history, model.evaluate(x, y, batch_size=8, verbose=0)))
    assert results[0] == results[1]


def test_a_batch_hook_set_on_the_callback_object_gets_the_logs_a_class_s_hook_gets() -> None:
    """`fit` reads batch logs for a hook assigned to a callback instance as for one
    defined in its class: the running loss and metrics, not empty logs."""
    seen: dict[str, list[dict[str, float]]] = {"object": [], "class": []}

    class ClassHook(ds.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            seen["class"].append(dict(logs or {}))

    on_object = ds.callbacks.Callback()
    on_object.on_train_batch_end = lambda batch, logs=None: seen["object"].append(  # type: ignore[method-assign]
        dict(logs or {})
    )
    x, y = _data(40)
    for callback in (on_object, ClassHook()):
        model = _built(STRATEGY_FACTORIES["default"])
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert len(seen["object"]) == 5 and seen["object"] == seen["class"]
    assert set(seen["object"][-1]) == {"loss", "accuracy"}
