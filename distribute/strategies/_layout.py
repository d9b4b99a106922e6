"""Keras 3's description of model parallelism: `DeviceMesh`, `TensorLayout`, `LayoutMap`,
and the pure functions that resolve a module's variables to layouts.

Nothing here touches a process group or a device: a mesh is a named grid of worker
processes, a layout names a mesh axis (or None) for each dimension of a variable, and a
layout map is Keras's dict of regexes over variable paths. `ModelParallelStrategy`
executes the layouts with DTensor; `TPUStrategy` can annotate the same map for GSPMD.
Both start from `resolve_layouts`, which validates every variable of a module against
its layout and names the variable, the layout and the fix when one does not fit.

Example:
    >>> from distribute.experimental import DeviceMesh, LayoutMap
    >>> mesh = DeviceMesh(shape=(2, 4), axis_names=("batch", "model"))
    >>> layout_map = LayoutMap(mesh)
    >>> layout_map[r"mlp\\.up\\.weight"] = ("model", None)
    >>> layout_map["mlp.up.weight"].axes
    ('model', None)
    >>> layout_map["mlp.down.weight"] is None
    True
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from distribute.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DeviceMesh",
    "LayoutMap",
    "TensorLayout",
    "resolve_layouts",
    "shard_dims",
]


class DeviceMesh:
    """A named grid of devices: one device per worker process.

    Args:
        shape: the size of each axis, e.g. ``(2, 4)``: 2 replicas of the batch, each
            model split over 4 devices.
        axis_names: one name per axis, e.g. ``("batch", "model")``.
        devices: the mesh's devices in row-major order, one per worker process (its
            CUDA device, else its CPU); None: one per worker of the cluster the
            strategy resolves. Building a mesh needs no process group.

    Raises:
        InvalidArgumentError: an empty shape, a size below 1, names that do not match
            the shape one to one, or a ``devices`` list whose length is not the mesh's
            size.

    Example:
        >>> from distribute.experimental import DeviceMesh
        >>> mesh = DeviceMesh(shape=(1, 2), axis_names=("batch", "model"))
        >>> mesh.size, mesh.axis_names
        (2, ('batch', 'model'))
    """

    def __init__(
        self,
        shape: Sequence[int],
        axis_names: Sequence[str],
        devices: Sequence[Any] | None = None,
    ) -> None:
        shape = tuple(int(n) for n in shape)
        axis_names = tuple(str(a) for a in axis_names)
        if not shape or len(shape) != len(axis_names):
            raise InvalidArgumentError(
                f"DeviceMesh needs one name per axis, got shape={shape} and "
                f"axis_names={axis_names}; e.g. DeviceMesh((2, 4), ('batch', 'model'))"
            )
        if any(n < 1 for n in shape):
            raise InvalidArgumentError(
                f"DeviceMesh's axis sizes must be at least 1, got shape={shape}"
            )
        if len(set(axis_names)) != len(axis_names):
            raise InvalidArgumentError(
                f"DeviceMesh's axis names must differ from each other, got {axis_names}"
            )
        if devices is not None:
            devices = tuple(devices)
            if len(devices) != math.prod(shape):
                raise InvalidArgumentError(
                    f"DeviceMesh of shape {shape} holds {math.prod(shape)} devices, but "
                    f"{len(devices)} were given ({list(devices)}); give one device per "
                    "worker process, or devices=None"
                )
        self._shape = shape
        self._axis_names = axis_names
        self._devices = devices

    @property
    def shape(self) -> tuple[int, ...]:
        """The size of each axis."""
        return self._shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The name of each axis."""
        return self._axis_names

    @property
    def devices(self) -> tuple[Any, ...] | None:
        """The devices given (row-major), or None: one per worker process."""
        return self._devices

    @property
    def size(self) -> int:
        """How many devices (worker processes) the mesh holds."""
        return math.prod(self._shape)

    def axis_size(self, name: str) -> int:
        """The size of axis ``name``."""
        return self._shape[self._axis_names.index(name)]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, DeviceMesh)
            and other._shape == self._shape
            and other._axis_names == self._axis_names
            and other._devices == self._devices
        )

    def __hash__(self) -> int:
        return hash((self._shape, self._axis_names))

    def __repr__(self) -> str:
        return f"DeviceMesh(shape={self._shape}, axis_names={self._axis_names})"


class TensorLayout:
    """How one variable lies on a mesh: a mesh axis name (or None) per dimension.

    Dimension ``d`` is split along the named axis (``Shard(d)``); a dimension marked
    None, and every mesh axis no dimension names, hold whole copies (``Replicate()``).

    Args:
        axes: one entry per dimension of the variable: a mesh axis name or None.
        device_mesh: the mesh (set by the `LayoutMap` the layout is put in).

    Raises:
        InvalidArgumentError: an axis the mesh does not have, or an axis named twice.

    Example:
        >>> from distribute.experimental import TensorLayout
        >>> TensorLayout(("model", None)).axes     # torch Linear weight: (out, in)
        ('model', None)
    """

    def __init__(self, axes: Sequence[str | None], device_mesh: DeviceMesh | None = None) -> None:
        self._axes = tuple(None if a is None else str(a) for a in axes)
        self._device_mesh: DeviceMesh | None = None
        named = [a for a in self._axes if a is not None]
        if len(set(named)) != len(named):
            raise InvalidArgumentError(
                f"TensorLayout {self._axes} names a mesh axis for two dimensions; an axis "
                "splits one dimension of a variable: name each axis at most once"
            )
        if device_mesh is not None:
            self.device_mesh = device_mesh

    @property
    def axes(self) -> tuple[str | None, ...]:
        """The mesh axis (or None) of each dimension."""
        return self._axes

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The mesh the axes refer to."""
        return self._device_mesh

    @device_mesh.setter
    def device_mesh(self, mesh: DeviceMesh) -> None:
        if self._device_mesh is not None and self._device_mesh != mesh:
            raise InvalidArgumentError(
                f"TensorLayout {self._axes} already belongs to {self._device_mesh}, not "
                f"{mesh}; make a new TensorLayout for the other mesh"
            )
        unknown = [a for a in self._axes if a is not None and a not in mesh.axis_names]
        if unknown:
            raise InvalidArgumentError(
                f"TensorLayout {self._axes} names axis {unknown[0]!r}, which {mesh} does not "
                f"have; use the mesh's axes {mesh.axis_names} or None"
            )
        self._device_mesh = mesh

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorLayout) and other._axes == self._axes

    def __hash__(self) -> int:
        return hash(self._axes)

    def __repr__(self) -> str:
        return f"TensorLayout({self._axes})"


class LayoutMap(MutableMapping[str, TensorLayout]):
    """Keras's map from variable paths to layouts: keys are regexes.

    ``layout_map[path]`` returns the layout of the key equal to ``path``, else of the
    one key that `re.search`es it, else None (the variable is replicated). Paths are
    qualified names as ``model.named_parameters()`` and ``named_buffers()`` give them.
    A tuple (or list) value becomes a `TensorLayout` on the map's mesh.

    Args:
        device_mesh: the mesh every layout refers to.

    Raises:
        InvalidArgumentError: reading a path that several keys match (the path and the
            keys are named), setting a key twice, or a value that is not a layout.

    Example:
        >>> from distribute.experimental import DeviceMesh, LayoutMap
        >>> mesh = DeviceMesh((1, 2), ("batch", "model"))
        >>> layout_map = LayoutMap(mesh)
        >>> layout_map[r"blocks\\.\\d+\\.up\\.weight"] = ("model", None)
        >>> layout_map["blocks.3.up.weight"]
        TensorLayout(('model', None))
    """

    def __init__(self, device_mesh: DeviceMesh) -> None:
        if not isinstance(device_mesh, DeviceMesh):
            raise InvalidArgumentError(
                f"LayoutMap needs a ds.experimental.DeviceMesh, got {type(device_mesh).__name__}"
            )
        self._device_mesh = device_mesh
        self._layouts: collections.OrderedDict[str, TensorLayout] = collections.OrderedDict()

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh of every layout in the map."""
        return self._device_mesh

    def __getitem__(self, path: str) -> TensorLayout | None:  # type: ignore[override]  # None for no match, as Keras
        if path in self._layouts:
            return self._layouts[path]
        keys = matching_keys(self._layouts, path)
        if len(keys) > 1:
            raise InvalidArgumentError(
                f"variable {path!r} matches several LayoutMap keys: {keys}; each path may "
                "match at most one key: make the regexes more specific (anchor them, e.g. "
                "r'^blocks\\.\\d+\\.up\\.weight$')"
            )
        return self._layouts[keys[0]] if keys else None

    def __setitem__(self, key: str, layout: TensorLayout | Sequence[str | None]) -> None:
        if key in self._layouts:
            raise InvalidArgumentError(
                f"LayoutMap key {key!r} is already set to {self._layouts[key]}; set each key "
                "once (delete it first to change it)"
            )
        if isinstance(layout, (tuple, list)):
            layout = TensorLayout(layout)
        if not isinstance(layout, TensorLayout):
            raise InvalidArgumentError(
                f"LayoutMap[{key!r}] must be a TensorLayout or a tuple of axis names and None, "
                f"got {type(layout).__name__}"
            )
        try:
            re.compile(key)
        except re.error as exc:
            raise InvalidArgumentError(
                f"LayoutMap key {key!r} is not a regular expression ({exc}); escape "
                "special characters (re.escape)"
            ) from None
        try:
            layout.device_mesh = self._device_mesh
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"LayoutMap[{key!r}] = {layout.axes}: {exc}") from None
        self._layouts[key] = layout

    def __delitem__(self, key: str) -> None:
        del self._layouts[key]

    def __contains__(self, key: object) -> bool:
        return key in self._layouts  # a key set in the map (not a path it matches)

    def get(self, path: str, default: Any = None) -> Any:
        """The layout of ``path`` (see `__getitem__`), or ``default`` when no key matches."""
        layout = self[path]
        return default if layout is None else layout

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)

    def __repr__(self) -> str:
        items = ", ".join(f"{k!r}: {v.axes}" for k, v in self._layouts.items())
        return f"LayoutMap({self._device_mesh}, {{{items}}})"


def matching_keys(keys: Sequence[str] | MutableMapping[str, Any], path: str) -> list[str]:
    """The keys that `re.search` ``path``, in insertion order."""
    return [k for k in keys if re.search(k, path)]


def resolve_layouts(
    layout_map: LayoutMap, module: torch.nn.Module, *, buffers: bool = True
) -> dict[str, TensorLayout | None]:
    """Every parameter (and buffer) of ``module`` by path, with its layout or None.

    A pure function of the module's named tensors and the map: it validates each
    layout against its variable (one entry per dimension, axes of the mesh) so a
    strategy can lay the variables out without further checks. A variable shared by
    several paths (tied weights) appears under each; their layouts must agree.

    Args:
        layout_map: the map.
        module: the model (paths are relative to it).
        buffers: whether buffers are resolved too.

    Returns:
        ``{path: layout or None}`` in ``named_parameters()`` then
            ``named_buffers()`` order (duplicates included).

    Raises:
        InvalidArgumentError: a layout whose length is not the variable's number of
            dimensions, a path that several keys match, or tied paths with different
            layouts (the variable's path and the layout are named).

    Example:
        >>> import torch
        >>> from distribute.experimental import DeviceMesh, LayoutMap
        >>> from distribute.strategies._layout import resolve_layouts
        >>> mesh = DeviceMesh((1, 2), ("batch", "model"))
        >>> layout_map = LayoutMap(mesh)
        >>> layout_map["0.weight"] = ("model", None)
        >>> resolve_layouts(layout_map, torch.nn.Sequential(torch.nn.Linear(2, 4)))
        {'0.weight': TensorLayout(('model', None)), '0.bias': None}
    """
    named: list[tuple[str, Any]] = list(module.named_parameters(remove_duplicate=False))
    if buffers:
        named += list(module.named_buffers(remove_duplicate=False))
    resolved: dict[str, TensorLayout | None] = {}
    first_path: dict[int, str] = {}
    for path, tensor in named:
        layout = layout_map[path]
        if layout is not None and len(layout.axes) != tensor.dim():
            raise InvalidArgumentError(
                f"the layout of {path!r} is {layout.axes}, with {len(layout.axes)} entries, but "
                f"the variable has {tensor.dim()} dimensions (shape {tuple(tensor.shape)}); "
                "give one mesh axis or None per dimension (a torch Linear weight is "
                "(out_features, in_features))"
            )
        earlier = first_path.setdefault(id(tensor), path)
        if earlier != path and _axes(resolved[earlier]) != _axes(layout):
            raise InvalidArgumentError(
                f"{path!r} and {earlier!r} are one variable (tied) with different layouts, "
                f"{_axes(layout)} and {_axes(resolved[earlier])}; give both paths the same "
                "layout"
            )
        resolved[path] = layout
    return resolved


def _axes(layout: TensorLayout | None) -> tuple[str | None, ...] | None:
    return None if layout is None else layout.axes


def shard_dims(layout: TensorLayout | None, axis_names: Sequence[str]) -> tuple[int | None, ...]:
    """For each mesh axis in ``axis_names``, the variable dimension split along it (or
    None: the variable is whole along that axis).

    Example:
        >>> from distribute.experimental import TensorLayout
        >>> from distribute.strategies._layout import shard_dims
        >>> shard_dims(TensorLayout((None, "model")), ("batch", "model"))
        (None, 1)
    """
    if layout is None:
        return tuple(None for _ in axis_names)
    return tuple(layout.axes.index(axis) if axis in layout.axes else None for axis in axis_names)
