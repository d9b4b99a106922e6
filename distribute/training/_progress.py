"""The progress bar of `fit`, `evaluate` and `predict`: tqdm on the chief alone.

``verbose``: 0 silent; 1 (and ``"auto"``) a bar per epoch with the steps done,
the time per step and the running loss and metrics; 2 one line per epoch (Keras's
format). Other workers of a multi-worker strategy print nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from distribute.errors import InvalidArgumentError
from distribute.training.callbacks import Callback

__all__ = ["ProgressBar"]


def _format(logs: dict[str, Any]) -> str:
    return " - ".join(f"{k}: {v:.4f}" for k, v in logs.items() if isinstance(v, (int, float)))


class ProgressBar(Callback):
    """Shows progress on the chief (see the module docstring)."""

    def __init__(self, verbose: str | int, is_chief: bool, mode: str) -> None:
        super().__init__()
        if verbose == "auto":
            verbose = 1
        if verbose not in (0, 1, 2):
            raise InvalidArgumentError(f"verbose must be 0, 1, 2 or 'auto', got {verbose!r}")
        self.requested = int(verbose)  # the same on every worker
        self.verbose = self.requested if is_chief else 0
        self.mode = mode
        self._bar: Any = None
        self._start = 0.0

    def _open(self, total: int | None, description: str) -> None:
        from tqdm import tqdm

        self._start = time.perf_counter()
        if self.verbose == 1:
            self._bar = tqdm(
                total=total, desc=description, unit="step", file=sys.stderr, leave=True
            )

    def _advance(self, batch: int, logs: dict[str, Any] | None) -> None:
        if self._bar is not None:
            self._bar.update(max(1, batch + 1 - self._bar.n))  # steps since the last call
            self._bar.set_postfix_str(_format(logs or {}), refresh=False)

    def _close(self, logs: dict[str, Any] | None, line: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(_format(logs or {}))
            self._bar.close()
            self._bar = None
        elif self.verbose == 2:
            seconds = time.perf_counter() - self._start
            sys.stderr.write(f"{line} - {seconds:.0f}s - {_format(logs or {})}\n")

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.verbose:
            self._epoch = epoch
            self._open(self.params.get("steps"), f"Epoch {epoch + 1}/{self.params.get('epochs')}")

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._advance(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.verbose:
            self._close(logs, f"Epoch {epoch + 1}/{self.params.get('epochs')}")

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.verbose and self.mode == "test":
            self._open(self.params.get("steps"), "evaluate")

    def on_test_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.mode == "test":
            self._advance(batch, logs)

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        if self.verbose and self.mode == "test":
            self._close(logs, "evaluate")

    def on_predict_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.verbose:
            self._open(self.params.get("steps"), "predict")

    def on_predict_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._advance(batch, logs)

    def on_predict_end(self, logs: dict[str, Any] | None = None) -> None:
        if self.verbose:
            self._close(logs, "predict")
