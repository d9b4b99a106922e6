"""FullyShardedStrategy (FSDP2) in real worker processes joined by gloo on 127.0.0.1.

What these pin: training gives one process's numbers (and MultiWorkerMirrored's where
BatchNorm's per-replica statistics are involved) with an uneven last batch, tied
weights, accumulation under no_sync and clipping of the summed gradient, in both
sharding modes and under HSDP; gradients are exact sums on every path; every worker
holds only its shards; a killed worker, a skipped backward and a forward on the
chief alone are named on every survivor within the timeout; misuse is refused.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

import distribute as ds
from distribute import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

GLOBAL_BATCH = 16
EXAMPLES = 3 * GLOBAL_BATCH + 10  # an uneven last batch
VOCAB = 20


# -- models and data (used in the workers and in this process) ---------------------------


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class TiedNet(torch.nn.Module):
    """Repeated blocks, and an output layer tied to the embedding."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.blocks = torch.nn.ModuleList([Block(16) for _ in range(3)])
        self.norm = torch.nn.BatchNorm1d(16) if batchnorm else torch.nn.Identity()
        self.head = torch.nn.Linear(16, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).mean(dim=1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TwoDtypes(torch.nn.Module):
    """One unit (the root) holding float32 and float64 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 1).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (EXAMPLES, 4), generator=g), torch.randint(
        0, VOCAB, (EXAMPLES,), generator=g
    )


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole, by name (a collective for DTensors)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, value in model.state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        out[name] = value.detach().clone().cpu()
    return out


def _train_loop(
    strategy: ds.Strategy,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    accumulate: bool,
    clip: bool,
) -> list[float]:
    x, y = _data()
    micro = GLOBAL_BATCH // 2 if accumulate else GLOBAL_BATCH
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=micro)
    dist = strategy.experimental_distribute_dataset(loader)
    losses: list[float] = []

    def forward_backward(xb: torch.Tensor, yb: torch.Tensor, size: int) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=size)
        loss.backward()
        return loss.detach()

    def apply() -> None:
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()

    while len(losses) < steps:
        batches = list(dist)
        sizes = [GLOBAL_BATCH] * (len(batches) // 2 if accumulate else len(batches))
        if accumulate:  # each global batch is two micro-batches; the last is uneven
            sizes = [min(GLOBAL_BATCH, EXAMPLES - i * GLOBAL_BATCH) for i in range(len(sizes))]
            for i, size in enumerate(sizes):
                first, second = batches[2 * i], batches[2 * i + 1]
                with strategy.extended.no_sync():
                    first_loss = strategy.run(forward_backward, args=(*first, size))
                second_loss = strategy.run(forward_backward, args=(*second, size))
                strategy.run(apply)
                losses.append(
                    float(strategy.reduce("sum", first_loss, axis=None))
                    + float(strategy.reduce("sum", second_loss, axis=None))
                )
        else:
            sizes = [min(GLOBAL_BATCH, EXAMPLES - i * GLOBAL_BATCH) for i in range(len(batches))]
            for (xb, yb), size in zip(batches, sizes):
                loss = strategy.run(forward_backward, args=(xb, yb, size))
                strategy.run(apply)
                losses.append(float(strategy.reduce("sum", loss, axis=None)))
    return losses[:steps]


def _reference(
    optimizer_name: str, *, steps: int, accumulate: bool, clip: bool
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the chief's seed, the same global batches."""
    torch.manual_seed(100)
    model = TiedNet()
    optimizer = _optimizer(optimizer_name, model.parameters())
    x, y = _data()
    losses: list[float] = []
    while len(losses) < steps:
        for start in range(0, EXAMPLES, GLOBAL_BATCH):
            xb, yb = x[start : start + GLOBAL_BATCH], y[start : start + GLOBAL_BATCH]
            per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
            loss = per_example.sum() / len(xb)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses[:steps], {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- functions run in the workers ------------------------------------------------------------


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _parity(modes: list[bool], mesh_shape: tuple[int, int] | None) -> dict[str, Any]:
    """Trains each config under a FullyShardedStrategy per sharding mode (seeds differing
    per worker), then checks the exactness of the gradient sum."""
    results: dict[str, Any] = {}
    configs = HSDP_CONFIGS if mesh_shape is not None else CONFIGS
    for reshard in modes:
        strategy = ds.experimental.FullyShardedStrategy(
            mesh_shape=mesh_shape, reshard_after_forward=reshard
        )
        runs = []
        for config in configs:
            torch.manual_seed(100 + _rank())  # the chief's values must win
            with strategy.scope():
                model = TiedNet()
                optimizer = _optimizer(config["optimizer"], model.parameters())
            locals_ = sum(p.to_local().numel() for p in model.parameters())
            total = sum(p.numel() for p in model.parameters())
            losses = _train_loop(
                strategy,
                model,
                optimizer,
                steps=20,
                accumulate=config.get("accumulate", False),
                clip=config.get("clip", False),
            )
            runs.append(
                {
                    "losses": losses,
                    "state": _full_state(model),
                    "local": locals_,
                    "total": total,
                    "tied": model.head.weight is model.embed.weight,
                    "types": sorted({type(p).__name__ for p in model.parameters()}),
                }
            )
        results["zero3" if reshard else "zero2"] = runs
        results["sums"] = _exact_sums(strategy)
    return results


def _batchnorm(strategy: Any) -> dict[str, Any]:
    """The BatchNorm model under ``strategy``."""
    torch.manual_seed(100 + _rank())
    with strategy.scope():
        model = TiedNet(batchnorm=True)
        optimizer = _optimizer("adam", model.parameters())
    losses = _train_loop(strategy, model, optimizer, steps=20, accumulate=False, clip=False)
    return {"losses": losses, "state": _full_state(model)}


def _exact_sums(strategy: Any) -> list[float]:
    """Worker r's loss makes every gradient element exactly r + 1 (two identity layers
    on a vector of ones): the sum over W workers is W(W+1)/2, an average (W+1)/2."""
    with strategy.scope():
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 6, bias=False), torch.nn.Linear(6, 6, bias=False)
        )
        for layer in model:
            torch.nn.init.eye_(layer.weight)
    rank = _rank()

    def step() -> None:
        (model(torch.ones(1, 6)) * (rank + 1)).sum().backward()

    strategy.run(step)
    return sorted({float(v) for p in model.parameters() for v in p.grad.full_tensor().reshape(-1)})


# -- parity -----------------------------------------------------------------------------------


CONFIGS = [
    {"optimizer": "sgd"},
    {"optimizer": "adam"},
    {"optimizer": "adam", "accumulate": True, "clip": True},
]
HSDP_CONFIGS = [{"optimizer": "adam", "accumulate": True, "clip": True}]


def _assert_matches_reference(result: dict[str, Any], config: dict[str, Any]) -> None:
    losses, state = _reference(
        config["optimizer"],
        steps=20,
        accumulate=config.get("accumulate", False),
        clip=config.get("clip", False),
    )
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(losses), rtol=0, atol=1e-5
    )
    for name, value in state.items():
        torch.testing.assert_close(result["state"][name], value, rtol=0, atol=1e-5, msg=name)
    assert result["tied"], "the output layer stays tied to the embedding"
    assert result["types"] == ["DTensor"]


@pytest.fixture(scope="module")
def two_workers() -> list[dict[str, Any]]:
    """One launch of 2 workers: both sharding modes, then the exact sums."""
    return launch.run(_parity, 2, args=([True, False], None), timeout=200)


@pytest.fixture(scope="module")
def hsdp_workers() -> list[dict[str, Any]]:
    """One launch of 4 workers on a (2, 2) mesh."""
    return launch.run(_parity, 4, args=([True], (2, 2)), timeout=200)


@pytest.mark.parametrize("mode", ["zero3", "zero2"])
def test_training_matches_one_process_in_both_sharding_modes(
    two_workers: list[dict[str, Any]], mode: str
) -> None:
    for worker in two_workers:
        for result, config in zip(worker[mode], CONFIGS):
            _assert_matches_reference(result, config)
            # Each worker holds about half of every parameter.
            assert result["local"] <= result["total"] // 2 + 16, result


def test_hsdp_on_a_2x2_mesh_matches_one_process(hsdp_workers: list[dict[str, Any]]) -> None:
    for worker in hsdp_workers:
        _assert_matches_reference(worker["zero3"][0], HSDP_CONFIGS[0])
        assert worker["zero3"][0]["local"] <= worker["zero3"][0]["total"] // 2 + 16


def test_gradients_are_exact_sums_over_the_workers(
    two_workers: list[dict[str, Any]], hsdp_workers: list[dict[str, Any]]
) -> None:
    # gloo's AVG reduce-scatter was reported to sum (pytorch#162338); FSDP averages by
    # default: the strategy must give the library's sum, exactly, on every path.
    for workers, count in ((two_workers, 2), (hsdp_workers, 4)):
        for worker in workers:
            assert worker["sums"] == [float(count * (count + 1) // 2)], worker["sums"]


def test_batchnorm_training_matches_multi_worker_mirrored(
    against_mirrored: list[dict[str, Any]],
) -> None:
    # Per-replica batch statistics, averaged buffers: MultiWorkerMirrored's numbers.
    for out in against_mirrored:
        a, b = out["bn_sharded"], out["bn_mirrored"]
        torch.testing.assert_close(
            torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=0, atol=1e-5
        )
        for name, value in b["state"].items():
            torch.testing.assert_close(a["state"][name], value, rtol=0, atol=1e-5, msg=name)
    first, second = (out["bn_sharded"]["state"] for out in against_mirrored)
    assert torch.equal(first["norm.running_mean"], second["norm.running_mean"])


# -- failures are named, never a silent hang -------------------------------------------------


def _failing_worker(scenario: str, timeout: float) -> dict[str, Any]:
    """Two workers train; worker 1 dies, skips a backward, or the chief runs a forward
    alone. The survivors report what they raised and how long it took."""
    strategy = ds.experimental.FullyShardedStrategy(
        communication_options=ds.experimental.CommunicationOptions(timeout_seconds=timeout)
    )
    rank = _rank()
    with strategy.scope():
        model = TiedNet()
        optimizer = _optimizer("sgd", model.parameters())
    x, y = _data()

    def step(skip_backward: bool) -> None:
        loss = torch.nn.functional.cross_entropy(model(x[:8]), y[:8])
        if not skip_backward:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    strategy.run(step, args=(False,))  # one good step
    start = time.monotonic()
    try:
        if scenario == "killed":
            if rank == 1:
                os._exit(0)
            strategy.run(step, args=(False,))
        elif scenario == "skipped_backward":
            strategy.run(step, args=(rank == 1,))
            strategy.run(step, args=(False,))
        elif scenario == "chief_forward":
            if rank == 0:
                model(x[:8])  # outside run, on the chief alone
            else:
                time.sleep(timeout + 1.5)  # alive, in no collective, past the deadline
                return {"error": None, "message": "", "seconds": 0.0}
    except ds.errors.DistributeError as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    return {"error": None, "message": "", "seconds": time.monotonic() - start}


@pytest.mark.parametrize("scenario", ["killed", "skipped_backward", "chief_forward"])
def test_a_failing_worker_is_named_on_the_survivors_within_the_timeout(scenario: str) -> None:
    timeout = 4.0
    results = launch.run(
        _failing_worker, 2, args=(scenario, timeout), timeout=120, allow_missing=True
    )
    survivors = [r for r in results if r is not None and r["error"] is not None]
    assert survivors, results
    for out in survivors:
        assert out["error"] in {"CollectiveTimeoutError", "CollectiveMismatchError"}, out
        assert out["seconds"] < timeout + 5, out
        message = out["message"]
        if scenario == "chief_forward":
            assert "forward of a FullyShardedStrategy model outside `run`" in message, message
            assert "rank 1" in message, message
        else:
            assert "FSDP" in message, message  # the operation: an FSDP all-gather/reduce-scatter
            other = 1 - results.index(out)
            assert f"rank {other}" in message, message
    if scenario == "killed":
        assert "dead" in survivors[0]["message"], survivors[0]["message"]


# -- misuse is refused, saying how to fix it ------------------------------------------------


def _misuse() -> dict[str, str]:
    """Each mistake in turn, on both workers (they stay in step: every check raises on
    every worker at the same point)."""
    seen: dict[str, str] = {}

    def expect(name: str, error: type[BaseException], fn: Any) -> None:
        try:
            fn()
        except error as exc:
            seen[name] = str(exc)
        else:
            seen[name] = "<nothing raised>"

    expect(
        "two_devices",
        ValueError,
        lambda: ds.experimental.FullyShardedStrategy(devices=["cpu:0", "cpu:1"]),
    )
    expect(
        "mesh_shape", ValueError, lambda: ds.experimental.FullyShardedStrategy(mesh_shape=(3, 1))
    )
    strategy = ds.experimental.FullyShardedStrategy()
    x = torch.randn(4, 6)

    def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        def step() -> None:
            model(x).sum().backward()
            optimizer.step()

        strategy.run(step)

    outside = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 1))
    expect(
        "built_outside_scope",
        ValueError,
        lambda: train(outside, torch.optim.SGD(outside.parameters(), lr=0.1)),
    )

    def mixed_dtypes() -> None:
        with strategy.scope():
            TwoDtypes()  # both layers in the root's unit

    expect("mixed_dtypes", ValueError, mixed_dtypes)

    def stepped_before_sharding() -> None:
        with strategy.scope():
            model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 1))
            optimizer = torch.optim.Adam(model.parameters())
            model(x).sum().backward()
            optimizer.step()  # state for the parameters about to be replaced

    expect("optimizer_with_state", ValueError, stepped_before_sharding)

    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 1))
        originals = list(model.parameters())
    expect("stale_parameters", ValueError, lambda: train(model, torch.optim.SGD(originals, lr=0.1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_inside_no_sync() -> None:
        with strategy.extended.no_sync():
            train(model, optimizer)

    expect("step_in_no_sync", RuntimeError, step_inside_no_sync)
    with strategy.scope():  # a container without a forward: its elements are the roots
        layers = torch.nn.ModuleList([torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)])
    seen["module_list"] = str(sorted({type(p).__name__ for p in layers.parameters()}))
    strategy.shutdown()
    return seen


def test_misuse_is_refused_with_the_fix_on_every_worker() -> None:
    for seen in launch.run(_misuse, 2, timeout=150):
        assert "one replica per worker process" in seen["two_devices"], seen
        assert "replicate(3) * shard(1) = 3 != the 2 workers" in seen["mesh_shape"], seen
        assert "plain parameters" in seen["built_outside_scope"], seen
        assert "several dtypes" in seen["mixed_dtypes"], seen
        assert "torch.float64" in seen["mixed_dtypes"], seen
        assert "already holds state" in seen["optimizer_with_state"], seen
        assert "replaced by its shards" in seen["stale_parameters"], seen
        assert "inside strategy.extended.no_sync()" in seen["step_in_no_sync"], seen
        assert seen["module_list"] == "['DTensor']", seen


# -- deferred initialization ------------------------------------------------------------------


class Wide(torch.nn.Module):
    """Eight wide blocks; records how many real parameter elements exist after each."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList()
        self.real_after_each: list[int] = []
        for _ in range(8):
            self.blocks.append(torch.nn.Linear(64, 64))
            self.real_after_each.append(
                sum(p.numel() for p in self.blocks.parameters() if not p.is_meta)
            )
        self.norm = torch.nn.BatchNorm1d(64)


class LateInit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.apply(lambda m: torch.nn.init.zeros_(m.weight) if hasattr(m, "weight") else None)


def _deferred() -> dict[str, Any]:
    strategy = ds.experimental.FullyShardedStrategy(deferred_init=True)
    torch.manual_seed(100 + _rank())  # the chief's draws win
    with strategy.scope():
        tied = TiedNet(batchnorm=True)
        wide = Wide()
    after = torch.randn(3)  # each worker's own generator again
    out = {
        "tied": _full_state(tied),
        "wide": _full_state(wide),
        "real_after_each": wide.real_after_each,
        "tie_kept": tied.head.weight is tied.embed.weight,
        "after": after,
    }
    try:
        with strategy.scope():
            LateInit()
        out["late"] = "<nothing raised>"
    except ds.errors.DistributeError as exc:
        out["late"] = f"{type(exc).__name__}: {exc}"
    strategy.shutdown()
    return out


def test_deferred_init_gives_the_chief_s_values_without_a_whole_copy() -> None:
    results = launch.run(_deferred, 2, timeout=150)
    torch.manual_seed(100)
    tied, wide = TiedNet(batchnorm=True), Wide()
    for rank, out in enumerate(results):
        for name, value in tied.state_dict().items():
            assert torch.equal(out["tied"][name], value), name
        for name, value in wide.state_dict().items():
            assert torch.equal(out["wide"][name], value), name
        assert out["tie_kept"]
        # At most this worker's shards of the finished blocks and the block being built.
        block = 64 * 64 + 64
        for built, real in enumerate(out["real_after_each"], start=1):
            assert real <= (built - 1) * block // 2 + block + 64, out["real_after_each"]
        torch.manual_seed(100 + rank)
        if rank == 0:  # the chief's generator advanced as building alone advances it
            TiedNet(batchnorm=True), Wide()
        assert torch.equal(out["after"], torch.randn(3)), "each worker's own generator"
        assert "LateInitError" in out["late"] and "deferred_init=False" in out["late"], out["late"]


# -- frozen parameters, autocast with ds.GradScaler, torch.compile ------------------------------


def _short_run(
    strategy: Any,
    model: torch.nn.Module,
    *,
    autocast: bool = False,
    scaler: bool = False,
    steps: int = 4,
) -> dict[str, torch.Tensor]:
    with strategy.scope():
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
        grad_scaler = ds.GradScaler("cpu") if scaler else None
    x, y = _data()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x[:48], y[:48]), batch_size=GLOBAL_BATCH
    )

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(xb)
        per_example = torch.nn.functional.cross_entropy(logits.float(), yb, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        if grad_scaler is None:
            loss.backward()
            optimizer.step()
        else:
            grad_scaler.scale(loss).backward()
            grad_scaler.step(optimizer)
            grad_scaler.update()
        optimizer.zero_grad()

    done = 0
    while done < steps:
        for batch in strategy.experimental_distribute_dataset(loader):
            strategy.run(step, args=batch)
            done += 1
    return _full_state(model)


def _semantics() -> dict[str, Any]:
    mirrored = ds.MultiWorkerMirroredStrategy()
    sharded = ds.experimental.FullyShardedStrategy()
    out: dict[str, Any] = {}
    for name, strategy in (("mirrored", mirrored), ("sharded", sharded)):
        out[f"bn_{name}"] = _batchnorm(strategy)
        torch.manual_seed(100 + _rank())
        with strategy.scope():
            frozen = TiedNet()
            frozen.blocks[0].requires_grad_(False)
        out[f"frozen_{name}"] = _short_run(strategy, frozen)
        torch.manual_seed(100 + _rank())
        with strategy.scope():
            mixed = TiedNet()
        out[f"autocast_{name}"] = _short_run(strategy, mixed, autocast=True, scaler=True)
    torch.manual_seed(100 + _rank())
    with sharded.scope():
        plain = TiedNet()
    torch.manual_seed(100 + _rank())
    with sharded.scope():
        compiled = TiedNet()
    out["eager"] = _short_run(sharded, plain)
    state = _short_run(sharded, torch.compile(compiled, backend="aot_eager"))
    out["compiled"] = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    out["frozen_types"] = sorted({type(p).__name__ for p in frozen.parameters()})
    sharded.shutdown()
    mirrored.shutdown()
    return out


@pytest.fixture(scope="module")
def against_mirrored() -> list[dict[str, Any]]:
    """One launch of 2 workers, each with a MultiWorkerMirrored and a sharded strategy."""
    return launch.run(_semantics, 2, timeout=200)


def test_frozen_parameters_autocast_with_grad_scaler_and_torch_compile(
    against_mirrored: list[dict[str, Any]],
) -> None:
    for out in against_mirrored:
        for kind in ("frozen", "autocast"):
            for name, value in out[f"{kind}_mirrored"].items():
                torch.testing.assert_close(
                    out[f"{kind}_sharded"][name], value, rtol=0, atol=1e-5, msg=f"{kind} {name}"
                )
        torch.manual_seed(100)
        frozen_start = TiedNet().blocks[0].linear.weight
        assert torch.equal(out["frozen_sharded"]["blocks.0.linear.weight"], frozen_start)
        for name, value in out["eager"].items():
            torch.testing.assert_close(out["compiled"][name], value, rtol=0, atol=1e-6, msg=name)
        assert out["frozen_types"] == ["DTensor"]
