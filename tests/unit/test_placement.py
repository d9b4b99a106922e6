"""Variables that behave like the tensors users have (issue #22): where initial values
are drawn, meta-device builds, `.to(dtype)` and `.data` swaps after the scope,
optimizers that keep state in their param groups, plain arguments to `run`.

The simulated CPU devices hide most placement bugs; the same behaviours are tested
on torch_xla's devices in tests/xla and on CUDA in tests/gpu.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import distribute as ds
from distribute.errors import InvalidArgumentError

STRATEGIES: dict[str, Callable[[], ds.Strategy]] = {
    "default": ds.get_strategy,
    "one_device": lambda: ds.OneDeviceStrategy("cpu"),
    "mirrored_1": lambda: ds.MirroredStrategy(["cpu:0"]),
    "mirrored_2": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
    "mirrored_4": lambda: ds.MirroredStrategy([f"cpu:{i}" for i in range(4)]),
    "central_storage": lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}
REPLICATED = [name for name in STRATEGIES if name != "default"]

BATCH = 8


class Net(torch.nn.Module):
    """Two layers and a constant buffer the forward pass reads."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 8)
        self.second = torch.nn.Linear(8, 2)
        self.register_buffer("scale", torch.full((2,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x))) * self.scale


def split(strategy: ds.Strategy, batch: torch.Tensor) -> Any:
    n = strategy.num_replicas_in_sync
    if n == 1:
        return batch
    return ds.PerReplica([batch[i * BATCH // n : (i + 1) * BATCH // n] for i in range(n)])


def train(
    strategy: ds.Strategy,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int = 3,
    dtype: torch.dtype = torch.float32,
) -> list[float]:
    generator = torch.Generator().manual_seed(7)
    losses = []

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = ((model(x) - y) ** 2).sum(dim=1)
        loss = ds.compute_average_loss(per_example, global_batch_size=BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    for _ in range(steps):
        x = torch.randn(BATCH, 4, generator=generator).to(dtype)
        y = torch.randn(BATCH, 2, generator=generator).to(dtype)
        out = strategy.run(step, args=(split(strategy, x), split(strategy, y)))
        losses.append(float(strategy.reduce("sum", out, axis=None)))
    return losses


def weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])


def assert_copies_identical(model: torch.nn.Module) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(tensor, ds.DistributedVariable):
            first = tensor.values[0]
            for i, other in enumerate(tensor.values[1:], start=1):
                assert other.dtype == first.dtype and other.shape == first.shape, name
                assert torch.equal(other, first), f"{name}: replica {i}'s copy differs"


# -- 1. initial values -------------------------------------------------------------------


@pytest.mark.parametrize("name", REPLICATED)
def test_modules_built_in_scope_start_from_the_values_outside_any_scope(name: str) -> None:
    torch.manual_seed(1)
    expected = weights(Net())
    strategy = STRATEGIES[name]()
    torch.manual_seed(1)
    with strategy.scope():
        model = Net()
    assert torch.equal(weights(model), expected)
    assert_copies_identical(model)


def test_parameters_stay_where_the_module_made_them_until_the_scope_is_left() -> None:
    # A parameter registered on a replica device would be initialized there, from that
    # device's generator: it is placed when the scope is left (NOTE [placement]).
    strategy = ds.MirroredStrategy(["cpu", "meta"])
    with strategy.scope():
        layer = torch.nn.Linear(3, 2)
        inside = [t.device.type for t in layer.weight.values]
        made = torch.nn.Linear(3, 2)
    assert inside == ["cpu", "meta"]  # asking for the copies places that variable
    assert [t.device.type for t in made.weight.values] == ["cpu", "meta"]
    assert [t.device.type for t in made.bias.values] == ["cpu", "meta"]


def test_a_nested_scope_places_nothing_until_the_outermost_is_left() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        with strategy.scope():
            layer = torch.nn.Linear(3, 2)
        assert not layer.weight._ds_placed  # its builder may initialize it further
        torch.nn.init.constant_(layer.weight, 2.0)
    assert [float(t.sum()) for t in layer.weight.values] == [12.0, 12.0]


# -- 2. meta-device builds ------------------------------------------------------------------


def _reference_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return Net().state_dict()


def _reference_run() -> torch.Tensor:
    model = Net()
    model.load_state_dict(_reference_state())
    train(ds.get_strategy(), model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return weights(model)


MATERIALIZE = ["to_empty_in_scope", "assign_in_scope", "to_empty_after_scope", "assign_after_scope"]


@pytest.mark.parametrize("how", MATERIALIZE)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_module_built_on_the_meta_device_is_materialized_and_trains_like_one_device(
    name: str, how: str
) -> None:
    strategy = STRATEGIES[name]()
    state = _reference_state()
    with strategy.scope():
        with torch.device("meta"):
            model = Net()
        if how == "to_empty_in_scope":
            model.to_empty(device="cpu")
            model.load_state_dict(state)
        elif how == "assign_in_scope":
            model.load_state_dict(state, assign=True)
        if how.endswith("in_scope"):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if how == "to_empty_after_scope":
        model.to_empty(device="cpu")
        model.load_state_dict(state)
    elif how == "assign_after_scope":
        model.load_state_dict(state, assign=True)
    if how.endswith("after_scope"):
        with strategy.scope():
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(strategy, model, optimizer)
    if name != "default":
        for tensor in [*model.parameters(), *model.buffers()]:
            assert isinstance(tensor, ds.MirroredVariable)
            assert len(tensor.values) == len(strategy.extended.worker_devices)
        assert all(p is q for p, q in zip(optimizer.param_groups[0]["params"], model.parameters()))
    assert_copies_identical(model)
    torch.testing.assert_close(weights(model), _reference_run(), rtol=0, atol=1e-6)


def test_the_smallest_meta_case_builds_in_every_replica_s_scope() -> None:
    # Before, the scope's parameter hook copied the meta tensor: "Cannot copy out of meta".
    with ds.MirroredStrategy(["cpu:0", "cpu:1"]).scope(), torch.device("meta"):
        layer = torch.nn.Linear(2, 2)
    assert layer.weight.is_meta


def test_run_refuses_a_module_still_on_the_meta_device() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope(), torch.device("meta"):
        layer = torch.nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError, match=r"meta device.*to_empty"):
        strategy.run(lambda x: layer(x), args=(torch.ones(1, 2),))


def test_a_variable_made_from_a_meta_value_is_placed_once_assigned() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        with torch.device("meta"):
            v = ds.Variable(torch.zeros(3))
        v.data = torch.arange(3.0)
    assert [t.tolist() for t in v.values] == [[0.0, 1.0, 2.0]] * 2


# -- 3. casts and moves after the scope ---------------------------------------------------------


CASTS: dict[str, tuple[Callable[[torch.nn.Module], Any], torch.dtype]] = {
    "double": (lambda m: m.double(), torch.float64),
    "to_float64": (lambda m: m.to(torch.float64), torch.float64),
    "half": (lambda m: m.half(), torch.float16),
    "bfloat16": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
}


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("name", REPLICATED)
def test_a_cast_after_the_scope_reaches_every_copy(name: str, cast: str) -> None:
    convert, dtype = CASTS[cast]
    strategy = STRATEGIES[name]()
    torch.manual_seed(0)
    with strategy.scope():
        model = Net()
        model.add_module("norm", torch.nn.BatchNorm1d(2))
    convert(model)
    for tensor in model.parameters():
        assert isinstance(tensor, ds.MirroredVariable)
        assert {t.dtype for t in tensor.values} == {dtype}, "every replica's copy is cast"
    assert model.scale.dtype == dtype  # a plain tensor now: adopted again by the next run
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if dtype is torch.float64:  # exact: the same numbers as one device
        torch.manual_seed(0)
        expected = Net()
        expected.add_module("norm", torch.nn.BatchNorm1d(2))
        convert(expected)
        train(
            ds.get_strategy(), expected, torch.optim.SGD(expected.parameters(), lr=0.05), 2, dtype
        )
        train(strategy, model, optimizer, 2, dtype)
        torch.testing.assert_close(weights(model), weights(expected), rtol=0, atol=1e-12)
    else:
        train(strategy, model, optimizer, 2, dtype)
    if strategy.num_replicas_in_sync > 1:
        for buffer in model.buffers():
            assert isinstance(buffer, ds.MirroredVariable)
        assert {t.dtype for t in model.scale.values} == {dtype}
    assert_copies_identical(model)


@pytest.mark.parametrize("name", ["mirrored_4", "central_storage"])
def test_buffers_a_cast_replaced_become_variables_again_before_the_next_run(name: str) -> None:
    # Module._apply writes each buffer's slot with a new tensor (no hook sees it); a
    # plain buffer would be updated by every replica thread at once.
    strategy = STRATEGIES[name]()
    with strategy.scope():
        norm = torch.nn.BatchNorm1d(3)
    norm.double()
    assert not isinstance(norm.running_mean, ds.DistributedVariable)
    x = torch.randn(8, 3, dtype=torch.float64)
    strategy.run(lambda x: norm(x), args=(split(strategy, x),))
    for buffer in (norm.running_mean, norm.running_var, norm.num_batches_tracked):
        assert isinstance(buffer, ds.MirroredVariable)
    assert {t.dtype for t in norm.running_mean.values} == {torch.float64}
    expected = x.mean(dim=0) * 0.1  # momentum 0.1 from zeros: the batches' mean, averaged
    torch.testing.assert_close(norm.running_mean.values[0], expected)
    assert_copies_identical(norm)


@pytest.mark.parametrize("name", REPLICATED)
def test_moving_to_where_the_variables_are_changes_nothing(name: str) -> None:
    strategy = STRATEGIES[name]()
    with strategy.scope():
        model = Net()
    before = [p for p in model.parameters()]
    model.to("cpu")
    model.to(torch.device("cpu"))
    assert all(p is q for p, q in zip(model.parameters(), before))


def test_moving_a_variable_off_its_replica_devices_is_refused() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        layer = torch.nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError, match="replica devices"):
        layer.weight.data = torch.zeros(2, 2, device="meta")


# -- 4. `.data` swapped for another shape ----------------------------------------------------------


@pytest.mark.parametrize("name", REPLICATED)
def test_a_data_swap_to_another_shape_reaches_every_copy_and_trains(name: str) -> None:
    # transformers' resize_token_embeddings does `old.weight.data = new.weight.data`.
    def build() -> torch.nn.Module:
        torch.manual_seed(2)
        return torch.nn.Sequential(
            torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(8, 2)
        )

    def grow(model: torch.nn.Module) -> None:
        torch.manual_seed(4)
        bigger = torch.nn.Embedding(12, 4)
        bigger.weight.data[:10] = model[0].weight.data
        model[0].weight.data = bigger.weight.data

    strategy = STRATEGIES[name]()
    with strategy.scope():
        model = build()
    grow(model)
    assert {tuple(t.shape) for t in model[0].weight.values} == {(12, 4)}
    with strategy.scope():
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    expected = build()
    grow(expected)
    expected_optimizer = torch.optim.Adam(expected.parameters(), lr=0.01)
    ids = torch.randint(0, 12, (BATCH, 2), generator=torch.Generator().manual_seed(1))
    y = torch.randn(BATCH, 2, generator=torch.Generator().manual_seed(2))

    def step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[..., Any]:
        def fn(x: torch.Tensor, t: torch.Tensor) -> None:
            loss = ds.compute_average_loss(((m(x) - t) ** 2).sum(1), global_batch_size=BATCH)
            loss.backward()
            opt.step()
            opt.zero_grad()

        return fn

    for _ in range(3):
        strategy.run(step(model, optimizer), args=(split(strategy, ids), split(strategy, y)))
        step(expected, expected_optimizer)(ids, y)
    assert_copies_identical(model)
    torch.testing.assert_close(weights(model), weights(expected), rtol=0, atol=1e-6)


# -- 5. optimizers that keep state in their param groups ---------------------------------------


class GroupStepSGD(torch.optim.Optimizer):
    """SGD whose learning rate decays with a step counter kept in the group, as Lamb's
    and Adan's bias corrections are (timm, pytorch_optimizer)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / group["step"])


def _group_step_optimizers() -> dict[str, Callable[[Any], torch.optim.Optimizer]]:
    import pytorch_optimizer

    return {
        "group_step_sgd": lambda params: GroupStepSGD(params, lr=0.1),
        "lamb": lambda params: pytorch_optimizer.Lamb(params, lr=0.01),
        "adan": lambda params: pytorch_optimizer.Adan(params, lr=0.01),
        "lamb_foreach": lambda params: pytorch_optimizer.Lamb(params, lr=0.01, foreach=True),
    }


@pytest.mark.parametrize("optimizer_name", ["group_step_sgd", "lamb", "adan", "lamb_foreach"])
@pytest.mark.parametrize("name", ["mirrored_1", "mirrored_2", "mirrored_4", "central_storage"])
def test_optimizers_with_a_step_counter_in_their_groups_count_each_step_once(
    name: str, optimizer_name: str
) -> None:
    make = _group_step_optimizers()[optimizer_name]
    torch.manual_seed(5)
    expected = Net()
    expected_optimizer = make(expected.parameters())
    train(ds.get_strategy(), expected, expected_optimizer, steps=4)
    strategy = STRATEGIES[name]()
    torch.manual_seed(5)
    with strategy.scope():
        model = Net()
        optimizer = make(model.parameters())
    train(strategy, model, optimizer, steps=4)
    assert optimizer.state_dict()["param_groups"][0]["step"] == 4
    assert_copies_identical(model)
    torch.testing.assert_close(weights(model), weights(expected), rtol=0, atol=1e-6)


# -- 6. plain tensors passed to `run` ------------------------------------------------------------


def test_plain_tensors_passed_to_run_reach_each_replica_on_its_device() -> None:
    strategy = ds.MirroredStrategy(["cpu", "meta"])
    host = torch.ones(2)

    def devices(x: torch.Tensor, nest: dict[str, Any], *, y: torch.Tensor) -> tuple[str, ...]:
        return (x.device.type, nest["a"][0].device.type, y.device.type)

    out = strategy.run(devices, args=(host, {"a": [host]}), kwargs={"y": host})
    assert strategy.experimental_local_results(out) == (("cpu",) * 3, ("meta",) * 3)


def test_tensors_already_on_the_replica_s_device_are_not_copied() -> None:
    strategy = ds.MirroredStrategy(["cpu", "meta"])
    host = torch.ones(2)
    same = strategy.run(lambda x: x is host, args=(host,))
    assert strategy.experimental_local_results(same) == (True, False)
