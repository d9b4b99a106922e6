"""The hooks by which `ModelParallelStrategy` runs laid-out modules as one device
would (NOTE [model parallel layout] in `_tensor_parallel.py`): on activations (a
column-parallel layer's input, a row-parallel or propagating embedding's partial
output, Keras's output layouts, ``torch.cat`` of an empty plain tensor among
DTensors), and on whole values loaded into laid-out variables; and the report of the
layout map's keys that matched nothing. Each is a plain torch hook (or a
``TorchFunctionMode``), installed by `LaidOutModules`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from distribute.errors import InvalidArgumentError
from distribute.strategies._layout import LayoutMap, shard_dims, unmatched_keys

if TYPE_CHECKING:
    from distribute.strategies._layout import TensorLayout

__all__ = [
    "EmptySkippedInCat",
    "OutputLayout",
    "grad_sums_here",
    "lay_out_loaded_values",
    "partial_sums_here",
    "transposed_style",
    "warn_unmatched",
]


class EmptySkippedInCat(TorchFunctionMode):
    """Inside the outermost call, ``torch.cat`` skips an empty 1-D plain tensor among
    DTensors, as plain torch skips it (its legacy rule for ``torch.tensor([])``).

    transformers' ``DynamicCache`` starts every layer's keys and values from
    ``torch.tensor([])`` and ``torch.cat``s the new ones onto it; taken as a replicated
    DTensor (implicit replication), the empty 1-D tensor made DTensor split it along
    the keys' sharded head dimension (``IndexError: Dimension out of range``).
    """

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in _CATS and args and isinstance(args[0], (list, tuple)):
            from torch.distributed.tensor import DTensor

            tensors = args[0]
            if any(isinstance(t, DTensor) for t in tensors):
                kept = [
                    t
                    for t in tensors
                    if isinstance(t, DTensor) or not (t.dim() == 1 and t.numel() == 0)
                ]
                if len(kept) != len(tensors):
                    args = (kept, *args[1:])
        return func(*args, **(kwargs or {}))


_CATS = (torch.cat, torch.concat, torch.concatenate)


def grad_sums_here(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Before a column-parallel layer: a replicated DTensor input becomes a fresh one of
    the same local tensor, whose gradient (partial sums) is summed here, once, as torch
    does for a plain input (NOTE [model parallel layout]). An input split along the
    sequence (an output layout, sequence-parallel style) is gathered here (one
    all-gather; its gradient is reduce-scattered back), as torch's ``SequenceParallel``
    hands its output to a ``ColwiseParallel(input_layouts=Shard(1))``: a split input
    met by the split weight would leave DTensor to choose, and the model's reshapes
    then met a split sequence."""
    from torch.distributed.tensor import DTensor, Replicate

    if not args or not isinstance(args[0], DTensor):
        return None
    x = args[0]
    if not all(p.is_replicate() for p in x.placements):
        if any(p.is_partial() for p in x.placements):
            return None
        whole = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
        return (whole, *args[1:])
    fresh = DTensor.from_local(x.to_local(), x.device_mesh, x.placements, run_check=False)
    return (fresh, *args[1:])


class OutputLayout:
    """A forward hook constraining a module's output to its layout (a key
    ``"<module path>/output"``, as Keras's ``ModelParallel``): the output DTensor (or a
    tuple's first element) is redistributed to ``Shard(d)`` along each model axis the
    layout names for dimension ``d``, ``Replicate()`` along the others; the batch axis
    (the rows, split across replicas by the input) is already laid out. E.g.
    ``("batch", "model", None)`` on a block's ``(B, T, D)`` output keeps the residual
    stream split along the sequence between blocks (sequence-parallel style).

    Args:
        path: the module's path (for errors).
        layout: the output's layout, one entry per dimension.
        model_axes: the mesh's model axes, in the model sub-mesh's order.
    """

    def __init__(self, path: str, layout: TensorLayout, model_axes: Sequence[str]) -> None:
        self._path = path
        self._layout = layout
        self._dims = shard_dims(layout, model_axes)

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(output, DTensor):
            return self._constrain(output)
        if isinstance(output, tuple) and output and isinstance(output[0], DTensor):
            return (self._constrain(output[0]), *output[1:])
        return None

    def _constrain(self, output: Any) -> Any:
        from torch.distributed.tensor import Replicate, Shard

        if len(self._layout.axes) != output.dim():
            raise InvalidArgumentError(
                f"the output layout of {self._path!r} is {self._layout.axes}, with "
                f"{len(self._layout.axes)} entries, but its output has {output.dim()} "
                f"dimensions (shape {tuple(output.shape)}); give one mesh axis or None per "
                "dimension of the output"
            )
        placements = [Replicate() if d is None else Shard(d) for d in self._dims]
        if list(output.placements) == placements:
            return output
        return output.redistribute(output.device_mesh, placements)


def transposed_style(module: torch.nn.Module, *, column: bool) -> None:
    """torch's column- or row-parallel style on a ``Conv1D`` (weight ``(in, out)``),
    whose variables are laid out already: the column-parallel layer sums its input's
    gradient at its input (`grad_sums_here`), the row-parallel one its partial output
    at its output, as torch's styles do for an ``nn.Linear`` (the same collectives)."""
    if column:
        module.register_forward_pre_hook(grad_sums_here, prepend=True)
    else:
        module.register_forward_hook(_output_summed)


def _output_summed(module: torch.nn.Module, args: Any, output: Any) -> Any:
    """A row-parallel layer's partial output summed in one all-reduce (its backward
    passes the whole gradient through, as torch's ``RowwiseParallel``)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(output, DTensor) or not any(p.is_partial() for p in output.placements):
        return None
    placements = [Replicate() if p.is_partial() else p for p in output.placements]
    return output.redistribute(output.device_mesh, placements)


def partial_sums_here(module: torch.nn.Module, args: Any, output: Any) -> Any:
    """After an embedding that propagates (a tied one, split along the vocabulary): its
    partial output (DTensor's ``_MaskPartial``, which can finish its sum only once: a
    second reader raised a bare ``AssertionError``) is summed here, in one all-reduce,
    as torch's ``RowwiseParallel`` sums it, so any number of consumers may read it
    (RMSNorm reads it twice)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(output, DTensor) or not any(p.is_partial() for p in output.placements):
        return None
    placements = [Replicate() if p.is_partial() else p for p in output.placements]
    summed = output.redistribute(output.device_mesh, placements)
    # A fresh DTensor of the sum: its gradient (a partial sum when a consumer such as a
    # tied head leaves one) is summed at its from_local, so the redistribution's own
    # backward meets a whole gradient (partial-to-masked-partial is not a conversion
    # DTensor has).
    return DTensor.from_local(summed.to_local(), output.device_mesh, placements, run_check=False)


def lay_out_loaded_values(
    module: torch.nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    *_: Any,
    subtree: bool = False,
) -> None:
    """A ``load_state_dict`` pre-hook on each laid-out root and on each module holding
    laid-out variables: a whole (plain) value for one of the variables below the module
    becomes a DTensor of the variable's layout, each worker keeping its part (no
    communication: every worker loads the same whole values, as from one file), so
    torch's ``copy_`` meets two DTensors instead of refusing the mix (``aten.copy_.default
    got mixed torch.Tensor and DTensor``) after half the model had loaded. The root's
    hook runs before any module copies, so a value that cannot be laid out is refused
    before anything changed. A value of another shape is left as it is: torch names
    the mismatch. Only ``state_dict``, torch's copy of the caller's, is changed."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    named: list[tuple[str, Any]] = [*module._parameters.items(), *module._buffers.items()]
    if subtree:  # a laid-out root: every variable below it
        named = [
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ]
    for path, variable in named:
        key = prefix + path
        value = state_dict.get(key)
        if (
            not isinstance(variable, DTensor)
            or not isinstance(value, torch.Tensor)
            or isinstance(value, DTensor)
            or value.shape != variable.shape
        ):
            continue
        local = variable.to_local()
        try:
            state_dict[key] = distribute_tensor(
                value.detach().to(device=local.device, dtype=local.dtype),
                variable.device_mesh,
                variable.placements,
                src_data_rank=None,
            )
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            raise InvalidArgumentError(
                f"load_state_dict: the whole value of {key!r} (shape {tuple(value.shape)}) "
                f"cannot be laid out as its variable, placements {variable.placements} "
                f"({exc}); {'nothing was loaded' if subtree else 'loading stopped here'}. "
                "Load it in the layout's own form (a ds.Checkpoint, or DTensors of these "
                "placements)"
            ) from exc


def warn_unmatched(layout_map: LayoutMap, paths: Sequence[str]) -> None:
    """A warning for each key of ``layout_map`` that no path in ``paths`` matches (a
    typo, or a key written for the old `re.search` rule), naming the nearest paths: the
    variables it was meant for stay whole on every worker."""
    for key, nearest in unmatched_keys(layout_map, paths).items():
        warnings.warn(
            f"LayoutMap key {key!r} matches no variable of the model laid out (keys match "
            f"the whole path, re.fullmatch); the nearest paths are {nearest}. Variables "
            "no key matches stay whole on every worker: correct the key (a key written "
            "for re.search, matching part of a path, gets a leading '.*')",
            UserWarning,
            stacklevel=2,
        )
