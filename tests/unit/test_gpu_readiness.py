"""GPU paths checked on the CPU (issue #17): device binding, no stray `.cuda()`,
per-replica optimizer tensors, thread state. What needs a real GPU is in tests/gpu/."""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import distribute as ds
from distribute.collectives._deadlines import StreamWatch, nccl_group_timeout
from distribute.collectives._group_setup import check_distinct_devices
from distribute.errors import InvalidArgumentError
from distribute.strategies._devices import local_gpu

PACKAGE = Path(__file__).resolve().parents[2] / "distribute"


# -- which GPU a worker process binds to ----------------------------------------------


@pytest.mark.parametrize("local_rank", range(8))
def test_each_local_rank_of_a_full_node_gets_its_own_gpu(local_rank: int) -> None:
    assert local_gpu(local_rank, 8, 8, None) == local_rank


def test_more_processes_than_gpus_is_refused_instead_of_wrapping_onto_gpu_0() -> None:
    with pytest.raises(InvalidArgumentError, match=r"8 worker processes .* only 4 GPU"):
        local_gpu(5, 8, 4, None)


def test_a_process_given_one_gpu_of_its_own_by_the_launcher_uses_it() -> None:
    assert local_gpu(3, 8, 1, "3") == 0


def test_one_visible_gpu_shared_by_several_processes_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="share a GPU"):
        local_gpu(1, 2, 1, None)
    with pytest.raises(InvalidArgumentError, match="share a GPU"):
        local_gpu(1, 2, 1, "0,1")  # two ids visible, yet only one GPU counted


def test_slurm_gpu_ids_win_over_the_local_rank_and_out_of_range_ids_are_ignored() -> None:
    assert local_gpu(1, 2, 8, None, assigned=[4, 5, 6, 7]) == 4
    assert local_gpu(1, 2, 2, None, assigned=[4]) == 1  # ids of another view: local rank


# -- no CUDA call without a device ------------------------------------------------------


def _cuda_calls_without_device(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "cuda"
            and not node.args
            and not node.keywords
        ):
            lines.append(node.lineno)
    return lines


def test_the_library_never_calls_cuda_without_a_device() -> None:
    # `.cuda()` means the *current* device: GPU 0 in every process and replica thread
    # that did not set one, so every rank's tensors would land on one GPU.
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := _cuda_calls_without_device(path.read_text()))
    }
    assert found == {}, f"`.cuda()` without a device at {found}; use .to(device)"


def test_the_static_check_finds_a_bare_cuda_call() -> None:
    assert _cuda_calls_without_device("x = t.cuda()\ny = t.cuda(1)\n") == [1]


# -- optimizers get each replica's plain tensors ------------------------------------------


def _adam_run(
    strategy: ds.Strategy | None, steps: int = 3, **adam: Any
) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[Any]]:
    """Adam on a Linear(3, 2) for a few steps of a fixed global batch of 4."""
    torch.manual_seed(0)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1, **adam)
    seen: list[Any] = []
    x = torch.arange(12.0).reshape(4, 3) / 10

    def step(xs: torch.Tensor) -> None:
        loss = ds.compute_average_loss(model(xs).square().sum(1), global_batch_size=4)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(steps):
        if strategy is None:
            step(x)
        else:
            n = strategy.num_replicas_in_sync
            strategy.run(step, args=(ds.PerReplica(list(x.chunk(n))) if n > 1 else x,))
    return model, optimizer, seen


@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_foreach_and_fused_optimizers_train_replicas_like_one_device(flag: str) -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    model, optimizer, _ = _adam_run(strategy, **{flag: True})
    reference, ref_optimizer, _ = _adam_run(None, **{flag: True})
    for p, r in zip(model.parameters(), reference.parameters()):
        for component in p.values:
            torch.testing.assert_close(component, r.detach(), rtol=1e-6, atol=1e-6)
    # The state is still keyed by the variables: state_dict matches one device's.
    mine, theirs = optimizer.state_dict(), ref_optimizer.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    for index, state in theirs["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(mine["state"][index][key], value, rtol=1e-6, atol=1e-6)


def test_foreach_optimizer_steps_on_plain_tensors_of_each_replicas_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replicas on two really different devices: before, torch grouped the variables
    by replica 0's device and raised "Tensors of the same index must be on the same
    device"; the foreach kernel must get plain tensors of one device per replica."""
    seen: list[tuple[set[type], set[str]]] = []
    adam_module = importlib.import_module("torch.optim.adam")  # the name is shadowed
    original = adam_module._multi_tensor_adam

    def spy(params: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        seen.append(({type(p) for p in params}, {p.device.type for p in params}))
        return original(params, *args, **kwargs)

    monkeypatch.setattr(adam_module, "_multi_tensor_adam", spy)
    strategy = ds.MirroredStrategy(["cpu", "meta"])
    strategy.extended.experimental_aggregate_gradients = False  # meta has no data to sum
    with strategy.scope():
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1, foreach=True)
    before = model.weight.values[0].clone()

    def step(x: torch.Tensor) -> None:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    x = ds.PerReplica([torch.ones(2, 3), torch.ones(2, 3, device="meta")])
    for _ in range(2):
        strategy.run(step, args=(x,))
    assert sorted(seen, key=str) == sorted(
        [({torch.Tensor}, {"cpu"}), ({torch.Tensor}, {"meta"})] * 2, key=str
    )
    assert not torch.equal(model.weight.values[0], before)
    assert model.weight.values[1].device.type == "meta"
    assert isinstance(optimizer.param_groups[0]["params"][0], ds.MirroredVariable)  # outside


def test_optimizers_on_cpu_replicas_keep_their_own_param_group_dicts() -> None:
    # Replicas step on their own copies of the groups (NOTE [group state per replica]),
    # replica 0 on the optimizer's own dicts, which outside the step are what it sees.
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    _, optimizer, _ = _adam_run(strategy)
    groups = optimizer.param_groups
    assert isinstance(groups, list) and len(groups) == 1
    assert all(isinstance(p, ds.MirroredVariable) for p in groups[0]["params"])
    assert optimizer.state_dict()["param_groups"][0]["lr"] == groups[0]["lr"]


def test_an_optimizer_with_per_replica_groups_can_be_copied_and_reloaded() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    model, optimizer, _ = _adam_run(strategy, foreach=True)
    state = optimizer.state_dict()
    optimizer.load_state_dict(state)  # replaces param_groups and state with plain ones
    copied = copy.deepcopy(optimizer.state_dict())
    assert copied["param_groups"] == state["param_groups"]
    x = torch.ones(2, 3)

    def step(xs: torch.Tensor) -> None:
        model(xs).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    strategy.run(step, args=(ds.PerReplica([x, x]),))
    a, b = model.weight.values
    assert torch.equal(a, b)


# -- nccl collectives are watched off the training thread ---------------------------------


class _Work:
    """Stands in for a nccl `Work` handle: only its completion flag is read."""

    def __init__(self, completed: bool) -> None:
        self.completed = completed

    def is_completed(self) -> bool:
        return self.completed


class _Owner:
    def __init__(self) -> None:
        self.overdue: list[tuple[Any, float]] = []
        self.called = threading.Event()

    def on_overdue(self, position: Any, start: float) -> None:
        self.overdue.append((position, start))
        self.called.set()


def test_a_collective_still_running_past_the_deadline_is_reported_from_the_watch_thread() -> None:
    owner = _Owner()
    watch = StreamWatch(weakref.WeakMethod(owner.on_overdue), timeout=0.3)
    start = time.monotonic()
    watch.add(_Work(completed=True), (1, "all_reduce 'done'"), start)
    watch.add(_Work(completed=False), (2, "all_reduce 'stuck'"), start)
    assert owner.called.wait(5)
    assert owner.overdue == [((2, "all_reduce 'stuck'"), start)]
    assert time.monotonic() - start < 2


def test_completed_collectives_are_never_reported_and_the_watch_stops() -> None:
    owner = _Owner()
    watch = StreamWatch(weakref.WeakMethod(owner.on_overdue), timeout=0.2)
    work = _Work(completed=False)
    watch.add(work, (1, "broadcast 'x'"), time.monotonic())
    work.completed = True  # finished before the deadline
    time.sleep(0.6)  # the deadline passes with nothing running
    watch.stop()
    assert owner.overdue == []


def test_nccl_groups_time_out_after_the_library_has_named_the_missing_ranks() -> None:
    assert nccl_group_timeout(60).total_seconds() > 60 + 10


def test_two_ranks_claiming_one_gpu_are_both_named_before_nccl_starts() -> None:
    store = torch.distributed.HashStore()
    identities = ["host/GPU-a", "host/GPU-b", "host/GPU-a"]
    errors: list[BaseException | None] = [None] * 3

    def rank(r: int) -> None:
        try:
            check_distinct_devices(store, r, 3, identities[r], timeout_seconds=10)
        except BaseException as e:
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    for error in errors:
        assert isinstance(error, InvalidArgumentError)
        assert "ranks 0 and 2 both use GPU 'host/GPU-a'" in str(error)


def test_ranks_on_distinct_gpus_pass_the_device_check() -> None:
    store = torch.distributed.HashStore()
    threads = [
        threading.Thread(target=check_distinct_devices, args=(store, r, 2, f"host/GPU-{r}", 10))
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert store.get("device/1") == b"host/GPU-1"


def test_batches_are_placed_on_each_replicas_own_device() -> None:
    """Two really different devices: replica 1's part of every batch is on its device."""
    strategy = ds.MirroredStrategy(["cpu", "meta"])
    loader = torch.utils.data.DataLoader(torch.arange(12.0).reshape(6, 2), batch_size=4)
    steps = [
        strategy.experimental_local_results(b)
        for b in strategy.experimental_distribute_dataset(loader)
    ]
    assert [[t.device.type for t in step] for step in steps] == [["cpu", "meta"]] * 2
    assert [[tuple(t.shape) for t in step] for step in steps] == [
        [(2, 2), (2, 2)],
        [(1, 2), (1, 2)],
    ]
    assert steps[0][0].tolist() == [[0.0, 1.0], [2.0, 3.0]]
