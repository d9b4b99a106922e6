"""TPUStrategy on torch_xla's CPU backend: 4 simulated XLA devices in this process.

torch_xla's SPMD mode is process-wide and cannot be left, so the SPMD tests (marker
``spmd``) and the replica-mode tests run in separate pytest processes:

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .xla-venv/bin/python -m pytest tests/xla -m "not spmd"
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .xla-venv/bin/python -m pytest tests/xla -m spmd

(`.ci/xla` runs both). Without torch_xla every test here is skipped.
"""

from __future__ import annotations

import os

import pytest

# torch_xla reads these when its runtime starts (tests may set the environment; the
# library never does).
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spmd: needs torch_xla in SPMD mode (its own process)")


def pytest_collection_finish(session: pytest.Session) -> None:
    """After `-m` deselection: refuses a run with both kinds of XLA tests."""
    items = [item for item in session.items if "xla" in item.path.parts]
    kinds = {item.get_closest_marker("spmd") is not None for item in items}
    if kinds == {True, False}:
        raise pytest.UsageError(
            "tests/xla mixes SPMD and replica-mode tests, but torch_xla's SPMD mode is "
            "process-wide: run them apart, with -m spmd and -m 'not spmd' (see "
            "tests/xla/conftest.py, or .ci/xla)"
        )
