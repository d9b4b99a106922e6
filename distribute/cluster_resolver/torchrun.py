"""`TorchrunClusterResolver`: the cluster described by torchrun's variables.

torchrun (`torch.distributed.run`) sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` in each process it starts, e.g.::

    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-endpoint=host0:29500 train.py
"""

from __future__ import annotations

from collections.abc import Mapping

from distribute import _env
from distribute.cluster_resolver.base import ClusterResolver
from distribute.cluster_resolver.cluster_spec import ClusterSpec
from distribute.errors import InvalidArgumentError

__all__ = ["TorchrunClusterResolver"]


class TorchrunClusterResolver(ClusterResolver):
    """Resolves the cluster from torchrun's environment variables, read once.

    Every process is a `"worker"` task with `task_id == rank == RANK`. torchrun does
    not tell a process its peers' addresses, so `cluster_spec()` lists
    `"{MASTER_ADDR}:{MASTER_PORT}"` for worker 0 and the placeholders `"worker-{i}"`
    for the others: use `master_addr` / `master_port` for the rendezvous, not the
    spec's addresses.

    `LOCAL_RANK` and `LOCAL_WORLD_SIZE` default to 0 and 1 when unset (a launcher
    other than torchrun that sets only the global variables).

    Args:
        environ: the variables to read; None reads the process environment (through
            `distribute._env`).

    Raises:
        InvalidArgumentError: `RANK`, `WORLD_SIZE`, `MASTER_ADDR` or `MASTER_PORT` is
            unset (the message names which), a variable is not an integer, or
            `RANK >= WORLD_SIZE` / `LOCAL_RANK >= LOCAL_WORLD_SIZE`.

    Example:
        >>> from distribute.cluster_resolver import TorchrunClusterResolver
        >>> resolver = TorchrunClusterResolver(environ={
        ...     "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        ...     "MASTER_ADDR": "host0", "MASTER_PORT": "29500"})
        >>> resolver.rank, resolver.world_size, resolver.local_rank, resolver.task_type
        (5, 8, 1, 'worker')
        >>> resolver.master_addr, resolver.master_port, resolver.master(task_id=0)
        ('host0', 29500, 'host0:29500')
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = _env.read_environment(environ)
        rank, world_size = env.rank, env.world_size
        master_addr, master_port = env.master_addr, env.master_port
        if rank is None or world_size is None or master_addr is None or master_port is None:
            required = {
                "RANK": rank,
                "WORLD_SIZE": world_size,
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": master_port,
            }
            missing = [name for name, value in required.items() if value is None]
            raise InvalidArgumentError(
                f"TorchrunClusterResolver needs RANK, WORLD_SIZE, MASTER_ADDR and "
                f"MASTER_PORT, but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} unset; launch with torchrun, or "
                f"set them yourself"
            )
        if rank >= world_size:
            raise InvalidArgumentError(
                f"RANK must be < WORLD_SIZE, got RANK={rank} and WORLD_SIZE={world_size}; "
                f"fix the launcher's variables"
            )
        local_rank = 0 if env.local_rank is None else env.local_rank
        local_world_size = 1 if env.local_world_size is None else env.local_world_size
        if local_rank >= local_world_size:
            raise InvalidArgumentError(
                f"LOCAL_RANK must be < LOCAL_WORLD_SIZE, got LOCAL_RANK={local_rank} and "
                f"LOCAL_WORLD_SIZE={local_world_size}; set both, or neither"
            )
        self._rank = rank
        self._world_size = world_size
        self._local_rank = local_rank
        self._local_world_size = local_world_size
        self._master_addr = master_addr
        self._master_port = master_port
        self._group_rank = env.group_rank
        self._elastic_agent_store = bool(env.elastic_agent_store)
        self._elastic_attempt = (
            None
            if env.elastic_restart_count is None
            else (env.elastic_run_id or "none", env.elastic_restart_count)
        )

    def cluster_spec(self) -> ClusterSpec:
        """One `"worker"` task per rank; only worker 0's address is real."""
        rendezvous = f"{self._master_addr}:{self._master_port}"
        return ClusterSpec(
            {"worker": [rendezvous] + [f"worker-{i}" for i in range(1, self._world_size)]}
        )

    @property
    def task_type(self) -> str:
        """Always `"worker"`."""
        return "worker"

    @property
    def task_id(self) -> int:
        """`RANK`."""
        return self._rank

    @property
    def rank(self) -> int:
        """`RANK`."""
        return self._rank

    @property
    def world_size(self) -> int:
        """`WORLD_SIZE`."""
        return self._world_size

    @property
    def master_addr(self) -> str:
        """`MASTER_ADDR`."""
        return self._master_addr

    @property
    def master_port(self) -> int:
        """`MASTER_PORT`."""
        return self._master_port

    @property
    def local_rank(self) -> int:
        """`LOCAL_RANK`, 0 when unset."""
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        """`LOCAL_WORLD_SIZE`, 1 when unset."""
        return self._local_world_size

    @property
    def group_rank(self) -> int | None:
        """`GROUP_RANK`, the rank of this host among the hosts, or None when unset."""
        return self._group_rank

    @property
    def rendezvous_prefix(self) -> str:
        """``torchrun/<run id>/<restart count>/`` under torchrun's elastic agent.

        The agent's store outlives a restart of the workers, so each attempt keys
        its rendezvous apart (restarted workers never meet the dead attempt's keys).
        """
        if self._elastic_attempt is None:
            return ""
        run_id, restart = self._elastic_attempt
        return f"torchrun/{run_id}/{restart}/"

    @property
    def launcher_serves_rendezvous(self) -> bool:
        """`TORCHELASTIC_USE_AGENT_STORE`: torchrun's agent serves `MASTER_PORT`."""
        return self._elastic_agent_store
