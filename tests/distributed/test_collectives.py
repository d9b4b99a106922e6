"""ProcessGroupCollectives in real worker processes over gloo on 127.0.0.1.

One launch checks many collectives, since starting a worker (importing torch)
costs about two seconds; the failure tests each need their own launch.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from distribute import launch
from distribute._enums import ReduceOp
from distribute.cluster_resolver import resolve_cluster
from distribute.collectives.process_group import ProcessGroupCollectives
from distribute.errors import CollectiveMismatchError, CollectiveTimeoutError, InvalidArgumentError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(90)]

ENV = {"OMP_NUM_THREADS": "1"}


def _collectives(timeout: float = 60.0) -> ProcessGroupCollectives:
    resolver = resolve_cluster()
    assert resolver is not None, "the launcher did not set up a cluster"
    return ProcessGroupCollectives.create(
        resolver.rank,
        resolver.world_size,
        resolver.master_addr,
        resolver.master_port,
        timeout_seconds=timeout,
    )


def _expected_sum(n: int, k: int) -> int:
    return sum(r + k for r in range(n))


def _many_collectives() -> dict[str, Any]:
    c = _collectives()
    r, n = c.rank, c.world_size
    out: dict[str, Any] = {"identity": (c.rank, c.world_size, c.backend)}

    # 1000 small tensors of three dtypes, in small packs and in one pack per dtype.
    small: list[torch.Tensor] = []
    for k in range(1000):
        dtype = (torch.float32, torch.float64, torch.int64)[k % 3]
        small.append(torch.full((k % 5 + 1, 2), r + k, dtype=dtype))
    before = [t.clone() for t in small]
    for pack in (0, 512):
        summed = c.all_reduce(small, ReduceOp.SUM, name=f"small/{pack}", bytes_per_pack=pack)
        out[f"sum_ok/{pack}"] = all(
            s.dtype == t.dtype and s.shape == t.shape and bool((s == _expected_sum(n, k)).all())
            for k, (s, t) in enumerate(zip(summed, small))
        )
    out["inputs_untouched"] = all(torch.equal(a, b) for a, b in zip(small, before))
    mean = c.all_reduce(
        [torch.tensor([float(r)]), torch.tensor([2 * r], dtype=torch.int64)],
        ReduceOp.MEAN,
        name="mean",
    )
    out["mean"] = [(m.item(), str(m.dtype)) for m in mean]
    in_place = [torch.full((3,), float(r)), torch.full((2, 2), float(r), dtype=torch.float64)]
    returned = c.all_reduce(in_place, ReduceOp.MEAN, name="in place", in_place=True)
    out["in_place"] = (
        all(a is b for a, b in zip(returned, in_place)),
        [t.flatten().tolist() for t in in_place],
    )
    out["gather0"] = c.all_gather(torch.full((r + 1, 2), float(r)), 0, name="rows").tolist()
    out["gather1"] = c.all_gather(torch.full((2, r + 1), r), -1, name="columns").tolist()
    out["gather_empty"] = c.all_gather(torch.ones(r % 2, 3), 0, name="some empty").shape[0]
    b = [torch.full((3,), float(r)), torch.full((2,), r, dtype=torch.int32), torch.zeros(1)]
    c.broadcast(b, src=n - 1, name="from last")
    out["broadcast"] = [t.tolist() for t in b]
    out["int"] = c.all_reduce_int(r + 1, "count")
    handle = c.all_reduce_async([torch.ones(4) * r, torch.ones(2)], ReduceOp.SUM, name="async")
    out["async"] = [t.tolist() for t in handle.wait()]
    c.check_same([("float32", 10)], name="layout")
    c.barrier("end")
    c.shutdown()
    c.shutdown()  # idempotent
    out["destroyed"] = not torch.distributed.is_initialized()
    try:
        c.barrier("after shutdown")
    except InvalidArgumentError as exc:
        out["after_shutdown"] = str(exc)
    return out


def test_collectives_give_the_reduced_gathered_and_broadcast_values_on_three_workers() -> None:
    n = 3
    results = launch.run(_many_collectives, n, timeout=60, env=ENV)
    for r, out in enumerate(results):
        assert out["identity"] == (r, n, "gloo")
        assert out["sum_ok/0"] and out["sum_ok/512"] and out["inputs_untouched"], r
        assert out["mean"] == [(1.0, "torch.float32"), (2.0, "torch.float64")]
        assert out["in_place"] == (True, [[1.0] * 3, [1.0] * 4])
        assert out["gather0"] == [[float(k)] * 2 for k in range(n) for _ in range(k + 1)]
        assert out["gather1"] == [[k for k in range(n) for _ in range(k + 1)]] * 2
        assert out["gather_empty"] == 1  # only rank 1 has a row
        assert out["broadcast"] == [[2.0] * 3, [2] * 2, [0.0]]
        assert out["int"] == 6
        assert out["async"] == [[3.0] * 4, [3.0] * 2]
        assert "after shutdown()" in out["after_shutdown"] and out["destroyed"]


def _dead_peer(timeout: float) -> dict[str, Any]:
    c = _collectives(timeout)
    c.barrier("everyone is up")
    if c.rank == 1:
        os._exit(1)  # dies without a word
    start = time.monotonic()
    try:
        c.all_reduce([torch.ones(1000)], ReduceOp.SUM, name="gradients", check=False)
    except CollectiveTimeoutError as exc:
        first = (str(exc), time.monotonic() - start)
    else:
        return {"message": None}
    try:  # the group is broken now: later collectives fail at once
        c.barrier("after the failure")
    except CollectiveTimeoutError as exc:
        later = str(exc)
    return {"message": first[0], "seconds": first[1], "later": later}


def test_a_dead_peer_is_named_on_every_rank_well_within_the_timeout() -> None:
    timeout = 30.0
    results = launch.run(_dead_peer, 4, args=(timeout,), timeout=60, allow_missing=True, env=ENV)
    assert results[1] is None
    for rank in (0, 2, 3):  # rank 3 has no direct link to rank 1 in gloo's ring
        out = results[rank]
        assert out["message"] is not None, rank
        assert "all_reduce 'gradients'" in out["message"]
        assert "ranks [1] never arrived: rank 1 is dead" in out["message"], out["message"]
        assert out["seconds"] < 5.0, out
        assert "broke in an earlier collective" in out["later"]


def _stuck_peer(timeout: float) -> dict[str, Any]:
    c = _collectives(timeout)
    c.barrier("everyone is up")
    start = time.monotonic()
    if c.rank == 1:
        time.sleep(timeout + 1.0)  # alive, but busy elsewhere past the others' timeout
    try:
        c.all_reduce([torch.ones(2)], ReduceOp.SUM, name="gradients")
    except CollectiveTimeoutError as exc:
        return {"message": str(exc), "seconds": time.monotonic() - start}
    return {"message": None}


def test_a_stuck_peer_is_named_as_alive_once_the_timeout_passes() -> None:
    timeout = 4.0
    results = launch.run(_stuck_peer, 3, args=(timeout,), timeout=60, env=ENV)
    for rank in (0, 2):
        out = results[rank]
        assert out["message"] is not None, rank
        assert "all_reduce 'gradients'" in out["message"]
        assert "ranks [1] never arrived: rank 1 is alive but stuck elsewhere" in out["message"]
        assert "#1 barrier 'everyone is up'" in out["message"]  # its last finished collective
        assert timeout - 1.5 <= out["seconds"] <= timeout + 0.5, out
    # The stuck rank, arriving late, fails at once with the others' verdict.
    late = results[1]
    assert late["message"] is not None
    assert "ranks [1] never arrived" in late["message"]
    assert late["seconds"] < timeout + 1.0 + 2.0


def _mismatches() -> dict[str, Any]:
    c = _collectives(20)
    r = c.rank
    out: dict[str, Any] = {}
    calls = {
        "shape": lambda: c.all_reduce([torch.ones(3 + r)], ReduceOp.SUM, name="x"),
        "dtype": lambda: c.all_reduce(
            [torch.ones(3, dtype=(torch.float32, torch.float64)[r])], ReduceOp.SUM, name="y"
        ),
        "many": lambda: c.all_reduce(
            [torch.ones(2 + r * (k == 7)) for k in range(10)], ReduceOp.SUM, name="grads"
        ),
        "gather": lambda: c.all_gather(torch.ones(2, 3 + r), 0, name="features"),
        "operation": lambda: (
            c.all_reduce([torch.ones(3)], ReduceOp.SUM, name="loss")
            if r == 0
            else c.broadcast([torch.ones(3)], 0, name="weights")
        ),
    }
    for key, call in calls.items():
        try:
            call()
            out[key] = None
        except CollectiveMismatchError as exc:
            out[key] = str(exc)
    out["still_usable"] = c.all_reduce([torch.ones(2)], ReduceOp.SUM, name="after")[0].tolist()
    c.shutdown()
    return out


def test_mismatched_calls_raise_on_every_rank_naming_both_ranks() -> None:
    for out in launch.run(_mismatches, 2, timeout=60, env=ENV):
        assert out["shape"].startswith(
            "all_reduce 'x': rank 0 passed float32[3] (SUM) but rank 1 passed float32[4] (SUM)"
        ), out["shape"]
        assert "rank 0 passed float32[3] (SUM) but rank 1 passed float64[3] (SUM)" in out["dtype"]
        assert (
            "rank 0 passed 10 tensors (SUM), #7 being float32[2] but rank 1 passed 10 tensors "
            "(SUM), #7 being float32[3]" in out["many"]
        ), out["many"]
        assert (
            "all_gather 'features': rank 0 passed float32[2, 3] (axis 0) but rank 1 "
            "passed float32[2, 4] (axis 0)" in out["gather"]
        )
        assert "rank 0 called all_reduce 'loss'" in out["operation"]
        assert "rank 1 called broadcast 'weights'" in out["operation"]
        assert out["still_usable"] == [2.0, 2.0]
