"""Shared pieces of the XLA tests: data, a small model, and the CPU reference run."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

import distribute as ds

GLOBAL_BATCH = 16
#: 19 full batches and a partial one of 13 rows: 20 steps.
EXAMPLES = 19 * GLOBAL_BATCH + 13


def data(n: int = EXAMPLES, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].sum(dim=1) > 0).long() + (x[:, 4] > 1).long()
    return x, y


def loader(x: torch.Tensor, y: torch.Tensor, batch: int = GLOBAL_BATCH) -> DataLoader[Any]:
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def mlp(seed: int = 0, hidden: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3)
    )


def cpu_reference(x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-device CPU training on the same global batches: losses and weights."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for xb, yb in loader(x, y):
        per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        loss = per_example.sum() / GLOBAL_BATCH
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(
    strategy: ds.Strategy,
    x: torch.Tensor,
    y: torch.Tensor,
    on_step: Callable[[int], None],
    hidden: int = 32,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training under `strategy`, written once as in the README (``hidden``:
    another width gives programs no other test compiled)."""
    reference = mlp(hidden=hidden)
    with strategy.scope():
        model = mlp(hidden=hidden)
        model.load_state_dict(reference.state_dict())  # XLA's RNG initializes differently
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    losses = []
    for i, batch in enumerate(strategy.experimental_distribute_dataset(loader(x, y))):
        losses.append(float(strategy.reduce("sum", strategy.run(step, args=batch), axis=None)))
        on_step(i)
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def assert_close_to_reference(
    got: tuple[list[float], dict[str, torch.Tensor]],
    want: tuple[list[float], dict[str, torch.Tensor]],
) -> None:
    losses, weights = got
    want_losses, want_weights = want
    assert len(losses) == len(want_losses) == 20
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), atol=1e-5, rtol=0)
    for name, value in want_weights.items():
        torch.testing.assert_close(weights[name], value, atol=1e-5, rtol=0, msg=name)


class _CompileCounts(ds.callbacks.Callback):
    """Graphs compiled so far, after each step of the first epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: list[int] = []
        self.epoch = 0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        from distribute.collectives import xla

        if self.epoch == 0:
            self.counts.append(xla.compile_count())


def fit_history(strategy: ds.Strategy, compiles: list[int] | None = None) -> dict[str, list[float]]:
    """`ds.Model.fit` for 3 shuffled epochs with a partial last batch (300 = 9 x 32 + 12);
    `compiles` gets the compile count after each step of the first epoch (XLA)."""
    x, y = data(300)
    reference = mlp()
    with strategy.scope():
        net = mlp()
        net.load_state_dict(reference.state_dict())
        model = ds.Model(net)
    model.compile(optimizer="sgd", loss=torch.nn.CrossEntropyLoss(), metrics=["accuracy"])
    torch.manual_seed(1)  # the shuffling seed
    counter = _CompileCounts()
    callbacks = [counter] if compiles is not None else []
    history = model.fit(
        x.numpy(), y.numpy(), batch_size=32, epochs=3, verbose=0, callbacks=callbacks
    )
    if compiles is not None:
        compiles.extend(counter.counts)
    return dict(history.history)


def assert_same_history(got: dict[str, list[float]], want: dict[str, list[float]]) -> None:
    assert got["accuracy"] == want["accuracy"]
    torch.testing.assert_close(
        torch.tensor(got["loss"]), torch.tensor(want["loss"]), atol=1e-5, rtol=0
    )


def initial_weights(strategy: ds.Strategy, seed: int = 3) -> dict[str, torch.Tensor]:
    """The weights a model built in `strategy`'s scope starts from (on the CPU)."""
    torch.manual_seed(seed)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(5, 2), torch.nn.LayerNorm(2))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def written_once(strategy: ds.Strategy, steps: int = 5) -> dict[str, torch.Tensor]:
    """Training written once, as in the README: the model is built in the scope from a
    seed (no weights copied in), plain host tensors are passed to `run`."""
    x, y = data(steps * GLOBAL_BATCH)
    torch.manual_seed(11)
    with strategy.scope():
        model = mlp(seed=11)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    for batch in strategy.experimental_distribute_dataset(loader(x, y)):
        strategy.run(step, args=batch)
    # A plain host tensor passed to `run` reaches the replica's device.
    probe = strategy.run(lambda t: model(t).sum(), args=(torch.ones(2, 8),))
    float(strategy.reduce("sum", probe, axis=None))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=0, msg=name)


# -- ds.Model under TPUStrategy (issue #30) ---------------------------------------------

#: fit's data: 300 = 9 x 32 + 12 examples, a partial last batch (padded on XLA).
FIT_EXAMPLES, FIT_BATCH, FIT_EPOCHS = 300, 32, 3
FIT_STEPS = -(-FIT_EXAMPLES // FIT_BATCH)


def _optimizer(kind: str) -> Any:
    if kind == "momentum":  # torch's rule, as a user passes it
        return lambda params: torch.optim.SGD(params, lr=0.2, momentum=0.9)
    return kind  # a Keras name: Keras's rule (distribute.training.optimizers)


def _xla_counters() -> tuple[int, int]:
    """(graphs compiled, XLA executions) so far in this process."""
    import torch_xla.debug.metrics as met

    from distribute.collectives import xla

    runs = sum(int(met.counter_value(n) or 0) for n in ("ExecuteReplicated", "ExecuteComputation"))
    return xla.compile_count(), runs


class EpochCounters(ds.callbacks.Callback):
    """Graphs compiled and XLA executions during each epoch (epoch hooks only: fit
    then reads no batch logs, so it reads each execution's while the next runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.compiles: list[int] = []
        self.executions: list[int] = []

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._start = _xla_counters()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        compiles, runs = _xla_counters()
        self.compiles.append(compiles - self._start[0])
        self.executions.append(runs - self._start[1])


class BatchCalls(ds.callbacks.Callback):
    """The batch hooks fit calls, and the loss each end sees (fit reads batch logs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []
        self.losses: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.calls.append(("begin", batch))

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.calls.append(("end", batch))
        self.losses.append(float((logs or {})["loss"]))


def fit_run(
    strategy: ds.Strategy,
    optimizer: str = "momentum",
    steps_per_execution: int = 1,
    callback: ds.callbacks.Callback | None = None,
) -> dict[str, Any]:
    """`ds.Model` built in `strategy`'s scope from fixed weights, compiled with
    accuracy, fit for 3 shuffled epochs with a partial last batch, then evaluated and
    asked to predict on the same arrays: the history, the final weights, evaluate's
    loss and accuracy, and the predictions (host arrays)."""
    x, y = data(FIT_EXAMPLES)
    reference = mlp()
    with strategy.scope():
        net = mlp()
        net.load_state_dict(reference.state_dict())
        model = ds.Model(net)
    model.compile(
        optimizer=_optimizer(optimizer),
        loss=torch.nn.CrossEntropyLoss(),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    torch.manual_seed(1)  # the shuffling seed
    history = model.fit(
        x.numpy(),
        y.numpy(),
        batch_size=FIT_BATCH,
        epochs=FIT_EPOCHS,
        verbose=0,
        callbacks=[callback] if callback is not None else [],
    )
    loss, accuracy = model.evaluate(x.numpy(), y.numpy(), batch_size=FIT_BATCH, verbose=0)
    predictions = model.predict(x.numpy(), batch_size=FIT_BATCH, verbose=0)
    return {
        "history": dict(history.history),
        "weights": {k: v.detach().cpu() for k, v in net.state_dict().items()},
        "evaluate": (loss, accuracy),
        "predictions": predictions,
    }


def assert_same_run(got: dict[str, Any], want: dict[str, Any]) -> None:
    """fit's history, the weights, evaluate and predict within 1e-5; accuracy exact."""
    assert_same_history(got["history"], want["history"])
    assert_same_weights(got["weights"], want["weights"])
    (loss, accuracy), (want_loss, want_accuracy) = got["evaluate"], want["evaluate"]
    assert abs(loss - want_loss) < 1e-5 and accuracy == want_accuracy
    predictions = got["predictions"]
    assert isinstance(predictions, np.ndarray) and predictions.shape == (FIT_EXAMPLES, 3)
    np.testing.assert_allclose(predictions, want["predictions"], atol=1e-5, rtol=0)


@functools.cache
def counted_fit_run(
    strategy: ds.Strategy, optimizer: str, steps_per_execution: int
) -> tuple[dict[str, Any], EpochCounters]:
    """`fit_run` under `strategy`, once per process for each case, with its counters."""
    counters = EpochCounters()
    return fit_run(strategy, optimizer, steps_per_execution, counters), counters


@functools.cache
def default_fit_run(optimizer: str) -> dict[str, Any]:
    """`fit_run` under the default strategy (steps_per_execution changes no number)."""
    return fit_run(ds.get_strategy(), optimizer)


#: Batch hooks of one epoch of FIT_STEPS (10) steps with steps_per_execution=4:
#: Keras's, every 4 steps, the last group short.
BATCH_CALLS_EVERY_4 = [("begin", 0), ("end", 3), ("begin", 4), ("end", 7), ("begin", 8), ("end", 9)]


def train_in_executions(
    strategy: ds.TPUStrategy, x: torch.Tensor, y: torch.Tensor, every: int
) -> tuple[tuple[list[float], dict[str, torch.Tensor]], int]:
    """`train` written with ``every`` `run` calls per ``strategy.one_execution()``
    (losses read after each execution): the losses and weights, and the XLA
    executions the loop took."""
    reference = mlp(hidden=24)  # a width no other test compiles
    with strategy.scope():
        model = mlp(hidden=24)
        model.load_state_dict(reference.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    batches = list(strategy.experimental_distribute_dataset(loader(x, y)))
    losses: list[float] = []
    before = _xla_counters()[1]
    for start in range(0, len(batches), every):
        with strategy.one_execution():
            outs = [strategy.run(step, args=batch) for batch in batches[start : start + every]]
        losses += [float(strategy.reduce("sum", out, axis=None)) for out in outs]
    runs = _xla_counters()[1] - before
    return (losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}), runs


def cpu_reference_of_width(
    x: torch.Tensor, y: torch.Tensor, hidden: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`cpu_reference` for an MLP of another width."""
    model = mlp(hidden=hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for xb, yb in loader(x, y):
        loss = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none").sum()
        loss = loss / GLOBAL_BATCH
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- the recompilation warning (issue #36) ------------------------------------------------

RECOMPILED = "compiled .* new XLA graph"


def recompilation_warnings(run: Callable[[], Any]) -> list[str]:
    """The recompilation warnings (NOTE [recompilation]) that ``run()`` gave."""
    import re
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if re.search(RECOMPILED, str(w.message))]


def _trimmed(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out`` plus zero from a tensor whose size is read from the data: a host read
    (``.item()``) and a shape that follows the data, a new graph for most batches."""
    size = 1 + int(abs(float(x.sum().item())) * 1000) % 97
    return out + torch.zeros(size, device=x.device).sum()


def data_dependent_loop(strategy: ds.Strategy, steps: int = 20) -> None:
    """A custom loop whose step's shapes depend on the data (a new graph most steps)."""
    x, y = data()
    with strategy.scope():
        model = mlp(hidden=20)  # a width no other test compiles
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def trimming_step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        out = _trimmed(model(xb), xb)
        loss = ds.compute_average_loss(
            torch.nn.functional.cross_entropy(out, yb, reduction="none"),
            global_batch_size=GLOBAL_BATCH,
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    batches = strategy.experimental_distribute_dataset(loader(x, y))
    for _, batch in zip(range(steps), batches):
        strategy.run(trimming_step, args=batch)


class _Trimming(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(hidden=22)  # a width no other test compiles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _trimmed(self.net(x), x)


def data_dependent_fit(strategy: ds.Strategy, epochs: int, steps_per_execution: int = 1) -> None:
    """``fit`` of a model whose forward's shapes depend on the data."""
    x, y = data(FIT_EXAMPLES)
    with strategy.scope():
        model = ds.Model(_Trimming())
    model.compile(
        optimizer="sgd", loss=torch.nn.CrossEntropyLoss(), steps_per_execution=steps_per_execution
    )
    model.fit(x.numpy(), y.numpy(), batch_size=FIT_BATCH, epochs=epochs, verbose=0)


# -- the recompilation warning's checks, shared by both modes (issue #36) -------------------


def check_data_dependent_loop_warned_once(strategy: ds.Strategy) -> None:
    """A custom loop whose step trims its batch by a host read recompiles, and is
    warned of once, naming the step."""
    from distribute.collectives import xla

    before = xla.compile_count()
    messages = recompilation_warnings(lambda: data_dependent_loop(strategy))
    assert xla.compile_count() - before > 8  # it does recompile (before: silently)
    assert len(messages) == 1, messages  # once, not once per new graph
    (message,) = messages
    assert "'data_dependent_loop.<locals>.trimming_step'" in message, message
    assert "depend on the data" in message and ".item()" in message, message


def check_data_dependent_fit_warned_after_the_first_epoch(
    strategy: ds.Strategy, steps_per_execution: int
) -> None:
    """The same under `fit`: nothing in the first epoch, then once per signature (an
    epoch's 10 steps in executions of ``steps_per_execution`` make at most two)."""
    assert recompilation_warnings(lambda: data_dependent_fit(strategy, epochs=1)) == []
    messages = recompilation_warnings(
        lambda: data_dependent_fit(strategy, epochs=3, steps_per_execution=steps_per_execution)
    )
    assert 1 <= len(messages) <= 2, messages
    assert all("'Model._run_step.<locals>.replica_fn'" in m for m in messages), messages
    assert all("after the first epoch" in m for m in messages), messages


def check_clean_runs_not_warned(strategy: ds.Strategy) -> None:
    """A clean custom loop and a clean `fit` (1 and 4 steps per execution): no warning."""
    x, y = data()
    assert recompilation_warnings(lambda: train(strategy, x, y, on_step=lambda i: None)) == []
    for every in (1, 4):
        run = functools.partial(fit_run, strategy, steps_per_execution=every)
        assert recompilation_warnings(run) == []


# -- evaluate and predict in executions of steps_per_execution (issue #40) -----------------


class InferenceBatchCalls(ds.callbacks.Callback):
    """evaluate's and predict's batch hooks, and the loss each test batch end sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []
        self.losses: list[float] = []

    def on_test_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.calls.append(("test_begin", batch))

    def on_test_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.calls.append(("test_end", batch))
        self.losses.append(float((logs or {})["loss"]))

    def on_predict_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.calls.append(("predict_begin", batch))

    def on_predict_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.calls.append(("predict_end", batch))


#: evaluate's and predict's batch hooks over FIT_STEPS (10) steps with
#: steps_per_execution=4, as fit's (BATCH_CALLS_EVERY_4).
INFERENCE_CALLS_EVERY_4 = [
    (f"{kind}_{hook}", step) for kind in ("test", "predict") for hook, step in BATCH_CALLS_EVERY_4
]


def inference_run(
    strategy: ds.Strategy,
    steps_per_execution: int,
    callback: ds.callbacks.Callback | None = None,
    hidden: int = 32,
) -> dict[str, Any]:
    """A model built in `strategy`'s scope from fixed weights, compiled with accuracy
    and ``steps_per_execution``, evaluated then asked to predict twice on FIT_EXAMPLES
    (10 steps, a padded last batch): the second calls' results, and each call's
    graphs compiled and XLA executions (XLA), as ``{"evaluate": [(compiles,
    executions), ...], "predict": [...]}`` under "counts"."""
    x, y = data(FIT_EXAMPLES)
    reference = mlp(hidden=hidden)
    with strategy.scope():
        net = mlp(hidden=hidden)
        net.load_state_dict(reference.state_dict())
        model = ds.Model(net)
    model.compile(
        optimizer="sgd",
        loss=torch.nn.CrossEntropyLoss(),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    callbacks = [callback] if callback is not None else []
    xla = strategy.extended.step_runner.name == "XLA_EXECUTIONS"
    counts: dict[str, list[tuple[int, int]]] = {"evaluate": [], "predict": []}
    result: dict[str, Any] = {"counts": counts}
    for _ in range(2):
        start = _xla_counters() if xla else (0, 0)
        result["evaluate"] = model.evaluate(
            x.numpy(), y.numpy(), batch_size=FIT_BATCH, verbose=0, callbacks=callbacks
        )
        middle = _xla_counters() if xla else (0, 0)
        result["predictions"] = model.predict(
            x.numpy(), batch_size=FIT_BATCH, verbose=0, callbacks=callbacks
        )
        end = _xla_counters() if xla else (0, 0)
        counts["evaluate"].append((middle[0] - start[0], middle[1] - start[1]))
        counts["predict"].append((end[0] - middle[0], end[1] - middle[1]))
    return result


def assert_same_inference(got: dict[str, Any], want: dict[str, Any]) -> None:
    """evaluate's loss within 1e-5 and its accuracy exact; predictions within 1e-5."""
    (loss, accuracy), (want_loss, want_accuracy) = got["evaluate"], want["evaluate"]
    assert abs(loss - want_loss) < 1e-5 and accuracy == want_accuracy
    assert got["predictions"].shape == (FIT_EXAMPLES, 3)
    np.testing.assert_allclose(got["predictions"], want["predictions"], atol=1e-5, rtol=0)


@functools.cache
def counted_inference_run(strategy: ds.Strategy, steps_per_execution: int) -> dict[str, Any]:
    """`inference_run` under `strategy` with a width no other test compiles (so the
    first call's compiles are its own), once per process for each case."""
    return inference_run(strategy, steps_per_execution, hidden=26)


def validated_fit_history(strategy: ds.Strategy, steps_per_execution: int) -> dict[str, Any]:
    """`fit` for 4 epochs with validation data of 200 rows (7 steps: a short last
    execution with steps_per_execution=4), a width no other test compiles."""
    x, y = data(FIT_EXAMPLES)
    vx, vy = data(200, seed=5)
    reference = mlp(hidden=30)
    with strategy.scope():
        net = mlp(hidden=30)
        net.load_state_dict(reference.state_dict())
        model = ds.Model(net)
    model.compile(
        optimizer="sgd",
        loss=torch.nn.CrossEntropyLoss(),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    torch.manual_seed(1)  # the shuffling seed
    history = model.fit(
        x.numpy(),
        y.numpy(),
        batch_size=FIT_BATCH,
        epochs=4,
        verbose=0,
        validation_data=(vx.numpy(), vy.numpy()),
    )
    return dict(history.history)
