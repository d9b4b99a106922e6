"""Cluster resolvers: who is in the cluster, which task this process is, and where
the processes meet.

`resolve_cluster()` picks a resolver from the launcher's variables (torchrun first,
then `TF_CONFIG`, then SLURM). Every resolver gives, beyond tf.distribute's
`cluster_spec()`, `master()`, `task_type`, `task_id`, `num_accelerators()` and
`rpc_layer`, what a `torch.distributed` process group needs: `rank`, `world_size`,
`master_addr`, `master_port`, `local_rank` and `local_world_size`.

Example:
    >>> from distribute.cluster_resolver import resolve_cluster
    >>> resolver = resolve_cluster({"RANK": "1", "WORLD_SIZE": "2",
    ...                             "MASTER_ADDR": "host0", "MASTER_PORT": "29500"})
    >>> resolver.rank, resolver.world_size, resolver.master_addr, resolver.master_port
    (1, 2, 'host0', 29500)
"""

from __future__ import annotations

from distribute.cluster_resolver.base import ClusterResolver
from distribute.cluster_resolver.cluster_spec import ClusterSpec
from distribute.cluster_resolver.select import resolve_cluster
from distribute.cluster_resolver.simple import SimpleClusterResolver
from distribute.cluster_resolver.slurm import (
    SlurmClusterResolver,
    expand_hostlist,
    expand_tasks_per_node,
)
from distribute.cluster_resolver.tfconfig import TFConfigClusterResolver
from distribute.cluster_resolver.torchrun import TorchrunClusterResolver
from distribute.cluster_resolver.tpu import TPUClusterResolver

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
    "TorchrunClusterResolver",
    "expand_hostlist",
    "expand_tasks_per_node",
    "resolve_cluster",
]
