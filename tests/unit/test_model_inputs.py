"""ds.Model.fit on input that cannot be shuffled: `shuffle` is ignored, as Keras
ignores it for a dataset or a generator (#36). Under parameter servers, input
without a length needs steps_per_epoch: tests/distributed/test_parameter_server_fit.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import distribute as ds

STRATEGIES: dict[str, Callable[[], ds.Strategy]] = {
    "default": ds.get_strategy,
    "one_device": lambda: ds.OneDeviceStrategy("cpu"),
    "mirrored": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
}

ROWS = 40


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 3, generator=generator)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5]])


class _Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """The rows in order, one example at a time: nothing to shuffle."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = _rows()
        return iter(zip(x, y))


def _batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _rows()
    for start in range(0, ROWS, 8):
        yield x[start : start + 8], y[start : start + 8]


def _model(strategy: ds.Strategy) -> ds.Model:
    torch.manual_seed(0)
    with strategy.scope():
        model = ds.Model(torch.nn.Linear(3, 1))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _in_order_losses() -> list[float]:
    """The reference: the same batches, in order, given as arrays with shuffle off."""
    x, y = _rows()
    model = _model(ds.get_strategy())
    history = model.fit(x.numpy(), y.numpy(), batch_size=8, epochs=2, shuffle=False, verbose=0)
    return history.history["loss"]


INPUTS: dict[str, Callable[[], Any]] = {
    "iterable_dataset": _Stream,
    "data_loader_over_an_iterable_dataset": lambda: DataLoader(_Stream(), batch_size=8),
    "generator": _batches,
}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("source", sorted(INPUTS))
def test_fit_with_default_arguments_ignores_shuffle_for_input_that_cannot_be_shuffled(
    strategy: str, source: str
) -> None:
    model = _model(STRATEGIES[strategy]())
    data = INPUTS[source]()
    epochs = 1 if source == "generator" else 2  # a generator is one pass
    kwargs: dict[str, Any] = {"batch_size": 8} if source == "iterable_dataset" else {}
    history = model.fit(data, epochs=epochs, verbose=0, **kwargs)  # shuffle=True by default
    np.testing.assert_allclose(history.history["loss"], _in_order_losses()[:epochs], rtol=1e-5)
