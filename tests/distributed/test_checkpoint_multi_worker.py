"""`ds.Checkpoint` and `ds.CheckpointManager` in real worker processes (gloo).

What these pin: a checkpoint written by one world size restores exactly under
another (and in one process); mirrored values are on disk once, not once per
worker; a save called by one worker alone raises on it instead of hanging; a
worker killed at any point of a save leaves the previous checkpoint the latest
and loadable; and training interrupted, saved and resumed in fresh processes
ends bitwise equal to training straight through.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from shared_checks import assert_identical
from torch.distributed.checkpoint import CheckpointException

import distribute as ds
from distribute import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


# -- helpers (used in the workers and in this process) ----------------------------------


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _strategy(**options: Any) -> ds.MultiWorkerMirroredStrategy:
    comm = ds.experimental.CommunicationOptions(**options) if options else None
    return ds.MultiWorkerMirroredStrategy(communication_options=comm)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the model's parameters and buffers."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _clone(value: Any) -> Any:
    """A deep copy of a state dict's nest (tensors cloned), safe to return from a worker."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _disk_bytes(directory: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


# -- 1. restoring under another world size ----------------------------------------------


def _wide_mlp() -> torch.nn.Module:
    """About 300 KB of parameters (900 KB with Adam's state): far above the slack
    the size check allows, so a copy per worker could not pass it."""
    return torch.nn.Sequential(
        torch.nn.Linear(32, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 4),
    )


def _adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _train_and_save(path: str, steps: int) -> dict[str, Any]:
    """Trains on this rank's own data (so Adam's moments are not trivial); saves."""
    rank = _rank()
    torch.manual_seed(0)
    strategy = _strategy()
    with strategy.scope():
        model = _wide_mlp()
        optimizer = _adam(model)
    g = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(steps):
        strategy.run(step)
    written = ds.Checkpoint(model=model, optimizer=optimizer).write(path)
    out = {"path": written, "params": _state(model), "optimizer": _clone(optimizer.state_dict())}
    strategy.shutdown()
    return out


def _restore_and_maybe_save(path: str, save_to: str | None) -> dict[str, Any]:
    """Builds the model from another seed, restores ``path``; then writes ``save_to``."""
    torch.manual_seed(1234 + _rank())  # what restore must override
    strategy = _strategy()
    with strategy.scope():
        model = _wide_mlp()
        optimizer = _adam(model)
    ckpt = ds.Checkpoint(model=model, optimizer=optimizer)
    ckpt.restore(path)
    out = {"params": _state(model), "optimizer": _clone(optimizer.state_dict())}
    out["copies_equal"] = all(
        all(torch.equal(c, p.values[0]) for c in p.values) for p in model.parameters()
    )
    if save_to is not None:
        out["path"] = ckpt.write(save_to)
    strategy.shutdown()
    return out


def _restore_here(path: str, strategy: ds.Strategy | None) -> dict[str, Any]:
    torch.manual_seed(99)
    if strategy is None:
        model = _wide_mlp()
        optimizer = _adam(model)
    else:
        with strategy.scope():
            model = _wide_mlp()
            optimizer = _adam(model)
    ds.Checkpoint(model=model, optimizer=optimizer).restore(path)
    return {"params": _state(model), "optimizer": _clone(optimizer.state_dict())}


def _assert_size_is_one_copy(directory: str, saved: dict[str, Any]) -> None:
    logical = _tensor_bytes(saved["params"]) + _tensor_bytes(saved["optimizer"]["state"])
    on_disk = _disk_bytes(directory)
    assert on_disk <= 1.05 * logical + 64 * 1024, (
        f"{directory} holds {on_disk} bytes for {logical} bytes of state: mirrored values "
        "written more than once?"
    )
    assert on_disk >= logical  # and everything is there


def test_save_under_2_workers_restores_exactly_under_4_then_under_2_and_one_process(
    tmp_path: Path,
) -> None:
    first, second = str(tmp_path / "by-2"), str(tmp_path / "by-4")
    saved = launch.run(_train_and_save, 2, args=(first, 3), timeout=120)
    assert [out["path"] for out in saved] == [first, first]
    assert_identical(saved[1]["params"], saved[0]["params"], "rank 1 vs rank 0 (saved)")
    assert_identical(saved[1]["optimizer"], saved[0]["optimizer"], "rank 1 vs rank 0 (saved)")
    expected = saved[0]
    assert len(expected["optimizer"]["state"]) == 6  # every parameter has Adam moments
    assert float(expected["optimizer"]["state"][0]["step"]) == 3.0
    _assert_size_is_one_copy(first, expected)

    # 2 -> 4 workers: every rank, every parameter and optimizer tensor, bitwise.
    restored = launch.run(_restore_and_maybe_save, 4, args=(first, second), timeout=120)
    for rank, out in enumerate(restored):
        assert out["copies_equal"]
        assert_identical(out["params"], expected["params"], f"4 workers, rank {rank}, params")
        assert_identical(out["optimizer"], expected["optimizer"], f"4 workers, rank {rank}")
        assert out["path"] == second
    _assert_size_is_one_copy(second, expected)

    # 4 -> 2 workers, and 4 -> this process (no strategy, and OneDeviceStrategy).
    again = launch.run(_restore_and_maybe_save, 2, args=(second, None), timeout=120)
    here = [_restore_here(second, None), _restore_here(second, ds.OneDeviceStrategy("cpu"))]
    places = ["2 workers, rank 0", "2 workers, rank 1", "no strategy", "OneDeviceStrategy"]
    for where, out in zip(places, [*again, *here]):
        assert_identical(out["params"], expected["params"], f"{where}, params")
        assert_identical(out["optimizer"], expected["optimizer"], f"{where}, optimizer")


def _restore_failure(path: str) -> dict[str, Any]:
    """Restores ``path`` into a model built from another seed; the error, and
    whether the model kept its values."""
    torch.manual_seed(1234 + _rank())
    strategy = _strategy()
    with strategy.scope():
        model = _wide_mlp()
        optimizer = _adam(model)
    before = _state(model)
    out: dict[str, Any] = {"error": None, "message": ""}
    try:
        ds.Checkpoint(model=model, optimizer=optimizer).restore(path)
    except Exception as e:  # the parent asserts on the type
        out.update(error=type(e).__name__, message=str(e))
    out["untouched"] = all(torch.equal(v, before[k]) for k, v in _state(model).items())
    strategy.shutdown()
    return out


def test_a_flipped_byte_in_a_file_another_worker_wrote_is_named_on_every_worker(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "by-2")
    launch.run(_train_and_save, 2, args=(path, 1), timeout=120)
    damaged = Path(path) / "__1_0.distcp"  # written by rank 1; both ranks read it
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # the size is unchanged
    damaged.write_bytes(bytes(raw))
    outs = launch.run(_restore_failure, 2, args=(path,), timeout=120)
    for rank, out in enumerate(outs):
        assert out["error"] == "CheckpointError", (rank, out)
        assert str(damaged) in out["message"] and "stored tensor" in out["message"], out
        assert out["untouched"], f"rank {rank} restored part of a damaged checkpoint"


# -- 2. a save called on one worker only ------------------------------------------------

_SAVE_TIMEOUT = 10.0


def _save_on_rank_0_only(prefix: str, rank_1_does: str, done: str) -> dict[str, Any]:
    """Rank 0 saves; rank 1 reduces something of its own, or idles until rank 0 is done."""
    rank = _rank()
    strategy = _strategy(timeout_seconds=_SAVE_TIMEOUT)
    with strategy.scope():
        model = torch.nn.Linear(3, 2)
    ckpt = ds.Checkpoint(model=model, step=1)
    start = time.monotonic()
    out: dict[str, Any] = {"error": None, "message": "", "returned": None}
    try:
        if rank == 0:
            out["returned"] = ckpt.save(prefix)
        elif rank_1_does == "reduce":
            strategy.reduce("sum", torch.ones(2), axis=None)
        else:  # alive, not in any collective, until rank 0 has given up
            deadline = time.monotonic() + 3 * _SAVE_TIMEOUT
            while not Path(done).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
    except Exception as e:  # the parent asserts on the type
        out.update(error=type(e).__name__, message=str(e))
    out["seconds"] = time.monotonic() - start
    if rank == 0:
        Path(done).touch()
    return out


@pytest.mark.parametrize("rank_1_does", ["reduce", "idle"])
def test_save_called_on_one_worker_only_raises_naming_the_save_instead_of_hanging(
    tmp_path: Path, rank_1_does: str
) -> None:
    prefix = tmp_path / "ckpts" / "ckpt"
    prefix.parent.mkdir()
    done = str(tmp_path / "rank-0-done")
    started = time.monotonic()
    rank0, rank1 = launch.run(
        _save_on_rank_0_only, 2, args=(str(prefix), rank_1_does, done), timeout=90
    )
    assert time.monotonic() - started < _SAVE_TIMEOUT + 20  # start-up included; no hang
    assert rank0["returned"] is None
    assert rank0["error"] in {"CollectiveMismatchError", "CollectiveTimeoutError"}, rank0
    assert "checkpoint save" in rank0["message"], rank0["message"]
    assert rank0["seconds"] < _SAVE_TIMEOUT + 3, rank0
    if rank_1_does == "reduce":  # the mismatch is seen at once, on both ranks
        assert rank0["error"] == "CollectiveMismatchError"
        assert rank0["seconds"] < 5
        assert rank1["error"] == "CollectiveMismatchError", rank1
        assert "checkpoint save" in rank1["message"] and "reduce" in rank1["message"]
    else:  # rank 1 is named, as alive but elsewhere
        assert rank0["error"] == "CollectiveTimeoutError"
        assert "rank 1" in rank0["message"] and "alive" in rank0["message"], rank0["message"]
        assert rank1["error"] is None
    # Nothing was written: the check comes before any file.
    assert list(prefix.parent.iterdir()) == []


# -- 3. a worker killed during a save ------------------------------------------------------

# (module.function to wrap, kill before/after the real call, only when its first
# argument's name is this (None: always), rank killed):
# before any tensor is written; after this rank's tensors (the other's may be done);
# with the tensors, the per-rank files and the manifest in `<path>.partial` but not
# renamed; renamed to `ckpt-2` but the manager's index not yet updated.
_DCP_SAVE = "torch.distributed.checkpoint.state_dict_saver.save"  # `write` imports it
_COMMIT = "distribute.checkpoint._checkpoint.commit"
_CRASH_POINTS = {
    "before-tensors": (_DCP_SAVE, "before", None, 0),
    "after-tensors": (_DCP_SAVE, "after", None, 1),
    "before-commit": (_COMMIT, "before", None, 0),
    "after-commit-before-index": (_COMMIT, "after", None, 0),
}


def _kill_at(function: str, when: str, only: str | None) -> None:
    """Wraps ``function`` (``module.name``) of the save so that this process is
    SIGKILLed there."""
    module_name, _, name = function.rpartition(".")
    module = importlib.import_module(module_name)
    real: Callable[..., Any] = getattr(module, name)

    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        hit = only is None or (args and Path(args[0]).name == only)
        if hit and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = real(*args, **kwargs)
        if hit and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(module, name, wrapper)


def _save_twice_killed_in_the_second(
    directory: str, function: str, when: str, only: str | None, killed_rank: int
) -> dict[str, Any]:
    rank = _rank()
    torch.manual_seed(0)
    strategy = _strategy(timeout_seconds=30)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        model(torch.ones(2, 3) * (rank + 1)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    strategy.run(step)
    ckpt = ds.Checkpoint(model=model, optimizer=optimizer, step=1)
    manager = ds.CheckpointManager(ckpt, directory, max_to_keep=3)
    first = manager.save()
    values = [{"params": _state(model), "optimizer": _clone(optimizer.state_dict())}]
    strategy.run(step)
    ckpt.step = 2
    values.append({"params": _state(model), "optimizer": _clone(optimizer.state_dict())})
    out: dict[str, Any] = {"first": first, "values": values, "error": None, "message": ""}
    if rank == killed_rank:
        _kill_at(function, when, only)
    try:
        out["second"] = manager.save()
    # The survivor sees its peer die. Inside DCP's own collectives that may be torch's
    # CheckpointException, a BaseException.
    except (Exception, CheckpointException) as e:
        out.update(error=type(e).__name__, message=str(e))
    return out


def _fresh_model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(77)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("point", sorted(_CRASH_POINTS))
def test_worker_killed_during_a_save_leaves_the_previous_checkpoint_latest_and_loadable(
    tmp_path: Path, point: str
) -> None:
    function, when, only, killed = _CRASH_POINTS[point]
    directory = tmp_path / "ckpts"
    results = launch.run(
        _save_twice_killed_in_the_second,
        2,
        args=(str(directory), function, when, only, killed),
        timeout=90,
        allow_missing=True,
    )
    assert results[killed] is None  # it was killed, as armed
    survivor = results[1 - killed]
    assert survivor["first"] == str(directory / "ckpt-1")
    assert survivor["error"] is not None, "the survivor's save reported success"
    by_name = {"ckpt-1": survivor["values"][0], "ckpt-2": survivor["values"][1]}

    # A process started again: a fresh manager on the directory, a fresh model.
    manager = ds.CheckpointManager(ds.Checkpoint(), directory, max_to_keep=3)
    latest = manager.latest_checkpoint
    assert latest is not None
    complete = ["ckpt-1", "ckpt-2"] if point == "after-commit-before-index" else ["ckpt-1"]
    assert Path(latest).name in complete, (latest, sorted(os.listdir(directory)))
    assert latest == manager.checkpoints[-1]
    for path in manager.checkpoints:  # never a half-written directory
        assert re.fullmatch(r"ckpt-\d+", Path(path).name), path
        assert (Path(path) / "manifest.json").is_file(), path
    model, optimizer = _fresh_model_and_optimizer()
    ckpt = ds.Checkpoint(model=model, optimizer=optimizer, step=0)
    ckpt.restore(latest)
    expected = by_name[Path(latest).name]
    assert ckpt.step == int(Path(latest).name.split("-")[1])
    assert_identical(_state(model), expected["params"], f"{latest}, params")
    assert_identical(_clone(optimizer.state_dict()), expected["optimizer"], f"{latest}, opt")

    # Saving again over what the killed save left behind works and becomes latest.
    resumed = ds.CheckpointManager(ckpt, directory, max_to_keep=3)
    path = resumed.save()
    assert resumed.latest_checkpoint == path
    assert not list(directory.glob("*.partial")), sorted(os.listdir(directory))
    model2, optimizer2 = _fresh_model_and_optimizer()
    ds.Checkpoint(model=model2, optimizer=optimizer2).restore(path)
    assert_identical(_state(model2), expected["params"], f"{path}, params")


_KILLED_IN_WRITE, _STAY_ALIVE = 3, 20.0


def _killed_inside_the_tensor_write(directory: str) -> dict[str, Any]:
    """Rank 3 is SIGKILLed inside DCP's tensor write of the second save; the survivors
    time their error, then stay alive (as a script handling the error would) so that
    no survivor is released by another's exit."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    strategy = _strategy(timeout_seconds=60)
    with strategy.scope():
        model = torch.nn.Linear(3, 2)
    ckpt = ds.Checkpoint(model=model)
    ckpt.write(os.path.join(directory, "warm"))  # DCP's imports and first plans
    if strategy.worker_index == _KILLED_IN_WRITE:

        def write_data(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    start = time.monotonic()
    out: dict[str, Any] = {"error": None}
    try:
        ckpt.write(os.path.join(directory, "killed"))
    except (Exception, CheckpointException) as e:
        out = {"error": type(e).__name__, "message": str(e)}
    out["seconds"] = time.monotonic() - start
    time.sleep(_STAY_ALIVE)  # not a wait for a peer: this survivor's process lives on
    return out


@pytest.mark.slow  # run by CI (.ci/run: -m slow), not by the README's command
def test_a_worker_killed_inside_the_tensor_write_is_named_by_every_survivor_within_seconds(
    tmp_path: Path,
) -> None:
    """Before: a survivor that DCP's raw collectives did not connect to the dead worker
    (rank 1 here) waited in them until another survivor's process exited, or for the
    whole timeout (60 s)."""
    results = launch.run(
        _killed_inside_the_tensor_write, 4, args=(str(tmp_path),), timeout=150, allow_missing=True
    )
    assert results[_KILLED_IN_WRITE] is None  # killed, as armed
    for rank, out in enumerate(results):
        if rank == _KILLED_IN_WRITE:
            continue
        assert out["error"] == "CollectiveTimeoutError", (rank, out)
        assert f"rank {_KILLED_IN_WRITE} is dead" in out["message"], (rank, out["message"])
        assert out["seconds"] < 10.0, (rank, out)  # well before the survivors' exits


# -- 4. interrupted and resumed training is bitwise the uninterrupted one ----------------

_EXAMPLES, _GLOBAL_BATCH = 40, 8  # 5 steps an epoch
_TOTAL_STEPS, _INTERRUPT_AT = 12, 7  # stopped mid epoch 2; resumed across epoch 3's start


def _loader(kind: str) -> Any:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(_EXAMPLES, 6, generator=g), torch.randint(0, 3, (_EXAMPLES,), generator=g)
    dataset = torch.utils.data.TensorDataset(x, y)
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(dataset, batch_size=_GLOBAL_BATCH, shuffle=True)
    return torch.utils.data.DataLoader(dataset, batch_size=_GLOBAL_BATCH, shuffle=True)


def _train_resumably(
    kind: str, seed: int, stop_at: int, save_to: str | None, restore_from: str | None
) -> dict[str, Any]:
    """Trains (dropout, Adam, shuffled data) up to step ``stop_at``; saves or restores."""
    rank = _rank()
    torch.manual_seed(seed + rank)  # every worker its own dropout masks
    strategy = _strategy()
    with strategy.scope():
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3)
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    dataset = strategy.experimental_distribute_dataset(_loader(kind))
    iterator = iter(dataset)
    ckpt = ds.Checkpoint(model=model, optimizer=optimizer, data=iterator, rng=ds.RNGState(), step=0)
    initial = _state(model)
    if restore_from is not None:
        ckpt.restore(restore_from)

    def train_step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        ds.compute_average_loss(per_example, global_batch_size=_GLOBAL_BATCH).backward()
        optimizer.step()
        optimizer.zero_grad()

    step: int = ckpt.step
    start = step
    seen: list[list[float]] = []
    while step < stop_at:
        try:
            xb, yb = next(iterator)
        except StopIteration:
            iterator = iter(dataset)
            ckpt.data = iterator
            continue
        seen.append(xb[:, 0].tolist())
        strategy.run(train_step, args=(xb, yb))
        step += 1
    out = {
        "start": start,
        "initial": initial,
        "params": _state(model),
        "optimizer": _clone(optimizer.state_dict()),
        "rng": torch.get_rng_state(),
        "seen": seen,
    }
    if save_to is not None:
        ckpt.step = step
        ckpt.write(save_to)
    strategy.shutdown()
    return out


@pytest.mark.parametrize("kind", ["dataloader", "stateful"])
def test_training_interrupted_and_resumed_ends_bitwise_equal_to_uninterrupted(
    tmp_path: Path, kind: str
) -> None:
    path = str(tmp_path / "interrupted")
    straight = launch.run(
        _train_resumably, 2, args=(kind, 5, _TOTAL_STEPS, None, None), timeout=120
    )
    first = launch.run(_train_resumably, 2, args=(kind, 5, _INTERRUPT_AT, path, None), timeout=120)
    resumed = launch.run(
        _train_resumably, 2, args=(kind, 500, _TOTAL_STEPS, None, path), timeout=120
    )
    for rank in range(2):
        assert resumed[rank]["start"] == _INTERRUPT_AT
        # The resumed run read exactly the batches the straight run read from there
        # (each batch named by its first feature column).
        assert first[rank]["seen"] == straight[rank]["seen"][:_INTERRUPT_AT], rank
        assert resumed[rank]["seen"] == straight[rank]["seen"][_INTERRUPT_AT:], (
            f"rank {rank}: the resumed run read other batches than the uninterrupted one"
        )
        assert_identical(resumed[rank]["params"], straight[rank]["params"], f"rank {rank}")
        assert_identical(resumed[rank]["optimizer"], straight[rank]["optimizer"], f"rank {rank}")
        assert torch.equal(resumed[rank]["rng"], straight[rank]["rng"]), rank  # dropout's too
    # The resumed workers started from other values (their seed): restore replaced them.
    assert not torch.equal(resumed[0]["initial"]["0.weight"], straight[0]["initial"]["0.weight"])


# -- the input position under a larger world ------------------------------------------------


def _read_then_save(path: str, steps: int) -> list[int]:
    strategy = _strategy(timeout_seconds=20)
    loader = torch.utils.data.DataLoader(torch.arange(48), batch_size=8)  # no shuffle
    iterator = iter(strategy.experimental_distribute_dataset(loader))
    seen = [int(v) for _ in range(steps) for v in next(iterator)]
    ds.Checkpoint(data=iterator).write(path)
    strategy.shutdown()
    return seen


def _restore_and_read(path: str) -> list[int]:
    strategy = _strategy(timeout_seconds=20)
    loader = torch.utils.data.DataLoader(torch.arange(48), batch_size=8)
    iterator = iter(strategy.experimental_distribute_dataset(loader))
    ds.Checkpoint(data=iterator).restore(path)
    seen = [int(v) for batch in iterator for v in batch]
    strategy.shutdown()
    return seen


def test_an_input_position_saved_by_2_workers_resumes_under_4_without_repeating(
    tmp_path: Path,
) -> None:
    """Ranks 2 and 3 have no position of their own: they take rank 0's global step
    (the review found they started the epoch again, re-reading trained examples, and
    then hung at the end-of-data agreement)."""
    path = str(tmp_path / "position")
    before = launch.run(_read_then_save, 2, args=(path, 2), timeout=120)
    after = launch.run(_restore_and_read, 4, args=(path,), timeout=120)
    read_before = sorted(v for seen in before for v in seen)
    read_after = sorted(v for seen in after for v in seen)
    assert read_before == list(range(16))  # 2 global batches of 8
    assert read_after == list(range(16, 48))  # the rest, each once, over 4 workers
