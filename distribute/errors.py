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
    "MixedStrategyError",
    "RendezvousError",
    "ReplicaAbortedError",
    "WorkerError",
    "XlaAutogradError",
]


class DistributeError(Exception):
    """Base class of every exception raised by `distribute`."""


class InvalidArgumentError(DistributeError, ValueError):
    """An argument has the wrong value, type, shape or structure."""


class ContextError(DistributeError, RuntimeError):
    """A call was made in the wrong context (replica vs cross-replica)."""


class MixedStrategyError(ContextError):
    """A strategy's scope was entered inside a different strategy's scope."""


class CollectiveTimeoutError(DistributeError, TimeoutError):
    """A collective did not complete in time; the message names the missing ranks."""


class CollectiveMismatchError(DistributeError, ValueError):
    """Participants of a collective passed values of different shape, dtype or structure."""


class RendezvousError(DistributeError, ConnectionError):
    """The rendezvous store cannot be served (its port is taken) or was lost."""


class ReplicaAbortedError(DistributeError, RuntimeError):
    """A replica was released from a collective because another replica failed."""


class WorkerError(DistributeError, RuntimeError):
    """A worker process failed; the message names its rank and carries its traceback."""


class XlaAutogradError(DistributeError, RuntimeError):
    """Autograd cannot run a backward on XLA devices in this process: its first
    backward ran before torch_xla's runtime started (the message says how to fix it)."""
