"""ModelParallelStrategy in real worker processes joined by gloo on 127.0.0.1.

What these pin: a small transformer laid out on (1, 2) and (2, 2) meshes (attention and
MLP projections column- then row-parallel, the head through DTensor propagation)
trains to one process's losses and weights within 1e-5 with SGD-momentum and Adam,
clipping and an uneven last batch; each worker holds half of a variable split along a
2-wide axis and all of an unmapped one; gradients are exact sums along the batch axis
(with and without FSDP2); ``fully_shard=True`` gives the same numbers with less state;
a checkpoint saved under a (2, 2) mesh restores bitwise in one process, under
MultiWorkerMirroredStrategy, under FullyShardedStrategy and under another mesh and
layout, optimizer state included; misuse is refused on every worker.

Two launches (2 and 4 workers), shared by the tests through module-scoped fixtures.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import distribute as ds
from distribute import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

GLOBAL_BATCH = 8
EXAMPLES = 2 * GLOBAL_BATCH + 5  # an uneven last batch: 5 rows over 2 replicas is 3 + 2
VOCAB, WIDTH, HEADS, SEQ = 16, 8, 2, 4
STEPS = 5  # the third is the uneven last batch

#: Every strategy a worker makes, kept until the worker ends: the first made the process
#: group and the later ones adopted it; collecting the first would destroy it under them.
_KEEP: list[Any] = []


# -- the model and data (used in the workers and in this process) -------------------------------


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.k = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.v = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.o = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            p(x).view(b, t, HEADS, d // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, t, d))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.down(F.gelu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def layout_map(shape: tuple[int, int], *, head: bool = True) -> ds.experimental.LayoutMap:
    mesh = ds.experimental.DeviceMesh(shape, ("batch", "model"))
    layouts = ds.experimental.LayoutMap(mesh)
    layouts[r"blocks\.\d+\.attn\.(q|k|v)\.weight"] = ("model", None)
    layouts[r"blocks\.\d+\.attn\.o\.weight"] = (None, "model")
    layouts[r"blocks\.\d+\.up\.weight"] = ("model", None)
    layouts[r"blocks\.\d+\.up\.bias"] = ("model",)
    layouts[r"blocks\.\d+\.down\.weight"] = (None, "model")
    if head:  # its bias stays whole: DTensor's propagation, not torch's colwise
        layouts[r"head\.weight"] = ("model", None)
    return layouts


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (
        torch.randint(0, VOCAB, (EXAMPLES, SEQ), generator=g),
        torch.randint(0, VOCAB, (EXAMPLES, SEQ), generator=g),
    )


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _per_example(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return (
        F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none")
        .view(len(x), -1)
        .mean(dim=1)
    )


def _reference(optimizer_name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the chief's seed, the same global batches."""
    torch.manual_seed(100)
    model = Net()
    optimizer = _optimizer(optimizer_name, model.parameters())
    x, y = _data()
    losses: list[float] = []
    while len(losses) < STEPS:
        for start in range(0, EXAMPLES, GLOBAL_BATCH):
            xb, yb = x[start : start + GLOBAL_BATCH], y[start : start + GLOBAL_BATCH]
            loss = _per_example(model, xb, yb).sum() / len(xb)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses[:STEPS], {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- functions run in the workers --------------------------------------------------------------


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _whole(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    value = value.full_tensor() if isinstance(value, DTensor) else value
    return value.detach().clone().cpu()


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: _whole(value) for name, value in model.state_dict().items()}


def _train(strategy: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    x, y = _data()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=GLOBAL_BATCH
    )

    def step(xb: torch.Tensor, yb: torch.Tensor, size: int) -> torch.Tensor:
        loss = ds.compute_average_loss(_per_example(model, xb, yb), global_batch_size=size)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    losses: list[float] = []
    while len(losses) < STEPS:
        for i, (xb, yb) in enumerate(strategy.experimental_distribute_dataset(loader)):
            size = min(GLOBAL_BATCH, EXAMPLES - i * GLOBAL_BATCH)
            loss = strategy.run(step, args=(xb, yb, size))
            losses.append(float(strategy.reduce("sum", loss, axis=None)))
    return losses[:STEPS]


def _parity_run(
    shape: tuple[int, int], optimizer_name: str, fully_shard: bool, save_to: str | None = None
) -> dict[str, Any]:
    strategy = ds.experimental.ModelParallelStrategy(layout_map(shape), fully_shard=fully_shard)
    _KEEP.append(strategy)
    torch.manual_seed(100 + _rank())  # the chief's values must win
    with strategy.scope():
        model = Net()
        optimizer = _optimizer(optimizer_name, model.parameters())
    up = model.blocks[0].up.weight
    local = {
        "up": tuple(up.to_local().shape),
        "embed": tuple(model.embed.weight.to_local().shape),
        "types": sorted({type(p).__name__ for p in model.parameters()}),
    }
    losses = _train(strategy, model, optimizer)
    saved = None
    if save_to is not None:
        ds.Checkpoint(model=model, optimizer=optimizer).save(os.path.join(save_to, "ckpt"))
        saved = {"model": _full_state(model), "optimizer": _optimizer_state(optimizer)}
    state_elements = sum(
        t.to_local().numel() for s in optimizer.state.values() for t in s.values() if t.dim()
    )
    return {
        "losses": losses,
        "state": _full_state(model),
        "local": local,
        "param_elements": sum(p.to_local().numel() for p in model.parameters()),
        "state_elements": state_elements,
        "replicas": strategy.num_replicas_in_sync,
        "saved": saved,
    }


def _exact_sums(shape: tuple[int, int], fully_shard: bool) -> list[list[float]]:
    """Replica r's loss makes every gradient element exactly r + 1 (two identity layers,
    column- then row-parallel, on a vector of ones): the sum over B replicas is
    B(B+1)/2, an average (B+1)/2 (pytorch#162338: gloo's AVG summing silently). Then a
    second backward pass adds its sum, and two more (one inside no_sync) add theirs."""
    mesh = ds.experimental.DeviceMesh(shape, ("batch", "model"))
    layouts = ds.experimental.LayoutMap(mesh)
    layouts[r"^0\.weight$"] = ("model", None)
    layouts[r"^1\.weight$"] = (None, "model")
    strategy = ds.experimental.ModelParallelStrategy(layouts, fully_shard=fully_shard)
    _KEEP.append(strategy)
    with strategy.scope():
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 6, bias=False), torch.nn.Linear(6, 6, bias=False)
        )
        for layer in model:
            torch.nn.init.eye_(layer.weight)

    def step() -> None:
        replica = ds.get_replica_context().replica_id_in_sync_group
        (model(torch.ones(1, 6)) * (replica + 1)).sum().backward()

    def grads() -> list[float]:
        return sorted({float(v) for p in model.parameters() for v in _whole(p.grad).reshape(-1)})

    seen = []
    strategy.run(step)
    seen.append(grads())
    strategy.run(step)  # accumulates: the first sum plus the second
    seen.append(grads())
    with strategy.extended.no_sync():
        strategy.run(step)
    strategy.run(step)  # sums both passes
    seen.append(grads())
    return seen


def _rows_seen(shape: tuple[int, int]) -> list[list[int]]:
    """One shuffled epoch of the row numbers 0..19 in batches of 4, each worker seeded
    differently: the rows each worker receives, step by step."""
    strategy = ds.experimental.ModelParallelStrategy(layout_map(shape))
    _KEEP.append(strategy)
    torch.manual_seed(7 + _rank())
    loader = torch.utils.data.DataLoader(torch.arange(20), batch_size=4, shuffle=True)
    return [batch.tolist() for batch in strategy.experimental_distribute_dataset(loader)]


def _reductions() -> dict[str, Any]:
    """reduce, gather and the replica context's collectives over the replicas of a
    (2, 2) mesh: replica r contributes r + 1 rows of r + 1."""
    strategy = ds.experimental.ModelParallelStrategy(layout_map((2, 2)))
    _KEEP.append(strategy)

    def fn() -> tuple[torch.Tensor, ...]:
        context = ds.get_replica_context()
        replica = context.replica_id_in_sync_group
        x = torch.tensor([float(replica + 1)], requires_grad=True)
        total = context.all_reduce("sum", x)
        total.backward()  # the gradient of a sum is the sum of the gradients
        gathered = context.all_gather(torch.full((replica + 1,), float(replica)), 0)
        rows = torch.full((replica + 1, 2), float(replica + 1))
        return rows, total.detach(), x.grad, gathered

    rows, total, grad, gathered = strategy.run(fn)
    return {
        "sum": strategy.reduce("sum", rows, axis=0).tolist(),
        "mean": strategy.reduce("mean", rows, axis=0).tolist(),
        "gather": strategy.gather(rows, axis=0).tolist(),
        "all_reduce": total.tolist(),
        "grad": grad.tolist(),
        "all_gather": gathered.tolist(),
    }


def _two_workers() -> dict[str, Any]:
    out: dict[str, Any] = {"rows": _rows_seen((1, 2))}
    for name in ("sgd", "adam"):
        out[name] = _parity_run((1, 2), name, fully_shard=False)
    out["misuse"] = _misuse()
    return out


def _four_workers(directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": _rows_seen((2, 2)), "reductions": _reductions()}
    out["sgd"] = _parity_run((2, 2), "sgd", fully_shard=False)
    out["adam"] = _parity_run((2, 2), "adam", fully_shard=False, save_to=directory)
    out["fully_shard"] = _parity_run((2, 2), "adam", fully_shard=True)
    out["sums"] = _exact_sums((2, 2), fully_shard=False)
    out["sums_fully_shard"] = _exact_sums((2, 2), fully_shard=True)
    out["checkpoints"] = _checkpoints(directory)
    return out


# -- checkpoints -------------------------------------------------------------------------------


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state, whole, by parameter position."""
    state = optimizer.state_dict()["state"]
    return {
        f"{index}.{key}": _whole(value)
        for index, entries in state.items()
        for key, value in entries.items()
    }


def _restored(strategy: Any, directory: str) -> dict[str, Any]:
    _KEEP.append(strategy)
    torch.manual_seed(200 + _rank())  # other values than the saved ones
    with strategy.scope():
        model = Net()
        optimizer = _optimizer("adam", model.parameters())
    ds.Checkpoint(model=model, optimizer=optimizer).restore(os.path.join(directory, "ckpt-1"))
    return {"model": _full_state(model), "optimizer": _optimizer_state(optimizer)}


def _checkpoints(directory: str) -> dict[str, Any]:
    """The (2, 2) mesh's Adam run saved its model and optimizer: restored under a (1, 4)
    mesh with another layout, under MultiWorkerMirroredStrategy and under
    FullyShardedStrategy."""
    other = layout_map((1, 4), head=False)
    other[r"embed\.weight"] = (None, "model")
    return {
        "mesh_1x4": _restored(ds.experimental.ModelParallelStrategy(other), directory),
        "mirrored": _restored(ds.MultiWorkerMirroredStrategy(), directory),
        "sharded": _restored(ds.experimental.FullyShardedStrategy(), directory),
    }


# -- misuse ------------------------------------------------------------------------------------


def _misuse() -> dict[str, str]:
    """Each mistake in turn, on both workers (every check raises on every worker at the
    same point, so they stay in step)."""
    seen: dict[str, str] = {}

    def expect(name: str, error: type[BaseException], fn: Any) -> None:
        try:
            fn()
        except error as exc:
            seen[name] = f"{type(exc).__name__}: {exc}"
        else:
            seen[name] = "<nothing raised>"

    expect(
        "mesh_size",
        ds.errors.InvalidArgumentError,
        lambda: ds.experimental.ModelParallelStrategy(layout_map((2, 2))),
    )
    devices = ds.experimental.DeviceMesh((2, 2), ("batch", "model"), devices=["cpu"] * 4)
    expect(
        "local_replicas",
        ds.errors.InvalidArgumentError,
        lambda: ds.experimental.ModelParallelStrategy(ds.experimental.LayoutMap(devices)),
    )

    def build(layouts: ds.experimental.LayoutMap) -> None:
        strategy = ds.experimental.ModelParallelStrategy(layouts)
        _KEEP.append(strategy)
        with strategy.scope():
            Net()

    wrong_rank = layout_map((1, 2))
    wrong_rank[r"embed\.weight"] = ("model",)
    expect("wrong_rank", ValueError, lambda: build(wrong_rank))
    two_keys = layout_map((1, 2))
    two_keys[r"blocks\.0\.up\..*"] = (None, "model")
    expect("two_keys", ValueError, lambda: build(two_keys))
    expect("unknown_axis", ValueError, lambda: layout_map((1, 2)).__setitem__("x", ("modle",)))

    # A model built outside the scope, trained where 2 replicas are in sync.
    strategy = ds.experimental.ModelParallelStrategy(layout_map((2, 1)))
    _KEEP.append(strategy)
    outside = Net()
    optimizer = torch.optim.SGD(outside.parameters(), lr=0.1)
    x, y = _data()

    def step() -> None:
        _per_example(outside, x[:2], y[:2]).sum().backward()
        optimizer.step()

    expect("outside_scope", ValueError, lambda: strategy.run(step))

    with strategy.scope():
        model = Net()
        inside = torch.optim.SGD(model.parameters(), lr=0.1)

    def accumulate_then_step() -> None:
        with strategy.extended.no_sync():
            _per_example(model, x[:2], y[:2]).sum().backward()
        inside.step()

    expect("step_after_no_sync", RuntimeError, lambda: strategy.run(accumulate_then_step))
    expect("variable", ValueError, lambda: _variable_in_scope(strategy))
    return seen


def _variable_in_scope(strategy: Any) -> None:
    with strategy.scope():
        ds.Variable(torch.zeros(3))


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_workers() -> list[dict[str, Any]]:
    """One launch of 2 workers: a (1, 2) mesh, then the misuse."""
    return launch.run(_two_workers, 2, timeout=200)


@pytest.fixture(scope="module")
def four_workers(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], str]:
    """One launch of 4 workers: a (2, 2) mesh with and without FSDP, the exact sums and
    the checkpoint matrix."""
    directory = str(tmp_path_factory.mktemp("model_parallel"))
    return launch.run(_four_workers, 4, args=(directory,), timeout=220), directory


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    return {name: _reference(name) for name in ("sgd", "adam")}


def _assert_matches(result: dict[str, Any], reference: tuple[list[float], Any]) -> None:
    losses, state = reference
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(losses), rtol=0, atol=1e-5
    )
    for name, value in state.items():
        torch.testing.assert_close(result["state"][name], value, rtol=0, atol=1e-5, msg=name)


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_1x2_mesh_trains_to_one_process_s_numbers(
    two_workers: list[dict[str, Any]], references: dict[str, Any], optimizer: str
) -> None:
    for worker in two_workers:
        _assert_matches(worker[optimizer], references[optimizer])
        assert worker[optimizer]["replicas"] == 1


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_2x2_mesh_trains_to_one_process_s_numbers(
    four_workers: tuple[list[dict[str, Any]], str], references: dict[str, Any], optimizer: str
) -> None:
    for worker in four_workers[0]:
        _assert_matches(worker[optimizer], references[optimizer])
        assert worker[optimizer]["replicas"] == 2


def test_each_worker_holds_half_of_a_split_variable_and_all_of_an_unmapped_one(
    two_workers: list[dict[str, Any]], four_workers: tuple[list[dict[str, Any]], str]
) -> None:
    for worker in [*two_workers, *four_workers[0]]:
        local = worker["adam"]["local"]
        assert local["up"] == (2 * WIDTH, WIDTH), local  # (4 * WIDTH, WIDTH) split in two
        assert local["embed"] == (VOCAB, WIDTH), local
        assert local["types"] == ["DTensor"], local


def test_the_workers_of_a_replica_get_the_same_shuffled_rows_and_replicas_split_them(
    two_workers: list[dict[str, Any]], four_workers: tuple[list[dict[str, Any]], str]
) -> None:
    def flat(steps: list[list[int]]) -> list[int]:
        return sorted(row for step in steps for row in step)

    first, second = (worker["rows"] for worker in two_workers)
    assert first == second, "a (1, 2) mesh: both workers are one replica"
    assert flat(first) == list(range(20)), first
    assert first != [[4 * i + j for j in range(4)] for i in range(5)], "shuffled"
    rows = [worker["rows"] for worker in four_workers[0]]  # ranks (0, 0) (0, 1) (1, 0) (1, 1)
    assert rows[0] == rows[1] and rows[2] == rows[3], "a replica's workers: the same rows"
    assert flat(rows[0] + rows[2]) == list(range(20)), "the replicas split every batch"


def test_reduce_gather_and_the_replica_context_combine_the_replicas(
    four_workers: tuple[list[dict[str, Any]], str],
) -> None:
    for worker in four_workers[0]:
        out = worker["reductions"]
        assert out["sum"] == [5.0, 5.0] and out["mean"] == pytest.approx([5 / 3, 5 / 3])
        assert out["gather"] == [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]
        assert out["all_reduce"] == [3.0] and out["grad"] == [2.0]
        assert out["all_gather"] == [0.0, 1.0, 1.0]


def test_gradients_are_exact_sums_along_the_batch_axis_and_accumulate(
    four_workers: tuple[list[dict[str, Any]], str],
) -> None:
    for worker in four_workers[0]:
        assert worker["sums"] == [[3.0], [6.0], [12.0]], worker["sums"]
        assert worker["sums_fully_shard"] == [[3.0], [6.0], [12.0]], worker["sums_fully_shard"]


def test_fully_shard_gives_the_same_numbers_with_less_state_per_worker(
    four_workers: tuple[list[dict[str, Any]], str], references: dict[str, Any]
) -> None:
    for worker in four_workers[0]:
        sharded, plain = worker["fully_shard"], worker["adam"]
        _assert_matches(sharded, references["adam"])
        assert sharded["param_elements"] <= plain["param_elements"] * 0.6, (sharded, plain)
        assert sharded["state_elements"] <= plain["state_elements"] * 0.6, (sharded, plain)


def test_a_checkpoint_of_a_2x2_mesh_restores_bitwise_everywhere(
    four_workers: tuple[list[dict[str, Any]], str],
) -> None:
    workers, directory = four_workers
    saved = workers[0]["adam"]["saved"]
    for worker in workers:
        checkpoints = worker["checkpoints"]
        for name in ("mesh_1x4", "mirrored", "sharded"):
            for kind in ("model", "optimizer"):
                restored = checkpoints[name][kind]
                assert restored.keys() == saved[kind].keys(), (name, kind)
                for key, value in saved[kind].items():
                    assert torch.equal(restored[key], value), (name, kind, key)
    # In one process, without any strategy.
    torch.manual_seed(300)
    model = Net()
    optimizer = _optimizer("adam", model.parameters())
    ds.Checkpoint(model=model, optimizer=optimizer).restore(os.path.join(directory, "ckpt-1"))
    for key, value in saved["model"].items():
        assert torch.equal(model.state_dict()[key], value), key
    for key, value in _optimizer_state(optimizer).items():
        assert torch.equal(value, saved["optimizer"][key]), key


def test_misuse_is_refused_on_every_worker_saying_how_to_fix_it(
    two_workers: list[dict[str, Any]],
) -> None:
    for worker in two_workers:
        seen = worker["misuse"]
        assert "holds 4 devices but the cluster has 2 worker" in seen["mesh_size"], seen
        assert "not several local replicas per worker" in seen["local_replicas"], seen
        assert "'embed.weight'" in seen["wrong_rank"] and "('model',)" in seen["wrong_rank"]
        assert "'blocks.0.up.weight'" in seen["two_keys"], seen
        assert "several LayoutMap keys" in seen["two_keys"], seen
        assert "'modle'" in seen["unknown_axis"] and "('modle',)" in seen["unknown_axis"]
        assert "plain parameters" in seen["outside_scope"], seen
        assert "outside no_sync()" in seen["step_after_no_sync"], seen
        assert "register it on a module" in seen["variable"], seen
        for message in seen.values():
            assert message.split(":")[0] in {
                "InvalidArgumentError",
                "ContextError",
            }, message
