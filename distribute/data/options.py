"""Input options and the small context objects handed to input functions.

Example::

    >>> import distribute as ds
    >>> ctx = ds.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    >>> ctx.get_per_replica_batch_size(64)
    16
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from distribute.errors import InvalidArgumentError

__all__ = [
    "AutoShardPolicy",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "ValueContext",
]


class InputReplicationMode(enum.Enum):
    """How many input pipelines `distribute_datasets_from_function` builds.

    ``PER_WORKER``: one per worker, its batches split over the local replicas.
    ``PER_REPLICA``: one per replica, each yielding that replica's batches.

    Example:
        >>> import distribute as ds, torch
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> per_replica = ds.InputReplicationMode.PER_REPLICA
        >>> options = ds.InputOptions(experimental_replication_mode=per_replica)
        >>> dist = strategy.distribute_datasets_from_function(
        ...     lambda ctx: [torch.full((2,), ctx.input_pipeline_id)], options)
        >>> [t.tolist() for t in next(iter(dist)).values]   # each replica's own pipeline
        [[0, 0], [1, 1]]
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


class AutoShardPolicy(enum.Enum):
    """How `experimental_distribute_dataset` divides data between workers.

    ``FILE``: each worker reads its own files (the dataset exposes ``files``
    and ``with_files(files)``). ``DATA``: each worker loads only its own part of
    every global batch (the DataLoader's sampler is rewrapped). ``AUTO``: FILE
    when the dataset has files enough for every worker, else DATA. ``OFF``:
    every worker reads all the data (a replica still gets 1/N of each global
    batch, so every worker takes ``num_workers`` times as many steps per epoch).

    Example:
        >>> import distribute as ds
        >>> ds.InputOptions(auto_shard_policy=ds.AutoShardPolicy.DATA).auto_shard_policy
        <AutoShardPolicy.DATA: 'DATA'>
    """

    AUTO = "AUTO"
    FILE = "FILE"
    DATA = "DATA"
    OFF = "OFF"


@dataclass(frozen=True)
class InputOptions:
    """Options for distributed input.

    Args:
      experimental_fetch_to_device: move each replica's batch to its device
        ahead of use; ``False`` keeps batches on the host.
      experimental_replication_mode: see :class:`InputReplicationMode`;
        ``PER_REPLICA`` only with `distribute_datasets_from_function`.
      experimental_place_dataset_on_device: the per-replica pipeline itself
        produces device tensors (needs ``PER_REPLICA`` and
        ``experimental_fetch_to_device=False``).
      experimental_per_replica_buffer_size: how many steps are read (and copied
        to the replicas' devices) ahead of use; 0 disables prefetching. With one
        worker and nothing to copy (CPU replicas, or
        ``experimental_fetch_to_device=False``) nothing is read ahead.
      auto_shard_policy: see :class:`AutoShardPolicy`.

    Raises:
      ValueError: for the combinations tf.distribute rejects.

    Example::

        >>> import distribute as ds
        >>> ds.InputOptions(experimental_fetch_to_device=False).experimental_per_replica_buffer_size
        1
    """

    experimental_fetch_to_device: bool = True
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1
    auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "experimental_replication_mode",
            _to_enum(
                InputReplicationMode,
                self.experimental_replication_mode,
                "experimental_replication_mode",
            ),
        )
        object.__setattr__(
            self,
            "auto_shard_policy",
            _to_enum(AutoShardPolicy, self.auto_shard_policy, "auto_shard_policy"),
        )
        if self.experimental_per_replica_buffer_size < 0:
            raise InvalidArgumentError(
                "experimental_per_replica_buffer_size must be >= 0 (0 disables prefetching), "
                f"got {self.experimental_per_replica_buffer_size}."
            )
        if self.experimental_place_dataset_on_device:
            if self.experimental_replication_mode is not InputReplicationMode.PER_REPLICA:
                raise InvalidArgumentError(
                    "experimental_place_dataset_on_device=True needs "
                    "experimental_replication_mode=InputReplicationMode.PER_REPLICA, got "
                    f"{self.experimental_replication_mode.name}."
                )
            if self.experimental_fetch_to_device:
                raise InvalidArgumentError(
                    "experimental_place_dataset_on_device=True and "
                    "experimental_fetch_to_device=True "
                    "cannot be combined: the pipeline already produces device tensors; pass "
                    "experimental_fetch_to_device=False."
                )


def _to_enum(cls: type[enum.Enum], value: object, name: str) -> enum.Enum:
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls[value.upper()]
        except KeyError:
            pass
    choices = ", ".join(m.name for m in cls)
    raise InvalidArgumentError(f"{name} must be one of {choices}, got {value!r}.")


@dataclass(frozen=True)
class InputContext:
    """What an input function needs to know about its pipeline.

    Args:
      num_input_pipelines: how many pipelines exist (workers, or replicas in
        PER_REPLICA mode).
      input_pipeline_id: this pipeline's index in ``[0, num_input_pipelines)``.
      num_replicas_in_sync: replicas over all workers.

    Example::

        >>> import distribute as ds
        >>> ds.InputContext(num_replicas_in_sync=2).get_per_replica_batch_size(10)
        5
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        if (
            self.num_input_pipelines < 1
            or not 0 <= self.input_pipeline_id < self.num_input_pipelines
        ):
            raise InvalidArgumentError(
                "input_pipeline_id must be in [0, "
                f"num_input_pipelines={self.num_input_pipelines}), "
                f"got {self.input_pipeline_id}."
            )
        if self.num_replicas_in_sync < 1:
            raise InvalidArgumentError(
                f"num_replicas_in_sync must be >= 1, got {self.num_replicas_in_sync}."
            )

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """Returns ``global_batch_size // num_replicas_in_sync``.

        Raises:
          ValueError: when the global batch does not divide evenly.
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise InvalidArgumentError(
                f"The global batch size ({global_batch_size}) must be divisible by "
                f"num_replicas_in_sync ({self.num_replicas_in_sync}); pick a multiple of "
                f"{self.num_replicas_in_sync}."
            )
        return global_batch_size // self.num_replicas_in_sync


@dataclass(frozen=True)
class ValueContext:
    """Identifies the replica a value function is called for.

    Example::

        >>> import distribute as ds
        >>> ds.experimental.ValueContext(1, 2).replica_id_in_sync_group
        1
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1
