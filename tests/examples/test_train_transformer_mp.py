"""examples/train_transformer_mp.py: two workers on a (1, 2) mesh, started by the
library's launcher (torchrun's variables, then one TF_CONFIG each), learn with one
worker's numbers while each holds about half of the weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from distribute import launch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_transformer_mp.py"
ARGS = ["--epochs", "2", "--examples", "128"]


def _main_in_worker(argv: list[str]) -> dict[str, Any]:
    """The example's main in a worker process of `launch.run`."""
    spec = importlib.util.spec_from_file_location("train_transformer_mp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result: dict[str, Any] = module.main(argv)
    return result


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_workers_learn_with_one_worker_s_numbers_holding_half_the_weights() -> None:
    (one,) = launch.run(_main_in_worker, 1, args=(ARGS,), timeout=200)
    two = launch.run(_main_in_worker, 2, args=(ARGS,), timeout=200)
    tf_config = launch.run(_main_in_worker, 2, args=(ARGS,), launcher="tf_config", timeout=200)
    assert one["losses"][-1] < one["losses"][0] - 0.5, one  # it learns
    for worker in [*two, *tf_config]:
        assert worker["mesh"] == [1, 2] and worker["replicas_in_sync"] == 1
        assert worker["losses"] == pytest.approx(one["losses"], rel=0, abs=1e-5)
        assert 0.5 < worker["weights_held"] < 0.6, worker  # the projections split in two
