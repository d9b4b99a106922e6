"""Single-process strategies on real GPUs: MirroredStrategy, CentralStorageStrategy.

Skipped without CUDA; the tests that need several GPUs are skipped with fewer.
Every comparison with one-GPU training runs with TF32 off and deterministic
cuDNN, so both sides run the same kernels on the same shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.optim.adam as adam_module

import distribute as ds

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ATOL, RTOL = 1e-5, 1e-4
IMAGE = (3, 8, 8)
CLASSES = 10

needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs at least 2 GPUs, found {GPUS}")


@pytest.fixture(autouse=True)
def _exact_cuda_math() -> Iterator[None]:
    """No TF32, deterministic cuDNN; the previous settings come back afterwards."""
    saved = (
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        (
            torch.backends.cudnn.allow_tf32,
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
        ) = saved


# -- models, data and the one-GPU reference ------------------------------------------------


def _cnn() -> torch.nn.Module:
    """A small CNN with two BatchNorm2d layers."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(IMAGE[0], 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, CLASSES),
    )


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, CLASSES)
    )


def _batches(
    steps: int, global_batch: int, features: tuple[int, ...], seed: int = 7
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """CPU global batches, the same for the strategy and its reference."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(global_batch, *features, generator=g),
            torch.randint(0, CLASSES, (global_batch,), generator=g),
        )
        for _ in range(steps)
    ]


def _reference_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    replicas: int,
    global_batch: int,
) -> float:
    """One step on one device that computes what `replicas` replicas compute.

    BatchNorm normalizes each replica's own part of the batch (as in TF and DDP,
    without SyncBatchNorm), so the global batch is split the way the strategy splits
    it and each part goes through the model on its own, from the same running
    statistics; gradients accumulate (the sum over replicas), and the running
    statistics become the mean of what each part left (integer buffers: the first
    part's), which is what the strategy's buffer sync does.
    """
    buffers = dict(model.named_buffers())
    start = {k: b.detach().clone() for k, b in buffers.items()}
    ends: list[dict[str, torch.Tensor]] = []
    total = 0.0
    for xs, ys in zip(x.tensor_split(replicas), y.tensor_split(replicas)):
        with torch.no_grad():
            for k, b in buffers.items():
                b.copy_(start[k])
        per_example = F.cross_entropy(model(xs), ys, reduction="none")
        loss = per_example.sum() / global_batch
        loss.backward()
        total += float(loss.detach())
        ends.append({k: b.detach().clone() for k, b in buffers.items()})
    with torch.no_grad():
        for k, b in buffers.items():
            parts = [e[k] for e in ends]
            b.copy_(torch.stack(parts).mean(0) if b.is_floating_point() else parts[0])
    optimizer.step()
    optimizer.zero_grad()
    return total


def _train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, global_batch: int
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = F.cross_entropy(model(x), y, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=global_batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def _state(module: torch.nn.Module) -> list[tuple[str, str, Any]]:
    return [("parameter", n, p) for n, p in module.named_parameters()] + [
        ("buffer", n, b) for n, b in module.named_buffers()
    ]


def _assert_replicas_identical(
    strategy: ds.Strategy, model: torch.nn.Module, devices: list[torch.device], when: str
) -> None:
    """Every parameter and buffer has one component per replica, on the replica's
    device, all equal to replica 0's bit for bit."""
    for kind, name, var in _state(model):
        components = strategy.experimental_local_results(var)
        assert len(components) == len(devices), f"{when}: {kind} {name!r}: {len(components)}"
        first = components[0].detach().cpu()
        for i, (c, device) in enumerate(zip(components, devices)):
            assert c.device == device, f"{when}: {kind} {name!r} replica {i} on {c.device}"
            assert torch.equal(c.detach().cpu(), first), (
                f"{when}: {kind} {name!r} differs between replica 0 and replica {i}"
            )


def _assert_matches_reference(
    strategy: ds.Strategy, model: torch.nn.Module, reference: torch.nn.Module, when: str
) -> None:
    expected = {name: value for _, name, value in _state(reference)}
    for kind, name, var in _state(model):
        actual = strategy.experimental_local_results(var)[0].detach().cpu()
        torch.testing.assert_close(
            actual,
            expected[name].detach().cpu(),
            atol=ATOL,
            rtol=RTOL,
            msg=lambda m, kind=kind, name=name: f"{when}: {kind} {name!r}: {m}",
        )


# -- 1. MirroredStrategy on every GPU: a BatchNorm CNN --------------------------------------


@needs_two_gpus
def test_mirrored_batchnorm_cnn_on_every_gpu_keeps_replicas_identical_and_matches_one_gpu() -> None:
    """MirroredStrategy() takes every GPU; 20 SGD-with-momentum steps of a BatchNorm CNN
    keep every parameter and buffer identical on all replicas after each step, and
    equal (1e-5 / 1e-4) to one-GPU training on the same global batches."""
    devices = [torch.device("cuda", i) for i in range(GPUS)]
    strategy = ds.MirroredStrategy()
    assert list(strategy.extended.worker_devices) == devices
    replicas, global_batch, steps = len(devices), 4 * len(devices), 20
    torch.manual_seed(0)
    with strategy.scope():
        model = _cnn()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(0)
    reference = _cnn().to(devices[0])
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    _assert_replicas_identical(strategy, model, devices, "before training")
    _assert_matches_reference(strategy, model, reference, "before training")

    batches = _batches(steps, global_batch, IMAGE)
    step = _train_step(model, optimizer, global_batch)
    done = 0
    for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(batches)):
        loss = float(strategy.reduce("SUM", strategy.run(step, args=(x, y)), axis=None))
        xr, yr = (t.to(devices[0]) for t in batches[i])
        ref_loss = _reference_step(reference, ref_optimizer, xr, yr, replicas, global_batch)
        assert loss == pytest.approx(ref_loss, rel=RTOL, abs=ATOL), f"loss at step {i}"
        _assert_replicas_identical(strategy, model, devices, f"after step {i}")
        _assert_matches_reference(strategy, model, reference, f"after step {i}")
        done += 1
    assert done == steps


# -- 4. foreach and fused optimizers --------------------------------------------------------

_ADAM_PATHS = ("_single_tensor_adam", "_multi_tensor_adam", "_fused_adam")


def _recording(name: str, original: Callable[..., Any], calls: list[dict[str, Any]]) -> Any:
    def recorder(params: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        calls.append(
            {
                "path": name,
                "types": sorted({type(p).__name__ for p in params}),
                "devices": sorted({str(p.device) for p in params}),
            }
        )
        return original(params, *args, **kwargs)

    return recorder


@pytest.fixture
def adam_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Records which of Adam's three implementations each step runs.

    `torch.optim.adam.adam` picks ``_fused_adam``, ``_multi_tensor_adam`` (foreach) or
    ``_single_tensor_adam`` by name from its module at every call, after its own
    default (`_default_to_fused_or_foreach` on the tensors the optimizer really
    holds, then the ``lr``-is-a-Tensor exception). Wrapping the three records the
    path actually taken whatever decided it; wrapping ``torch._foreach_add_`` would
    not do, because the library sums gradients with it too.
    """
    calls: list[dict[str, Any]] = []
    for name in _ADAM_PATHS:
        monkeypatch.setattr(adam_module, name, _recording(name, getattr(adam_module, name), calls))
    return calls


_ADAM_FLAGS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
_EXPECTED_PATH = {
    "default": "_multi_tensor_adam",
    "foreach": "_multi_tensor_adam",
    "fused": "_fused_adam",
}


@needs_two_gpus
@pytest.mark.parametrize("flags", sorted(_ADAM_FLAGS))
def test_adam_foreach_and_fused_paths_train_on_two_gpus_like_one(
    flags: str, adam_calls: list[dict[str, Any]]
) -> None:
    """Adam with default arguments, ``foreach=True`` and ``fused=True`` under
    MirroredStrategy on 2 GPUs: the step runs the expected implementation (by
    default, foreach, as torch picks for plain CUDA parameters), keeps the replicas
    identical and matches one-GPU Adam with the same arguments."""
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    strategy = ds.MirroredStrategy([str(d) for d in devices])
    global_batch, steps = 16, 10
    torch.manual_seed(0)
    with strategy.scope():
        model = _mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, **_ADAM_FLAGS[flags])
    torch.manual_seed(0)
    reference = _mlp().to(devices[0])
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3, **_ADAM_FLAGS[flags])
    batches = _batches(steps, global_batch, (16,))
    step = _train_step(model, optimizer, global_batch)

    for x, y in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(x, y))
    ours = list(adam_calls)
    adam_calls.clear()
    for x, y in batches:
        xr, yr = x.to(devices[0]), y.to(devices[0])
        _reference_step(reference, ref_optimizer, xr, yr, len(devices), global_batch)
    theirs = list(adam_calls)

    expected = _EXPECTED_PATH[flags]
    assert theirs and all(c["path"] == expected for c in theirs), (
        f"one-GPU Adam({flags}) itself ran {theirs[:2]}: this torch decides differently"
    )
    assert ours, "optimizer.step() under the strategy never reached torch.optim.adam.adam"
    assert all(c["path"] == expected for c in ours), (
        f"Adam({flags}) under MirroredStrategy ran {sorted({c['path'] for c in ours})}, "
        f"expected {expected}; what it was given: {ours[:2]}"
    )
    _assert_replicas_identical(strategy, model, devices, f"Adam({flags}) after {steps} steps")
    _assert_matches_reference(strategy, model, reference, f"Adam({flags}) after {steps} steps")


# -- 5. replica threads enter their own device ---------------------------------------------


@needs_two_gpus
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_each_replica_thread_runs_on_its_own_current_device(order: str) -> None:
    """Inside `run`, ``torch.cuda.current_device()`` is the replica's GPU and
    ``device="cuda"`` means it, whatever the order of the devices given; the caller's
    current device is unchanged afterwards."""
    indices = list(range(GPUS))
    if order == "descending":
        indices.reverse()
    devices = [torch.device("cuda", i) for i in indices]
    strategy = ds.MirroredStrategy([str(d) for d in devices])
    before = torch.cuda.current_device()

    def where() -> tuple[int, int, torch.device]:
        ctx = ds.get_replica_context()
        assert ctx is not None
        made = torch.ones(1, device="cuda")
        return ctx.replica_id_in_sync_group, torch.cuda.current_device(), made.device

    for attempt in range(2):  # the replica threads persist between runs
        seen = strategy.experimental_local_results(strategy.run(where))
        assert len(seen) == len(devices)
        for replica, (rid, current, made) in enumerate(seen):
            device = devices[replica]
            assert rid == replica
            assert current == device.index, (
                f"run {attempt}: replica {replica} (on {device}) has current device {current}"
            )
            assert made == device, f"run {attempt}: replica {replica}: 'cuda' made {made}"
        assert torch.cuda.current_device() == before, "run changed the caller's device"


# -- 6. input prefetched to each replica's GPU ---------------------------------------------


@needs_two_gpus
def test_distributed_dataloader_batches_arrive_on_each_replicas_gpu() -> None:
    """A pinned-memory DataLoader's global batches arrive split over the replicas
    (larger parts first, empty parts at the uneven end), each part on its replica's
    GPU, with the values of the CPU batch's split."""
    devices = [torch.device("cuda", i) for i in range(GPUS)]
    strategy = ds.MirroredStrategy()
    n = len(devices)
    global_batch = 2 * n + 1  # uneven: n + 1 parts are not all equal
    g = torch.Generator().manual_seed(3)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(5 * global_batch + 3, 4, generator=g), torch.arange(5 * global_batch + 3)
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=global_batch, pin_memory=True)
    expected = list(torch.utils.data.DataLoader(dataset, batch_size=global_batch))

    def check(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.device, torch.device, int]:
        ctx = ds.get_replica_context()
        assert ctx is not None
        return x.device, y.device, ctx.replica_id_in_sync_group

    steps = 0
    for step, (x, y) in enumerate(strategy.experimental_distribute_dataset(loader)):
        want_x, want_y = expected[step]
        xs = strategy.experimental_local_results(x)
        ys = strategy.experimental_local_results(y)
        parts = zip(want_x.tensor_split(n), want_y.tensor_split(n))
        for i, (xc, yc, (ex, ey)) in enumerate(zip(xs, ys, parts)):
            assert xc.device == devices[i] and yc.device == devices[i], (
                f"step {step}: replica {i}'s part is on {xc.device}/{yc.device}"
            )
            assert torch.equal(xc.cpu(), ex), f"step {step}: replica {i}'s features"
            assert torch.equal(yc.cpu(), ey), f"step {step}: replica {i}'s labels"
        inside = strategy.experimental_local_results(strategy.run(check, args=(x, y)))
        for xd, yd, replica in inside:
            assert xd == devices[replica] and yd == devices[replica], (
                f"step {step}: inside run, replica {replica} got {xd}/{yd}"
            )
        steps += 1
    assert steps == len(expected)


# -- 7. CentralStorageStrategy with its defaults -------------------------------------------


def test_central_storage_with_default_arguments_trains_on_a_cuda_machine() -> None:
    """CentralStorageStrategy() builds where CUDA is available (one shared copy needs
    one device: compute and parameters on the first GPU) and its training steps give
    one-device training's parameters."""
    strategy = ds.CentralStorageStrategy()
    devices = list(strategy.extended.worker_devices)
    assert devices == [torch.device("cuda", 0)], devices
    assert list(strategy.extended.parameter_devices) == devices
    replicas, global_batch, steps = len(devices), 4 * len(devices), 3
    torch.manual_seed(0)
    with strategy.scope():
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(0)
    reference = _mlp().to(devices[0])
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    start = {n: p.detach().cpu().clone() for n, p in reference.named_parameters()}
    batches = _batches(steps, global_batch, (16,))
    step = _train_step(model, optimizer, global_batch)

    for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(batches)):
        loss = float(strategy.reduce("SUM", strategy.run(step, args=(x, y)), axis=None))
        xr, yr = (t.to(devices[0]) for t in batches[i])
        ref_loss = _reference_step(reference, ref_optimizer, xr, yr, replicas, global_batch)
        assert loss == pytest.approx(ref_loss, rel=RTOL, abs=ATOL), f"loss at step {i}"
    _assert_matches_reference(strategy, model, reference, f"after {steps} steps")
    for name, p in model.named_parameters():
        now = strategy.experimental_local_results(p)[0].detach().cpu()
        assert not torch.equal(now, start[name]), f"{name!r} never changed"
