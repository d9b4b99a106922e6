"""ParameterServerStrategy on real processes: a chief, ps and worker tasks over rpc.

rpc is process-global, so this process never builds the strategy: each cluster is
one run of ``tests/distributed/_ps_chief.py <case>`` (a `LocalCluster` whose chief
is that script), which reports what each of its checks observed as one JSON line.
The tests below assert on those reports; several tests share one cluster (a
module-scoped fixture runs it once). The tests at the end fail before any rpc is set
up and run in this process.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _ps_chief import MARKER

import distribute as ds
from distribute.cluster_resolver import SimpleClusterResolver

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parents[2]
CHIEF = Path(__file__).with_name("_ps_chief.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
#: The rendezvous waits at least this long for tasks to start (MIN_WAIT_SECONDS).
RENDEZVOUS_BOUND_SECONDS = 30.0


def _run_chief(case: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(CHIEF), case],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    assert proc.returncode == 0 and lines, (
        f"chief {case!r} exited {proc.returncode} without a report:\n{proc.stderr[-4000:]}"
    )
    report: dict[str, Any] = json.loads(lines[-1][len(MARKER) :])
    assert "error" not in report, f"chief {case!r} failed: {report['error']}\n{report['traceback']}"
    return report


def _check(report: dict[str, Any], name: str) -> dict[str, Any]:
    """The observations of check `name`; fails with the chief's error if it raised."""
    check: dict[str, Any] = report[name]
    if "error" in check:
        pytest.fail(
            f"check {name!r} raised in the chief: {check['error']}\n{check.get('traceback', '')}"
            + (f"\n(then pending: {check['pending_error']})" if "pending_error" in check else "")
        )
    return check


@pytest.fixture(scope="module")
def one_ps() -> dict[str, Any]:
    """2 workers, 1 ps."""
    return _run_chief("one_ps")


@pytest.fixture(scope="module")
def two_ps_sharded() -> dict[str, Any]:
    """2 workers, 2 ps, FixedShardsPartitioner(5)."""
    return _run_chief("two_ps_sharded")


@pytest.fixture(scope="module")
def ps_failure() -> dict[str, Any]:
    """2 workers, 2 ps, MinSizePartitioner; ps_0 is killed during a run."""
    return _run_chief("ps_failure")


@pytest.fixture(params=["one_ps", "two_ps_sharded"])
def any_cluster(request: pytest.FixtureRequest) -> tuple[int, dict[str, Any]]:
    num_ps = {"one_ps": 1, "two_ps_sharded": 2}[request.param]
    return num_ps, request.getfixturevalue(request.param)


# -- scheduling -------------------------------------------------------------------------


def test_schedule_join_fetch_return_every_closures_value(
    any_cluster: tuple[int, dict[str, Any]],
) -> None:
    num_ps, report = any_cluster
    check = _check(report, "schedule")
    scalars = [float(i + 1) for i in range(2 * num_ps)]
    assert check["fetched_list"] == [10 * s for s in scalars] + [sum(scalars)]
    assert check["fetched_nest"] == {"slow": 7, "pair": [5, 3]}
    assert check["remote_fetch"] == 7  # RemoteValue.fetch
    assert check["remote_get"] == 5  # RemoteValue.get, a closure given kwargs


def test_variables_are_placed_round_robin_over_the_ps_tasks(
    any_cluster: tuple[int, dict[str, Any]],
) -> None:
    num_ps, report = any_cluster
    tasks = _check(report, "placement")["tasks"]
    assert tasks == [f"ps_{i % num_ps}" for i in range(2 * num_ps)]


def test_done_is_false_while_a_closure_runs_and_true_after_join(
    any_cluster: tuple[int, dict[str, Any]],
) -> None:
    _, report = any_cluster
    check = _check(report, "schedule")
    assert check["done_while_running"] is False  # a 1 s closure was just scheduled
    assert check["done_after_join"] is True


def test_a_sum_counter_incremented_by_n_closures_ends_at_n(one_ps: dict[str, Any]) -> None:
    check = _check(one_ps, "counter")
    assert check["read_value"] == 20
    assert check["chief_copy_after_join"] == 20
    # assign_add is atomic on the ps: each closure saw a different new value
    assert check["returned"] == list(range(1, 21))


def test_a_remote_value_argument_to_schedule_raises_value_error(one_ps: dict[str, Any]) -> None:
    check = _check(one_ps, "remote_value_argument")
    for where in ("positional", "nested", "keyword"):
        error = check[where]
        assert error is not None, f"schedule accepted a RemoteValue ({where})"
        assert "ValueError" in error["mro"], error
        assert "RemoteValue" in error["message"]
    assert check["still_works"] == 1


# -- per-worker datasets ----------------------------------------------------------------


def test_per_worker_iterators_give_closures_batches_and_every_batch_is_seen(
    one_ps: dict[str, Any],
) -> None:
    check = _check(one_ps, "per_worker_dataset")
    assert check["iterators_per_worker"] == 2
    expected = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(batch in expected for batch in check["batches"]), check["batches"]
    assert len(check["batches"]) == 8
    # each worker reads its own copy from the start: with 8 closures over 2 workers,
    # one ran at least 4 and saw every batch
    assert sorted({tuple(b) for b in check["batches"]}) == [tuple(b) for b in expected]


def test_a_per_worker_data_loader_gives_each_worker_its_batches_in_order(
    one_ps: dict[str, Any],
) -> None:
    batches = _check(one_ps, "per_worker_dataset")["loader_batches"]
    expected = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert len(batches) == 4 and all(b in expected for b in batches), batches
    # whichever worker ran the first closure read its loader's first batch
    assert batches[0] == [0, 1]


def test_fetch_of_per_worker_values_fetches_each_workers_remote_value(
    one_ps: dict[str, Any],
) -> None:
    check = _check(one_ps, "per_worker_dataset")
    assert check["fetched_per_worker_values"] == ["a", "b"]


# -- training ---------------------------------------------------------------------------


def test_scheduled_sgd_steps_train_a_linear_regression(one_ps: dict[str, Any]) -> None:
    check = _check(one_ps, "training")
    assert check["optimizer_type"] == "torch.optim.sgd.SGD"
    assert check["final_loss"] < check["initial_loss"] / 100, check
    losses = check["step_losses"]
    assert len(losses) == 60
    assert sum(losses[-5:]) < sum(losses[:5]) / 100, losses


def test_a_worker_has_loaded_what_optimizers_import_before_its_first_closure(
    one_ps: dict[str, Any],
) -> None:
    """Else a worker's first step takes seconds longer than the others', and in a
    short run its gradient of the initial weights is applied last, undoing the run
    (test_scheduled_sgd_steps_train_a_linear_regression failed so, 1 run in 15)."""
    assert _check(one_ps, "warm_start")["imported"] == [True]


def test_the_chiefs_copies_after_join_equal_the_ps_values(one_ps: dict[str, Any]) -> None:
    check = _check(one_ps, "training")
    assert check["chief_copies"] == check["read_values"]
    assert check["chief_copies"] != [[[0.0, 0.0, 0.0]], [0.0]]


# -- errors -----------------------------------------------------------------------------


def test_the_error_of_the_last_closure_surfaces_from_join(one_ps: dict[str, Any]) -> None:
    check = _check(one_ps, "errors")
    assert check["join_last"] is not None, "join returned although the closure raised"
    assert (check["join_last"]["type"], check["join_last"]["message"]) == ("ValueError", "boom 0")
    assert check["failing_fetch_0"]["message"] == "boom 0"


def test_a_closures_error_surfaces_from_join_and_cancels_the_queued_closures(
    one_ps: dict[str, Any],
) -> None:
    check = _check(one_ps, "errors")
    assert check["join"] == {"type": "ValueError", "mro": _VALUE_ERROR_MRO, "message": "boom"}
    assert check["failing_fetch"]["type"] == "ValueError"
    assert check["failing_fetch"]["message"] == "boom"
    queued = check["queued_fetch"]
    cancelled = [q for q in queued if q.get("type") == "ClosureCancelledError"]
    # the other worker may have taken one before the failure; the rest are cancelled
    assert len(cancelled) >= len(queued) - 1, queued
    assert queued[-1].get("type") == "ClosureCancelledError", queued[-1]
    assert all("value" in q or q.get("type") == "ClosureCancelledError" for q in queued)


def test_a_closures_error_surfaces_from_the_next_schedule_and_done(
    one_ps: dict[str, Any],
) -> None:
    check = _check(one_ps, "errors")
    assert check["failing_fetch_2"]["message"] == "boom 2"
    assert check["schedule"] is not None, "schedule did not raise the earlier closure's error"
    assert (check["schedule"]["type"], check["schedule"]["message"]) == ("ValueError", "boom 2")
    assert check["failing_fetch_3"]["message"] == "boom 3"
    assert isinstance(check["done"], dict), f"done() returned {check['done']!r}"
    assert (check["done"]["type"], check["done"]["message"]) == ("ValueError", "boom 3")


def test_the_coordinator_goes_on_once_an_error_was_raised(one_ps: dict[str, Any]) -> None:
    check = _check(one_ps, "errors")
    assert check["join_after_raised"] == "returned"
    assert check["rescheduled"] == 42


_VALUE_ERROR_MRO = ["ValueError", "Exception", "BaseException", "object"]


# -- partitioned variables ----------------------------------------------------------------


def test_fixed_shards_partitioner_splits_an_embedding_13_rows_3_3_3_2_2_over_the_ps(
    two_ps_sharded: dict[str, Any],
) -> None:
    check = _check(two_ps_sharded, "embedding")
    assert check["is_sharded"], f"the weight is a {check['weight_type']}"
    assert check["shard_rows"] == [3, 3, 3, 2, 2]
    tasks = check["shard_tasks"]
    assert set(tasks) == {"ps_0", "ps_1"}
    assert all(a != b for a, b in itertools.pairwise(tasks)), f"not round-robin: {tasks}"


def test_a_sharded_variable_reads_as_its_initial_full_value(
    two_ps_sharded: dict[str, Any],
) -> None:
    assert _check(two_ps_sharded, "embedding")["initial_equal"] is True


def test_an_embedding_lookup_step_changes_exactly_the_looked_up_rows(
    two_ps_sharded: dict[str, Any],
) -> None:
    check = _check(two_ps_sharded, "embedding")
    assert check["lookup_shape"] == [4, 4]
    before, after, ids = check["before"], check["after"], check["ids"]
    lr = 0.5  # the gradient of sum() is 1 per lookup: row 1, looked up twice, moves by 2 lr
    for row in range(len(before)):
        step = lr * ids.count(row)
        expected = [b - step for b in before[row]]
        assert after[row] == pytest.approx(expected, abs=1e-6), (row, before[row], after[row])


def test_min_size_partitioner_shards_a_large_variable_and_keeps_a_small_one_whole(
    ps_failure: dict[str, Any],
) -> None:
    check = _check(ps_failure, "min_size")
    assert check["is_sharded"] is True
    assert check["shard_rows"] == [4, 4, 4]  # 192 bytes, at least 64 a shard
    assert set(check["shard_tasks"]) == {"ps_0", "ps_1"}
    assert check["initial_equal"] is True
    assert check["small_is_sharded"] is False, check["small_type"]


# -- failures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker_failure() -> dict[str, Any]:
    """2 workers, 1 ps: worker_1 killed during 50 closures, then worker_0."""
    return _run_chief("worker_failure")


@pytest.fixture(scope="module")
def worker_restart() -> dict[str, Any]:
    """2 workers, 1 ps: worker_1 killed during 50 closures and restarted."""
    return _run_chief("worker_restart")


@pytest.mark.slow  # run by CI (.ci/run: -m slow), not by the README's command
def test_closures_of_a_killed_worker_run_elsewhere_at_least_once(
    worker_failure: dict[str, Any],
) -> None:
    check = _check(worker_failure, "run")
    closures = check["closures"]
    assert check["fetched"] == list(range(closures))
    # at least once: the killed worker may have incremented before it died
    assert closures <= check["counter"] <= closures + 1, check["counter"]


@pytest.mark.slow  # run by CI (.ci/run: -m slow), not by the README's command
def test_with_every_worker_dead_join_fails_naming_the_loss_after_the_timeout(
    worker_failure: dict[str, Any],
) -> None:
    check = _check(worker_failure, "all_lost")
    error = check["join"]
    assert error is not None, "join returned with every worker dead"
    assert "WorkerLostError" in error["mro"], error
    assert "worker_0" in error["message"] and "came back" in error["message"]
    # it waited for a worker to come back, but not much longer than the timeout
    timeout = check["timeout_seconds"]
    assert timeout - 1.0 <= check["seconds"] < timeout + 5.0, check["seconds"]
    assert check["value"]["type"] == "ClosureCancelledError", check["value"]
    # worker_0 was restarted afterwards (and exited 0 at the shutdown)
    assert worker_failure["exit_codes"] == {"ps_0": 0, "worker_0": 0, "worker_1": -9}


@pytest.mark.slow  # run by CI (.ci/run: -m slow), not by the README's command
def test_a_restarted_worker_rejoins_and_runs_closures_again(
    worker_restart: dict[str, Any],
) -> None:
    check = _check(worker_restart, "run")
    closures = check["closures"]
    assert check["fetched"] == list(range(closures))
    assert closures <= check["counter_after_kill"] <= closures + 1
    assert check["new_pid"] != check["old_pid"]
    assert check["rejoined_after_seconds"] < 60.0
    # after it rejoined, closures run on both workers: the restarted process too
    assert check["pids_after_rejoin"] == sorted([check["worker_0_pid"], check["new_pid"]])
    assert check["counter_after_rejoin"] == check["counter_after_kill"] + 20


@pytest.mark.slow  # run by CI (.ci/run: -m slow), not by the README's command
def test_a_worker_restarted_after_every_worker_died_runs_the_next_closure(
    worker_failure: dict[str, Any],
) -> None:
    check = _check(worker_failure, "back_after_all_lost")
    assert check["value"] == 9
    assert check["seconds"] < 60.0


@pytest.mark.slow  # run by CI (.ci/run: -m slow), not by the README's command
def test_after_a_restart_the_process_starts_another_cluster_using_every_worker(
    worker_restart: dict[str, Any],
) -> None:
    check = _check(worker_restart, "next_cluster")
    assert check["value"] == 11
    assert check["ran_on_every_worker"], check
    assert check["exit_codes"] == {"ps_0": 0, "worker_0": 0, "worker_1": 0}


@pytest.mark.slow  # run by CI (.ci/run: -m slow), not by the README's command
def test_a_restarted_workers_per_worker_iterator_is_rebuilt_from_the_start(
    worker_restart: dict[str, Any],
) -> None:
    check = _check(worker_restart, "run")
    assert check["first_batch_there"] == [0, 1]


@pytest.mark.slow  # run by CI (.ci/run: -m slow), not by the README's command
def test_a_second_process_claiming_a_live_worker_is_refused_naming_it(
    worker_restart: dict[str, Any],
) -> None:
    check = _check(worker_restart, "duplicate")
    assert check["returncode"] not in (0, None), check
    assert "worker_0 is alive, so two processes claim it" in check["stderr_tail"]
    assert check["still"] == 5  # the cluster goes on


@pytest.mark.slow  # run by CI (.ci/run: -m slow), not by the README's command
def test_every_task_exits_0_after_a_restart_and_a_clean_shutdown(
    worker_restart: dict[str, Any],
) -> None:
    assert worker_restart["exit_codes"] == {"ps_0": 0, "worker_0": 0, "worker_1": 0}


def test_a_killed_ps_is_named_by_the_next_join_within_the_timeout(
    ps_failure: dict[str, Any],
) -> None:
    check = _check(ps_failure, "run")
    assert check["counter_task"] == "ps_0"
    error = check["join"]
    assert error is not None, "join returned although ps_0 was killed"
    assert "PsUnavailableError" in error["mro"], error
    assert "ps_0" in error["message"]
    # the strategy's timeout, not the worker task's own default (60 s)
    assert f"after {check['timeout_seconds']:.0f} s" in error["message"], error["message"]
    assert check["seconds"] < check["timeout_seconds"] + 5.0, check["seconds"]
    codes = dict(ps_failure["exit_codes"])
    assert codes.pop("ps_0") == -9  # SIGKILL
    assert codes == {"ps_1": 0, "worker_0": 0, "worker_1": 0}


@pytest.fixture(scope="module")
def ps_frozen() -> dict[str, Any]:
    """1 worker, 1 ps, timeout_seconds=4; ps_0 is stopped (SIGSTOP) during a run."""
    return _run_chief("ps_frozen")


@pytest.mark.slow  # run by CI (.ci/run: -m slow), not by the README's command
def test_a_frozen_ps_is_named_not_blamed_on_the_worker_within_the_timeout(
    ps_frozen: dict[str, Any],
) -> None:
    """Before: a plain RuntimeError saying that worker_0 is alive but its call failed."""
    check = _check(ps_frozen, "run")
    error = check["join"]
    assert error is not None, "join returned although ps_0 was stopped"
    assert "PsUnavailableError" in error["mro"] and "DistributeError" in error["mro"], error
    assert "parameter server ps_0" in error["message"], error["message"]
    assert f"after {check['timeout_seconds']:.0f} s" in error["message"], error["message"]
    timeout = check["timeout_seconds"]
    # the closure's timeout, then a ping of the ps of at most the timeout
    assert check["seconds"] < 2 * timeout + 5.0, check["seconds"]
    codes = dict(ps_frozen["exit_codes"])
    assert codes.pop("ps_0") == -9  # killed once stopped
    assert codes == {"worker_0": 0}


def test_a_restarted_ps_is_refused_saying_to_restart_from_a_checkpoint(
    ps_failure: dict[str, Any],
) -> None:
    check = _check(ps_failure, "ps_restarted")
    assert check["returncode"] not in (0, None), check
    assert "ps_0 died, and a ps task cannot rejoin" in check["stderr_tail"]
    assert "checkpoint" in check["stderr_tail"]


def test_every_task_exits_0_after_a_clean_shutdown(
    any_cluster: tuple[int, dict[str, Any]],
) -> None:
    num_ps, report = any_cluster
    expected = {f"ps_{i}": 0 for i in range(num_ps)} | {"worker_0": 0, "worker_1": 0}
    assert report["exit_codes"] == expected


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_idle_tasks_do_not_spin(one_ps: dict[str, Any]) -> None:
    """TensorPipe's shared-memory transport busy-polls: half a core per idle task."""
    check = _check(one_ps, "idle_cpu")
    for task, cpu in check["cpu"].items():
        assert cpu < 0.2 * check["seconds"], (task, cpu)


# -- a process of another cluster ---------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_every_task_listens_on_its_cluster_spec_address_only(one_ps: dict[str, Any]) -> None:
    """The spec's addresses are 127.0.0.1: nothing listens on another interface (the
    chief's rendezvous store, TensorPipe's listeners), though no TP_SOCKET_IFNAME
    was set."""
    check = _check(one_ps, "listeners")
    assert set(check) == {"chief", "ps_0", "worker_0", "worker_1"}
    for task, addresses in check.items():
        assert addresses, f"{task} listens nowhere?"
        assert set(addresses) == {"127.0.0.1"}, (task, addresses)


def test_a_process_of_another_cluster_is_refused_quickly_naming_the_difference(
    any_cluster: tuple[int, dict[str, Any]],
) -> None:
    """A ``serve`` process whose TF_CONFIG has one worker more, with the same chief:
    as the extra worker itself (two_ps_sharded: its rank is ps_0's in this cluster)
    and as a ps (one_ps: a rank no task holds)."""
    _, report = any_cluster
    check = _check(report, "another_cluster")
    assert check["returncode"] not in (0, None), check
    assert check["seconds"] < RENDEZVOUS_BOUND_SECONDS, check["seconds"]  # did not wait it out
    assert "different clusters" in check["stderr_tail"], check["stderr_tail"]


def test_a_refused_process_of_another_cluster_leaves_the_cluster_working(
    two_ps_sharded: dict[str, Any],
) -> None:
    assert _check(two_ps_sharded, "after_another_cluster") == {"value": 3}


# -- in this process: refused before any rpc ----------------------------------------------

_SPEC = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}


@pytest.mark.parametrize("task_type", ["chief", "evaluator"])
def test_server_refuses_a_task_that_is_not_ps_or_worker(task_type: str) -> None:
    spec = {**_SPEC, "evaluator": ["127.0.0.1:4"]}
    resolver = SimpleClusterResolver(spec, task_type=task_type, task_id=0)
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"'ps' and 'worker'.*{task_type}"):
        ds.Server(resolver)
    assert time.monotonic() - start < 5.0  # refused at once, not after a rendezvous


def test_strategy_without_a_ps_task_raises_value_error_naming_the_counts() -> None:
    resolver = SimpleClusterResolver(
        {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]},
        task_type="chief",
        task_id=0,
    )
    with pytest.raises(ValueError, match=r"worker=2, ps=0"):
        ds.ParameterServerStrategy(resolver)


def test_strategy_without_a_worker_task_raises_value_error_naming_the_counts() -> None:
    resolver = SimpleClusterResolver(
        {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, task_type="chief", task_id=0
    )
    with pytest.raises(ValueError, match=r"worker=0, ps=1"):
        ds.ParameterServerStrategy(resolver)


def test_strategy_built_on_a_worker_task_raises_value_error() -> None:
    resolver = SimpleClusterResolver(_SPEC, task_type="worker", task_id=0)
    with pytest.raises(ValueError, match="built on the chief"):
        ds.ParameterServerStrategy(resolver)


# -- what users trip on ------------------------------------------------------------------


@pytest.fixture(scope="module")
def robustness() -> dict[str, Any]:
    return _run_chief("robustness")


def test_a_module_built_inside_a_closure_stays_local_to_the_worker(
    robustness: dict[str, Any],
) -> None:
    check = _check(robustness, "module_inside")
    assert check["after"] == check["before"]  # the chief's variable is untouched


def test_an_in_place_write_on_the_chief_reaches_the_ps(robustness: dict[str, Any]) -> None:
    assert _check(robustness, "chief_writes")["ps"] == [[7.0]]


def test_a_learning_rate_changed_after_the_first_schedule_is_used(
    robustness: dict[str, Any],
) -> None:
    check = _check(robustness, "learning_rate")
    assert check["after_lr_1"] == 6.0  # 7 - 1.0 * d(w * 1)/dw
    assert check["after_lr_0"] == 6.0  # lr 0: unchanged (the function is sent anew)


def test_an_unsendable_result_fails_its_closure_and_keeps_the_workers(
    robustness: dict[str, Any],
) -> None:
    check = _check(robustness, "unsendable_result")
    assert check["failure"] is not None and "cannot be sent back" in check["failure"]["message"]
    assert check["later"] == 5


def test_an_unsendable_argument_is_refused_by_schedule_and_the_queue_goes_on(
    robustness: dict[str, Any],
) -> None:
    check = _check(robustness, "unsendable_argument")
    assert check["failure"] is not None, "schedule() took a lock as an argument"
    assert "InvalidArgumentError" in check["failure"]["mro"]
    assert "cannot send the arguments" in check["failure"]["message"]
    assert check["later"] == 6


def test_a_sharded_lookup_leaves_the_padding_row_alone(robustness: dict[str, Any]) -> None:
    check = _check(robustness, "padding")
    assert check["after"][0] == check["before"][0]  # padding_idx=0: no gradient
    assert check["after"][1] != check["before"][1]


def test_a_second_strategy_in_one_process_is_refused_and_the_first_goes_on(
    robustness: dict[str, Any],
) -> None:
    check = _check(robustness, "second_strategy")
    assert "already is task chief" in check["failure"]["message"]
    assert check["first_still_works"] == 3


def test_schedule_after_shutdown_raises_and_every_task_exits_0(
    robustness: dict[str, Any],
) -> None:
    assert "shut down" in robustness["after_shutdown"]["failure"]["message"]
    assert robustness["exit_codes"] == {"ps_0": 0, "worker_0": 0, "worker_1": 0}


def test_a_checkpoint_restored_on_the_chief_reaches_the_ps(robustness: dict[str, Any]) -> None:
    check = _check(robustness, "checkpoint")
    assert check["ps_after_restore"] == check["saved"]
    assert check["table_after_restore"] == check["saved_table"]  # every shard, on its ps


def test_after_a_shutdown_the_process_starts_another_cluster(robustness: dict[str, Any]) -> None:
    check = _check(robustness, "next_cluster")
    assert check["value"] == 11
    assert check["seconds"] < 30.0, check["seconds"]
    assert check["exit_codes"] == {"ps_0": 0, "worker_0": 0}


def test_a_checkpoint_keeps_the_optimizer_state_the_ps_tasks_hold(
    robustness: dict[str, Any],
) -> None:
    """Adam over a dense and a sharded variable: 2 steps, save, 1 step (the run to
    match); 3 more steps, restore, 1 step: the same weights, so the moments and step
    counts came back from the checkpoint to the ps tasks."""
    check = _check(robustness, "optimizer_state")
    assert check["resumed"] == check["continued"]


def test_optimizer_state_saved_sharded_is_refused_by_a_whole_variable(
    robustness: dict[str, Any],
) -> None:
    error = _check(robustness, "optimizer_state")["other_sharding"]
    assert error is not None, "state of 2 shards restored into one variable"
    assert "InvalidArgumentError" in error["mro"]
    assert "saved as 2 shards but is now one variable" in error["message"]
    assert "variable_partitioner" in error["message"]


def test_per_worker_iterators_the_chief_dropped_are_freed_on_the_workers(
    robustness: dict[str, Any],
) -> None:
    # the dataset, and at most the last iterator while its free is on its way (5 made)
    assert all(count <= 2 for count in _check(robustness, "iterators_freed")["counts"])
