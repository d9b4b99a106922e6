"""Keras's callbacks for `ds.Model.fit` / `evaluate` / `predict`.

The protocol is Keras's: ``on_{train,epoch,test,predict}_{begin,end}`` and
``on_{train,test,predict}_batch_{begin,end}``, each with a ``logs`` dict. Every
worker of a multi-worker strategy runs the callbacks (a checkpoint is saved by all
of them); what writes files or prints (`CSVLogger`, `TensorBoard`, the progress
bar) writes on the chief alone.

Example:
    >>> import distribute as ds
    >>> stop = ds.callbacks.EarlyStopping(monitor="loss", patience=2)
"""

from __future__ import annotations

import csv
import logging
import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distribute.errors import InvalidArgumentError

if TYPE_CHECKING:
    from distribute.training.model import Model

logger = logging.getLogger(__name__)

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "History",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "TensorBoard",
]


class Callback:
    """Base class: override the hooks you need. ``self.model`` and ``self.params``
    (epochs, steps) are set before training starts.

    Example:
        >>> import numpy as np, torch, distribute as ds
        >>> class Losses(ds.callbacks.Callback):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.seen = []
        ...     def on_epoch_end(self, epoch, logs=None):
        ...         self.seen.append((epoch, round(logs["loss"], 3)))
        >>> model = ds.Model(torch.nn.Linear(1, 1))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> losses = Losses()
        >>> x, y = np.ones((4, 1)), np.zeros((4, 1))
        >>> _ = model.fit(x, y, epochs=2, verbose=0, callbacks=[losses])
        >>> [epoch for epoch, _ in losses.seen]
        [0, 1]
    """

    def __init__(self) -> None:
        self.model: Model | None = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Model) -> None:
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        self.params = params

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_train_end(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_test_end(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_test_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_test_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_predict_begin(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_predict_end(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_predict_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_predict_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...


class CallbackList:
    """Calls every callback's hook in order.

    Example:
        >>> import distribute as ds
        >>> stop = ds.callbacks.EarlyStopping(monitor="loss")
        >>> hooks = ds.callbacks.CallbackList([stop], model=None, params={"epochs": 3})
        >>> hooks.on_train_begin({})   # calls stop.on_train_begin({})
        >>> stop.params
        {'epochs': 3}
    """

    def __init__(self, callbacks: Sequence[Callback], model: Model, params: dict[str, Any]) -> None:
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            callback.set_model(model)
            callback.set_params(params)

    def __getattr__(self, hook: str) -> Callable[..., None]:
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args: Any) -> None:
            for callback in self.callbacks:
                getattr(callback, hook)(*args)

        return call


class History(Callback):
    """Records every epoch's logs: ``history.history["loss"]`` is one value per epoch.

    `fit` adds one and returns it.

    Example:
        >>> import numpy as np, torch, distribute as ds
        >>> model = ds.Model(torch.nn.Linear(1, 1))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 1)), np.zeros((16, 1))
        >>> history = model.fit(x, y, epochs=3, verbose=0)
        >>> len(history.history["loss"])  # one value per epoch
        3
    """

    def __init__(self) -> None:
        super().__init__()
        self.epoch: list[int] = []
        self.history: dict[str, list[float]] = {}

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(value)


def _direction(mode: str, monitor: str) -> str:
    """``"min"`` or ``"max"``; ``"auto"`` is max for accuracies and AUC."""
    if mode == "auto":
        return "max" if "acc" in monitor or monitor.endswith("auc") else "min"
    return mode


def _improved(mode: str, monitor: str, value: float, best: float, min_delta: float) -> bool:
    if _direction(mode, monitor) == "min":
        return value < best - min_delta
    return value > best + min_delta


def _start(mode: str, monitor: str) -> float:
    return math.inf if _direction(mode, monitor) == "min" else -math.inf


class EarlyStopping(Callback):
    """Stops training when ``monitor`` has not improved for ``patience`` epochs.

    Args:
        monitor: a log name (``"val_loss"``, ``"accuracy"``...).
        min_delta: the least change that counts as an improvement.
        patience: epochs without improvement before stopping.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (max for accuracies and AUC).
        baseline: a value the monitor must beat.
        restore_best_weights: put back the best epoch's weights when stopping.

    Example:
        >>> import numpy as np, torch, distribute as ds
        >>> model = ds.Model(torch.nn.Linear(1, 1))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 1)), np.zeros((16, 1))
        >>> stop = ds.callbacks.EarlyStopping(
        ...     monitor="val_loss", min_delta=0.01, patience=2, restore_best_weights=True
        ... )
        >>> history = model.fit(
        ...     x, y, validation_split=0.25, epochs=100, verbose=0, callbacks=[stop]
        ... )
        >>> len(history.epoch) < 100  # stopped early: val_loss no longer improves by 0.01
        True
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
    ) -> None:
        super().__init__()
        if mode not in ("auto", "min", "max"):
            raise InvalidArgumentError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        self.monitor, self.min_delta, self.patience = monitor, abs(min_delta), patience
        self.mode, self.baseline, self.restore_best_weights = mode, baseline, restore_best_weights
        self.stopped_epoch = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.wait = 0
        self.best = self.baseline if self.baseline is not None else _start(self.mode, self.monitor)
        self.best_weights: dict[str, Any] | None = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        value = (logs or {}).get(self.monitor)
        if value is None:  # Keras: warn and skip (validation_freq > 1 leaves epochs out)
            logger.warning(
                "EarlyStopping monitors %r, not in this epoch's logs %s; skipped",
                self.monitor,
                sorted(logs or {}),
            )
            return
        assert self.model is not None
        if _improved(self.mode, self.monitor, value, self.best, self.min_delta):
            self.best, self.wait = value, 0
            if self.restore_best_weights:
                self.best_weights = self.model._logical_state()
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            self.model.stop_training = True
            if self.restore_best_weights and self.best_weights is not None:
                self.model._load_logical_state(self.best_weights)


class LearningRateScheduler(Callback):
    """Sets the learning rate of every parameter group to ``schedule(epoch, lr)`` at
    the start of each epoch.

    Example:
        >>> import numpy as np, torch, distribute as ds
        >>> model = ds.Model(torch.nn.Linear(1, 1))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 1)), np.zeros((16, 1))
        >>> halve = ds.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5 if epoch else lr)
        >>> history = model.fit(x, y, epochs=3, verbose=0, callbacks=[halve])
        >>> history.history["learning_rate"]  # SGD's default 0.01, then halved
        [0.01, 0.005, 0.0025]
    """

    def __init__(self, schedule: Callable[[int, float], float], verbose: int = 0) -> None:
        super().__init__()
        self.schedule = schedule
        self.verbose = verbose

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        assert self.model is not None and self.model.optimizer is not None
        groups = self.model.optimizer.param_groups
        lr = float(self.schedule(epoch, float(groups[0]["lr"])))
        for group in groups:
            group["lr"] = lr

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None and self.model is not None and self.model.optimizer is not None:
            logs["learning_rate"] = float(self.model.optimizer.param_groups[0]["lr"])


class ModelCheckpoint(Callback):
    """Saves the model (with `ds.Checkpoint`) at the end of every epoch, or only when
    ``monitor`` improved (``save_best_only``). ``filepath`` may hold ``{epoch}`` and
    log names (``"ckpt-{epoch:02d}-{val_loss:.2f}"``); every worker saves.

    ``save_weights_only=False`` also saves the optimizer.

    Example:
        >>> import numpy as np, torch, distribute as ds
        >>> model = ds.Model(torch.nn.Linear(1, 1))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 1)), np.zeros((16, 1))
        >>> import os, tempfile
        >>> run = tempfile.mkdtemp()
        >>> save = ds.callbacks.ModelCheckpoint(
        ...     os.path.join(run, "ckpt-{epoch:02d}"), monitor="loss", save_best_only=True
        ... )
        >>> _ = model.fit(x, y, epochs=3, verbose=0, callbacks=[save])
        >>> [os.path.basename(path) for path in save.saved]  # the loss improved each epoch
        ['ckpt-01', 'ckpt-02', 'ckpt-03']
        >>> _ = ds.Checkpoint(model=model).restore(save.saved[-1])
    """

    def __init__(
        self,
        filepath: str | Path,
        monitor: str = "val_loss",
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
    ) -> None:
        super().__init__()
        self.filepath, self.monitor, self.mode = str(filepath), monitor, mode
        self.save_best_only, self.save_weights_only = save_best_only, save_weights_only
        self.best = _start(mode, monitor)
        self.saved: list[str] = []

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        from distribute.checkpoint import Checkpoint

        logs = logs or {}
        if self.save_best_only:
            value = logs.get(self.monitor)
            if value is None or not _improved(self.mode, self.monitor, value, self.best, 0.0):
                return
            self.best = value
        assert self.model is not None
        objects: dict[str, Any] = {"model": self.model}
        if not self.save_weights_only and self.model.optimizer is not None:
            objects["optimizer"] = self.model.optimizer
        try:
            path = self.filepath.format(epoch=epoch + 1, **logs)
        except KeyError as e:
            raise InvalidArgumentError(
                f"ModelCheckpoint's filepath {self.filepath!r} names {e}, which is not in "
                f"this epoch's logs {sorted(logs)}"
            ) from None
        self.saved.append(Checkpoint(**objects, epoch=epoch + 1).write(path))


class BackupAndRestore(Callback):
    """Backs up the training state so that a `fit` interrupted (a killed worker, a
    preempted machine) resumes where it stopped when run again.

    Saves the model, the optimizer, the epoch, the input position and the random
    generators in ``backup_dir`` at the end of every epoch, or every ``save_freq``
    steps; `fit` started again restores them and goes on at that epoch and step,
    ending with the weights of an uninterrupted run. The backup is deleted when
    training ends (``delete_checkpoint``).

    Example:
        >>> import numpy as np, torch, distribute as ds
        >>> model = ds.Model(torch.nn.Linear(1, 1))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 1)), np.zeros((16, 1))
        >>> import os, tempfile
        >>> backup_dir = os.path.join(tempfile.mkdtemp(), "backup")
        >>> # a backup every 100 steps (and at the end of every epoch without save_freq)
        >>> backup = ds.callbacks.BackupAndRestore(backup_dir, save_freq=100)
        >>> _ = model.fit(x, y, epochs=10, verbose=0, callbacks=[backup])
        >>> # killed at epoch 6? run the same line again: it goes on from there
        >>> os.path.exists(backup_dir)  # deleted once training ended
        False
    """

    def __init__(
        self, backup_dir: str | Path, save_freq: str | int = "epoch", delete_checkpoint: bool = True
    ) -> None:
        super().__init__()
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
            raise InvalidArgumentError(
                f"save_freq must be 'epoch' or a positive int, got {save_freq!r}"
            )
        self.backup_dir = Path(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        from distribute.checkpoint import Checkpoint, CheckpointManager, RNGState

        assert self.model is not None
        self._checkpoint = Checkpoint(
            model=self.model, optimizer=self.model.optimizer, rng=RNGState(), epoch=0
        )
        self._manager = CheckpointManager(self._checkpoint, self.backup_dir, max_to_keep=1)
        latest = self._manager.latest_checkpoint
        cross = self.model.distribute_strategy.extended.cross_worker
        if cross is not None:  # every worker restores the same backup, or says why not
            cross.check_same(str(latest), name="backup to restore")
        if latest is not None:
            self._checkpoint.restore(latest)  # the input position waits for its iterator
            self.model._initial_epoch = int(self._checkpoint.epoch)
        self._steps = 0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        assert self.model is not None
        self._checkpoint.data = self.model._train_iterator  # placed after a restore

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._steps += 1
        if isinstance(self.save_freq, int) and self._steps % self.save_freq == 0:
            assert self.model is not None
            self._checkpoint.data = self.model._train_iterator  # fit may have made a new one
            self._manager.save()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        assert self.model is not None
        self._checkpoint.epoch = epoch + 1
        self._checkpoint.data = self.model._train_iterator  # the next epoch's, at its start
        self._manager.save()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self.delete_checkpoint and self.model is not None:
            self.model._barrier("training done")  # every worker has finished with it
            if self.model._is_chief:
                shutil.rmtree(self.backup_dir, ignore_errors=True)
            self.model._barrier("backup deleted")  # the next fit sees it gone everywhere


class CSVLogger(Callback):
    """Writes each epoch's logs as a row of a CSV file (on the chief); the columns are
    the first epoch's keys, ``"NA"`` where a later epoch lacks one.

    Example:
        >>> import numpy as np, torch, distribute as ds
        >>> model = ds.Model(torch.nn.Linear(1, 1))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 1)), np.zeros((16, 1))
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "log.csv")
        >>> _ = model.fit(x, y, epochs=2, verbose=0, callbacks=[ds.callbacks.CSVLogger(path)])
        >>> open(path).read().splitlines()[0]  # then one row per epoch
        'epoch,loss'
    """

    def __init__(self, filename: str | Path, separator: str = ",", append: bool = False) -> None:
        super().__init__()
        self.filename, self.separator, self.append = Path(filename), separator, append

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._keys: list[str] | None = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.model is None or not self.model._is_chief:
            return
        row = {"epoch": epoch, **(logs or {})}
        new = self._keys is None
        if self._keys is None:  # Keras: the first epoch's keys; "NA" where one is missing
            self._keys = list(row)
            new = not (self.append and self.filename.exists())
        with open(self.filename, "w" if new else "a", newline="") as f:
            writer = csv.DictWriter(
                f,
                fieldnames=self._keys,
                delimiter=self.separator,
                restval="NA",
                extrasaction="ignore",
            )
            if new:
                writer.writeheader()
            writer.writerow(row)


class TensorBoard(Callback):
    """Writes each epoch's logs as scalars for TensorBoard (on the chief), through
    ``torch.utils.tensorboard`` (install ``tensorboard``).

    Example:
        >>> import distribute as ds
        >>> board = ds.callbacks.TensorBoard("/tmp/run/tb")
        >>> # model.fit(..., callbacks=[board]), then: tensorboard --logdir /tmp/run/tb
    """

    def __init__(self, log_dir: str | Path = "logs") -> None:
        super().__init__()
        self.log_dir = str(log_dir)
        self._writer: Any = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.model is None or not self.model._is_chief:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise InvalidArgumentError(
                f"the TensorBoard callback needs the tensorboard package ({e}); "
                "pip install 'torch-distribute[tensorboard]'"
            ) from None
        self._writer = SummaryWriter(self.log_dir)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._writer is not None:
            for key, value in (logs or {}).items():
                self._writer.add_scalar(f"epoch_{key}", value, epoch)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
