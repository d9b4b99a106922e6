"""`TPUClusterResolver`: the XLA devices of this host, as tf.distribute names them."""

from __future__ import annotations

from distribute.cluster_resolver.base import ClusterResolver
from distribute.cluster_resolver.cluster_spec import ClusterSpec
from distribute.errors import InvalidArgumentError

__all__ = ["TPUClusterResolver"]

#: The names TensorFlow accepts for the TPU devices attached to this host.
_LOCAL_NAMES = (None, "", "local")


class TPUClusterResolver(ClusterResolver):
    """Resolves the TPU (or other XLA) devices that torch_xla's runtime sees here.

    One process drives every local XLA device (`PJRT_DEVICE` picks the backend:
    ``TPU``, ``CUDA``, or ``CPU`` with ``CPU_NUM_DEVICES`` simulated devices). Only
    local devices are supported: a named remote TPU (TensorFlow's gRPC TPU
    workers) has no torch_xla counterpart; launch one process per TPU host instead.

    Args:
        tpu: None, "" or "local" for the devices of this host.

    Raises:
        InvalidArgumentError: `tpu` names a remote TPU.

    Example:
        >>> import distribute as ds
        >>> resolver = ds.cluster_resolver.TPUClusterResolver()
        >>> resolver.task_type, resolver.task_id, resolver.master()
        ('worker', 0, '')
    """

    def __init__(self, tpu: str | None = None) -> None:
        if tpu not in _LOCAL_NAMES:
            raise InvalidArgumentError(
                f"TPUClusterResolver(tpu={tpu!r}) names a remote TPU, but torch_xla drives "
                "the XLA devices of its own host only; pass tpu=None (or 'local') and start "
                "one process per TPU host"
            )
        self._tpu = tpu or "local"

    def cluster_spec(self) -> ClusterSpec:
        """One local worker: ``{"worker": ["localhost"]}``."""
        return ClusterSpec({"worker": ["localhost"]})

    @property
    def task_type(self) -> str | None:
        return "worker"

    @property
    def task_id(self) -> int | None:
        return 0

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """ "" : the devices are local (TensorFlow's local TPU master is "" too)."""
        del task_type, task_id, rpc_layer
        return ""

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None
    ) -> dict[str, int]:
        """``{"TPU": n}``: the XLA devices torch_xla's runtime has here (imports it)."""
        del task_type, task_id
        from distribute.collectives import xla

        return {"TPU": xla.runtime_device_count()}

    def __repr__(self) -> str:
        return f"TPUClusterResolver(tpu={self._tpu!r})"
