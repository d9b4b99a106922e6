"""`CheckpointManager`: numbered checkpoints in a directory, the last few kept.

The kept names are listed in ``<directory>/checkpoint.json`` (rewritten atomically
after each save); without a readable index, the complete checkpoints are found by
their manifests, so a lost or damaged index never sends training back to the start.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

from distribute.checkpoint._checkpoint import Checkpoint
from distribute.checkpoint._format import MANIFEST, complete_path, write_json
from distribute.errors import InvalidArgumentError

__all__ = ["CheckpointManager"]

logger = logging.getLogger(__name__)

_INDEX = "checkpoint.json"


class CheckpointManager:
    """Keeps the last ``max_to_keep`` numbered checkpoints in ``directory``.

    The list of kept checkpoints lives in ``<directory>/checkpoint.json``, written
    atomically after each save, so a process started again (after a crash, too)
    finds `latest_checkpoint`. Without a readable index (deleted, truncated,
    overwritten), the complete checkpoints are found by their manifests. Each save
    also removes what an interrupted one left: checkpoints beyond ``max_to_keep``
    (a kill between the index and the deletions) and unfinished ``.partial``
    directories.

    Args:
        checkpoint: the `Checkpoint` to save.
        directory: where checkpoints go (created if missing). The manager owns the
            names ``<checkpoint_name>-<n>`` there.
        max_to_keep: how many to keep (None: all).
        checkpoint_name: the prefix of each checkpoint's name.

    Example:
        >>> import torch, tempfile, distribute as ds
        >>> manager = ds.CheckpointManager(ds.Checkpoint(step=1), tempfile.mkdtemp(), 2)
        >>> for _ in range(3):
        ...     _ = manager.save()
        >>> [p.rsplit("/", 1)[1] for p in manager.checkpoints]
        ['ckpt-2', 'ckpt-3']
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | Path,
        max_to_keep: int | None = 5,
        checkpoint_name: str = "ckpt",
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise InvalidArgumentError(f"max_to_keep must be at least 1 or None, got {max_to_keep}")
        self._checkpoint = checkpoint
        self._directory = Path(directory)
        self._max_to_keep = max_to_keep
        self._name = checkpoint_name
        # What this manager writes: <name>-<n>, and a killed save's leftovers.
        self._owned = re.compile(rf"{re.escape(checkpoint_name)}-(\d+)(\.partial|\.old)?")
        self._directory.mkdir(parents=True, exist_ok=True)

    @property
    def directory(self) -> str:
        """Where the checkpoints are."""
        return str(self._directory)

    @property
    def checkpoints(self) -> list[str]:
        """The kept checkpoints' paths, oldest first."""
        return [str(self._directory / name) for name in self._kept()]

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest complete checkpoint's path, or None."""
        kept = self._kept()
        return str(self._directory / kept[-1]) if kept else None

    def save(self, checkpoint_number: int | None = None) -> str:
        """Saves a new checkpoint (every worker calls it); returns its path.

        ``checkpoint_number`` names it (``ckpt-<n>``); by default the checkpoint's
        `save_counter` after incrementing it.
        """
        checkpoint = self._checkpoint
        checkpoint.save_counter += 1
        number = checkpoint_number if checkpoint_number is not None else checkpoint.save_counter
        path = checkpoint.write(self._directory / f"{self._name}-{number}")
        workers = checkpoint._workers()
        if workers is None or workers.rank == 0:
            kept = [n for n in self._kept() if n != Path(path).name] + [Path(path).name]
            if self._max_to_keep is not None:
                kept = kept[-self._max_to_keep :]
            write_json(self._directory / _INDEX, {"checkpoints": kept})
            self._remove_all_but(kept)
        if workers is not None:
            workers.barrier("checkpoint index written")
        return path

    def _kept(self) -> list[str]:
        """The kept names from the index, else (no index, a damaged one, or one
        naming no complete checkpoint) the complete checkpoints found, oldest first."""
        listed = [n for n in self._index() if self._complete(n)]
        if listed:
            return listed
        found = [
            (int(match.group(1)), p.name)
            for p in self._directory.iterdir()
            if (match := self._owned.fullmatch(p.name)) and not match.group(2)
            if self._complete(p.name)
        ]
        return [name for _, name in sorted(found)]

    def _index(self) -> list[str]:
        """The names in the index; none when it is missing or damaged (logged)."""
        index = self._directory / _INDEX
        try:
            names = json.loads(index.read_bytes())["checkpoints"]
        except FileNotFoundError:
            return []
        except (ValueError, KeyError, TypeError) as e:  # truncated, garbage, another schema
            logger.warning(
                "%s is damaged (%s: %s); finding the checkpoints by their manifests instead",
                index,
                type(e).__name__,
                e,
            )
            return []
        if not isinstance(names, list) or not all(
            isinstance(n, str) and (m := self._owned.fullmatch(n)) and not m.group(2) for n in names
        ):
            logger.warning(
                "%s lists %r, not names of this manager's checkpoints; finding them by their "
                "manifests instead",
                index,
                names,
            )
            return []
        return names

    def _complete(self, name: str) -> bool:
        """Whether checkpoint ``name`` is complete (or its complete ``.old`` is there,
        after a re-save killed between its renames)."""
        return (complete_path(self._directory / name) / MANIFEST).exists()

    def _remove_all_but(self, kept: list[str]) -> None:
        """Removes this manager's checkpoints that are not ``kept`` and what saves
        killed half way left (``.partial`` directories, a stale ``.old``, the
        index's temporary file). No save of this manager is in flight: every
        worker is in this one, which is committed."""
        for entry in self._directory.iterdir():
            match = self._owned.fullmatch(entry.name)
            if match is None:
                continue
            base, suffix = f"{self._name}-{match.group(1)}", match.group(2)
            if base not in kept:
                _remove(entry)
            elif suffix == ".partial" or (
                suffix == ".old" and (self._directory / base / MANIFEST).exists()
            ):
                _remove(entry)
        (self._directory / (_INDEX + ".tmp")).unlink(missing_ok=True)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
