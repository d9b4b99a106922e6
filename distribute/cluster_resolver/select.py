"""`resolve_cluster`: pick the resolver that fits how this process was launched."""

from __future__ import annotations

from collections.abc import Mapping

from distribute import _env
from distribute.cluster_resolver.base import ClusterResolver
from distribute.cluster_resolver.slurm import SlurmClusterResolver
from distribute.cluster_resolver.tfconfig import TFConfigClusterResolver, parse_tf_config
from distribute.cluster_resolver.torchrun import TorchrunClusterResolver

__all__ = ["resolve_cluster"]


def resolve_cluster(environ: Mapping[str, str] | None = None) -> ClusterResolver | None:
    """The resolver for this process's launcher, or None for a single worker.

    In order: torchrun's variables (`RANK` and `WORLD_SIZE` set) give a
    `TorchrunClusterResolver`; else a `TF_CONFIG` with a non-empty `"cluster"` gives a
    `TFConfigClusterResolver`; else a SLURM step of more than one task (`SLURM_PROCID`
    set) gives a `SlurmClusterResolver`; else None.

    Args:
        environ: the variables to read; None reads the process environment.

    Raises:
        InvalidArgumentError: the chosen launcher's variables are malformed or
            incomplete (e.g. `RANK` without `MASTER_ADDR`, or a `TF_CONFIG` that is not
            JSON).

    Example:
        >>> from distribute.cluster_resolver import resolve_cluster
        >>> resolve_cluster({}) is None
        True
        >>> resolve_cluster({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h",
        ...                  "MASTER_PORT": "29500"}).world_size
        2
    """
    env = _env.read_environment(environ)
    if env.has_torchrun:
        return TorchrunClusterResolver(environ)
    if env.has_tf_config and parse_tf_config(env.tf_config).cluster:
        return TFConfigClusterResolver(environ=environ)
    if env.has_slurm and env.slurm_num_tasks is not None and env.slurm_num_tasks > 1:
        return SlurmClusterResolver(environ=environ)
    return None
