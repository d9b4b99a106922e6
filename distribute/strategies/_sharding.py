"""Sharding the modules built in a `FullyShardedStrategy` scope with FSDP2.

# NOTE [sharding]
PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`, parameters as DTensors) does
the sharding; this module decides what it shards and keeps the library's rules
around it:

* **What.** The scope records the modules whose parameters it sees registered,
  and which module each was attached to, so the *roots* (the modules the user
  built, not their parts) are known when the outermost scope is left, or at the
  next `run`. Parameters stay plain tensors until then (no `MirroredVariable`:
  FSDP replaces them by DTensors); buffers are the strategy's mirrored variables,
  averaged after each `run` as under `MultiWorkerMirroredStrategy` (FSDP leaves
  buffers alone).
* **Units.** By default the repeated blocks (the children of a `ModuleList` or
  `Sequential` holding two or more modules of one class with parameters) and the
  root; ``shard_units`` gives classes or a predicate. A parameter shared between
  two units (tied weights) must live in one: the units that share one are left
  to their parent (FSDP would only refuse at the first forward). A unit whose
  trainable parameters have several dtypes is refused now, naming them (FSDP
  asserts at the first forward).
* **The chief's values.** Every worker builds the whole model; rank 0's values are
  broadcast (one packed, checked broadcast) before `fully_shard` takes each rank's
  shard of its own copy (it would otherwise take a patchwork of every rank's
  draws). `deferred_init` avoids the whole copy (NOTE [deferred init]).
* **Sums.** Gradients are SUMMED over the workers, as everywhere in the library
  (the loss is scaled by the global batch). FSDP averages by default;
  `set_gradient_divide_factor(1.0)` alone becomes `PREMUL_SUM`, which gloo refuses,
  so every FSDP module also gets `set_force_sum_reduction_for_comms(True)`: a
  plain SUM on every backend and dtype. `set_reduce_scatter_unused_params(True)`
  keeps the reduce-scatters of every rank the same size when a parameter is
  unused on one (gloo aborts the process on mismatched sizes); an unused
  parameter then gets a zero gradient, not None.
* **No silent hangs.** FSDP's all-gathers and reduce-scatters go through the
  strategy's `ProcessGroupCollectives.watch` (FSDP2's custom comm hooks), so a
  dead or stuck worker is named with the unit and phase ("FSDP all-gather of
  'blocks.2' (forward)") within the timeout. HSDP is FSDP over each shard group
  plus an all-reduce hook over the replicate group, watched the same way.
* **Optimizers built in the scope** hold the parameters FSDP replaced: they are
  pointed at the shards (an optimizer with state for them is refused), and the
  replaced parameters are marked so that a step over them is refused. Which
  optimizers: NOTE [optimizers built in the scope] in `_optimizer_watch.py`.

# NOTE [deferred init]
With ``deferred_init=True`` no worker ever holds the whole model, and the values are
still exactly the chief's ``torch.manual_seed(s); Model()``. Entering the outermost
scope broadcasts the chief's CPU generator state (5 KB) and every other worker forks
its generator to it, so each runs the constructor drawing the chief's numbers, with no
values sent (afterwards the chief's generator has advanced as building alone would
have advanced it, and the others have their own back, un-advanced). Built-in modules
initialize their parameters inside their own ``__init__``; so when a module registers
its first parameter, the parameters of every module registered before it are
finished: each worker keeps its FSDP shard of them
(``torch.chunk(p, shard_group_size, 0)[rank]``, FSDP2's layout) and turns them into
meta tensors in place (`swap_tensors`: references and ties survive). A dispatch mode
refuses any later use of a meta parameter (a parent's ``self.apply(init_weights)``,
a ``copy_`` into it), which would otherwise give silently wrong numbers:
`LateInitError` says to build with ``deferred_init=False``. When the scope is left,
FSDP shards the meta parameters, ``to_empty`` gives the shards memory, and each
worker copies in the shards it kept; buffers stay real throughout. Peak memory is a
worker's shards plus the module being built (about 18.5 MiB for a 34 MiB model on 2
workers in the research memo).
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

from distribute import _marks, _torch
from distribute.errors import InvalidArgumentError, LateInitError
from distribute.strategies._module_recorder import ModuleRecorder

if TYPE_CHECKING:
    from distribute.collectives.process_group import ProcessGroupCollectives

__all__ = [
    "DeferredInit",
    "LateInitError",
    "ShardedModules",
    "ShardingOptions",
    "UnitChooser",
    "choose_units",
    "device_mesh",
]

#: FSDP2's base classes of custom collectives (a private module of FSDP2).
_AllGather: Any
_ReduceScatter: Any
_AllGather, _ReduceScatter = _torch.fsdp_comm_hook_bases()

#: torch 2.13 renamed the *_tensor collectives (now deprecated) to *_single.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

#: Classes whose instances are sharding units, or a predicate of (name, module).
UnitChooser = Sequence[type[torch.nn.Module]] | Callable[[str, torch.nn.Module], bool]


@dataclass(frozen=True)
class ShardingOptions:
    """How the modules are sharded (see `FullyShardedStrategy`)."""

    reshard_after_forward: bool = True
    mesh_shape: tuple[int, int] | None = None
    shard_units: UnitChooser | None = None
    mixed_precision: Any = None
    cpu_offload: bool = False
    deferred_init: bool = False


class ShardedModules:
    """The modules a scope built, and their sharding (NOTE [sharding]): the replicated
    engine's `ModuleCapture` and `ScopeLifecycle` under `FullyShardedStrategy`
    (`_engine_parts.py`). Parameters registered in the scope stay plain and are
    recorded; the roots are sharded when the outermost scope is left or at the next
    `run`; buffers and `ds.Variable`s stay the engine's mirrored variables.

    Args:
        strategy: the strategy whose parameters these are.
        options: `ShardingOptions`.
        collectives: the workers' collectives (watch FSDP's, broadcast values).
        device: this worker's device.
        mesh: the 1-D device mesh FSDP shards over (the whole world unless HSDP).
        replicate_group: HSDP's replicate group, or None.
    """

    def __init__(
        self,
        strategy: Any,
        options: ShardingOptions,
        collectives: ProcessGroupCollectives,
        device: torch.device,
        mesh: Any,
        replicate_group: Any = None,
    ) -> None:
        self._strategy_ref = weakref.ref(strategy)
        self._options = options
        self._collectives = collectives
        self._device = device
        self._mesh = mesh
        self._replicate_group = replicate_group
        # What the scope built, its sharded roots, the optimizers built over them.
        self._recorder = ModuleRecorder("FullyShardedStrategy")
        self._watch = self._recorder.optimizers
        self._deferred: DeferredInit | None = None
        self._kept: dict[int, torch.Tensor] = {}  # deferred init: id(parameter) -> shard

    # -- the engine's parts: capture (`ModuleCapture`) and lifecycle (`ScopeLifecycle`) ---

    def captures(self, module: torch.nn.Module, tensor: torch.Tensor) -> bool:
        """Not FSDP's own re-registrations (a module with its own __setattr__ at every
        unshard) nor DTensors (`load_state_dict(assign=True)` of sharded values)."""
        from torch.distributed.tensor import DTensor

        return not isinstance(tensor, DTensor) and not isinstance(module, FSDPModule)

    def capture_parameter(
        self, module: torch.nn.Module, name: str, param: torch.nn.Parameter
    ) -> torch.nn.Parameter | None:
        """Records the parameter; it stays a plain parameter until FSDP shards it."""
        self.record(module, name, param)
        return None

    def capture_buffer(
        self, module: torch.nn.Module, name: str, buffer: torch.Tensor
    ) -> torch.Tensor | None:
        """A buffer stays the engine's mirrored variable (FSDP shards parameters only)."""
        from distribute.variables import capture_buffer

        return capture_buffer(self._strategy_ref(), module, name, buffer)  # type: ignore[arg-type]  # alive while its scope is

    def capture_submodule(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        self.record_child(parent, child)

    def scope_entered(self) -> None:
        self._watch.start()
        self.begin_deferred()

    def scope_leaving(self) -> None:
        self._watch.stop()
        if self.pending:
            self.shard_pending()

    def scope_left(self) -> None:
        """Nothing: the roots were sharded as the strategy's scope was left."""

    def placed(self, variables: list[Any]) -> None:
        """Nothing: buffers and `ds.Variable`s stay mirrored variables."""

    def before_run(self) -> None:
        self._watch.stop()
        if self.pending:
            self.shard_pending()

    # -- recording in the scope --------------------------------------------------------

    def record(self, module: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
        """``module`` registered parameter ``name`` in the scope."""
        if self._deferred is not None:
            self._deferred.registered(module, name, param)
        self._recorder.record(module, param)

    # -- deferred initialization (NOTE [deferred init]) ----------------------------------

    def begin_deferred(self) -> None:
        """Entering the outermost scope: from here until the modules are sharded, every
        worker draws the chief's numbers and keeps only its shards."""
        if not self._options.deferred_init or self._deferred is not None:
            return
        state = torch.get_rng_state()
        if self._collectives.world_size > 1:
            self._collectives.broadcast([state], 0, name="the chief's random state")
        shard_rank, shard_size = self._mesh.get_local_rank(), self._mesh.size()
        chief = self._collectives.rank == 0
        self._deferred = DeferredInit(None if chief else state, shard_rank, shard_size)

    def end_deferred(self) -> None:
        """The modules are built: later draws are each worker's own again."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            deferred.close()
            self._kept = deferred.shards

    def record_child(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        """``child`` was attached to ``parent`` in the scope."""
        self._recorder.record_child(parent, child)

    @property
    def pending(self) -> bool:
        """Whether modules wait to be sharded."""
        return self._recorder.pending

    def roots(self) -> list[torch.nn.Module]:
        """The sharded roots still alive."""
        return self._recorder.roots()

    # -- sharding ------------------------------------------------------------------------

    def shard_pending(self) -> None:
        """Shards every root built since the last call (NOTE [sharding])."""
        self.end_deferred()
        for root in self._recorder.take_roots():  # the same order on every worker
            self._shard(root)

    def _shard(self, root: torch.nn.Module) -> None:
        if isinstance(root, FSDPModule):
            return
        if isinstance(root, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            # A container without a forward cannot be a unit: its elements are roots.
            for child in root.children():
                if any(True for _ in child.parameters()):
                    self._shard(child)
            return
        strategy = self._strategy_ref()
        units = choose_units(root, self._options.shard_units)
        check_unit_dtypes(root, units)
        before = dict(root.named_parameters(remove_duplicate=False))
        originals = list({id(p): p for p in before.values()}.values())
        kept = self._kept
        deferred = bool(originals) and all(id(p) in kept for p in originals)
        if not deferred:
            self._broadcast_chief_values(originals)
        buffers = [
            (m, n, b) for m in root.modules() for n, b in m._buffers.items() if b is not None
        ]
        common: dict[str, Any] = {"mesh": self._mesh}
        if self._options.mixed_precision is not None:
            common["mp_policy"] = self._options.mixed_precision
        if self._options.cpu_offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            common["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        reshard = self._options.reshard_after_forward
        for unit in units:  # deepest first
            fully_shard(unit, reshard_after_forward=reshard, **common)
        fully_shard(root, reshard_after_forward=None if reshard else False, **common)
        for module in root.modules():
            if isinstance(module, FSDPModule):
                self._configure(module, root)
        after = dict(root.named_parameters(remove_duplicate=False))
        if deferred:
            _materialize(root, before, after, kept, buffers, self._device)
        replaced: dict[int, torch.nn.Parameter] = {}
        for name, new in after.items():
            _marks.mark_managed(new, strategy)  # read by the step hooks
            old = before.get(name)
            if old is not None and old is not new:
                replaced[id(old)] = new
        for old in originals:
            if id(old) in replaced:
                _marks.mark_sharded_away(old)  # a step over it is refused
        self._recorder.repoint(replaced)
        root.register_forward_pre_hook(self._forward_outside_run, prepend=True)
        self._recorder.keep(root)

    def _broadcast_chief_values(self, params: Sequence[torch.Tensor]) -> None:
        """Every worker takes rank 0's values before FSDP keeps its shard of them."""
        if self._collectives.world_size > 1 and params:
            with torch.no_grad():
                self._collectives.broadcast(
                    [p.detach() for p in params], 0, name="initial parameter values"
                )

    def _configure(self, module: Any, root: torch.nn.Module) -> None:
        """Sum semantics, same-size reduce-scatters and watched collectives."""
        module.set_force_sum_reduction_for_comms(True)
        module.set_gradient_divide_factor(1.0)
        if hasattr(module, "set_reduce_scatter_unused_params"):  # torch 2.11 lacks it
            module.set_reduce_scatter_unused_params(True, recurse=False)
        groups = _torch.fsdp_param_groups(module)  # raises if torch moved them
        if len(groups) == 1:
            name = _module_name(root, module)
            module.set_custom_all_gather(_WatchedAllGather(self._collectives, groups[0], name))
            module.set_custom_reduce_scatter(
                _WatchedReduceScatter(self._collectives, groups[0], name)
            )
        if self._replicate_group is not None:
            module.set_all_reduce_hook(
                _ReplicateAllReduce(self._collectives, self._replicate_group, module, root)
            )

    def _forward_outside_run(self, module: torch.nn.Module, args: Any) -> None:
        """A sharded model's forward is a collective: outside `run` every worker must
        call it together (a forward on the chief alone would wait in FSDP's all-gather);
        one small checked exchange first names the workers that do not."""
        from distribute import context

        strategy = self._strategy_ref()
        if context._current_replica_context_for(strategy) is not None:  # type: ignore[arg-type]
            return
        if self._collectives.world_size > 1:
            self._collectives.check_same(
                ("forward of a sharded model", type(module).__name__),
                name=(
                    "forward of a FullyShardedStrategy model outside `run` (a collective of "
                    "every worker: call it on every worker, e.g. inside strategy.run)"
                ),
            )

    # -- accumulation ------------------------------------------------------------------------

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate unreduced gradients (FSDP keeps them whole)."""
        return self._recorder.no_sync(_set_gradient_sync)


def _set_gradient_sync(root: torch.nn.Module, sync: bool) -> None:
    root.set_requires_gradient_sync(sync)  # type: ignore[operator]  # an FSDPModule's


# -- units --------------------------------------------------------------------------------


def choose_units(root: torch.nn.Module, chooser: UnitChooser | None) -> list[torch.nn.Module]:
    """The sharding units under ``root`` (root excluded), deepest first (NOTE [sharding])."""
    named = [(name, m) for name, m in root.named_modules() if m is not root]
    if chooser is None:
        candidates = _repeated_blocks(root)
    elif callable(chooser) and not isinstance(chooser, (list, tuple)):
        candidates = [m for name, m in named if chooser(name, m)]
    else:
        classes = tuple(chooser)
        candidates = [m for _, m in named if isinstance(m, classes)]
    candidates = [m for m in candidates if any(True for _ in m.parameters())]
    for m in candidates:
        if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            raise InvalidArgumentError(
                f"shard_units chose a {type(m).__name__}, which has no forward; FSDP shards "
                "modules that run: choose its elements (the blocks) instead"
            )
    candidates = _without_split_ties(root, candidates)
    depth = {id(m): name.count(".") + 1 for name, m in named}
    return sorted(candidates, key=lambda m: -depth[id(m)])


def _repeated_blocks(root: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of every `ModuleList`/`Sequential` holding two or more modules of
    one class with parameters (a transformer's layers, an MLP's linear layers)."""
    blocks: list[torch.nn.Module] = []
    for container in root.modules():
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = [c for c in container.children() if any(True for _ in c.parameters())]
        counts = collections.Counter(type(c) for c in children)
        blocks.extend(c for c in children if counts[type(c)] >= 2)
    return blocks


def _without_split_ties(
    root: torch.nn.Module, candidates: list[torch.nn.Module]
) -> list[torch.nn.Module]:
    """Drops units that share a parameter with anything outside them (tied weights
    go to their parent unit, where both ends live)."""
    while True:
        owner: dict[int, int] = {}  # parameter id -> the innermost candidate holding it
        inside = {id(c): {id(p) for p in c.parameters()} for c in candidates}
        for index, c in enumerate(candidates):
            for p in c.parameters():
                previous = owner.get(id(p))
                # the innermost: a candidate inside another holds fewer parameters
                if previous is None or len(inside[id(c)]) < len(inside[id(candidates[previous])]):
                    owner[id(p)] = index
        split: set[int] = set()
        for _, module in root.named_modules(remove_duplicate=False):
            for p in module.parameters(recurse=False):
                holder = owner.get(id(p))
                if holder is None:
                    continue
                if not any(module is m for m in candidates[holder].modules(remove_duplicate=False)):
                    split.add(holder)  # used by a module outside its unit: a tie
        if not split:
            return candidates
        candidates = [c for i, c in enumerate(candidates) if i not in split]


def check_unit_dtypes(root: torch.nn.Module, units: Sequence[torch.nn.Module]) -> None:
    """Refuses a unit (or the root's own parameters) whose trainable parameters have
    several dtypes: FSDP flattens each unit into one buffer of one dtype."""
    claimed: set[int] = set()
    for unit in [*units, root]:
        names: dict[torch.dtype, list[str]] = {}
        for name, p in unit.named_parameters():
            if id(p) in claimed:
                continue
            claimed.add(id(p))
            if p.requires_grad:
                names.setdefault(p.dtype, []).append(name)
        if len(names) > 1:
            listed = "; ".join(f"{dtype}: {', '.join(ns[:3])}" for dtype, ns in names.items())
            where = "the root" if unit is root else f"unit {type(unit).__name__}"
            raise InvalidArgumentError(
                f"{where} holds trainable parameters of several dtypes ({listed}); FSDP shards "
                "each unit as one flat buffer of one dtype. Cast the module (module.to(dtype)), "
                "or make the parameters of each dtype a unit of their own (shard_units)"
            )


# -- FSDP's collectives, watched ---------------------------------------------------------


def _module_name(root: torch.nn.Module, module: torch.nn.Module) -> str:
    if module is root:
        return "<root>"
    for name, m in root.named_modules():
        if m is module:
            return str(name)
    return type(module).__name__


class _Watched:
    """Issues FSDP's collective asynchronously and waits for it under the strategy's
    deadline and diagnosis (`ProcessGroupCollectives.watch`)."""

    def __init__(self, collectives: ProcessGroupCollectives, param_group: Any, name: str) -> None:
        self._collectives = collectives
        self._group = param_group
        self._name = name

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _label(self, what: str) -> str:
        return f"FSDP {what} of {self._name!r} ({_torch.fsdp_phase(self._group)})"


class _WatchedAllGather(_Watched, _AllGather):  # type: ignore[misc]  # an FSDP base: Any
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        async_op: bool = False,
    ) -> None:
        self._collectives.watch(
            "all_gather",
            self._label("all-gather"),
            lambda: _all_gather_single(output_tensor, input_tensor, group=group, async_op=True),
        )
        return None  # done: FSDP waits only for a returned work


class _WatchedReduceScatter(_Watched, _ReduceScatter):  # type: ignore[misc]  # an FSDP base: Any
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> None:
        self._collectives.watch(
            "reduce_scatter",
            self._label("reduce-scatter"),
            lambda: _reduce_scatter_single(
                output_tensor, input_tensor, op=op, group=group, async_op=True
            ),
        )
        return None


class _ReplicateAllReduce:
    """HSDP: each shard's gradient summed over the replicate group, in place, watched."""

    def __init__(
        self,
        collectives: ProcessGroupCollectives,
        group: Any,
        module: torch.nn.Module,
        root: torch.nn.Module,
    ) -> None:
        self._collectives = collectives
        self._group = group
        self._name = _module_name(root, module)

    def __call__(self, tensor: torch.Tensor) -> None:
        self._collectives.watch(
            "all_reduce",
            f"HSDP all-reduce of {self._name!r} over the replicate group",
            lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group, async_op=True),
        )


# -- meshes and optimizers ---------------------------------------------------------------


def device_mesh(
    device: torch.device, world_size: int, shape: tuple[int, int] | None
) -> tuple[Any, Any]:
    """(the 1-D mesh FSDP shards over, HSDP's replicate group or None), built with
    `init_device_mesh` and named dimensions: ``("shard",)`` over every worker, or
    ``("replicate", "shard")`` for HSDP (shard groups of consecutive ranks, replicate
    groups of ranks ``shard`` apart). Every rank builds it, in the same order."""
    from torch.distributed.device_mesh import init_device_mesh

    if shape is None:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",)), None
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    return mesh["shard"], mesh["replicate"].get_group()


# -- deferred initialization ----------------------------------------------------------------


#: Operations that only look at a finished (meta) parameter's metadata.
_METADATA_OPS = frozenset(
    {"aten::detach", "aten::alias", "aten::view", "aten::t", "aten::empty_like"}
)


class DeferredInit:
    """Streams a model's construction into shards (NOTE [deferred init]).

    Args:
        chief_state: the chief's CPU generator state, which this worker draws from
            until `close` gives it its own back; None on the chief, whose generator
            advances as it would building the model alone.
        rank: this worker's index in its shard group.
        size: the shard group's size.
    """

    def __init__(self, chief_state: torch.Tensor | None, rank: int, size: int) -> None:
        self._rank, self._size = rank, size
        self.shards: dict[int, torch.Tensor] = {}  # id(parameter) -> this worker's shard
        self._pending: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
        self._stack = contextlib.ExitStack()
        if chief_state is not None:
            self._stack.enter_context(torch.random.fork_rng(devices=[]))
            torch.set_rng_state(chief_state)

        class Guard(_torch.TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped in torch
            def __torch_dispatch__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                kwargs = kwargs or {}
                if func._schema.name not in _METADATA_OPS:
                    for a in _torch.tree_leaves((args, kwargs)):
                        if isinstance(a, torch.Tensor) and a.is_meta:
                            raise LateInitError(
                                f"{func._schema.name} used a parameter after its module was "
                                "built, under deferred_init=True: each worker keeps only its "
                                "shard of a module's parameters once the next module registers "
                                "its own, so code that initializes or reads them later (a "
                                "parent's self.apply(init_weights), a copy_ into them) cannot be "
                                "reproduced. Build the model with deferred_init=False (every "
                                "worker holds it whole until it is sharded), or initialize each "
                                "module inside its own __init__"
                            )
                return func(*args, **kwargs)

        self._stack.enter_context(Guard())  # type: ignore[no-untyped-call]  # untyped in torch

    def registered(self, module: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
        """A module registers a parameter: the parameters of the modules registered
        before it are finished (a module initializes its own in its __init__)."""
        if id(param) in self.shards or any(p is param for _, _, p in self._pending):
            return  # a tie to a parameter already seen
        self._finish(except_module=module)
        self._pending.append((module, name, param))

    def _finish(self, except_module: torch.nn.Module | None = None) -> None:
        keep = []
        for module, name, param in self._pending:
            if module is except_module:
                keep.append((module, name, param))
                continue
            if module._parameters.get(name) is not param:
                continue  # replaced (a tie assigned over it): nothing to keep
            chunks = torch.chunk(param.detach(), self._size, dim=0)
            shard = chunks[self._rank] if self._rank < len(chunks) else param.new_empty(0)
            self.shards[id(param)] = shard.clone()
            with torch.no_grad():
                meta = torch.nn.Parameter(
                    torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
                )
                torch.utils.swap_tensors(param, meta)  # type: ignore[no-untyped-call]  # untyped in torch
        self._pending = keep

    def close(self) -> None:
        """Finishes every parameter, leaves the guard and gives this worker its own
        generator back."""
        try:
            self._finish()
        finally:
            self._stack.close()


def _materialize(
    root: torch.nn.Module,
    before: dict[str, torch.nn.Parameter],
    after: dict[str, torch.nn.Parameter],
    kept: dict[int, torch.Tensor],
    buffers: list[tuple[torch.nn.Module, str, torch.Tensor]],
    device: torch.device,
) -> None:
    """Gives the meta-device shards real memory and the values each worker kept;
    puts the buffers (real all along) back after `to_empty` replaced them."""
    root.to_empty(device=device)
    with torch.no_grad():
        for name, new in after.items():
            shard = kept[id(before[name])]
            local = new.to_local()  # type: ignore[attr-defined]  # a DTensor
            if local.numel():
                local.copy_(shard.reshape(local.shape))
    for module, name, buffer in buffers:
        module._buffers[name] = buffer
