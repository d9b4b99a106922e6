"""The engine contract (tests/unit/test_conformance.py) through TPUStrategy in replica mode,
on torch_xla's 4 CPU devices: the same checks, on genuinely distinct devices."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

xla = pytest.importorskip("torch_xla")

import distribute as ds  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_conformance import (  # noqa: E402
    test_a_checkpoint_round_trip_restores_weights_and_optimizer_state,
    test_a_training_step_gives_one_devices_weights,
    test_gather_concatenates_every_replica_in_order,
    test_local_results_of_a_plain_value_and_a_run,
    test_merge_call_runs_once_in_cross_replica_context,
    test_reduce_sum_and_mean_and_along_an_axis,
    test_run_gives_every_replica_its_id_and_refuses_run_inside_run,
    test_run_inside_a_merge_fn_is_refused,
    test_scope_makes_the_strategy_current_in_cross_replica_context,
    test_update_applies_to_the_strategys_variables_and_refuses_others,
)

pytestmark: list[pytest.MarkDecorator] = []

__all__ = [
    "test_a_checkpoint_round_trip_restores_weights_and_optimizer_state",
    "test_a_training_step_gives_one_devices_weights",
    "test_gather_concatenates_every_replica_in_order",
    "test_local_results_of_a_plain_value_and_a_run",
    "test_merge_call_runs_once_in_cross_replica_context",
    "test_reduce_sum_and_mean_and_along_an_axis",
    "test_run_gives_every_replica_its_id_and_refuses_run_inside_run",
    "test_run_inside_a_merge_fn_is_refused",
    "test_scope_makes_the_strategy_current_in_cross_replica_context",
    "test_update_applies_to_the_strategys_variables_and_refuses_others",
]


@pytest.fixture(scope="module")
def strategy() -> ds.Strategy:
    return ds.TPUStrategy()
