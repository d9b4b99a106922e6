"""`TFConfigClusterResolver`: the cluster described by the `TF_CONFIG` variable.

`TF_CONFIG` is JSON::

    {"cluster": {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"],
                 "ps": ["p0:2222"], "evaluator": ["e0:2222"]},
     "task": {"type": "worker", "index": 1},
     "rpc_layer": "grpc", "environment": "cloud"}

Only `"cluster"` and `"task"` matter for training; `"rpc_layer"` and `"environment"`
are optional. Every job maps to a list of `"host:port"` addresses (or to an object
from task index to address, for a sparse job).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distribute import _env
from distribute.cluster_resolver.base import ClusterResolver
from distribute.cluster_resolver.cluster_spec import ClusterSpec, split_host_port
from distribute.errors import InvalidArgumentError

__all__ = ["TFConfigClusterResolver", "parse_tf_config"]

_HINT = (
    'e.g. TF_CONFIG=\'{"cluster": {"worker": ["host0:2222"]}, '
    '"task": {"type": "worker", "index": 0}}\''
)


@dataclass(frozen=True)
class TFConfig:
    """A validated `TF_CONFIG`.

    Attributes:
        cluster: the cluster (empty when `TF_CONFIG` has no `"cluster"`).
        task_type: `task.type`, or None.
        task_id: `task.index`, or None.
        rpc_layer: `"rpc_layer"`, or None.
        environment: `"environment"`, or "".
    """

    cluster: ClusterSpec
    task_type: str | None = None
    task_id: int | None = None
    rpc_layer: str | None = None
    environment: str = ""


def parse_tf_config(raw: str | None) -> TFConfig:
    """Parses and validates a `TF_CONFIG` string; None or blanks give an empty config.

    Args:
        raw: the value of `TF_CONFIG`.

    Returns:
        The validated `TFConfig`.

    Raises:
        InvalidArgumentError: malformed JSON; a `"cluster"` or `"task"` of the wrong
            shape; an address without a port; more than one chief; a task type that is
            not in the cluster; a task index out of range.

    Example:
        >>> from distribute.cluster_resolver.tfconfig import parse_tf_config
        >>> config = parse_tf_config(
        ...     '{"cluster": {"worker": ["a:2222", "b:2222"]}, '
        ...     '"task": {"type": "worker", "index": 1}}'
        ... )
        >>> config.task_type, config.task_id, config.cluster.num_tasks("worker")
        ('worker', 1, 2)
    """
    if raw is None or not raw.strip():
        return TFConfig(cluster=ClusterSpec({}))
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(
            f"TF_CONFIG must be a JSON object, but it is not valid JSON ({e}): {raw!r}; "
            f"fix the quoting, {_HINT}"
        ) from e
    if not isinstance(value, dict):
        raise InvalidArgumentError(
            f"TF_CONFIG must be a JSON object, got a JSON {type(value).__name__}: {raw!r}; {_HINT}"
        )
    cluster = _parse_cluster(value.get("cluster", {}))
    task_type, task_id = _parse_task(value.get("task", {}))
    validate_task(cluster, task_type, task_id)
    rpc_layer = value.get("rpc_layer")
    environment = value.get("environment", "")
    if rpc_layer is not None and not isinstance(rpc_layer, str):
        raise InvalidArgumentError(
            f'TF_CONFIG\'s "rpc_layer" must be a string such as "grpc", got {rpc_layer!r}'
        )
    if not isinstance(environment, str):
        raise InvalidArgumentError(
            f'TF_CONFIG\'s "environment" must be a string such as "cloud", got {environment!r}'
        )
    return TFConfig(cluster, task_type, task_id, rpc_layer or None, environment)


def _parse_cluster(cluster: Any) -> ClusterSpec:
    if not isinstance(cluster, dict):
        raise InvalidArgumentError(
            f'TF_CONFIG\'s "cluster" must be an object from job name to a list of '
            f"'host:port' addresses, got {cluster!r}; {_HINT}"
        )
    jobs: dict[str, list[str] | dict[int, str]] = {}
    for job, tasks in cluster.items():
        if isinstance(tasks, dict):
            jobs[job] = {_sparse_index(job, key): address for key, address in tasks.items()}
        elif isinstance(tasks, list):
            jobs[job] = tasks
        else:
            raise InvalidArgumentError(
                f"TF_CONFIG's cluster job {job!r} must be a list of 'host:port' addresses, "
                f"got {tasks!r}; {_HINT}"
            )
    spec = ClusterSpec(jobs)
    for job in spec.jobs:
        for index in spec.task_indices(job):
            split_host_port(spec.task_address(job, index), where=f"TF_CONFIG's {job} {index}")
    if "chief" in spec and spec.num_tasks("chief") > 1:
        raise InvalidArgumentError(
            f"TF_CONFIG's cluster may have at most one chief, got "
            f"{spec.num_tasks('chief')}: {spec.task_addresses('chief')}; make the others "
            f"workers"
        )
    return spec


def _sparse_index(job: str, key: str) -> int:
    if not key.isdigit():
        raise InvalidArgumentError(
            f"TF_CONFIG's cluster job {job!r} maps task index {key!r} to an address; task "
            f'indices must be non-negative integers such as "0"'
        )
    return int(key)


def _parse_task(task: Any) -> tuple[str | None, int | None]:
    if not isinstance(task, dict):
        raise InvalidArgumentError(
            f'TF_CONFIG\'s "task" must be an object like {{"type": "worker", '
            f'"index": 0}}, got {task!r}'
        )
    if not task:
        return None, None
    task_type = task.get("type")
    index = task.get("index")
    if not isinstance(task_type, str) or not task_type:
        raise InvalidArgumentError(
            f'TF_CONFIG\'s task "type" must be a job name such as "worker", got '
            f"{task_type!r} in {task!r}"
        )
    if isinstance(index, str) and index.isdigit():
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise InvalidArgumentError(
            f'TF_CONFIG\'s task "index" must be a non-negative integer, got {index!r} in '
            f'{task!r}; e.g. {{"type": "{task_type}", "index": 0}}'
        )
    return task_type, index


def validate_task(cluster: ClusterSpec, task_type: str | None, task_id: int | None) -> None:
    """Checks that task (`task_type`, `task_id`) is in `cluster`.

    An evaluator may be missing from the cluster (as in tf.distribute), with index 0.

    Raises:
        InvalidArgumentError: the task type is not a job of the cluster, or the index is
            not one of its task indices.
    """
    if task_type is None:
        return
    if task_type not in cluster:
        if task_type == "evaluator" and task_id in (None, 0):
            return
        raise InvalidArgumentError(
            f"task type {task_type!r} is not in the cluster, whose jobs are "
            f"{cluster.jobs}; add {task_type!r} to the cluster or use one of those jobs"
        )
    if task_id is not None and task_id not in cluster.task_indices(task_type):
        raise InvalidArgumentError(
            f"task index {task_id} is out of range for job {task_type!r}, which has "
            f"task indices {cluster.task_indices(task_type)}; use one of those"
        )


class TFConfigClusterResolver(ClusterResolver):
    """Resolves the cluster from `TF_CONFIG`, re-reading it on every call.

    Rank: the chief is 0; worker i is `i + 1` when there is a chief, else `i`. The
    rendezvous address is the chief's (else worker 0's) `host:port`. Local rank counts
    the training tasks listed with the same host.

    Args:
        task_type: overrides `TF_CONFIG`'s task type.
        task_id: overrides `TF_CONFIG`'s task index.
        rpc_layer: overrides `TF_CONFIG`'s `"rpc_layer"`.
        environment: overrides `TF_CONFIG`'s `"environment"`.
        environ: where to read `TF_CONFIG`; None reads the process environment (through
            `distribute._env`). A mutable mapping is re-read on every call too.

    Raises:
        InvalidArgumentError: from any accessor, when `TF_CONFIG` is malformed (see
            `parse_tf_config`) or the task is not in the cluster.

    Example:
        >>> from distribute.cluster_resolver import TFConfigClusterResolver
        >>> tf_config = (
        ...     '{"cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]}, '
        ...     '"task": {"type": "worker", "index": 1}}'
        ... )
        >>> resolver = TFConfigClusterResolver(environ={"TF_CONFIG": tf_config})
        >>> resolver.task_type, resolver.task_id, resolver.rank, resolver.world_size
        ('worker', 1, 2, 3)
        >>> resolver.master_addr, resolver.master_port, resolver.master()
        ('c', 2222, 'w1:2222')
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if task_id is not None and (isinstance(task_id, bool) or not isinstance(task_id, int)):
            raise InvalidArgumentError(
                f"task_id must be an int or None, got {task_id!r}; pass e.g. task_id=0"
            )
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment
        self._environ = environ

    def _config(self) -> TFConfig:
        config = parse_tf_config(_env.read_environment(self._environ).tf_config)
        if self._task_type is not None or self._task_id is not None:
            validate_task(config.cluster, *self._task_of(config))
        return config

    def _task_of(self, config: TFConfig) -> tuple[str | None, int | None]:
        task_type = self._task_type if self._task_type is not None else config.task_type
        task_id = self._task_id if self._task_id is not None else config.task_id
        return task_type, task_id

    def _snapshot(self) -> tuple[ClusterSpec, str | None, int | None]:
        config = self._config()
        return (config.cluster, *self._task_of(config))

    def cluster_spec(self) -> ClusterSpec:
        """The cluster in `TF_CONFIG` (empty when it has none)."""
        return self._config().cluster

    @property
    def task_type(self) -> str | None:
        """This task's type: the override, else `TF_CONFIG`'s `task.type`."""
        return self._task_of(self._config())[0]

    @property
    def task_id(self) -> int | None:
        """This task's index: the override, else `TF_CONFIG`'s `task.index`."""
        return self._task_of(self._config())[1]

    @property
    def rpc_layer(self) -> str | None:
        """The override, else `TF_CONFIG`'s `"rpc_layer"`, else None."""
        return self._rpc_layer if self._rpc_layer is not None else self._config().rpc_layer

    @property
    def environment(self) -> str:
        """The override, else `TF_CONFIG`'s `"environment"`, else ""."""
        return self._environment if self._environment is not None else self._config().environment
