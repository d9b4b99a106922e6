"""`Topology` and `DeviceAssignment`: which XLA devices each replica's logical cores use.

Pure arithmetic on a 4-axis device mesh, as TensorFlow has it (``[x, y, z, core]``).
torch_xla has no topology object on every backend, so `initialize_tpu_system` builds
one from the device count: ``n`` devices form the mesh ``[1, 1, 1, n]``, device
``k`` at coordinates ``(0, 0, 0, k)``.

A `DeviceAssignment` tiles the mesh with blocks of ``computation_shape``: each
replica takes one block, its logical cores the block's devices in row-major order.
With 4 devices and ``computation_shape=[1, 1, 1, 2]``::

    replica 0: logical core 0 -> device 0, logical core 1 -> device 1
    replica 1: logical core 0 -> device 2, logical core 1 -> device 3

Example:
    >>> from distribute.tpu import DeviceAssignment, Topology
    >>> a = DeviceAssignment.build(Topology.of_devices(4), [1, 1, 1, 2], num_replicas=2)
    >>> a.num_replicas, a.num_cores_per_replica, a.tpu_ordinal(1, 1)
    (2, 2, 3)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from distribute.errors import InvalidArgumentError

__all__ = ["DeviceAssignment", "Topology"]

_RANK = 4  # mesh axes: x, y, z, core


class Topology:
    """The device mesh: its shape and each device's coordinates.

    Args:
        mesh_shape: the mesh's size along ``[x, y, z, core]``.

    Example:
        >>> from distribute.tpu import Topology
        >>> t = Topology.of_devices(4)
        >>> t.mesh_shape, t.num_tasks, t.num_tpus_per_task
        ((1, 1, 1, 4), 1, 4)
    """

    def __init__(self, mesh_shape: Sequence[int]) -> None:
        shape = tuple(int(d) for d in mesh_shape)
        if len(shape) != _RANK or any(d < 1 for d in shape):
            raise InvalidArgumentError(
                f"a topology's mesh_shape has {_RANK} positive sizes [x, y, z, core], got "
                f"{list(mesh_shape)}"
            )
        self._mesh_shape = shape

    @classmethod
    def of_devices(cls, num_devices: int) -> Topology:
        """The mesh ``[1, 1, 1, num_devices]`` of one host's devices."""
        return cls((1, 1, 1, num_devices))

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh's size along each axis."""
        return self._mesh_shape

    @property
    def mesh_rank(self) -> int:
        """The number of mesh axes (4)."""
        return _RANK

    @property
    def num_tasks(self) -> int:
        """Hosts in the mesh (1: one process drives every device)."""
        return 1

    @property
    def num_tpus_per_task(self) -> int:
        """Devices per host."""
        return math.prod(self._mesh_shape)

    @property
    def device_coordinates(self) -> np.ndarray:
        """``[num_tasks, num_tpus_per_task, 4]``: device k's mesh coordinates."""
        coords = list(itertools.product(*(range(d) for d in self._mesh_shape)))
        return np.array(coords, dtype=np.int32).reshape(1, len(coords), _RANK)

    def ordinal(self, coordinates: Sequence[int]) -> int:
        """The device index at ``coordinates`` (row-major over the mesh)."""
        return int(np.ravel_multi_index(tuple(coordinates), self._mesh_shape))

    def __repr__(self) -> str:
        return f"Topology(mesh_shape={list(self._mesh_shape)})"


class DeviceAssignment:
    """Maps each replica's logical cores to devices of a `Topology`.

    Build one with `DeviceAssignment.build`.

    Example:
        >>> from distribute.tpu import DeviceAssignment, Topology
        >>> a = DeviceAssignment.build(Topology.of_devices(4), num_replicas=4)
        >>> a.core_assignment.shape, [a.tpu_ordinal(r) for r in range(4)]
        ((4, 1, 4), [0, 1, 2, 3])
    """

    def __init__(self, topology: Topology, core_assignment: np.ndarray) -> None:
        self._topology = topology
        self._core_assignment = np.asarray(core_assignment, dtype=np.int32)

    @staticmethod
    def build(
        topology: Topology,
        computation_shape: Sequence[int] | None = None,
        num_replicas: int = 1,
    ) -> DeviceAssignment:
        """Tiles `topology`'s mesh with `num_replicas` blocks of `computation_shape`.

        Args:
            topology: from `ds.tpu.initialize_tpu_system`.
            computation_shape: one replica's block, ``[x, y, z, core]``; default one core.
            num_replicas: how many replicas (blocks) to place.

        Raises:
            InvalidArgumentError: a shape that is not 4 positive sizes, a block that
                does not divide the mesh, or more replicas than blocks fit.
        """
        mesh = topology.mesh_shape
        shape = tuple(int(d) for d in (computation_shape or (1,) * _RANK))
        if len(shape) != _RANK or any(d < 1 for d in shape):
            raise InvalidArgumentError(
                f"computation_shape has {_RANK} positive sizes [x, y, z, core], got "
                f"{list(computation_shape or [])}"
            )
        if any(m % c for m, c in zip(mesh, shape)):
            raise InvalidArgumentError(
                f"computation_shape {list(shape)} does not divide the mesh {list(mesh)} "
                "axis by axis; pick block sizes that divide each mesh size"
            )
        blocks = [m // c for m, c in zip(mesh, shape)]
        if not 1 <= num_replicas <= math.prod(blocks):
            raise InvalidArgumentError(
                f"num_replicas={num_replicas} replicas of {math.prod(shape)} core(s) each do "
                f"not fit the {math.prod(mesh)} devices of mesh {list(mesh)} (at most "
                f"{math.prod(blocks)} replicas of computation_shape {list(shape)})"
            )
        replicas = []
        for block in itertools.islice(itertools.product(*(range(b) for b in blocks)), num_replicas):
            origin = [b * c for b, c in zip(block, shape)]
            cores = [
                [o + i for o, i in zip(origin, inner)]
                for inner in itertools.product(*(range(c) for c in shape))
            ]
            replicas.append(cores)
        return DeviceAssignment(topology, np.array(replicas, dtype=np.int32))

    @property
    def topology(self) -> Topology:
        """The topology this assignment places replicas on."""
        return self._topology

    @property
    def num_replicas(self) -> int:
        """The number of replicas."""
        return int(self._core_assignment.shape[0])

    @property
    def num_cores_per_replica(self) -> int:
        """The logical cores (devices) of each replica."""
        return int(self._core_assignment.shape[1])

    @property
    def core_assignment(self) -> np.ndarray:
        """``[num_replicas, num_cores_per_replica, 4]``: each logical core's coordinates."""
        copy: np.ndarray = self._core_assignment.copy()
        return copy

    def coordinates(self, replica: int, logical_core: int) -> tuple[int, ...]:
        """The mesh coordinates of `replica`'s `logical_core`."""
        return tuple(int(c) for c in self._core_assignment[replica, logical_core])

    def tpu_ordinal(self, replica: int = 0, logical_core: int = 0) -> int:
        """The device index of `replica`'s `logical_core`."""
        return self._topology.ordinal(self.coordinates(replica, logical_core))

    def lookup_replicas(self, task_id: int, logical_core: int) -> list[int]:
        """The replicas whose `logical_core` is on task `task_id` (every one: one host)."""
        del logical_core
        return list(range(self.num_replicas)) if task_id == 0 else []

    def __repr__(self) -> str:
        return (
            f"DeviceAssignment(num_replicas={self.num_replicas}, "
            f"num_cores_per_replica={self.num_cores_per_replica})"
        )
