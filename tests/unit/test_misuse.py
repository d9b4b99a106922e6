"""Misuse is caught with a clear error, never a crash, a hang or a silent wrong answer.

Each test pins one rule: what happens when a model built outside `scope()` is trained
in `run`, when one strategy's variables are trained by another, when the optimizer
steps outside `run`, when variables or scopes are created inside `run`, when scope
objects are reused, when batches carry non-tensor leaves, when `PerReplica` values or
device strings are malformed, when a generator is iterated twice, and when `run` is
entered from two threads at once. CPU only: two logical replicas `cpu:0`, `cpu:1`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import distribute as ds

TWO_CPUS = ["cpu:0", "cpu:1"]


def mirrored2() -> ds.Strategy:
    return ds.MirroredStrategy(TWO_CPUS)


def central2() -> ds.Strategy:
    return ds.CentralStorageStrategy(TWO_CPUS)


def one_device() -> ds.Strategy:
    return ds.OneDeviceStrategy("cpu")


def two_replica_batch() -> ds.PerReplica:
    """One (2, 4) input per replica, different on each replica."""
    return ds.PerReplica((torch.ones(2, 4), torch.full((2, 4), 2.0)))


def training_step(model: Any, optimizer: torch.optim.Optimizer) -> Any:
    """forward, backward, step, zero_grad: the usual training step."""

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def unchanged(model: torch.nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


# -- 1. a model built outside scope() trained inside run ----------------------------------


@pytest.mark.parametrize("make_strategy", [mirrored2, central2], ids=["mirrored", "central"])
def test_plain_model_trained_in_run_raises_invalid_argument_naming_scope(make_strategy):
    strategy = make_strategy()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model)
    with pytest.raises(ds.errors.InvalidArgumentError, match=re.escape("strategy.scope()")):
        strategy.run(training_step(model, optimizer), args=(two_replica_batch(),))
    assert issubclass(ds.errors.InvalidArgumentError, ValueError)
    assert unchanged(model, before)


_PLAIN_MODEL_200_STEPS = textwrap.dedent(
    """
    import torch
    import distribute as ds

    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    def step(x):
        loss = model(x).pow(2).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    for i in range(200):
        batch = ds.PerReplica((torch.ones(2, 4), torch.full((2, 4), 2.0)))
        try:
            strategy.run(step, args=(batch,))
        except ds.errors.InvalidArgumentError as e:
            assert "strategy.scope()" in str(e), f"step {i}: {e}"
        else:
            raise SystemExit(f"step {i}: run did not raise InvalidArgumentError")
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b), "weights changed"
    print("ALL 200 STEPS RAISED")
    """
)


def test_plain_model_trained_200_times_in_mirrored_run_raises_every_time_without_crashing():
    """In a child process, so that a segfault fails this test instead of the whole run."""
    root = Path(ds.__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _PLAIN_MODEL_200_STEPS],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "ALL 200 STEPS RAISED" in proc.stdout


def test_optimizer_mixing_scope_variables_with_a_plain_parameter_raises_invalid_argument():
    strategy = mirrored2()
    with strategy.scope():
        layer = torch.nn.Linear(4, 2)
    plain = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([*layer.parameters(), plain], lr=0.1)
    before = snapshot(layer)
    with pytest.raises(ds.errors.InvalidArgumentError):
        strategy.run(
            training_step(lambda x: layer(x) + plain, optimizer), args=(two_replica_batch(),)
        )
    assert unchanged(layer, before)
    assert torch.equal(plain.detach(), torch.zeros(2))


def test_plain_model_trains_under_one_device_strategy():
    strategy = one_device()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model)
    strategy.run(training_step(model, optimizer), args=(torch.ones(2, 4),))
    assert not unchanged(model, before)


# -- 2. variables of strategy A trained in strategy B's run -------------------------------


def _train_a_model_of_a_in_b(a: ds.Strategy, b: ds.Strategy) -> pytest.ExceptionInfo:
    with a.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ds.errors.MixedStrategyError) as info:
        b.run(training_step(model, optimizer), args=(two_replica_batch(),))
    return info


def test_model_of_one_mirrored_strategy_trained_in_another_raises_mixed_strategy_error():
    info = _train_a_model_of_a_in_b(mirrored2(), mirrored2())
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert "MirroredStrategy" in message
    assert re.search(r"\bstrategy\b", message, re.IGNORECASE), message


def test_model_of_central_storage_trained_in_mirrored_run_names_both_strategies():
    info = _train_a_model_of_a_in_b(central2(), mirrored2())
    message = str(info.value)
    assert "CentralStorageStrategy" in message
    assert "MirroredStrategy" in message


# -- 3. optimizer.step() outside run after backward inside run ----------------------------


@pytest.mark.parametrize("in_scope", [False, True], ids=["outside_scope", "inside_scope"])
def test_step_in_cross_replica_context_after_backward_in_run_raises_context_error(in_scope):
    strategy = mirrored2()
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy.run(lambda x: model(x).pow(2).sum().backward(), args=(two_replica_batch(),))
    before = snapshot(model)
    with pytest.raises(ds.errors.ContextError, match="inside") as info:
        if in_scope:
            with strategy.scope():
                optimizer.step()
        else:
            optimizer.step()
    assert "run" in str(info.value)
    assert unchanged(model, before)


# -- 4. creating variables inside run -----------------------------------------------------


def test_variable_created_in_mirrored_run_raises_context_error_naming_scope():
    with pytest.raises(ds.errors.ContextError, match="scope"):
        mirrored2().run(lambda: ds.Variable(1.0))


def test_module_with_parameters_built_in_mirrored_run_raises_context_error_naming_scope():
    with pytest.raises(ds.errors.ContextError, match="scope"):
        mirrored2().run(lambda: torch.nn.Linear(2, 2))


def test_parameter_free_module_built_in_mirrored_run_is_allowed():
    strategy = mirrored2()
    out = strategy.run(lambda: torch.nn.ReLU())
    results = strategy.experimental_local_results(out)
    assert len(results) == 2
    assert all(isinstance(m, torch.nn.ReLU) for m in results)


def test_variable_created_in_one_device_run_is_allowed():
    v = one_device().run(lambda: ds.Variable(1.0))
    assert torch.equal(v.detach(), torch.tensor(1.0))


# -- 5. entering scope() inside run -------------------------------------------------------


@pytest.mark.parametrize("make_strategy", [mirrored2, one_device], ids=["mirrored", "one_device"])
def test_entering_scope_inside_run_raises_context_error(make_strategy):
    strategy = make_strategy()

    def fn() -> None:
        with strategy.scope():
            pass

    with pytest.raises(ds.errors.ContextError, match="scope") as info:
        strategy.run(fn)
    assert isinstance(info.value, RuntimeError)
    assert not ds.has_strategy()


# -- 6. scope objects are reusable and re-entrant -----------------------------------------


def test_scope_object_can_be_entered_twice_in_sequence():
    strategy = mirrored2()
    s = strategy.scope()
    for _ in range(2):
        with s:
            assert ds.get_strategy() is strategy
        assert not ds.has_strategy()


def test_scope_object_can_be_nested_in_itself():
    strategy = mirrored2()
    s = strategy.scope()
    with s:
        with s:
            assert ds.get_strategy() is strategy
        assert ds.get_strategy() is strategy
    assert not ds.has_strategy()


def test_scope_object_enters_as_the_strategy():
    strategy = mirrored2()
    with strategy.scope() as got:
        assert got is strategy
    assert not ds.has_strategy()


# -- 7. per-example non-tensor leaves are split with their examples -----------------------


class _NamedValues(Dataset):
    """Item i is (tensor([i]), "file{i}")."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        return torch.tensor([float(i)]), f"file{i}"


def test_string_leaves_of_a_loader_batch_are_split_with_their_examples():
    strategy = mirrored2()
    dist = strategy.experimental_distribute_dataset(DataLoader(_NamedValues(20), batch_size=8))
    seen: list[float] = []
    steps = 0
    for x, names in dist:
        steps += 1
        assert isinstance(x, ds.PerReplica) and len(x.values) == 2
        assert isinstance(names, ds.PerReplica) and len(names.values) == 2
        for t, n in zip(x.values, names.values, strict=True):
            assert list(n) == [f"file{int(v)}" for v in t.flatten()]
            seen.extend(t.flatten().tolist())
    assert steps == 3
    # the last batch (4 items) splits 2 + 2
    assert [len(n) for n in names.values] == [2, 2]
    assert sorted(seen) == [float(i) for i in range(20)]


def test_string_list_of_a_given_batch_is_split_three_and_three():
    strategy = mirrored2()
    batches = [(torch.arange(6.0).reshape(6, 1), ["a", "b", "c", "d", "e", "f"])]
    steps = list(strategy.experimental_distribute_dataset(batches))
    assert len(steps) == 1
    x, names = steps[0]
    assert isinstance(names, ds.PerReplica)
    assert [list(n) for n in names.values] == [["a", "b", "c"], ["d", "e", "f"]]
    assert [t.flatten().tolist() for t in x.values] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_string_list_whose_length_is_not_the_batch_size_raises_invalid_argument():
    strategy = mirrored2()
    dist = strategy.experimental_distribute_dataset([(torch.zeros(6, 1), ["a", "b", "c"])])
    with pytest.raises(ds.errors.InvalidArgumentError) as info:
        list(dist)
    message = str(info.value)
    assert "6" in message and "3" in message, message


# -- 8. PerReplica of the wrong length ----------------------------------------------------


def test_per_replica_with_more_components_than_replicas_raises_invalid_argument():
    with pytest.raises(ds.errors.InvalidArgumentError, match="3") as info:
        mirrored2().run(lambda x: x, args=(ds.PerReplica((1, 2, 3)),))
    assert "2" in str(info.value)


def test_per_replica_with_fewer_components_than_replicas_raises_invalid_argument():
    with pytest.raises(ds.errors.InvalidArgumentError):
        mirrored2().run(lambda x: x, args=(ds.PerReplica((1,)),))


# -- 9. device strings ---------------------------------------------------------------------


def test_single_device_string_is_one_device_not_its_characters():
    assert ds.MirroredStrategy("cpu:0").num_replicas_in_sync == 1


def test_tensorflow_device_spellings_are_accepted():
    assert ds.MirroredStrategy(["/cpu:0", "/device:CPU:1"]).num_replicas_in_sync == 2
    assert (
        ds.MirroredStrategy(["/job:localhost/replica:0/task:0/device:CPU:0"]).num_replicas_in_sync
        == 1
    )
    assert ds.OneDeviceStrategy("/cpu:0").num_replicas_in_sync == 1
    assert ds.OneDeviceStrategy("CPU:0").num_replicas_in_sync == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    "make_strategy",
    [
        lambda: ds.MirroredStrategy(["cuda:0"]),
        lambda: ds.MirroredStrategy(["/gpu:0"]),
        lambda: ds.MirroredStrategy(["GPU:0"]),
        lambda: ds.OneDeviceStrategy("cuda:0"),
    ],
    ids=["mirrored_cuda0", "mirrored_/gpu0", "mirrored_GPU0", "one_device_cuda0"],
)
def test_gpu_device_without_cuda_raises_invalid_argument_listing_cpu(make_strategy):
    with pytest.raises(ds.errors.InvalidArgumentError, match="cpu"):
        make_strategy()


def test_nonsense_device_raises_invalid_argument():
    with pytest.raises(ds.errors.InvalidArgumentError):
        ds.MirroredStrategy(["tpu9:x"])


# -- 10. a generator dataset iterated twice -----------------------------------------------


def test_second_iteration_over_a_generator_dataset_warns_it_is_a_spent_iterator():
    strategy = mirrored2()
    gen = (torch.ones(4, 1) for _ in range(3))
    dist = strategy.experimental_distribute_dataset(gen)
    assert sum(1 for _ in dist) == 3
    with pytest.warns(UserWarning, match="iterator"):
        for _ in dist:
            pass


# -- 11. run entered from two threads at once ---------------------------------------------


@pytest.mark.timeout(60)
def test_run_from_a_second_thread_while_one_is_running_raises_context_error_naming_thread():
    strategy = mirrored2()
    entered = threading.Event()
    release = threading.Event()
    result: dict[str, Any] = {}

    def fn() -> str:
        entered.set()
        assert release.wait(timeout=10), "never released"
        return "done"

    def worker() -> None:
        try:
            result["out"] = strategy.run(fn)
        except BaseException as e:  # reported by the main thread
            result["error"] = e

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    try:
        assert entered.wait(timeout=10), "the worker thread never entered run"
        with pytest.raises(ds.errors.ContextError, match="thread"):
            strategy.run(lambda: None)
    finally:
        release.set()
        t.join(timeout=10)
    assert not t.is_alive()
    assert "error" not in result, result.get("error")
    assert result.get("out") == "done"


# -- what is NOT refused (review: no false positives) ----------------------------------


def test_per_replica_optimizer_over_plain_tensors_made_inside_run_is_allowed() -> None:
    """An adversarial perturbation optimized inside `fn` belongs to its replica alone."""
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(4, 1)

    def fn(x: torch.Tensor) -> torch.Tensor:
        delta = torch.zeros_like(x, requires_grad=True)
        inner = torch.optim.SGD([delta], lr=0.1)
        model(x + delta).sum().backward()
        inner.step()
        return delta.detach()

    x = ds.PerReplica((torch.ones(2, 4), torch.ones(2, 4)))
    deltas = strategy.experimental_local_results(strategy.run(fn, args=(x,)))
    assert all(d.abs().sum() > 0 for d in deltas)


def test_model_of_another_strategy_can_be_evaluated_without_grad() -> None:
    a = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    b = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with a.scope():
        model = torch.nn.Linear(4, 1)

    def evaluate() -> torch.Tensor:
        with torch.no_grad():
            return model(torch.ones(1, 4))

    outs = b.experimental_local_results(b.run(evaluate))
    assert torch.equal(outs[0], outs[1])


def test_constant_tuple_in_a_batch_goes_whole_to_every_replica() -> None:
    """Only lists of strings are per-example; an image size stays a constant."""
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    batches = [{"x": torch.zeros(4, 1), "size": (224, 224)}]
    (element,) = list(strategy.experimental_distribute_dataset(batches))
    assert [t.shape[0] for t in element["x"].values] == [2, 2]
    assert element["size"] == (224, 224)
