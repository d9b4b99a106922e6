"""The default strategy: no distribution; `run(fn)` just calls `fn`."""

from __future__ import annotations

import functools

from distribute import context
from distribute.strategies._replicated import ReplicatedExtended
from distribute.strategies.base import Strategy, StrategyScope

__all__ = ["DefaultStrategy"]


class DefaultStrategy(Strategy):
    """The strategy in effect outside any scope: one replica, nothing distributed.

    `ds.get_strategy()` returns this singleton outside any scope; its `scope()`
    changes nothing and modules built in it keep plain parameters.

    Example:
        >>> import distribute as ds
        >>> s = ds.get_strategy()
        >>> s.run(lambda x: x + 1, args=(1,))
        2
    """

    def __init__(self) -> None:
        super().__init__(
            ReplicatedExtended(self, ["cpu"], captures_modules=False, wrap_single_values=False)
        )

    def scope(self) -> StrategyScope:
        """A scope that changes nothing (the default strategy is already current)."""
        return _DefaultScope(self)

    def __repr__(self) -> str:
        return "DefaultStrategy()"


class _DefaultScope(StrategyScope):
    """Enters nothing: the default strategy is what no scope means."""

    def __enter__(self) -> Strategy:
        return self._strategy

    def __exit__(self, *exc: object) -> None:
        pass


@functools.cache
def _default_strategy_singleton() -> DefaultStrategy:
    return DefaultStrategy()


context.register_default_strategy(_default_strategy_singleton)
