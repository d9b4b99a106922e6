"""The default strategy: no distribution; `run(fn)` just calls `fn`."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from distribute.strategies._replicated import ReplicatedExtended
from distribute.strategies.base import Strategy

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

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """A no-op scope (the default strategy is already current)."""
        yield self

    def __repr__(self) -> str:
        return "DefaultStrategy()"


@functools.cache
def _default_strategy_singleton() -> DefaultStrategy:
    return DefaultStrategy()
