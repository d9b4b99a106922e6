"""Chief programs of `ds.Model.fit` under ParameterServerStrategy, for
tests/distributed/test_parameter_server_fit.py.

As `_ps_chief.py` (whose report format and `_attempt` this reuses): rpc is one per
process, so each case runs as ``python tests/distributed/_ps_fit_chief.py <case>``,
starts a `LocalCluster` (this process is the chief), runs its checks, shuts the
cluster down and prints one ``PS_CHIEF_RESULT <json>`` line. The one-device
references run in this process too, under the default strategy, from the same seed.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ps_chief import MARKER, _attempt, _error

import distribute as ds

ROWS, BATCH, EPOCHS = 70, 16, 3  # 70 = 4 x 16 + 6: an uneven last batch


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 3)).astype("float32")
    y = (x @ np.array([[1.5], [-2.0], [0.5]], dtype="float32") + 4.3).astype("float32")
    return x, y


def _optimizer(name: str, lr: float) -> Any:
    if name == "sgd_momentum":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    return lambda params: torch.optim.Adam(params, lr=lr)


def _model(strategy: Any, optimizer: str, lr: float = 0.02) -> ds.Model:
    torch.manual_seed(0)
    with strategy.scope():
        model = ds.Model(
            torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        )
        model.compile(loss="mse", optimizer=_optimizer(optimizer, lr), metrics=["mae"])
    return model


def _weights(model: ds.Model) -> list[list[float]]:
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


class _EpochWeights(ds.callbacks.Callback):
    """Records the weights at every epoch's end (the chief's copies, read back)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[list[list[float]]] = []

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        assert self.model is not None
        self.weights.append(_weights(self.model))


class _Interrupt(ds.callbacks.Callback):
    """Raises at the end of epoch `epoch` (after the callbacks before it ran)."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if epoch == self.epoch:
            raise KeyboardInterrupt(f"interrupted after epoch {epoch}")


class _KillAt(ds.callbacks.Callback):
    """Kills a worker task when batch `batch` of the first epoch ends."""

    def __init__(self, cluster: Any, task: str, batch: int) -> None:
        super().__init__()
        self.cluster, self.task, self.batch = cluster, task, batch
        self.killed = False

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.killed and batch == self.batch:
            self.cluster.kill(self.task)
            self.killed = True


def _fit(model: ds.Model, **kwargs: Any) -> dict[str, list[float]]:
    x, y = _data()
    args: dict[str, Any] = {"epochs": EPOCHS, "batch_size": BATCH, "verbose": 0}
    args.update(kwargs)
    return model.fit(x, y, **args).history


def _repeating(context: ds.InputContext) -> Any:
    """A per-worker dataset_fn: this worker's half of the rows, again and again, and
    the context it was given (every row's first feature column carries it)."""
    x, y = _data()
    rows = slice(context.input_pipeline_id, None, context.num_input_pipelines)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.tensor(x[rows]), torch.tensor(y[rows])), batch_size=8
    )
    return itertools.cycle(loader)


def _context_of(iterator: Any) -> list[int]:
    return list(next(iterator))


def _contexts(context: ds.InputContext) -> Any:
    return itertools.repeat([context.num_input_pipelines, context.input_pipeline_id])


class UserError(Exception):
    """An exception class of the user's script (this file is the chief's ``__main__``:
    the workers get the class by value)."""


class TwoPartError(ValueError):
    """An exception the chief cannot rebuild: its ``__init__`` does not take its
    message (pickle calls ``TwoPartError(message)``)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")


def _task() -> str:
    """The task this runs on (``worker_1``), from its TF_CONFIG."""
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    return f"{task['type']}_{task['index']}"


class _FailingOn(ds.Model):
    """A model whose training step raises `error` on worker `task`."""

    def __init__(self, module: torch.nn.Module, task: str, error: type[Exception]) -> None:
        super().__init__(module)
        self.failing_task = task
        self.error = error

    def train_step(self, data: Any) -> Any:
        if _task() == self.failing_task:
            raise self.error(f"a bad batch on {self.failing_task}")
        return super().train_step(data)


def _failing_model(strategy: Any, error: type[Exception]) -> ds.Model:
    torch.manual_seed(0)
    with strategy.scope():
        model = _FailingOn(torch.nn.Linear(3, 1), "worker_1", error)
        model.compile(loss="mse", optimizer="sgd")
    return model


def _user_error_dataset_fn(context: ds.InputContext) -> Any:
    if context.input_pipeline_id == 1:
        raise UserError(f"no shard {context.input_pipeline_id} of {context.num_input_pipelines}")
    return _repeating(context)


def _value_error_dataset_fn(context: ds.InputContext) -> Any:
    if context.input_pipeline_id == 1:
        raise ValueError(f"no shard {context.input_pipeline_id}")
    return _repeating(context)


def _raise_two_part(detail: str) -> None:
    raise TwoPartError(7, f"{detail} on {_task()}")


def _task_after(seconds: float) -> str:
    time.sleep(seconds)  # a closure's work: both workers get some
    return _task()


def _workers_used(coordinator: Any) -> list[str]:
    """The workers that ran 6 closures of 0.2 s (both, if both are in use)."""
    return sorted(
        set(coordinator.fetch([coordinator.schedule(_task_after, args=(0.2,)) for _ in range(6)]))
    )


def _raised(attempt: Callable[[], Any]) -> dict[str, Any] | None:
    """How `attempt` raised: the error's type, message, notes, whether it is one of
    this script's classes (the chief's own); None if it returned."""
    try:
        attempt()
    except Exception as e:
        return {
            **_error(e),
            "notes": list(getattr(e, "__notes__", [])),
            "is_user_error": type(e) is UserError,
            "remote": {
                k: getattr(e, k, None)
                for k in ("type_name", "remote_message", "task", "remote_traceback")
            },
        }
    return None


def _clean_after(model: ds.Model, coordinator: Any) -> dict[str, Any]:
    """What the next calls do after an error was raised: nothing stale."""
    x, y = _data()
    out: dict[str, Any] = {"evaluate": _raised(lambda: model.evaluate(x, y, verbose=0))}
    out["join"] = _raised(coordinator.join)
    out["workers"] = _workers_used(coordinator)
    return out


# -- checks --------------------------------------------------------------------------------


def check_parity(strategy: Any, optimizer: str) -> dict[str, Any]:
    """fit / evaluate / predict with one worker, against one device in this process."""
    x, _ = _data()
    out: dict[str, Any] = {}
    for name, where in (("one_device", ds.get_strategy()), ("ps", strategy)):
        model = _model(where, optimizer)
        x_val, y_val = _data()
        history = _fit(model, validation_data=(x_val[:20], y_val[:20]))
        out[name] = {
            "history": history,
            "weights": _weights(model),
            "evaluate": model.evaluate(*_data(), batch_size=BATCH, verbose=0),
            "predict": model.predict(x, batch_size=BATCH, verbose=0).ravel().tolist(),
        }
    return out


def check_lr_zero(strategy: Any) -> dict[str, Any]:
    model = _model(strategy, "sgd_momentum", lr=0.0)
    x, y = _data()
    with torch.no_grad():
        initial = float(
            torch.nn.functional.mse_loss(model.module(torch.tensor(x)), torch.tensor(y))
        )
    return {"initial": initial, "losses": _fit(model)["loss"]}


def check_checkpoints(strategy: Any) -> dict[str, Any]:
    """ModelCheckpoint's file of epoch 2 holds the weights that epoch ended with;
    BackupAndRestore resumes an interrupted fit to the weights of an uninterrupted one."""
    directory = Path(tempfile.mkdtemp())
    epochs = _EpochWeights()
    model = _model(strategy, "sgd_momentum")
    saver = ds.callbacks.ModelCheckpoint(str(directory / "epoch{epoch}"))
    _fit(model, callbacks=[saver, epochs])
    restored = _model(ds.get_strategy(), "sgd_momentum", lr=0.5)  # other values to overwrite
    ds.Checkpoint(model=restored).restore(saver.saved[1])

    reference = _model(ds.get_strategy(), "sgd_momentum")
    _fit(reference, shuffle=False, epochs=4)
    backup = ds.callbacks.BackupAndRestore(directory / "backup")
    resumed = _model(strategy, "sgd_momentum")
    try:
        _fit(resumed, shuffle=False, epochs=4, callbacks=[backup, _Interrupt(1)])
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    again = _model(strategy, "sgd_momentum", lr=0.02)
    history = _fit(again, shuffle=False, epochs=4, callbacks=[backup])
    return {
        "epoch_2_weights": epochs.weights[1],
        "restored_from_file": _weights(restored),
        "interrupted": interrupted,
        "resumed_epochs": len(history["loss"]),
        "resumed_weights": _weights(again),
        "uninterrupted_weights": _weights(reference),
    }


class _Endless(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Examples of `_data`, again and again: no length, no end."""

    def __iter__(self) -> Any:
        x, y = _data()
        return itertools.cycle(zip(torch.tensor(x), torch.tensor(y)))


def _endless_batches() -> Any:
    x, y = _data()
    return itertools.cycle([(torch.tensor(x[:BATCH]), torch.tensor(y[:BATCH]))])


def check_refusals(strategy: Any) -> dict[str, Any]:
    model = _model(strategy, "sgd_momentum")
    out: dict[str, Any] = {}
    endless: dict[str, Callable[[], Any]] = {
        "iterable_dataset": _Endless,
        "data_loader": lambda: torch.utils.data.DataLoader(_Endless(), batch_size=BATCH),
        "generator": _endless_batches,
    }
    for name, make in endless.items():
        start = time.monotonic()
        raised = _raised(functools.partial(model.fit, make(), epochs=1, verbose=0))
        out[f"endless_{name}"] = {"raised": raised, "seconds": time.monotonic() - start}
        history = model.fit(make(), epochs=2, steps_per_epoch=3, verbose=0).history
        out[f"endless_{name}"]["with_steps"] = history["loss"]
    attempts: dict[str, Callable[[], Any]] = {
        "backup_per_step": lambda: _fit(
            model, callbacks=[ds.callbacks.BackupAndRestore(tempfile.mkdtemp(), save_freq=2)]
        ),
        "dataset_fn_without_steps": lambda: model.fit(_repeating, epochs=1, verbose=0),
        "dataset_fn_with_y": lambda: model.fit(_repeating, _data()[1], epochs=1, steps_per_epoch=2),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = None
        except Exception as e:
            out[name] = _error(e)
    return out


def check_two_workers(strategy: Any, cluster: Any) -> dict[str, Any]:
    """Two workers learn; evaluate and predict equal a direct computation with the
    trained weights; a dataset_fn gets each worker's context; a worker killed in the
    middle of fit loses nothing."""
    x, y = _data()
    model = _model(strategy, "adam", lr=0.05)
    history = _fit(model)
    with torch.no_grad():
        direct = model.module(torch.tensor(x))
        direct_loss = float(torch.nn.functional.mse_loss(direct, torch.tensor(y)))
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    predicted = model.predict(x, batch_size=BATCH, verbose=0)
    coordinator = ds.coordinator.ClusterCoordinator.of(strategy)
    contexts = iter(coordinator.create_per_worker_dataset(_contexts))
    seen = coordinator.fetch(
        [coordinator.schedule(_context_of, args=(contexts,)) for _ in range(8)]
    )
    from_fn = model.fit(_repeating, epochs=2, steps_per_epoch=5, verbose=0).history
    killer = _KillAt(cluster, "worker_1", batch=2)
    start = time.monotonic()
    after_kill = _fit(model, epochs=2, callbacks=[killer])
    return {
        "losses": history["loss"],
        "evaluate": evaluated,
        "direct_loss": direct_loss,
        "predict_error": float(np.abs(predicted - direct.numpy()).max()),
        "contexts": sorted({tuple(c) for c in seen}),
        "dataset_fn_losses": from_fn["loss"],
        "killed": killer.killed,
        "after_kill": after_kill["loss"],
        "after_kill_seconds": time.monotonic() - start,
    }


def check_worker_errors(strategy: Any) -> dict[str, Any]:
    """The user's errors on worker_1 (in a dataset_fn and in a step), of the script's
    own class and builtins: raised on the chief naming the worker, with nothing
    stale after and both workers still in use."""
    coordinator = ds.coordinator.ClusterCoordinator.of(strategy)
    out: dict[str, Any] = {"workers_before": _workers_used(coordinator)}
    for name, dataset_fn in (
        ("user_dataset_fn", _user_error_dataset_fn),
        ("builtin_dataset_fn", _value_error_dataset_fn),
    ):
        model = _model(strategy, "sgd_momentum")
        raised = _raised(
            functools.partial(model.fit, dataset_fn, epochs=1, steps_per_epoch=4, verbose=0)
        )
        out[name] = {"raised": raised, "after": _clean_after(model, coordinator)}
    for name, error in (("user_step", UserError), ("builtin_step", ValueError)):
        model = _failing_model(strategy, error)
        raised = _raised(functools.partial(_fit, model, epochs=1))
        out[name] = {"raised": raised, "after": _clean_after(model, coordinator)}
    raised = _raised(
        lambda: coordinator.fetch(coordinator.schedule(_raise_two_part, args=("cannot rebuild",)))
    )
    out["unrebuildable"] = {
        "raised": raised,
        "join": _raised(coordinator.join),  # the coordinator's error, raised once
        "join_again": _raised(coordinator.join),
        "workers": _workers_used(coordinator),
    }
    return out


# -- cases ---------------------------------------------------------------------------------


def case_one_worker() -> dict[str, Any]:
    with ds.coordinator.LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = ds.ParameterServerStrategy(cluster.resolver, timeout_seconds=30)
        out = {
            "sgd_momentum": _attempt(None, lambda: check_parity(strategy, "sgd_momentum")),
            "adam": _attempt(None, lambda: check_parity(strategy, "adam")),
            "lr_zero": _attempt(None, lambda: check_lr_zero(strategy)),
            "checkpoints": _attempt(None, lambda: check_checkpoints(strategy)),
            "refusals": _attempt(None, lambda: check_refusals(strategy)),
        }
        strategy.shutdown()
        out["exit_codes"] = cluster.wait(30.0)
    return out


def case_two_workers() -> dict[str, Any]:
    with ds.coordinator.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = ds.ParameterServerStrategy(cluster.resolver, timeout_seconds=20)
        out = {"two_workers": _attempt(None, lambda: check_two_workers(strategy, cluster))}
        strategy.shutdown()
        out["exit_codes"] = cluster.wait(30.0)
    return out


def case_worker_errors() -> dict[str, Any]:
    with ds.coordinator.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = ds.ParameterServerStrategy(cluster.resolver, timeout_seconds=20)
        out = {"errors": _attempt(None, lambda: check_worker_errors(strategy))}
        strategy.shutdown()
        out["exit_codes"] = cluster.wait(30.0)
    return out


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "one_worker": case_one_worker,
    "two_workers": case_two_workers,
    "worker_errors": case_worker_errors,
}


def main(argv: list[str]) -> int:
    (case,) = argv
    start = time.monotonic()
    try:
        result = CASES[case]()
    except BaseException as e:
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    result["case_seconds"] = time.monotonic() - start
    print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
