"""`SimpleClusterResolver`: a cluster given directly, as a `ClusterSpec`."""

from __future__ import annotations

from distribute.cluster_resolver.base import ClusterResolver, format_master_url
from distribute.cluster_resolver.cluster_spec import ClusterSpec, ClusterSpecLike
from distribute.errors import InvalidArgumentError

__all__ = ["SimpleClusterResolver"]


class SimpleClusterResolver(ClusterResolver):
    """Resolves a cluster given as a `ClusterSpec` (or a dict) and a task.

    Rank, world size and rendezvous address follow the same rule as `TF_CONFIG`: the
    chief is rank 0, then the workers by index; the rendezvous is rank 0's address.

    Args:
        cluster_spec: the cluster, a `ClusterSpec` or a dict `ClusterSpec` accepts.
        master: what `master()` returns when asked for no particular task.
        task_type: this process's job.
        task_id: this process's index in its job.
        environment: the environment the cluster runs in (e.g. "cloud").
        num_accelerators: accelerators per task by type, e.g. `{"GPU": 2}`; None
            counts this process's CUDA devices.
        rpc_layer: the protocol prefixed to `master()` addresses, e.g. "grpc".

    Raises:
        InvalidArgumentError: a malformed cluster, a `task_id` that is not an int, or
            negative accelerator counts.

    Example:
        >>> from distribute.cluster_resolver import SimpleClusterResolver
        >>> resolver = SimpleClusterResolver(
        ...     {"worker": ["w0:2222", "w1:2222"]}, task_type="worker", task_id=1,
        ...     num_accelerators={"GPU": 2})
        >>> resolver.rank, resolver.world_size, resolver.master_addr, resolver.master_port
        (1, 2, 'w0', 2222)
        >>> resolver.master(), resolver.master("worker", 0, rpc_layer="grpc")
        ('', 'grpc://w0:2222')
    """

    def __init__(
        self,
        cluster_spec: ClusterSpecLike,
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: dict[str, int] | None = None,
        rpc_layer: str | None = None,
    ) -> None:
        if task_id is not None and (isinstance(task_id, bool) or not isinstance(task_id, int)):
            raise InvalidArgumentError(
                f"task_id must be an int or None, got {task_id!r}; pass e.g. task_id=0"
            )
        if num_accelerators is not None and any(n < 0 for n in num_accelerators.values()):
            raise InvalidArgumentError(
                f"num_accelerators must map device types to counts >= 0, got "
                f"{num_accelerators}; pass e.g. {{'GPU': 2}}"
            )
        self._cluster_spec = ClusterSpec(cluster_spec)
        self._master = master
        self._task_type = task_type
        self._task_id = task_id
        self._environment = environment
        self._num_accelerators = None if num_accelerators is None else dict(num_accelerators)
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """The cluster given to the constructor."""
        return self._cluster_spec

    @property
    def task_type(self) -> str | None:
        """The task type given to the constructor."""
        return self._task_type

    @property
    def task_id(self) -> int | None:
        """The task index given to the constructor."""
        return self._task_id

    @property
    def rpc_layer(self) -> str | None:
        """The rpc layer given to the constructor."""
        return self._rpc_layer

    @property
    def environment(self) -> str:
        """The environment given to the constructor."""
        return self._environment

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of task (`task_type`, `task_id`) when both are given, else the
        constructor's `master`; prefixed with `"{rpc_layer}://"` when one is set.

        Raises:
            InvalidArgumentError: the task is not in the cluster.
        """
        if task_type is not None and task_id is not None:
            address = self._cluster_spec.task_address(task_type, task_id)
        else:
            address = self._master
        return format_master_url(address, rpc_layer or self._rpc_layer) if address else ""

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None
    ) -> dict[str, int]:
        """The constructor's `num_accelerators`, else `{"GPU": torch.cuda.device_count()}`."""
        if self._num_accelerators is None:
            return super().num_accelerators(task_type, task_id)
        return dict(self._num_accelerators)
