"""`ds.Model.fit` / `evaluate` / `predict` under ParameterServerStrategy on real
processes (a chief, ps and worker tasks over rpc): Keras's parameter-server fit.

Each cluster is one run of ``tests/distributed/_ps_fit_chief.py <case>`` (rpc is one
per process); the tests assert on its report and on its stderr, where every task of
the cluster writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _ps_chief import MARKER

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
CHIEF = Path(__file__).with_name("_ps_fit_chief.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
#: What TensorPipe prints when a task's connection closes under a live agent.
TENSORPIPE_NOISE = ("tensorpipe", "RPC agent for", "broken pipe", "pipe closed")


def _run(case: str) -> tuple[dict[str, Any], str]:
    proc = subprocess.run(
        [sys.executable, str(CHIEF), case],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=220,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    assert proc.returncode == 0 and lines, (
        f"chief {case!r} exited {proc.returncode} without a report:\n{proc.stderr[-4000:]}"
    )
    report: dict[str, Any] = json.loads(lines[-1][len(MARKER) :])
    assert "error" not in report, f"chief {case!r} failed: {report['error']}\n{report['traceback']}"
    return report, proc.stderr


def _check(report: dict[str, Any], name: str) -> dict[str, Any]:
    check: dict[str, Any] = report[name]
    if "error" in check:
        pytest.fail(f"check {name!r} raised in the chief: {check['error']}\n{check['traceback']}")
    return check


@pytest.fixture(scope="module")
def one_worker() -> tuple[dict[str, Any], str]:
    """1 worker, 1 ps: parity with one device, lr 0, checkpoints, refusals."""
    return _run("one_worker")


@pytest.fixture(scope="module")
def two_workers() -> tuple[dict[str, Any], str]:
    """2 workers, 1 ps: learning, inference, per-worker data, a killed worker."""
    return _run("two_workers")


@pytest.fixture(scope="module")
def worker_errors() -> dict[str, Any]:
    """2 workers, 1 ps: the user's errors raised on worker_1 (#36)."""
    return _check(_run("worker_errors")[0], "errors")


def _close(a: Any, b: Any, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(
        np.asarray(a, dtype=float), np.asarray(b, dtype=float), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
def test_with_one_worker_fit_evaluate_predict_give_one_devices_numbers(
    one_worker: tuple[dict[str, Any], str], optimizer: str
) -> None:
    check = _check(one_worker[0], optimizer)
    one, ps = check["one_device"], check["ps"]
    assert set(ps["history"]) == {"loss", "mae", "val_loss", "val_mae"}
    for key, values in one["history"].items():
        _close(ps["history"][key], values)
    _close(ps["weights"][0], one["weights"][0])
    for got, want in zip(ps["weights"], one["weights"]):
        _close(got, want)
    _close(ps["evaluate"], one["evaluate"])
    _close(ps["predict"], one["predict"])
    assert one["history"]["loss"][0] > one["history"]["loss"][-1]  # it trained


def test_with_learning_rate_zero_every_epoch_logs_the_initial_loss(
    one_worker: tuple[dict[str, Any], str],
) -> None:
    check = _check(one_worker[0], "lr_zero")
    _close(check["losses"], [check["initial"]] * 3)


def test_model_checkpoint_saves_each_epochs_weights_under_parameter_servers(
    one_worker: tuple[dict[str, Any], str],
) -> None:
    check = _check(one_worker[0], "checkpoints")
    for got, want in zip(check["restored_from_file"], check["epoch_2_weights"]):
        _close(got, want, tol=0)


def test_backup_and_restore_resumes_an_interrupted_fit_to_the_uninterrupted_weights(
    one_worker: tuple[dict[str, Any], str],
) -> None:
    check = _check(one_worker[0], "checkpoints")
    assert check["interrupted"]
    assert check["resumed_epochs"] == 2  # epochs 3 and 4 of 4
    for got, want in zip(check["resumed_weights"], check["uninterrupted_weights"]):
        _close(got, want)


def test_misuse_under_parameter_servers_is_refused_saying_what_to_do(
    one_worker: tuple[dict[str, Any], str],
) -> None:
    check = _check(one_worker[0], "refusals")
    backup = check["backup_per_step"]
    assert backup is not None and "ValueError" in backup["mro"]
    assert "save_freq='epoch'" in backup["message"]
    steps = check["dataset_fn_without_steps"]
    assert steps is not None and "steps_per_epoch" in steps["message"]
    with_y = check["dataset_fn_with_y"]
    assert with_y is not None and "do not pass y" in with_y["message"]


@pytest.mark.parametrize("source", ["iterable_dataset", "data_loader", "generator"])
def test_an_input_without_length_or_steps_per_epoch_is_refused_before_the_first_step(
    one_worker: tuple[dict[str, Any], str], source: str
) -> None:
    check = _check(one_worker[0], "refusals")[f"endless_{source}"]
    raised = check["raised"]
    assert raised is not None, f"fit on an endless {source} returned"
    assert "InvalidArgumentError" in raised["mro"] and "ValueError" in raised["mro"]
    assert "steps_per_epoch" in raised["message"]
    assert check["seconds"] < 10  # refused up front, not after training
    losses = check["with_steps"]  # with steps_per_epoch the same input trains
    assert len(losses) == 2 and all(np.isfinite(losses)), losses


def test_a_normal_exit_prints_no_tensorpipe_warning(
    one_worker: tuple[dict[str, Any], str],
) -> None:
    report, stderr = one_worker
    assert all(code == 0 for code in report["exit_codes"].values()), report["exit_codes"]
    noise = [line for line in stderr.splitlines() if any(n in line for n in TENSORPIPE_NOISE)]
    assert not noise, "\n".join(noise)


def test_two_workers_learn_and_evaluate_predict_use_the_trained_weights(
    two_workers: tuple[dict[str, Any], str],
) -> None:
    check = _check(two_workers[0], "two_workers")
    losses = check["losses"]
    assert losses[-1] < 0.5 * losses[0], losses
    _close(check["evaluate"][0], check["direct_loss"])
    assert check["predict_error"] < 1e-6


def test_a_dataset_fn_gets_each_workers_input_context(
    two_workers: tuple[dict[str, Any], str],
) -> None:
    check = _check(two_workers[0], "two_workers")
    assert check["contexts"] == [[2, 0], [2, 1]]
    assert len(check["dataset_fn_losses"]) == 2 and all(np.isfinite(check["dataset_fn_losses"]))


def test_a_worker_killed_during_fit_does_not_lose_the_run(
    two_workers: tuple[dict[str, Any], str],
) -> None:
    check = _check(two_workers[0], "two_workers")
    assert check["killed"]
    assert len(check["after_kill"]) == 2 and all(np.isfinite(check["after_kill"]))
    assert check["after_kill"][-1] <= check["losses"][-1] * 1.5


def test_a_lost_worker_is_logged_with_its_name_and_the_cause(
    two_workers: tuple[dict[str, Any], str],
) -> None:
    _, stderr = two_workers
    lost = [line for line in stderr.splitlines() if "worker_1 is lost:" in line]
    assert lost, stderr[-3000:]
    assert "did not answer a ping" in lost[0] or "cannot be called" in lost[0], lost[0]
    assert not any("worker_0 is lost" in line for line in stderr.splitlines())


# -- the user's errors on a worker (#36) --------------------------------------------------


def _named_worker_1(raised: dict[str, Any], where: str) -> None:
    """The error's note names worker_1 and holds its traceback there, through `where`."""
    assert raised["notes"], raised
    note = raised["notes"][-1]
    assert note.startswith("raised on worker_1; its traceback there:\nTraceback"), note
    assert f"in {where}" in note, note


@pytest.mark.parametrize(
    ("case", "where"),
    [("user_dataset_fn", "_user_error_dataset_fn"), ("user_step", "train_step")],
)
def test_the_users_own_exception_class_raised_on_a_worker_is_rebuilt_on_the_chief(
    worker_errors: dict[str, Any], case: str, where: str
) -> None:
    raised = worker_errors[case]["raised"]
    assert raised is not None, f"fit returned although worker_1 raised ({case})"
    assert raised["is_user_error"], raised  # the chief's own class: `except UserError` works
    expected = "no shard 1 of 2" if case == "user_dataset_fn" else "a bad batch on worker_1"
    assert raised["message"] == expected
    _named_worker_1(raised, where)


@pytest.mark.parametrize(
    ("case", "where"),
    [("builtin_dataset_fn", "_value_error_dataset_fn"), ("builtin_step", "train_step")],
)
def test_a_builtin_error_on_worker_1_keeps_its_type_and_names_the_worker_with_its_traceback(
    worker_errors: dict[str, Any], case: str, where: str
) -> None:
    raised = worker_errors[case]["raised"]
    assert raised is not None, f"fit returned although worker_1 raised ({case})"
    assert raised["mro"] == _VALUE_ERROR_MRO
    assert raised["message"] in ("no shard 1", "a bad batch on worker_1")
    _named_worker_1(raised, where)


@pytest.mark.parametrize(
    "case", ["user_dataset_fn", "user_step", "builtin_dataset_fn", "builtin_step"]
)
def test_after_a_workers_error_nothing_is_stale_and_every_worker_is_still_used(
    worker_errors: dict[str, Any], case: str
) -> None:
    after = worker_errors[case]["after"]
    assert after["evaluate"] is None, f"evaluate raised a stale error: {after['evaluate']}"
    assert after["join"] is None, f"join raised a stale error: {after['join']}"
    assert after["workers"] == ["worker_0", "worker_1"]
    assert worker_errors["workers_before"] == ["worker_0", "worker_1"]


def test_an_error_the_chief_cannot_rebuild_is_a_remote_error_naming_type_message_and_worker(
    worker_errors: dict[str, Any],
) -> None:
    check = worker_errors["unrebuildable"]
    raised = check["raised"]
    assert raised is not None, "fetch returned although the closure raised"
    # the library's error, and still the ValueError the original is
    assert raised["mro"][:2] == ["RemoteValueError", "RemoteError"]
    assert {"DistributeError", "ValueError"} <= set(raised["mro"])
    remote = raised["remote"]
    task = remote["task"]
    assert task in ("worker_0", "worker_1")
    assert remote["type_name"] == "__main__.TwoPartError"
    assert remote["remote_message"] == f"code 7: cannot rebuild on {task}"
    assert "in _raise_two_part" in remote["remote_traceback"]
    assert f"TwoPartError raised on {task}: code 7" in raised["message"]
    assert raised["notes"] and raised["notes"][-1].startswith(f"raised on {task};")
    # raised once by the coordinator, then nothing; both workers still run closures
    assert check["join"] is not None and check["join"]["type"] == "RemoteValueError"
    assert check["join_again"] is None
    assert check["workers"] == ["worker_0", "worker_1"]


_VALUE_ERROR_MRO = ["ValueError", "Exception", "BaseException", "object"]


def test_the_parameter_server_example_exits_without_tensorpipe_warnings() -> None:
    """The README's parameter-server command: a chief script with 2 workers and 1 ps."""
    launch = [sys.executable, "-m", "distribute.coordinator.launch", "--workers", "2", "--ps", "1"]
    script = ["examples/train_digits.py", "--strategy", "parameter_server", "--epochs", "1"]
    proc = subprocess.run(
        [*launch, "--", *script],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert '"strategy": "parameter_server"' in proc.stdout
    noise = [line for line in proc.stderr.splitlines() if any(n in line for n in TENSORPIPE_NOISE)]
    assert not noise, "\n".join(noise)
