"""The README's main example trains for real and gives the same numbers under every
single-process strategy."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


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


def test_the_convolutional_example_learns_digits() -> None:
    spec = importlib.util.spec_from_file_location(
        "train_digits_cnn", EXAMPLE.with_name("train_digits_cnn.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--quiet"])
    assert result["validation_accuracy"] > 0.85
