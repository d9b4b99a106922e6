"""The on-disk format of a checkpoint: a directory of DCP files and a manifest.

# NOTE [checkpoint format]
A checkpoint is a directory::

    ckpt-3/
      manifest.json        what is in it: every object's structure (its skeleton),
                           the tensors' shapes and dtypes, every file's size
      rank-<r>.json        per-worker objects (RNG state, input position) of rank r
      .metadata, *.distcp  the tensors, written by torch.distributed.checkpoint

An object's state (a module's or optimizer's ``state_dict``, an iterator's
position, a plain value) is stored as a *skeleton*: its nest of dicts, lists and
tuples in JSON, with each tensor replaced by ``{"__tensor__": key, ...}`` and
the tensor itself stored once under ``key`` by DCP. One logical value per
variable, whatever the strategy: nothing in the format names replicas, devices
or world sizes, so a checkpoint restores under any strategy. Nothing is
unpickled on load (JSON and DCP's tensor files only).

Writing goes to ``<path>.partial`` and is renamed into place once every file is
complete, so a process killed at any moment leaves either the whole new
checkpoint or none of it (and the previous one as the latest). The manifest
records every file's size; a missing, truncated or foreign file raises an error
naming it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from distribute.errors import InvalidArgumentError

__all__ = [
    "CheckpointError",
    "Skeleton",
    "commit",
    "files_with_sizes",
    "flatten",
    "read_json",
    "unflatten",
    "verify_files",
    "write_json",
]

FORMAT = "distribute-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
PARTIAL = ".partial"

#: A JSON value in which tensors are placeholders.
Skeleton = Any


class CheckpointError(InvalidArgumentError):
    """A checkpoint that cannot be read: missing, truncated, corrupt or foreign."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} in the checkpoint")
    return dtype


def flatten(prefix: str, value: Any, tensors: dict[str, torch.Tensor]) -> Skeleton:
    """The skeleton of ``value``; its tensors go into ``tensors`` under ``prefix/...``.

    Example:
        >>> tensors = {}
        >>> flatten("opt", {"lr": 0.1, "m": torch.zeros(2)}, tensors)
        {'lr': 0.1, 'm': {'__tensor__': 'opt/m', 'shape': [2], 'dtype': 'float32'}}
    """
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value
        return {"__tensor__": prefix, "shape": list(value.shape), "dtype": _dtype_name(value.dtype)}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: flatten(f"{prefix}/{k}", v, tensors) for k, v in value.items()}
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise InvalidArgumentError(
                    f"cannot checkpoint {prefix!r}: a dict key {k!r} of type {type(k).__name__}; "
                    "keys must be strings or numbers"
                )
            items.append([k, flatten(f"{prefix}/{k}", v, tensors)])
        return {"__dict__": items}
    if isinstance(value, tuple):
        return {"__tuple__": [flatten(f"{prefix}/{i}", v, tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [flatten(f"{prefix}/{i}", v, tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise InvalidArgumentError(
        f"cannot checkpoint {prefix!r}: a {type(value).__name__} is neither a tensor, a number, "
        "a string nor a dict/list/tuple of them; give the object a state_dict() that returns "
        "those"
    )


def templates(skeleton: Skeleton) -> Iterator[tuple[str, torch.Tensor]]:
    """Empty CPU tensors for every tensor placeholder of ``skeleton`` (DCP loads into them)."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            yield (
                skeleton["__tensor__"],
                torch.empty(skeleton["shape"], dtype=_dtype(skeleton["dtype"])),
            )
            return
        for value in skeleton.values():
            yield from templates(value)
    elif isinstance(skeleton, list):
        for value in skeleton:
            yield from templates(value)


def unflatten(skeleton: Skeleton, tensors: dict[str, torch.Tensor]) -> Any:
    """The value `flatten` took apart, with its tensors from ``tensors``."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__tuple__" in skeleton:
            return tuple(unflatten(v, tensors) for v in skeleton["__tuple__"])
        if "__dict__" in skeleton:
            return {k: unflatten(v, tensors) for k, v in skeleton["__dict__"]}
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton


# -- files ----------------------------------------------------------------------------


def write_json(path: Path, value: Any) -> None:
    """Writes ``value`` as JSON to ``path`` through a temporary file and a rename."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def read_json(path: Path, what: str) -> Any:
    """Reads a JSON file of a checkpoint, raising `CheckpointError` naming it."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing: {path.parent} is not a complete distribute checkpoint ({what})"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt ({what} is not valid JSON: {e})") from None


def files_with_sizes(directory: Path) -> dict[str, int]:
    """Every file of a checkpoint directory but the manifest, with its size."""
    return {
        p.name: p.stat().st_size
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }


def verify_files(directory: Path, expected: dict[str, int]) -> None:
    """Raises `CheckpointError` naming the first file missing or of the wrong size."""
    for name, size in expected.items():
        path = directory / name
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing from the checkpoint") from None
        if actual != size:
            raise CheckpointError(
                f"{path} is {actual} bytes but the checkpoint wrote {size}: it is truncated or "
                "was overwritten; restore an earlier checkpoint"
            )


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``directory``, checked for format and files."""
    if not directory.is_dir():
        if directory.exists():
            raise CheckpointError(
                f"{directory} is a file, not a distribute checkpoint (a directory written by "
                "ds.Checkpoint.save); torch.save files load with torch.load"
            )
        raise CheckpointError(f"no checkpoint at {directory}")
    manifest = read_json(directory / MANIFEST, "its manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{directory / MANIFEST} is not a distribute checkpoint manifest (another "
            "program's file?)"
        )
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{directory} has format version {manifest.get('version')}; this library reads "
            f"version {VERSION}"
        )
    verify_files(directory, manifest["files"])
    return manifest


def complete_path(path: Path) -> Path:
    """``path``, or the complete ``<path>.old`` that a write over ``path`` killed
    between its two renames left (see `commit`)."""
    old = _old_path(path)
    if not path.exists() and (old / MANIFEST).exists():
        return old
    return path


def _old_path(path: Path) -> Path:
    """Where `commit` moves the checkpoint it replaces, until the new one is in place."""
    return path.with_name(path.name + ".old")


def partial_path(path: Path) -> Path:
    """Where a checkpoint is written before it is complete."""
    return path.with_name(path.name + PARTIAL)


def prepare_partial(path: Path) -> Path:
    """An empty ``<path>.partial`` directory (what a killed save left is removed)."""
    partial = partial_path(path)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def commit(path: Path) -> None:
    """Renames the complete ``<path>.partial`` to ``path``, replacing an older ``path``.

    Replacing takes two renames (``path`` to ``<path>.old``, then the new one in);
    a process killed between them leaves ``<path>.old`` complete, which
    `complete_path` finds.
    """
    partial = partial_path(path)
    if path.exists():
        old = _old_path(path)
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old)
    else:
        os.replace(partial, path)
    _sync_directory(path.parent)


def _sync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
