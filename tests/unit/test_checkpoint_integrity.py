"""Damaged and crafted checkpoints (issue #27): every damage is named before
anything is restored, and restoring runs no code from the checkpoint directory.

What is damaged here is what a disk, a copy or a hand can change: a flipped byte
(the file's size unchanged), a value edited in a JSON file, a crafted pickle.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from torch.utils.data import DataLoader

import distribute as ds
from distribute.checkpoint import CheckpointError


def _saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint of a model, an Adam optimizer after one step, a step counter and
    an input position (a per-worker object: rank-0.json); and the saved weights."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    model(torch.ones(1, 64)).sum().backward()
    optimizer.step()
    iterator = iter(ds.get_strategy().experimental_distribute_dataset(DataLoader(range(32), 2)))
    next(iterator)
    ckpt = ds.Checkpoint(model=model, optimizer=optimizer, data=iterator, step=5)
    path = Path(ckpt.save(tmp_path / "ckpt"))
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fresh() -> tuple[ds.Checkpoint, torch.nn.Module]:
    """A checkpoint of the same kinds of objects, with other values."""
    torch.manual_seed(1)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    iterator = iter(ds.get_strategy().experimental_distribute_dataset(DataLoader(range(32), 2)))
    return ds.Checkpoint(model=model, optimizer=optimizer, data=iterator, step=0), model


def _replace_once(path: Path, old: bytes, new: bytes) -> None:
    """Edits ``path`` in place: ``old`` (found exactly once) becomes ``new``, of the
    same length, so the file's size is unchanged."""
    assert len(old) == len(new)
    data = path.read_bytes()
    assert data.count(old) == 1, (path.name, old, data.count(old))
    path.write_bytes(data.replace(old, new))


def _assert_untouched(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} was changed by a restore that failed"


# -- flipped bytes and edited values --------------------------------------------------------


def test_a_flipped_byte_in_a_tensors_data_is_named_with_the_tensor_and_nothing_is_restored(
    tmp_path: Path,
) -> None:
    path, saved = _saved(tmp_path)
    (data,) = path.glob("*.distcp")
    weights = saved["weight"].numpy().tobytes()
    at = data.read_bytes().index(weights) + 4 * 100 + 3  # the top byte of weight[1, 36]
    raw = bytearray(data.read_bytes())
    raw[at] ^= 0x40
    data.write_bytes(bytes(raw))  # the same size: only a checksum can tell
    ckpt, model = _fresh()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        ckpt.restore(path)
    message = str(info.value)
    assert data.name in message and "'model/weight'" in message and "'model'" in message, message
    assert "earlier checkpoint" in message
    _assert_untouched(model, before)
    assert ckpt.step == 0


def _edit_manifest_step(path: Path) -> str:
    _replace_once(path / "manifest.json", b'"step": 5', b'"step": 7')
    return "manifest.json"


def _edit_manifest_learning_rate(path: Path) -> str:
    _replace_once(path / "manifest.json", b'"lr": 0.05', b'"lr": 0.07')
    return "manifest.json"


def _edit_manifest_shape(path: Path) -> str:
    # the module's skeleton, not the tensor index: today's restore blamed the model
    manifest = (path / "manifest.json").read_text()
    skeleton = '"__tensor__": "model/weight", "shape": [64, 64]'
    assert manifest.count(skeleton) == 1
    (path / "manifest.json").write_text(manifest.replace(skeleton, skeleton[:-4] + "65]"))
    return "manifest.json"


def _edit_worker_steps(path: Path) -> str:
    _replace_once(path / "rank-0.json", b'"steps": 1', b'"steps": 9')  # moves the next batch
    return "rank-0.json"


def _flip_in_metadata(path: Path) -> str:
    raw = bytearray((path / ".metadata").read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (path / ".metadata").write_bytes(bytes(raw))
    return ".metadata"


@pytest.mark.parametrize(
    "damage",
    [
        _edit_manifest_step,
        _edit_manifest_learning_rate,
        _edit_manifest_shape,
        _edit_worker_steps,
        _flip_in_metadata,
    ],
    ids=["manifest-step", "manifest-lr", "manifest-shape", "rank-0-steps", "metadata-flip"],
)
def test_an_edited_or_damaged_file_is_named_before_anything_is_restored(
    tmp_path: Path, damage: Callable[[Path], str]
) -> None:
    path, _ = _saved(tmp_path)
    name = damage(path)
    ckpt, model = _fresh()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        ckpt.restore(path)
    message = str(info.value)
    assert str(path / name) in message, message
    assert "damaged or was edited" in message and "earlier checkpoint" in message, message
    assert "Size mismatch" not in message and "__0.metadata" not in message
    _assert_untouched(model, before)
    assert ckpt.step == 0


def test_a_damaged_worker_file_names_the_objects_it_holds(tmp_path: Path) -> None:
    path, _ = _saved(tmp_path)
    _edit_worker_steps(path)
    with pytest.raises(CheckpointError, match=r"rank-0\.json.*'data of rank 0'"):
        _fresh()[0].restore(path)


def test_the_manifest_records_every_files_size_and_xxh3_128(tmp_path: Path) -> None:
    """What lets a user check a copied checkpoint by hand (``xxh128sum``)."""
    path, _ = _saved(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    for name, entry in manifest["files"].items():
        raw = (path / name).read_bytes()
        assert entry["bytes"] == len(raw)
        assert entry["xxh3_128"] == xxhash.xxh3_128_hexdigest(raw), name


# -- crafted pickles -------------------------------------------------------------------------


class _RunsCode:
    """Unpickled, it makes a directory: the proof that unpickling ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.marker,))


def _crafted_metadata(path: Path, marker: Path) -> bytes:
    """A pickle that runs code, padded to the recorded size of ``.metadata``."""
    crafted = pickle.dumps(_RunsCode(marker))
    size = (path / ".metadata").stat().st_size
    assert len(crafted) < size
    return crafted + b"\0" * (size - len(crafted))  # pickle stops at its STOP opcode


def _reseal(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrites the manifest after ``edit``, with a matching checksum of its own:
    what a writer who can rewrite the manifest too can do."""
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["checksum"]
    edit(manifest)
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest["checksum"] = xxhash.xxh3_128_hexdigest(canonical)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _record_file(path: Path, name: str) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        raw = (path / name).read_bytes()
        manifest["files"][name].update(bytes=len(raw), xxh3_128=xxhash.xxh3_128_hexdigest(raw))

    return edit


def test_a_crafted_metadata_pickle_is_refused_by_its_checksum_and_never_unpickled(
    tmp_path: Path,
) -> None:
    path, _ = _saved(tmp_path)
    marker = tmp_path / "code-ran"
    (path / ".metadata").write_bytes(_crafted_metadata(path, marker))
    with pytest.raises(CheckpointError, match=r"\.metadata is damaged or was edited"):
        _fresh()[0].restore(path)
    assert not marker.exists()


def test_a_crafted_metadata_runs_no_code_even_with_the_manifest_rewritten_to_match(
    tmp_path: Path,
) -> None:
    """Checksums cannot stop a writer who rewrites the manifest too; what restore
    reads still cannot run code: the tensor index comes from the manifest's JSON."""
    path, saved = _saved(tmp_path)
    marker = tmp_path / "code-ran"
    (path / ".metadata").write_bytes(_crafted_metadata(path, marker))
    _reseal(path, _record_file(path, ".metadata"))
    ckpt, model = _fresh()
    ckpt.restore(path)
    assert not marker.exists()
    assert torch.equal(model.weight.detach(), saved["weight"]) and ckpt.step == 5


def test_a_crafted_tensor_record_runs_no_code_even_with_the_manifest_rewritten_to_match(
    tmp_path: Path,
) -> None:
    path, _ = _saved(tmp_path)
    marker = tmp_path / "code-ran"
    (data,) = path.glob("*.distcp")
    at = data.stat().st_size
    with open(data, "ab") as f:
        torch.save({"weight": _RunsCode(marker)}, f)
    length = data.stat().st_size - at
    record = xxhash.xxh3_128_hexdigest(data.read_bytes()[at:])

    def point_the_weight_at_the_crafted_record(manifest: dict[str, Any]) -> None:
        (chunk,) = manifest["tensors"]["model/weight"]["chunks"]
        chunk.update(at=at, length=length, xxh3_128=record)
        _record_file(path, data.name)(manifest)

    _reseal(path, point_the_weight_at_the_crafted_record)
    with pytest.raises(CheckpointError, match=rf"{data.name}.*'model/weight'.*cannot be read"):
        _fresh()[0].restore(path)  # torch.load(weights_only=True) refuses the object
    assert not marker.exists()


def test_a_checkpoint_of_format_version_1_is_refused_saying_why(tmp_path: Path) -> None:
    path, _ = _saved(tmp_path)
    _reseal(path, lambda manifest: manifest.update(version=1))
    with pytest.raises(CheckpointError, match=r"format version 1.*reads version 2.*pickle"):
        _fresh()[0].restore(path)


# -- how the checked bytes are loaded ---------------------------------------------------------


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    floats = torch.randn(3, 5, generator=generator)
    return {
        "float32": floats,
        "float64": floats.double(),
        "bfloat16": floats.bfloat16(),
        "float16": floats.half(),
        "complex64": torch.complex(floats, -floats),
        "int64": torch.arange(-7, 8).reshape(3, 5),
        "int8": torch.arange(-7, 8, dtype=torch.int8),
        "uint8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": floats > 0,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "transposed": floats.t(),  # saved contiguous
    }


def test_every_dtype_restores_bitwise_by_the_direct_copy_and_by_the_full_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records of this machine's byte order are copied straight from the mapped file
    into the tensors (one pass); others load through ``torch.load`` and a copy.
    Both give the saved bits."""
    from distribute.checkpoint import _storage

    saved = _tensors()
    path = Path(ds.Checkpoint(**saved).save(tmp_path / "ckpt"))

    def restored() -> dict[str, torch.Tensor]:
        targets = {k: torch.zeros_like(v) for k, v in saved.items()}
        ds.Checkpoint(**targets).restore(path)
        return targets

    full_loads: list[str] = []
    load_record = _storage._load_record
    monkeypatch.setattr(
        _storage,
        "_load_record",
        lambda path, record, data: full_loads.append(record.key) or load_record(path, record, data),
    )
    for key, value in restored().items():
        assert value.dtype == saved[key].dtype and torch.equal(value, saved[key]), key
    assert full_loads == []  # every record copied directly

    full_loads.clear()
    foreign = "big" if __import__("sys").byteorder == "little" else "little"
    _reseal(path, lambda manifest: manifest.update(byteorder=foreign))
    for key, value in restored().items():
        assert value.dtype == saved[key].dtype and torch.equal(value, saved[key]), key
    assert sorted(full_loads) == sorted(set(saved) - {"empty"}), (
        full_loads
    )  # DCP reads no bytes for it


def test_a_restore_into_synced_mirrored_variables_reaches_every_replicas_copy(
    tmp_path: Path,
) -> None:
    """The direct copy writes the primary copy outside torch: it must still count
    as a write, or the other replicas keep their old values."""
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    torch.manual_seed(0)
    with strategy.scope():
        saved = torch.nn.Linear(3, 2)
    path = ds.Checkpoint(model=saved).save(tmp_path / "ckpt")
    torch.manual_seed(1)
    with strategy.scope():
        model = torch.nn.Linear(3, 2)
    for variable in model.parameters():
        assert len(variable.values) == 2  # reading them syncs the copies: all in step now
    ds.Checkpoint(model=model).restore(path)
    expected = {k: v.detach().clone() for k, v in saved.state_dict().items()}
    for key, variable in model.state_dict(keep_vars=True).items():
        for replica, copy in enumerate(variable.values):
            assert torch.equal(copy, expected[key]), (key, replica)
