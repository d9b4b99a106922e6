"""Running metrics whose state is a sync-on-read variable: exact over replicas and workers.

Each metric keeps its running sums (correct predictions and examples, a total and
a count, a confusion histogram) in ONE `SyncOnReadVariable` with SUM aggregation:
every replica adds its batch's sums to its own copy inside ``run``, with no
communication, and a read sums the copies of every replica of every worker. The
result is the one a single device computes over the same examples, also with an
uneven last batch (replicas without data add nothing).

Example:
    >>> import torch, distribute as ds
    >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     accuracy = ds.metrics.SparseCategoricalAccuracy()
    >>> logits = ds.PerReplica([torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]])])
    >>> labels = ds.PerReplica([torch.tensor([1]), torch.tensor([1])])
    >>> _ = strategy.run(accuracy.update_state, args=(labels, logits))
    >>> accuracy.result()
    0.5
"""

from __future__ import annotations

import copy
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from distribute import context
from distribute._enums import VariableAggregation, VariableSynchronization
from distribute.errors import InvalidArgumentError
from distribute.variables import DistributedVariable

__all__ = [
    "AUC",
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "Mean",
    "MeanAbsoluteError",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "Metric",
    "SparseCategoricalAccuracy",
    "TorchMetric",
    "get",
]


class Metric:
    """A running metric: `update_state` inside ``run``, `result` outside it.

    Subclasses say how many sums they keep (`size`), what one batch adds to them
    (`batch_sums`), and how the totals become the result (`result_from`).

    Args:
        name: the name logs use.

    Example:
        >>> import distribute as ds, torch
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     mean = ds.metrics.Mean("mean")
        >>> batch = ds.PerReplica((torch.tensor([1.0, 2.0]), torch.tensor([6.0])))
        >>> _ = strategy.run(mean.update_state, args=(batch,))
        >>> mean.result()   # over every replica: (1 + 2 + 6) / 3
        3.0
    """

    size = 2

    def __init__(self, name: str) -> None:
        from distribute import variables

        self.name = name
        self.state: torch.Tensor = variables.Variable(
            torch.zeros(self.size, dtype=torch.float64),
            trainable=False,
            synchronization=VariableSynchronization.ON_READ,
            aggregation=VariableAggregation.SUM,
        )

    def keep_local(self) -> None:
        """Keeps the sums in this process, outside any strategy, starting from zero
        (`ParameterServerStrategy`'s `fit`: each closure returns the sums of its
        batch, and the chief adds them up)."""
        self.state = torch.zeros(self.size, dtype=torch.float64)

    def batch_sums(
        self, y_true: torch.Tensor, y_pred: torch.Tensor, sample_weight: torch.Tensor | None
    ) -> torch.Tensor:
        """What one batch adds to the running sums (a float64 vector of `size`)."""
        raise NotImplementedError

    def result_from(self, totals: torch.Tensor) -> float:
        """The metric's value from the summed state."""
        return float(totals[0] / totals[1]) if float(totals[1]) else 0.0

    def update_state(
        self, y_true: Any, y_pred: Any, sample_weight: torch.Tensor | None = None
    ) -> None:
        """Adds a batch (in the running replica's own copy of the state)."""
        with torch.no_grad():
            sums = self.batch_sums(torch.as_tensor(y_true), torch.as_tensor(y_pred), sample_weight)
            self._add(sums)

    def _add(self, sums: torch.Tensor) -> None:
        """Adds `sums` to the running replica's own copy of the state."""
        state = self.state
        if isinstance(state, DistributedVariable):
            state.assign_add(sums.to(torch.float64))
        else:  # kept local (`keep_local`)
            state.add_(sums.to(state.device, torch.float64))

    def local_totals(self) -> torch.Tensor:
        """This worker's sums (its replicas' copies added), without communication."""
        values = getattr(self.state, "values", None)
        copies = list(values) if isinstance(values, tuple) else [self.state]
        total = copies[0].detach().cpu().clone()
        for other in copies[1:]:
            total += other.detach().cpu()
        return total

    def result(self) -> float:
        """The value over every replica of every worker (a cross-replica read)."""
        read = getattr(self.state, "read_value", None)
        return self.result_from((read() if read is not None else self.state).detach().cpu())

    def local_result(self) -> float:
        """The value over this worker's replicas only (no communication)."""
        return self.result_from(self.local_totals())

    def reset_state(self) -> None:
        """Zeroes the sums of every replica."""
        values = getattr(self.state, "values", None)
        # Copied from the host, not `zero_()`: on XLA a copy is new device data, where
        # `zero_()` would be an operation recorded into the next step's graph (a
        # graph other than the steady one, compiled again in the second epoch).
        zeros = torch.zeros(self.size, dtype=torch.float64)
        with torch.no_grad():
            for component in values if isinstance(values, tuple) else (self.state,):
                component.copy_(zeros)


def _weights(sample_weight: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    if sample_weight is None:
        return torch.ones(n, dtype=torch.float64, device=device)
    weights = torch.as_tensor(sample_weight, device=device).double()
    return weights.flatten(1).mean(1) if weights.dim() > 1 else weights


class MeanMetricWrapper(Metric):
    """The weighted mean of ``fn(y_true, y_pred)``, one value per example.

    Example:
        >>> import distribute as ds, torch
        >>> worst = lambda y_true, y_pred: (y_true - y_pred).abs().flatten(1).amax(1)
        >>> metric = ds.metrics.MeanMetricWrapper(worst, "max_error")
        >>> y_true, y_pred = torch.zeros(2, 2), torch.eye(2) * 2
        >>> _ = ds.get_strategy().run(metric.update_state, args=(y_true, y_pred))
        >>> metric.result()
        2.0
    """

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str) -> None:
        super().__init__(name)
        self._fn = fn

    def batch_sums(
        self, y_true: torch.Tensor, y_pred: torch.Tensor, sample_weight: torch.Tensor | None
    ) -> torch.Tensor:
        values = self._fn(y_true, y_pred).double()
        values = values.flatten(1).mean(1) if values.dim() > 1 else values
        weights = _weights(sample_weight, len(values), values.device)
        # Left where the batch is: the state's copy is on the replica's device (a host
        # read here would end an XLA step in the middle of every training step).
        return torch.stack([(values * weights).sum(), weights.sum()])


class Mean(Metric):
    """The weighted mean of the values given (``update_state(values)``).

    Example:
        >>> import distribute as ds, torch
        >>> mean = ds.metrics.Mean("mean")
        >>> _ = ds.get_strategy().run(mean.update_state, args=(torch.tensor([1.0, 2.0, 6.0]),))
        >>> mean.result()
        3.0
    """

    def __init__(self, name: str = "mean") -> None:
        super().__init__(name)

    def update_state(  # type: ignore[override]  # Keras's signature: values, weights
        self, values: Any, sample_weight: torch.Tensor | None = None
    ) -> None:
        values = torch.as_tensor(values).detach().reshape(-1).double()
        weights = _weights(sample_weight, len(values), values.device)
        with torch.no_grad():
            self._add(torch.stack([(values * weights).sum(), weights.sum()]))


def _sparse_correct(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return (y_pred.argmax(-1) == y_true.reshape(y_pred.shape[:-1]).long()).double()


def _categorical_correct(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return (y_pred.argmax(-1) == y_true.argmax(-1)).double()


def _binary_correct(y_true: torch.Tensor, y_pred: torch.Tensor, threshold: float) -> torch.Tensor:
    return ((y_pred > threshold).to(y_true.dtype) == y_true).double()


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often the largest score's index equals the integer label.

    Example:
        >>> import distribute as ds, torch
        >>> metric = ds.metrics.SparseCategoricalAccuracy()
        >>> scores = torch.tensor([[0.9, 0.1], [0.8, 0.2]])
        >>> _ = ds.get_strategy().run(metric.update_state, args=(torch.tensor([0, 1]), scores))
        >>> metric.result()
        0.5
    """

    def __init__(self, name: str = "sparse_categorical_accuracy") -> None:
        super().__init__(_sparse_correct, name)


class CategoricalAccuracy(MeanMetricWrapper):
    """How often the largest score's index equals the one-hot label's.

    Example:
        >>> import distribute as ds, torch
        >>> metric = ds.metrics.CategoricalAccuracy()
        >>> labels, scores = torch.eye(2), torch.tensor([[0.9, 0.1], [0.8, 0.2]])
        >>> _ = ds.get_strategy().run(metric.update_state, args=(labels, scores))
        >>> metric.result()
        0.5
    """

    def __init__(self, name: str = "categorical_accuracy") -> None:
        super().__init__(_categorical_correct, name)


class BinaryAccuracy(MeanMetricWrapper):
    """How often ``y_pred > threshold`` equals the 0/1 label.

    Example:
        >>> import distribute as ds, torch
        >>> metric = ds.metrics.BinaryAccuracy()
        >>> labels, scores = torch.tensor([[1.0], [0.0]]), torch.tensor([[0.7], [0.6]])
        >>> _ = ds.get_strategy().run(metric.update_state, args=(labels, scores))
        >>> metric.result()
        0.5
    """

    def __init__(self, name: str = "binary_accuracy", threshold: float = 0.5) -> None:
        super().__init__(lambda t, p: _binary_correct(t, p, threshold), name)


class Accuracy(MeanMetricWrapper):
    """Keras's ``"accuracy"``: sparse categorical, categorical or binary accuracy,
    chosen from the shapes of each batch (integer labels with one dimension fewer
    than the scores: sparse; scores with one column or the labels' shape and 0/1
    labels: binary; else categorical).

    Example:
        >>> import distribute as ds, torch
        >>> metric = ds.metrics.Accuracy()
        >>> scores = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
        >>> _ = ds.get_strategy().run(metric.update_state, args=(torch.tensor([0, 1]), scores))
        >>> metric.result()   # integer labels: sparse categorical accuracy
        1.0
    """

    def __init__(self, name: str = "accuracy") -> None:
        super().__init__(_any_accuracy, name)


def _any_accuracy(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    if y_pred.dim() == y_true.dim() + 1 and y_pred.shape[-1] > 1:
        return _sparse_correct(y_true, y_pred)
    if y_pred.shape == y_true.shape and y_pred.dim() >= 2 and y_pred.shape[-1] > 1:
        return _categorical_correct(y_true, y_pred)
    return _binary_correct(y_true.reshape(y_pred.shape), y_pred, 0.5)


class MeanSquaredError(MeanMetricWrapper):
    """The mean of ``(y_true - y_pred) ** 2``.

    Example:
        >>> import distribute as ds, torch
        >>> metric = ds.metrics.MeanSquaredError()
        >>> y_true, y_pred = torch.tensor([[1.0], [2.0]]), torch.tensor([[1.0], [4.0]])
        >>> _ = ds.get_strategy().run(metric.update_state, args=(y_true, y_pred))
        >>> metric.result()
        2.0
    """

    def __init__(self, name: str = "mean_squared_error") -> None:
        super().__init__(lambda t, p: (p.double() - t.reshape(p.shape).double()).square(), name)


class MeanAbsoluteError(MeanMetricWrapper):
    """The mean of ``|y_true - y_pred|``.

    Example:
        >>> import distribute as ds, torch
        >>> metric = ds.metrics.MeanAbsoluteError()
        >>> y_true, y_pred = torch.tensor([[1.0], [2.0]]), torch.tensor([[1.0], [4.0]])
        >>> _ = ds.get_strategy().run(metric.update_state, args=(y_true, y_pred))
        >>> metric.result()
        1.0
    """

    def __init__(self, name: str = "mean_absolute_error") -> None:
        super().__init__(lambda t, p: (p.double() - t.reshape(p.shape).double()).abs(), name)


class AUC(Metric):
    """Area under the ROC curve of binary scores, from a confusion histogram at
    ``num_thresholds`` thresholds (Keras's interpolation: the trapezoid rule).

    The histogram's counts are sums, so the area is exact over replicas and workers.

    Example:
        >>> import distribute as ds, torch
        >>> auc = ds.metrics.AUC()
        >>> labels, scores = torch.tensor([0.0, 0.0, 1.0, 1.0]), torch.tensor([0.1, 0.4, 0.35, 0.8])
        >>> _ = ds.get_strategy().run(auc.update_state, args=(labels, scores))
        >>> auc.result()
        0.75
    """

    def __init__(self, name: str = "auc", num_thresholds: int = 200) -> None:
        if num_thresholds < 2:
            raise InvalidArgumentError(f"num_thresholds must be >= 2, got {num_thresholds}")
        self.thresholds = torch.cat(
            [
                torch.tensor([-1e-7]),
                torch.linspace(0, 1, num_thresholds)[1:-1].double(),
                torch.tensor([1 + 1e-7]),
            ]
        ).double()
        self.size = 4 * num_thresholds
        super().__init__(name)

    def batch_sums(
        self, y_true: torch.Tensor, y_pred: torch.Tensor, sample_weight: torch.Tensor | None
    ) -> torch.Tensor:
        scores = y_pred.reshape(-1).double().cpu()
        labels = y_true.reshape(-1).double().cpu()
        weights = _weights(sample_weight, len(scores), scores.device)
        above = (scores[None, :] > self.thresholds[:, None]).double()
        tp = (above * labels * weights).sum(1)
        fp = (above * (1 - labels) * weights).sum(1)
        fn = ((1 - above) * labels * weights).sum(1)
        tn = ((1 - above) * (1 - labels) * weights).sum(1)
        return torch.cat([tp, fp, fn, tn])

    def result_from(self, totals: torch.Tensor) -> float:
        tp, fp, fn, tn = totals.reshape(4, -1)
        tpr = tp / (tp + fn).clamp_min(1e-12)
        fpr = fp / (fp + tn).clamp_min(1e-12)
        return float(((fpr[:-1] - fpr[1:]) * (tpr[:-1] + tpr[1:]) / 2).sum())


class TorchMetric(Metric):
    """A ``torchmetrics`` metric, kept as one copy per local replica.

    Each replica updates its own copy inside ``run`` (no thread shares one); the
    result merges the copies (``merge_state``) and computes, which torchmetrics
    synchronizes across worker processes through ``torch.distributed`` (every worker
    reads the result at the same point, as `fit` does).

    Example:
        >>> import distribute as ds, torch, torchmetrics
        >>> metric = ds.metrics.TorchMetric(torchmetrics.MeanSquaredError(), "mse")
        >>> y_true, y_pred = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0])
        >>> _ = ds.get_strategy().run(metric.update_state, args=(y_true, y_pred))
        >>> metric.result()
        2.0
    """

    def __init__(self, metric: Any, name: str | None = None) -> None:
        self.name = name or _snake_case(type(metric).__name__)
        self._template = copy.deepcopy(metric)
        self._copies: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _copy(self, local: int) -> Any:
        with self._lock:
            if local not in self._copies:
                self._copies[local] = copy.deepcopy(self._template)
            return self._copies[local]

    def update_state(
        self, y_true: Any, y_pred: Any, sample_weight: torch.Tensor | None = None
    ) -> None:
        ctx = context.get_replica_context()
        local = ctx.local_replica_id if ctx is not None else 0
        self._copy(local).update(torch.as_tensor(y_pred), torch.as_tensor(y_true))

    def _merged(self, sync: bool) -> Any:
        merged = copy.deepcopy(self._template)
        merged.reset()
        for replica in sorted(self._copies):
            merged.merge_state(self._copies[replica])
        merged.sync_on_compute = sync
        return merged

    def result(self) -> float:
        return self._compute(sync=True)

    def local_result(self) -> float:
        return self._compute(sync=False) if self._copies else 0.0

    def _compute(self, sync: bool) -> float:
        with warnings.catch_warnings():  # the merged copy holds updates it did not see
            warnings.filterwarnings("ignore", message=".*was called before the ``update``")
            return float(self._merged(sync).compute())

    def reset_state(self) -> None:
        with self._lock:
            self._copies.clear()

    def keep_local(self) -> None:
        raise InvalidArgumentError(
            f"metric {self.name!r} is a torchmetrics object, whose state cannot be summed "
            "over the closures of ParameterServerStrategy's fit; pass its name (e.g. "
            "'accuracy') or a ds.metrics object instead"
        )


def _snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _is_torchmetric(obj: Any) -> bool:
    try:
        import torchmetrics
    except ImportError:
        return False
    return isinstance(obj, torchmetrics.Metric)


_BY_NAME: dict[str, Callable[[], Metric]] = {
    "accuracy": Accuracy,
    "acc": Accuracy,
    "sparse_categorical_accuracy": SparseCategoricalAccuracy,
    "categorical_accuracy": CategoricalAccuracy,
    "binary_accuracy": BinaryAccuracy,
    "mse": lambda: MeanSquaredError("mse"),
    "mean_squared_error": MeanSquaredError,
    "mae": lambda: MeanAbsoluteError("mae"),
    "mean_absolute_error": MeanAbsoluteError,
    "auc": AUC,
}


def get(identifier: Any) -> Metric:
    """A metric from a name (``"accuracy"``, ``"mae"``, ...), a `Metric`, a
    ``torchmetrics`` metric (where that package is installed), or a function of
    ``(y_true, y_pred)`` giving one value per example.

    Build it inside the strategy's scope (``Model.compile`` does).

    Example:
        >>> import distribute as ds
        >>> metric = ds.metrics.get("mae")
        >>> type(metric).__name__, metric.name
        ('MeanAbsoluteError', 'mae')
    """
    if isinstance(identifier, Metric):
        return identifier
    if _is_torchmetric(identifier):
        return TorchMetric(identifier)
    if isinstance(identifier, str):
        factory = _BY_NAME.get(identifier.lower())
        if factory is None:
            raise InvalidArgumentError(
                f"unknown metric {identifier!r}; known: {sorted(_BY_NAME)}, or pass a Metric "
                "or a function of (y_true, y_pred)"
            )
        return factory()
    if callable(identifier):
        return MeanMetricWrapper(identifier, getattr(identifier, "__name__", "metric"))
    raise InvalidArgumentError(f"cannot make a metric of {identifier!r}")


def get_all(identifiers: Sequence[Any] | None) -> list[Metric]:
    """`get` of each of ``identifiers`` (None: no metrics)."""
    return [get(i) for i in identifiers or ()]
