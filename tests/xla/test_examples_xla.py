"""The examples that run on torch_xla, each in its own process (as a user runs them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch_xla", reason="needs torch_xla (the XLA lane: .ci/xla)")
pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "TF_CPP_MIN_LOG_LEVEL": "2"}


def _run(*args: str) -> list[dict[str, object]]:
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_train_digits_on_one_replica_per_xla_device() -> None:
    (out,) = _run("examples/train_digits.py", "--strategy", "tpu", "--epochs", "4", "--quiet")
    assert out["replicas_in_sync"] == 4
    assert out["test_accuracy"] > 0.85, out


@pytest.mark.spmd
def test_train_digits_as_one_spmd_program() -> None:
    (out,) = _run(
        "examples/train_digits.py", "--strategy", "tpu", "--spmd", "--epochs", "4", "--quiet"
    )
    assert out["replicas_in_sync"] == 4
    assert out["test_accuracy"] > 0.85, out


def test_the_reference_page_examples_run_as_written() -> None:
    loop, logical = _run("examples/tpu_seed_examples.py")
    assert loop["last_loss"] < loop["first_loss"], loop
    assert logical["num_replicas"] == 2
    assert logical["devices"] == ["xla:0", "xla:2"]  # logical device 0 of replicas 0 and 1
    assert logical["values"] == [[[2.0, 2.0, 2.0]], [[2.0, 2.0, 2.0]]]


def _same_fine_tuning(got: dict[str, object], want: dict[str, object]) -> None:
    for key in ("loss", "val_loss"):
        got_values, want_values = got[key], want[key]
        assert isinstance(got_values, list) and isinstance(want_values, list)
        assert len(got_values) == len(want_values) == 3
        assert max(abs(a - b) for a, b in zip(got_values, want_values)) < 1e-5, (key, got, want)
    assert got["val_accuracy"] == want["val_accuracy"]
    assert got["predict_accuracy"] == want["predict_accuracy"]


def test_bert_fine_tuned_with_fit_on_xla_devices_has_the_default_strategy_s_losses() -> None:
    pytest.importorskip("transformers", reason="the BERT example needs transformers")
    (default,) = _run("examples/bert_tpu_fit.py")
    (tpu,) = _run("examples/bert_tpu_fit.py", "--strategy", "tpu")
    assert tpu["replicas_in_sync"] == 4 and not tpu["spmd"]
    _same_fine_tuning(tpu, default)


@pytest.mark.spmd
def test_bert_fine_tuned_with_fit_as_one_spmd_program_has_the_default_strategy_s_losses() -> None:
    pytest.importorskip("transformers", reason="the BERT example needs transformers")
    (default,) = _run("examples/bert_tpu_fit.py")
    (tpu,) = _run("examples/bert_tpu_fit.py", "--strategy", "tpu", "--spmd")
    assert tpu["replicas_in_sync"] == 4 and tpu["spmd"]
    _same_fine_tuning(tpu, default)
