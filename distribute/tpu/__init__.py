"""TPU system set-up, as `tf.tpu.experimental` has it: topology and device assignment.

Example:
    >>> import distribute as ds
    >>> topology = ds.tpu.Topology.of_devices(4)   # initialize_tpu_system(resolver) on XLA
    >>> assignment = ds.tpu.DeviceAssignment.build(topology, [1, 1, 1, 2], num_replicas=2)
    >>> assignment.core_assignment.tolist()
    [[[0, 0, 0, 0], [0, 0, 0, 1]], [[0, 0, 0, 2], [0, 0, 0, 3]]]
"""

from __future__ import annotations

from typing import Any

from distribute.tpu._topology import DeviceAssignment, Topology

__all__ = ["DeviceAssignment", "Topology", "initialize_tpu_system"]


def initialize_tpu_system(cluster_resolver: Any = None) -> Topology:
    """Starts torch_xla's runtime and returns the topology of this host's XLA devices.

    Args:
        cluster_resolver: a `TPUClusterResolver` (None: the local devices).

    Returns:
        The mesh ``[1, 1, 1, n]`` of the ``n`` XLA devices torch_xla sees.

    Raises:
        InvalidArgumentError: torch_xla is not installed (the message says how).

    Example::

        resolver = ds.cluster_resolver.TPUClusterResolver()
        topology = ds.tpu.initialize_tpu_system(resolver)
    """
    from distribute.cluster_resolver.tpu import TPUClusterResolver

    resolver = cluster_resolver if cluster_resolver is not None else TPUClusterResolver()
    return Topology.of_devices(resolver.num_accelerators()["TPU"])
