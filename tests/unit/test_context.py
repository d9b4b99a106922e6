"""Context rules: default, cross-replica and replica contexts; scope nesting."""

from __future__ import annotations

import threading

import pytest
import torch

import distribute as ds


def test_default_context_outside_any_scope() -> None:
    assert not ds.has_strategy()
    assert not ds.in_cross_replica_context()
    ctx = ds.get_replica_context()
    assert ctx is not None
    assert ctx.replica_id_in_sync_group == 0
    assert ctx.num_replicas_in_sync == 1
    assert ds.get_strategy() is ds.get_strategy()  # a singleton


def test_default_strategy_run_calls_fn_directly() -> None:
    default = ds.get_strategy()
    assert default.run(lambda a, b: a * b, args=(3,), kwargs={"b": 4}) == 12
    assert not ds.has_strategy()


def test_scope_makes_the_strategy_current_in_cross_replica_context() -> None:
    s = ds.OneDeviceStrategy("cpu")
    with s.scope():
        assert ds.get_strategy() is s
        assert ds.has_strategy()
        assert ds.in_cross_replica_context()
        assert ds.get_replica_context() is None
    assert not ds.has_strategy()


def test_run_enters_replica_context_with_the_replica_ids() -> None:
    s = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])

    def fn() -> tuple[int, int, bool, bool]:
        ctx = ds.get_replica_context()
        assert ctx is not None
        return (
            ctx.replica_id_in_sync_group,
            ctx.num_replicas_in_sync,
            ds.in_cross_replica_context(),
            ds.get_strategy() is s,
        )

    results = s.experimental_local_results(s.run(fn))
    assert [r[0] for r in results] == [0, 1, 2]
    assert all(r[1] == 3 and r[2] is False and r[3] for r in results)


def test_reentering_the_same_scope_is_fine() -> None:
    s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with s.scope(), s.scope():
        assert ds.get_strategy() is s
    assert not ds.has_strategy()


def test_entering_a_different_strategy_scope_raises_naming_both() -> None:
    a = ds.OneDeviceStrategy("cpu")
    b = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with a.scope():
        with pytest.raises(RuntimeError, match="Mixing") as info:
            with b.scope():
                pass
        assert "OneDeviceStrategy" in str(info.value)
        assert "MirroredStrategy" in str(info.value)
        assert ds.get_strategy() is a  # the failed entry left the stack intact
    assert not ds.has_strategy()


def test_experimental_set_strategy_sets_and_clears() -> None:
    s = ds.OneDeviceStrategy("cpu")
    ds.experimental_set_strategy(s)
    try:
        assert ds.get_strategy() is s
        assert ds.in_cross_replica_context()
    finally:
        ds.experimental_set_strategy(None)
    assert not ds.has_strategy()


def test_experimental_set_strategy_inside_a_scope_raises() -> None:
    s = ds.OneDeviceStrategy("cpu")
    with s.scope(), pytest.raises(RuntimeError, match="scope"):
        ds.experimental_set_strategy(s)


def test_contexts_are_per_thread() -> None:
    s = ds.OneDeviceStrategy("cpu")
    seen: list[bool] = []
    with s.scope():
        t = threading.Thread(target=lambda: seen.append(ds.has_strategy()))
        t.start()
        t.join()
    assert seen == [False]


@pytest.mark.parametrize("method", ["reduce", "gather"])
def test_reduce_and_gather_in_replica_context_raise_with_a_hint(method: str) -> None:
    s = ds.MirroredStrategy(["cpu:0", "cpu:1"])

    def fn() -> None:
        if method == "reduce":
            s.reduce("sum", torch.ones(1))
        else:
            s.gather(torch.ones(1), axis=0)

    with pytest.raises(RuntimeError, match="cross-replica") as info:
        s.run(fn)
    assert ("merge_call" in str(info.value)) or ("all_gather" in str(info.value))


def test_run_inside_run_raises() -> None:
    s = ds.OneDeviceStrategy("cpu")
    with pytest.raises(RuntimeError, match="inside `run`"):
        s.run(lambda: s.run(lambda: 1))


def test_default_replica_context_merge_call_runs_in_cross_replica_context() -> None:
    def merge_fn(strategy: ds.Strategy, x: int) -> tuple[int, bool]:
        return x + 1, ds.in_cross_replica_context()

    ctx = ds.get_replica_context()
    assert ctx is not None
    assert ctx.merge_call(merge_fn, args=(1,)) == (2, True)
    assert ctx.all_reduce("sum", 5.0) == 5.0
