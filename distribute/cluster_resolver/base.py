"""`ClusterResolver`: who is in the cluster, who this process is, where to rendezvous.

Glossary:

- **task**: one process of the cluster, named by a job (`task_type`: `"chief"`,
  `"worker"`, `"ps"`, `"evaluator"`) and an index in that job (`task_id`).
- **training tasks**: the chief and the workers, the processes that train in
  lockstep. ps and evaluator tasks are not among them.
- **rank**: a training task's position among the training tasks, the chief first
  (rank 0), then the workers by index. `world_size` is the number of training tasks.
- **rendezvous address**: `master_addr:master_port`, the address of rank 0 (the chief,
  else worker 0), where a `torch.distributed.TCPStore` can be served.
- **local rank**: a training task's position among the training tasks on its host;
  `local_world_size` is how many there are.

The arithmetic is pure functions of a `ClusterSpec` and a task (`training_tasks`,
`training_rank`, `rendezvous_address`, `local_placement`), so every resolver that can
produce a spec shares it without subclassing another resolver.
"""

from __future__ import annotations

import abc

import torch

from distribute.cluster_resolver.cluster_spec import ClusterSpec, split_host_port
from distribute.errors import InvalidArgumentError

__all__ = [
    "TRAINING_JOBS",
    "ClusterResolver",
    "format_master_url",
    "local_placement",
    "rendezvous_address",
    "training_rank",
    "training_tasks",
    "training_world_size",
]

#: The jobs whose tasks train synchronously, in rank order.
TRAINING_JOBS = ("chief", "worker")


def format_master_url(address: str, rpc_layer: str | None = None) -> str:
    """`address` prefixed with `"{rpc_layer}://"` when an rpc layer is given.

    Example:
        >>> from distribute.cluster_resolver.base import format_master_url
        >>> format_master_url("w0:2222", "grpc"), format_master_url("w0:2222")
        ('grpc://w0:2222', 'w0:2222')
    """
    return f"{rpc_layer}://{address}" if rpc_layer else address


def training_tasks(spec: ClusterSpec) -> list[tuple[str, int]]:
    """The training tasks of `spec` in rank order: chief tasks, then workers by index.

    Example:
        >>> from distribute.cluster_resolver import ClusterSpec
        >>> from distribute.cluster_resolver.base import training_tasks
        >>> training_tasks(ClusterSpec({"ps": ["p:1"], "worker": ["a:1", "b:1"], "chief": ["c:1"]}))
        [('chief', 0), ('worker', 0), ('worker', 1)]
    """
    return [
        (job, index) for job in TRAINING_JOBS if job in spec for index in spec.task_indices(job)
    ]


def training_rank(spec: ClusterSpec, task_type: str | None, task_id: int | None) -> int:
    """The rank of task (`task_type`, `task_id`) among the training tasks of `spec`.

    An empty `spec` with no task is a single local worker: rank 0.

    Raises:
        InvalidArgumentError: the task is unknown, is not a chief or worker task, or is
            not in `spec`.

    Example:
        >>> from distribute.cluster_resolver import ClusterSpec
        >>> from distribute.cluster_resolver.base import training_rank
        >>> spec = ClusterSpec({"chief": ["c:1"], "worker": ["a:1", "b:1"]})
        >>> training_rank(spec, "chief", 0), training_rank(spec, "worker", 1)
        (0, 2)
    """
    if task_type is None and task_id is None and not spec:
        return 0
    if task_type is None or task_id is None:
        raise InvalidArgumentError(
            f"this process's task is unknown (task_type={task_type!r}, task_id={task_id!r}) "
            f"in cluster {spec.as_dict()}; name it, e.g. TF_CONFIG's "
            f'"task": {{"type": "worker", "index": 0}} or the resolver\'s task_type/task_id'
        )
    if task_type not in TRAINING_JOBS:
        raise InvalidArgumentError(
            f"rank is defined for chief and worker tasks only, but this task is "
            f"{task_type!r} {task_id}; {task_type} tasks do not join synchronous training"
        )
    ranks = {task: rank for rank, task in enumerate(training_tasks(spec))}
    if (task_type, task_id) not in ranks:
        spec.task_address(task_type, task_id)  # raises a message naming the job's tasks
    return ranks[(task_type, task_id)]


def training_world_size(spec: ClusterSpec) -> int:
    """The number of training tasks in `spec`; 1 for an empty spec (a single worker).

    Example:
        >>> from distribute.cluster_resolver import ClusterSpec
        >>> from distribute.cluster_resolver.base import training_world_size
        >>> training_world_size(ClusterSpec({"chief": ["c:1"], "worker": ["a:1"], "ps": ["p:1"]}))
        2
    """
    return len(training_tasks(spec)) if spec else 1


def rendezvous_address(spec: ClusterSpec) -> tuple[str, int]:
    """The host and port of rank 0 (the chief, else the first worker) in `spec`.

    Raises:
        InvalidArgumentError: `spec` has no chief or worker task, or rank 0's address
            is not `"host:port"`.

    Example:
        >>> from distribute.cluster_resolver import ClusterSpec
        >>> from distribute.cluster_resolver.base import rendezvous_address
        >>> rendezvous_address(ClusterSpec({"worker": ["a:2222", "b:2222"]}))
        ('a', 2222)
    """
    tasks = training_tasks(spec)
    if not tasks:
        raise InvalidArgumentError(
            f"the cluster {spec.as_dict()} has no chief or worker task, so there is no "
            f"rendezvous address; add a 'chief' or 'worker' job (a single local worker "
            f"needs no rendezvous: check world_size > 1 first)"
        )
    job, index = tasks[0]
    return split_host_port(spec.task_address(job, index), where=f"the address of {job} {index}")


def local_placement(
    spec: ClusterSpec, task_type: str | None, task_id: int | None
) -> tuple[int, int]:
    """`(local_rank, local_world_size)` of a task: its position among the training
    tasks whose address has the same host, and how many there are.

    Hosts are compared as written (`"localhost"` and `"127.0.0.1"` differ). A task
    that is not a training task of `spec` (or an unknown one) gets `(0, 1)`.

    Example:
        >>> from distribute.cluster_resolver import ClusterSpec
        >>> from distribute.cluster_resolver.base import local_placement
        >>> spec = ClusterSpec({"worker": ["a:1", "b:1", "a:2"]})
        >>> local_placement(spec, "worker", 2), local_placement(spec, "worker", 1)
        ((1, 2), (0, 1))
    """
    tasks = training_tasks(spec)
    if task_type is None or task_id is None or (task_type, task_id) not in tasks:
        return 0, 1
    hosts = [_host(spec.task_address(job, index)) for job, index in tasks]
    own = tasks.index((task_type, task_id))
    same_host = [i for i, host in enumerate(hosts) if host == hosts[own]]
    return same_host.index(own), len(same_host)


def _host(address: str) -> str:
    host, sep, _ = address.rpartition(":")
    return host if sep else address


class ClusterResolver(abc.ABC):
    """Base class of cluster resolvers: the cluster, this task, and the rendezvous.

    Subclasses provide `cluster_spec()`, `task_type` and `task_id`; the rank, world
    size, rendezvous address and local placement follow from them (chief first, then
    workers; see the module docstring), and subclasses that know better (torchrun,
    SLURM) override them.

    Example:
        >>> from distribute.cluster_resolver import SimpleClusterResolver, ClusterSpec
        >>> spec = ClusterSpec({"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]})
        >>> resolver = SimpleClusterResolver(spec, task_type="worker", task_id=1)
        >>> resolver.rank, resolver.world_size, resolver.master_addr, resolver.master_port
        (2, 3, 'c', 2222)
    """

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The cluster: every job and the address of each of its tasks."""

    @property
    @abc.abstractmethod
    def task_type(self) -> str | None:
        """This process's job (`"chief"`, `"worker"`, ...), or None when unknown."""

    @property
    @abc.abstractmethod
    def task_id(self) -> int | None:
        """This process's index in its job, or None when unknown."""

    @property
    def rpc_layer(self) -> str | None:
        """The protocol prefixed to `master()` addresses (e.g. `"grpc"`), or None."""
        return None

    @property
    def environment(self) -> str:
        """The environment the cluster runs in (TF_CONFIG's `"environment"`), or ""."""
        return ""

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of a task, `"{rpc_layer}://host:port"` when an rpc layer is set.

        Args:
            task_type: the task's job; defaults to this process's.
            task_id: the task's index; defaults to this process's.
            rpc_layer: overrides `self.rpc_layer`.

        Returns:
            The address, or "" when the task is unknown.

        Raises:
            InvalidArgumentError: the task is not in the cluster.
        """
        spec, own_type, own_id = self._snapshot()
        task_type = own_type if task_type is None else task_type
        task_id = own_id if task_id is None else task_id
        if task_type is None or task_id is None:
            return ""
        address = spec.task_address(task_type, task_id)
        return format_master_url(address, rpc_layer or self.rpc_layer)

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None
    ) -> dict[str, int]:
        """Accelerators per task by type: `{"GPU": torch.cuda.device_count()}`.

        `task_type` and `task_id` are accepted for tf.distribute compatibility; every
        task is assumed to see the same devices as this process.
        """
        del task_type, task_id
        return {"GPU": torch.cuda.device_count()}

    def _snapshot(self) -> tuple[ClusterSpec, str | None, int | None]:
        """`(cluster_spec(), task_type, task_id)` read together; resolvers that re-read
        their source override it to read once per call."""
        return self.cluster_spec(), self.task_type, self.task_id

    @property
    def rank(self) -> int:
        """This process's rank among the training tasks (chief 0, then workers).

        Raises:
            InvalidArgumentError: this task is unknown, or is a ps or evaluator task.
        """
        return training_rank(*self._snapshot())

    @property
    def world_size(self) -> int:
        """The number of training tasks (chief + workers); 1 for an empty cluster."""
        return training_world_size(self.cluster_spec())

    @property
    def master_addr(self) -> str:
        """The rendezvous host: rank 0's (the chief's, else worker 0's).

        Raises:
            InvalidArgumentError: the cluster has no chief or worker task.
        """
        return rendezvous_address(self.cluster_spec())[0]

    @property
    def master_port(self) -> int:
        """The rendezvous port: rank 0's.

        Raises:
            InvalidArgumentError: the cluster has no chief or worker task.
        """
        return rendezvous_address(self.cluster_spec())[1]

    @property
    def rendezvous_prefix(self) -> str:
        """A key prefix for this attempt of the job in the rendezvous store ("" here).

        Launchers that keep one store across restarts (torchrun's agent) need every
        attempt's keys apart, or restarted workers read the dead attempt's.
        """
        return ""

    @property
    def launcher_serves_rendezvous(self) -> bool:
        """Whether the launcher already serves the rendezvous store at
        `master_addr:master_port` (then rank 0 joins it instead of serving one)."""
        return False

    @property
    def local_rank(self) -> int:
        """This process's rank among the training tasks on its host; 0 when unknown."""
        return local_placement(*self._snapshot())[0]

    @property
    def local_world_size(self) -> int:
        """The number of training tasks on this process's host; 1 when unknown."""
        return local_placement(*self._snapshot())[1]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(task_type={self.task_type!r}, task_id={self.task_id!r})"
