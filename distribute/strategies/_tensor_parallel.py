"""Laying out the modules built in a `ModelParallelStrategy` scope on the mesh.

# NOTE [model parallel layout]
The batch axis of the mesh is data parallel; every other axis (the *model* axes) splits
variables. Each variable becomes a DTensor on the model sub-mesh, ``Shard(d)`` along
the axis its layout names for dimension ``d`` and ``Replicate()`` along the others;
along the batch axis every group of workers holds its own copy (its gradients are
summed across the batch axis, or FSDP2 shards it there with ``fully_shard=True``, as
torchtitan composes tensor and data parallelism).

* **Every variable is a DTensor, and so is every activation inside the model.** A
  module mixing a DTensor parameter with a plain activation is refused by DTensor,
  and so are ``clip_grad_norm_`` and foreach optimizers over a mix of DTensor and plain
  parameters; so unmapped variables are ``Replicate()`` DTensors too. The outermost
  module call (a model, or any module of it called directly) converts its tensor
  arguments to replicated DTensors and its DTensor results back to whole plain tensors
  (`GlobalView`), so the step's own code (the loss, metrics, ``.item()``) sees plain
  tensors, as on one device. Inside the call tensors made by the model's code (a mask,
  ``torch.arange``) are taken as replicated (DTensor's ``implicit_replication``), and on
  CPUs ``scaled_dot_product_attention`` runs its math kernel, the one DTensor can split
  (it has no rule for the CPU flash kernel).
* **The fast path is torch's.** Where the map makes an ``nn.Linear`` column-parallel
  (weight ``(axis, None)``, bias ``(axis,)`` or none) or row-parallel (weight
  ``(None, axis)``, bias replicated or none), or splits an ``nn.Embedding``, on a mesh
  with one model axis, torch's ``ColwiseParallel``/``RowwiseParallel`` drive it
  (`choose_styles`): the column-parallel output stays split on its last dimension, the
  row-parallel layer sums its partial products in one all-reduce, so an MLP or an
  attention block costs one all-reduce in forward and one in backward, and no
  activation is gathered. The outputs stay DTensors (``use_local_output=False``), so
  the model's own reshapes (``view(B, T, n_heads, head_dim)``) keep their one-device
  shapes. One thing is added to torch's column-parallel input: a replicated DTensor
  input is passed as a fresh replicated DTensor of the same local tensor, so its
  gradient (a partial sum) is summed there, in one all-reduce, as torch does for a
  plain input; without it the partial sum flowed back into the previous row-parallel
  layer and DTensor gathered activations to finish it (3 all-gathers per step more,
  11% slower on the benchmark's MLP).
* **Everything else propagates.** Any other layout (a 2-D model mesh, a conv weight,
  a bias left replicated under a column-split weight) is a DTensor whose operations
  DTensor's sharding propagation runs, redistributing as each op needs: correct,
  sometimes slower.
* **The chief's values.** Every worker builds the whole model on its CPU; rank 0's
  values are broadcast (one packed broadcast), then each worker keeps its part
  (``distribute_tensor(..., src_data_rank=None)``: no further communication). The same
  seed gives one device's initial weights.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from distribute import _marks, _torch
from distribute.strategies._layout import (
    LayoutMap,
    TensorLayout,
    map_paths,
    resolve_layouts,
    resolve_output_layouts,
    shard_dims,
)
from distribute.strategies._layout_hooks import (
    EmptySkippedInCat,
    OutputLayout,
    grad_sums_here,
    lay_out_loaded_values,
    partial_sums_here,
    transposed_style,
    warn_unmatched,
)
from distribute.strategies._module_recorder import ModuleRecorder

if TYPE_CHECKING:
    from distribute.collectives.process_group import ProcessGroupCollectives

__all__ = [
    "GlobalView",
    "LaidOutModules",
    "MeshPlan",
    "NoSyncDepth",
    "Style",
    "choose_styles",
    "is_conv1d",
    "plain_is_replicated",
]


class Style(enum.Enum):
    """How a module holding laid-out variables runs."""

    COLWISE = "colwise"  # torch's ColwiseParallel
    ROWWISE = "rowwise"  # torch's RowwiseParallel
    PROPAGATE = "propagate"  # DTensor's sharding propagation


def _is(module: torch.nn.Module, cls: type[torch.nn.Module]) -> bool:
    """Whether ``module`` runs ``cls``'s own forward (subclasses that change the forward,
    or modules whose parameters another module's code reads, are not the pattern)."""
    return isinstance(module, cls) and type(module).forward is cls.forward


def choose_styles(
    module: torch.nn.Module,
    layouts: dict[str, TensorLayout | None],
    model_axes: tuple[str, ...],
) -> dict[str, Style]:
    """The style of every module (by path) that holds a laid-out variable of its own.

    A pure function of the module tree and the layouts (`resolve_layouts`). Torch's
    styles need one model axis; a variable shared by two modules (tied weights)
    propagates.

    Example:
        >>> import torch
        >>> from distribute.strategies._tensor_parallel import choose_styles
        >>> from distribute.strategies._layout import TensorLayout as L
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
        >>> layouts = {"0.weight": L(("model", None)), "0.bias": L(("model",)),
        ...            "1.weight": L((None, "model")), "1.bias": None}
        >>> choose_styles(mlp, layouts, ("model",))
        {'0': <Style.COLWISE: 'colwise'>, '1': <Style.ROWWISE: 'rowwise'>}
    """
    owners: dict[int, int] = {}
    for _, m in module.named_modules(remove_duplicate=False):
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None:
                owners[id(t)] = owners.get(id(t), 0) + 1
    styles: dict[str, Style] = {}
    for path, m in module.named_modules():
        prefix = f"{path}." if path else ""
        own = {
            name: layouts.get(prefix + name)
            for name, t in [*m._parameters.items(), *m._buffers.items()]
            if t is not None
        }
        if not any(_splits(layout) for layout in own.values()):
            continue
        tied = any(
            owners.get(id(t), 0) > 1
            for t in [*m._parameters.values(), *m._buffers.values()]
            if t is not None
        )
        style = None if tied or len(model_axes) != 1 else _torch_style(m, own, model_axes[0])
        styles[path] = style or Style.PROPAGATE
    return styles


def _splits(layout: TensorLayout | None) -> bool:
    return layout is not None and any(a is not None for a in layout.axes)


def _torch_style(
    m: torch.nn.Module, own: dict[str, TensorLayout | None], axis: str
) -> Style | None:
    """Torch's style for a Linear or Embedding laid out as it lays them out, else None."""
    axes = {name: (layout.axes if layout is not None else None) for name, layout in own.items()}
    if set(axes) - {"weight", "bias"}:
        return None
    weight, bias = axes.get("weight"), axes.get("bias")
    has_bias = "bias" in axes
    if _is(m, torch.nn.Linear):
        if weight == (axis, None) and (not has_bias or bias == (axis,)):
            return Style.COLWISE
        if weight == (None, axis) and (not has_bias or bias in (None, (None,))):
            return Style.ROWWISE
    if _is(m, torch.nn.Embedding) and not has_bias:
        if weight == (axis, None):
            return Style.ROWWISE
        if weight == (None, axis):
            return Style.COLWISE
    if is_conv1d(m):  # weight (in, out): the Linear's layouts transposed
        if weight == (None, axis) and (not has_bias or bias == (axis,)):
            return Style.COLWISE
        if weight == (axis, None) and (not has_bias or bias in (None, (None,))):
            return Style.ROWWISE
    return None


def is_conv1d(module: torch.nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (GPT-2's projections: a linear
    layer whose weight is ``(in_features, out_features)``, ``x @ weight + bias``), found
    without importing transformers."""
    cls = type(module)
    return (
        cls.__name__ == "Conv1D"
        and cls.__module__.startswith("transformers.")
        and hasattr(module, "nf")
    )


@dataclass(frozen=True)
class MeshPlan:
    """The torch mesh and its parts, as one worker sees them.

    Attributes:
        mesh: torch's `DeviceMesh` over every worker, axes named as the user's.
        batch_axis: the name of the data-parallel axis.
        model_axes: the other axes' names (may be empty).
        model_mesh: torch's sub-mesh of the model axes (None when there are none).
        batch_mesh: torch's sub-mesh of the batch axis (this worker's batch group).
        device: this worker's device.
    """

    mesh: Any
    batch_axis: str
    model_axes: tuple[str, ...]
    model_mesh: Any
    batch_mesh: Any
    device: torch.device

    @property
    def batch_size(self) -> int:
        """The size of the batch axis (the replicas in sync)."""
        return int(self.batch_mesh.size())

    def describe_rank(self, rank: int) -> str:
        """A global rank with its mesh coordinates, as errors name it: ``"rank 3
        (batch 1, model 1)"``."""
        grid = self.mesh.mesh
        found = (grid == rank).nonzero()
        if len(found) == 0:
            return f"rank {rank}"
        names = self.mesh.mesh_dim_names or tuple(str(i) for i in range(grid.dim()))
        where = ", ".join(f"{n} {int(i)}" for n, i in zip(names, found[0].tolist()))
        return f"rank {rank} ({where})"


class GlobalView:
    """The outermost module call converts to and from DTensors (NOTE [model parallel
    layout]); calls nested inside it pass their DTensors through.

    Args:
        mesh: the model sub-mesh activations live on.
    """

    def __init__(self, mesh: Any) -> None:
        self._mesh = mesh
        self._state = threading.local()
        self._cpu = mesh.device_type == "cpu"

    def _depth(self) -> int:
        return int(getattr(self._state, "depth", 0))

    def attach(self, module: torch.nn.Module) -> None:
        """Converts at ``module``'s calls when it is the outermost one."""
        module.register_forward_pre_hook(self._enter, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._exit, always_call=True)

    def _enter(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        depth = self._depth()
        self._state.depth = depth + 1
        if depth:
            return None
        from torch.distributed.tensor import DTensor, Replicate

        stack = contextlib.ExitStack()
        stack.enter_context(plain_is_replicated())
        stack.enter_context(EmptySkippedInCat())
        if self._cpu:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        self._state.stack = stack
        replicate = [Replicate()] * self._mesh.ndim

        def to_dtensor(t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, DTensor):
                return t
            return DTensor.from_local(t, self._mesh, replicate, run_check=False)

        converted: tuple[tuple[Any, ...], dict[str, Any]] = _torch.tree_map_only(
            torch.Tensor, to_dtensor, (args, kwargs)
        )
        return converted

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        depth = self._depth() - 1
        self._state.depth = depth
        if depth:
            return None
        stack = getattr(self._state, "stack", None)
        if stack is not None:
            self._state.stack = None
            stack.close()
        from torch.distributed.tensor import DTensor

        return _torch.tree_map_only(DTensor, lambda t: t.full_tensor(), output)


@contextlib.contextmanager
def plain_is_replicated() -> Iterator[None]:
    """DTensor takes a plain tensor that meets a DTensor as replicated inside the block,
    and leaves the setting as it found it (torch's ``implicit_replication`` turns it
    off on the way out, also inside an outer block that had turned it on)."""
    before = _torch.allow_implicit_replication(True)
    try:
        yield
    finally:
        _torch.allow_implicit_replication(before)


class NoSyncDepth:
    """How deep the strategy is inside ``no_sync()`` (read by its gradient sums)."""

    def __init__(self) -> None:
        self.depth = 0

    def active(self) -> bool:
        return self.depth > 0


class LaidOutModules:
    """The modules a scope built, and their layout (NOTE [model parallel layout]): the
    engine's `ModuleCapture` and `ScopeLifecycle` (`_engine_parts.py`). Parameters and
    buffers registered in the scope stay plain and are recorded; the roots are laid out
    when the outermost scope is left or at the next `run`.

    Args:
        strategy: the strategy whose variables these become.
        layout_map: the user's map.
        plan: the mesh and its parts.
        world: collectives over every worker (the chief's values).
        fully_shard: FSDP2 shards along the batch axis too.
        no_sync: the ``no_sync()`` depth, which `no_sync` keeps.
        track: told the trainable parameters each layout adds (the batch-axis sums).
    """

    def __init__(
        self,
        strategy: Any,
        layout_map: LayoutMap,
        plan: MeshPlan,
        world: ProcessGroupCollectives,
        fully_shard: bool,
        no_sync: NoSyncDepth,
        track: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> None:
        self._no_sync = no_sync
        self._track = track
        self._strategy_ref = weakref.ref(strategy)
        self._layout_map = layout_map
        self._plan = plan
        self._world = world
        self._fully_shard = fully_shard and plan.batch_size > 1
        self._view = GlobalView(plan.model_mesh) if plan.model_mesh is not None else None
        # What the scope built, its laid-out roots, the optimizers built over them.
        self._recorder = ModuleRecorder("ModelParallelStrategy")
        self.optimizers = self._recorder.optimizers
        #: The laid-out trainable parameters whose gradients the batch-axis sums handle
        #: (FSDP2 sums those of a root it shards along the batch axis).
        self.trainable: list[torch.Tensor] = []

    def in_no_sync(self) -> bool:
        """Whether the strategy is inside ``no_sync()``."""
        return self._no_sync.active()

    # -- the engine's parts: capture (`ModuleCapture`) and lifecycle (`ScopeLifecycle`) ---

    def captures(self, module: torch.nn.Module, tensor: torch.Tensor) -> bool:
        """Not our own layout, torch's styles or FSDP's (un)sharded parameters (neither
        module is imported before something of this strategy has used it)."""
        dtensor = sys.modules.get("torch.distributed.tensor")
        if dtensor is not None and isinstance(tensor, dtensor.DTensor):
            return False
        fsdp = sys.modules.get("torch.distributed.fsdp")
        return fsdp is None or not isinstance(module, fsdp.FSDPModule)

    def capture_parameter(
        self, module: torch.nn.Module, name: str, param: torch.nn.Parameter
    ) -> torch.nn.Parameter | None:
        self.record(module, param)
        return None  # a plain parameter until the module is laid out

    def capture_buffer(
        self, module: torch.nn.Module, name: str, buffer: torch.Tensor
    ) -> torch.Tensor | None:
        self.record(module)
        return None

    def capture_submodule(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        self.record_child(parent, child)

    def scope_entered(self) -> None:
        self.optimizers.start()  # NOTE [optimizers built in the scope]

    def scope_leaving(self) -> None:
        self.optimizers.stop()
        self.lay_out_pending()

    def scope_left(self) -> None:
        """Nothing: the roots were laid out as the scope was left."""

    def before_run(self) -> None:
        self.optimizers.stop()
        self.lay_out_pending()

    def placed(self, variables: list[Any]) -> None:
        """Nothing: this engine places no variables of its own."""

    # -- recording in the scope ------------------------------------------------------------

    def record(self, module: torch.nn.Module, tensor: torch.Tensor | None = None) -> None:
        """``module`` registered a parameter (``tensor``) or buffer in the scope."""
        self._recorder.record(module, tensor)

    def record_child(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        """``child`` was attached to ``parent`` in the scope."""
        self._recorder.record_child(parent, child)

    @property
    def pending(self) -> bool:
        """Whether modules wait to be laid out."""
        return self._recorder.pending

    def roots(self) -> list[torch.nn.Module]:
        """The laid-out roots still alive."""
        return self._recorder.roots()

    # -- laying out ------------------------------------------------------------------------

    def lay_out_pending(self) -> None:
        """Lays out every root built since the last call, in creation order (the same on
        every worker)."""
        if not self._recorder.pending:
            return
        known = len(self.trainable)
        roots = self._recorder.take_roots()
        for root in roots:
            self._lay_out(root)
        if self._track is not None:
            self._track(self.trainable[known:])
        if roots and self._world.rank == 0:
            warn_unmatched(self._layout_map, [p for root in roots for p in map_paths(root)])

    def _lay_out(self, root: torch.nn.Module) -> None:
        plan = self._plan
        # NOTE [the batch axis in a layout]: a variable whose layout names the batch
        # axis is split along it by FSDP2 (Keras allows it; API.md), the model axes by
        # DTensor as usual; FSDP2 then shards the whole root along the batch axis (its
        # other variables on dim 0, as fully_shard=True), so that every parameter and
        # gradient lives on the one 2-D mesh (clip_grad_norm_ and foreach optimizers
        # refuse DTensors of two meshes), and it sums their gradients (reduce-scatter).
        layouts, batch_dims = _split_off_batch_axis(
            resolve_layouts(self._layout_map, root), plan.batch_axis
        )
        by_fsdp = plan.batch_size > 1 and (self._fully_shard or bool(batch_dims))
        before = dict(root.named_parameters(remove_duplicate=False))
        slots = _slots(root)
        tensors = [t for t, _ in slots.values()]
        if self._world.world_size > 1 and tensors:
            with torch.no_grad():
                self._world.broadcast([t.detach() for t in tensors], 0, name="initial values")
        if plan.model_mesh is not None:
            self._distribute(root, slots, layouts)
            self._apply_styles(root, layouts)
        elif plan.device.type != "cpu":
            with torch.no_grad():
                for tensor in tensors:
                    tensor.data = tensor.data.to(plan.device)
        if by_fsdp:
            self._shard_batch_axis(root, batch_dims)
        self._finish(root, before, summed_by_fsdp=by_fsdp)

    def _distribute(
        self,
        root: torch.nn.Module,
        slots: dict[int, tuple[torch.Tensor, list[tuple[torch.nn.Module, str, str]]]],
        layouts: dict[str, TensorLayout | None],
    ) -> None:
        """Every variable becomes a DTensor on the model mesh (NOTE [model parallel
        layout]); every slot holding it gets the one DTensor."""
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = self._plan.model_mesh
        holders: set[torch.nn.Module] = set()
        for tensor, places in slots.values():
            first_path = places[0][2]  # tied paths share one layout (resolve_layouts)
            dims = shard_dims(layouts.get(first_path), self._plan.model_axes)
            placements = [Replicate() if d is None else Shard(d) for d in dims]
            with torch.no_grad():
                value = tensor.detach().to(self._plan.device)
                laid = distribute_tensor(value, mesh, placements, src_data_rank=None)
            new: torch.Tensor
            if isinstance(tensor, torch.nn.Parameter):
                new = torch.nn.Parameter(laid, requires_grad=tensor.requires_grad)
            else:
                new = laid
            for module, kind, path in places:
                name = path.rpartition(".")[2]
                if kind == "param":
                    module._parameters[name] = new  # type: ignore[assignment]  # a DTensor Parameter
                else:
                    module._buffers[name] = new
                if module not in holders:
                    holders.add(module)
                    module.register_load_state_dict_pre_hook(lay_out_loaded_values)  # type: ignore[no-untyped-call]  # torch leaves it untyped
        # The root's runs first and lays out every whole value (or refuses) before any copy.
        whole_tree = functools.partial(lay_out_loaded_values, subtree=True)
        root.register_load_state_dict_pre_hook(whole_tree)  # type: ignore[no-untyped-call]  # torch leaves it untyped

    def _apply_styles(self, root: torch.nn.Module, layouts: dict[str, TensorLayout | None]) -> None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        styles = choose_styles(root, layouts, self._plan.model_axes)
        mesh = self._plan.model_mesh
        for path, style in styles.items():
            module = root.get_submodule(path)
            if is_conv1d(module) and style is not Style.PROPAGATE:
                transposed_style(module, column=style is Style.COLWISE)
            elif style is Style.COLWISE:
                parallelize_module(
                    module, mesh, ColwiseParallel(use_local_output=False), src_data_rank=None
                )
                module.register_forward_pre_hook(grad_sums_here, prepend=True)
            elif style is Style.ROWWISE:
                parallelize_module(
                    module, mesh, RowwiseParallel(use_local_output=False), src_data_rank=None
                )
            elif isinstance(module, torch.nn.Embedding):
                module.register_forward_hook(partial_sums_here)
        for path, layout in resolve_output_layouts(self._layout_map, root).items():
            constrain = OutputLayout(path, layout, self._plan.model_axes)
            root.get_submodule(path).register_forward_hook(constrain)
        assert self._view is not None
        for module in root.modules():
            self._view.attach(module)

    def _shard_batch_axis(self, root: torch.nn.Module, batch_dims: dict[str, int]) -> None:
        """FSDP2 along the batch axis, over the tensor-parallel DTensors (2-D, as
        torchtitan composes them), summing (not averaging) gradients; a variable whose
        layout names the batch axis is split along the dimension it names there
        (``batch_dims``: by path), the others along their first."""
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor import Shard

        from distribute.strategies._sharding import check_unit_dtypes, choose_units

        named = {id(root.get_parameter(path)): dim for path, dim in batch_dims.items()}

        def placement(param: torch.nn.Parameter) -> Any:
            dim = named.get(id(param))
            return Shard(dim) if dim is not None else None

        units = choose_units(root, None)
        check_unit_dtypes(root, units)
        mesh = self._plan.batch_mesh
        for unit in units:  # deepest first
            fully_shard(unit, mesh=mesh, shard_placement_fn=placement)
        fully_shard(root, mesh=mesh, shard_placement_fn=placement)
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
                module.set_gradient_divide_factor(1.0)
                if hasattr(module, "set_reduce_scatter_unused_params"):  # torch 2.11 lacks it
                    module.set_reduce_scatter_unused_params(True, recurse=False)

    def _finish(
        self, root: torch.nn.Module, before: dict[str, torch.nn.Parameter], summed_by_fsdp: bool
    ) -> None:
        strategy = self._strategy_ref()
        after = dict(root.named_parameters(remove_duplicate=False))
        replaced: dict[int, torch.nn.Parameter] = {}
        for name, new in after.items():
            old = before.get(name)
            if old is not None and old is not new:
                replaced[id(old)] = new
        for tensor in root.buffers():
            _marks.mark_managed(tensor, strategy)  # read by checkpoints
        for param in root.parameters():  # each once, in registration order
            _marks.mark_managed(param, strategy)  # read by the step hooks
            if param.requires_grad and not summed_by_fsdp:
                self.trainable.append(param)
        self._recorder.repoint(replaced)
        self._recorder.keep(root)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients stay local (the batch-axis sums wait; FSDP's accumulation without
        reduce-scatters under ``fully_shard=True``); blocks nest."""
        self._no_sync.depth += 1
        try:
            with self._recorder.no_sync(_set_gradient_sync):
                yield
        finally:
            self._no_sync.depth -= 1


def _set_gradient_sync(root: torch.nn.Module, sync: bool) -> None:
    if hasattr(root, "set_requires_gradient_sync"):  # FSDP's roots (fully_shard=True)
        root.set_requires_gradient_sync(sync)  # type: ignore[operator]  # an FSDPModule's


def _split_off_batch_axis(
    layouts: dict[str, TensorLayout | None], batch_axis: str
) -> tuple[dict[str, TensorLayout | None], dict[str, int]]:
    """The layouts with the batch axis taken out (DTensor lays out the model axes), and
    for each path whose layout named it, the dimension split along it (FSDP2's).

    Example:
        >>> from distribute.strategies._tensor_parallel import TensorLayout, _split_off_batch_axis
        >>> split = _split_off_batch_axis({"w": TensorLayout(("model", "batch"))}, "batch")
        >>> split[0]["w"].axes, split[1]
        (('model', None), {'w': 1})
    """
    rest: dict[str, TensorLayout | None] = {}
    dims: dict[str, int] = {}
    for path, layout in layouts.items():
        if layout is None or batch_axis not in layout.axes:
            rest[path] = layout
            continue
        dims[path] = layout.axes.index(batch_axis)
        axes = tuple(None if a == batch_axis else a for a in layout.axes)
        rest[path] = TensorLayout(axes, layout.device_mesh)
    return rest, dims


def _slots(
    root: torch.nn.Module,
) -> dict[int, tuple[torch.Tensor, list[tuple[torch.nn.Module, str, str]]]]:
    """Every parameter and buffer of ``root`` once, in registration order, with every
    (module, kind, path) holding it (tied weights have several)."""
    found: dict[int, tuple[torch.Tensor, list[tuple[torch.nn.Module, str, str]]]] = {}
    for module_path, module in root.named_modules(remove_duplicate=False):
        prefix = f"{module_path}." if module_path else ""
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                entry = found.setdefault(id(tensor), (tensor, []))
                entry[1].append((module, kind, prefix + name))
    return found
