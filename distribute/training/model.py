"""`ds.Model`: Keras's compile / fit / evaluate / predict, distributed by a strategy.

Build the model in ``strategy.scope()`` and that strategy runs every step::

    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = ds.Model(torch.nn.Linear(1, 1))
        model.compile(loss="mse", optimizer="sgd")
    model.fit(np.ones((100, 1)), np.ones((100, 1)), epochs=2, batch_size=10)

# NOTE [the fit loop]
Each step is ``strategy.run(train_step, batch)``: the batch is the GLOBAL batch
split by the strategy; `train_step` runs once per replica and scales its loss by
the global batch size of that step (`compute_average_loss`), so the gradients
summed over the replicas, and the loss summed by ``strategy.reduce``, are those of
one device on the whole batch, partial last batch included. The epoch's loss is
the mean of the steps' losses weighted by their batch sizes (Keras's), and the
metrics are sync-on-read sums (`distribute.training.metrics`): every strategy
logs the numbers of one device. `train_step`, `test_step` and `predict_step` run
inside ``run`` and may be overridden, as in Keras.

Modes, as Keras's ``training`` argument: `evaluate`, `predict` and `fit`'s
validation switch every submodule to eval mode for their duration and restore
each one's own mode after (an exception included), so BatchNorm normalizes with,
and keeps, its running statistics. `fit` trains in the mode the modules are in
(a new module's is training), so a submodule a user froze with ``.eval()`` stays
frozen.

Under `ParameterServerStrategy` the chief runs no step: `_ps_fit` schedules each
one as a closure on the workers and adds up what they return (NOTE
[parameter-server fit]).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from distribute import context
from distribute._enums import ReduceOp
from distribute.checkpoint._objects import apply_state, capture_state, strategy_of
from distribute.errors import ContextError, InvalidArgumentError
from distribute.losses import compute_average_loss
from distribute.training import _ps_fit
from distribute.training import losses as losses_lib
from distribute.training import metrics as metrics_lib
from distribute.training._data import Data, adapt, local_batch_size, split_arrays, unpack
from distribute.training._progress import ProgressBar
from distribute.training._xla_steps import StepExecutions
from distribute.training.callbacks import Callback, CallbackList, History
from distribute.values import PerReplica, flatten, map_structure

if TYPE_CHECKING:
    from distribute.collectives.base import CrossWorker

__all__ = ["Model"]


class Model(torch.nn.Module):
    """A module with Keras's training loop, distributed by the strategy it was built in.

    Use it to wrap a module (``ds.Model(torch.nn.Linear(1, 1))``) or as a base class
    (define ``forward``; override `train_step`, `test_step` or `predict_step` to
    change a step, which then runs once per replica inside ``strategy.run``).

    Args:
        module: the network, built in the strategy's scope; None when subclassing.

    Example:
        >>> import numpy as np, torch, distribute as ds
        >>> with ds.OneDeviceStrategy("cpu").scope():
        ...     model = ds.Model(torch.nn.Linear(1, 1))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(np.ones((8, 1)), np.ones((8, 1)), epochs=2, verbose=0)
        >>> len(history.history["loss"])
        2
    """

    def __init__(self, module: torch.nn.Module | None = None) -> None:
        super().__init__()
        self._ds_strategy = context.get_strategy()
        if module is not None:
            built_in = _strategy_of(module)
            if built_in is not None:  # wrapped outside the scope the network was built in
                self._ds_strategy = built_in
            self.module = module
        self.optimizer: torch.optim.Optimizer | None = None
        self.stop_training = False
        self.history: History | None = None
        self._loss: Any = None
        self._loss_weights: Any = None
        self._metrics: list[metrics_lib.Metric] = []
        self._steps_per_execution = 1
        # The running step's global batch size, by replica thread (a dict pickles).
        self._step_sizes: dict[int, int | None] = {}
        self._initial_epoch = 0
        self._train_iterator: Any = None
        self._train_data: Data | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if "module" not in self._modules:
            raise NotImplementedError(
                "ds.Model has no network: pass one (ds.Model(module)) or subclass it and "
                "define forward"
            )
        return self.module(*args, **kwargs)

    @property
    def distribute_strategy(self) -> Any:
        """The strategy whose scope built the model; it runs every step."""
        return self._ds_strategy

    # -- compile ------------------------------------------------------------------------

    def compile(
        self,
        optimizer: Any = "rmsprop",
        loss: Any = None,
        metrics: Sequence[Any] | None = None,
        loss_weights: Sequence[float] | dict[str, float] | None = None,
        steps_per_execution: int = 1,
    ) -> None:
        """Sets the optimizer, the loss and the metrics (names, as Keras's, or objects).

        Args:
            optimizer: ``"sgd"``, ``"adam"``, ``"adamw"``, ``"rmsprop"``, ... (Keras's
                defaults), a ``torch.optim`` optimizer of the model's parameters, or a
                function making one from them.
            loss: a name (``"mse"``, ``"sparse_categorical_crossentropy"``, ...), a
                torch loss module, a function ``(y_true, y_pred) -> per-example
                losses``; a list or dict of them for several outputs.
            metrics: names (``"accuracy"``, ``"mae"``, ``"auc"``, ...), `ds.metrics`
                objects or functions of ``(y_true, y_pred)``.
            loss_weights: weights of the outputs' losses.
            steps_per_execution: the batch callbacks (and the progress bar) of
                `fit`, `evaluate` and `predict` run every this many steps (a
                group's first step begins, its last ends, with that step's logs);
                under `TPUStrategy` these steps also run as one XLA execution (one
                graph, compiled once: NOTE [steps per execution] in `_xla_steps.py`).
        """
        if steps_per_execution < 1:
            raise InvalidArgumentError(
                f"steps_per_execution must be >= 1, got {steps_per_execution}"
            )
        with self._ds_strategy.scope():
            self.optimizer = losses_lib.get_optimizer(optimizer, list(self.parameters()))
            self._metrics = metrics_lib.get_all(metrics)
        if isinstance(loss, dict):
            self._loss = {k: losses_lib.get(v) for k, v in loss.items()}
        elif isinstance(loss, (list, tuple)):
            self._loss = [losses_lib.get(v) for v in loss]
        else:
            self._loss = losses_lib.get(loss) if loss is not None else None
        self._loss_weights = loss_weights
        self._steps_per_execution = steps_per_execution

    @property
    def metrics_names(self) -> list[str]:
        return ["loss", *(m.name for m in self._metrics)]

    def _require_compiled(self, what: str) -> None:
        if self.optimizer is None:
            raise ContextError(f"call model.compile(optimizer=..., loss=...) before {what}")

    # -- the steps (one call per replica, inside run) -------------------------------------

    def compute_loss(
        self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None
    ) -> torch.Tensor:
        """This replica's share of the global batch's mean loss (summed over the
        replicas it is the loss of one device on the whole batch)."""
        if self._loss is None:
            raise ContextError("compile the model with a loss, or override compute_loss")
        size = self._global_batch_size(y_pred)
        if not isinstance(self._loss, (dict, list)):  # one loss (weight 1): no sum to make
            per_example = self._loss(y, y_pred)
            return compute_average_loss(
                per_example, sample_weight=sample_weight, global_batch_size=size
            )
        if isinstance(self._loss, dict):
            keys = list(self._loss)
            parts = [(self._loss[k], y[k], y_pred[k]) for k in keys]
            weights = [(self._loss_weights or {}).get(k, 1.0) for k in keys]
        elif isinstance(self._loss, list):
            parts = list(zip(self._loss, y, y_pred))
            weights = list(self._loss_weights or [1.0] * len(parts))
        else:
            parts, weights = [(self._loss, y, y_pred)], [1.0]
        total: torch.Tensor | float = 0.0
        for (fn, target, prediction), weight in zip(parts, weights):
            per_example = fn(target, prediction)
            total = total + weight * compute_average_loss(
                per_example, sample_weight=sample_weight, global_batch_size=size
            )
        assert isinstance(total, torch.Tensor)
        return total

    def compute_metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds the batch to every metric (this replica's own sums)."""
        for metric in self._metrics:
            prediction = y_pred.detach() if isinstance(y_pred, torch.Tensor) else y_pred
            metric.update_state(y, prediction, sample_weight)

    def train_step(self, data: Any) -> dict[str, torch.Tensor]:
        """One replica's step: forward, loss, backward, optimizer step, metrics."""
        x, y, sample_weight = unpack(data)
        y_pred = self(x)
        loss = self.compute_loss(x, y, y_pred, sample_weight)
        loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch
        assert self.optimizer is not None
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.compute_metrics(x, y, y_pred, sample_weight)
        return {"loss": loss.detach()}

    def test_step(self, data: Any) -> dict[str, torch.Tensor]:
        """One replica's evaluation step: forward, loss, metrics."""
        x, y, sample_weight = unpack(data)
        with torch.no_grad():
            y_pred = self(x)
            loss = self.compute_loss(x, y, y_pred, sample_weight)
        self.compute_metrics(x, y, y_pred, sample_weight)
        return {"loss": loss}

    def predict_step(self, data: Any) -> Any:
        """One replica's predictions."""
        x, _, _ = unpack(data)
        with torch.no_grad():
            return self(x)

    def _global_batch_size(self, y_pred: Any) -> int:
        size = self._step_sizes.get(threading.get_ident())
        if size is not None:
            return int(size)
        # Unknown before the step (several workers, a loader of unknown length): sum here.
        local = next(t for t in flatten(y_pred) if isinstance(t, torch.Tensor)).shape[0]
        ctx = context.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return int(local)
        return int(ctx.all_reduce("sum", torch.tensor(float(local))).item())

    # -- running steps ----------------------------------------------------------------------

    def _run_step(self, fn: Callable[[Any], Any], batch: Any, size: int | None) -> Any:
        """Runs ``fn(batch)`` on every replica with the step's global batch size."""

        def replica_fn(data: Any) -> Any:
            thread = threading.get_ident()
            self._step_sizes[thread] = size
            try:
                return fn(data)
            finally:
                self._step_sizes.pop(thread, None)

        return self._ds_strategy.run(replica_fn, args=(batch,))

    def _step_size_of(self, data: Data, step: int, batch: Any) -> int:
        if data.sizes is not None and (data.steps is None or step < data.steps):
            return data.sizes(step)
        strategy = self._ds_strategy
        local = local_batch_size(strategy, batch)
        cross = strategy.extended.cross_worker
        if cross is None:
            return local
        counted = local if strategy.extended.counts_in_worker_sums else 0  # each replica once
        return int(cross.all_reduce_int(counted, "global batch size"))  # unknown up front

    def _sum_losses(self, steps: list[tuple[int, Any]]) -> list[float]:
        """Each step's loss summed over the replicas: the steps' scalar losses stacked
        (per replica) into one ``reduce``, which adds them up as it would one by one."""
        strategy = self._ds_strategy
        losses = [logs["loss"] if isinstance(logs, dict) else logs for _, logs in steps]
        stacked = _stacked(losses)
        if stacked is None:  # not scalar tensors alike: one reduce each
            return [float(strategy.reduce(ReduceOp.SUM, loss, axis=None)) for loss in losses]
        sums: list[float] = strategy.reduce(ReduceOp.SUM, stacked, axis=None).tolist()
        return sums

    def _running_metrics(self) -> dict[str, float]:
        """The metrics so far over this worker's replicas (no communication): exact
        with one worker, this worker's share with several (the epoch's logs are
        global)."""
        return {m.name: m.local_result() for m in self._metrics}

    def _metric_logs(self) -> dict[str, float]:
        return {m.name: m.result() for m in self._metrics}

    def _reset_metrics(self) -> None:
        for metric in self._metrics:
            metric.reset_state()

    # -- fit ------------------------------------------------------------------------------

    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: str | int = "auto",
        callbacks: Sequence[Callback] | None = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool = True,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_freq: int = 1,
        sample_weight: Any = None,
    ) -> History:
        """Trains for ``epochs`` epochs; returns the `History` (``history["loss"]``...).

        ``x`` may be arrays or tensors (with ``y``; split into global batches of
        ``batch_size``, 32 by default, reshuffled every epoch), a DataLoader (its
        batch size is the global batch size), a Dataset, or a distributed dataset.

        ``shuffle`` applies to arrays, tensors and map-style Datasets; it is
        ignored, as Keras ignores it for a dataset or a generator, for input that
        cannot be shuffled here: an `IterableDataset`, a generator or iterable of
        batches, a DataLoader (it shuffles as it was built to) and a distributed
        dataset. Under `ParameterServerStrategy`, input without a length (an
        `IterableDataset`, a DataLoader over one, a generator) needs
        ``steps_per_epoch``.
        """
        self._require_compiled("fit")
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = split_arrays(
                x, y, sample_weight, validation_split
            )
        strategy = self._ds_strategy
        ps_loop = _ps_fit.loop_for(self)
        train = (
            ps_loop.adapt(x, y, sample_weight, batch_size, shuffle, steps_per_epoch)
            if ps_loop is not None
            else adapt(strategy, x, y, sample_weight, batch_size, shuffle)
        )
        validation = None
        if validation_data is not None:
            vx, vy, vw = (
                unpack(validation_data)
                if isinstance(validation_data, tuple)
                else (validation_data, None, None)
            )
            validation = adapt(strategy, vx, vy, vw, batch_size, shuffle=False)
        steps = steps_per_epoch or train.steps
        history = History()
        bar = ProgressBar(verbose, self._is_chief, "train")
        hooks = CallbackList(
            [bar, *(callbacks or ()), history],  # Keras's order: History sees every log
            self,
            {"epochs": epochs, "steps": steps, "verbose": verbose},
        )
        if ps_loop is not None:
            ps_loop.check_callbacks(hooks)
        self.history = history
        self.stop_training = False
        self._initial_epoch = initial_epoch
        self._train_data = train
        self._train_iterator = iter(train.dataset)
        hooks.on_train_begin()
        logs: dict[str, Any] = {}
        for epoch in range(self._initial_epoch, epochs):
            self._reset_metrics()
            hooks.on_epoch_begin(epoch)
            if ps_loop is not None:
                total, count, self._train_iterator = ps_loop.train_epoch(
                    train, hooks, steps_per_epoch, self._train_iterator
                )
            else:
                total, count = self._train_epoch(train, hooks, steps_per_epoch)
            logs = {"loss": total / count if count else 0.0, **self._metric_logs()}
            if validation is not None and (epoch + 1) % validation_freq == 0:
                val = self._evaluate_data(validation, validation_steps, hooks)  # on_test_*
                logs.update({f"val_{k}": v for k, v in val.items()})
            if steps_per_epoch is None or self._train_iterator is None:
                self._train_iterator = iter(train.dataset)  # the next epoch's, not yet drawn from
            hooks.on_epoch_end(epoch, logs)
            cross = self._cross_worker()
            if cross is not None:  # every worker stops after the same epoch
                self.stop_training = cross.all_reduce_int(int(self.stop_training), "stop") > 0
            if self.stop_training:
                break
        hooks.on_train_end(logs)
        return history

    def _train_epoch(
        self, train: Data, hooks: CallbackList, steps_per_epoch: int | None
    ) -> tuple[float, int]:
        # steps_per_execution steps per XLA execution where the strategy records them
        # into one graph, their logs read after it (NOTE [steps per execution]).
        # Elsewhere too, with one worker, the built-in step's (detached) losses wait
        # to be read in one batch where nobody reads batch logs.
        defer = self._cross_worker() is None and _own_step(self, "train_step")
        with StepExecutions(
            self._ds_strategy, self._steps_per_execution, defer=defer
        ) as executions:
            return self._train_steps(train, hooks, steps_per_epoch, executions)

    def _train_steps(
        self,
        train: Data,
        hooks: CallbackList,
        steps_per_epoch: int | None,
        executions: StepExecutions,
    ) -> tuple[float, int]:
        iterator = self._train_iterator
        total, count = 0.0, 0
        taken = 0
        every = self._steps_per_execution
        running = _wants_batch_logs(hooks)  # else the metrics are not summed per step
        # The batch hooks only where a callback does something in them (issue 40).
        batch_begin = _batch_hook(hooks, "on_train_batch_begin")
        batch_end = _batch_hook(hooks, "on_train_batch_end")
        one_worker = self._cross_worker() is None
        fresh = False  # the iterator was just made: an empty pass means empty data
        pending: tuple[int, dict[str, float]] | None = None
        reduced = 0

        def settle(index: int, wait: bool) -> tuple[bool, tuple[int, dict[str, float]]]:
            """Ends the execution (``index``: its last step) and reads the logs of its
            steps (without ``wait``, on XLA or with one worker and the built-in step,
            none yet: nobody reads batch logs, a read on XLA would wait for the
            devices, and elsewhere the reads cost less in one batch at the end):
            whether to stop, and the batch logs."""
            nonlocal total, count, reduced
            steps = executions.finish(wait)
            stop = False
            metrics: dict[str, float] = {}
            if one_worker:  # no collective: the steps' losses in one reduce
                if steps:
                    for (size, _), loss in zip(steps, self._sum_losses(steps)):
                        total, count = total + loss * size, count + size
                    if running:
                        metrics = self._running_metrics()
                return stop, (index, {"loss": total / count, **metrics} if count else {})
            for k, (size, logs) in enumerate(steps):
                last = k == len(steps) - 1  # the metrics so far: read once, after it
                loss, stop, metrics = self._reduce_step(logs, running and last, reduced == 0)
                total, count, reduced = total + loss * size, count + size, reduced + 1
            return stop, (index, {"loss": total / count, **metrics} if count else {})

        while steps_per_epoch is None or taken < steps_per_epoch:
            try:
                batch = next(iterator)
            except StopIteration:
                if steps_per_epoch is None:
                    break
                if fresh:
                    raise InvalidArgumentError("fit got no data: the dataset is empty") from None
                # Keras's steps_per_epoch over a finite dataset: go on into the next pass.
                iterator = self._train_iterator = iter(train.dataset)
                fresh = True
                continue
            fresh = False
            step = iterator.steps - 1
            index = taken if steps_per_epoch is not None else step
            if batch_begin is not None and taken % every == 0:
                batch_begin(index)
            size = self._step_size_of(train, step, batch)
            executions.run(size, self._run_step, self.train_step, batch, size)
            taken += 1
            if not executions.full and (steps_per_epoch is None or taken < steps_per_epoch):
                continue  # the execution's next step
            stop, pending = settle(index, wait=running)
            if taken % every == 0:
                if batch_end is not None:
                    batch_end(*pending)
                pending = None
            if stop or (one_worker and self.stop_training):
                self.stop_training = True
                break
        if executions.pending:  # logs not read yet: the last execution's (XLA), or the
            _, pending = settle(index, wait=True)  # data ended inside an execution
        if pending is not None and taken % every and batch_end is not None:  # a group's last
            batch_end(*pending)
        if count == 0 and steps_per_epoch is None and iterator.steps == 0:
            raise InvalidArgumentError("fit got no data: the dataset is empty")
        return total, count

    def _cross_worker(self) -> CrossWorker | None:
        return self._ds_strategy.extended.cross_worker

    def _reduce_step(
        self, logs: Any, running: bool, first: bool
    ) -> tuple[float, bool, dict[str, float]]:
        """Several workers: the step's loss over every replica, whether any worker
        asked to stop (as of its previous step: so that all stop after the same step),
        and the running metrics, in ONE collective across workers (the loss's)."""
        loss = logs["loss"] if isinstance(logs, dict) else logs
        strategy = self._ds_strategy
        cross = self._cross_worker()
        assert cross is not None  # one worker: `_sum_losses`
        # The loss and metric totals count each replica once (a worker whose
        # replica another worker adds adds 0); the stop flag is every worker's.
        counts = 1.0 if strategy.extended.counts_in_worker_sums else 0.0
        local = sum(float(t) for t in strategy.experimental_local_results(loss)) * counts
        summable = [m for m in self._metrics if not isinstance(m, metrics_lib.TorchMetric)]
        parts = [torch.tensor([local, float(self.stop_training)], dtype=torch.float64)]
        if running:
            parts += [m.local_totals() * counts for m in summable]
        packed = cross.all_reduce([torch.cat(parts)], ReduceOp.SUM, name="fit step", check=first)[0]
        metrics: dict[str, float] = {}
        if running:
            offset = 2
            for metric in summable:
                metrics[metric.name] = metric.result_from(packed[offset : offset + metric.size])
                offset += metric.size
            for metric in self._metrics:
                if isinstance(metric, metrics_lib.TorchMetric):
                    metrics[metric.name] = metric.local_result()
        return float(packed[0]), bool(packed[1] > 0), metrics

    # -- evaluate and predict ---------------------------------------------------------------

    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: str | int = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Sequence[Callback] | None = None,
        return_dict: bool = False,
    ) -> float | list[float] | dict[str, float]:
        """The loss (and metrics) over the data: a scalar without metrics, else a list
        in `metrics_names` order, or a dict with ``return_dict``.

        The network runs in eval mode (Keras's ``training=False``: BatchNorm uses and
        keeps its running statistics, dropout is off); every submodule's mode is
        restored after, as for `predict` and `fit`'s validation."""
        self._require_compiled("evaluate")
        self._read_trained_variables()
        data = adapt(self._ds_strategy, x, y, sample_weight, batch_size, shuffle=False)
        bar = ProgressBar(verbose, self._is_chief, "test")
        hooks = CallbackList([*(callbacks or ()), bar], self, {"steps": steps or data.steps})
        logs = self._evaluate_data(data, steps, hooks)
        if return_dict:
            return logs
        values = [logs[name] for name in self.metrics_names]
        return values[0] if len(values) == 1 else values

    def _evaluate_data(
        self, data: Data, steps: int | None, hooks: CallbackList
    ) -> dict[str, float]:
        with self._inference_mode():
            return self._evaluate_batches(data, steps, hooks)

    def _evaluate_batches(
        self, data: Data, steps: int | None, hooks: CallbackList
    ) -> dict[str, float]:
        self._reset_metrics()
        hooks.on_test_begin()
        total, count = 0.0, 0
        every = self._steps_per_execution
        # The batch hooks every `every` steps, and only where a callback does
        # something in them; on XLA the group's steps are one execution, whose
        # losses are read after it (NOTE [steps per execution]).
        batch_begin = _batch_hook(hooks, "on_test_batch_begin")
        batch_end = _batch_hook(hooks, "on_test_batch_end")
        step = -1
        defer = self._cross_worker() is None and _own_step(self, "test_step")
        with StepExecutions(self._ds_strategy, every, epoch=False, defer=defer) as executions:

            def read(wait: bool) -> None:
                nonlocal total, count
                done = executions.finish(wait)
                for (size, _), loss in zip(done, self._sum_losses(done) if done else ()):
                    total, count = total + loss * size, count + size

            for step, batch in enumerate(itertools.islice(data.dataset, steps)):
                if batch_begin is not None and step % every == 0:
                    batch_begin(step)
                size = self._step_size_of(data, step, batch)
                executions.run(size, self._run_step, self.test_step, batch, size)
                if not executions.full:
                    continue  # the execution's next step
                group_end = batch_end is not None and (step + 1) % every == 0
                read(wait=group_end)
                if batch_end is not None and group_end:
                    batch_end(step, {"loss": total / count})
            read(wait=True)  # the steps not read yet
        if count == 0:
            raise InvalidArgumentError("evaluate got no data: the dataset is empty")
        if batch_end is not None and (step + 1) % every:  # a short last group
            batch_end(step, {"loss": total / count})
        logs = {"loss": total / count, **self._metric_logs()}
        hooks.on_test_end(logs)
        return logs

    def predict(
        self,
        x: Any,
        batch_size: int | None = None,
        verbose: str | int = "auto",
        steps: int | None = None,
        callbacks: Sequence[Callback] | None = None,
    ) -> Any:
        """Every example's prediction, in input order (a NumPy array; a list or dict
        of them for several outputs), gathered from every replica and worker.

        The network runs in eval mode (Keras's ``training=False``), every
        submodule's mode restored after."""
        self._read_trained_variables()
        data = adapt(self._ds_strategy, x, None, None, batch_size, shuffle=False)
        bar = ProgressBar(verbose, self._is_chief, "predict")
        hooks = CallbackList([*(callbacks or ()), bar], self, {"steps": steps or data.steps})
        hooks.on_predict_begin()
        outputs: list[Any] = []
        rows: list[int | None] = []  # each step's examples (a padded batch has fewer)
        strategy = self._ds_strategy
        every = self._steps_per_execution
        batch_begin = _batch_hook(hooks, "on_predict_batch_begin")
        batch_end = _batch_hook(hooks, "on_predict_batch_end")

        def gather(steps: list[tuple[int, Any]]) -> None:
            for _, per_replica in steps:  # on the host, after their execution, on XLA
                outputs.append(map_structure(lambda t: strategy.gather(t, axis=0), per_replica))

        step = -1
        with self._inference_mode(), StepExecutions(strategy, every, epoch=False) as executions:
            for step, batch in enumerate(itertools.islice(data.dataset, steps)):
                if batch_begin is not None and step % every == 0:
                    batch_begin(step)
                rows.append(_known_size(data, step))
                executions.run(0, self._run_step, self.predict_step, batch, None)  # no loss
                if not executions.full:
                    continue  # the execution's next step
                group_end = batch_end is not None and (step + 1) % every == 0
                gather(executions.finish(wait=group_end))
                if batch_end is not None and group_end:
                    batch_end(step, {})
            gather(executions.finish())  # the steps not read yet
        if batch_end is not None and step >= 0 and (step + 1) % every:  # a short last group
            batch_end(step, {})
        hooks.on_predict_end()
        if not outputs:
            raise InvalidArgumentError("predict got no data")
        return _concatenate(outputs, rows)

    def _read_trained_variables(self) -> None:
        """Under `ParameterServerStrategy`: the chief's copies of the variables read
        from the ps tasks (they hold the trained values)."""
        ps_loop = _ps_fit.loop_for(self)
        if ps_loop is not None:
            ps_loop.before_inference()

    @contextlib.contextmanager
    def _inference_mode(self) -> Iterator[None]:
        """Every submodule in eval mode (Keras's ``training=False``: BatchNorm's running
        statistics, no dropout), each one's own mode restored after, errors included."""
        modes = [(module, module.training) for module in self.modules()]
        self.eval()
        try:
            yield
        finally:
            for module, training in modes:
                module.training = training

    def __getstate__(self) -> dict[str, Any]:
        """The model without the state of a `fit` in progress (its iterator, history
        and step sizes): what a closure sent to a parameter-server worker carries."""
        state = dict(self.__dict__)
        state.update(
            _train_iterator=None,
            _train_data=None,
            history=None,
            _step_sizes={},
            stop_training=False,
        )
        return state

    # -- for callbacks ----------------------------------------------------------------------

    @property
    def _is_chief(self) -> bool:
        resolver = getattr(self._ds_strategy, "cluster_resolver", None)
        return resolver is None or resolver.rank == 0

    def _barrier(self, name: str) -> None:
        cross = self._ds_strategy.extended.cross_worker
        if cross is not None:
            cross.barrier(name)

    def _logical_state(self) -> dict[str, Any]:
        state = capture_state("model", self)
        return {k: v.clone() for k, v in state.items()}

    def _load_logical_state(self, state: dict[str, Any]) -> None:
        apply_state("model", self, state)


def _strategy_of(module: torch.nn.Module) -> Any:
    """The strategy whose scope built ``module``: its variables', or the one that
    sharded its parameters (`FullyShardedStrategy`)."""
    for value in module.state_dict(keep_vars=True).values():
        strategy = strategy_of(value)
        if strategy is not None:
            return strategy
    return None


def _wants_batch_logs(hooks: CallbackList) -> bool:
    """Whether a callback reads per-batch logs (a bar, or a user's hook): the same
    answer on every worker, since the step's collective carries the metrics then."""
    for callback in hooks.callbacks:
        if isinstance(callback, ProgressBar):
            if callback.requested == 1:
                return True
        elif type(callback).on_train_batch_end is not Callback.on_train_batch_end:
            return True
        elif "on_train_batch_end" in getattr(callback, "__dict__", {}):  # set on the object
            return True
    return False


def _stacked(losses: list[Any]) -> Any:
    """The scalar tensors ``losses`` as one tensor, or their `PerReplica`s as one
    `PerReplica` of each replica's stacked losses; None for anything else."""
    # Sets, not all(...) over generators: a check of a few calls, not one per loss.
    kinds = {type(loss) for loss in losses}
    if kinds == {torch.Tensor}:
        parts = [losses]
    elif kinds == {PerReplica}:
        parts = [list(values) for values in zip(*[loss.values for loss in losses])]
    else:
        return None
    flat = [t for part in parts for t in part]
    if {type(t) for t in flat} != {torch.Tensor} or {t.dim() for t in flat} != {0}:
        return None
    stacks = [torch.stack(part) for part in parts]
    return stacks[0] if kinds == {torch.Tensor} else PerReplica(tuple(stacks))


def _own_step(model: Model, name: str) -> bool:
    """Whether ``model``'s step ``name`` is `Model`'s own, which returns detached
    losses (a user's may return a loss whose graph a deferred read would keep)."""
    return bool(getattr(type(model), name) is getattr(Model, name))


def _batch_hook(hooks: CallbackList, name: str) -> Callable[..., None] | None:
    """``hooks``' hook ``name`` (a batch hook), or None where no callback does anything
    in it: `Callback`'s own hooks do nothing, nor does a progress bar that draws no bar
    (``verbose`` other than 1); `fit` then skips it at every step."""
    base = getattr(Callback, name)
    hook: Callable[..., None] = getattr(hooks, name)
    for callback in hooks.callbacks:
        if isinstance(callback, ProgressBar):
            if callback.verbose == 1:
                return hook
        elif getattr(type(callback), name) is not base or name in getattr(callback, "__dict__", {}):
            return hook
    return None


def _known_size(data: Data, step: int) -> int | None:
    """Step ``step``'s global batch size where the loader says it, else None."""
    if data.sizes is None or (data.steps is not None and step >= data.steps):
        return None
    return data.sizes(step)


def _concatenate(outputs: list[Any], rows: list[int | None]) -> Any:
    """The steps' outputs concatenated on the host, each cut to its step's ``rows``
    (a batch padded to the full size, under `TPUStrategy`, has fewer examples)."""
    first = outputs[0]
    if isinstance(first, dict):
        return {k: _concatenate([o[k] for o in outputs], rows) for k in first}
    if isinstance(first, (list, tuple)):
        return [_concatenate([o[i] for o in outputs], rows) for i in range(len(first))]
    return np.concatenate([o.detach().cpu().numpy()[:n] for o, n in zip(outputs, rows)])
