"""`ds.Model`'s training loop under `ParameterServerStrategy` (Keras's parameter-server `fit`).

# NOTE [parameter-server fit]
The chief never runs a training step itself. Each step is a closure that the
strategy's `ClusterCoordinator` (the user's, or one made here) runs on an idle
worker: the worker reads the variables from the ps tasks (the coordinator refreshes
them), runs `Model.train_step` as on one device, and its optimizer step sends the
gradients to the ps tasks, which apply them before the closure returns. The closure
returns the step's loss, its global batch size and the sums its batch adds to each
metric; the chief adds these up in step order. So the epoch's loss and metrics are
those of the steps that ran in it, weighted by their batch sizes as under every
strategy, whichever worker ran each step. One worker runs its closures one after
the other, each seeing the update of the one before: one device's numbers. With
several, steps overlap (asynchronous training, as tf.distribute's).

Input: arrays, tensors, Datasets and DataLoaders are read on the chief (the same
batches in the same order as under every other strategy) and each batch travels
with its closure. A ``dataset_fn(input_context)`` (Keras's ``DatasetCreator``), or
per-worker data from ``coordinator.create_per_worker_dataset``, is built on every
worker instead, and each closure takes the next batch of its worker's iterator; the
data then has no end the chief could see, so ``steps_per_epoch`` is required; so it
is for input read on the chief that has no length (an `IterableDataset`, a
DataLoader over one, a generator), as TF's parameter-server `fit` requires: an
infinite one would otherwise train forever in its first epoch.

Errors: a step's error on a worker is raised by `fit` once (the coordinator's
error state is cleared with it: the next `fit`, `evaluate` or ``join`` starts
clean), with the worker's name and traceback in a note (NOTE [errors from workers]
in coordinator/).

Callbacks: a batch's ``on_train_batch_begin`` runs when its closure is scheduled,
``on_train_batch_end`` when its result arrives (in step order, with the running
loss and metrics up to that step); at most `_IN_FLIGHT_PER_WORKER` closures per
worker are outstanding, so a callback that stops training stops it within a few
steps. Epoch callbacks run once every closure of the epoch has finished and the
chief's copies of the variables have been refreshed: `ModelCheckpoint`,
`EarlyStopping` and `BackupAndRestore` see the weights the epoch ended with.
`BackupAndRestore` saves at epoch ends only (between two batches the ps tasks hold
updates of steps still running). `evaluate` and `predict` run on the chief with
the ps tasks' current values (read first).
"""

from __future__ import annotations

import collections
import functools
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from distribute._enums import StepRunner
from distribute.coordinator import ClusterCoordinator, PerWorkerValues, RemoteValue
from distribute.data.dataset import DistributedDataset, DistributedDatasetsFromFunction
from distribute.errors import InvalidArgumentError
from distribute.training._data import Data, adapt, local_batch_size
from distribute.training.callbacks import BackupAndRestore, CallbackList

if TYPE_CHECKING:
    from distribute.training.model import Model

__all__ = ["ParameterServerLoop", "loop_for"]

#: Closures per worker scheduled ahead of the results the chief has read.
_IN_FLIGHT_PER_WORKER = 2


def applies(strategy: Any) -> bool:
    """Whether `strategy` trains through a coordinator (the chief of a
    `ParameterServerStrategy`)."""
    return strategy.extended.step_runner is StepRunner.COORDINATED


class _PerWorkerData(Data):
    """Input built on every worker: closures take their batches from it there."""

    def __init__(self, per_worker: PerWorkerValues) -> None:
        super().__init__(per_worker, None, None)


class ParameterServerLoop:
    """Runs `model`'s epochs as closures on the workers (NOTE [parameter-server fit]).

    Args:
        model: a `ds.Model` built in a `ParameterServerStrategy`'s scope.
    """

    def __init__(self, model: Model) -> None:
        strategy = model.distribute_strategy
        self._model = model
        self._strategy = strategy
        self.coordinator = ClusterCoordinator.of(strategy)
        self._num_workers = len(strategy.cluster_resolver.cluster_spec().as_dict()["worker"])
        for metric in model._metrics:
            metric.keep_local()  # summed here from what the closures return

    def check_callbacks(self, callbacks: CallbackList) -> None:
        """Refuses what cannot work with steps running on several workers at once."""
        for callback in callbacks.callbacks:
            if isinstance(callback, BackupAndRestore) and callback.save_freq != "epoch":
                raise InvalidArgumentError(
                    f"BackupAndRestore(save_freq={callback.save_freq!r}) under "
                    "ParameterServerStrategy: between two batches the ps tasks hold updates "
                    "of steps still running on other workers, so a backup is only exact at "
                    "an epoch's end; use save_freq='epoch'"
                )

    def adapt(
        self,
        x: Any,
        y: Any,
        sample_weight: Any,
        batch_size: int | None,
        shuffle: bool,
        steps_per_epoch: int | None,
    ) -> Data:
        """`fit`'s input: read on the chief, or built on every worker (a
        ``dataset_fn(input_context)`` or per-worker values)."""
        if isinstance(x, PerWorkerValues) or _is_dataset_fn(x):
            if y is not None or sample_weight is not None:
                raise InvalidArgumentError(
                    "with a dataset_fn (or per-worker data) the batches carry the targets: "
                    "do not pass y or sample_weight"
                )
            if steps_per_epoch is None:
                raise InvalidArgumentError(
                    "fit under ParameterServerStrategy with a dataset_fn (or per-worker "
                    "data) needs steps_per_epoch: the data is read on the workers, so the "
                    "chief cannot see where an epoch ends (make the dataset repeat, and "
                    "pass steps_per_epoch=<steps per epoch>)"
                )
            per_worker = (
                x
                if isinstance(x, PerWorkerValues)
                else self.coordinator.create_per_worker_dataset(x)
            )
            return _PerWorkerData(per_worker)
        if steps_per_epoch is None and not _has_length(x):
            raise InvalidArgumentError(
                f"fit under ParameterServerStrategy got a {type(x).__name__} without a length "
                "and no steps_per_epoch: the chief cannot tell where an epoch ends, and an "
                "infinite input would train forever in its first epoch; pass "
                "steps_per_epoch=<steps per epoch>"
            )
        return adapt(self._strategy, x, y, sample_weight, batch_size, shuffle)

    def train_epoch(
        self, train: Data, hooks: CallbackList, steps_per_epoch: int | None, iterator: Any
    ) -> tuple[float, int, Any]:
        """Schedules the epoch's steps, taking batches from `iterator` (fit's
        iterator over `train`), and adds up their results.

        Returns:
            The summed ``loss * batch size`` and the examples, as
                `Model._train_epoch` does, and the iterator the epoch ended with (a
                new pass over `train` where ``steps_per_epoch`` ran past its end).

        Raises:
            Exception: a step's error (raised once: NOTE [parameter-server fit]).
        """
        model = self._model
        metrics = model._metrics
        sums = [torch.zeros(m.size, dtype=torch.float64) for m in metrics]
        every = model._steps_per_execution
        per_worker = isinstance(train, _PerWorkerData)
        step_fn = functools.partial(_train_closure, model)
        pending: collections.deque[tuple[int, int, Any]] = collections.deque()
        window = _IN_FLIGHT_PER_WORKER * self._num_workers
        totals = [0.0, 0]
        last: list[Any] = [None]  # the newest batch logs not yet given to the hooks

        def finish_oldest() -> None:
            index, taken, result = pending.popleft()
            loss, size, batch_sums = self._fetch(result)
            totals[0] += loss * size
            totals[1] += size
            for total, part in zip(sums, batch_sums):
                total += part
            logs = {
                "loss": totals[0] / totals[1] if totals[1] else 0.0,
                **{m.name: m.result_from(total) for m, total in zip(metrics, sums)},
            }
            last[0] = (index, logs)
            if (taken + 1) % every == 0:
                hooks.on_train_batch_end(index, logs)
                last[0] = None

        taken = 0
        fresh = False  # the iterator was just made: an empty pass means empty data
        while (steps_per_epoch is None or taken < steps_per_epoch) and not model.stop_training:
            if per_worker:
                source, size, index = iterator, None, taken
            else:
                try:
                    source = next(iterator)
                except StopIteration:
                    if steps_per_epoch is None:
                        break
                    if fresh:
                        raise InvalidArgumentError(
                            "fit got no data: the dataset is empty"
                        ) from None
                    # Keras's steps_per_epoch over a finite dataset: on into the next pass.
                    iterator = iter(train.dataset)
                    fresh = True
                    continue
                fresh = False
                step = iterator.steps - 1
                index = taken if steps_per_epoch is not None else step
                known = train.sizes is not None and (train.steps is None or step < train.steps)
                size = (
                    train.sizes(step)
                    if known and train.sizes is not None
                    else local_batch_size(self._strategy, source)
                )
            if taken % every == 0:
                hooks.on_train_batch_begin(index)
            pending.append(
                (index, taken, self.coordinator.schedule(step_fn, args=(source, size, per_worker)))
            )
            taken += 1
            while len(pending) >= window:
                finish_oldest()
        while pending:
            finish_oldest()
        if last[0] is not None:  # the last steps of a steps_per_execution group
            hooks.on_train_batch_end(*last[0])
        self.coordinator.join()  # every update applied; the chief's copies read back
        for metric, total in zip(metrics, sums):
            with torch.no_grad():
                metric.state.copy_(total)
        if taken == 0 and not model.stop_training:
            raise InvalidArgumentError("fit got no data: the dataset is empty")
        return totals[0], int(totals[1]), iterator

    def _fetch(self, result: RemoteValue) -> Any:
        """A step's result; its error is raised as the coordinator's (the first of
        the failed steps), which clears it, so that the next call starts clean."""
        try:
            return result.fetch()
        except BaseException:
            self.coordinator.join()  # raises the first error, once
            raise

    def before_inference(self) -> None:
        """Reads the variables' current values from the ps tasks into the chief's
        copies (after waiting for any scheduled closure)."""
        self.coordinator.join()


def _has_length(x: Any) -> bool:
    """Whether fit's input `x` (read on the chief) has a length: arrays, a map-style
    dataset, a DataLoader over one; a distributed dataset is taken as having one."""
    if isinstance(x, (DistributedDataset, DistributedDatasetsFromFunction)):
        return True
    try:
        len(x)
    except TypeError:
        return False
    return True


def _is_dataset_fn(x: Any) -> bool:
    return callable(x) and not isinstance(x, (Dataset, DataLoader, torch.Tensor))


def _train_closure(
    model: Model, source: Any, size: int | None, per_worker: bool
) -> tuple[float, int, list[torch.Tensor]]:
    """One training step on a worker: the loss, the global batch size and the
    batch's metric sums (NOTE [parameter-server fit])."""
    if per_worker:
        try:
            batch = next(source)
        except StopIteration:
            raise InvalidArgumentError(
                "a worker's dataset ran out of batches before steps_per_epoch steps: make "
                "dataset_fn's data repeat (e.g. itertools.cycle over a DataLoader) or lower "
                "steps_per_epoch"
            ) from None
    else:
        batch = source
    for metric in model._metrics:
        metric.keep_local()  # this batch's sums alone
    logs = model._run_step(model.train_step, batch, size)
    loss = logs["loss"] if isinstance(logs, dict) else logs
    if size is None:
        size = local_batch_size(model.distribute_strategy, batch)
    return float(loss), int(size), [m.local_totals() for m in model._metrics]


def loop_for(model: Model) -> ParameterServerLoop | None:
    """The parameter-server loop of `model`, or None under any other strategy."""
    return ParameterServerLoop(model) if applies(model.distribute_strategy) else None
