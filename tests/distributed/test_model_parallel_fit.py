"""`ds.Model` compile / fit / evaluate / predict under ModelParallelStrategy, in real
worker processes joined by gloo on 127.0.0.1.

What these pin: on (1, 2) and (2, 2) meshes (an MLP split column- then row-parallel
along "model"), fit's history (SGD-momentum, 3 epochs, shuffled, an uneven last batch,
validation data, "mae", every batch's logs), the trained weights (gathered whole),
evaluate (of arrays, and of an iterable of batches whose sizes are summed at each step)
and predict equal one process under the default strategy within 1e-5. The (1, 2) mesh is one
replica of 2 workers: a sum that counted workers instead of replicas would double
every total (the global batch size, the loss, the metrics).

One launch per world size (2 and 4 workers), shared by the tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import distribute as ds
from distribute import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

FEATURES, HIDDEN, OUTPUTS = 6, 8, 2
BATCH = 8
EPOCHS = 3
TRAIN, VALIDATION, PREDICT = 21, 11, 13  # none a multiple of the batch size
INIT_SEED, FIT_SEED = 0, 1

#: The strategy each worker made, kept until the worker ends (it owns the process group).
_KEEP: list[Any] = []


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((n, FEATURES)).astype(np.float32),
        rng.standard_normal((n, OUTPUTS)).astype(np.float32),
    )


def _model() -> ds.Model:
    """Linear-ReLU-Linear, seeded, compiled; built in the current strategy's scope."""
    torch.manual_seed(INIT_SEED)
    network = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUTPUTS)
    )
    return network


def _compile(model: ds.Model) -> ds.Model:
    model.compile(
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        loss="mse",
        metrics=["mae"],
    )
    return model


def _whole(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    value = value.full_tensor() if isinstance(value, DTensor) else value
    return value.detach().clone().cpu()


class _BatchLogs(ds.callbacks.Callback):
    """Every training batch's logs (the step's collective then carries the metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: list[dict[str, float]] = []

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.logs.append(dict(logs or {}))


class _Batches:
    """An iterable of global batches (not arrays: its length is not known up front)."""

    def __init__(self, batches: list[Any]) -> None:
        self._batches = batches

    def __iter__(self) -> Any:
        return iter(self._batches)


def _run(model: ds.Model) -> dict[str, Any]:
    """fit, then evaluate and predict; what every worker (and the reference) returns."""
    x, y = _data(TRAIN, 7)
    validation = _data(VALIDATION, 8)
    torch.manual_seed(FIT_SEED)  # the shuffling generator is seeded from torch's
    batches = _BatchLogs()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        validation_data=validation,
        verbose=0,
        callbacks=[batches],
    )
    evaluated = model.evaluate(*validation, batch_size=BATCH, verbose=0, return_dict=True)
    # An iterable of batches: the global batch sizes are not known up front (summed
    # over the workers at each step, each replica once).
    vx, vy = (torch.from_numpy(a) for a in validation)
    iterable = _Batches(
        [(vx[i : i + BATCH], vy[i : i + BATCH]) for i in range(0, VALIDATION, BATCH)]
    )
    evaluated_batches = model.evaluate(iterable, verbose=0, return_dict=True)
    px, _ = _data(PREDICT, 9)
    predictions = model.predict(px, batch_size=BATCH, verbose=0)
    return {
        "history": history.history,
        "batch_logs": batches.logs,
        "weights": {k: _whole(v) for k, v in model.state_dict().items()},
        "evaluate": evaluated,
        "evaluate_batches": evaluated_batches,
        "predict": predictions,
    }


def _layout_map(shape: tuple[int, int]) -> ds.experimental.LayoutMap:
    layouts = ds.experimental.LayoutMap(ds.experimental.DeviceMesh(shape, ("batch", "model")))
    layouts[r"0\.weight"] = ("model", None)
    layouts[r"0\.bias"] = ("model",)
    layouts[r"2\.weight"] = (None, "model")
    return layouts


def _worker(shape: tuple[int, int]) -> dict[str, Any]:
    strategy = ds.experimental.ModelParallelStrategy(_layout_map(shape))
    _KEEP.append(strategy)
    with strategy.scope():
        network = _model()
    model = _compile(ds.Model(network))  # wrapped outside the scope: found by its variables
    out = _run(model)
    out["strategy_found"] = model.distribute_strategy is strategy
    out["split"] = type(network[0].weight).__name__
    out["replicas"] = strategy.num_replicas_in_sync
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """One process, the default strategy."""
    return _run(_compile(ds.Model(_model())))


@pytest.fixture(scope="module")
def two_workers() -> list[dict[str, Any]]:
    return launch.run(_worker, 2, args=((1, 2),), timeout=150)


@pytest.fixture(scope="module")
def four_workers() -> list[dict[str, Any]]:
    return launch.run(_worker, 4, args=((2, 2),), timeout=150)


def _assert_same(result: dict[str, Any], reference: dict[str, Any]) -> None:
    assert result["history"].keys() == reference["history"].keys()
    for key, values in reference["history"].items():
        np.testing.assert_allclose(result["history"][key], values, rtol=0, atol=1e-5, err_msg=key)
    for name, value in reference["weights"].items():
        torch.testing.assert_close(result["weights"][name], value, rtol=0, atol=1e-5, msg=name)
    assert len(result["batch_logs"]) == len(reference["batch_logs"]) == EPOCHS * 3
    for got, want in zip(result["batch_logs"], reference["batch_logs"]):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=1e-5), key
    assert result["evaluate"].keys() == reference["evaluate"].keys()
    for key, value in reference["evaluate"].items():
        assert result["evaluate"][key] == pytest.approx(value, abs=1e-5), key
    for key, value in reference["evaluate_batches"].items():
        assert result["evaluate_batches"][key] == pytest.approx(value, abs=1e-5), key
    assert result["predict"].shape == (PREDICT, OUTPUTS)
    np.testing.assert_allclose(result["predict"], reference["predict"], rtol=0, atol=1e-5)


def test_one_replica_of_two_workers_fits_evaluates_and_predicts_as_one_process(
    two_workers: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    # Sums over workers instead of replicas would double the loss and the "mae" here.
    for worker in two_workers:
        assert worker["strategy_found"] and worker["split"] == "DTensor"
        assert worker["replicas"] == 1
        _assert_same(worker, reference)


def test_two_replicas_of_two_workers_fit_evaluate_and_predict_as_one_process(
    four_workers: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    for worker in four_workers:
        assert worker["strategy_found"] and worker["split"] == "DTensor"
        assert worker["replicas"] == 2
        _assert_same(worker, reference)
