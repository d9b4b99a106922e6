"""A checkpoint's tensors: DCP's files, indexed in JSON and checked before they load.

# NOTE [checkpoint integrity]
`torch.distributed.checkpoint` writes the tensors (``*.distcp``: each stored tensor
is one ``torch.save`` record, the records back to back) and a pickled index of
them (``.metadata``). Restoring through DCP's own reader unpickles that index, so a
crafted ``.metadata`` ran code during `restore`, and nothing noticed flipped bytes.

So the tensor index goes into the manifest as JSON (`tensor_index`: each stored
tensor's dtype, shape, chunks, file, byte range and checksum), and `restore` reads
through `VerifyingReader`, which never opens ``.metadata``: it builds DCP's index
from that JSON (numbers, strings and dtype names; nothing there can run code),
maps each file it needs, checks every record it is about to read against its
checksum, and only when all of them match loads them (``torch.load`` with
``weights_only=True``, which refuses anything but tensors). A damaged file
therefore raises naming the file and the tensor, and leaves the restored
objects as they were.

The checksum is XXH3-128 (the ``xxhash`` package; ``xxh128sum`` prints the same
digest for a whole file): about 20 GB/s on one core, against 0.5-2 GB/s for
SHA-256 or BLAKE2, so checking every byte costs a few milliseconds per 100 MB. It
detects damage (flipped bits, truncation, a stray write, an edit); it is not a
signature: whoever can rewrite the files can rewrite the manifest's checksums too.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from distribute.checkpoint._format import (
    CHECKSUM,
    CheckpointError,
    checksum,
    dtype_by_name,
    dtype_name,
    mapped,
)

__all__ = ["VerifyingReader", "checksums_of", "object_of", "tensor_files", "tensor_index"]


def object_of(key: str) -> str:
    """The checkpoint object a stored tensor belongs to: ``model`` for
    ``model/0.weight``, ``rng of rank 1`` for ``rank1/rng/torch_cpu``."""
    parts = key.split("/")
    if len(parts) > 1 and parts[0].startswith("rank") and parts[0][4:].isdigit():
        return f"{parts[1]} of rank {parts[0][4:]}"
    return parts[0]


# -- writing: the index of what DCP wrote, and its checksums ----------------------------------


def indexing_writer(path: Path, **options: Any) -> Any:
    """DCP's `FileSystemWriter` at ``path`` whose save returns the index of every record
    (``storage_data``), on every torch the package supports: torch 2.9's ``finish``
    fills a copy of the metadata, so its ``save`` returned none (every checkpoint
    failed there); this writer fills the one ``save`` returns (and broadcasts).

    Example::

        metadata = dcp_save(tensors, storage_writer=indexing_writer(partial))
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class _IndexingWriter(FileSystemWriter):
        def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
            if metadata.storage_data is None:
                metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
            super().finish(metadata=metadata, results=results)

    return _IndexingWriter(path, **options)


def tensor_index(metadata: Metadata) -> dict[str, Any]:
    """The JSON index of the tensors DCP wrote, from the metadata its save returns:
    for each key its dtype, shape and chunks, each chunk with its file and byte range.

    Raises:
        CheckpointError: DCP stored something this index cannot describe (bytes, or
            a transformed record); a checkpoint of this library holds neither.
    """
    index: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"torch.distributed.checkpoint stored {key!r} as {type(entry).__name__}, not "
                "as a tensor; this library writes tensors only (please report this)"
            )
        chunks = []
        for chunk in entry.chunks:
            where = metadata.storage_data[MetadataIndex(key, chunk.offsets)]
            if getattr(where, "transform_descriptors", None):
                raise CheckpointError(
                    f"torch.distributed.checkpoint stored {key!r} transformed "
                    f"({where.transform_descriptors}); this library reads plain records only "
                    "(please report this)"
                )
            chunks.append(
                {
                    "offsets": list(chunk.offsets),
                    "sizes": list(chunk.sizes),
                    "file": str(where.relative_path),
                    "at": int(where.offset),
                    "length": int(where.length),
                }
            )
        index[key] = {
            "dtype": dtype_name(entry.properties.dtype),
            "shape": list(entry.size),
            "chunks": chunks,
        }
    return index


def tensor_files(index: dict[str, Any]) -> list[str]:
    """The files holding the tensors of ``index``, sorted."""
    return sorted({chunk["file"] for entry in index.values() for chunk in entry["chunks"]})


def checksums_of(directory: Path, index: dict[str, Any], files: Sequence[str]) -> dict[str, Any]:
    """The checksums of ``files`` (tensor files of ``index``) and of every chunk
    stored in them: ``{"files": {name: digest}, "chunks": {key: {i: digest}}}``.

    One pass over each file: a megabyte at a time goes into the file's digest and
    its record's while it is in the cache (two passes cost twice the time).
    """
    wanted = set(files)
    found: dict[str, Any] = {"files": {}, "chunks": {}}
    by_file: dict[str, list[tuple[str, int, dict[str, Any]]]] = {}
    for key, entry in index.items():
        for i, chunk in enumerate(entry["chunks"]):
            if chunk["file"] in wanted:
                by_file.setdefault(chunk["file"], []).append((key, i, chunk))
    for name in sorted(wanted):
        with mapped(directory / name) as data:
            whole = xxhash.xxh3_128()
            done = 0  # bytes of the file in `whole` so far
            for key, i, chunk in sorted(by_file.get(name, []), key=lambda r: r[2]["at"]):
                start, end = chunk["at"], chunk["at"] + chunk["length"]
                record = xxhash.xxh3_128()
                for at in range(start, end, _PIECE):
                    stop = min(at + _PIECE, end)
                    with data[at:stop] as piece:
                        record.update(piece)
                        if at == done:  # the records are back to back
                            whole.update(piece)
                            done = stop
                    if stop > done:  # bytes between records (none are written so)
                        _update(whole, data, done, stop)
                        done = stop
                found["chunks"].setdefault(key, {})[str(i)] = record.hexdigest()
            _update(whole, data, done, len(data))
            found["files"][name] = whole.hexdigest()
    return found


#: How much of a file goes into its checksums at a time (fits the cache).
_PIECE = 1 << 20


def _update(digest: Any, data: memoryview, start: int, end: int) -> None:
    """Adds bytes ``[start, end)`` of ``data`` to ``digest``."""
    if end > start:
        with data[start:end] as piece:
            digest.update(piece)


# -- reading: DCP's index from the JSON one, every record checked before it loads -----------


@dataclass(frozen=True)
class _Record:
    """Where one stored chunk is, and its checksum."""

    key: str
    file: str
    at: int
    length: int
    checksum: str
    sizes: tuple[int, ...]  # the chunk's shape


class VerifyingReader(StorageReader):
    """DCP's storage reader for a checkpoint directory (NOTE [checkpoint integrity]):
    the index comes from the manifest's JSON, and every record read is checked
    against its checksum before any is loaded.

    Args:
        directory: the checkpoint directory.
        index: the manifest's ``tensors`` (`tensor_index` plus each chunk's
            ``xxh3_128``), already checked against the manifest's own checksum.
        native: whether the checkpoint was written in this machine's byte order
            (its records' bytes can then be copied straight into the tensors).

    Raises:
        CheckpointError: ``index`` is malformed (names the entry).
    """

    def __init__(self, directory: Path, index: Any, native: bool = False) -> None:
        super().__init__()
        self._directory = directory
        self._native = native
        self._metadata, self._records = _parse_index(directory, index)
        #: The integrity error this reader raised, if any (DCP wraps it).
        self.failure: CheckpointError | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            self._read(plan.items, planner)
        except CheckpointError as e:
            self.failure = e
            raise
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        by_file: dict[str, list[tuple[ReadItem, _Record]]] = {}
        for item in items:
            if item.type is LoadItemType.BYTE_IO:  # `_parse_index` makes tensors only
                raise CheckpointError(f"{self._directory}: DCP asked for bytes; it holds tensors")
            record = self._records[item.storage_index]
            by_file.setdefault(record.file, []).append((item, record))
        with contextlib.ExitStack() as stack:
            data_of = {
                name: stack.enter_context(mapped(self._directory / name)) for name in by_file
            }
            for name, reads in by_file.items():  # every record checked before any loads
                for _, record in reads:
                    with data_of[name][record.at : record.at + record.length] as data:
                        found = checksum(data)
                    if found != record.checksum:
                        raise CheckpointError(
                            f"{self._directory / name} is damaged: the bytes of the stored "
                            f"tensor {record.key!r} (of {object_of(record.key)!r}) have "
                            f"{CHECKSUM} {found}, but the checkpoint recorded "
                            f"{record.checksum}; nothing was restored. Restore an earlier "
                            "checkpoint"
                        )
            for name, reads in by_file.items():
                for item, record in reads:
                    target = planner.resolve_tensor(item).detach()
                    with data_of[name][record.at : record.at + record.length] as data:
                        if not (self._native and _copy_directly(data, item, record, target)):
                            tensor = _load_record(self._directory / name, record, data)
                            _copy_into(item, record, tensor, target, self._directory / name)
                    planner.commit_tensor(item, target)


def _copy_directly(data: memoryview, item: ReadItem, record: _Record, target: torch.Tensor) -> bool:
    """Copies a whole stored chunk's bytes from the mapped file straight into
    ``target``, where its record is a plain contiguous tensor of ``target``'s dtype
    and shape; False where it is not (`_load_record` then reads it).

    ``torch.load`` onto the meta device reads the record's header only (with
    ``weights_only``, as everywhere here): the tensor's dtype, shape and where its
    bytes are. Reading them through ``torch.load`` onto the CPU, then copying, took
    three passes over the data; this takes one.
    """
    if (
        target.device.type != "cpu"
        or not target.is_contiguous()
        or any(item.storage_offsets)
        or tuple(item.lengths) != record.sizes
        or tuple(target.shape) != record.sizes
    ):
        return False
    try:
        source = cast(IO[bytes], _MemoryFile(data))  # a file object but for its static type
        header = torch.load(source, map_location="meta", weights_only=True)
    except Exception:
        return False  # `_load_record` names what is wrong with it
    if not isinstance(header, torch.Tensor):
        return False
    offset = getattr(header.untyped_storage(), "_checkpoint_offset", None)
    if (
        not isinstance(offset, int)  # a torch that does not say where the bytes are
        or header.layout is not torch.strided
        or header.dtype != target.dtype
        or header.shape != target.shape
        or not header.is_contiguous()
        or header.storage_offset() != 0
    ):
        return False
    size = target.numel() * target.element_size()
    if size == 0:
        return True
    if offset < 0 or offset + size > len(data):
        return False
    stored = np.frombuffer(data, dtype=np.uint8, count=size, offset=offset)
    target.view(-1).view(torch.uint8).numpy()[:] = stored
    del stored  # it holds the mapping's buffer, which must be released
    # A write torch did not see: counted as one, as `copy_` would, so that a mirrored
    # variable's other copies follow its primary (NOTE in variables.py).
    torch.autograd.graph.increment_version(target)
    return True


def _load_record(path: Path, record: _Record, data: memoryview) -> torch.Tensor:
    try:
        # a file object in all but its static type: torch.load reads it with readinto
        source = cast(IO[bytes], _MemoryFile(data))
        tensor = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{path}: the stored tensor {record.key!r} (of {object_of(record.key)!r}) cannot "
            f"be read although its checksum matches ({type(e).__name__}: {e}); the file was "
            "not written by this library. Restore an earlier checkpoint"
        ) from None
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(
            f"{path}: the record of {record.key!r} holds a {type(tensor).__name__}, not a "
            "tensor; the file was not written by this library. Restore an earlier checkpoint"
        )
    return tensor


def _copy_into(
    item: ReadItem, record: _Record, tensor: torch.Tensor, target: torch.Tensor, path: Path
) -> None:
    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
        if length < tensor.size(dim):  # a part of a stored chunk (a resharded read)
            tensor = tensor.narrow(dim, offset, length)
    if target.size() != tensor.size():
        raise CheckpointError(
            f"{path}: the stored tensor {record.key!r} has shape {tuple(tensor.shape)} where "
            f"the checkpoint's index says {tuple(target.shape)}; the checkpoint is "
            "inconsistent. Restore an earlier checkpoint"
        )
    target.copy_(tensor)


def _parse_index(directory: Path, index: Any) -> tuple[Metadata, dict[MetadataIndex, _Record]]:
    """DCP's `Metadata` and the records of the JSON tensor index.

    Raises:
        CheckpointError: a malformed entry (named): a JSON index from a manifest
            whose own checksum matched was written so by hand.
    """
    if not isinstance(index, dict):
        raise CheckpointError(f"{directory}: the manifest's tensor index is not a mapping")
    entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    records: dict[MetadataIndex, _Record] = {}
    for key, entry in index.items():
        try:
            chunks = []
            for chunk in entry["chunks"]:
                offsets, sizes = _ints(chunk["offsets"]), _ints(chunk["sizes"])
                name = chunk["file"]
                if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                    raise ValueError(f"file {name!r} is not a name in the checkpoint directory")
                at, length = _ints([chunk["at"], chunk["length"]])
                records[MetadataIndex(key, offsets)] = _Record(
                    key, name, at, length, str(chunk[CHECKSUM]), tuple(sizes)
                )
                chunks.append(
                    ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                )
            entries[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_by_name(entry["dtype"])),
                size=torch.Size(_ints(entry["shape"])),
                chunks=chunks,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{directory}: the manifest's entry for the stored tensor {key!r} is malformed "
                f"({type(e).__name__}: {e}); restore an earlier checkpoint"
            ) from None
    return Metadata(state_dict_metadata=entries), records


def _ints(values: Any) -> list[int]:
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        raise ValueError(f"expected a list of non-negative integers, got {values!r}")
    return list(values)


class _MemoryFile(io.RawIOBase):
    """A read-only file over a buffer, for ``torch.load``: it reads with
    ``readinto``, straight from the mapped file into the tensor's storage."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data = data
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._data)}
        self._position = max(0, base[whence] + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        size = max(0, min(len(buffer), len(self._data) - self._position))
        buffer[:size] = self._data[self._position : self._position + size]
        self._position += size
        return size
