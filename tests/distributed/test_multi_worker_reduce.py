"""A custom loop's cross-worker `reduce`: one collective a call, and a mismatch that
appears after steady steps still raises on every worker (issue 40, NOTE [one
collective per reduce] in distribute/strategies/_cross_replica.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import distribute as ds
from distribute import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

STEADY_STEPS = 5


def _reduce_values() -> dict[str, Any]:
    """Sums over 2 workers of values that fit the one collective and of values that
    need a second one (integers, more than 11 elements), and means over an axis."""
    strategy = ds.MultiWorkerMirroredStrategy()
    assert strategy.cluster_resolver is not None
    rank = strategy.cluster_resolver.rank
    r = float(rank + 1)
    cases = {
        "f32 scalar": torch.tensor(0.1 * r),
        "f64 [4]": torch.arange(4, dtype=torch.float64) * r + 1e-9,
        "f32 [2, 3]": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 3 * r,
        "bf16 [2]": torch.tensor([1.5, -2.0], dtype=torch.bfloat16) * r,
        "i64 [3]": torch.tensor([2**40 + 1, -3, 7]) * (rank + 1),
        "f32 [100]": torch.linspace(0, 1, 100) * r,
    }
    out: dict[str, Any] = {}
    for name, value in cases.items():
        for _ in range(2):  # the second call reuses the cached signature hash
            got = strategy.reduce("sum", value, axis=None)
        out[name] = (str(got.dtype), list(got.shape), got.tolist())
    per_replica = strategy.run(lambda: torch.ones(2 + rank) * r)  # 2 and 3 examples
    out["mean axis 0"] = float(strategy.reduce("mean", per_replica, axis=0))
    out["sum axis 0"] = float(strategy.reduce("sum", per_replica, axis=0))
    strategy.shutdown()
    return out


def test_cross_worker_reduce_gives_the_sum_of_every_dtype_and_size() -> None:
    results = launch.run(_reduce_values, 2, args=(), timeout=120)
    expected: dict[str, torch.Tensor] = {
        "f32 scalar": torch.tensor(0.1) + torch.tensor(0.2),
        "f64 [4]": (torch.arange(4, dtype=torch.float64) + 1e-9)
        + (torch.arange(4, dtype=torch.float64) * 2 + 1e-9),
        "f32 [2, 3]": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 3
        + torch.arange(6, dtype=torch.float32).reshape(2, 3) / 3 * 2,
        "bf16 [2]": torch.tensor([1.5, -2.0], dtype=torch.bfloat16) * 3,
        "i64 [3]": torch.tensor([2**40 + 1, -3, 7]) * 3,
        "f32 [100]": torch.linspace(0, 1, 100) + torch.linspace(0, 1, 100) * 2,
    }
    for out in results:
        for name, want in expected.items():
            dtype, shape, values = out[name]
            assert dtype == str(want.dtype) and shape == list(want.shape), (name, out[name])
            assert values == want.tolist(), (name, values, want.tolist())  # bit for bit
        assert out["sum axis 0"] == pytest.approx(2 * 1.0 + 3 * 2.0)
        assert out["mean axis 0"] == pytest.approx((2 * 1.0 + 3 * 2.0) / 5)


def _later_mismatch(kind: str) -> dict[str, Any]:
    """STEADY_STEPS reduces that agree, then one where worker 1 passes another value."""
    strategy = ds.MultiWorkerMirroredStrategy(
        communication_options=ds.experimental.CommunicationOptions(timeout_seconds=30)
    )
    assert strategy.cluster_resolver is not None
    rank = strategy.cluster_resolver.rank
    good = torch.ones(3)
    odd = {
        "shape": torch.ones(1),
        "same size, other shape": torch.ones(3, 1),
        "dtype": torch.ones(3, dtype=torch.float64),
        "large": torch.ones(40),
        "axis": good,
    }[kind]
    for _ in range(STEADY_STEPS):
        strategy.reduce("sum", good, axis=None)
    start = time.monotonic()
    try:
        if kind == "axis":
            # worker 1's sum over axis 0 has worker 0's shape: only the axis differs
            strategy.reduce(
                "sum", torch.ones(2, 3) if rank == 1 else good, axis=0 if rank else None
            )
        else:
            strategy.reduce("sum", odd if rank == 1 else good, axis=None)
    except ds.errors.CollectiveMismatchError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("kind", ["shape", "same size, other shape", "dtype", "large", "axis"])
def test_reduce_raises_on_every_worker_when_a_worker_changes_after_steady_steps(
    kind: str,
) -> None:
    results = launch.run(_later_mismatch, 2, args=(kind,), timeout=120)
    for out in results:
        assert out["error"] is not None, (kind, out)
        assert out["seconds"] < 10, out  # at once, not after the collective timeout
        if kind != "axis":
            assert "rank 0" in out["error"] and "rank 1" in out["error"], out["error"]
            assert "float32[3]" in out["error"], out["error"]
        else:
            assert "axis" in out["error"], out["error"]


def _later_other_collective() -> dict[str, Any]:
    """Steady reduces, then worker 1 gathers where worker 0 reduces."""
    strategy = ds.MultiWorkerMirroredStrategy(
        communication_options=ds.experimental.CommunicationOptions(timeout_seconds=3)
    )
    assert strategy.cluster_resolver is not None
    rank = strategy.cluster_resolver.rank
    for _ in range(STEADY_STEPS):
        strategy.reduce("sum", torch.ones(3), axis=None)
    start = time.monotonic()
    try:
        if rank == 1:
            strategy.gather(torch.ones(3), axis=0)
        else:
            strategy.reduce("sum", torch.ones(3), axis=None)
    except ds.errors.DistributeError as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    return {"error": None, "seconds": time.monotonic() - start}


def test_another_collective_after_steady_reduces_raises_within_the_timeout() -> None:
    # The first reduce checks its collective against the others' (a checkpoint save on
    # one worker raises at once, test_checkpoint_multi_worker.py); later ones carry
    # only their own signature, and another collective there ends in the timeout's
    # error, on every worker, never a hang or a number.
    results = launch.run(_later_other_collective, 2, timeout=120)
    for out in results:
        assert out["error"] in {"CollectiveTimeoutError", "CollectiveMismatchError"}, out
        assert out["seconds"] < 3 + 10, out
