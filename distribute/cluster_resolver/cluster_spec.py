"""`ClusterSpec`: the jobs of a cluster and the address of each of their tasks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TypeAlias

from distribute.errors import InvalidArgumentError

__all__ = ["ClusterSpec", "ClusterSpecLike", "split_host_port"]

#: What `ClusterSpec` accepts: a `ClusterSpec`, or a mapping from job name to a list
#: of addresses (dense, task i at position i) or to a `{task index: address}` mapping
#: (sparse).
ClusterSpecLike: TypeAlias = "ClusterSpec | Mapping[str, Sequence[str] | Mapping[int, str]]"


class ClusterSpec:
    """The jobs of a cluster (`"chief"`, `"worker"`, `"ps"`, ...) and their tasks.

    Like `tf.train.ClusterSpec`: each job maps task indices to `"host:port"`
    addresses. A job given as a list is dense (task i is at position i); a job given
    as a `{index: address}` mapping may be sparse.

    Args:
        cluster: a mapping from job name to a list of addresses or to a mapping from
            task index to address, or another `ClusterSpec` (copied).

    Raises:
        InvalidArgumentError: a job name that is not a non-empty string, an address
            that is not a string, or a task index that is not a non-negative int.

    Example:
        >>> from distribute.cluster_resolver import ClusterSpec
        >>> spec = ClusterSpec({"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"]})
        >>> spec.jobs, spec.num_tasks("worker"), spec.task_address("worker", 1)
        (['chief', 'worker'], 2, 'w1:2222')
    """

    def __init__(self, cluster: ClusterSpecLike) -> None:
        if isinstance(cluster, ClusterSpec):
            self._jobs: dict[str, dict[int, str]] = {
                job: dict(tasks) for job, tasks in cluster._jobs.items()
            }
            return
        if not isinstance(cluster, Mapping):
            raise InvalidArgumentError(
                f"ClusterSpec expects a dict from job name to a list of 'host:port' "
                f"addresses, got {type(cluster).__name__}; pass e.g. "
                f"{{'worker': ['host0:2222', 'host1:2222']}}"
            )
        self._jobs = {}
        for job, tasks in cluster.items():
            if not isinstance(job, str) or not job:
                raise InvalidArgumentError(
                    f"ClusterSpec job names must be non-empty strings, got {job!r}; "
                    f"name jobs like 'chief', 'worker' or 'ps'"
                )
            self._jobs[job] = _job_tasks(job, tasks)

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return sorted(self._jobs)

    def num_tasks(self, job: str) -> int:
        """The number of tasks in `job`.

        Raises:
            InvalidArgumentError: `job` is not in the cluster.
        """
        return len(self._tasks(job))

    def task_indices(self, job: str) -> list[int]:
        """The task indices of `job`, ascending (0..n-1 for a dense job).

        Raises:
            InvalidArgumentError: `job` is not in the cluster.
        """
        return sorted(self._tasks(job))

    def task_addresses(self, job: str) -> list[str]:
        """The addresses of the tasks of `job`, in task index order.

        Raises:
            InvalidArgumentError: `job` is not in the cluster.
        """
        tasks = self._tasks(job)
        return [tasks[index] for index in sorted(tasks)]

    def task_address(self, job: str, index: int) -> str:
        """The address of task `index` of `job`.

        Raises:
            InvalidArgumentError: `job` is not in the cluster, or has no task `index`.
        """
        tasks = self._tasks(job)
        if index not in tasks:
            raise InvalidArgumentError(
                f"job {job!r} has no task {index}; its task indices are "
                f"{sorted(tasks)}; use one of those"
            )
        return tasks[index]

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """The cluster as a dict: a list per dense job, an `{index: address}` dict
        per sparse one (the form `ClusterSpec` and `TF_CONFIG` accept)."""
        result: dict[str, list[str] | dict[int, str]] = {}
        for job in self.jobs:
            tasks = self._jobs[job]
            if sorted(tasks) == list(range(len(tasks))):
                result[job] = [tasks[index] for index in range(len(tasks))]
            else:
                result[job] = {index: tasks[index] for index in sorted(tasks)}
        return result

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self._jobs == other._jobs

    __hash__ = None  # type: ignore[assignment]  # mutable-looking value type: unhashable

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __iter__(self) -> Iterator[str]:
        return iter(self.jobs)

    def __contains__(self, job: object) -> bool:
        return job in self._jobs

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"

    def _tasks(self, job: str) -> dict[int, str]:
        if job not in self._jobs:
            raise InvalidArgumentError(
                f"the cluster has no job {job!r}; its jobs are {self.jobs}; use one of "
                f"those or add {job!r} to the cluster"
            )
        return self._jobs[job]


def _job_tasks(job: str, tasks: object) -> dict[int, str]:
    """Validates one job's tasks and returns them as `{index: address}`."""
    if isinstance(tasks, Mapping):
        items = list(tasks.items())
    elif isinstance(tasks, Sequence) and not isinstance(tasks, str):
        items = list(enumerate(tasks))
    else:
        raise InvalidArgumentError(
            f"job {job!r} must map to a list of 'host:port' addresses or a dict from "
            f"task index to address, got {tasks!r}; pass e.g. ['host0:2222']"
        )
    result: dict[int, str] = {}
    for index, address in items:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise InvalidArgumentError(
                f"job {job!r} has task index {index!r}; task indices must be non-negative ints"
            )
        if not isinstance(address, str):
            raise InvalidArgumentError(
                f"task {index} of job {job!r} has address {address!r}; addresses must "
                f"be strings like 'host:2222'"
            )
        result[index] = address
    return result


def split_host_port(address: str, *, where: str = "the address") -> tuple[str, int]:
    """Splits `"host:port"` (or `"[v6 addr]:port"`) into host and int port.

    Args:
        address: the address to split.
        where: what the address is, for the error message (e.g. "TF_CONFIG worker 1").

    Returns:
        `(host, port)`; an IPv6 host is returned without its brackets.

    Raises:
        InvalidArgumentError: no port, a port that is not an int in 1..65535, an empty
            host, or an IPv6 address without brackets.

    Example:
        >>> from distribute.cluster_resolver.cluster_spec import split_host_port
        >>> split_host_port("10.0.0.1:2222"), split_host_port("[::1]:2222")
        (('10.0.0.1', 2222), ('::1', 2222))
    """
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an unbracketed IPv6 address: reject below
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        hint = f"add the port, e.g. '{address}:2222'" if not sep else "fix the host or port"
        raise InvalidArgumentError(
            f"{where} must be 'host:port' with a port in 1..65535 (IPv6 as '[addr]:port'), "
            f"got {address!r}; {hint}"
        )
    return host, int(port_text)
