"""The one place where `distribute` reads environment variables.

Every variable the library looks at is read here, once per `read_environment()` call,
into a frozen `Environment`. Other modules take an `Environment` (or a mapping they
pass on to `read_environment`) and never touch `os.environ`; nothing here writes it.

Variables read, by launcher:

- torchrun: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
  `MASTER_PORT`, `GROUP_RANK`, and its elastic agent's `TORCHELASTIC_RUN_ID`,
  `TORCHELASTIC_RESTART_COUNT`, `TORCHELASTIC_USE_AGENT_STORE`.
- TensorFlow-style clusters: `TF_CONFIG` (kept as the raw string; the resolver parses
  the JSON when it needs it).
- SLURM: `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` (else `SLURM_NTASKS`),
  `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`, else `SLURM_NODELIST`),
  `SLURM_STEP_TASKS_PER_NODE` (else `SLURM_TASKS_PER_NODE`), `SLURM_LOCALID`.
- Devices: `CUDA_VISIBLE_DEVICES`, `PJRT_DEVICE`, `CPU_NUM_DEVICES`.
- rpc: `TP_SOCKET_IFNAME` (TensorPipe reads it itself; the parameter-server tasks
  read it to tell whether rpc listens on their cluster-spec address).

Integer variables are parsed here, so a malformed value fails early with a message
naming the variable. A variable set to blanks counts as unset, except `TF_CONFIG` and
`CUDA_VISIBLE_DEVICES`, which are kept as given (`CUDA_VISIBLE_DEVICES=""` hides every
GPU).

Example:
    >>> from distribute._env import read_environment
    >>> env = read_environment({"RANK": "1", "WORLD_SIZE": "4"})
    >>> env.rank, env.world_size, env.has_torchrun
    (1, 4, True)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from distribute.errors import InvalidArgumentError

__all__ = ["Environment", "read_environment"]


@dataclass(frozen=True)
class Environment:
    """A parsed snapshot of the environment variables `distribute` uses.

    Every field is None when its variable is unset.

    Attributes:
        rank: torchrun's `RANK`, this process's global rank.
        world_size: torchrun's `WORLD_SIZE`, the number of processes.
        local_rank: torchrun's `LOCAL_RANK`, this process's rank on its host.
        local_world_size: torchrun's `LOCAL_WORLD_SIZE`, the processes on this host.
        master_addr: torchrun's `MASTER_ADDR`, the rendezvous host.
        master_port: torchrun's `MASTER_PORT`, the rendezvous port.
        group_rank: torchrun's `GROUP_RANK`, the rank of this host (node).
        elastic_run_id: torchrun's `TORCHELASTIC_RUN_ID`, the job's id.
        elastic_restart_count: torchrun's `TORCHELASTIC_RESTART_COUNT`, how many times
            the agent restarted the workers (0 on the first attempt).
        elastic_agent_store: `TORCHELASTIC_USE_AGENT_STORE` ("True": torchrun's agent
            serves a store at `MASTER_ADDR:MASTER_PORT` that workers join).
        tf_config: the raw `TF_CONFIG` string (JSON, not parsed here).
        slurm_procid: `SLURM_PROCID`, this task's rank in the job step.
        slurm_num_tasks: `SLURM_STEP_NUM_TASKS`, else `SLURM_NTASKS`.
        slurm_nodelist: `SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST`, else
            `SLURM_NODELIST` (compressed, e.g. `"n[1-2],m5"`).
        slurm_tasks_per_node: `SLURM_STEP_TASKS_PER_NODE`, else
            `SLURM_TASKS_PER_NODE` (compressed, e.g. `"3(x2),2"`).
        slurm_localid: `SLURM_LOCALID`, this task's index on its node.
        cuda_visible_devices: `CUDA_VISIBLE_DEVICES` as given ("" means no GPU).
        pjrt_device: `PJRT_DEVICE` (e.g. `"CPU"` or `"TPU"`), for torch_xla.
        cpu_num_devices: `CPU_NUM_DEVICES` as given, for torch_xla's CPU backend.
        tp_socket_ifname: `TP_SOCKET_IFNAME`, the network interface TensorPipe (rpc)
            listens on.

    Example:
        >>> from distribute._env import Environment
        >>> Environment(slurm_procid=0, slurm_num_tasks=2).has_slurm
        True
    """

    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    group_rank: int | None = None
    elastic_run_id: str | None = None
    elastic_restart_count: int | None = None
    elastic_agent_store: bool | None = None
    tf_config: str | None = None
    slurm_procid: int | None = None
    slurm_num_tasks: int | None = None
    slurm_nodelist: str | None = None
    slurm_tasks_per_node: str | None = None
    slurm_localid: int | None = None
    cuda_visible_devices: str | None = None
    pjrt_device: str | None = None
    cpu_num_devices: str | None = None
    tp_socket_ifname: str | None = None

    @property
    def has_torchrun(self) -> bool:
        """True when `RANK` and `WORLD_SIZE` are both set (torchrun or a look-alike)."""
        return self.rank is not None and self.world_size is not None

    @property
    def has_tf_config(self) -> bool:
        """True when `TF_CONFIG` is set to something other than blanks."""
        return self.tf_config is not None and self.tf_config.strip() != ""

    @property
    def has_slurm(self) -> bool:
        """True when `SLURM_PROCID` is set (the process is a task of a SLURM step)."""
        return self.slurm_procid is not None


def read_environment(environ: Mapping[str, str] | None = None) -> Environment:
    """Reads and parses the variables `distribute` uses.

    Args:
        environ: the variables to read; None reads `os.environ`.

    Returns:
        A frozen `Environment`; unset variables are None.

    Raises:
        InvalidArgumentError: an integer variable is not a non-negative integer, or
            `MASTER_PORT` is outside 1..65535.

    Example:
        >>> from distribute._env import read_environment
        >>> read_environment({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}).slurm_num_tasks
        8
    """
    source: Mapping[str, str] = os.environ if environ is None else environ
    master_port = _int(source, "MASTER_PORT")
    if master_port is not None and not 1 <= master_port <= 65535:
        raise InvalidArgumentError(
            f"environment variable MASTER_PORT must be a TCP port in 1..65535, got "
            f"{master_port}; set MASTER_PORT to a free port on the MASTER_ADDR host"
        )
    return Environment(
        rank=_int(source, "RANK"),
        world_size=_int(source, "WORLD_SIZE"),
        local_rank=_int(source, "LOCAL_RANK"),
        local_world_size=_int(source, "LOCAL_WORLD_SIZE"),
        master_addr=_str(source, "MASTER_ADDR"),
        master_port=master_port,
        group_rank=_int(source, "GROUP_RANK"),
        elastic_run_id=_str(source, "TORCHELASTIC_RUN_ID"),
        elastic_restart_count=_int(source, "TORCHELASTIC_RESTART_COUNT"),
        elastic_agent_store=_bool(source, "TORCHELASTIC_USE_AGENT_STORE"),
        tf_config=source.get("TF_CONFIG"),
        slurm_procid=_int(source, "SLURM_PROCID"),
        slurm_num_tasks=_int(source, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
        slurm_nodelist=_str(source, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
        slurm_tasks_per_node=_str(source, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
        slurm_localid=_int(source, "SLURM_LOCALID"),
        cuda_visible_devices=source.get("CUDA_VISIBLE_DEVICES"),
        pjrt_device=_str(source, "PJRT_DEVICE"),
        cpu_num_devices=_str(source, "CPU_NUM_DEVICES"),
        tp_socket_ifname=_str(source, "TP_SOCKET_IFNAME"),
    )


def _first(source: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    """The first of `names` set to a non-blank value, with that value stripped."""
    for name in names:
        value = source.get(name)
        if value is not None and value.strip() != "":
            return name, value.strip()
    return None


def _str(source: Mapping[str, str], *names: str) -> str | None:
    found = _first(source, names)
    return None if found is None else found[1]


def _bool(source: Mapping[str, str], name: str) -> bool | None:
    value = _str(source, name)
    return None if value is None else value.lower() in ("1", "true", "yes")


def _int(source: Mapping[str, str], *names: str) -> int | None:
    found = _first(source, names)
    if found is None:
        return None
    name, value = found
    if not value.isdigit() or not value.isascii():
        raise InvalidArgumentError(
            f"environment variable {name} must be a non-negative integer, got {value!r}; "
            f"fix or unset {name} in the launcher's environment"
        )
    return int(value)
