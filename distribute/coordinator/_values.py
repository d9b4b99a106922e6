"""The values that cross between the chief and the workers: `RemoteValue` (a
closure's future result) and `PerWorkerValues` (one element per worker: per-worker
datasets and iterators, each a `Resource` resolved by key on the worker).

Example::

    iterators = iter(coordinator.create_per_worker_dataset(dataset_fn))
    value = coordinator.schedule(step, args=(iterators,))   # a RemoteValue
    value.fetch()
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

from distribute.errors import InvalidArgumentError
from distribute.ps import _runtime

__all__ = [
    "PerWorkerDataset",
    "PerWorkerIterators",
    "PerWorkerValues",
    "RemoteValue",
    "Resource",
    "WithInputContext",
    "takes_one_argument",
]


class RemoteValue:
    """The future result of a scheduled closure.

    Example::

        value = coordinator.schedule(lambda: 41 + 1)
        value.fetch()    # 42 (waits for the closure)
    """

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        if self._done.is_set():
            return
        self._value, self._error = value, error
        self._done.set()

    def fetch(self) -> Any:
        """Waits for the closure and returns its result (raises its error)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def get(self) -> Any:
        """Same as `fetch`."""
        return self.fetch()

    def __repr__(self) -> str:
        state = "done" if self._done.is_set() else "pending"
        return f"RemoteValue({state})"


class PerWorkerValues:
    """One value per worker (a per-worker dataset or iterator); a closure given one
    as an argument gets the element of the worker that runs it.

    Example::

        iterators = iter(coordinator.create_per_worker_dataset(dataset_fn))
        coordinator.schedule(step, args=(iterators,))
    """

    def __init__(self, values: Sequence[Any]) -> None:
        self._values = tuple(values)

    @property
    def values(self) -> tuple[Any, ...]:
        """The elements, in worker order."""
        return self._values

    def __repr__(self) -> str:
        return f"PerWorkerValues({len(self._values)} workers)"


class Resource:
    """A per-worker object (dataset, iterator), referred to by key; unpickled on a
    worker it is that worker's object."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __reduce__(self) -> Any:
        return (_resolve_resource, (self.key,))

    @staticmethod
    def key_of(values: PerWorkerValues) -> str:
        """The key of per-worker `values` made by a coordinator."""
        first = values.values[0]
        assert isinstance(first, Resource)
        return first.key


def _resolve_resource(key: str) -> Any:
    runtime = _runtime.current()
    try:
        return runtime.resources[key]
    except KeyError:
        raise InvalidArgumentError(
            f"{runtime.name} does not have this per-worker dataset or iterator: building "
            "it there failed when the worker rejoined (the chief logged why); make the "
            "dataset_fn succeed on every worker"
        ) from None


class PerWorkerDataset(PerWorkerValues):
    """`create_per_worker_dataset`'s result: `iter()` makes per-worker iterators.

    Args:
        values: one `Resource` per worker.
        make_iterators: builds ``iter()`` of each worker's dataset (the
            coordinator's, which knows the workers).
    """

    def __init__(
        self, values: Sequence[Any], make_iterators: Callable[[PerWorkerValues], PerWorkerValues]
    ) -> None:
        super().__init__(values)
        self._make_iterators = make_iterators

    def __iter__(self) -> PerWorkerIterators:
        iterators = self._make_iterators(self)
        assert isinstance(iterators, PerWorkerIterators)
        return iterators


class PerWorkerIterators(PerWorkerValues):
    """`iter()` of a per-worker dataset: one iterator per worker, to pass to
    `schedule` (a closure calls ``next()`` on its worker's)."""

    def __init__(self, values: Sequence[Any], dataset: PerWorkerValues) -> None:
        super().__init__(values)
        self._dataset = dataset  # kept while the iterators live: a rejoining worker rebuilds both

    def __iter__(self) -> PerWorkerIterators:
        return self

    def __next__(self) -> Any:
        raise InvalidArgumentError(
            "next() of per-worker iterators runs on the workers: pass the iterators to "
            "coordinator.schedule(fn, args=(iterators,)) and call next() inside fn"
        )


def takes_one_argument(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes exactly one positional argument (an `InputContext`)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    positional = [
        p
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return len(positional) == 1


class WithInputContext:
    """A per-worker `dataset_fn(input_context)`, called on a worker with its context."""

    def __init__(self, dataset_fn: Callable[[Any], Any], num_workers: int) -> None:
        self._dataset_fn = dataset_fn
        self._num_workers = num_workers

    def __call__(self) -> Any:
        from distribute.data.options import InputContext

        context = InputContext(
            num_input_pipelines=self._num_workers,
            input_pipeline_id=_runtime.worker_index(_runtime.current().name),
            num_replicas_in_sync=1,
        )
        return self._dataset_fn(context)
