"""ModelParallelStrategy on CUDA: one NCCL worker on a (1, 1) mesh, and two gloo
workers sharing one GPU on a (1, 2) mesh, each against plain PyTorch on one GPU.

Skipped without CUDA. One GPU is enough for both: the second case names the GPU twice
in the mesh's devices (two processes on ``cuda:0``) and asks for gloo (RING), whose
collectives take CUDA tensors; what it shows is the CUDA placement of the laid-out
variables, of the batches and of the gradient sums, not NCCL between two GPUs (which
needs two). The layout keeps the model's output replicated (no all-gather over gloo
with CUDA tensors: torch 2.11's died in ``wait_tensor``, tests/gpu/README). TF32 is
off throughout. Never run on a GPU yet (written without one).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import distribute as ds
from distribute import launch

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ATOL, RTOL = 1e-5, 1e-4
GLOBAL_BATCH, WIDTH, HEADS, SEQ, VOCAB = 8, 16, 2, 6, 12
STEPS = 6


class Block(torch.nn.Module):
    """Attention and an MLP, their projections column- then row-parallel."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.q = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.k = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.v = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.o = torch.nn.Linear(WIDTH, WIDTH)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, t, d = x.shape
        q, k, v = (
            p(x).view(b, t, HEADS, d // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        x = x + self.down(F.gelu(self.up(x)))
        return self.head(x)


def _layout_map(shape: tuple[int, int], devices: list[str] | None) -> ds.experimental.LayoutMap:
    mesh = ds.experimental.DeviceMesh(shape, ("batch", "model"), devices=devices)
    layouts = ds.experimental.LayoutMap(mesh)
    layouts[r"(q|k|v)\.weight"] = ("model", None)
    layouts[r"o\.weight"] = (None, "model")
    layouts[r"up\.weight"] = ("model", None)
    layouts[r"up\.bias"] = ("model",)
    layouts[r"down\.weight"] = (None, "model")
    return layouts


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _loss(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    per_example = (
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), reduction="none")
        .view(len(x), -1)
        .mean(dim=1)
    )
    return ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)


def _one_gpu(device: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on one GPU, whole global batches: the reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = Block().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _batches():
        loss = _loss(model, x.to(device), y.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _mesh_worker(
    shape: tuple[int, int], devices: list[str] | None, implementation: str
) -> dict[str, Any]:
    """The same training under ModelParallelStrategy (in a worker process)."""
    from torch.distributed.tensor import DTensor

    torch.backends.cuda.matmul.allow_tf32 = False
    options = ds.experimental.CommunicationOptions(implementation=implementation)  # type: ignore[arg-type]
    strategy = ds.experimental.ModelParallelStrategy(
        _layout_map(shape, devices), communication_options=options
    )
    torch.manual_seed(0)
    with strategy.scope():
        model = Block()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = _loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    losses = []
    for x, y in _batches():
        loss = strategy.run(step, args=(x, y))
        losses.append(float(strategy.reduce("SUM", loss, axis=None)))
    state = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
        for k, v in model.state_dict().items()
    }
    devices_seen = sorted({str(p.to_local().device) for p in model.parameters()})
    up = tuple(model.up.weight.to_local().shape)
    strategy.shutdown()
    return {"losses": losses, "state": state, "devices": devices_seen, "up": up}


def _assert_close(got: dict[str, Any], losses: list[float], state: dict[str, torch.Tensor]) -> None:
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(losses), atol=ATOL, rtol=RTOL
    )
    for name, value in state.items():
        torch.testing.assert_close(got["state"][name], value, atol=ATOL, rtol=RTOL, msg=name)


@pytest.fixture(autouse=True)
def no_tf32() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def test_one_nccl_worker_on_a_1x1_mesh_matches_one_gpu() -> None:
    losses, state = _one_gpu("cuda:0")
    (got,) = launch.run(_mesh_worker, 1, args=((1, 1), None, "NCCL"), timeout=240)
    _assert_close(got, losses, state)
    assert got["devices"] == ["cuda:0"], got["devices"]


def test_two_gloo_workers_sharing_one_gpu_on_a_1x2_mesh_match_one_gpu() -> None:
    losses, state = _one_gpu("cuda:0")
    workers = launch.run(_mesh_worker, 2, args=((1, 2), ["cuda:0", "cuda:0"], "RING"), timeout=240)
    for got in workers:
        _assert_close(got, losses, state)
        assert got["devices"] == ["cuda:0"], got["devices"]
        assert got["up"] == (2 * WIDTH, WIDTH), got["up"]  # half of (4 * WIDTH, WIDTH)
