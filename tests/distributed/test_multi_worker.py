"""MultiWorkerMirroredStrategy in real processes joined by a gloo process group."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import distribute as ds
from distribute import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]


# -- functions run in the workers (module level: pickled by reference) -------------------


def _strategy(local_replicas: int, **options: Any) -> ds.MultiWorkerMirroredStrategy:
    devices = [f"cpu:{i}" for i in range(local_replicas)] if local_replicas > 1 else None
    comm = ds.experimental.CommunicationOptions(**options) if options else None
    return ds.MultiWorkerMirroredStrategy(communication_options=comm, devices=devices)


def _basics(local_replicas: int) -> dict[str, Any]:
    strategy = _strategy(local_replicas)
    resolver = strategy.cluster_resolver
    assert resolver is not None
    out: dict[str, Any] = {"rank": resolver.rank, "n": strategy.num_replicas_in_sync}

    def ids() -> int:
        ctx = ds.get_replica_context()
        assert ctx is not None
        return ctx.replica_id_in_sync_group

    out["ids"] = list(strategy.experimental_local_results(strategy.run(ids)))

    def value() -> torch.Tensor:
        ctx = ds.get_replica_context()
        assert ctx is not None
        return torch.tensor([float(ctx.replica_id_in_sync_group + 1)])

    per_replica = strategy.run(value)
    out["sum"] = strategy.reduce("sum", per_replica, axis=None).item()
    out["mean"] = strategy.reduce("mean", per_replica, axis=None).item()
    out["host_sum"] = float(strategy.reduce("sum", torch.tensor(2.0), axis=None))

    def uneven() -> torch.Tensor:
        ctx = ds.get_replica_context()
        assert ctx is not None
        rid = ctx.replica_id_in_sync_group
        return torch.full((rid + 1, 2), float(rid))

    out["gather"] = strategy.gather(strategy.run(uneven), axis=0).tolist()

    def all_gather_in_replica() -> torch.Tensor:
        ctx = ds.get_replica_context()
        assert ctx is not None
        rid = ctx.replica_id_in_sync_group
        return ctx.all_gather(torch.tensor([rid, rid]), axis=0)

    out["all_gather"] = [
        t.tolist() for t in strategy.experimental_local_results(strategy.run(all_gather_in_replica))
    ]

    def all_reduce_in_replica() -> torch.Tensor:
        ctx = ds.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("sum", torch.ones(3) * ctx.replica_id_in_sync_group)

    out["all_reduce"] = [
        t.tolist() for t in strategy.experimental_local_results(strategy.run(all_reduce_in_replica))
    ]

    # Input: 10 elements in global batches of 4; every element once, uneven end.
    loader = torch.utils.data.DataLoader(torch.arange(10), batch_size=4)
    steps = []
    for batch in strategy.experimental_distribute_dataset(loader):
        steps.append([t.tolist() for t in strategy.experimental_local_results(batch)])
    out["steps"] = steps
    strategy.shutdown()
    return out


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the model's parameters and buffers."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _linear_and_sgd() -> tuple[torch.nn.Linear, torch.optim.SGD]:
    """Linear(3, 2) with seed 0 and plain SGD: the same start in workers and reference."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(58, 12, generator=g)
    y = torch.randint(0, 5, (58,), generator=g)
    return x, y


def _make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 5),
    )


def _make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


GLOBAL_BATCH = 16


def _train(
    local_replicas: int, optimizer_name: str, epochs: int, accumulate: int
) -> dict[str, Any]:
    """Trains with a different seed on every worker; returns the final parameters."""
    rank = int(os.environ["RANK"]) if "RANK" in os.environ else 0
    torch.manual_seed(1000 + rank)  # workers disagree; the chief's initial values win
    strategy = _strategy(local_replicas, bytes_per_pack=2048)  # several gradient buckets
    with strategy.scope():
        model = _make_model()
        optimizer = _make_optimizer(optimizer_name, model.parameters())
    x, y = _make_data()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=GLOBAL_BATCH // accumulate
    )
    dist = strategy.experimental_distribute_dataset(loader)

    def forward_backward(xb: torch.Tensor, yb: torch.Tensor) -> None:
        per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH).backward()

    def apply() -> None:
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(epochs):
        for i, (xb, yb) in enumerate(dist):
            if (i + 1) % accumulate:
                with strategy.extended.no_sync():
                    strategy.run(forward_backward, args=(xb, yb))
                continue
            strategy.run(forward_backward, args=(xb, yb))
            strategy.run(apply)
    params = _state(model)
    copies_equal = all(
        all(torch.equal(c, p.values[0]) for c in p.values) for p in model.parameters()
    )
    strategy.shutdown()
    return {"params": params, "copies_equal": copies_equal}


def _train_meta_built(local_replicas: int) -> dict[str, Any]:
    """Builds the model on the meta device in the scope; only the chief loads real
    weights (the others' memory is left uninitialized): the chief's values win."""
    rank = int(os.environ["RANK"])
    strategy = _strategy(local_replicas)
    with strategy.scope():
        with torch.device("meta"):
            model = _make_model()
        model.to_empty(device="cpu")
        if rank == 0:
            torch.manual_seed(1000)
            model.load_state_dict(_make_model().state_dict())
        optimizer = _make_optimizer("adam", model.parameters())
    x, y = _make_data()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=GLOBAL_BATCH
    )

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):
        for xb, yb in strategy.experimental_distribute_dataset(loader):
            strategy.run(step, args=(xb, yb))
    variables = all(isinstance(p, ds.MirroredVariable) for p in model.parameters())
    out = {"params": _state(model), "variables": variables}
    strategy.shutdown()
    return out


@pytest.mark.parametrize("local_replicas", [1, 2])
def test_a_model_built_on_the_meta_device_takes_the_chief_s_weights_and_trains(
    local_replicas: int,
) -> None:
    results = launch.run(_train_meta_built, 2, args=(local_replicas,), timeout=150)
    expected = _reference("adam", 2)
    for out in results:
        assert out["variables"]
        for name, value in expected.items():
            torch.testing.assert_close(out["params"][name], value, rtol=1e-5, atol=1e-5)


def _reference(optimizer_name: str, epochs: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(1000)
    model = _make_model()
    optimizer = _make_optimizer(optimizer_name, model.parameters())
    x, y = _make_data()
    for _ in range(epochs):
        for start in range(0, len(x), GLOBAL_BATCH):
            xb, yb = x[start : start + GLOBAL_BATCH], y[start : start + GLOBAL_BATCH]
            per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
            (per_example.sum() / GLOBAL_BATCH).backward()
            optimizer.step()
            optimizer.zero_grad()
    return _state(model)


def _dead_peer(timeout: float) -> dict[str, Any]:
    strategy = _strategy(1, timeout_seconds=timeout)
    assert strategy.cluster_resolver is not None
    if strategy.cluster_resolver.rank == 1:
        os._exit(0)  # dies without a word
    start = time.monotonic()
    try:
        strategy.reduce("sum", torch.ones(2), axis=None)
    except ds.errors.DistributeError as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    return {"error": None}


def _mismatch() -> dict[str, Any]:
    strategy = _strategy(1, timeout_seconds=20)
    assert strategy.cluster_resolver is not None
    rank = strategy.cluster_resolver.rank

    def fn() -> torch.Tensor:
        ctx = ds.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("sum", torch.ones(3 + rank))

    try:
        strategy.run(fn)
    except ds.errors.CollectiveMismatchError as exc:
        strategy.shutdown()
        return {"error": str(exc)}
    return {"error": None}


def _reduce_shape_mismatch(local_replicas: int, odd_replicas: str) -> dict[str, Any]:
    """Worker 1's last (or every) replica holds a partial batch: shape [1] against [3]."""
    strategy = _strategy(local_replicas, timeout_seconds=30)
    assert strategy.cluster_resolver is not None
    rank = strategy.cluster_resolver.rank

    def fn() -> torch.Tensor:
        ctx = ds.get_replica_context()
        assert ctx is not None
        last = ctx.replica_id_in_sync_group == strategy.num_replicas_in_sync - 1
        odd = rank == 1 and (last or odd_replicas == "worker")
        return torch.ones(1 if odd else 3)

    value = strategy.run(fn)
    errors = []
    start = time.monotonic()
    for op in ("sum", "mean"):
        try:
            strategy.reduce(op, value, axis=None)
            errors.append(None)
        except ValueError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    seconds = time.monotonic() - start
    strategy.shutdown()
    return {"rank": rank, "errors": errors, "seconds": seconds}


@pytest.mark.parametrize(
    ("local_replicas", "odd_replicas"),
    [(1, "worker"), (2, "worker"), (2, "last")],
    ids=["1x_workers_differ", "2x_workers_differ", "2x_replicas_within_a_worker_differ"],
)
def test_reduce_of_shapes_that_differ_across_workers_raises_on_every_worker(
    local_replicas: int, odd_replicas: str
) -> None:
    # TF raises; a reduction must never broadcast a partial batch's [1] against [3].
    results = launch.run(
        _reduce_shape_mismatch, 2, args=(local_replicas, odd_replicas), timeout=120
    )
    for out in results:
        for error in out["errors"]:
            assert error is not None, out
            assert "[3]" in error and "[1]" in error, error
        # Every worker raises at once, not after the 30 s collective timeout.
        assert out["seconds"] < 10, out


def _batchnorm_buffers(local_replicas: int) -> dict[str, Any]:
    strategy = _strategy(local_replicas)
    with strategy.scope():
        bn = torch.nn.BatchNorm1d(2, momentum=0.5)
        bn.register_buffer("constant", torch.tensor([0.1, 1 / 3]))
        # More buffers of the same shape: the workers must pair them by creation
        # order in the packed sync (a set's order differs between processes).
        for i in range(6):
            bn.register_buffer(f"constant_{i}", torch.tensor([float(i), -float(i)]))

    def fn() -> None:
        ctx = ds.get_replica_context()
        assert ctx is not None
        bn(torch.tensor([[0.0, 1.0], [2.0, 5.0]]) * (ctx.replica_id_in_sync_group + 1))

    strategy.run(fn)
    strategy.run(fn)
    return {
        name: [c.tolist() for c in getattr(bn, name).values]
        for name in ["running_mean", "num_batches_tracked", "constant"]
        + [f"constant_{i}" for i in range(6)]
    }


class _Branches(torch.nn.Module):
    """`shared` always used, `only_rank_1` by replica 1 only, `never` not at all.

    `shared` is registered last, so its gradients fill the first buckets (buckets
    follow the reverse registration order) and are launched during backward.
    """

    def __init__(self) -> None:
        super().__init__()
        self.never = torch.nn.Linear(2, 2)
        self.only_rank_1 = torch.nn.Linear(2, 2)
        self.shared = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.shared(x)
        return self.only_rank_1(h) if use_branch else h


def _branch_input(rank: int, step: int, backward: int) -> torch.Tensor:
    return torch.arange(6.0).reshape(2, 3) / (1 + rank + 2 * step + 5 * backward)


def _branch_steps(
    model: _Branches,
    optimizer: torch.optim.Optimizer,
    ranks: list[int],
    steps: int,
    set_to_none: bool = True,
) -> None:
    """Two backward passes per step (no no_sync) then one update, for `ranks`' inputs."""
    for step in range(steps):
        for backward in range(2):
            for rank in ranks:
                model(_branch_input(rank, step, backward), rank == 1).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)


def _unused_and_accumulated(local_replicas: int, set_to_none: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    strategy = _strategy(local_replicas, bytes_per_pack=16)  # a bucket per parameter or two
    with strategy.scope():
        model = _Branches()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)

    def replica_steps() -> None:
        ctx = ds.get_replica_context()
        assert ctx is not None
        _branch_steps(model, optimizer, [ctx.replica_id_in_sync_group], 3, set_to_none)

    # With one local replica the first step aggregates synchronously and later ones
    # overlap with backward, where the second backward pass makes launched buckets
    # stale; with two, every step packs the local sums with the used flags. With
    # set_to_none=False the gradients stay views of the buckets between steps, so
    # backward accumulates into the buckets themselves.
    strategy.run(replica_steps)
    params = _state(model)
    strategy.shutdown()
    return {"params": params}


def _backward_counts(counts: list[list[int]]) -> dict[str, Any]:
    """Steps with ``counts[step][rank]`` backward passes each; stops at the first error."""
    rank = int(os.environ["RANK"])
    strategy = _strategy(1, bytes_per_pack=4, timeout_seconds=30)  # bias, weight: 2 buckets
    with strategy.scope():
        model, optimizer = _linear_and_sgd()

    def step(passes: int) -> None:
        for _ in range(passes):
            model(torch.full((2, 3), float(1 + rank))).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    out: dict[str, Any] = {"error": None, "steps": 0}
    try:
        for passes in counts:  # the first step aggregates synchronously
            strategy.run(step, args=(passes[rank],))
            out["steps"] += 1
    except ds.errors.CollectiveMismatchError as e:
        out["error"] = str(e)
    out["params"] = _state(model)
    strategy.shutdown()
    return out


def _branch_logging_frozen_then_shutdown() -> dict[str, Any]:
    """Data-dependent branches, a frozen parameter, a collective between backward and
    the step, and a backward pass after `shutdown`."""
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    strategy = _strategy(1, bytes_per_pack=16, timeout_seconds=30)
    with strategy.scope():
        model = _Branches()
        model.shared.bias.requires_grad_(False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses: list[float] = []

    def step(i: int) -> None:
        ctx = ds.get_replica_context()
        assert ctx is not None
        loss = model(_branch_input(rank, i, 0), rank == 1).square().sum()
        loss.backward()
        losses.append(ctx.all_reduce("sum", loss.detach()).item())  # logging
        optimizer.step()
        optimizer.zero_grad()

    for i in range(4):
        strategy.run(step, args=(i,))
    params = _state(model)
    strategy.shutdown()
    model(_branch_input(rank, 0, 0), True).sum().backward()  # no collective, no error
    return {"params": params, "losses": losses}


def _native_thread_names() -> list[str]:
    """The names of this process's threads, as the kernel knows them (gloo's included)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended while we looked
            pass
    return names


def _gloo_threads_after_shutdown() -> dict[str, list[str]]:
    """Trains with an optimizer (which imports torch._dynamo), then shuts down."""
    strategy = _strategy(1)
    with strategy.scope():
        model, optimizer = _linear_and_sgd()

    def step() -> None:
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        strategy.run(step)
    before = _native_thread_names()
    strategy.shutdown()
    return {"before": before, "after": _native_thread_names()}


def _grad_edits(model: torch.nn.Module, rank: int) -> None:
    """What a worker does to its gradients between backward and the step."""
    if rank == 1:
        for p in model.parameters():
            assert p.grad is not None
            p.grad.mul_(0.5)  # in place, as clip_grad_norm_ does when it clips
    else:
        model.bias.grad = model.bias.grad * 2  # type: ignore[operator]  # a new tensor


def _edited_gradients() -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    strategy = _strategy(1, bytes_per_pack=4)  # bias, then weight: two buckets
    with strategy.scope():
        model, optimizer = _linear_and_sgd()

    def step(i: int) -> None:
        model(torch.full((2, 3), float(i + rank))).square().sum().backward()
        _grad_edits(model, rank)
        optimizer.step()
        optimizer.zero_grad()

    for i in range(3):  # the first step synchronously, then overlapped
        strategy.run(step, args=(i,))
    params = _state(model)
    strategy.shutdown()
    return {"params": params}


# -- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workers", "local_replicas"),
    [(2, 1), (2, 2), (4, 1), (4, 2)],
    ids=["2x1", "2x2", "4x1", "4x2"],
)
def test_workers_replica_ids_reduce_gather_and_input(workers: int, local_replicas: int) -> None:
    results = launch.run(_basics, workers, args=(local_replicas,), timeout=150)
    n = workers * local_replicas
    for rank, out in enumerate(results):
        assert out["rank"] == rank and out["n"] == n
        assert out["ids"] == [rank * local_replicas + i for i in range(local_replicas)]
        assert out["sum"] == sum(range(1, n + 1))
        assert out["mean"] == pytest.approx(sum(range(1, n + 1)) / n)
        assert out["host_sum"] == 2.0 * workers  # a host value is summed across workers, as in TF
        assert out["gather"] == [[float(r), float(r)] for r in range(n) for _ in range(r + 1)]
        assert all(g == [r for r in range(n) for _ in range(2)] for g in out["all_gather"])
        assert all(v == [float(sum(range(n)))] * 3 for v in out["all_reduce"])
    # Input (10 elements, global batches of 4): every element once, per step sizes
    # differ by at most one, every worker stops after the same 3 steps.
    assert all(len(out["steps"]) == 3 for out in results)
    steps = [[part for out in results for part in out["steps"][i]] for i in range(3)]
    seen = sorted(x for step in steps for part in step for x in part)
    assert seen == list(range(10))
    for step in steps:
        sizes = [len(part) for part in step]
        assert len(sizes) == n and max(sizes) - min(sizes) <= 1
    last = [len(p) for p in steps[-1]]
    assert sum(last) == 2
    if workers == 2:
        assert last == ([1, 1] if local_replicas == 1 else [1, 1, 0, 0])


@pytest.mark.parametrize(
    ("workers", "local_replicas", "optimizer_name", "accumulate"),
    [(2, 1, "sgd", 1), (2, 2, "adam", 1), (4, 1, "adam", 1), (4, 2, "sgd", 1), (2, 1, "sgd", 2)],
    ids=[
        "2x1-sgd-overlapped",
        "2x2-adam-hierarchical",
        "4x1-adam",
        "4x2-sgd",
        "2x1-no_sync-accumulation",
    ],
)
def test_training_matches_single_process_with_different_seeds(
    workers: int, local_replicas: int, optimizer_name: str, accumulate: int
) -> None:
    epochs = 2
    results = launch.run(
        _train, workers, args=(local_replicas, optimizer_name, epochs, accumulate), timeout=150
    )
    expected = _reference(optimizer_name, epochs)
    for out in results:
        assert out["copies_equal"]
        for name, value in expected.items():
            torch.testing.assert_close(out["params"][name], value, rtol=1e-5, atol=1e-5)


def test_tf_config_launch_builds_the_same_cluster() -> None:
    results = launch.run(_basics, 2, args=(1,), launcher="tf_config", timeout=120)
    assert [out["rank"] for out in results] == [0, 1]
    assert [out["ids"] for out in results] == [[0], [1]]
    assert results[0]["sum"] == 3.0


def test_dead_peer_gives_a_timeout_error_naming_it() -> None:
    timeout = 6.0
    results = launch.run(_dead_peer, 2, args=(timeout,), timeout=120, allow_missing=True)
    out = results[0]
    assert out["error"] in {"CollectiveTimeoutError", "WorkerError"}, out
    assert "1" in out["message"] and "reduce" in out["message"], out["message"]
    assert out["seconds"] < timeout + 5


def test_shape_mismatch_raises_on_every_rank() -> None:
    results = launch.run(_mismatch, 2, timeout=120)
    for out in results:
        assert out["error"] is not None
        assert "rank 0" in out["error"] and "rank 1" in out["error"], out["error"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_example_runs_under_torchrun() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(ROOT / "examples" / "train_digits.py"),
        "--strategy",
        "multi_worker",
        "--epochs",
        "2",
        "--quiet",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "failed to bind" not in proc.stderr, proc.stderr[-3000:]  # joins torchrun's store
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout  # only the chief prints
    assert lines[0]["replicas_in_sync"] == 2
    assert lines[0]["test_accuracy"] > 0.85


def test_batchnorm_statistics_are_averaged_over_every_replica_of_every_worker() -> None:
    workers, local_replicas = 2, 2
    results = launch.run(_batchnorm_buffers, workers, args=(local_replicas,), timeout=120)
    n = workers * local_replicas
    base = torch.tensor([[0.0, 1.0], [2.0, 5.0]])
    running = torch.zeros(2)
    for _ in range(2):  # two steps, each averaging the replicas' momentum updates
        running = torch.stack(
            [0.5 * running + 0.5 * (base * (r + 1)).mean(dim=0) for r in range(n)]
        ).mean(dim=0)
    for out in results:
        for copy in out["running_mean"]:
            torch.testing.assert_close(torch.tensor(copy), running)
        assert out["num_batches_tracked"] == [2] * local_replicas
        assert out["constant"] == [torch.tensor([0.1, 1 / 3]).tolist()] * local_replicas
        for i in range(6):
            assert out[f"constant_{i}"] == [[float(i), -float(i)]] * local_replicas


@pytest.mark.parametrize(
    ("local_replicas", "set_to_none"),
    [(1, True), (2, True), (1, False)],
    ids=["1-local", "2-local", "1-local-zero_grad-in-place"],
)
def test_unused_parameters_and_repeated_backward_match_one_process(
    local_replicas: int, set_to_none: bool
) -> None:
    """A parameter no worker used keeps no gradient (weight decay leaves it alone); one
    used by a single worker gets that worker's gradient everywhere; two backward passes
    before a step accumulate exactly."""
    results = launch.run(
        _unused_and_accumulated, 2, args=(local_replicas, set_to_none), timeout=120
    )
    torch.manual_seed(0)
    model = _Branches()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _branch_steps(model, optimizer, list(range(2 * local_replicas)), 3, set_to_none)
    expected = model.state_dict()
    assert torch.equal(expected["never.weight"], before["never.weight"])
    for out in results:
        for name, value in expected.items():
            torch.testing.assert_close(out["params"][name], value, rtol=1e-6, atol=1e-6)


def test_workers_accumulating_over_several_backward_passes_sum_what_they_accumulated() -> None:
    """Every worker runs backward twice before a step (accumulation without
    no_sync): the step sums each worker's accumulated gradient."""
    counts = [[1, 1], [1, 1], [2, 2], [1, 1]]
    results = launch.run(_backward_counts, 2, args=(counts,), timeout=120)
    model, optimizer = _linear_and_sgd()
    for step_passes in counts:
        for rank, passes in enumerate(step_passes):
            for _ in range(passes):
                model(torch.full((2, 3), float(1 + rank))).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    for out in results:
        assert out["error"] is None
        for name, value in model.state_dict().items():
            torch.testing.assert_close(out["params"][name], value, rtol=1e-6, atol=1e-6)


def test_workers_making_different_numbers_of_backward_passes_raise_on_every_worker() -> None:
    """Rank 1 runs backward twice before one step, rank 0 once. Which workers saw a
    change is not asked at each step (that would be a host sync per step), so the
    disagreement is caught: rank 1 at that step, before reducing again, rank 0 when
    its next backward pass begins, before launching anything. Nobody hangs."""
    counts = [[1, 1], [1, 1], [1, 2], [1, 1], [1, 1]]
    started = time.monotonic()
    rank0, rank1 = launch.run(_backward_counts, 2, args=(counts,), timeout=120)
    assert time.monotonic() - started < 25  # well within the 30 s collective timeout
    assert rank1["steps"] == 2 and rank0["steps"] == 3
    for out in (rank0, rank1):
        assert "disagree on reducing their gradients again" in out["error"]
        assert "no_sync" in out["error"]


def test_branches_frozen_parameters_and_collectives_between_backward_and_step() -> None:
    """Only rank 1 uses a branch, so the ranks' buckets become ready at different
    times; a logging all-reduce between backward and the step must still pair with
    its counterpart, and a frozen parameter must not break the hooks."""
    results = launch.run(_branch_logging_frozen_then_shutdown, 2, timeout=120)
    torch.manual_seed(0)
    model = _Branches()
    model.shared.bias.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(4):
        total = 0.0
        for rank in range(2):
            loss = model(_branch_input(rank, i, 0), rank == 1).square().sum()
            loss.backward()
            total += loss.item()
        losses.append(total)
        optimizer.step()
        optimizer.zero_grad()
    for out in results:
        assert out["losses"] == pytest.approx(losses, rel=1e-6)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(out["params"][name], value, rtol=1e-6, atol=1e-6)


def test_gradients_edited_between_backward_and_step_are_what_is_summed() -> None:
    """In-place edits (clipping) on one worker, a replaced `.grad` on the other: the
    sum is of the gradients the step finds, even for buckets launched in backward."""
    results = launch.run(_edited_gradients, 2, timeout=120)
    model, optimizer = _linear_and_sgd()
    for i in range(3):
        total = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
        for rank in range(2):
            model.zero_grad()
            model(torch.full((2, 3), float(i + rank))).square().sum().backward()
            _grad_edits(model, rank)
            for name, p in model.named_parameters():
                assert p.grad is not None
                total[name] += p.grad
        for name, p in model.named_parameters():
            p.grad = total[name]
        optimizer.step()
    for out in results:
        for name, value in model.state_dict().items():
            torch.testing.assert_close(out["params"][name], value, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_shutdown_stops_gloo_threads_so_exit_cannot_abort() -> None:
    """Gloo's worker threads outliving `shutdown` (the group pinned by defaults that
    torch.distributed.nn.functional binds at import) aborted workers at interpreter
    exit with "terminate called without an active exception", about 1 run in 12."""
    for out in launch.run(_gloo_threads_after_shutdown, 2, timeout=120):
        assert "pt_gloo_runloop" in out["before"]
        assert not [n for n in out["after"] if n.startswith(("pt_gloo", "gloo"))], out["after"]
