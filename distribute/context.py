"""The strategy and replica context stack.

Three states, as in tf.distribute:

* default: outside any scope. `get_strategy()` is the default strategy and
  `get_replica_context()` a default replica context (replica 0 of 1).
* cross-replica: inside `strategy.scope()` but outside `strategy.run`, or inside a
  `merge_call`. `get_replica_context()` is `None`.
* replica: inside `strategy.run`. `get_replica_context()` is the running replica's
  `ReplicaContext`.

The stack is thread-local: each replica thread of a strategy gets its own entry.

Example:
    >>> import distribute as ds
    >>> ds.get_replica_context().replica_id_in_sync_group
    0
    >>> ds.in_cross_replica_context()
    False
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from distribute._enums import ReduceOp
from distribute.errors import ContextError

if TYPE_CHECKING:
    from distribute.strategies.base import Strategy

__all__ = [
    "ReplicaContext",
    "experimental_set_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]


class ReplicaContext:
    """The context of one replica while `strategy.run` executes `fn`.

    Args:
        strategy: the strategy running the replica.
        replica_id_in_sync_group: the global replica id (over all workers).
        local_replica_id: the replica's index among this worker's replicas.

    Example:
        >>> import distribute as ds
        >>> s = ds.OneDeviceStrategy("cpu")
        >>> s.run(lambda: ds.get_replica_context().all_reduce("sum", 3.0))
        3.0
    """

    def __init__(
        self, strategy: Strategy, replica_id_in_sync_group: int, local_replica_id: int = 0
    ) -> None:
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        self._local_replica_id = local_replica_id

    @property
    def strategy(self) -> Strategy:
        """The strategy this replica belongs to."""
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id, from 0 to `num_replicas_in_sync - 1`, over all workers."""
        return self._replica_id

    @property
    def local_replica_id(self) -> int:
        """This replica's index among the replicas of its own worker."""
        return self._local_replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas over all workers."""
        return self._strategy.num_replicas_in_sync

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Reduces `value` (a tensor, number or nest of them) across all replicas.

        Every replica must call it, in the same order, with the same structure,
        shapes and dtypes. Differentiable: the gradient of a SUM is the SUM of the
        replicas' gradients.

        Example:
            >>> import distribute as ds, torch
            >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> r = s.run(lambda: ds.get_replica_context().all_reduce(
            ...     "sum", torch.tensor(1.0 + ds.get_replica_context().replica_id_in_sync_group)))
            >>> [float(t) for t in s.experimental_local_results(r)]
            [3.0, 3.0]
        """
        self._require_current("all_reduce")
        op = ReduceOp.from_value(reduce_op)
        return self._strategy.extended._replica_all_reduce(self, op, value)

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenates every replica's `value` (tensor or nest) along `axis`.

        Shapes may differ along `axis` only. Each replica receives the whole result.
        """
        self._require_current("all_gather")
        return self._strategy.extended._replica_all_gather(self, value, axis)

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Runs `merge_fn(strategy, *args, **kwargs)` once, in cross-replica context.

        Every replica pauses at the call; the replicas' `args` are regrouped into
        `PerReplica` values; each replica gets its own component of the result (a
        plain result goes to every replica).
        """
        self._require_current("merge_call")
        return self._strategy.extended._replica_merge_call(
            self, merge_fn, tuple(args), dict(kwargs or {})
        )

    def _require_current(self, method: str) -> None:
        """Raises `ContextError` unless this replica context is the running one."""
        top = _top()
        if top is None:
            if self._strategy is _default_strategy():
                return  # the default replica context, outside any scope
        elif top.replica_context is self:
            return
        where = (
            "inside a merge_fn"
            if top is not None and top.in_merge
            else "after its `run` returned"
            if top is None or top.replica_context is None
            else "from another replica's `run`"
        )
        raise ContextError(
            f"ReplicaContext.{method} was called {where}, in cross-replica context; call it "
            "only inside the `fn` given to `strategy.run`, on "
            "`ds.get_replica_context()` of the running replica"
        )

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


class _Entry(NamedTuple):
    strategy: Strategy
    replica_context: ReplicaContext | None
    in_merge: bool = False


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Entry] = []
        self.set_strategy_scope: contextlib.AbstractContextManager[Any] | None = None


_state = _ThreadState()


def _top() -> _Entry | None:
    return _state.stack[-1] if _state.stack else None


class _push:  # used like a function: `with _push(...)`
    """Makes `strategy` current in this thread (cross-replica when no replica context).

    `in_merge` marks the cross-replica context of a `merge_call`'s `merge_fn`. A
    plain class rather than a generator context manager: it is entered on every
    `run`, where microseconds count.
    """

    __slots__ = ("_entry", "_stack")

    def __init__(
        self, strategy: Strategy, replica_context: ReplicaContext | None, *, in_merge: bool = False
    ) -> None:
        self._entry = _Entry(strategy, replica_context, in_merge)
        self._stack = _state.stack

    def __enter__(self) -> None:
        self._stack.append(self._entry)

    def __exit__(self, *exc: object) -> None:
        self._stack.pop()


def _enter_scope(strategy: Strategy) -> None:
    top = _top()
    if top is not None and top.strategy is not strategy:
        from distribute.errors import MixedStrategyError

        raise MixedStrategyError(
            f"Mixing different distribute strategies: {strategy!r} is not "
            f"{top.strategy!r}; exit the current strategy's scope before entering another"
        )
    if top is not None and top.replica_context is not None:
        raise ContextError(
            f"{strategy!r}.scope() was entered inside `run` of {top.strategy!r} (replica "
            f"{top.replica_context.replica_id_in_sync_group}); enter the scope around the "
            "code that builds the model and calls `run`, not inside `fn`"
        )
    _state.stack.append(_Entry(strategy, None))


def _exit_scope() -> None:
    _state.stack.pop()


def _scope_depth(strategy: Strategy) -> int:
    """How many scopes of `strategy` this thread has entered (and not left)."""
    return sum(1 for e in _state.stack if e.strategy is strategy and e.replica_context is None)


#: Makes the default strategy (registered by `distribute.strategies.default`, which the
#: package imports): the context sits below the strategies and names none of them.
_default_factory: list[Callable[[], Strategy]] = []


def register_default_strategy(factory: Callable[[], Strategy]) -> None:
    """Sets what `get_strategy()` returns outside any scope (the strategies layer calls it).

    Example::

        register_default_strategy(lambda: MY_DEFAULT_STRATEGY)
    """
    _default_factory[:] = [factory]


def _default_strategy() -> Strategy:
    if not _default_factory:
        raise ContextError(
            "no default strategy is registered; import distribute (not only "
            "distribute.context), which registers it"
        )
    return _default_factory[0]()


def get_strategy() -> Strategy:
    """Returns the current strategy, or the default strategy outside any scope.

    Example:
        >>> import distribute as ds
        >>> s = ds.OneDeviceStrategy("cpu")
        >>> with s.scope():
        ...     ds.get_strategy() is s
        True
    """
    top = _top()
    return _default_strategy() if top is None else top.strategy


def has_strategy() -> bool:
    """Whether a non-default strategy is current.

    Example:
        >>> import distribute as ds
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> ds.has_strategy()
        False
        >>> with strategy.scope():
        ...     ds.has_strategy()
        True
    """
    top = _top()
    return top is not None and top.strategy is not _default_strategy()


def in_cross_replica_context() -> bool:
    """Whether the caller is inside a scope but not inside `run` (or inside a merge).

    Example:
        >>> import distribute as ds
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     ds.in_cross_replica_context()
        True
        >>> strategy.run(ds.in_cross_replica_context)
        False
    """
    top = _top()
    return top is not None and top.replica_context is None


def get_replica_context() -> ReplicaContext | None:
    """The current `ReplicaContext`; `None` in cross-replica context.

    Outside any scope, the default replica context (replica 0 of 1).

    Example:
        >>> import distribute as ds
        >>> ds.get_replica_context().num_replicas_in_sync   # the default replica context
        1
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     ds.get_replica_context() is None             # cross-replica context
        True
        >>> ids = strategy.run(lambda: ds.get_replica_context().replica_id_in_sync_group)
        >>> strategy.experimental_local_results(ids)
        (0, 1)
    """
    top = _top()
    if top is None:
        return ReplicaContext(_default_strategy(), 0)
    return top.replica_context


def _current_replica_context_for(strategy: Strategy) -> ReplicaContext | None:
    """The replica context if `strategy` is running a replica in this thread."""
    top = _top()
    if top is not None and top.strategy is strategy:
        return top.replica_context
    return None


def require_cross_replica(strategy: Strategy, method: str, hint: str) -> None:
    """Raises `ContextError` when `strategy`'s `method` is called in replica context."""
    top = _top()
    if top is not None and top.replica_context is not None:
        raise ContextError(
            f"`{method}` may only be called in cross-replica context, but it was called "
            f"inside `run` (replica {top.replica_context.replica_id_in_sync_group}); {hint}"
        )


def experimental_set_strategy(strategy: Strategy | None) -> None:
    """Makes `strategy` current in this thread until it is set to `None`.

    Raises:
        ContextError: called inside a `with strategy.scope()` block.

    Example:
        >>> import distribute as ds
        >>> s = ds.OneDeviceStrategy("cpu")
        >>> ds.experimental_set_strategy(s)
        >>> ds.get_strategy() is s
        True
        >>> ds.experimental_set_strategy(None)
    """
    previous = _state.set_strategy_scope
    expected_depth = 1 if previous is not None else 0
    if len(_state.stack) != expected_depth:
        raise ContextError(
            "experimental_set_strategy must not be called inside a `with strategy.scope()` "
            "block or inside `run`; exit the scope first"
        )
    if previous is not None:
        previous.__exit__(None, None, None)
        _state.set_strategy_scope = None
    if strategy is not None:
        scope = strategy.scope()
        scope.__enter__()
        _state.set_strategy_scope = scope
