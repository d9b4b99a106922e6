"""`SlurmClusterResolver`: the cluster of a SLURM job step.

SLURM describes a step with compressed lists, which `expand_hostlist` and
`expand_tasks_per_node` expand (pure functions)::

    SLURM_STEP_NODELIST="n[1-2],m5"        -> ["n1", "n2", "m5"]
    SLURM_STEP_TASKS_PER_NODE="3(x2),2"    -> [3, 3, 2]

Hosts are sorted in natural order (`n2` before `n10`, SLURM's own order, so that the
consecutive `SLURM_PROCID`s of a host's tasks line up with it); the tasks on a host get
ports `port_base`, `port_base + 1`, ...; the tasks are then dealt to the jobs in sorted
job-name order.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

import torch

from distribute import _env
from distribute.cluster_resolver.base import ClusterResolver
from distribute.cluster_resolver.cluster_spec import ClusterSpec
from distribute.errors import InvalidArgumentError

__all__ = ["SlurmClusterResolver", "expand_hostlist", "expand_tasks_per_node"]

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a SLURM host list into host names, in the order written.

    Items are separated by commas outside brackets; an item is text with any number
    of `[...]` groups, each a comma list of numbers and `lo-hi` ranges. Numbers keep
    the zero padding of the range's lower bound; several groups expand as a product.

    Args:
        hostlist: e.g. `"n[1-2],m5"` or `"node[001-003]"` or `"a[1,3-4]b[1-2]"`.

    Returns:
        The host names, e.g. `["n1", "n2", "m5"]`.

    Raises:
        InvalidArgumentError: an empty list or item, unbalanced or nested brackets, an
            empty group, a non-numeric group entry, or a range whose end is below its
            start.

    Example:
        >>> from distribute.cluster_resolver import expand_hostlist
        >>> expand_hostlist("n[1-2],m5"), expand_hostlist("node[008-010]")
        (['n1', 'n2', 'm5'], ['node008', 'node009', 'node010'])
        >>> expand_hostlist("a[1,3]b[1-2]")
        ['a1b1', 'a1b2', 'a3b1', 'a3b2']
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist):
        parts: list[list[str]] = []
        pos = 0
        while (start := item.find("[", pos)) != -1:
            end = item.index("]", start)  # brackets balance: _split_top_level checked
            parts.append([item[pos:start]])
            parts.append(_expand_group(item[start + 1 : end], hostlist))
            pos = end + 1
        parts.append([item[pos:]])
        hosts.extend("".join(names) for names in itertools.product(*parts))
    return hosts


def _split_top_level(hostlist: str) -> list[str]:
    """Splits at commas outside brackets, checking that brackets balance."""
    items: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(hostlist):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
        if depth not in (0, 1):
            break
    items.append(hostlist[start:])
    if depth != 0 or any(not item.strip() for item in items):
        raise InvalidArgumentError(
            f"SLURM host list must be comma-separated names with balanced, unnested "
            f"[...] groups, got {hostlist!r}; e.g. 'node[1-3,7],login1'"
        )
    return [item.strip() for item in items]


def _expand_group(group: str, hostlist: str) -> list[str]:
    """Expands the inside of one `[...]` group: `"1,3-4"` -> `["1", "3", "4"]`."""
    names: list[str] = []
    for entry in group.split(","):
        match = _RANGE.fullmatch(entry.strip())
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise InvalidArgumentError(
                f"SLURM host list group [{group}] must be numbers and increasing 'lo-hi' "
                f"ranges separated by commas, got entry {entry!r} in {hostlist!r}; "
                f"e.g. 'node[1-3,7]'"
            )
        low, high = match[1], match[2] if match[2] is not None else match[1]
        names.extend(f"{i:0{len(low)}d}" for i in range(int(low), int(high) + 1))
    return names


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expands SLURM's tasks-per-node list: `"3(x2),2"` -> `[3, 3, 2]`.

    Args:
        tasks_per_node: comma-separated `count` or `count(xrepeat)` items.

    Returns:
        The number of tasks on each node, in node list order.

    Raises:
        InvalidArgumentError: an item that is not `count` or `count(xrepeat)` with
            `repeat >= 1`.

    Example:
        >>> from distribute.cluster_resolver import expand_tasks_per_node
        >>> expand_tasks_per_node("3(x2),2")
        [3, 3, 2]
    """
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = _TASKS.fullmatch(item.strip())
        if match is None or (match[2] is not None and int(match[2]) < 1):
            raise InvalidArgumentError(
                f"SLURM tasks-per-node list must be comma-separated 'count' or "
                f"'count(xrepeat)' items, got item {item!r} in {tasks_per_node!r}; "
                f"e.g. '3(x2),2'"
            )
        counts.extend([int(match[1])] * (1 if match[2] is None else int(match[2])))
    return counts


def _natural_key(host: str) -> list[tuple[int, int | str]]:
    """Sorts `n2` before `n10`: digit runs compare as numbers."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", host)]


class SlurmClusterResolver(ClusterResolver):
    """Resolves the cluster of the SLURM job step this process is a task of.

    Reads `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`, `SLURM_STEP_NODELIST`,
    `SLURM_STEP_TASKS_PER_NODE` and `SLURM_LOCALID` (with `_env`'s fallbacks) once, at
    construction. Task addresses are `host:port` with `port = port_base + the task's
    index on its host`, hosts in natural sorted order. The tasks, in that order, are
    dealt to `jobs` by sorted job name; with the default `jobs` (`{"worker": number
    of tasks}`) worker i is `SLURM_PROCID` i and `rank == SLURM_PROCID`.

    This resolver never writes `CUDA_VISIBLE_DEVICES` (tf.distribute's does);
    `gpu_ids` names the GPUs allocated to this task, and `auto_set_gpu=True` calls
    `torch.cuda.set_device` on the first of them.

    Args:
        jobs: the number of tasks of each job, e.g. `{"chief": 1, "worker": 3}`; must
            add up to the number of tasks. Defaults to all tasks being workers.
        port_base: the port of the first task on each host.
        gpus_per_node: GPUs on each host; defaults to `torch.cuda.device_count()`.
        gpus_per_task: GPUs per task; defaults to `gpus_per_node // most tasks on a host`.
        tasks_per_node: tasks on every host (an int) or per host name (a dict);
            defaults to `SLURM_STEP_TASKS_PER_NODE`.
        auto_set_gpu: pin this process to its first GPU with `torch.cuda.set_device`.
        rpc_layer: the protocol prefixed to `master()` addresses, e.g. "grpc".
        environ: the variables to read; None reads the process environment.

    Raises:
        InvalidArgumentError: a SLURM variable is missing (the message names it) or
            malformed; the host list and tasks-per-node list differ in length; the
            tasks do not add up to the number of tasks; `jobs` does not add up to it;
            more GPUs are requested per host than it has; a port beyond 65535.

    Example:
        >>> from distribute.cluster_resolver import SlurmClusterResolver
        >>> resolver = SlurmClusterResolver(environ={
        ...     "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4",
        ...     "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
        >>> resolver.cluster_spec().task_addresses("worker")
        ['n1:8888', 'n1:8889', 'n2:8888', 'n2:8889']
        >>> resolver.rank, resolver.world_size, resolver.local_rank, resolver.master()
        (3, 4, 1, 'n2:8889')
        >>> resolver.master_addr, resolver.master_port
        ('n1', 8888)
    """

    def __init__(
        self,
        jobs: Mapping[str, int] | None = None,
        port_base: int = 8888,
        gpus_per_node: int | None = None,
        gpus_per_task: int | None = None,
        tasks_per_node: int | Mapping[str, int] | None = None,
        auto_set_gpu: bool = False,
        rpc_layer: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = _env.read_environment(environ)
        procid, num_tasks, nodelist = env.slurm_procid, env.slurm_num_tasks, env.slurm_nodelist
        tasks_text = env.slurm_tasks_per_node
        if (
            procid is None
            or num_tasks is None
            or nodelist is None
            or (tasks_per_node is None and tasks_text is None)
        ):
            required = {
                "SLURM_PROCID": procid,
                "SLURM_STEP_NUM_TASKS (or SLURM_NTASKS)": num_tasks,
                "SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST)": nodelist,
                "SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE)": (
                    tasks_text if tasks_per_node is None else tasks_per_node
                ),
            }
            missing = [name for name, value in required.items() if value is None]
            raise InvalidArgumentError(
                f"SlurmClusterResolver needs the variables of a SLURM job step, but "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} unset; run "
                f"the script with srun inside an allocation"
            )
        hosts = expand_hostlist(nodelist)
        counts = _tasks_per_host(hosts, tasks_per_node, tasks_text)
        if len(set(hosts)) != len(hosts):
            raise InvalidArgumentError(
                f"SLURM node list {nodelist!r} names a host more than once: {hosts}; each "
                f"node must appear once"
            )
        if sum(counts) != num_tasks or procid >= num_tasks:
            raise InvalidArgumentError(
                f"SLURM variables disagree: {sum(counts)} tasks on the nodes "
                f"({dict(zip(hosts, counts, strict=True))}), SLURM_STEP_NUM_TASKS={num_tasks}, "
                f"SLURM_PROCID={procid}; expected the counts to add up to the number of "
                f"tasks and SLURM_PROCID below it (check tasks_per_node)"
            )
        placement = sorted(zip(hosts, counts, strict=True), key=lambda pair: _natural_key(pair[0]))
        most = max(counts)
        if not 1 <= port_base <= 65536 - most:
            raise InvalidArgumentError(
                f"port_base must leave room for {most} ports per host below 65536, got "
                f"{port_base}; pick a port_base in 1..{65536 - most}"
            )
        self._jobs = _validate_jobs(jobs, num_tasks)
        gpus_per_node = torch.cuda.device_count() if gpus_per_node is None else gpus_per_node
        gpus_per_task = gpus_per_node // most if gpus_per_task is None else gpus_per_task
        if gpus_per_node < 0 or gpus_per_task < 0 or gpus_per_task * most > gpus_per_node:
            raise InvalidArgumentError(
                f"{most} tasks per host x gpus_per_task={gpus_per_task} GPUs must fit in "
                f"gpus_per_node={gpus_per_node}; lower gpus_per_task or tasks per node"
            )

        addresses: list[str] = []
        self._gpu_allocation: list[list[int]] = []
        self._host_of: list[tuple[int, int]] = []  # (local index, tasks on host) per task
        for host, count in placement:
            for local in range(count):
                addresses.append(f"{host}:{port_base + local}")
                self._gpu_allocation.append(
                    list(range(local * gpus_per_task, (local + 1) * gpus_per_task))
                )
                self._host_of.append((local, count))
        cluster: dict[str, list[str]] = {}
        start = 0
        for job in sorted(self._jobs):
            cluster[job] = addresses[start : start + self._jobs[job]]
            if start <= procid < start + self._jobs[job]:
                self._task_type, self._task_id = job, procid - start
            start += self._jobs[job]
        self._cluster_spec = ClusterSpec(cluster)
        self._procid = procid
        self._localid = env.slurm_localid
        self._gpus_per_task = gpus_per_task
        self._rpc_layer = rpc_layer
        if auto_set_gpu and self.gpu_ids and torch.cuda.is_available():
            torch.cuda.set_device(self.gpu_ids[0])

    def cluster_spec(self) -> ClusterSpec:
        """The step's tasks as `host:port` addresses, dealt to the jobs."""
        return self._cluster_spec

    @property
    def task_type(self) -> str:
        """The job `SLURM_PROCID` falls in."""
        return self._task_type

    @property
    def task_id(self) -> int:
        """`SLURM_PROCID`'s index in its job."""
        return self._task_id

    @property
    def rpc_layer(self) -> str | None:
        """The rpc layer given to the constructor."""
        return self._rpc_layer

    @property
    def local_rank(self) -> int:
        """`SLURM_LOCALID`, else this task's index on its host."""
        return self._host_of[self._procid][0] if self._localid is None else self._localid

    @property
    def local_world_size(self) -> int:
        """The number of tasks of the step on this task's host."""
        return self._host_of[self._procid][1]

    @property
    def gpu_ids(self) -> list[int]:
        """The indices of the GPUs allocated to this task (`gpus_per_task` of them)."""
        return list(self._gpu_allocation[self._procid])

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None
    ) -> dict[str, int]:
        """`{"GPU": gpus_per_task}`: every task gets the same number."""
        del task_type, task_id
        return {"GPU": self._gpus_per_task}


def _tasks_per_host(
    hosts: list[str], tasks_per_node: int | Mapping[str, int] | None, tasks_text: str | None
) -> list[int]:
    """The number of tasks on each of `hosts`, from the argument or the variable."""
    if isinstance(tasks_per_node, int):
        return [tasks_per_node] * len(hosts)
    if tasks_per_node is not None:
        missing = [host for host in hosts if host not in tasks_per_node]
        if missing:
            raise InvalidArgumentError(
                f"tasks_per_node gives no count for hosts {missing} of the node list "
                f"{hosts}; add them, or pass one int for every host"
            )
        return [tasks_per_node[host] for host in hosts]
    counts = expand_tasks_per_node(str(tasks_text))
    if len(counts) != len(hosts):
        raise InvalidArgumentError(
            f"SLURM_STEP_TASKS_PER_NODE {tasks_text!r} gives {len(counts)} counts but the "
            f"node list has {len(hosts)} hosts {hosts}; expected one count per host"
        )
    return counts


def _validate_jobs(jobs: Mapping[str, int] | None, num_tasks: int) -> dict[str, int]:
    if jobs is None:
        return {"worker": num_tasks}
    counts = list(jobs.values())
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts) or (
        sum(counts) != num_tasks
    ):
        raise InvalidArgumentError(
            f"jobs must give each job a task count >= 0, adding up to the step's "
            f"{num_tasks} tasks, got {dict(jobs)}; e.g. "
            f"{{'chief': 1, 'worker': {num_tasks - 1}}}"
        )
    return dict(jobs)
