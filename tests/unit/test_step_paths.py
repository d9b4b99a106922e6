"""What the hot paths of a step do, beyond their numbers (issue 40).

Two cuts whose effect the call budget (`test_host_budget.py`) does not see, since
the work they removed ran in torch's code: `fit` on arrays gathers each batch with
one index per tensor, and several local replicas that all have every gradient sum
them with one foreach add per replica, with nothing packed.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import distribute as ds
from distribute.collectives import packing


@contextlib.contextmanager
def _calls_to(code: Any) -> Iterator[list[int]]:
    """Counts calls of ``code`` on every thread while the context is open."""
    count = [0]

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code:
            count[0] += 1

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        yield count
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]  # None unsets it


def test_fit_on_arrays_gathers_each_batch_with_one_index_per_tensor() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    torch.manual_seed(0)
    with strategy.scope():
        model = ds.Model(torch.nn.Linear(6, 3))
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=torch.nn.CrossEntropyLoss())
    with _calls_to(TensorDataset.__getitem__.__code__) as examples:
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=True, verbose=0)
    assert examples[0] == 0, f"{examples[0]} examples fetched one at a time in 2 epochs of 40"
    assert all(np.isfinite(history.history["loss"]))


def test_fit_on_arrays_trains_on_what_a_loader_of_examples_gives() -> None:
    """The gathered batches are the examples a TensorDataset would stack, in order."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(37, 5)).astype(np.float32)
    y = rng.integers(0, 4, size=37)
    losses = []
    for as_loader in (False, True):
        torch.manual_seed(0)
        strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            model = ds.Model(torch.nn.Linear(5, 4))
        model.compile(
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=torch.nn.CrossEntropyLoss()
        )
        if as_loader:
            loader = torch.utils.data.DataLoader(
                TensorDataset(torch.as_tensor(x), torch.as_tensor(y)), batch_size=8
            )
            history = model.fit(loader, epochs=2, verbose=0)
        else:
            history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        losses.append(history.history["loss"])
    assert losses[0] == losses[1]


def _replica_step(
    strategy: ds.Strategy, grads: list[list[torch.Tensor]]
) -> tuple[torch.nn.Module, list[list[torch.Tensor]]]:
    """Gives replica i the gradients ``grads[i]`` and steps SGD (lr 1); returns the
    model and each replica's gradients after the step."""
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    after: list[list[torch.Tensor]] = [[] for _ in grads]

    def fn() -> None:
        local = ds.get_replica_context().replica_id_in_sync_group
        for p, g in zip(model.parameters(), grads[local]):
            p.grad = g.clone()
        optimizer.step()
        after[local] = [p.grad.clone() for p in model.parameters()]

    strategy.run(fn)
    return model, after


def test_replicas_with_every_gradient_sum_them_in_replica_order_without_packing() -> None:
    n = 4
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(2, 3, generator=gen), torch.randn(2, generator=gen)] for _ in range(n)]
    expected = [grads[0][j] + grads[1][j] + grads[2][j] + grads[3][j] for j in range(2)]
    strategy = ds.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    with _calls_to(packing.pack_by_bytes.__code__) as packs:  # the replica threads start inside
        model, after = _replica_step(strategy, grads)
    assert packs[0] == 0, "the gradients were packed"
    for replica in after:
        for got, want in zip(replica, expected):
            assert torch.equal(got, want)  # bitwise: the order of the packed sum
    torch.manual_seed(0)
    initial = torch.nn.Linear(3, 2)
    for p, p0, want in zip(model.parameters(), initial.parameters(), expected):
        for component in strategy.experimental_local_results(p):
            assert torch.equal(component.detach(), p0.detach() - want)


def test_a_replica_without_a_gradient_takes_the_packed_sum() -> None:
    """A replica with no gradient for a variable (it counts as zeros) still sums
    through the packed path, as before."""
    n = 2
    gen = torch.Generator().manual_seed(4)
    grads = [[torch.randn(2, 3, generator=gen), torch.randn(2, generator=gen)] for _ in range(n)]
    strategy = ds.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)

    def fn() -> None:
        local = ds.get_replica_context().replica_id_in_sync_group
        weight, bias = model.parameters()
        weight.grad = grads[local][0].clone()
        if local == 0:
            bias.grad = grads[0][1].clone()
        optimizer.step()

    strategy.run(fn)
    torch.manual_seed(0)
    initial = torch.nn.Linear(3, 2)
    weight, bias = model.parameters()
    for component in strategy.experimental_local_results(bias):
        assert torch.equal(component.detach(), initial.bias.detach() - grads[0][1])
    for component in strategy.experimental_local_results(weight):
        assert torch.equal(
            component.detach(), initial.weight.detach() - (grads[0][0] + grads[1][0])
        )


# -- one replica: the quiet hooks (NOTE [quiet steps]) ---------------------------------


def _one_replica_training(strategy: ds.Strategy) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer


def _step(strategy: ds.Strategy, model: torch.nn.Module, optimizer: Any) -> None:
    def fn(x: torch.Tensor) -> None:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    strategy.run(fn, args=(torch.ones(3, 4),))


def test_a_quiet_optimizer_given_another_strategys_variables_is_still_refused() -> None:
    a, b = ds.MirroredStrategy(["cpu:0"]), ds.MirroredStrategy(["cpu:0"])
    model, optimizer = _one_replica_training(a)
    for _ in range(3):
        _step(a, model, optimizer)  # the plan is quiet now
    foreign, _ = _one_replica_training(b)
    optimizer.add_param_group({"params": list(foreign.parameters())})
    with pytest.raises(ds.errors.MixedStrategyError, match="MirroredStrategy"):
        _step(a, model, optimizer)


def test_a_quiet_optimizer_stepped_in_another_strategys_run_is_refused() -> None:
    a, b = ds.MirroredStrategy(["cpu:0"]), ds.MirroredStrategy(["cpu:0"])
    model, optimizer = _one_replica_training(a)
    for _ in range(3):
        _step(a, model, optimizer)
    with pytest.raises(ds.errors.MixedStrategyError):
        _step(b, model, optimizer)


def test_one_replicas_steady_step_runs_no_step_handler() -> None:
    """The quiet hooks skip the handler: a steady one-replica step calls neither
    `before_step` nor `after_step` (they would do nothing), and still trains."""
    from distribute.gradients.synchronous import SynchronousStepHandler

    strategy = ds.MirroredStrategy(["cpu:0"])
    model, optimizer = _one_replica_training(strategy)
    _step(strategy, model, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    with _calls_to(SynchronousStepHandler.before_step.__code__) as calls:
        for _ in range(3):
            _step(strategy, model, optimizer)
    assert calls[0] == 0
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_an_op_inside_run_reads_its_replicas_copy_however_the_variable_is_passed() -> None:
    """Positional (the loop of NOTE [the op inside run]), keyword and nested
    arguments (`_swap`) all give each replica its own copy."""
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        v = ds.Variable(torch.zeros(2))

    def fn() -> tuple[torch.Tensor, ...]:
        local = ds.get_replica_context().replica_id_in_sync_group
        v.assign(torch.full((2,), float(local)))  # each replica's own copy differs
        zero = torch.zeros(2)
        return (
            torch.add(zero, v),
            torch.add(zero, other=v),
            torch.stack([v, zero]).sum(0),
            v * 1.0,
        )

    results = strategy.run(fn)
    for column in results:
        got = [float(t[0].detach()) for t in strategy.experimental_local_results(column)]
        assert got == [0.0, 1.0, 2.0]


# -- a DataLoader over a TensorDataset (NOTE [batched tensor datasets]) ----------------


def _tensor_loader(**kwargs: Any) -> torch.utils.data.DataLoader[Any]:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(30, 3, generator=gen).to(torch.float64)
    y = torch.randint(0, 4, (30,), generator=gen, dtype=torch.int32)
    return torch.utils.data.DataLoader(TensorDataset(x, y), batch_size=8, **kwargs)


@pytest.mark.parametrize("kwargs", [{}, {"shuffle": True}, {"drop_last": True}])
def test_a_tensor_loader_distributes_the_batches_it_yields_fetching_no_example_alone(
    kwargs: dict[str, Any],
) -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    torch.manual_seed(0)
    expected = list(_tensor_loader(**kwargs))
    torch.manual_seed(0)
    dist = strategy.experimental_distribute_dataset(_tensor_loader(**kwargs))
    with _calls_to(TensorDataset.__getitem__.__code__) as examples:
        got = list(dist)
    assert examples[0] == 0
    assert len(got) == len(expected)
    for batch, want in zip(got, expected):
        assert isinstance(batch, list)  # as default_collate makes of tuple examples
        for per_replica, tensor in zip(batch, want):
            parts = strategy.experimental_local_results(per_replica)
            joined = torch.cat(parts)
            assert joined.dtype == tensor.dtype
            assert torch.equal(joined, tensor)


def test_a_loader_of_another_dataset_or_collation_is_read_as_it_is() -> None:
    class Examples(TensorDataset):
        pass

    loaders = [
        torch.utils.data.DataLoader(Examples(torch.arange(8.0)), batch_size=4),
        torch.utils.data.DataLoader(
            TensorDataset(torch.arange(8.0)),
            batch_size=4,
            collate_fn=lambda b: torch.stack([e[0] for e in b]),
        ),
    ]
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    for loader in loaders:
        with _calls_to(TensorDataset.__getitem__.__code__) as examples:
            list(strategy.experimental_distribute_dataset(loader))
        assert examples[0] == 8  # one call per example, as the loader's own reading


def test_a_gathered_batch_never_shares_memory_with_the_dataset() -> None:
    """An unshuffled batch is a slice, copied: a step that writes into its batch
    (normalizing in place) leaves the data of later epochs unchanged."""
    x = torch.arange(12.0).reshape(6, 2)
    loader = torch.utils.data.DataLoader(TensorDataset(x), batch_size=3)
    strategy = ds.MirroredStrategy(["cpu:0"])
    for _ in range(2):
        for (batch,) in strategy.experimental_distribute_dataset(loader):
            batch.mul_(0)
    assert torch.equal(x, torch.arange(12.0).reshape(6, 2))


def test_a_step_after_an_early_sum_is_quiet_again() -> None:
    """`GradScaler.unscale_` sums before the step (an early sum): that step takes the
    full hooks, and the next ones are quiet again (the early sum used to drop the
    optimizer's quiet plan for good)."""
    from distribute.gradients.synchronous import SynchronousStepHandler

    strategy = ds.MirroredStrategy(["cpu:0"])
    with strategy.scope():
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ds.GradScaler("cpu", init_scale=8.0)

    def scaled_step(x: torch.Tensor) -> None:
        scaler.scale(model(x).sum()).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    _step(strategy, model, optimizer)
    strategy.run(scaled_step, args=(torch.ones(3, 4),))
    with _calls_to(SynchronousStepHandler.before_step.__code__) as calls:
        for _ in range(3):
            _step(strategy, model, optimizer)
    assert calls[0] == 0
