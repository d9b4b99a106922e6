"""distribute: tf.distribute's Strategy API, rebuilt on PyTorch.

Change only the strategy object to move one training step from one CPU to several
devices, processes or machines, with the same numbers coming out.

Example:
    >>> import distribute as ds, torch
    >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     model = torch.nn.Linear(4, 1)
    ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> def step(x):
    ...     loss = ds.compute_average_loss(model(x).pow(2).mean(dim=1), global_batch_size=8)
    ...     loss.backward()
    ...     optimizer.step()
    ...     optimizer.zero_grad()
    ...     return loss
    >>> batch = ds.PerReplica((torch.ones(4, 4), torch.ones(4, 4)))
    >>> loss = strategy.reduce("sum", strategy.run(step, args=(batch,)))
"""

from __future__ import annotations

from distribute import (
    checkpoint,
    cluster_resolver,
    compat,
    coordinator,
    data,
    errors,
    experimental,
    gradients,
    tpu,
    training,
    values,
)
from distribute._enums import ReduceOp, VariableAggregation, VariableSynchronization
from distribute.checkpoint import Checkpoint, CheckpointManager, RNGState
from distribute.collectives.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from distribute.context import (
    ReplicaContext,
    experimental_set_strategy,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from distribute.data._iterator import DistributedIterator
from distribute.data.dataset import DistributedDataset
from distribute.data.options import (
    AutoShardPolicy,
    InputContext,
    InputOptions,
    InputReplicationMode,
)
from distribute.gradients import GradScaler
from distribute.losses import compute_average_loss, scale_regularization_loss
from distribute.ps._variables import ParameterServerVariable, ShardedVariable
from distribute.strategies.base import Strategy, StrategyExtended
from distribute.strategies.central_storage import CentralStorageStrategy
from distribute.strategies.mirrored import MirroredStrategy
from distribute.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from distribute.strategies.one_device import OneDeviceStrategy
from distribute.strategies.parameter_server import ParameterServerStrategy, Server
from distribute.strategies.tpu import TPUStrategy
from distribute.training import Model, callbacks, metrics, optimizers
from distribute.values import DistributedValues, Mirrored, PerReplica
from distribute.variables import (
    DistributedVariable,
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
)

__all__ = [
    "AutoShardPolicy",
    "CentralStorageStrategy",
    "Checkpoint",
    "CheckpointManager",
    "CrossDeviceOps",
    "DistributedDataset",
    "DistributedIterator",
    "DistributedValues",
    "DistributedVariable",
    "GradScaler",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "Model",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "ParameterServerVariable",
    "PerReplica",
    "RNGState",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "Server",
    "ShardedVariable",
    "Strategy",
    "StrategyExtended",
    "SyncOnReadVariable",
    "TPUStrategy",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "callbacks",
    "checkpoint",
    "cluster_resolver",
    "compat",
    "compute_average_loss",
    "coordinator",
    "data",
    "errors",
    "experimental",
    "experimental_set_strategy",
    "get_replica_context",
    "get_strategy",
    "gradients",
    "has_strategy",
    "in_cross_replica_context",
    "metrics",
    "optimizers",
    "scale_regularization_loss",
    "tpu",
    "training",
    "values",
]
