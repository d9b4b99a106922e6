"""Every private torch name the library uses, in one place.

# NOTE [private torch]
The library leans on a few torch internals where no public API does the job
(a tensor subclass's storage, FSDP2's communication hooks, rpc's backend without
its own rendezvous). Each is reached here and nowhere else, with what it is for and
the torch versions it was checked on, so that a torch upgrade that moves one fails
loudly (`tests/unit/test_torch_internals.py` resolves every name, and the lazy ones
raise `TorchInternalsError` naming the torch version instead of falling back), never
silently (`_sharding.py` once read FSDP's param groups with `getattr(..., None) or
[]`: had torch renamed them, FSDP's collectives would silently have gone unwatched).

Checked on: every name resolves on torch 2.13.0 (CPU: the development and CI
environment) and 2.9.0 (the torch_xla lane's environment), by
`tests/unit/test_torch_internals.py`; FSDP's are also read from a live sharded module
there, on 2.13.0 (the sharded strategy itself does not run on 2.9:
``Module.modules(remove_duplicate=...)`` is newer).

Names torch already imports when ``import torch`` runs are bound at import; those of
modules the library imports late (FSDP, the rpc backend: a second of import time)
are resolved when first used, through a function here.

Public torch names are used at their call sites as usual, except the c10d stores:
public as ``torch.distributed.Store``, ``PrefixStore``, ``TCPStore`` and
``HashStore``, but declared to type checkers only in ``torch._C._distributed_c10d``,
so they are imported from there, here. Private
*attributes of torch objects* are reached through functions here too (FSDP's state
of a module, a param group's phase); a module's own ``_parameters``, ``_buffers`` and
``_modules`` dicts and a tensor's ``_version`` are read where they are used, and
their presence is checked here (`INSTANCE_ATTRIBUTES`).
"""

from __future__ import annotations

import datetime
import importlib
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d
from torch._C._distributed_c10d import HashStore, PrefixStore, Store, TCPStore
from torch.amp import grad_scaler as _grad_scaler
from torch.utils import _python_dispatch, _pytree

from distribute.errors import DistributeError

__all__ = [
    "CHECKED_ON",
    "INSTANCE_ATTRIBUTES",
    "LAZY_NAMES",
    "METHODS_IN_FRAMES",
    "OPTION_ATTRIBUTES",
    "DisableTorchFunctionSubclass",
    "HashStore",
    "PrefixStore",
    "Store",
    "TCPStore",
    "TensorBase",
    "TorchDispatchMode",
    "TorchInternalsError",
    "abort_process_group",
    "allow_implicit_replication",
    "autograd_execution_engine",
    "backend_options",
    "default_store",
    "disabled_torch_function_impl",
    "flatten_dense_tensors",
    "function_mode_stack_depth",
    "is_leaf_property",
    "foreach_add",
    "foreach_add_",
    "foreach_copy_",
    "fsdp_comm_hook_bases",
    "fsdp_param_groups",
    "fsdp_phase",
    "has_compatible_shallow_copy_type",
    "make_subclass",
    "make_wrapper_subclass",
    "missing_names",
    "optimizer_adding_param_group",
    "refresh_per_optimizer_state",
    "rpc_current_agent",
    "rpc_init_backend",
    "stepping_grad_scaler",
    "tree_leaves",
    "tree_map",
    "tree_map_only",
]

#: The torch versions every name here was checked on (NOTE [private torch]).
CHECKED_ON = ("2.9.0", "2.13.0")


class TorchInternalsError(DistributeError, RuntimeError):
    """A torch internal the library uses is missing from the installed torch."""


def _missing(name: str, error: BaseException | None = None) -> TorchInternalsError:
    detail = f" ({type(error).__name__}: {error})" if error is not None else ""
    return TorchInternalsError(
        f"torch {torch.__version__} has no {name}{detail}, which distribute uses (NOTE "
        f"[private torch] in distribute/_torch.py; checked on torch {', '.join(CHECKED_ON)}); "
        "install a torch version it was checked on, or update distribute/_torch.py"
    )


# -- tensors (torch._C) ---------------------------------------------------------------------

#: The C tensor type under `torch.Tensor`: its `data`/`grad` descriptors read and write a
#: subclass's own storage without its `__torch_function__` (variables, placement).
TensorBase: Any = torch._C.TensorBase
#: Turns `__torch_function__` of subclasses off for a block (variables read their own copy).
DisableTorchFunctionSubclass: Any = torch._C.DisableTorchFunctionSubclass
#: The `__torch_function__` that disables dispatch to a subclass (DistributedVariable).
disabled_torch_function_impl: Any = torch._C._disabled_torch_function_impl
#: `Tensor._make_subclass(cls, data, requires_grad)`: a subclass sharing ``data``'s storage.
make_subclass: Callable[..., Any] = torch.Tensor._make_subclass
#: `Tensor._make_wrapper_subclass(cls, shape, ...)`: a subclass without storage (ShardedVariable).
make_wrapper_subclass: Callable[..., Any] = torch.Tensor._make_wrapper_subclass
#: Whether `a.data = b` is allowed (placement moves a primary copy in place where it is).
has_compatible_shallow_copy_type: Callable[[torch.Tensor, torch.Tensor], bool] = (
    torch._has_compatible_shallow_copy_type
)
#: One flat buffer of several tensors (packing), as DDP's reducer makes it.
flatten_dense_tensors: Callable[[list[torch.Tensor]], torch.Tensor] = (
    torch._C._nn.flatten_dense_tensors
)
#: In-place foreach kernels (gradient sums, buffer copies): one kernel for many tensors.
foreach_add: Callable[..., Any] = torch._foreach_add
foreach_add_: Callable[..., Any] = torch._foreach_add_
foreach_copy_: Callable[..., Any] = torch._foreach_copy_
#: Autograd's engine: `queue_callback` runs a function when the backward pass ends
#: (the bucket reducer launches what is left, as DDP does).
autograd_execution_engine: Any = torch.autograd.Variable._execution_engine

#: How many torch function modes are active in this thread (the sharded scope's
#: optimizer watch leaves the stack only from its top).
function_mode_stack_depth: Callable[[], int] = torch._C._len_torch_function_stack
#: The `is_leaf` property: what `Optimizer.add_param_group` reads of every parameter
#: (the sharded scope's optimizer watch recognizes it).
is_leaf_property: Any = torch._C.TensorBase.is_leaf

# -- pytrees, dispatch modes, the scaler (torch.utils._*, torch.amp) --------------------------

tree_map: Callable[..., Any] = _pytree.tree_map
tree_map_only: Callable[..., Any] = _pytree.tree_map_only
tree_leaves: Callable[..., list[Any]] = _pytree.tree_leaves
#: The base class of dispatch modes (deferred initialization refuses late use of shards).
TorchDispatchMode = _python_dispatch.TorchDispatchMode
#: `GradScaler`'s fresh per-optimizer state (distribute.GradScaler keeps one per replica).
refresh_per_optimizer_state: Callable[[], dict[str, Any]] = (
    _grad_scaler._refresh_per_optimizer_state
)

# -- callers torch passes nothing of: its own methods' running frames ---------------------------
# NOTE [callers found by their frames]
# torch has no hook on an optimizer's construction, and `torch.amp.GradScaler.step` hands
# nothing of itself to `optimizer.step`; where the library must know who is calling, it
# finds the caller here, by the name of torch's public method (`add_param_group`, `step`)
# in the running frames of this thread, and ``self`` of that frame. `METHODS_IN_FRAMES`
# names them; the tests resolve them and watch each found, so a torch release that
# renames one fails a test instead of silently disabling what depends on it.
# The mechanisms without frames were tried and each loses something:
# * An optimizer built in a sharded or laid-out scope found at its first step (torch's
#   public global step hook) instead of as it is built: until then it holds the replaced
#   parameters, so a step that clips ``optimizer.param_groups``' gradients before its
#   first ``optimizer.step()`` clips nothing (their gradients stay None): a silent wrong
#   number; and a `Checkpoint` restored before the first step maps its state to the
#   wrong tensors.
# * Keeping each parameter's identity (`torch.utils.swap_tensors` of the old parameter
#   with its shard): a DTensor has slots a plain parameter lacks, which it refuses.
# * Being told (`strategy.extended.register_optimizer(opt)`): every torch optimizer the
#   user builds in the scope, as tf.distribute's users build theirs, would need a call
#   that tf.distribute does not ask for; the library's own optimizers and `compile` could
#   tell, plain torch optimizers could not.
# * torch's scaler: an optimizer that scales itself (``_step_supports_amp_scaling``) is
#   handed ``grad_scale``/``found_inf``, but setting that flag on a user's optimizer is
#   another private name and changes its arithmetic where the library passes it through.


def optimizer_adding_param_group() -> torch.optim.Optimizer | None:
    """The optimizer whose ``add_param_group`` (its constructor's, or a later call) is
    running a few frames up this thread: what the sharded scope's optimizer watch asks
    when that method reads a watched parameter's ``is_leaf`` (NOTE [optimizers built in
    the scope])."""
    found = _self_in_frames("add_param_group", torch.optim.Optimizer, frames=6)
    return found if isinstance(found, torch.optim.Optimizer) else None


def stepping_grad_scaler() -> torch.amp.GradScaler | None:
    """The `torch.amp.GradScaler` (or subclass) whose public ``step`` calls
    ``optimizer.step`` in this thread (directly for an optimizer that handles the scale
    itself, through ``_maybe_opt_step`` for the others), asked from an optimizer step
    hook: the synchronous handler refuses torch's own scaler (NOTE [refused steps])."""
    found = _self_in_frames("step", torch.amp.GradScaler, frames=10)
    return found if isinstance(found, torch.amp.GradScaler) else None


def _self_in_frames(method: str, owner: type, frames: int) -> Any:
    """``self`` of the nearest of ``frames`` frames, from the caller's caller up, that
    runs a method named ``method`` of an ``owner`` (a frame of the same name whose
    ``self`` is something else, a user's ``step`` function, is passed over); None if
    none does."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(frames):
        if frame is None:
            return None
        if frame.f_code.co_name == method:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, owner):
                return candidate
        frame = frame.f_back
    return None


# -- process groups (torch.distributed.distributed_c10d) -----------------------------------------


def default_store() -> Any:
    """The default process group's store (adopting a group made by the user).

    Raises:
        RuntimeError, ValueError: there is none (torch's own errors).
    """
    return dist.distributed_c10d._get_default_store()


def abort_process_group(group: Any) -> None:
    """Aborts ``group``'s communicators (an nccl collective past its deadline)."""
    abort: Callable[[Any], None] | None = getattr(
        dist.distributed_c10d, "_abort_process_group", None
    )
    if abort is None:
        raise _missing("torch.distributed.distributed_c10d._abort_process_group")
    abort(group)


def backend_options(backend: str, timeout: datetime.timedelta) -> Any:
    """A process group's options carrying ``timeout`` (``init_device_mesh``'s
    ``backend_override``, which reads it from the private ``_timeout``)."""
    if backend == "nccl":
        options: Any = dist.ProcessGroupNCCL.Options()
    else:
        options = _c10d.Backend.Options(backend, timeout)
    options._timeout = timeout
    return options


# -- FSDP2 (torch.distributed.fsdp._fully_shard), imported when first used ----------------------


def fsdp_comm_hook_bases() -> tuple[type, type]:
    """FSDP2's ``AllGather`` and ``ReduceScatter`` base classes of custom collectives
    (`set_custom_all_gather`, `set_custom_reduce_scatter`)."""
    api = _import("torch.distributed.fsdp._fully_shard._fsdp_api")
    return _attribute(api, "AllGather"), _attribute(api, "ReduceScatter")


def fsdp_param_groups(module: Any) -> list[Any]:
    """The FSDP param groups of a module `fully_shard` was applied to (one per unit
    that owns parameters; none for a unit without its own)."""
    state = _attribute(module, "_get_fsdp_state", "FSDPModule._get_fsdp_state")()
    groups = _attribute(state, "_fsdp_param_groups", "FSDPState._fsdp_param_groups")
    return list(groups)


def fsdp_phase(param_group: Any) -> str:
    """``"forward"``, ``"backward"`` or ``"unshard"``: where an FSDP param group is."""
    common = _import("torch.distributed.fsdp._fully_shard._fsdp_common")
    training_state = _attribute(common, "TrainingState")
    state = _attribute(param_group, "_training_state", "FSDPParamGroup._training_state")
    if state == training_state.FORWARD:
        return "forward"
    if state in (training_state.PRE_BACKWARD, training_state.POST_BACKWARD):
        return "backward"
    return "unshard"  # outside forward and backward (an explicit unshard)


# -- DTensor (torch.distributed.tensor), imported when first used -------------------------------


def allow_implicit_replication(allow: bool) -> bool:
    """Sets whether DTensor takes a plain tensor that meets a DTensor as replicated
    (its op dispatcher's switch, which torch's ``implicit_replication`` context turns
    off on the way out even inside an outer block); returns the previous setting."""
    tensor = _import("torch.distributed.tensor")
    dispatcher = _attribute(
        _attribute(tensor, "DTensor"), "_op_dispatcher", "DTensor._op_dispatcher"
    )
    previous = bool(
        _attribute(
            dispatcher,
            "_allow_implicit_replication",
            "DTensor._op_dispatcher._allow_implicit_replication",
        )
    )
    dispatcher._allow_implicit_replication = allow
    return previous


# -- rpc (torch.distributed.rpc), imported when first used --------------------------------------


def rpc_init_backend(
    store: Any, name: str, rank: int, options: Any, backend: Any | None = None
) -> None:
    """Starts rpc's agent on our own rendezvous store: what `rpc.init_rpc` does after
    its own rendezvous (dist_autograd's context, then the backend), with
    ``world_size=None`` (TensorPipe's dynamic group)."""
    rpc = _import("torch.distributed.rpc")
    dist_autograd = _import("torch.distributed.autograd")
    _attribute(dist_autograd, "_init", "torch.distributed.autograd._init")(rank)
    if backend is None:
        backend = rpc.BackendType.TENSORPIPE
    init_backend = _attribute(rpc, "_init_rpc_backend", "torch.distributed.rpc._init_rpc_backend")
    init_backend(backend, store, name, rank, None, options)


def rpc_current_agent() -> Any:
    """This process's rpc agent (its member list; a quiet join before shutting down)."""
    api = _import("torch.distributed.rpc.api")
    return _attribute(api, "_get_current_rpc_agent", "torch.distributed.rpc.api")()


# -- checking ---------------------------------------------------------------------------------

#: The names resolved when first used, as (module, attribute path): `missing_names`
#: resolves each.
LAZY_NAMES: tuple[tuple[str, str], ...] = (
    ("torch.distributed.fsdp._fully_shard._fsdp_api", "AllGather"),
    ("torch.distributed.fsdp._fully_shard._fsdp_api", "ReduceScatter"),
    ("torch.distributed.fsdp._fully_shard._fsdp_common", "TrainingState"),
    ("torch.distributed.fsdp", "FSDPModule._get_fsdp_state"),
    ("torch.distributed.rpc", "_init_rpc_backend"),
    ("torch.distributed.rpc.api", "_get_current_rpc_agent"),
    ("torch.distributed.autograd", "_init"),
    ("torch.distributed.tensor", "DTensor._op_dispatcher._allow_implicit_replication"),
    ("torch.distributed.distributed_c10d", "_get_default_store"),
    ("torch.distributed.distributed_c10d", "_abort_process_group"),
)

#: Private attributes of torch objects the library writes (a group option's timeout,
#: which `init_device_mesh` reads back; checked by `missing_names` on a fresh object).
OPTION_ATTRIBUTES: tuple[str, ...] = ("_timeout",)

#: torch's methods whose running frames `optimizer_adding_param_group` and
#: `stepping_grad_scaler` look for, as (module, attribute path): `missing_names` resolves
#: each, and the tests check that each is found where it runs.
METHODS_IN_FRAMES: tuple[tuple[str, str], ...] = (
    ("torch.optim.optimizer", "Optimizer.add_param_group"),
    ("torch.amp.grad_scaler", "GradScaler.step"),
)

#: Private attributes of torch objects the library reads where it uses them (every
#: module's and tensor's; FSDP's are read through the functions above, and checked on a
#: live sharded module by the tests).
INSTANCE_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("torch.nn.Module", "_parameters"),
    ("torch.nn.Module", "_buffers"),
    ("torch.nn.Module", "_modules"),
    ("torch.Tensor", "_version"),
)


def missing_names() -> list[str]:
    """Every private torch name of this module that the installed torch lacks (empty
    when all resolve); imports the lazily used modules to look."""
    missing = []
    for module, name in LAZY_NAMES + METHODS_IN_FRAMES:
        try:
            owner = _import(module)
            for part in name.split("."):
                owner = _attribute(owner, part)
        except TorchInternalsError:
            missing.append(f"{module}.{name}")
    options = _c10d.Backend.Options("gloo", datetime.timedelta(seconds=1))
    missing += [f"Backend.Options.{n}" for n in OPTION_ATTRIBUTES if not hasattr(options, n)]
    samples = {"torch.nn.Module": torch.nn.Module(), "torch.Tensor": torch.zeros(1)}
    for owner, name in INSTANCE_ATTRIBUTES:
        if not hasattr(samples[owner], name):
            missing.append(f"{owner}.{name}")
    return missing


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise _missing(f"module {module}", e) from e


def _attribute(owner: Any, name: str, described: str | None = None) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError as e:
        raise _missing(described or f"{getattr(owner, '__name__', owner)}.{name}", e) from e
