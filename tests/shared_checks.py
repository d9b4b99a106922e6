"""Pieces several test modules use: a bitwise comparison of nested states, and a
`fit` callback that records the steps and can kill its worker at one of them.

Importable from every test module (pytest puts tests/, where the root conftest.py
is, on ``sys.path``; `launch.run` hands that path on to the workers).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch

import distribute as ds


def assert_identical(actual: Any, expected: Any, where: str = "") -> None:
    """Equal nests, tensors bitwise equal with the same dtype and shape."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}"
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"{where}: values differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (
            f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        )
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_identical(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


class StepRecorder(ds.callbacks.Callback):
    """Records the (epoch, batch) of every training step; rank ``kill_rank`` SIGKILLs
    itself at the end of step ``kill_at``."""

    def __init__(self, kill_rank: int | None, kill_at: tuple[int, int]) -> None:
        super().__init__()
        self.kill_rank, self.kill_at = kill_rank, kill_at
        self.steps: list[tuple[int, int]] = []
        self.epoch = -1

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.steps.append((self.epoch, batch))
        if self.kill_rank == int(os.environ["RANK"]) and (self.epoch, batch) == self.kill_at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
