"""The on-disk format of a checkpoint: a directory of DCP files and a manifest.

# NOTE [checkpoint format]
A checkpoint is a directory::

    ckpt-3/
      manifest.json        what is in it: every object's structure (its skeleton),
                           the tensor index (each stored tensor's dtype, shape, file,
                           byte range and checksum), every file's size and checksum,
                           and the checksum of the manifest itself
      rank-<r>.json        per-worker objects (RNG state, input position) of rank r
      *.distcp             the tensors, written by torch.distributed.checkpoint
      .metadata            DCP's own (pickled) index of them: kept for DCP's tools,
                           never read by this library

An object's state (a module's or optimizer's ``state_dict``, an iterator's
position, a plain value) is stored as a *skeleton*: its nest of dicts, lists and
tuples in JSON, with each tensor replaced by ``{"__tensor__": key, ...}`` and
the tensor itself stored once under ``key`` by DCP. One logical value per
variable, whatever the strategy: nothing in the format names replicas, devices
or world sizes, so a checkpoint restores under any strategy.

Writing goes to ``<path>.partial`` and is renamed into place once every file is
complete, so a process killed at any moment leaves either the whole new
checkpoint or none of it (and the previous one as the latest).

Restoring checks before it loads (NOTE [checkpoint integrity] in `_storage.py`):
the manifest against its own checksum, every file's size, the JSON files whole
against their checksums, and each stored tensor's bytes against its checksum; a
missing, truncated, damaged or edited file raises an error naming it (and the
objects in it). Nothing is unpickled: structure is JSON, and tensors load with
``torch.load(weights_only=True)`` after their bytes matched.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import xxhash

from distribute.errors import InvalidArgumentError

__all__ = [
    "CheckpointError",
    "Skeleton",
    "commit",
    "checksum",
    "dtype_by_name",
    "dtype_name",
    "file_checksum",
    "flatten",
    "mapped",
    "read_json",
    "seal",
    "unflatten",
    "verify_files",
    "write_json",
]

FORMAT = "distribute-checkpoint"
#: 2: checksums of every file and stored tensor, the tensor index in JSON.
VERSION = 2
MANIFEST = "manifest.json"
#: The manifest's key for the checksum of the rest of it.
SEAL = "checksum"
#: The checksum every file and stored tensor of a checkpoint carries (NOTE
#: [checkpoint integrity] in `_storage.py` says why this one).
CHECKSUM = "xxh3_128"
PARTIAL = ".partial"

#: A JSON value in which tensors are placeholders.
Skeleton = Any


class CheckpointError(InvalidArgumentError):
    """A checkpoint that cannot be read: missing, truncated, corrupt or foreign.

    Example:
        >>> import distribute as ds, torch
        >>> ds.Checkpoint(model=torch.nn.Linear(1, 1)).restore("/nonexistent/ckpt-1")
        Traceback (most recent call last):
        ...
        distribute.checkpoint._format.CheckpointError: ...
    """


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def dtype_by_name(name: Any) -> torch.dtype:
    """The torch dtype named ``name`` (`dtype_name`'s inverse).

    Raises:
        CheckpointError: no dtype has that name.
    """
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} in the checkpoint")
    return dtype


def flatten(prefix: str, value: Any, tensors: dict[str, torch.Tensor]) -> Skeleton:
    """The skeleton of ``value``; its tensors go into ``tensors`` under ``prefix/...``.

    Example:
        >>> import torch
        >>> from distribute.checkpoint._format import flatten
        >>> tensors = {}
        >>> flatten("opt", {"lr": 0.1, "m": torch.zeros(2)}, tensors)
        {'lr': 0.1, 'm': {'__tensor__': 'opt/m', 'shape': [2], 'dtype': 'float32'}}
    """
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value
        return {"__tensor__": prefix, "shape": list(value.shape), "dtype": dtype_name(value.dtype)}
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


def templates(
    skeleton: Skeleton, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Empty tensors on ``device`` for every tensor placeholder of ``skeleton`` (DCP
    loads into them; on the ``"meta"`` device they are shapes and dtypes, no memory)."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            yield (
                skeleton["__tensor__"],
                torch.empty(
                    skeleton["shape"], dtype=dtype_by_name(skeleton["dtype"]), device=device
                ),
            )
            return
        for value in skeleton.values():
            yield from templates(value, device)
    elif isinstance(skeleton, list):
        for value in skeleton:
            yield from templates(value, device)


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


def checksum(data: bytes | memoryview) -> str:
    """The XXH3-128 digest of ``data`` in hex (what ``xxh128sum`` prints).

    Example:
        >>> from distribute.checkpoint._format import checksum
        >>> checksum(b"")
        '99aa06d3014798d86001c324468d497f'
    """
    return xxhash.xxh3_128_hexdigest(data)


def file_checksum(path: Path) -> str:
    """`checksum` of a whole file (mapped, not copied)."""
    with mapped(path) as data:
        return checksum(data)


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[memoryview]:
    """The bytes of file ``path``, mapped read-only (an empty file: no bytes)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield memoryview(b"")
            return
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        with memoryview(mapping) as data:
            yield data
    finally:
        mapping.close()


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


def canonical(value: Any) -> bytes:
    """``value`` as JSON in one spelling (sorted keys, no spaces): what a checksum
    of JSON data covers, so that reading and writing it again changes nothing."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with the checksum of the rest of it under `SEAL`."""
    return {**manifest, SEAL: checksum(canonical(manifest))}


def verify_files(directory: Path, files: dict[str, Any], whole: set[str]) -> None:
    """Checks every file's size, and the checksum of those in ``whole`` (the
    tensor files' records are checked as they are read).

    Raises:
        CheckpointError: the first file missing, of the wrong size, or damaged
            (named, with the objects it holds).
    """
    for name, entry in files.items():
        path = directory / name
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(
                f"{path} is missing from the checkpoint{_holding(entry)}; restore an earlier "
                "checkpoint"
            ) from None
        if actual != entry["bytes"]:
            raise CheckpointError(
                f"{path} is {actual} bytes but the checkpoint wrote {entry['bytes']}: it is "
                f"truncated or was overwritten{_holding(entry)}; restore an earlier checkpoint"
            )
    for name in sorted(whole):
        entry, path = files[name], directory / name
        found = file_checksum(path)
        if found != entry[CHECKSUM]:
            raise CheckpointError(
                f"{path} is damaged or was edited after the save: its {CHECKSUM} is {found}, "
                f"but the checkpoint recorded {entry[CHECKSUM]}{_holding(entry)}; nothing was "
                "restored. Restore an earlier checkpoint"
            )


def _holding(entry: dict[str, Any]) -> str:
    objects = entry.get("objects")
    return f" (it holds {', '.join(map(repr, objects))})" if objects else ""


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``directory``, checked: its format, its own
    checksum, every file's size and the checksums of the files read whole.

    Raises:
        CheckpointError: not a checkpoint, another format version, or a missing,
            truncated or damaged file (named).
    """
    if not directory.is_dir():
        if directory.exists():
            raise CheckpointError(
                f"{directory} is a file, not a distribute checkpoint (a directory written by "
                "ds.Checkpoint.save); torch.save files load with torch.load"
            )
        raise CheckpointError(f"no checkpoint at {directory}")
    path = directory / MANIFEST
    manifest = read_json(path, "its manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a distribute checkpoint manifest (another program's file?)"
        )
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{directory} has format version {manifest.get('version')!r}; this library reads "
            f"version {VERSION} (version 1, written before checksums, kept its tensor index "
            "as a pickle, which restoring would have to unpickle). Save it again with the "
            "version that wrote it, or load its tensors with torch.distributed.checkpoint if "
            "you trust the files"
        )
    recorded = manifest.pop(SEAL, None)
    found = checksum(canonical(manifest))
    if recorded != found:
        raise CheckpointError(
            f"{path} is damaged or was edited after the save: its contents have checksum "
            f"{found}, but it recorded {recorded}; nothing was restored. Restore an earlier "
            "checkpoint"
        )
    try:
        tensors = {c["file"] for e in manifest["tensors"].values() for c in e["chunks"]}
        verify_files(directory, manifest["files"], set(manifest["files"]) - tensors)
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{path} is malformed ({type(e).__name__}: {e}) although its checksum matches: it "
            "was written by hand. Restore an earlier checkpoint"
        ) from None
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
