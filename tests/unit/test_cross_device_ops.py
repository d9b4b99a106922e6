"""Cross-device ops: ReductionToOneDevice, the packed all-reduces and their CPU fallback.

REFERENCE.md: ReductionToOneDevice reduces on one device (the first destination by
default), MEAN divides by the number of values, then broadcasts; NcclAllReduce and
HierarchicalCopyAllReduce reject `num_packs < 0`, pack by `num_packs` (last chunk takes
the remainder) and fall back to ReductionToOneDevice for CPU destinations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

import distribute as ds
from distribute.collectives.cross_device_ops import packed_all_reduce

ALL_REDUCE_OPS = [ds.HierarchicalCopyAllReduce, ds.NcclAllReduce]


def per_replica(*components: Any) -> ds.PerReplica:
    return ds.PerReplica([torch.as_tensor(c, dtype=torch.float32) for c in components])


def assert_mirrored(result: Any, expected: torch.Tensor, copies: int) -> None:
    assert isinstance(result, ds.Mirrored)
    assert len(result.values) == copies
    for value in result.values:
        torch.testing.assert_close(value, expected, rtol=0, atol=0)
    ptrs = {v.data_ptr() for v in result.values}
    assert len(ptrs) == copies, "every destination gets its own copy"


# -- ReductionToOneDevice ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "expected"), [("SUM", [9.0, 12.0]), ("MEAN", [3.0, 4.0]), (ds.ReduceOp.SUM, [9.0, 12.0])]
)
def test_reduction_to_one_device_reduce_sum_and_mean(op: Any, expected: list[float]) -> None:
    value = per_replica([1.0, 2.0], [3.0, 4.0], [5.0, 6.0])
    result = ds.ReductionToOneDevice().reduce(op, value, destinations=["cpu", "cpu"])
    assert_mirrored(result, torch.tensor(expected), copies=2)


def test_reduction_to_one_device_destinations_default_to_the_value_s_devices() -> None:
    value = per_replica([1.0], [2.0], [4.0], [8.0])
    result = ds.ReductionToOneDevice(reduce_to_device="cpu").reduce("sum", value, None)
    assert_mirrored(result, torch.tensor([15.0]), copies=4)


def test_reduction_to_one_device_to_a_single_device_and_to_a_distributed_value() -> None:
    value = per_replica([1.0, 1.0], [2.0, 2.0])
    ops = ds.ReductionToOneDevice()
    assert_mirrored(ops.reduce("mean", value, "cpu"), torch.tensor([1.5, 1.5]), copies=1)
    assert_mirrored(ops.reduce("sum", value, value), torch.tensor([3.0, 3.0]), copies=2)


def test_reduction_to_one_device_mean_of_integers_is_a_true_division() -> None:
    value = ds.PerReplica((torch.tensor(1), torch.tensor(2)))
    result = ds.ReductionToOneDevice().reduce("mean", value, "cpu")
    assert float(result.values[0]) == 1.5


def test_reduction_to_one_device_reduces_a_mirrored_variable() -> None:
    s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with s.scope():
        v = ds.Variable(torch.tensor([1.0, 2.0]))
    result = ds.ReductionToOneDevice().reduce("sum", v, v)
    assert_mirrored(result, torch.tensor([2.0, 4.0]), copies=2)


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_reduction_to_one_device_batch_reduce_reduces_each_pair(op: str) -> None:
    a = per_replica([1.0, 2.0], [3.0, 4.0])
    b = per_replica(10.0, 30.0)
    results = ds.ReductionToOneDevice().batch_reduce(op, [(a, ["cpu"] * 2), (b, "cpu")])
    n = 1.0 if op == "SUM" else 2.0
    assert len(results) == 2
    assert_mirrored(results[0], torch.tensor([4.0, 6.0]) / n, copies=2)
    assert_mirrored(results[1], torch.tensor(40.0) / n, copies=1)


def test_broadcast_copies_the_tensor_to_every_destination() -> None:
    t = torch.tensor([1.0, 2.0, 3.0])
    result = ds.ReductionToOneDevice().broadcast(t, ["cpu", "cpu", "cpu"])
    assert_mirrored(result, t, copies=3)
    assert all(v.data_ptr() != t.data_ptr() for v in result.values)


def test_reduce_rejects_destinations_of_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="destinations"):
        ds.ReductionToOneDevice().reduce("sum", per_replica(1.0, 2.0), destinations=3.5)


def test_reduce_rejects_an_unknown_reduce_op() -> None:
    with pytest.raises(ValueError, match="reduce_op"):
        ds.ReductionToOneDevice().reduce("max", per_replica(1.0, 2.0), "cpu")


# -- HierarchicalCopyAllReduce / NcclAllReduce -------------------------------------------


@pytest.mark.parametrize("cls", ALL_REDUCE_OPS)
def test_negative_num_packs_raises_value_error(cls: type[ds.CrossDeviceOps]) -> None:
    with pytest.raises(ValueError, match="num_packs must be >= 0"):
        cls(num_packs=-1)  # type: ignore[call-arg]


@pytest.mark.parametrize("cls", ALL_REDUCE_OPS)
def test_num_packs_defaults_to_one_and_is_kept(cls: type[Any]) -> None:
    assert cls().num_packs == 1
    assert cls(num_packs=0).num_packs == 0
    assert cls(num_packs=3).num_packs == 3


@pytest.mark.parametrize("num_packs", [0, 1, 2, 5])
@pytest.mark.parametrize("cls", ALL_REDUCE_OPS)
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_packed_all_reduce_on_cpu_falls_back_to_the_same_numbers(
    cls: type[Any], num_packs: int, op: str
) -> None:
    g = torch.Generator().manual_seed(0)
    values = [
        ds.PerReplica([torch.randn(3, 4, generator=g) for _ in range(4)]),
        ds.PerReplica([torch.randn(7, generator=g) for _ in range(4)]),
        ds.PerReplica([torch.randn((), generator=g) for _ in range(4)]),
    ]
    pairs = [(v, v) for v in values]
    expected = ds.ReductionToOneDevice().batch_reduce(op, pairs)
    got = cls(num_packs=num_packs).batch_reduce(op, pairs)
    assert len(got) == len(expected)
    for g_value, e_value in zip(got, expected):
        assert isinstance(g_value, ds.Mirrored)
        for a, b in zip(g_value.values, e_value.values):
            assert torch.equal(a, b)
    single = cls(num_packs=num_packs).reduce(op, values[0], values[0])
    assert torch.equal(single.values[0], expected[0].values[0])
    assert cls(num_packs=num_packs).batch_reduce(op, []) == []


@pytest.mark.parametrize("num_packs", [0, 1, 2, 3, 40])
def test_packed_all_reduce_splits_into_num_packs_and_reassembles(num_packs: int) -> None:
    # The packing path itself (used across distinct GPUs) gives the same numbers on CPU.
    per_replica_tensors = [
        [torch.full((2, 3), float(r)), torch.arange(5.0) * (r + 1), torch.tensor(float(r))]
        for r in range(3)
    ]
    out = packed_all_reduce(ds.ReduceOp.SUM, per_replica_tensors, num_packs)
    expected = [
        torch.full((2, 3), 3.0),
        torch.arange(5.0) * 6,
        torch.tensor(3.0),
    ]
    assert len(out) == 3
    for replica_out in out:
        for got, want in zip(replica_out, expected):
            assert got.shape == want.shape
            assert torch.equal(got, want)
    mean = packed_all_reduce(ds.ReduceOp.MEAN, per_replica_tensors, num_packs)
    torch.testing.assert_close(mean[1][1], torch.arange(5.0) * 2)


def test_packed_all_reduce_rejects_negative_num_packs() -> None:
    with pytest.raises(ValueError, match="num_packs"):
        packed_all_reduce(ds.ReduceOp.SUM, [[torch.ones(1)], [torch.ones(1)]], -2)


@pytest.mark.parametrize("cls", ALL_REDUCE_OPS)
def test_all_reduce_ops_broadcast(cls: type[Any]) -> None:
    result = cls(num_packs=2).broadcast(torch.tensor([5.0]), ["cpu", "cpu"])
    assert_mirrored(result, torch.tensor([5.0]), copies=2)


# -- CommunicationOptions -----------------------------------------------------------------


@pytest.mark.parametrize("bytes_per_pack", [-1, -(1 << 20)])
def test_communication_options_negative_bytes_per_pack_raises(bytes_per_pack: int) -> None:
    with pytest.raises(ValueError, match="bytes_per_pack"):
        ds.experimental.CommunicationOptions(bytes_per_pack=bytes_per_pack)


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_communication_options_non_positive_timeout_raises(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout_seconds"):
        ds.experimental.CommunicationOptions(timeout_seconds=timeout)


def test_communication_options_defaults_and_implementation_from_string() -> None:
    options = ds.experimental.CommunicationOptions()
    assert options.bytes_per_pack == 0
    assert options.timeout_seconds is None
    assert options.implementation is ds.experimental.CommunicationImplementation.AUTO
    ring = ds.experimental.CommunicationOptions(implementation="RING")  # type: ignore[arg-type]
    assert ring.implementation is ds.experimental.CommunicationImplementation.RING


# -- the strategy uses the ops it was given ---------------------------------------------------


class RecordingOps(ds.ReductionToOneDevice):
    """ReductionToOneDevice that records every batch_reduce call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[ds.ReduceOp | str, int]] = []

    def batch_reduce(
        self, reduce_op: ds.ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]
    ) -> list[ds.Mirrored]:
        self.calls.append((reduce_op, len(value_destination_pairs)))
        return super().batch_reduce(reduce_op, value_destination_pairs)


def test_mirrored_strategy_reduce_to_uses_the_given_cross_device_ops() -> None:
    ops = RecordingOps()
    s = ds.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops)
    value = s.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group + 1))
    )
    result = s.extended.reduce_to("sum", value, "cpu")
    assert ops.calls == [(ds.ReduceOp.SUM, 1)]
    assert float(s.experimental_local_results(result)[0]) == 3.0
    mean = s.extended.reduce_to("mean", value, "cpu")
    assert float(s.experimental_local_results(mean)[0]) == 1.5
    calls_before = len(ops.calls)
    s.extended.batch_reduce_to("sum", [(value, "cpu"), (value, "cpu")])
    assert len(ops.calls) > calls_before, "batch_reduce_to goes through the ops too"


@pytest.mark.parametrize(
    "ops",
    [ds.ReductionToOneDevice(), ds.HierarchicalCopyAllReduce(2), ds.NcclAllReduce(1), None],
    ids=["one_device", "hierarchical", "nccl", "none"],
)
def test_reduce_to_gives_the_same_numbers_whichever_ops(ops: ds.CrossDeviceOps | None) -> None:
    s = ds.MirroredStrategy([f"cpu:{i}" for i in range(4)], cross_device_ops=ops)
    value = s.experimental_distribute_values_from_function(
        lambda ctx: torch.arange(3.0) * (ctx.replica_id_in_sync_group + 1)
    )
    total = s.extended.reduce_to("sum", value, "cpu")
    mean = s.extended.reduce_to("mean", value, "cpu")
    assert torch.equal(s.experimental_local_results(total)[0], torch.arange(3.0) * 10)
    assert torch.equal(s.experimental_local_results(mean)[0], torch.arange(3.0) * 2.5)
