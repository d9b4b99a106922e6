"""Gradients of `ModelParallelStrategy`: summed along the batch axis at the end of each
backward pass, so that the step's own code (``clip_grad_norm_``) sees the sums.

# NOTE [batch-axis sums]
Each group of workers along the batch axis holds its own copy of the model (its
DTensors live on the model sub-mesh), computes gradients from its rows of the batch,
and the copies must step with the sum over every row: the workers that share a model
coordinate all-reduce their local gradients (SUM, never gloo's AVG) once per backward
pass, in an autograd callback queued by the first gradient that arrives, before
``backward()`` returns. That is before the user's code between backward and the step
(clipping reads the norm of the sum, as on one device), which a sum at the step would
come after.

* **Accumulation.** A second backward pass must add its own sum, not sum the first
  sum again: when the first gradient of a pass arrives for a parameter whose gradient
  is already a sum, that sum is set aside and the pass accumulates afresh; at the end
  the new sum is added to it. Inside ``no_sync()`` nothing is summed (the gradients
  stay local and keep accumulating), and the next pass outside it sums all of it.
* **Every worker packs every trainable parameter**, with a used-flag each: a parameter
  no worker of the group used keeps ``grad=None`` (an optimizer skips it, as on one
  device); one used on some workers only gets their sum. Every worker must run the
  same number of backward passes, as under `MultiWorkerMirroredStrategy`.
* **Placements.** A gradient DTensor whose placements differ from its parameter's (a
  partial sum) is redistributed to them first, once, so the optimizer's element-wise
  updates do not each redistribute it.

Why by hand and not torch's replication: torch 2.13's ``fully_shard(...,
dp_mesh_dims=DataParallelMeshDims(replicate="batch"))`` (and the private
``replicate_with_fsdp`` built on it) wants each parameter as a DTensor on the *full*
(batch, model) mesh with ``Replicate()`` on the batch axis, and the step's inputs and
activations then live on that mesh too; this engine's parameters live on the model
sub-mesh and each batch group runs its own rows as plain local input, so adopting it
means moving the whole forward onto the full mesh, not swapping the sum. torch 2.9,
within the supported range (``torch>=2.9``), has no such argument at all. A layout
that names the batch axis (sharding along it) already goes through FSDP2's own
reduce-scatter (NOTE [the batch axis in a layout]); only replication is summed here.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from distribute import _torch
from distribute._enums import ReduceOp
from distribute.errors import ContextError

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from distribute.collectives.process_group import ProcessGroupCollectives

__all__ = ["BatchAxisGradients", "MeshStepHandler"]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t  # no autograd: inside no_grad


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient of ``param`` (a DTensor placed as it, where it is one)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
    return local


class BatchAxisGradients:
    """Sums gradients along the batch axis at the end of backward (NOTE [batch-axis sums]).

    Args:
        collectives: the batch group's collectives, or None when the batch axis has
            size 1 (gradients are then only tidied).
        in_no_sync: whether the strategy is inside ``no_sync()`` now.
    """

    def __init__(
        self, collectives: ProcessGroupCollectives | None, in_no_sync: Callable[[], bool]
    ) -> None:
        self._collectives = collectives
        self._in_no_sync = in_no_sync
        self._params: list[weakref.ref[torch.Tensor]] = []
        self._unsummed: set[int] = set()  # ids: gradients of local contributions only
        self._aside: dict[int, torch.Tensor] = {}  # ids: the sums of earlier passes
        self._queued = False
        self._checked_layout: tuple[Any, ...] | None = None

    def track(self, params: Sequence[torch.Tensor]) -> None:
        """Sums these parameters' gradients from the next backward pass on."""
        for p in params:
            ref = weakref.ref(p)
            self._params.append(ref)
            p.register_hook(functools.partial(self._arriving, ref))  # type: ignore[no-untyped-call]  # untyped in torch

    @property
    def unsummed(self) -> bool:
        """Whether some gradient holds contributions not summed yet (``no_sync``)."""
        return bool(self._unsummed)

    def _arriving(self, ref: weakref.ref[torch.Tensor], grad: torch.Tensor) -> None:
        """A gradient contribution for a parameter arrives (before it is accumulated)."""
        param = ref()
        if param is None:
            return
        key = id(param)
        if key not in self._unsummed:
            if param.grad is not None:
                self._aside[key] = param.grad  # a sum already: the pass accumulates afresh
                param.grad = None
            self._unsummed.add(key)
        elif param.grad is None:
            self._aside.pop(key, None)  # zero_grad() since a no_sync() pass: all of it gone
        if not self._queued:
            self._queued = True
            _torch.autograd_execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._queued = False
        if self._in_no_sync():
            return
        params = [p for ref in self._params if (p := ref()) is not None]
        if len(params) != len(self._params):
            self._params = [weakref.ref(p) for p in params]
        with torch.no_grad():
            self._tidy(params)
            if self._collectives is not None:
                self._sum(params)
            for param in params:
                aside = self._aside.pop(id(param), None)
                if aside is not None:
                    param.grad = aside if param.grad is None else aside + param.grad
        self._unsummed.clear()
        self._aside.clear()

    def _tidy(self, params: list[torch.Tensor]) -> None:
        from torch.distributed.tensor import DTensor

        for param in params:
            grad = param.grad
            if (
                id(param) in self._unsummed
                and isinstance(grad, DTensor)
                and isinstance(param, DTensor)
                and grad.placements != param.placements
            ):
                param.grad = grad.redistribute(param.device_mesh, param.placements)

    def _sum(self, params: list[torch.Tensor]) -> None:
        assert self._collectives is not None
        if not params:
            return
        values: list[torch.Tensor] = []
        flags: list[float] = []
        for param in params:
            grad = param.grad if id(param) in self._unsummed else None
            values.append(_local(grad) if grad is not None else torch.zeros_like(_local(param)))
            flags.append(0.0 if grad is None else 1.0)
        used = torch.tensor(flags, dtype=torch.float32, device=values[0].device)
        layout = tuple((str(v.dtype), tuple(v.shape)) for v in values)
        self._collectives.all_reduce(
            [*values, used],
            ReduceOp.SUM,
            name="gradients along the batch axis",
            check=layout != self._checked_layout,  # once per layout: every step is the same
            in_place=True,  # a contribution's local tensor now holds the sum
        )
        self._checked_layout = layout
        for param, value, count in zip(params, values, used.tolist()):
            if not count or (id(param) in self._unsummed and param.grad is not None):
                continue  # nobody used it, or summed in place
            summed = _like(param, value)  # used on other workers only: their sum
            param.grad = summed if param.grad is None else param.grad + summed


class MeshStepHandler:
    """The `StepHandler` of `ModelParallelStrategy`: backward has summed everything
    (`BatchAxisGradients`, or FSDP's reduce-scatters), so the step only refuses to run
    on gradients that are not sums yet.

    Args:
        in_no_sync: whether the strategy is inside ``no_sync()`` now.
        unsummed: whether some gradient holds local contributions only.
    """

    def __init__(self, in_no_sync: Callable[[], bool], unsummed: Callable[[], bool]) -> None:
        self._in_no_sync = in_no_sync
        self._unsummed = unsummed

    def sum_gradients(self, optimizer: Optimizer, variables: Sequence[Any], local: int) -> None:
        """Nothing to combine: backward summed every gradient."""

    def before_step(
        self, optimizer: Optimizer, variables: Sequence[Any], local: int, *, summed: bool
    ) -> None:
        if self._in_no_sync() or self._unsummed():
            raise ContextError(
                "optimizer.step() would apply gradients that were not summed along the batch "
                "axis: the backward passes since the last sum ran inside "
                "strategy.extended.no_sync(). Run the last backward pass of the accumulation "
                "outside no_sync() (it sums everything accumulated), then step"
            )

    def after_step(self, optimizer: Optimizer, variables: Sequence[Any], local: int) -> None:
        """Nothing to finish."""

    def check_step_outside_run(self, optimizer: Optimizer, variables: Sequence[Any]) -> None:
        """A step outside `run` is exact too: backward summed the gradients."""

    def steps_quietly(self, optimizer: Optimizer) -> bool:
        """Never: the batch groups sum at each step."""
        return False

    def hides_gradients(self) -> bool:
        """Never: each worker steps its own part of every parameter."""
        return False

    def close(self) -> None:
        """Holds nothing."""
