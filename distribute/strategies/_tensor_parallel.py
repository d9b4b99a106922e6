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
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from distribute import _torch
from distribute.errors import InvalidArgumentError
from distribute.strategies._layout import LayoutMap, TensorLayout, resolve_layouts, shard_dims
from distribute.strategies._optimizer_watch import OptimizerWatch

if TYPE_CHECKING:
    from distribute.collectives.process_group import ProcessGroupCollectives

__all__ = [
    "GlobalView",
    "LaidOutModules",
    "MeshPlan",
    "Style",
    "choose_styles",
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
    return None


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


def _grad_sums_here(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Before a column-parallel layer: a replicated DTensor input becomes a fresh one of
    the same local tensor, whose gradient (partial sums) is summed here, once, as torch
    does for a plain input (NOTE [model parallel layout])."""
    from torch.distributed.tensor import DTensor

    if not args or not isinstance(args[0], DTensor):
        return None
    x = args[0]
    if not all(p.is_replicate() for p in x.placements):
        return None
    fresh = DTensor.from_local(x.to_local(), x.device_mesh, x.placements, run_check=False)
    return (fresh, *args[1:])


class LaidOutModules:
    """The modules a scope built, and their layout (NOTE [model parallel layout]).

    Args:
        strategy: the strategy whose variables these become.
        layout_map: the user's map.
        plan: the mesh and its parts.
        world: collectives over every worker (the chief's values).
        fully_shard: FSDP2 shards along the batch axis too.
    """

    def __init__(
        self,
        strategy: Any,
        layout_map: LayoutMap,
        plan: MeshPlan,
        world: ProcessGroupCollectives,
        fully_shard: bool,
    ) -> None:
        self._strategy_ref = weakref.ref(strategy)
        self._layout_map = layout_map
        self._plan = plan
        self._world = world
        self._fully_shard = fully_shard and plan.batch_size > 1
        self._view = GlobalView(plan.model_mesh) if plan.model_mesh is not None else None
        self._recorded: list[weakref.ref[torch.nn.Module]] = []
        self._parents: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = (
            weakref.WeakKeyDictionary()
        )
        self._roots: list[weakref.ref[torch.nn.Module]] = []
        self.trainable: list[torch.Tensor] = []  # every laid-out trainable parameter
        # Optimizers built in the scope (NOTE [optimizers built in the scope]).
        self.optimizers = OptimizerWatch()

    @property
    def sharded_by_fsdp(self) -> bool:
        """Whether FSDP2 shards (and sums) along the batch axis."""
        return self._fully_shard

    # -- recording in the scope ------------------------------------------------------------

    def record(self, module: torch.nn.Module, tensor: torch.Tensor | None = None) -> None:
        """``module`` registered a parameter (``tensor``) or buffer in the scope."""
        if tensor is not None:
            self.optimizers.watch(tensor)
        if not any(ref() is module for ref in self._recorded):
            self._recorded.append(weakref.ref(module))

    def record_child(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        """``child`` was attached to ``parent`` in the scope."""
        self._parents[child] = parent

    @property
    def pending(self) -> bool:
        """Whether modules wait to be laid out."""
        return bool(self._recorded)

    def roots(self) -> list[torch.nn.Module]:
        """The laid-out roots still alive."""
        return [m for ref in self._roots if (m := ref()) is not None]

    # -- laying out ------------------------------------------------------------------------

    def lay_out_pending(self) -> None:
        """Lays out every root built since the last call, in creation order (the same on
        every worker)."""
        recorded = [m for ref in self._recorded if (m := ref()) is not None]
        self._recorded = []
        roots: list[torch.nn.Module] = []
        for module in recorded:
            root, seen = module, {id(module)}
            while (parent := self._parents.get(root)) is not None and id(parent) not in seen:
                root = parent
                seen.add(id(root))
            if all(root is not r for r in roots):
                roots.append(root)
        self._parents = weakref.WeakKeyDictionary()
        for root in roots:
            self._lay_out(root)

    def _lay_out(self, root: torch.nn.Module) -> None:
        plan = self._plan
        layouts = resolve_layouts(self._layout_map, root)
        self._refuse_batch_axis(layouts)
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
        if self._fully_shard:
            self._shard_batch_axis(root)
        self._finish(root, before)

    def _refuse_batch_axis(self, layouts: dict[str, TensorLayout | None]) -> None:
        batch = self._plan.batch_axis
        for path, layout in layouts.items():
            if layout is not None and batch in layout.axes:
                raise InvalidArgumentError(
                    f"the layout of {path!r} is {layout.axes}, which names the batch axis "
                    f"{batch!r} (batch_dim_name), along which the strategy splits the batch "
                    "and keeps one copy of the model per batch group; name a model axis "
                    f"{self._plan.model_axes or '(the mesh has none)'} instead, or pass "
                    "fully_shard=True to shard every variable along the batch axis (FSDP2)"
                )

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
            if style is Style.COLWISE:
                parallelize_module(
                    module, mesh, ColwiseParallel(use_local_output=False), src_data_rank=None
                )
                module.register_forward_pre_hook(_grad_sums_here, prepend=True)
            elif style is Style.ROWWISE:
                parallelize_module(
                    module, mesh, RowwiseParallel(use_local_output=False), src_data_rank=None
                )
        assert self._view is not None
        for module in root.modules():
            self._view.attach(module)

    def _shard_batch_axis(self, root: torch.nn.Module) -> None:
        """FSDP2 along the batch axis, over the tensor-parallel DTensors (2-D, as
        torchtitan composes them), summing (not averaging) gradients."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        from distribute.strategies._sharding import check_unit_dtypes, choose_units

        units = choose_units(root, None)
        check_unit_dtypes(root, units)
        mesh = self._plan.batch_mesh
        for unit in units:  # deepest first
            fully_shard(unit, mesh=mesh)
        fully_shard(root, mesh=mesh)
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
                module.set_gradient_divide_factor(1.0)
                if hasattr(module, "set_reduce_scatter_unused_params"):  # torch 2.11 lacks it
                    module.set_reduce_scatter_unused_params(True, recurse=False)

    def _finish(self, root: torch.nn.Module, before: dict[str, torch.nn.Parameter]) -> None:
        strategy = self._strategy_ref()
        after = dict(root.named_parameters(remove_duplicate=False))
        replaced: dict[int, torch.nn.Parameter] = {}
        for name, new in after.items():
            old = before.get(name)
            if old is not None and old is not new:
                replaced[id(old)] = new
        for tensor in root.buffers():
            tensor._ds_managed_by = strategy  # type: ignore[attr-defined]  # read by checkpoints
        for param in root.parameters():  # each once, in registration order
            param._ds_managed_by = strategy  # type: ignore[attr-defined]  # read by the step hooks
            if param.requires_grad:
                self.trainable.append(param)
        repoint_optimizers(self.optimizers.found(), replaced)
        self._roots.append(weakref.ref(root))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """FSDP's accumulation without reduce-scatters (``fully_shard=True``)."""
        roots = [r for r in self.roots() if hasattr(r, "set_requires_gradient_sync")]
        for root in roots:
            root.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            for root in roots:
                root.set_requires_gradient_sync(True)  # type: ignore[operator]


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


def repoint_optimizers(
    optimizers: Sequence[torch.optim.Optimizer], replaced: dict[int, torch.nn.Parameter]
) -> None:
    """Points optimizers built in the scope from the replaced parameters at their
    DTensors; refuses one that already holds state for them."""
    if not replaced:
        return
    for obj in optimizers:
        held = [p for g in obj.param_groups for p in g["params"] if id(p) in replaced]
        if not held:
            continue
        if any(obj.state.get(p) for p in held):
            raise InvalidArgumentError(
                f"{type(obj).__name__} already holds state for parameters that "
                "ModelParallelStrategy is replacing by their laid-out DTensors (it stepped "
                "before the scope was left); build the optimizer in the strategy's scope "
                "before its first step, or after the scope"
            )
        for group in obj.param_groups:
            group["params"] = [replaced.get(id(p), p) for p in group["params"]]
