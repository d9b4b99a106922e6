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
    >>> layout_map[r".*mlp\\.up\\.weight"] = ("model", None)
    >>> layout_map["blocks.0.mlp.up.weight"].axes
    ('model', None)
    >>> layout_map["blocks.0.mlp.down.weight"] is None
    True
"""

from __future__ import annotations

import collections
import difflib
import math
import re
import sys
from collections.abc import Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from distribute.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DeviceMesh",
    "LayoutMap",
    "TensorLayout",
    "network_path",
    "resolve_layouts",
    "resolve_output_layouts",
    "shard_dims",
    "unmatched_keys",
]


class DeviceMesh:
    """A named grid of devices: one device per worker process.

    Args:
        shape: the size of each axis, e.g. ``(2, 4)``: 2 replicas of the batch, each
            model split over 4 devices.
        axis_names: one name per axis, e.g. ``("batch", "model")``.
        devices: the mesh's devices, one per worker process (its CUDA device, else
            its CPU): a flat list in row-major order, or a grid of the mesh's shape
            (``np.array(devices).reshape(shape)``, as Keras writes it); None: one per
            worker of the cluster the strategy resolves. Building a mesh needs no
            process group.

    Raises:
        InvalidArgumentError: an empty shape, a size below 1, names that do not match
            the shape one to one, a flat ``devices`` list whose length is not the
            mesh's size, or a grid of another shape.

    Example:
        >>> from distribute.experimental import DeviceMesh
        >>> mesh = DeviceMesh(shape=(1, 2), axis_names=("batch", "model"))
        >>> mesh.size, mesh.axis_names
        (2, ('batch', 'model'))
        >>> DeviceMesh((2, 2), ("batch", "model"), [["cpu", "cpu"], ["cpu", "cpu"]]).devices
        ('cpu', 'cpu', 'cpu', 'cpu')
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
        self._shape = shape
        self._axis_names = axis_names
        self._devices = None if devices is None else _row_major(devices, shape)

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


def _row_major(devices: Any, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """The devices of a flat list or of a grid of the mesh's shape, in row-major order."""
    size = math.prod(shape)
    grid = _grid_shape(devices)
    if len(grid) > 1 and grid != shape:
        raise InvalidArgumentError(
            f"DeviceMesh of shape {shape} got a grid of devices of shape {grid}; give a grid "
            f"of the mesh's shape (np.array(devices).reshape({shape})), a flat list of {size} "
            "devices, or devices=None"
        )
    flat = tuple(_flatten(devices, len(grid)))
    if len(flat) != size:
        raise InvalidArgumentError(
            f"DeviceMesh of shape {shape} holds {size} devices, but {len(flat)} were given "
            f"({list(flat)}); give one device per worker process, or devices=None"
        )
    return flat


def _grid_shape(devices: Any) -> tuple[int, ...]:
    """The shape of a nested list (or numpy array) of devices; a string is one device."""
    shape = getattr(devices, "shape", None)
    if shape is not None and not isinstance(devices, str):  # a numpy array
        return tuple(int(n) for n in shape)
    dims: list[int] = []
    level = devices
    while isinstance(level, Sequence) and not isinstance(level, str):
        dims.append(len(level))
        if not level:
            break
        level = level[0]
    return tuple(dims)


def _flatten(devices: Any, depth: int) -> Iterator[Any]:
    if depth <= 1:
        yield from (
            d.item() if hasattr(d, "item") and not isinstance(d, str) else d for d in devices
        )
        return
    for row in devices:
        yield from _flatten(row, depth - 1)


class TensorLayout:
    """How one variable lies on a mesh: a mesh axis name (or None) per dimension.

    Dimension ``d`` is split along the named axis (``Shard(d)``); a dimension marked
    None, and every mesh axis no dimension names, hold whole copies (``Replicate()``).
    Two layouts are equal when their axes and their meshes are.

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
        return (
            isinstance(other, TensorLayout)
            and other._axes == self._axes
            and other._device_mesh == self._device_mesh
        )

    def __hash__(self) -> int:
        return hash(self._axes)

    def __repr__(self) -> str:
        return f"TensorLayout({self._axes})"


class LayoutMap(MutableMapping[str, TensorLayout]):
    """Keras's map from variable paths to layouts: keys are regexes.

    ``layout_map[path]`` returns the layout of the key equal to ``path``, else of the
    one key that `re.fullmatch`es it (the whole path, as Keras since 3.14, the Keras
    TensorFlow 2.21 ships), else None (the variable is replicated). A key matches the
    whole path: ``r".*up\\.weight"`` lays out ``blocks.7.up.weight``, ``r"up\\.weight"``
    does not (a key written for the old `re.search` rule gets a leading ``.*``). Paths
    are qualified names as ``model.named_parameters()`` and ``named_buffers()`` give
    them (the network's own, also when it is wrapped in ``ds.Model``). A tuple (or
    list) value becomes a `TensorLayout` on the map's mesh.

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
                "match at most one key (re.fullmatch): make the regexes more specific, e.g. "
                "r'blocks\\.\\d+\\.up\\.weight' rather than r'.*up.*'"
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
    """The keys that `re.fullmatch` ``path`` (the whole path), in insertion order.

    Example:
        >>> from distribute.strategies._layout import matching_keys
        >>> matching_keys([r".*up\\.weight", r"up\\.weight", r"blocks\\..*"], "blocks.0.up.weight")
        ['.*up\\\\.weight', 'blocks\\\\..*']
    """
    return [k for k in keys if re.fullmatch(k, path)]


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
        module: the model (paths are relative to it; a ``ds.Model`` wrapping a network
            is looked through: the map sees the network's own paths, ``module.`` is not
            part of them).
        buffers: whether buffers are resolved too.

    Returns:
        ``{path: layout or None}`` in ``named_parameters()`` then
            ``named_buffers()`` order (duplicates included), the paths relative to
            ``module``.

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
    strip = _wrapper_prefix(module)
    for path, tensor in named:
        layout = layout_map[network_path(path, strip)]
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


def _wrapper_prefix(module: torch.nn.Module) -> str:
    """``"module."`` when ``module`` is a ``ds.Model`` wrapping a network
    (``ds.Model(net)``), whose paths the map sees as the network's own; else ``""``."""
    training = sys.modules.get("distribute.training.model")  # no ds.Model without it
    if training is not None and isinstance(module, training.Model) and "module" in module._modules:
        return "module."
    return ""


def network_path(path: str, strip: str) -> str:
    """The path the layout map sees: ``path`` without the wrapper's ``strip`` prefix.

    Example:
        >>> from distribute.strategies._layout import network_path
        >>> network_path("module.blocks.0.up.weight", "module."), network_path("head", "")
        ('blocks.0.up.weight', 'head')
    """
    return path[len(strip) :] if strip and path.startswith(strip) else path


def map_paths(module: torch.nn.Module, *, buffers: bool = True) -> list[str]:
    """Every path of ``module`` a key may name, as the layout map sees it
    (`network_path`): its variables', then each submodule's output
    (``"<module path>/output"``)."""
    strip = _wrapper_prefix(module)
    named = [p for p, _ in module.named_parameters(remove_duplicate=False)]
    if buffers:
        named += [p for p, _ in module.named_buffers(remove_duplicate=False)]
    named += [f"{p}{OUTPUT}" for p, _ in module.named_modules() if p and f"{p}." != strip]
    return [network_path(p, strip) for p in named]


#: The suffix of a key that lays out a module's output, as Keras spells it.
OUTPUT = "/output"


def resolve_output_layouts(
    layout_map: LayoutMap, module: torch.nn.Module
) -> dict[str, TensorLayout]:
    """The submodules (by path relative to ``module``) whose output the map lays out:
    a key matching ``"<module path>/output"`` (the path as the map sees it, Keras's
    output layouts), with the layout.

    Example:
        >>> import torch
        >>> from distribute.strategies._layout import DeviceMesh, LayoutMap, resolve_output_layouts
        >>> layout_map = LayoutMap(DeviceMesh((1, 2), ("batch", "model")))
        >>> layout_map[r"\\d+/output"] = ("batch", None, "model")
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> resolve_output_layouts(layout_map, net)
        {'0': TensorLayout(('batch', None, 'model')), '1': TensorLayout(('batch', None, 'model'))}
    """
    strip = _wrapper_prefix(module)
    found: dict[str, TensorLayout] = {}
    for path, _ in module.named_modules():
        if not path or f"{path}." == strip:  # the root, or the network ds.Model wraps
            continue
        if (layout := layout_map[network_path(path, strip) + OUTPUT]) is not None:
            found[path] = layout
    return found


def unmatched_keys(layout_map: LayoutMap, paths: Sequence[str]) -> dict[str, list[str]]:
    """The map's keys that no path in ``paths`` matches (equal, or `re.fullmatch`), each
    with the (at most 3) paths nearest to it, nearest first.

    Example:
        >>> from distribute.strategies._layout import DeviceMesh, LayoutMap, unmatched_keys
        >>> layout_map = LayoutMap(DeviceMesh((1, 2), ("batch", "model")))
        >>> layout_map[r"up\\.weight"] = ("model", None)
        >>> layout_map[r".*down\\.weight"] = (None, "model")
        >>> unmatched_keys(layout_map, ["blocks.0.up.weight", "blocks.0.down.weight"])
        {'up\\\\.weight': ['blocks.0.up.weight', 'blocks.0.down.weight']}
    """
    unmatched: dict[str, list[str]] = {}
    for key in layout_map:
        if key in paths or any(re.fullmatch(key, p) for p in paths):
            continue
        plain = key.replace("\\", "")
        unmatched[key] = difflib.get_close_matches(plain, list(paths), n=3, cutoff=0.0)
    return unmatched
