"""`Checkpoint`: tf.train's API over torch.distributed.checkpoint (`CheckpointManager`
is in `_manager.py`).

See NOTE [checkpoint format] for what is on disk. Every worker of a multi-worker
strategy calls `save` and `restore` (as in TF): each writes its share of the
tensors through `torch.distributed.checkpoint`, which writes a value that every
worker holds (a mirrored variable) once. Before anything is written the workers
check that all of them are saving the same path, so a save called on one rank
alone raises (naming the others and what they are doing) instead of hanging.

`torch.distributed.checkpoint` (and DTensor, which it imports) is imported by
`write` and `restore`, not here: it is a third of ``import distribute``'s time
(0.6 s), which every worker process would pay whether it checkpoints or not.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distribute import context
from distribute.checkpoint._format import (
    CHECKSUM,
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    commit,
    complete_path,
    file_checksum,
    flatten,
    partial_path,
    prepare_partial,
    read_json,
    read_manifest,
    seal,
    templates,
    unflatten,
    write_json,
)
from distribute.checkpoint._objects import (
    RNGState,
    apply_state,
    capture_state,
    direct_targets,
    is_per_worker,
    sharded_templates,
    strategy_of,
)
from distribute.errors import CollectiveTimeoutError, InvalidArgumentError

if TYPE_CHECKING:
    from distribute.collectives.base import CrossWorker

__all__ = ["Checkpoint"]


def _strategy_holding(obj: Any) -> Any:
    """The strategy whose variables (or, under `FullyShardedStrategy`, whose sharded
    parameters) ``obj`` holds; None if it holds none."""
    values: list[Any] = []
    if isinstance(obj, torch.Tensor):
        values = [obj]
    elif isinstance(obj, torch.nn.Module):
        values = list(obj.state_dict(keep_vars=True).values())
    elif isinstance(obj, torch.optim.Optimizer):
        values = [p for g in obj.param_groups for p in g["params"]]
    for value in values:
        strategy = strategy_of(value)
        if strategy is not None:
            return strategy
    return None


class Checkpoint:
    """Saves and restores modules, optimizers, input positions, tensors and numbers.

    A checkpoint holds one logical value per variable, whatever the strategy that
    wrote it, so it restores under any other strategy and world size (optimizer
    state included). Under a multi-worker strategy every worker calls `save` and
    `restore`. Writes are atomic: a process killed during `save` leaves the
    previous checkpoint intact.

    Args:
        **objects: what to save, by name: ``torch.nn.Module``, ``torch.optim``
            optimizers, distributed iterators (their position in the data), plain
            or distributed tensors, ints/floats/strings (read back as attributes:
            ``ckpt.step``), `ds.RNGState()`, and any object with ``state_dict`` and
            ``load_state_dict`` (LR schedulers, `ds.GradScaler`).

    Example:
        >>> import torch, tempfile, distribute as ds
        >>> model = torch.nn.Linear(2, 1)
        >>> ckpt = ds.Checkpoint(model=model, step=3)
        >>> path = ckpt.save(tempfile.mkdtemp() + "/ckpt")      # ".../ckpt-1"
        >>> ckpt.step = 0
        >>> ckpt.restore(path).step
        3
    """

    def __init__(self, **objects: Any) -> None:
        object.__setattr__(self, "_objects", dict(objects))
        object.__setattr__(self, "_pending", {})
        object.__setattr__(self, "save_counter", 0)

    # -- attributes: the objects, and deferred restores ---------------------------------

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__["_objects"]
        if name in objects:
            return objects[name]
        raise AttributeError(f"Checkpoint has no object {name!r}; it has {sorted(objects)}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("save_counter", "_unmatched"):
            object.__setattr__(self, name, value)
            return
        self._objects[name] = value
        pending = self._pending.pop(name, None)
        if pending is not None:  # restored before this object was attached
            self._objects[name] = apply_state(name, value, pending)

    # -- saving ---------------------------------------------------------------------------

    def save(self, file_prefix: str | Path) -> str:
        """Writes a numbered checkpoint ``<file_prefix>-<n>`` and returns its path.

        ``n`` is `save_counter` after it is incremented (1 for the first save).
        Every worker of a multi-worker strategy must call it.
        """
        self.save_counter += 1
        return self.write(f"{file_prefix}-{self.save_counter}")

    def write(self, file_path: str | Path) -> str:
        """Writes a checkpoint at exactly ``file_path`` (a directory); returns the path.

        Raises:
            CollectiveMismatchError: the workers are not all saving this path.
            CollectiveTimeoutError: a worker never called save (it is named).
        """
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        from distribute.checkpoint._storage import (
            checksums_of,
            indexing_writer,
            tensor_files,
            tensor_index,
        )

        path = Path(file_path)
        workers = self._workers()
        rank = workers.rank if workers is not None else 0
        world_size = workers.world_size if workers is not None else 1
        if workers is not None:
            workers.check_same(("checkpoint save", str(path.resolve())), name="checkpoint save")
        if rank == 0:
            prepare_partial(path)
        if workers is not None:
            workers.barrier("checkpoint directory made")
        partial = partial_path(path)
        tensors: dict[str, torch.Tensor] = {}
        shared: dict[str, Any] = {}
        own: dict[str, Any] = {}
        for name, obj in self._objects.items():
            state = capture_state(name, obj)
            if is_per_worker(obj):
                own[name] = flatten(f"rank{rank}/{name}", state, tensors)
            else:
                shared[name] = flatten(name, state, tensors)
        contiguous = {k: v.contiguous() for k, v in tensors.items()}

        def save() -> Any:
            return dcp_save(
                contiguous,
                storage_writer=indexing_writer(partial, sync_files=False),
                no_dist=world_size == 1,
            )

        try:
            with _quiet_single_process():
                # Watched: a worker killed inside the write is named within seconds by
                # every survivor, not only by those gloo connects to it directly.
                metadata = (
                    save()
                    if workers is None
                    else workers.run_watched(f"checkpoint write {path}", save)
                )
        except (Exception, CheckpointException) as e:  # torch's is a BaseException
            raise _failure(workers, f"writing checkpoint {path}", e) from e
        # Every rank has DCP's index of all the files; each checksums a share of them.
        index = tensor_index(metadata)
        checked = checksums_of(partial, index, tensor_files(index)[rank::world_size])
        write_json(partial / f"rank-{rank}.json", {"objects": own, "checksums": checked})
        if workers is not None:
            workers.barrier("checkpoint files written")
        if rank == 0:
            manifest = _manifest(partial, index, world_size, self.save_counter, shared)
            write_json(partial / MANIFEST, seal(manifest))
            commit(path)
        if workers is not None:
            workers.barrier("checkpoint committed")
        return str(path)

    # -- restoring ------------------------------------------------------------------------

    def restore(self, save_path: str | Path) -> Checkpoint:
        """Restores every object from the checkpoint at ``save_path``; returns self.

        Objects not attached yet are restored when they are (``ckpt.model = model``
        after `restore`). Per-worker state (RNG, input position) is restored on
        the workers whose rank the checkpoint has.

        Raises:
            CheckpointError: the path is not a complete checkpoint (names the file).
            InvalidArgumentError: a module or tensor does not fit the saved value.
        """
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        from distribute.checkpoint._storage import VerifyingReader

        path = Path(save_path)
        workers = self._workers()
        rank = workers.rank if workers is not None else 0
        world_size = workers.world_size if workers is not None else 1
        if workers is not None:
            workers.check_same(
                ("checkpoint restore", str(path.resolve())), name="checkpoint restore"
            )
        path = complete_path(path)
        manifest = read_manifest(path)  # every JSON file is checked against its checksum
        native = manifest.get("byteorder") == sys.byteorder
        reader = VerifyingReader(path, manifest["tensors"], native)
        skeletons: dict[str, Any] = dict(manifest["objects"])
        own_file = f"rank-{rank}.json"
        borrowed: set[str] = set()
        if own_file in manifest["files"]:
            skeletons.update(read_json(path / own_file, "a worker's state")["objects"])
        elif "rank-0.json" in manifest["files"]:
            # A larger world than wrote it: the input position counts global steps, so
            # this rank takes rank 0's (without rank 0's own loader state); its random
            # generators start anew.
            for name, skeleton in read_json(path / "rank-0.json", "a worker's state")[
                "objects"
            ].items():
                if isinstance(skeleton, dict) and "steps" in skeleton and "epoch" in skeleton:
                    skeletons[name] = skeleton
                    borrowed.add(name)
        shapes = dict(templates(skeletons, device="meta"))  # shapes and dtypes, no memory
        targets: dict[str, torch.Tensor] = {}
        for name, obj in self._objects.items():
            if name in skeletons:  # the live tensors, and this worker's shards of the rest
                targets.update(direct_targets(name, obj, skeletons[name], shapes))
                targets.update(sharded_templates(name, obj, skeletons[name], shapes))
        wanted = {
            key: targets[key] if key in targets else torch.empty_like(shape, device="cpu")
            for key, shape in shapes.items()
        }

        def load() -> None:
            dcp_load(wanted, storage_reader=reader, no_dist=world_size == 1)

        try:
            with _quiet_single_process():
                if workers is None:
                    load()
                else:
                    workers.run_watched(f"checkpoint read {path}", load)
        except (Exception, CheckpointException) as e:  # torch's is a BaseException
            if reader.failure is not None:
                raise reader.failure from None
            raise _failure(workers, f"reading the tensors of checkpoint {path}", e) from e
        object.__setattr__(self, "save_counter", int(manifest.get("save_counter", 0)))
        # Generators last: placing an input position draws from them.
        order = sorted(skeletons, key=lambda n: isinstance(self._objects.get(n), RNGState))
        missing = sorted(set(self._objects) - set(skeletons))
        if missing:
            logger.warning(
                "checkpoint %s has nothing for %s; they are left as they are", path, missing
            )
        self._unmatched = missing
        for name in order:
            skeleton = skeletons[name]
            state = unflatten(skeleton, wanted)
            if name in borrowed:
                state = {**state, "loader": None}  # replay rank 0's position for this rank
            if name in self._objects:
                self._objects[name] = apply_state(name, self._objects[name], state)
            elif state is None or isinstance(state, (bool, int, float, str)):
                self._objects[name] = state  # a plain value needs no object to go into
            else:
                self._pending[name] = state
        return self

    read = restore

    def assert_consumed(self) -> Checkpoint:
        """Raises unless the last restore matched every object both ways (TF's check).

        Raises:
            CheckpointError: objects the checkpoint had nothing for, or checkpoint
                entries that no attached object took (named).
        """
        unmatched = getattr(self, "_unmatched", [])
        if unmatched or self._pending:
            raise CheckpointError(
                f"the restore did not match: objects with nothing in the checkpoint "
                f"{unmatched or 'none'}, checkpoint entries with no object "
                f"{sorted(self._pending) or 'none'}; name the objects as they were saved"
            )
        return self

    def expect_partial(self) -> Checkpoint:
        """Says a partial restore is intended (no warning is kept; TF's spelling)."""
        self._pending.clear()
        object.__setattr__(self, "_unmatched", [])
        return self

    def _workers(self) -> CrossWorker | None:
        """The multi-worker collectives of the strategy the objects belong to (their
        variables, their input pipeline, or the current strategy), if any.

        Raises:
            InvalidArgumentError: several processes train together but nothing says
                which strategy's workers they are.
        """
        from distribute.data._iterator import DistributedIterator

        candidates: list[CrossWorker | None] = []
        for obj in self._objects.values():
            strategy = _strategy_holding(obj)
            if strategy is not None:
                candidates.append(strategy.extended.cross_worker)
            if isinstance(obj, DistributedIterator):
                candidates.append(obj._workers.collectives)
        candidates.append(context.get_strategy().extended.cross_worker)
        for cross in candidates:
            if cross is not None:
                return cross
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise InvalidArgumentError(
                f"ds.Checkpoint of {sorted(self._objects)} runs in one of "
                f"{dist.get_world_size()} processes but holds nothing of a multi-worker "
                "strategy (no variables or distributed iterator of one), so it cannot tell "
                "its workers apart: save inside `with strategy.scope():`, or add the model"
            )
        return None


def _manifest(
    directory: Path,
    index: dict[str, Any],
    world_size: int,
    save_counter: int,
    shared: dict[str, Any],
) -> dict[str, Any]:
    """The manifest of the complete checkpoint files in ``directory`` (rank 0, after
    every rank wrote its files and its share of the tensor checksums)."""
    from distribute.checkpoint._storage import object_of

    checked: dict[str, str] = {}
    holds: dict[str, set[str]] = {}
    for rank in range(world_size):
        state = read_json(directory / f"rank-{rank}.json", "a worker's state")
        checked.update(state["checksums"]["files"])
        holds[f"rank-{rank}.json"] = {object_of(f"rank{rank}/{n}") for n in state["objects"]}
        for key, digests in state["checksums"]["chunks"].items():
            for i, digest in digests.items():
                index[key]["chunks"][int(i)][CHECKSUM] = digest
    for key, entry in index.items():
        for chunk in entry["chunks"]:
            holds.setdefault(chunk["file"], set()).add(object_of(key))
    files = {}
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            files[p.name] = {
                "bytes": p.stat().st_size,
                CHECKSUM: checked.get(p.name) or file_checksum(p),
                "objects": sorted(holds.get(p.name, ())),
            }
    return {
        "format": FORMAT,
        "version": VERSION,
        "byteorder": sys.byteorder,  # of the tensor records (torch.save writes it)
        "save_counter": save_counter,
        "world_size": world_size,
        "objects": shared,
        "tensors": index,
        "files": files,
    }


def _failure(workers: CrossWorker | None, what: str, error: BaseException) -> Exception:
    """The error to raise when DCP failed: a worker's integrity error (a damaged
    file, named), the library's diagnosis when a worker is gone (DCP's own
    collectives only say a connection closed), else a `CheckpointError` naming the
    checkpoint."""
    for failure, _ in getattr(error, "failures", {}).values():
        if isinstance(failure, CheckpointError):
            return failure
    if isinstance(error, CollectiveTimeoutError):  # diagnosed already (`run_watched`)
        return error
    if workers is not None:
        try:
            workers.barrier(f"{what} (after an error)")
        except Exception as diagnosed:  # names the dead or stuck rank
            return diagnosed
    return CheckpointError(f"{what} failed: {error}")


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silences DCP's warning that it runs in one process: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


logger = logging.getLogger(__name__)
