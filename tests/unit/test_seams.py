"""The engine's seams (docs/architecture.md, "The engine's seams"): what a strategy's
engine offers the layers above it is declared and typed, and nothing reads or writes
another layer's private attributes by name."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distribute as ds
from distribute.collectives.base import CrossWorker
from distribute.collectives.process_group import ProcessGroupCollectives

PACKAGE = Path(ds.__file__).parent


def _sources(under: Path = PACKAGE) -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(under.rglob("*.py"))]


def test_no_module_reads_a_strategys_private_attribute_by_name() -> None:
    found = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr"):
                continue
            if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant):
                continue
            name = node.args[1].value
            owner = ast.unparse(node.args[0])
            if (
                isinstance(name, str)
                and name.startswith("_")
                and ("strategy" in owner or "extended" in owner)
            ):
                found.append(
                    f"{path.relative_to(PACKAGE)}:{node.lineno}: getattr({owner}, {name!r})"
                )
    assert not found, found


def test_the_replicated_engines_parts_read_its_topology_and_host_not_its_privates() -> None:
    """NOTE [the replica host]: placement, the replica collectives and the cross-replica
    reductions read the engine through `ReplicaTopology` and `ReplicaHost` only, and do
    not name the engine's class."""
    strategies = PACKAGE / "strategies"
    found = []
    for name in ("_placement.py", "_replica_collectives.py", "_cross_replica.py"):
        path = strategies / name
        text = path.read_text()
        if "ReplicatedExtended" in text.replace("`ReplicatedExtended", ""):
            found.append(f"{name}: names ReplicatedExtended")
        for node in ast.walk(ast.parse(text, str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and ast.unparse(node.value).split(".")[-1] in ("ext", "_ext", "_topology")
            ):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_the_gradient_layer_reads_no_engine_attribute_and_writes_none() -> None:
    found = []
    for path, tree in _sources(PACKAGE / "gradients"):
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, (ast.Name, ast.Attribute))
                and ast.unparse(node.value).split(".")[-1] in ("ext", "_ext", "group", "_group")
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_single_worker_strategies_declare_one_worker_and_a_step_handler(
    strategy: ds.Strategy,
) -> None:
    extended = strategy.extended
    assert extended.cross_worker is None
    assert (extended.worker_index, extended.num_workers) == (0, 1)
    assert extended.static_batch_shapes is False
    handler = extended.step_handler
    assert handler is not None
    assert handler.hides_gradients() is False  # outside any step


def test_the_process_group_collectives_are_a_cross_worker_with_rank_and_barrier() -> None:
    members = {"rank", "world_size", "barrier", "all_reduce", "all_gather", "broadcast"}
    for name in members | {"all_reduce_int", "check_same", "all_reduce_async"}:
        assert hasattr(CrossWorker, name), name
        assert callable(getattr(ProcessGroupCollectives, name)) or isinstance(
            getattr(ProcessGroupCollectives, name), property
        ), name


def test_central_storage_replicas_other_than_the_first_see_no_gradients_during_a_step() -> None:
    strategy = ds.CentralStorageStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        layer = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    handler = strategy.extended.step_handler
    assert handler is not None
    seen: dict[int, tuple[bool, bool]] = {}

    def spy(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        replica = ds.get_replica_context().replica_id_in_sync_group
        seen[replica] = (handler.hides_gradients(), layer.weight.grad is None)

    optimizer.register_step_pre_hook(spy)  # runs after the library's global pre-hook

    def step() -> None:
        layer(torch.ones(1, 2)).sum().backward()
        optimizer.step()

    strategy.run(step)
    assert seen == {0: (False, False), 1: (True, True)}
    assert handler.hides_gradients() is False


_COUNT_HOOKS = """
import json, sys
import torch
import torch.nn.modules.module as m
import torch.optim.optimizer as o

def counts():
    return [
        len(m._global_module_registration_hooks),
        len(m._global_parameter_registration_hooks),
        len(m._global_buffer_registration_hooks),
        len(o._global_optimizer_pre_hooks),
        len(o._global_optimizer_post_hooks),
    ]

seen = {"before": counts()}
import distribute as ds
seen["imported"] = counts()
model = torch.nn.Linear(2, 1)  # plain PyTorch: builds and steps without the library
torch.optim.SGD(model.parameters(), lr=0.1).step()
ds.get_strategy()
seen["plain_use"] = counts()
strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
seen["built"] = counts()
if sys.argv[1] == "scope":
    with strategy.scope():
        pass
else:
    strategy.run(lambda: None)
seen["first_use"] = counts()
with strategy.scope():
    pass
ds.OneDeviceStrategy("cpu").run(lambda: None)
seen["again"] = counts()
print(json.dumps(seen))
"""


@pytest.mark.parametrize("first_use", ["scope", "run"])
def test_import_installs_no_torch_hook_and_the_first_scope_or_run_installs_each_once(
    first_use: str,
) -> None:
    """`import distribute` leaves torch's global module, parameter, buffer and
    optimizer hooks alone (NOTE [hooks at first use]); the first scope (or `run`)
    installs one of each, and later scopes and runs add none."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", _COUNT_HOOKS, first_use],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    nothing = [0, 0, 0, 0, 0]
    assert seen["before"] == nothing, seen
    assert seen["imported"] == nothing, seen
    assert seen["plain_use"] == nothing, seen
    assert seen["built"] == nothing, seen
    assert seen["first_use"] == [1, 1, 1, 1, 1], seen
    assert seen["again"] == [1, 1, 1, 1, 1], seen


def test_a_run_without_any_scope_installs_the_hooks_that_refuse_plain_parameters() -> None:
    """A model built outside any scope, stepped inside `run` of two replicas, is
    refused even when no scope was ever entered (the hooks install at `run` too)."""
    from distribute.strategies import _torch_hooks

    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()

    try:
        strategy.run(step)
    except ValueError as e:
        assert "plain parameters" in str(e)
    else:
        raise AssertionError("a step over plain parameters under 2 replicas was not refused")
    assert _torch_hooks.installed()


def test_no_engine_subclasses_the_replicated_engine() -> None:
    """The sharded, parameter-server and TPU layout-map engines are the replicated
    engine built with parts of their own (`strategies/_engine_parts.py`), not
    subclasses overriding it; ModelParallelStrategy's engine is its own."""
    found = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if any(b.split(".")[-1] == "ReplicatedExtended" for b in bases):
                    found.append(f"{path.relative_to(PACKAGE)}: class {node.name}({bases})")
    assert not found, found


def test_no_strategy_writes_its_engine_after_building_it() -> None:
    """Every engine is whole when its constructor returns: nothing assigns to an
    engine's attributes from outside it (`extended._x = ...`)."""
    found = []
    for path, tree in _sources(PACKAGE / "strategies"):
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    if target.value.id in ("extended", "ext", "engine"):
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found


def test_the_sharded_engine_is_the_replicated_one_with_its_own_parts() -> None:
    """Its handler, capture and lifecycle were passed in at construction."""
    code = (
        "import distribute as ds\n"
        "from distribute.gradients.sharded import ShardedStepHandler\n"
        "from distribute.strategies._replicated import ReplicatedExtended\n"
        "from distribute.strategies._sharding import ShardedModules\n"
        "s = ds.experimental.FullyShardedStrategy()\n"
        "e = s.extended\n"
        "assert type(e) is ReplicatedExtended, type(e)\n"
        "assert isinstance(e.step_handler, ShardedStepHandler)\n"
        "assert isinstance(e._capture, ShardedModules) and e._lifecycle is e._capture\n"
        "assert e.cross_worker is None and e.num_workers == 1\n"
        "s.shutdown()\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_the_library_never_writes_the_process_environment() -> None:
    """Variables are handed to the processes a launcher starts, never written into
    this one (`os.environ[...] = `, `update`, `setdefault`, `putenv`, ...)."""
    writers = {"update", "setdefault", "pop", "popitem", "clear", "__setitem__"}
    found = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            text = ""
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = (
                    node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                )
                text = " ".join(ast.unparse(t) for t in targets)
                if "os.environ[" in text:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {text}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                func = ast.unparse(node.func)
                if func in ("os.putenv", "os.unsetenv") or (
                    func.startswith("os.environ.") and node.func.attr in writers
                ):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {func}")
    assert not found, found


_SHARDED_OPTIMIZERS = """
import json
import torch
import distribute as ds

seen = {}
strategy = ds.experimental.FullyShardedStrategy()  # one worker, a group of one
with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    listed = torch.optim.SGD([p for p in model.parameters()], lr=0.1)
    stale = list(model.parameters())
for name, opt in (("adam", adam), ("listed", listed)):
    seen[name] = sorted({type(p).__name__ for g in opt.param_groups for p in g["params"]})
seen["modes_left"] = torch._C._len_torch_function_stack()
try:
    with strategy.scope():
        other = torch.nn.Linear(4, 4)
        stepped = torch.optim.Adam(other.parameters())
        other(torch.ones(1, 4)).sum().backward()
        stepped.step()
except ValueError as e:
    seen["stepped"] = str(e)
late = torch.optim.SGD(stale, lr=0.1)
try:
    strategy.run(lambda: (model(torch.ones(1, 4)).sum().backward(), late.step()))
except ValueError as e:
    seen["stale"] = str(e)
strategy.shutdown()
print(json.dumps(seen))
"""


def test_optimizers_built_in_a_sharded_scope_are_repointed_without_a_heap_scan() -> None:
    """NOTE [optimizers built in the scope]: found as they are built (however their
    parameters were listed), one that stepped before the sharding is refused, one
    built afterwards from the replaced parameters is refused at its step, and the
    watch leaves no torch function mode behind; the package scans no heap."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", _SHARDED_OPTIMIZERS],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["adam"] == seen["listed"] == ["DTensor"], seen
    assert seen["modes_left"] == 0, seen
    assert "already holds state" in seen["stepped"], seen
    assert "replaced by its shards" in seen["stale"], seen
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and ast.unparse(node) in (
                "gc.get_objects",
                "gc.get_referrers",
            ):
                raise AssertionError(f"{path.relative_to(PACKAGE)}:{node.lineno}")
