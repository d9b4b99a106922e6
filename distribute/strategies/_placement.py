"""Where a replicated strategy's variables live, and how they get there.

# NOTE [placement]
A module built in a scope must start from exactly the values the same code gives
outside any scope (API.md): `reset_parameters` draws from the generator of the
device the parameter is on, so a parameter placed on `cuda:0` or `xla:0` when it
is registered draws other numbers than the CPU would. So a parameter or buffer
registered in a scope becomes a variable *where the module's code made it*
(normally the CPU; the meta device under `torch.device("meta")`), holding that
very tensor and no other copy, and is placed on the replica devices only when
the outermost scope is left, or at the next `run`, once the module's own code
has initialized it. Placement keeps the object: its primary moves with
`Tensor.data` where torch allows it (CPU and CUDA), and with
`torch.utils.swap_tensors` where it does not (a CPU tensor cannot become an XLA
one in place); the other replicas' copies are made then.

A variable still on the meta device is not placed: it waits until the module
that holds it is materialized. Torch materializes by *replacing* the tensor in
the module's slot (`to_empty` and `load_state_dict(assign=True)` put a new
`Parameter` there; transformers' `from_pretrained` assigns the loaded weights),
so every variable remembers its slots (module, parameter or buffer, name). A
replacement assigned through `setattr` meets the registration hooks and becomes
a variable at once; one written straight into the module's dictionary (as
`Module._apply` does for `to_empty`, and for every buffer on `.to(dtype)`) is
adopted when the strategy next looks: the plain tensor is turned into the
variable in place (`swap_tensors` again), so an optimizer that already holds it
holds the variable. Placed buffers are looked at before every `run` with several
replicas in sync (a plain buffer there would be updated by every replica thread
at once).

After placement, `p.data = t` (what `Module._apply` does for `.to(dtype)`,
`.half()`, `.double()`, and what transformers' `resize_token_embeddings` does)
reaches every replica's copy; a move off the replica devices is refused.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from distribute import _torch
from distribute._enums import VariableAggregation, VariableSpec, VariableSynchronization
from distribute.errors import InvalidArgumentError
from distribute.variables import DistributedVariable, buffer_aggregation, carry_attributes

if TYPE_CHECKING:
    from distribute.strategies._replica_host import ReplicaHost

__all__ = ["VariablePlacement"]

_TensorBase: Any = _torch.TensorBase


def _slots(var: DistributedVariable) -> Iterator[tuple[dict[str, Any], str]]:
    """The live module dictionaries (``_parameters`` or ``_buffers``) and names that
    were given ``var``."""
    for ref, kind, name in var._ds_owners:
        module = ref()
        if module is not None:
            table = module._buffers if kind == "buffer" else module._parameters
            yield table, name


def _set_data(var: DistributedVariable, value: torch.Tensor) -> None:
    """``var.data = value`` on the primary alone, past the variable's own setter."""
    with torch.no_grad():
        _TensorBase.data.__set__(var, value)


class VariablePlacement:
    """Places a replicated strategy's variables on its replica devices (NOTE [placement]).

    Args:
        ext: the strategy's extended object (devices, registration, broadcast).
    """

    def __init__(self, ext: ReplicaHost) -> None:
        self._ext_ref = weakref.ref(ext)
        self._topology = ext.topology  # fixed: read without the engine
        # Created in scope, not yet placed, in creation order (the same on every
        # worker). Held strongly: `swap_tensors` refuses tensors with weak references.
        # Read by the engine at every one-replica `run` (an attribute, not a call).
        self.unplaced: list[DistributedVariable] = []

    @property
    def _ext(self) -> ReplicaHost:
        ext = self._ext_ref()
        assert ext is not None
        return ext

    def defer(self, var: DistributedVariable) -> None:
        """Keeps ``var`` where it is until `place`."""
        var._ds_placed = False
        self.unplaced.append(var)

    # -- placing -----------------------------------------------------------------------

    def place(self, only: DistributedVariable | None = None) -> None:
        """Places every unplaced variable (or ``only``) that is not on the meta device;
        adopts the plain tensors that replaced one in a module."""
        if not self.unplaced:
            return
        waiting: list[DistributedVariable] = []
        adopted: dict[int, DistributedVariable] = {}
        for var in self.unplaced:
            if only is not None and var is not only:
                waiting.append(var)
                continue
            held = self._adopt_replacements(var, adopted)
            if not held and var._ds_owners:
                continue  # every slot holds something else now: the variable is gone
            if var.is_meta:
                waiting.append(var)
                continue
            self._place_one(var)
        self.unplaced = waiting
        for var in adopted.values():
            self._place_one(var)

    def require_materialized(self) -> None:
        """Raises when a variable a module still holds is on the meta device (`run`)."""
        for var in self.unplaced:
            if var.is_meta:
                names = [name for _, name in _slots(var)] or ["(a variable)"]
                raise InvalidArgumentError(
                    f"`run` needs real values, but {names[0]!r} (shape {list(var.shape)}) "
                    "is still on the meta device; materialize the model first: "
                    "model.to_empty(device='cpu') then load_state_dict(...), or "
                    "load_state_dict(..., assign=True), or build it with "
                    "from_pretrained(...) inside the scope"
                )

    def _adopt_replacements(
        self, var: DistributedVariable, adopted: dict[int, DistributedVariable]
    ) -> bool:
        """Turns plain tensors that replaced ``var`` in a module into variables; returns
        whether some module still holds ``var`` itself."""
        held = False
        for table, name in _slots(var):
            current = table.get(name)
            if current is var:
                held = True
            elif isinstance(current, torch.Tensor) and not isinstance(current, DistributedVariable):
                if id(current) not in adopted:
                    adopted[id(current)] = self._adopt(current, var)
        return held

    def _adopt(self, plain: torch.Tensor, like: DistributedVariable) -> DistributedVariable:
        """Makes ``plain`` (which replaced ``like`` in a module) a variable, in place."""
        return self._adopt_as(
            plain,
            is_buffer=like._ds_is_buffer,
            aggregation=like._ds_aggregation,
            owners=like._ds_owners,
        )

    def _adopt_as(
        self,
        plain: torch.Tensor,
        *,
        is_buffer: bool,
        aggregation: VariableAggregation,
        owners: list[Any],
    ) -> DistributedVariable:
        ext = self._ext
        spec = VariableSpec(
            plain.requires_grad if not is_buffer else False,
            VariableSynchronization.ON_WRITE,
            buffer_aggregation(plain) if is_buffer else aggregation,
            is_param=not is_buffer,
            is_buffer=is_buffer,
        )
        var = ext.make_variable(plain.detach(), spec, devices=(plain.device,))
        attributes = dict(vars(plain))
        self._swap(plain, var, what="materialized")
        adopted: DistributedVariable = plain  # type: ignore[assignment]  # now the variable
        carry_attributes(attributes, adopted)
        adopted._ds_placed = False
        adopted._ds_owners = list(owners)
        return adopted

    def _place_one(self, var: DistributedVariable, *, register: bool = True) -> None:
        ext = self._ext
        target = self._topology.devices[0]
        primary = var._plain_component(0)
        if primary.device != target:
            moved = primary.to(target)
            grad = var.grad
            if _torch.has_compatible_shallow_copy_type(primary, moved):
                _set_data(var, moved)
            else:
                owners = var._ds_owners
                replacement = ext.make_variable(moved, _spec_of(var), devices=(target,))
                attributes = dict(vars(var))
                self._swap(var, replacement, what="placed")
                carry_attributes(attributes, var)
                var._ds_owners = owners
            if grad is not None:
                var.grad = grad.to(target)
        self._make_components(var)
        var._ds_placed = True
        if register:
            ext.register_variable(var)

    def _make_components(self, var: DistributedVariable) -> None:
        """The other local replicas' copies of the primary (aliases under central storage)."""
        primary = var._plain_component(0)
        alias = (
            self._topology.central
            and var._ds_synchronization is VariableSynchronization.ON_WRITE
            and not var._ds_is_buffer
        )
        old = var._ds_components
        components = []
        for i, device in enumerate(self._topology.devices[1:]):
            if alias:
                component = primary.detach()
            else:
                component = primary.detach().to(device, copy=True)
            component.requires_grad_(var.requires_grad)
            old_grad = old[i].grad if i < len(old) else None
            if old_grad is not None:
                component.grad = _fit_grad(old_grad, component)
            components.append(component)
        var._ds_components = tuple(components)
        var._mark_synced()

    @staticmethod
    def _swap(old: torch.Tensor, new: torch.Tensor, *, what: str) -> None:
        try:
            torch.utils.swap_tensors(old, new)  # type: ignore[no-untyped-call]  # untyped in torch
        except RuntimeError as exc:
            raise InvalidArgumentError(
                f"a {list(old.shape)} {old.dtype} tensor could not be {what} on "
                f"the strategy's devices in place ({exc}); build the model inside "
                "`with strategy.scope():` without keeping weak references to its "
                "parameters, and build its optimizer there too"
            ) from exc

    # -- after placement -----------------------------------------------------------------

    def set_data(self, var: DistributedVariable, value: torch.Tensor) -> None:
        """``var.data = value`` for every replica's copy (see the module NOTE)."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"variable.data must be a tensor, got {type(value).__name__}")
        if isinstance(value, DistributedVariable):
            value = value._plain_component(0)
        if value is var:
            return  # `Module.to(device)` to where the variable already is
        ext = self._ext
        primary = var._plain_component(0)
        if not var._ds_placed:
            if _torch.has_compatible_shallow_copy_type(primary, value):
                _set_data(var, value)
            else:  # from the meta device: the object takes the new tensor in place
                owners = var._ds_owners
                replacement = ext.make_variable(
                    value.detach(), _spec_of(var), devices=(value.device,)
                )
                attributes = dict(vars(var))
                self._swap(var, replacement, what="materialized")
                carry_attributes(attributes, var)
                var._ds_owners = owners
                var._ds_placed = False
            return
        target = self._topology.devices[0]
        if value.device != target:
            devices = ", ".join(str(d) for d in self._topology.devices)
            raise InvalidArgumentError(
                f"a variable of {ext.container_strategy!r} lives on its replica devices "
                f"({devices}), but it was given a value on {value.device} (`.data = t`, "
                f"or `module.to({str(value.device)!r})`); the strategy places the model: "
                "drop the move (casts such as .to(torch.bfloat16) work), or read a copy "
                "with `t.detach().to(device)`"
            )
        changed = value.shape != primary.shape or value.dtype != primary.dtype
        _set_data(var, value)
        self._make_components(var)
        if changed:
            ext.variables_changed()
        ext.data_replaced(var)

    def adopt_replaced_buffer(
        self, var: DistributedVariable | None, owners: list[Any]
    ) -> DistributedVariable | None:
        """The variable made of a plain tensor that replaced buffer ``var`` (perhaps
        collected since) in a module's slot (`module.to(dtype)` writes the slot
        directly), placed; None when the modules still hold ``var``."""
        for ref, _, name in owners:
            module = ref()
            if module is None:
                continue
            current = module._buffers.get(name)
            if current is var or current is None or isinstance(current, DistributedVariable):
                continue
            adopted = self._adopt_as(
                current, is_buffer=True, aggregation=buffer_aggregation(current), owners=owners
            )
            self._place_one(adopted, register=False)  # it takes ``var``'s place
            return adopted
        return None


def _fit_grad(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """A component's old gradient kept if it still fits (cast to the new dtype)."""
    if grad.shape != like.shape:
        return None
    return grad.to(device=like.device, dtype=like.dtype)


def _spec_of(var: DistributedVariable) -> VariableSpec:
    """What ``var`` is, for a replacement of it."""
    return VariableSpec(
        var._ds_trainable,
        var._ds_synchronization,
        var._ds_aggregation,
        is_param=bool(getattr(var, "_is_param", False)),
        is_buffer=var._ds_is_buffer,
    )
