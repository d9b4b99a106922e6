"""What a scope built: the engines' one module recorder (docs/architecture.md,
"Composing the engine").

The engines that replace the parameters of the modules built in their scope (sharded
by FSDP2, laid out as DTensors by a layout map, annotated for GSPMD) need the same
three things: the modules that registered parameters or buffers there and the parent
links seen there, so that the *roots* (the outermost modules, in creation order: the
same on every worker) can be handled when the scope is left or at the next `run`; the
optimizers built over those parameters in the scope, to point them at the replacements
(NOTE [optimizers built in the scope] in `_optimizer_watch.py`); and ``no_sync()`` over
the handled roots, nesting. `ModuleRecorder` is that part; what each engine does to a
root stays the engine's.

Example::

    recorder = ModuleRecorder("FullyShardedStrategy")
    recorder.record(layer, layer.weight)      # from the scope's registration hooks
    recorder.record_child(model, layer)
    for root in recorder.take_roots():        # [model]
        replaced = shard(root)                # {id(old parameter): new parameter}
        recorder.repoint(replaced)
        recorder.keep(root)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch

from distribute.errors import InvalidArgumentError
from distribute.strategies._optimizer_watch import OptimizerWatch

__all__ = ["ModuleRecorder"]


class ModuleRecorder:
    """The modules built in a scope, their roots, and the optimizers built over them.

    Args:
        owner: the strategy's name, for the messages (``"FullyShardedStrategy"``).
    """

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._recorded: list[weakref.ref[torch.nn.Module]] = []
        self._parents: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = (
            weakref.WeakKeyDictionary()
        )
        self._roots: list[weakref.ref[torch.nn.Module]] = []
        self._sync_disabled = 0
        #: Optimizers built in the scope over recorded parameters.
        self.optimizers = OptimizerWatch()

    # -- recording in the scope ------------------------------------------------------------

    def record(self, module: torch.nn.Module, parameter: torch.Tensor | None = None) -> None:
        """``module`` registered ``parameter`` (or a buffer: None) in the scope."""
        if parameter is not None:
            self.optimizers.watch(parameter)
        if not any(ref() is module for ref in self._recorded):
            self._recorded.append(weakref.ref(module))

    def record_child(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        """``child`` was attached to ``parent`` in the scope."""
        self._parents[child] = parent

    def root_of(self, module: torch.nn.Module) -> torch.nn.Module:
        """The outermost module holding ``module``, by the parent links recorded since the
        last `take_roots`."""
        seen = {id(module)}
        while (parent := self._parents.get(module)) is not None and id(parent) not in seen:
            module = parent
            seen.add(id(module))
        return module

    @property
    def pending(self) -> bool:
        """Whether modules recorded since the last `take_roots` wait to be handled."""
        return bool(self._recorded)

    def take_roots(self) -> list[torch.nn.Module]:
        """The outermost modules of everything recorded since the last call, in creation
        order (the same on every worker); forgets the records and parent links."""
        recorded = [m for ref in self._recorded if (m := ref()) is not None]
        self._recorded = []
        roots: list[torch.nn.Module] = []
        for module in recorded:
            root = self.root_of(module)
            if all(root is not r for r in roots):
                roots.append(root)
        self._parents = weakref.WeakKeyDictionary()
        return roots

    # -- what was handled --------------------------------------------------------------------

    def keep(self, root: torch.nn.Module) -> None:
        """``root`` was handled (sharded, laid out): `roots` and `no_sync` reach it."""
        self._roots.append(weakref.ref(root))

    def roots(self) -> list[torch.nn.Module]:
        """The handled roots still alive."""
        return [m for ref in self._roots if (m := ref()) is not None]

    def repoint(self, replaced: dict[int, torch.nn.Parameter]) -> None:
        """Points the optimizers built in the scope from replaced parameters (by id) at
        their replacements; refuses one that already holds state for them."""
        if not replaced:
            return
        for optimizer in self.optimizers.found():
            held = [p for g in optimizer.param_groups for p in g["params"] if id(p) in replaced]
            with_state = [p for p in held if optimizer.state.get(p)]
            if with_state:
                raise InvalidArgumentError(
                    f"{type(optimizer).__name__} already holds state for {len(with_state)} "
                    f"parameters that {self._owner} is replacing (it stepped before the "
                    "scope was left); build the optimizer in the strategy's scope before its "
                    "first step, or after the scope was left"
                )
            if held:
                for group in optimizer.param_groups:
                    group["params"] = [replaced.get(id(p), p) for p in group["params"]]

    @contextlib.contextmanager
    def no_sync(self, set_sync: Callable[[torch.nn.Module, bool], None]) -> Iterator[None]:
        """``set_sync(root, False)`` on every handled root as the outermost block is
        entered, ``set_sync(root, True)`` as it is left (blocks nest)."""
        roots = self.roots()
        self._sync_disabled += 1
        if self._sync_disabled == 1:
            for root in roots:
                set_sync(root, False)
        try:
            yield
        finally:
            self._sync_disabled -= 1
            if self._sync_disabled == 0:
                for root in roots:
                    set_sync(root, True)
