"""A model trained under the default strategy BEFORE TPUStrategy exists, in one process.

PyTorch's autograd engine sizes its per-device queues once, at the process's first
backward, and torch_xla counts no devices before its runtime starts (NOTE
[autograd's device queues] in `distribute/collectives/xla.py`). Each case runs in a
fresh interpreter, as a user's script does: the pytest process has long since run
backwards on XLA devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch_xla", reason="needs torch_xla (the XLA lane: .ci/xla)")

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PJRT_DEVICE": "CPU",
    "CPU_NUM_DEVICES": "4",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
}

# The script: mse, momentum SGD, fit(x, y, epochs=3, batch_size=16) under the
# default strategy, then the same under TPUStrategy; `early` starts torch_xla's
# runtime at the top (ds.tpu.initialize_tpu_system(), as TF's scripts do).
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np, torch
    import distribute as ds

    early, spmd = sys.argv[1] == "early", sys.argv[2] == "spmd"
    if early:
        ds.tpu.initialize_tpu_system()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 8)).astype("float32")
    y = rng.normal(size=(100, 1)).astype("float32")

    def fit():
        torch.manual_seed(0)
        model = ds.Model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                             torch.nn.Linear(16, 1)))
        model.compile(loss="mse",
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
        return model.fit(x, y, epochs=3, batch_size=16, verbose=0).history["loss"]

    default = fit()
    try:
        strategy = ds.TPUStrategy(experimental_spmd_xla_partitioning=spmd)
    except ds.errors.DistributeError as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}))
        sys.exit(0)
    with strategy.scope():
        tpu = fit()
    print(json.dumps({"default": default, "tpu": tpu}))
    """
)


def _run(order: str, mode: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, order, mode],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (out,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return out


@pytest.mark.parametrize("mode", ["replica", "spmd"])
def test_a_default_fit_before_the_strategy_is_refused_with_the_fix_not_an_autograd_assert(
    mode: str,
) -> None:
    out = _run("late", mode)
    assert out["error"] == "XlaAutogradError", out
    message = str(out["message"])
    assert "first backward ran before torch_xla's runtime started" in message
    assert "ds.tpu.initialize_tpu_system()" in message
    assert "INTERNAL ASSERT" not in message


@pytest.mark.parametrize("mode", ["replica", "spmd"])
def test_initializing_the_tpu_system_first_lets_a_default_fit_come_before_tpu_fit(
    mode: str,
) -> None:
    out = _run("early", mode)
    default, tpu = out["default"], out["tpu"]
    assert isinstance(default, list) and isinstance(tpu, list) and len(tpu) == 3
    assert max(abs(a - b) for a, b in zip(default, tpu)) < 1e-5, out
