"""Placement on CUDA (issue #22), what the CPU's simulated devices cannot show: where
initial values are drawn, meta-device builds, casts and moves after the scope, plain
host tensors passed to `run`. One GPU is enough for all but the two-GPU case.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import distribute as ds
from distribute.errors import InvalidArgumentError

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

STRATEGIES: dict[str, Callable[[], ds.Strategy]] = {
    "one_device": lambda: ds.OneDeviceStrategy("cuda:0"),
    "mirrored_1": lambda: ds.MirroredStrategy(["cuda:0"]),
    "central_storage": lambda: ds.CentralStorageStrategy(["cuda:0"], parameter_device="cuda:0"),
    "mirrored_2": lambda: ds.MirroredStrategy(["cuda:0", "cuda:1"]),
}


def _strategy(name: str) -> ds.Strategy:
    if name == "mirrored_2" and GPUS < 2:
        pytest.skip(f"needs 2 GPUs, found {GPUS}")
    return STRATEGIES[name]()


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)
    )


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_same_seed_gives_the_cpu_s_initial_weights_on_cuda(name: str) -> None:
    # A parameter placed on the GPU when registered drew from the CUDA generator.
    torch.manual_seed(1)
    expected = _net().state_dict()
    strategy = _strategy(name)
    torch.manual_seed(1)
    with strategy.scope():
        model = _net()
    for key, value in model.state_dict().items():
        assert value.device.type == "cuda"
        assert torch.equal(value.cpu(), expected[key]), key


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_meta_device_build_is_materialized_on_the_gpus_and_trains(name: str) -> None:
    torch.manual_seed(2)
    reference = _net()
    strategy = _strategy(name)
    with strategy.scope():
        with torch.device("meta"):
            model = _net()
        model.to_empty(device="cpu")
        model.load_state_dict(reference.state_dict())
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    expected_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    x = torch.randn(8, 6)
    n = strategy.num_replicas_in_sync

    def step(xb: torch.Tensor) -> None:
        ds.compute_average_loss(model(xb).pow(2).sum(1), global_batch_size=8).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        args = ds.PerReplica([x[i * 8 // n : (i + 1) * 8 // n] for i in range(n)]) if n > 1 else x
        strategy.run(step, args=(args,))  # host tensors: placed on each replica's GPU
        (reference(x).pow(2).sum(1).sum() / 8).backward()
        expected_optimizer.step()
        expected_optimizer.zero_grad()
    for (key, value), want in zip(model.state_dict().items(), reference.state_dict().values()):
        assert value.device.type == "cuda"
        torch.testing.assert_close(value.cpu(), want, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_cast_after_the_scope_reaches_every_gpu_copy_and_a_move_off_is_refused(
    name: str,
) -> None:
    strategy = _strategy(name)
    with strategy.scope():
        model = _net()
    model.to(torch.bfloat16)
    for p in model.parameters():
        assert {(t.device.type, t.dtype) for t in p.values} == {("cuda", torch.bfloat16)}
    model.to("cuda:0")  # replica 0's own device: nothing moves
    with pytest.raises(InvalidArgumentError, match="replica devices"):
        model.to("cpu")
    out = strategy.run(lambda x: model(x), args=(torch.ones(2, 6, dtype=torch.bfloat16),))
    for result in strategy.experimental_local_results(out):
        assert result.device.type == "cuda" and result.dtype == torch.bfloat16


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_tensor_dataset_on_the_gpu_is_read_example_by_example(shuffle: bool) -> None:
    """NOTE [batched tensor datasets]: a TensorDataset whose tensors live on the GPU
    is not gathered with a host index (a copy to the device, a sync a batch): the
    loader's own batches, example by example, the same values."""
    x = torch.arange(40.0, device="cuda:0").reshape(20, 2)
    y = torch.arange(20, device="cuda:0")

    def loader() -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
        torch.manual_seed(0)
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=shuffle
        )

    expected = list(loader())
    strategy = ds.OneDeviceStrategy("cuda:0")
    torch.manual_seed(0)
    got = list(strategy.experimental_distribute_dataset(loader()))
    assert len(got) == len(expected)
    for batch, want in zip(got, expected):
        for tensor, wanted in zip(batch, want):
            assert torch.equal(tensor.cpu(), wanted.cpu())
