"""Which optimizers were built in a scope over parameters about to be replaced.

# NOTE [optimizers built in the scope]
`FullyShardedStrategy` (FSDP's shards) and `ModelParallelStrategy` (laid-out
DTensors) replace the parameters a scope's modules registered when the scope is
left, and an optimizer built in the scope before then holds the old ones: it must be
pointed at the new ones (`OptimizerWatch.found`). torch has no hook on an optimizer's
construction, and scanning every live object with the garbage collector (as both
strategies once did) is a pass over the whole heap that sees every optimizer of the
process. Instead, while the strategy's outermost scope is active, a torch function
mode (this thread only) notices `Optimizer.add_param_group` reading `is_leaf` of a
parameter the scope recorded (`watch`), and keeps that optimizer, weakly (the
optimizer is the ``self`` of the running ``add_param_group``: no public torch API
names it, so `_torch.optimizer_adding_param_group` finds it, NOTE [private torch]). The mode
passes every other call straight on; it is entered with the outermost scope and left
when the scope is left or `run` begins (from the top of the mode stack only: under a
mode entered later it stays, passing everything on, until a later `stop` finds it on
top). An optimizer built in the scope in another thread is not seen: its step is
refused, as one built from replaced parameters after the scope is.

Example::

    watch = OptimizerWatch()
    watch.start()                        # the outermost scope is entered
    watch.watch(param)                   # a module registered `param` in it
    optimizer = torch.optim.SGD([param]) # noticed
    watch.stop()                         # the scope is left
    assert watch.found() == [optimizer]
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from distribute import _torch

__all__ = ["OptimizerWatch"]


class OptimizerWatch:
    """The optimizers built over watched parameters while the watch runs (NOTE
    [optimizers built in the scope])."""

    def __init__(self) -> None:
        self._found: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._mode = _WatchMode(self._found)

    def watch(self, param: torch.Tensor) -> None:
        """``param`` was registered in the scope: an optimizer built over it is noted."""
        self._mode.watched.add(id(param))

    def start(self) -> None:
        """Starts watching in this thread (the outermost scope is entered)."""
        self._mode.start()

    def stop(self) -> None:
        """Stops watching (the scope is left, or `run` begins)."""
        self._mode.stop()

    def found(self) -> list[torch.optim.Optimizer]:
        """The optimizers noted so far that are still alive."""
        return list(self._found)


class _WatchMode(TorchFunctionMode):
    """Passes every call on; notes the optimizer of an `add_param_group` reading a
    watched parameter's `is_leaf`."""

    def __init__(self, found: weakref.WeakSet[torch.optim.Optimizer]) -> None:
        super().__init__()
        self._found = found
        self.watched: set[int] = set()  # ids of the parameters recorded in the scope
        self._depth: int | None = None  # the mode stack's depth with this mode on top

    def start(self) -> None:
        if self._depth is None:
            self.__enter__()  # type: ignore[no-untyped-call]  # untyped in torch
            self._depth = _torch.function_mode_stack_depth()

    def stop(self) -> None:
        if self._depth is not None and _torch.function_mode_stack_depth() == self._depth:
            self._depth = None
            self.__exit__(None, None, None)  # type: ignore[no-untyped-call]  # untyped in torch
        self.watched = set()

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        if (
            self.watched
            and args
            and getattr(func, "__self__", None) is _torch.is_leaf_property
            and id(args[0]) in self.watched
        ):
            optimizer = _torch.optimizer_adding_param_group()
            if optimizer is not None:
                self._found.add(optimizer)
        return func(*args, **(kwargs or {}))
