"""The engine contract (tests/unit/test_conformance.py) through ParameterServerStrategy
with one worker and one ps, for tests/distributed/test_conformance_ps.py.

rpc is one per process, so the test runs ``python tests/distributed/_ps_conformance_chief.py``;
this process is the chief of a `LocalCluster` and prints one line
``PS_CONFORMANCE <json>`` with what each check saw. The checks are the contract's where
it applies to parameter servers (the steps are closures a `ClusterCoordinator` runs on
the workers, and `run` happens inside them): the scope and its variables, `update` and
`colocate_vars_with` (and their refusals), `run` inside a closure (its replica id, and
`run` refused inside `run`), a training step with one device's weights, and a
checkpoint round trip.
"""

from __future__ import annotations

import json
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch

import distribute as ds

MARKER = "PS_CONFORMANCE "


def _net() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(24, 4, generator=g), torch.randn(24, 2, generator=g)


def _attempt(check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return check()
    except BaseException as e:
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


# -- closures (run on the worker; this file is __main__ there too) ---------------------------


def _replica_id(strategy: Any) -> list[int]:
    def fn() -> list[int]:
        ctx = ds.get_replica_context()
        return [ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync]

    return list(strategy.run(fn))


def _nested_run(strategy: Any) -> str:
    try:
        strategy.run(lambda: strategy.run(lambda: None))
    except ds.errors.ContextError as e:
        return str(e)
    return ""


def _train_step(model: Any, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss)


# -- the checks ------------------------------------------------------------------------------


def _scope_and_variables(strategy: Any) -> dict[str, Any]:
    with strategy.scope():
        current = ds.get_strategy() is strategy
        model = _net()
    plain = torch.nn.Parameter(torch.zeros(2))
    return {
        "current": current,
        "own": [strategy.extended.variable_created_in_scope(p) for p in model.parameters()],
        "plain": strategy.extended.variable_created_in_scope(plain),
    }


def _update_and_colocate(strategy: Any) -> dict[str, Any]:
    with strategy.scope():
        model = _net()
    bias = model[1].bias
    before = bias.read_value().clone()
    strategy.extended.update(bias, lambda v, x: v.assign_add(x), args=(torch.ones(2),))
    out: dict[str, Any] = {"updated": (bias.read_value() - before).tolist()}
    with strategy.scope(), strategy.extended.colocate_vars_with(bias):
        extra = ds.Variable(torch.zeros(1))
    out["colocated"] = extra.handle.task == bias.handle.task
    foreign = torch.nn.Parameter(torch.zeros(2))
    for name, call in (
        ("update_refused", lambda: strategy.extended.update(foreign, lambda v: v)),
        ("colocate_refused", lambda: strategy.extended.colocate_vars_with(foreign).__enter__()),
    ):
        try:
            call()
            out[name] = ""
        except ds.errors.InvalidArgumentError as e:
            out[name] = str(e)
    return out


def _run_in_a_closure(strategy: Any, coordinator: Any) -> dict[str, Any]:
    return {
        "replica": coordinator.schedule(_replica_id, args=(strategy,)).fetch(),
        "nested": coordinator.schedule(_nested_run, args=(strategy,)).fetch(),
    }


def _training(strategy: Any, coordinator: Any) -> dict[str, Any]:
    with strategy.scope():
        model = _net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data()
    for i in range(3):
        coordinator.schedule(
            _train_step, args=(model, optimizer, x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
        )
    coordinator.join()
    reference = _net()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for i in range(3):
        _train_step(reference, ref_optimizer, x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
    got = [p.read_value().tolist() for p in model.parameters()]
    want = [p.detach().tolist() for p in reference.parameters()]
    return {"got": got, "want": want}


def _checkpoint(strategy: Any) -> dict[str, Any]:
    with strategy.scope():
        model = _net()
    with torch.no_grad():
        for p in model.parameters():
            p.assign_add(torch.full_like(p.read_value(), 0.5))
    saved = [p.read_value().tolist() for p in model.parameters()]
    with tempfile.TemporaryDirectory() as directory:
        path = ds.Checkpoint(model=model).save(directory + "/ckpt")
        with strategy.scope():
            fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        ds.Checkpoint(model=fresh).restore(path)
        restored = [p.read_value().tolist() for p in fresh.parameters()]
    return {"saved": saved, "restored": restored}


def main() -> None:
    with ds.coordinator.LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = ds.ParameterServerStrategy(cluster.resolver, timeout_seconds=60)
        coordinator = ds.coordinator.ClusterCoordinator(strategy)
        out = {
            "scope": _attempt(lambda: _scope_and_variables(strategy)),
            "update": _attempt(lambda: _update_and_colocate(strategy)),
            "run": _attempt(lambda: _run_in_a_closure(strategy, coordinator)),
            "training": _attempt(lambda: _training(strategy, coordinator)),
            "checkpoint": _attempt(lambda: _checkpoint(strategy)),
        }
    print(MARKER + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
