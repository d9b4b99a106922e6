"""Exceptions raised by `distribute`.

Every exception derives from `DistributeError` and from the builtin that fits, so
code that catches `ValueError`, `RuntimeError` or `TimeoutError` keeps working.

Example:
    >>> import distribute as ds
    >>> try:
    ...     ds.ReduceOp.from_value("max")
    ... except ds.errors.DistributeError as e:
    ...     isinstance(e, ValueError)
    True
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ContextError",
    "DistributeError",
    "InvalidArgumentError",
    "LateInitError",
    "MixedStrategyError",
    "RendezvousError",
    "ReplicaAbortedError",
    "WorkerError",
    "XlaAutogradError",
]


class DistributeError(Exception):
    """Base class of every exception raised by `distribute`.

    Example:
        >>> import distribute as ds
        >>> issubclass(ds.errors.CollectiveTimeoutError, ds.errors.DistributeError)
        True
    """


class InvalidArgumentError(DistributeError, ValueError):
    """An argument has the wrong value, type, shape or structure.

    Example:
        >>> import distribute as ds
        >>> ds.MirroredStrategy(["cuda:0"])  # on a machine without CUDA
        Traceback (most recent call last):
        ...
        distribute.errors.InvalidArgumentError: device 'cuda:0' (cuda:0) does not exist ...
    """


class LateInitError(InvalidArgumentError):
    """A module's code used a parameter after it was sharded away (deferred init).

    `ds.experimental.FullyShardedStrategy(deferred_init=True)` keeps only each
    worker's shard of a module's parameters while the model is built; code that
    initializes them after their module's ``__init__`` (a parent's
    ``self.apply(init_weights)``) raises this. Build with the default
    ``deferred_init=False``.

    Example:
        >>> import distribute as ds
        >>> issubclass(ds.errors.LateInitError, (ds.errors.InvalidArgumentError, ValueError))
        True
    """


class ContextError(DistributeError, RuntimeError):
    """A call was made in the wrong context (replica vs cross-replica).

    Example:
        >>> import distribute as ds
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> strategy.run(lambda: strategy.reduce("sum", 1.0, axis=None))
        Traceback (most recent call last):
        ...
        distribute.errors.ContextError: `reduce` may only be called in cross-replica context, ...
    """


class MixedStrategyError(ContextError):
    """A strategy's scope was entered inside a different strategy's scope.

    Example:
        >>> import distribute as ds
        >>> with ds.OneDeviceStrategy("cpu").scope():
        ...     with ds.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        ...         pass
        Traceback (most recent call last):
        ...
        distribute.errors.MixedStrategyError: Mixing different distribute strategies: ...
    """


class CollectiveTimeoutError(DistributeError, TimeoutError):
    """A collective did not complete in time; the message names the missing ranks.

    Example::

        try:
            loss = strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None)
        except ds.errors.CollectiveTimeoutError as error:
            print(error)   # which operation, which ranks never joined, and the timeout
            raise
    """


class CollectiveMismatchError(DistributeError, ValueError):
    """Participants of a collective passed values of different shape, dtype or structure.

    Example:
        >>> import distribute as ds, torch
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> uneven = ds.PerReplica((torch.ones(2), torch.ones(3)))
        >>> strategy.run(lambda x: ds.get_replica_context().all_reduce("sum", x), args=(uneven,))
        Traceback (most recent call last):
        ...
        distribute.errors.CollectiveMismatchError: all_reduce: replica 0 passed [float32[2]] ...
    """


class RendezvousError(DistributeError, ConnectionError):
    """The rendezvous store cannot be served (its port is taken) or was lost.

    Example::

        # MASTER_PORT taken by another program on the chief's host:
        strategy = ds.MultiWorkerMirroredStrategy()
        # RendezvousError: rank 0 could not serve the rendezvous at host0:29500: the port
        # is already in use by another program (...); pick a free port for MASTER_PORT
    """


class ReplicaAbortedError(DistributeError, RuntimeError):
    """A replica was released from a collective because another replica failed.

    Example::

        try:
            strategy.run(step, args=(batch,))
        except ds.errors.ReplicaAbortedError as error:
            first = error.__cause__   # the failing replica's own exception
    """


class WorkerError(DistributeError, RuntimeError):
    """A worker process failed; the message names its rank and carries its traceback.

    Example::

        def work():
            raise RuntimeError("boom")

        ds.launch.run(work, 2, timeout=60)
        # WorkerError: worker rank 0 raised RuntimeError: boom, then its traceback
    """


class XlaAutogradError(DistributeError, RuntimeError):
    """Autograd cannot run a backward on XLA devices in this process: its first
    backward ran before torch_xla's runtime started (the message says how to fix it).

    Example::

        loss.backward()                   # on the CPU, first in the process
        strategy = ds.TPUStrategy()       # XlaAutogradError: build the strategy (or call
                                          # ds.tpu.initialize_tpu_system()) before it
    """
