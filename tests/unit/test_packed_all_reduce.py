"""Packed in-process all-reduce: many tensors in one call (proposed tests/unit file).

DESIGN.md "Collectives": mismatched shapes or dtypes across replicas give a clear
error; REFERENCE.md: all_reduce is batched over the nest and the gradient of an
all-reduce SUM is the all-reduce SUM of the gradient.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distribute as ds
from distribute.collectives.packing import pack_tensors, sum_packs, unpack_tensors
from distribute.errors import CollectiveMismatchError

DTYPES = [torch.float32, torch.float64, torch.int64, torch.float16]


def ctx() -> ds.ReplicaContext:
    c = ds.get_replica_context()
    assert c is not None
    return c


@pytest.fixture(scope="module")
def mirrored4() -> ds.Strategy:
    return ds.MirroredStrategy([f"cpu:{i}" for i in range(4)])


def make(shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], r: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(r)
    return [(torch.randint(-5, 5, s, generator=g) * (r + 1)).to(d) for s, d in zip(shapes, dtypes)]


shapes_st = st.lists(
    st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple), min_size=0, max_size=12
)


@settings(max_examples=30, deadline=None)
@given(shapes=shapes_st, data=st.data())
def test_pack_then_unpack_is_identity_with_views(shapes: list[Any], data: Any) -> None:
    dtypes = [data.draw(st.sampled_from(DTYPES)) for _ in shapes]
    tensors = make(shapes, dtypes, 0)
    p = pack_tensors(tensors)
    out = unpack_tensors(p.flats, p.shapes, p.groups)
    assert len(out) == len(tensors)
    for a, b in zip(out, tensors):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        buffers = {f.untyped_storage().data_ptr() for f in p.flats}
        assert a.numel() == 0 or a.untyped_storage().data_ptr() in buffers  # a view, no copy


@settings(max_examples=20, deadline=None)
@given(shapes=shapes_st, data=st.data())
def test_sum_packs_equals_the_sum_and_leaves_inputs_alone(shapes: list[Any], data: Any) -> None:
    dtypes = [data.draw(st.sampled_from(DTYPES)) for _ in shapes]
    per_replica = [make(shapes, dtypes, r) for r in range(3)]
    before = [[t.clone() for t in p] for p in per_replica]
    packs = [pack_tensors(p) for p in per_replica]
    totals = sum_packs(packs, torch.device("cpu"))
    out = unpack_tensors(totals, packs[0].shapes, packs[0].groups)
    for j, got in enumerate(out):
        want = per_replica[0][j] + per_replica[1][j] + per_replica[2][j]
        assert torch.equal(got, want)
    for p, b in zip(per_replica, before):
        assert all(torch.equal(x, y) for x, y in zip(p, b))


@settings(max_examples=10, deadline=None)
@given(shapes=shapes_st, data=st.data())
def test_all_reduce_of_a_list_matches_per_tensor_all_reduce(
    mirrored4: ds.Strategy, shapes: list[Any], data: Any
) -> None:
    dtypes = [data.draw(st.sampled_from(DTYPES)) for _ in shapes]
    op = data.draw(st.sampled_from(["sum", "mean"]))

    def fn() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        tensors = make(shapes, dtypes, ctx().replica_id_in_sync_group)
        return ctx().all_reduce(op, tensors), [ctx().all_reduce(op, t) for t in tensors]

    total = [sum(ts) for ts in zip(*(make(shapes, dtypes, r) for r in range(4)))]
    for packed, single in mirrored4.experimental_local_results(mirrored4.run(fn)):
        assert isinstance(packed, list) and len(packed) == len(shapes)
        for a, b, t in zip(packed, single, total):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
            if op == "sum":
                assert a.dtype == t.dtype and torch.equal(a, t)


def test_each_replica_gets_its_own_buffer_and_inputs_are_untouched(mirrored4: ds.Strategy) -> None:
    def fn() -> list[Any]:
        xs = [torch.full((3,), float(ctx().replica_id_in_sync_group)) for _ in range(5)]
        ys = ctx().all_reduce("sum", xs)
        ys[0].add_(100)  # must not leak to other replicas or inputs
        return [ys, xs]

    outs = mirrored4.experimental_local_results(mirrored4.run(fn))
    ptrs = {ys[1].untyped_storage().data_ptr() for ys, _ in outs}
    assert len(ptrs) == 4
    for r, (ys, xs) in enumerate(outs):
        assert torch.equal(ys[0], torch.full((3,), 106.0))
        assert all(torch.equal(y, torch.full((3,), 6.0)) for y in ys[1:])
        assert all(torch.equal(x, torch.full((3,), float(r))) for x in xs)


def test_non_contiguous_and_expanded_inputs(mirrored4: ds.Strategy) -> None:
    def fn() -> Any:
        r = float(ctx().replica_id_in_sync_group)
        return ctx().all_reduce(
            "sum", (torch.arange(6.0).view(2, 3).t() * r, torch.tensor(r).expand(2, 2))
        )

    for a, b in mirrored4.experimental_local_results(mirrored4.run(fn)):
        assert torch.equal(a, torch.arange(6.0).view(2, 3).t() * 6)
        assert torch.equal(b, torch.full((2, 2), 6.0))


def test_empty_list_all_reduce_returns_an_empty_list(mirrored4: ds.Strategy) -> None:
    outs = mirrored4.experimental_local_results(mirrored4.run(lambda: ctx().all_reduce("sum", [])))
    assert all(o == [] for o in outs)


def test_transposed_shapes_with_equal_sizes_raise_naming_replicas_and_shapes(
    mirrored4: ds.Strategy,
) -> None:
    def fn() -> Any:
        shape = (3, 2) if ctx().replica_id_in_sync_group == 2 else (2, 3)
        return ctx().all_reduce("sum", [torch.ones(4)] * 10 + [torch.ones(shape)])

    with pytest.raises(CollectiveMismatchError) as info:
        mirrored4.run(fn)
    message = str(info.value)
    assert "replica 0" in message and "replica 2" in message
    assert "float32[2, 3]" in message and "float32[3, 2]" in message


def test_gradient_of_a_packed_sum_is_the_sum_of_the_gradients(mirrored4: ds.Strategy) -> None:
    xs = [[torch.full((2,), 1.0, requires_grad=True) for _ in range(50)] for _ in range(4)]

    def fn() -> None:
        r = ctx().replica_id_in_sync_group
        ys = ctx().all_reduce("sum", xs[r])
        sum((j + 1) * (r + 1) * y.sum() for j, y in enumerate(ys)).backward()

    mirrored4.run(fn)
    for r in range(4):
        for j, x in enumerate(xs[r]):
            assert torch.equal(x.grad, torch.full((2,), float((j + 1) * 10)))


def test_packed_all_reduce_keeps_each_dtype_and_rejects_mismatched_layouts() -> None:
    from distribute.collectives.cross_device_ops import packed_all_reduce

    per_replica = [
        [torch.full((2,), r, dtype=torch.int64), torch.full((3,), 0.5 * r), torch.tensor(r * 1.0)]
        for r in range(3)
    ]
    for num_packs in (1, 2, 5):
        for out in packed_all_reduce(ds.ReduceOp.SUM, per_replica, num_packs):
            assert out[0].dtype == torch.int64 and torch.equal(out[0], torch.full((2,), 3))
            assert torch.equal(out[1], torch.full((3,), 1.5))
            assert torch.equal(out[2], torch.tensor(3.0))
    bad = [[torch.ones(2, 3)], [torch.ones(3, 2)]]
    with pytest.raises(CollectiveMismatchError, match=r"replica 1 passed \[float32\[3, 2\]\]"):
        packed_all_reduce(ds.ReduceOp.SUM, bad, 1)
