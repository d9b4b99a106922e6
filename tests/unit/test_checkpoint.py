"""ds.Checkpoint and ds.CheckpointManager in one process (issue #15).

Multi-worker saves, kills during a save and resumes across processes are in
tests/distributed/test_checkpoint_multi_worker.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import distribute as ds
from distribute.checkpoint import CheckpointError

STRATEGIES: dict[str, Callable[[], ds.Strategy]] = {
    "default": ds.get_strategy,
    "one_device": lambda: ds.OneDeviceStrategy("cpu"),
    "mirrored_2": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
    "mirrored_4": lambda: ds.MirroredStrategy([f"cpu:{i}" for i in range(4)]),
    "central_storage": lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}
GLOBAL_BATCH = 8


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )


def _build(strategy: ds.Strategy, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    return model, optimizer


def _data(seed: int = 0, loader: type = DataLoader) -> Any:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(96, 3, generator=generator)
    y = torch.randn(96, 2, generator=generator)
    return loader(
        list(zip(x, y)), batch_size=GLOBAL_BATCH, shuffle=True, generator=torch.Generator()
    )


def _step(strategy: ds.Strategy, model: torch.nn.Module, optimizer: Any) -> Callable[..., Any]:
    def step(batch: Any) -> torch.Tensor:
        x, y = batch
        per_example = (model(x) - y).square().mean(1)
        loss = ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return lambda batch: strategy.run(step, args=(batch,))


def _train(
    strategy: ds.Strategy, model: torch.nn.Module, optimizer: Any, iterator: Any, steps: int
) -> None:
    step = _step(strategy, model, optimizer)
    for _ in range(steps):
        step(next(iterator))


def _logical(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_state_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _optimizer_tensors(optimizer: Any) -> dict[str, torch.Tensor]:
    state = optimizer.state_dict()["state"]
    return {f"{i}/{k}": v for i, s in state.items() for k, v in s.items()}


@pytest.mark.parametrize("source", sorted(STRATEGIES))
@pytest.mark.parametrize("target", ["one_device", "mirrored_4", "central_storage"])
def test_a_checkpoint_restores_under_any_other_strategy(
    tmp_path: Path, source: str, target: str
) -> None:
    writer = STRATEGIES[source]()
    model, optimizer = _build(writer, seed=0)
    iterator = iter(writer.experimental_distribute_dataset(_data()))
    _train(writer, model, optimizer, iterator, steps=3)
    path = ds.Checkpoint(model=model, optimizer=optimizer).save(tmp_path / "ckpt")

    reader = STRATEGIES[target]()
    restored, restored_optimizer = _build(reader, seed=1)  # other initial values
    ds.Checkpoint(model=restored, optimizer=restored_optimizer).restore(path)

    _assert_state_equal(_logical(restored), _logical(model))
    for variable in restored.parameters():  # every replica's copy
        for component in variable.values if isinstance(variable, ds.DistributedVariable) else ():
            assert torch.equal(component, variable.values[0])
    _assert_state_equal(_optimizer_tensors(restored_optimizer), _optimizer_tensors(optimizer))


def test_per_replica_optimizer_state_is_one_logical_state_on_disk(tmp_path: Path) -> None:
    strategy = STRATEGIES["mirrored_4"]()
    model, optimizer = _build(strategy, seed=0)
    _train(strategy, model, optimizer, iter(strategy.experimental_distribute_dataset(_data())), 2)
    path = Path(ds.Checkpoint(optimizer=optimizer).save(tmp_path / "ckpt"))
    manifest = json.loads((path / "manifest.json").read_text())
    placeholders = json.dumps(manifest["objects"]).count("__tensor__")
    parameters = len(list(model.parameters()))
    assert placeholders == 3 * parameters  # step, exp_avg, exp_avg_sq per parameter, once


@pytest.mark.parametrize("name", ["mirrored_2", "one_device"])
@pytest.mark.parametrize("loader", [DataLoader, StatefulDataLoader])
def test_a_run_interrupted_and_resumed_ends_bitwise_equal_to_the_uninterrupted_run(
    tmp_path: Path, name: str, loader: type
) -> None:
    steps, interrupted_at = 10, 4

    def run(restore_from: str | None, stop_at: int | None) -> tuple[Any, str | None]:
        strategy = STRATEGIES[name]()
        model, optimizer = _build(strategy, seed=0 if restore_from is None else 99)
        torch.manual_seed(0 if restore_from is None else 99)
        iterator = iter(strategy.experimental_distribute_dataset(_data(loader=loader)))
        ckpt = ds.Checkpoint(
            model=model, optimizer=optimizer, data=iterator, rng=ds.RNGState(), step=0
        )
        if restore_from is not None:
            ckpt.restore(restore_from)
        step = _step(strategy, model, optimizer)
        while ckpt.step < steps:
            step(next(iterator))
            ckpt.step += 1
            if ckpt.step == stop_at:
                return None, ckpt.save(tmp_path / "ckpt")
        return _logical(model), None

    uninterrupted, _ = run(None, None)
    _, path = run(None, interrupted_at)
    resumed, _ = run(path, None)
    _assert_state_equal(resumed, uninterrupted)


def test_the_iterator_resumes_at_the_next_global_batch_with_the_same_shuffle(
    tmp_path: Path,
) -> None:
    strategy = STRATEGIES["mirrored_2"]()
    torch.manual_seed(3)
    everything = [
        [t.tolist() for t in strategy.experimental_local_results(x)]
        for x, _ in strategy.experimental_distribute_dataset(_data())
    ]
    torch.manual_seed(3)
    iterator = iter(strategy.experimental_distribute_dataset(_data()))
    for _ in range(2):
        next(iterator)
    path = ds.Checkpoint(data=iterator).save(tmp_path / "ckpt")
    torch.manual_seed(11)
    resumed = iter(strategy.experimental_distribute_dataset(_data()))
    ds.Checkpoint(data=resumed).restore(path)
    rest = [[t.tolist() for t in strategy.experimental_local_results(x)] for x, _ in resumed]
    assert rest == everything[2:]


def test_a_generator_iterators_position_cannot_be_saved_and_the_error_says_why(
    tmp_path: Path,
) -> None:
    strategy = STRATEGIES["mirrored_2"]()
    batches = (torch.ones(4, 2) * i for i in range(3))
    iterator = iter(strategy.experimental_distribute_dataset(batches))
    next(iterator)
    with pytest.raises(ds.errors.InvalidArgumentError, match=r"generator.*DataLoader"):
        ds.Checkpoint(data=iterator).save(tmp_path / "ckpt")


# -- numbering, the manager, deferred restores ----------------------------------------------


def test_save_numbers_checkpoints_and_restore_brings_back_the_counter_and_numbers(
    tmp_path: Path,
) -> None:
    weights = torch.zeros(3)
    ckpt = ds.Checkpoint(weights=weights, step=0, name="run")
    first = ckpt.save(tmp_path / "ckpt")
    weights += 1
    ckpt.step = 7
    second = ckpt.save(tmp_path / "ckpt")
    assert [Path(first).name, Path(second).name] == ["ckpt-1", "ckpt-2"]
    weights.zero_()
    ckpt.restore(first)
    assert ckpt.step == 0 and ckpt.save_counter == 1 and torch.equal(weights, torch.zeros(3))
    ckpt.restore(second)
    assert ckpt.step == 7 and ckpt.name == "run" and torch.equal(weights, torch.ones(3))
    assert Path(ckpt.write(tmp_path / "exact")).name == "exact"


def test_the_manager_keeps_the_newest_and_a_new_manager_finds_the_latest(
    tmp_path: Path,
) -> None:
    ckpt = ds.Checkpoint(step=0)
    manager = ds.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    assert manager.latest_checkpoint is None
    for step in range(4):
        ckpt.step = step
        manager.save()
    assert [Path(p).name for p in manager.checkpoints] == ["ckpt-3", "ckpt-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json", "ckpt-3", "ckpt-4"]
    again = ds.CheckpointManager(ds.Checkpoint(step=-1), tmp_path, max_to_keep=2)
    assert again.latest_checkpoint == str(tmp_path / "ckpt-4")
    restored = ds.Checkpoint(step=-1).restore(again.latest_checkpoint)
    assert restored.step == 3 and restored.save_counter == 4
    assert Path(manager.save(checkpoint_number=100)).name == "ckpt-100"


def test_the_manager_without_its_index_finds_complete_checkpoints_only(tmp_path: Path) -> None:
    manager = ds.CheckpointManager(ds.Checkpoint(step=1), tmp_path)
    manager.save()
    manager.save()
    (tmp_path / "checkpoint.json").unlink()  # a crash before the index was written
    (tmp_path / "ckpt-3.partial").mkdir()  # and a save killed half way
    assert ds.CheckpointManager(ds.Checkpoint(), tmp_path).latest_checkpoint == str(
        tmp_path / "ckpt-2"
    )


def _truncate_index(index: Path) -> None:
    index.write_bytes(index.read_bytes()[:-3])


def _garble_index(index: Path) -> None:
    index.write_bytes(b"\x00\x13 not an index")


def _delete_index(index: Path) -> None:
    index.unlink()


DAMAGED_INDEX = pytest.mark.parametrize(
    "damage",
    [_truncate_index, _garble_index, _delete_index],
    ids=["truncated", "garbage", "missing"],
)


@DAMAGED_INDEX
def test_a_damaged_index_still_finds_the_newest_complete_checkpoint(
    tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    manager = ds.CheckpointManager(ds.Checkpoint(step=1), tmp_path, max_to_keep=3)
    for _ in range(4):
        manager.save()
    damage(tmp_path / "checkpoint.json")
    again = ds.CheckpointManager(ds.Checkpoint(step=0), tmp_path, max_to_keep=3)
    assert again.latest_checkpoint == str(tmp_path / "ckpt-4")
    assert [Path(p).name for p in again.checkpoints] == ["ckpt-2", "ckpt-3", "ckpt-4"]
    again.save(checkpoint_number=5)  # and the index is whole again
    assert json.loads((tmp_path / "checkpoint.json").read_text()) == {
        "checkpoints": ["ckpt-3", "ckpt-4", "ckpt-5"]
    }


class _Killed(BaseException):
    """Stands for SIGKILL at one point of a save (nothing after it runs)."""


def test_checkpoints_left_by_a_save_killed_before_its_deletions_go_at_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distribute.checkpoint import _manager

    manager = ds.CheckpointManager(ds.Checkpoint(step=1), tmp_path, max_to_keep=2)
    manager.save()
    manager.save()

    def killed(path: Path) -> None:
        raise _Killed  # after the index was written, before anything was deleted

    with monkeypatch.context() as patch:
        patch.setattr(_manager, "_remove", killed)
        with pytest.raises(_Killed):
            manager.save()
    (tmp_path / "ckpt-9.partial").mkdir()  # a save of another number killed half way
    (tmp_path / "ckpt-9.partial" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("not the manager's")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint.json",
        "ckpt-1",
        "ckpt-2",
        "ckpt-3",
        "ckpt-9.partial",
        "notes.txt",
    ]
    restarted = ds.CheckpointManager(ds.Checkpoint(step=2), tmp_path, max_to_keep=2)
    assert restarted.latest_checkpoint == str(tmp_path / "ckpt-3")
    restarted.save(checkpoint_number=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint.json",
        "ckpt-3",
        "ckpt-4",
        "notes.txt",
    ]


def test_objects_attached_after_restore_get_their_values(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    path = ds.Checkpoint(model=model, step=4).save(tmp_path / "ckpt")
    ckpt = ds.Checkpoint().restore(path)  # nothing attached yet: deferred
    fresh = torch.nn.Linear(2, 2)
    ckpt.model = fresh
    assert torch.equal(fresh.weight, model.weight) and ckpt.step == 4


# -- errors ---------------------------------------------------------------------------------


def _saved(tmp_path: Path) -> Path:
    model = torch.nn.Linear(64, 64)
    return Path(ds.Checkpoint(model=model).save(tmp_path / "ckpt"))


def test_a_truncated_tensor_file_is_named_instead_of_loading_part(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    data = next(p for p in path.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{data.name}.*truncated"):
        ds.Checkpoint(model=torch.nn.Linear(64, 64)).restore(path)


def test_a_missing_manifest_a_foreign_directory_and_a_torch_save_file_are_named(
    tmp_path: Path,
) -> None:
    path = _saved(tmp_path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing"):
        ds.Checkpoint(model=torch.nn.Linear(64, 64)).restore(path)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "manifest.json").write_text('{"something": "else"}')
    with pytest.raises(CheckpointError, match="not a distribute checkpoint"):
        ds.Checkpoint().restore(foreign)
    torch.save({"w": torch.ones(1)}, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=r"is a file.*torch\.load"):
        ds.Checkpoint().restore(tmp_path / "model.pt")
    (foreign / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        ds.Checkpoint().restore(foreign)


def test_restoring_into_a_different_model_names_the_mismatch(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with pytest.raises(
        ds.errors.InvalidArgumentError, match=r"model/weight.*\(64, 64\).*\(8, 64\)"
    ):
        ds.Checkpoint(model=torch.nn.Linear(64, 8)).restore(path)
    with pytest.raises(ds.errors.InvalidArgumentError, match="missing from the checkpoint"):
        ds.Checkpoint(model=torch.nn.Sequential(torch.nn.Linear(64, 64))).restore(path)


def test_objects_without_state_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ds.errors.InvalidArgumentError, match=r"'thing'.*object"):
        ds.Checkpoint(thing=object()).save(tmp_path / "ckpt")


@pytest.mark.parametrize("explicit_generator", [True, False])
def test_a_save_between_epochs_resumes_with_the_next_epochs_shuffle(
    tmp_path: Path, explicit_generator: bool
) -> None:
    """The iterator of the next epoch, made but not drawn from when saved: its
    sampler draws its permutation lazily, at the first batch, so the resumed run
    must draw it from the generators as they were at the save."""
    strategy = STRATEGIES["mirrored_2"]()

    def loader() -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(4) if explicit_generator else None
        return DataLoader(torch.arange(24), batch_size=4, shuffle=True, generator=generator)

    def epochs(dist: Any, iterator: Any, count: int) -> tuple[list[list[int]], Any]:
        out = []
        for _ in range(count):
            out += [torch.cat(strategy.experimental_local_results(b)).tolist() for b in iterator]
            iterator = iter(dist)  # the next epoch's, made at the end of this one
            torch.randn(5)  # the training draws from torch's generator before using it
        return out, iterator

    torch.manual_seed(0)
    dist = strategy.experimental_distribute_dataset(loader())
    uninterrupted, _ = epochs(dist, iter(dist), 3)

    torch.manual_seed(0)
    dist = strategy.experimental_distribute_dataset(loader())
    first, following = epochs(dist, iter(dist), 1)
    path = ds.Checkpoint(data=following, rng=ds.RNGState()).save(tmp_path / "ckpt")

    torch.manual_seed(9)
    dist = strategy.experimental_distribute_dataset(loader())
    resumed = ds.Checkpoint(rng=ds.RNGState())
    resumed.restore(path)
    resumed.data = iter(dist)  # placed at the saved epoch's start when attached
    rest, _ = epochs(dist, resumed.data, 2)
    assert first + rest == uninterrupted


# -- fixes from the review ------------------------------------------------------------------


def test_an_integer_sync_on_read_sum_keeps_its_remainder_under_more_replicas(
    tmp_path: Path,
) -> None:
    def counter(strategy: ds.Strategy) -> Any:
        with strategy.scope():
            return ds.Variable(
                0,
                synchronization=ds.VariableSynchronization.ON_READ,
                aggregation=ds.VariableAggregation.SUM,
            )

    seen = counter(STRATEGIES["default"]())
    seen.assign(7)
    path = ds.Checkpoint(seen=seen).save(tmp_path / "ckpt")
    for name in ("mirrored_2", "mirrored_4"):
        restored = counter(STRATEGIES[name]())
        ds.Checkpoint(seen=restored).restore(path)
        assert int(restored.read_value()) == 7  # assign would give 6 and 4


def test_a_write_killed_between_its_two_renames_leaves_the_old_checkpoint_loadable(
    tmp_path: Path,
) -> None:
    weights = torch.ones(3)
    ckpt = ds.Checkpoint(weights=weights)
    path = Path(ckpt.write(tmp_path / "model"))
    path.rename(tmp_path / "model.old")  # what commit() does first, then the kill
    weights.zero_()
    ds.Checkpoint(weights=weights).restore(path)
    assert torch.equal(weights, torch.ones(3))


def test_assert_consumed_names_what_the_restore_did_not_match(tmp_path: Path) -> None:
    path = ds.Checkpoint(model=torch.nn.Linear(2, 2)).save(tmp_path / "ckpt")
    ds.Checkpoint(model=torch.nn.Linear(2, 2)).restore(path).assert_consumed()
    partial = ds.Checkpoint(net=torch.nn.Linear(2, 2)).restore(path)
    with pytest.raises(CheckpointError, match=r"\['net'\].*\['model'\]"):
        partial.assert_consumed()
    partial.expect_partial().assert_consumed()


def test_restoring_mid_epoch_skips_the_taken_batches_without_loading_them(
    tmp_path: Path,
) -> None:
    class Counted(torch.utils.data.Dataset[torch.Tensor]):
        loads = 0

        def __len__(self) -> int:
            return 400

        def __getitem__(self, i: int) -> torch.Tensor:
            Counted.loads += 1
            return torch.tensor([float(i)])

    strategy = STRATEGIES["mirrored_2"]()

    def iterator(seed: int) -> Any:
        torch.manual_seed(seed)
        loader = DataLoader(Counted(), batch_size=8, shuffle=True)
        return iter(strategy.experimental_distribute_dataset(loader))

    def values(batch: Any) -> list[float]:
        return torch.cat(strategy.experimental_local_results(batch)).tolist()

    taken = iterator(0)
    for _ in range(40):
        next(taken)
    path = ds.Checkpoint(data=taken).save(tmp_path / "ckpt")
    expected = values(next(taken))
    resumed = iterator(9)
    Counted.loads = 0
    ds.Checkpoint(data=resumed).restore(path)
    assert Counted.loads == 0  # 40 batches skipped by their indices alone
    assert values(next(resumed)) == expected
