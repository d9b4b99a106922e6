"""The engine contract (tests/unit/test_conformance.py) through ParameterServerStrategy
with one worker and one ps: real rpc, the chief in its own process
(tests/distributed/_ps_conformance_chief.py; rpc is one per process).

What applies to parameter servers, as TF's strategy has it: variables built in the scope
are the strategy's (on the ps), `update` and `colocate_vars_with` act on them and refuse
another's, `run` inside a scheduled closure is one replica of one and refuses `run`
inside `run`, three scheduled steps give one device's weights, and a checkpoint round
trip restores every value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

CHIEF = Path(__file__).with_name("_ps_conformance_chief.py")
MARKER = "PS_CONFORMANCE "


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(CHIEF)],
        cwd=CHIEF.parents[2],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=170,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    assert proc.returncode == 0 and lines, f"the chief failed:\n{proc.stderr[-4000:]}"
    out: dict[str, Any] = json.loads(lines[-1][len(MARKER) :])
    return out


def _check(report: dict[str, Any], name: str) -> dict[str, Any]:
    check: dict[str, Any] = report[name]
    if "error" in check:
        pytest.fail(f"{name} raised in the chief: {check['error']}\n{check['traceback']}")
    return check


def test_variables_built_in_the_scope_are_the_strategys(report: dict[str, Any]) -> None:
    check = _check(report, "scope")
    assert check["current"]
    assert check["own"] == [True] * 4
    assert check["plain"] is False


def test_update_and_colocate_act_on_its_variables_and_refuse_others(
    report: dict[str, Any],
) -> None:
    check = _check(report, "update")
    torch.testing.assert_close(torch.tensor(check["updated"]), torch.ones(2))
    assert check["colocated"]
    assert "update" in check["update_refused"], check
    assert "colocate_vars_with" in check["colocate_refused"], check


def test_run_in_a_closure_is_one_replica_and_refuses_run_inside_run(
    report: dict[str, Any],
) -> None:
    check = _check(report, "run")
    assert check["replica"] == [0, 1]
    assert "inside `run`" in check["nested"], check


def test_three_scheduled_steps_give_one_devices_weights(report: dict[str, Any]) -> None:
    check = _check(report, "training")
    for got, want in zip(check["got"], check["want"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_a_checkpoint_round_trip_restores_every_value(report: dict[str, Any]) -> None:
    check = _check(report, "checkpoint")
    assert check["restored"] == check["saved"]
