"""ProcessGroupCollectives and the local launcher, in real processes over gloo."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from distribute import launch
from distribute._enums import ReduceOp
from distribute.cluster_resolver import resolve_cluster
from distribute.collectives.process_group import ProcessGroupCollectives
from distribute.errors import CollectiveMismatchError, CollectiveTimeoutError, WorkerError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _collectives(timeout: float = 60.0) -> ProcessGroupCollectives:
    resolver = resolve_cluster()
    assert resolver is not None
    return ProcessGroupCollectives.create(
        resolver.rank, resolver.world_size, resolver.master_addr, resolver.master_port,
        timeout_seconds=timeout,
    )


def _many_collectives() -> dict[str, Any]:
    c = _collectives()
    r, n = c.rank, c.world_size
    out: dict[str, Any] = {}
    small = [torch.full((k % 7 + 1,), float(r + k)) for k in range(300)]
    small += [torch.full((2, 2), r + k, dtype=torch.int64) for k in range(50)]
    summed = c.all_reduce(small, ReduceOp.SUM, name="many small", bytes_per_pack=256)
    out["small_ok"] = all(
        torch.equal(s, torch.full_like(t, sum(rr + k for rr in range(n))))
        for k, (s, t) in enumerate(zip(summed[:300], small[:300]))
    ) and all(
        torch.equal(s, torch.full((2, 2), sum(rr + k for rr in range(n)), dtype=torch.int64))
        for k, s in enumerate(summed[300:])
    )
    out["inputs_untouched"] = torch.equal(small[0], torch.full((1,), float(r)))
    out["mean"] = c.all_reduce([torch.tensor([float(r)])], ReduceOp.MEAN, name="mean")[0].item()
    out["gather"] = c.all_gather(torch.full((r + 1, 2), float(r)), 0, name="uneven").tolist()
    out["gather_axis1"] = c.all_gather(torch.full((2, r + 1), r), 1, name="uneven axis 1").tolist()
    b = [torch.full((3,), float(r)), torch.full((2,), r, dtype=torch.int32)]
    c.broadcast(b, src=n - 1, name="from last")
    out["broadcast"] = [t.tolist() for t in b]
    out["int"] = c.all_reduce_int(r + 1, "count")
    handle = c.all_reduce_async([torch.ones(4) * r, torch.ones(2)], ReduceOp.SUM, name="async")
    out["async"] = [t.tolist() for t in handle.wait()]
    c.check_same([("float32", 10)], name="layout")
    c.barrier("end")
    c.shutdown()
    c.shutdown()  # idempotent
    return out


def test_collectives_over_three_workers() -> None:
    n = 3
    results = launch.run(_many_collectives, n, timeout=90)
    for r, out in enumerate(results):
        assert out["small_ok"] and out["inputs_untouched"]
        assert out["mean"] == pytest.approx(1.0)
        assert out["gather"] == [[float(k)] * 2 for k in range(n) for _ in range(k + 1)]
        assert out["gather_axis1"] == [[k for k in range(n) for _ in range(k + 1)]] * 2
        assert out["broadcast"] == [[2.0] * 3, [2] * 2]
        assert out["int"] == 6
        assert out["async"] == [[3.0] * 4, [3.0] * 2], r


def _stuck_peer(timeout: float) -> dict[str, Any]:
    c = _collectives(timeout)
    if c.rank == 1:
        time.sleep(timeout + 6)  # alive, but never reaches the collective
        return {"slept": True}
    start = time.monotonic()
    try:
        c.all_reduce([torch.ones(2)], ReduceOp.SUM, name="gradients")
    except CollectiveTimeoutError as exc:
        return {"message": str(exc), "seconds": time.monotonic() - start}
    return {"message": None}


def test_stuck_peer_raises_within_the_timeout_naming_it() -> None:
    timeout = 4.0
    out = launch.run(_stuck_peer, 2, args=(timeout,), timeout=60)[0]
    assert out["message"] is not None
    assert "ranks [1] never arrived" in out["message"] and "gradients" in out["message"]
    assert out["seconds"] <= timeout + 1.0


def _mismatched_gather() -> str:
    c = _collectives(20)
    try:
        c.all_gather(torch.ones(2, 3 + c.rank), 0, name="features")
    except CollectiveMismatchError as exc:
        return str(exc)
    return ""


def test_mismatched_shapes_raise_on_every_rank_naming_both() -> None:
    for message in launch.run(_mismatched_gather, 2, timeout=60):
        assert "features" in message
        assert "rank 0 passed float32[2, 3]" in message and "rank 1 passed float32[2, 4]" in message


def _raise_on_rank_one() -> int:
    resolver = resolve_cluster()
    assert resolver is not None
    if resolver.rank == 1:
        raise ValueError("bad batch on rank one")
    time.sleep(30)  # killed by the launcher once rank 1 fails
    return resolver.rank


def test_launcher_reraises_a_worker_exception_with_its_rank_and_kills_the_others() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 raised ValueError: bad batch on rank one"):
        launch.run(_raise_on_rank_one, 2, timeout=60)
    assert time.monotonic() - start < 25


def _sleep_forever() -> None:
    time.sleep(600)


def test_launcher_timeout_kills_every_worker_and_names_them() -> None:
    with pytest.raises(WorkerError, match=r"timed out after 4.0 s; ranks \[0, 1\]"):
        launch.run(_sleep_forever, 2, timeout=4.0)


def _identity(x: int) -> tuple[int, str]:
    resolver = resolve_cluster()
    assert resolver is not None
    return x, f"{resolver.task_type}:{resolver.task_id}:{resolver.rank}"


def test_launcher_returns_results_in_rank_order_under_tf_config() -> None:
    results = launch.run(_identity, 2, args=(7,), launcher="tf_config", timeout=60)
    assert results == [(7, "worker:0:0"), (7, "worker:1:1")]
