"""The compat.v1 parameter-server style: every worker runs its own loop (real
processes, real rpc), local replicas in sync, workers asynchronous."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import distribute as ds

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.distributed


def test_two_workers_each_running_its_own_loop_converge_on_digits() -> None:
    pytest.importorskip("sklearn")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TF_CONFIG", None)
    done = subprocess.run(
        [
            sys.executable,
            "examples/train_digits.py",
            "--strategy",
            "parameter_server_v1",
            "--epochs",
            "4",
            "--quiet",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-3000:]  # the ps task exited cleanly too
    outs = sorted(
        (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")),
        key=lambda out: out["worker"],
    )
    assert [out["worker"] for out in outs] == [0, 1]
    for out in outs:
        assert out["test_accuracy"] > 0.85, out
    # 719 and 718 examples, batches of 64, drop_last: 11 steps an epoch each. The
    # global step counts once per worker step (its first replica), not per replica;
    # the last worker to finish reads every step of both.
    assert max(out["global_step"] for out in outs) == 2 * 4 * 11
    assert all(4 * 11 <= out["global_step"] <= 2 * 4 * 11 for out in outs)


def test_a_cluster_with_a_chief_is_the_tf2_style() -> None:
    spec = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    resolver = ds.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=0)
    with pytest.raises(ValueError, match="has a 'chief': that is the TF2 style"):
        ds.compat.v1.ParameterServerStrategy(resolver)


def test_the_tf2_strategy_needs_a_chief() -> None:
    spec = {"worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    resolver = ds.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=0)
    with pytest.raises(ValueError, match=r"needs a 'chief'.*compat\.v1"):
        ds.ParameterServerStrategy(resolver)


def test_a_ps_task_cannot_run_the_compat_v1_program() -> None:
    spec = {"worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    resolver = ds.cluster_resolver.SimpleClusterResolver(spec, task_type="ps", task_id=0)
    with pytest.raises(ValueError, match="runs on worker tasks"):
        ds.compat.v1.ParameterServerStrategy(resolver)
    worker = ds.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=0)
    with pytest.raises(ValueError, match=r"only ps tasks run ds\.Server"):
        ds.Server(worker)
