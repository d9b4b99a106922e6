"""The README's main example trains for real and gives the same numbers under every
single-process strategy, and under FullyShardedStrategy as one worker, as two torchrun
workers and as two TF_CONFIG workers."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from distribute import launch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_digits.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_digits", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return _load()


@pytest.fixture(scope="module")
def reference(example: ModuleType) -> dict[str, float]:
    return example.main(["--strategy", "default", "--epochs", "2", "--quiet"])


def test_default_strategy_learns_digits(reference: dict[str, float]) -> None:
    assert reference["test_accuracy"] > 0.85
    assert math.isfinite(reference["final_loss"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--strategy", "one_device", "--device", "cpu"],
        ["--strategy", "mirrored", "--replicas", "1"],
        ["--strategy", "mirrored", "--replicas", "4"],
        ["--strategy", "central_storage", "--replicas", "2"],
        ["--strategy", "multi_worker"],
    ],
    ids=["one_device", "mirrored_1", "mirrored_4", "central_storage_2", "multi_worker_single"],
)
def test_every_strategy_matches_the_default_strategy(
    example: ModuleType, reference: dict[str, float], argv: list[str]
) -> None:
    result = example.main([*argv, "--epochs", "2", "--quiet"])
    assert result["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-5, abs=1e-6)
    assert result["test_accuracy"] == pytest.approx(reference["test_accuracy"], abs=1e-9)


def test_a_run_stopped_and_started_again_with_a_checkpoint_dir_continues_exactly(
    example: ModuleType, tmp_path: Path
) -> None:
    """`--checkpoint-dir`: a run of 2 epochs, then the same command asking for 3,
    ends where an uninterrupted 3-epoch run ends, bit for bit (weights, optimizer,
    input position and shuffle, generators)."""
    common = ["--strategy", "mirrored", "--quiet", "--checkpoint-dir", str(tmp_path)]
    example.main([*common, "--epochs", "2"])
    resumed = example.main([*common, "--epochs", "3"])
    straight = example.main(["--strategy", "mirrored", "--quiet", "--epochs", "3"])
    assert resumed["final_loss"] == straight["final_loss"]
    assert resumed["test_accuracy"] == straight["test_accuracy"]
    with pytest.raises(SystemExit, match="already finished 3 epochs"):
        example.main([*common, "--epochs", "3"])


def test_the_fit_api_gives_the_custom_loops_kind_of_model_under_every_strategy(
    example: ModuleType,
) -> None:
    mirrored = example.main(["--api", "fit", "--epochs", "2", "--quiet"])
    default = example.main(["--api", "fit", "--strategy", "default", "--epochs", "2", "--quiet"])
    assert mirrored["test_accuracy"] > 0.85
    assert mirrored["final_loss"] == pytest.approx(default["final_loss"], rel=1e-5)


def test_a_log_file_gets_one_plain_line_per_epoch(
    example: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """stderr that is not a terminal (a log file, CI) gets no redrawn bars: one line
    per epoch with the steps, the loss and the test accuracy."""
    example.main(["--strategy", "default", "--epochs", "2"])
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert [line.split(" - ")[:2] for line in lines] == [
        ["epoch 1/2", "22/22 steps"],
        ["epoch 2/2", "22/22 steps"],
    ]
    assert all("test accuracy" in line for line in lines)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_tqdm_bar_per_epoch(
    example: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    example.main(["--strategy", "default", "--epochs", "2"])
    epochs = terminal.getvalue().split("\n")
    assert len(epochs) == 3 and epochs[2] == ""  # each bar closed on its own line
    for number, drawn in enumerate(epochs[:2], start=1):
        last = drawn.split("\r")[-1]  # what the terminal shows once the epoch ends
        assert last.startswith(f"epoch {number}/2: 100%"), last
        assert "22/22" in last and "loss=" in last and "test accuracy" in last


def test_the_convolutional_example_learns_digits() -> None:
    spec = importlib.util.spec_from_file_location(
        "train_digits_cnn", EXAMPLE.with_name("train_digits_cnn.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--quiet"])
    assert result["validation_accuracy"] > 0.85


# -- FullyShardedStrategy: one worker, two torchrun workers, two TF_CONFIG workers ---------

SHARDED = ["--strategy", "fully_sharded", "--epochs", "2", "--quiet"]


def _script(args: list[str], *, torchrun: bool) -> dict[str, Any]:
    """The example as a command (a process group of its own, never this process's); the
    chief's JSON line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={launch.free_ports(1)[0]}",
    ]
    cmd = [sys.executable, *(launcher if torchrun else []), str(EXAMPLE), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout  # only the chief prints
    result: dict[str, Any] = lines[0]
    return result


def _main_in_worker(argv: list[str]) -> dict[str, Any]:
    """The example's main in a worker process of `launch.run`."""
    result: dict[str, Any] = _load().main(argv)
    return result


@pytest.fixture(scope="module")
def sharded_torchrun() -> dict[str, Any]:
    return _script(SHARDED, torchrun=True)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fully_sharded_as_one_worker_matches_the_default_strategy(
    reference: dict[str, float],
) -> None:
    result = _script(SHARDED, torchrun=False)
    assert result["replicas_in_sync"] == 1
    assert result["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-5, abs=1e-6)
    assert result["test_accuracy"] == pytest.approx(reference["test_accuracy"], abs=1e-9)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fully_sharded_learns_under_torchrun_like_multi_worker_mirrored(
    sharded_torchrun: dict[str, Any],
) -> None:
    """``torchrun --nproc_per_node=2 examples/train_digits.py --strategy fully_sharded``:
    two workers, each holding half of every weight, learn the digits, with the numbers
    of MultiWorkerMirroredStrategy on the same global batches."""
    mirrored = _script(["--strategy", "multi_worker", "--epochs", "2", "--quiet"], torchrun=True)
    assert sharded_torchrun["replicas_in_sync"] == 2
    assert sharded_torchrun["test_accuracy"] > 0.85, sharded_torchrun
    assert sharded_torchrun["final_loss"] == pytest.approx(mirrored["final_loss"], rel=1e-5)
    assert sharded_torchrun["test_accuracy"] == pytest.approx(mirrored["test_accuracy"], abs=1e-9)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fully_sharded_under_tf_config_matches_torchrun(sharded_torchrun: dict[str, Any]) -> None:
    results = launch.run(_main_in_worker, 2, args=(SHARDED,), launcher="tf_config", timeout=240)
    for result in results:  # every worker's own summary: the same numbers
        assert result["replicas_in_sync"] == 2
        assert result["final_loss"] == pytest.approx(sharded_torchrun["final_loss"], rel=1e-5)
        assert result["test_accuracy"] == sharded_torchrun["test_accuracy"]
