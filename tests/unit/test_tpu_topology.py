"""TPU set-up without torch_xla: device-assignment arithmetic, the resolver, the errors."""

from __future__ import annotations

import importlib.util
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import distribute as ds
from distribute.tpu import DeviceAssignment, Topology


def test_the_seed_assignment_gives_each_replica_two_adjacent_cores() -> None:
    a = DeviceAssignment.build(
        Topology.of_devices(8), computation_shape=[1, 1, 1, 2], num_replicas=4
    )
    assert (a.num_replicas, a.num_cores_per_replica) == (4, 2)
    assert a.core_assignment.shape == (4, 2, 4)
    assert [[a.tpu_ordinal(r, c) for c in range(2)] for r in range(4)] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    assert a.coordinates(3, 1) == (0, 0, 0, 7)


def test_the_default_assignment_is_one_core_for_one_replica() -> None:
    a = DeviceAssignment.build(Topology.of_devices(4))
    assert (a.num_replicas, a.num_cores_per_replica, a.tpu_ordinal()) == (1, 1, 0)


@given(
    mesh=st.tuples(*(st.integers(1, 3) for _ in range(4))),
    shape=st.tuples(*(st.integers(1, 3) for _ in range(4))),
    data=st.data(),
)
def test_replicas_tile_the_mesh_without_sharing_a_device(
    mesh: tuple[int, ...], shape: tuple[int, ...], data: st.DataObject
) -> None:
    if any(m % c for m, c in zip(mesh, shape)):
        with pytest.raises(ValueError, match="does not divide the mesh"):
            DeviceAssignment.build(Topology(mesh), shape)
        return
    blocks = math.prod(m // c for m, c in zip(mesh, shape))
    replicas = data.draw(st.integers(1, blocks))
    a = DeviceAssignment.build(Topology(mesh), shape, num_replicas=replicas)
    used = [a.tpu_ordinal(r, c) for r in range(replicas) for c in range(a.num_cores_per_replica)]
    assert len(set(used)) == len(used) == replicas * math.prod(shape)
    assert all(0 <= d < math.prod(mesh) for d in used)


@pytest.mark.parametrize(
    ("shape", "replicas", "message"),
    [
        ([1, 1, 2], 1, "4 positive sizes"),
        ([1, 1, 1, 3], 1, "does not divide the mesh"),
        ([1, 1, 1, 2], 3, "do not fit the 4 devices"),
        ([1, 1, 1, 1], 0, "do not fit the 4 devices"),
    ],
)
def test_assignments_that_cannot_be_built_say_why(
    shape: list[int], replicas: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        DeviceAssignment.build(Topology.of_devices(4), shape, num_replicas=replicas)


def test_the_tpu_resolver_is_one_local_worker_and_refuses_remote_tpus() -> None:
    resolver = ds.cluster_resolver.TPUClusterResolver()
    assert resolver.cluster_spec().as_dict() == {"worker": ["localhost"]}
    assert (resolver.task_type, resolver.task_id, resolver.master()) == ("worker", 0, "")
    assert ds.cluster_resolver.TPUClusterResolver("local").master() == ""
    with pytest.raises(ValueError, match="names a remote TPU"):
        ds.cluster_resolver.TPUClusterResolver("grpc://127.0.0.1:8470")


@pytest.mark.skipif(
    importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here"
)
def test_tpu_strategy_without_torch_xla_says_how_to_install_it() -> None:
    with pytest.raises(ValueError, match=r"needs torch_xla.*pip install torch==2\.9\.0"):
        ds.TPUStrategy()
