"""A steady-state multi-worker training step makes no host sync and no stray collective.

Issue #17 ("Keep it right without a GPU"): like DistributedDataParallel, a training
step under `MultiWorkerMirroredStrategy`, once warmed up, must not wait for the
device (on a GPU every `.item()`, `torch.equal`, `.tolist()` or `torch.tensor(...)`
of Python values stalls the host until the queued kernels finish), and must not
issue collectives beyond its gradient buckets, the buffer sync of models with
buffers, and the end-of-data agreement of the input pipeline. CPU-only machines
cannot see stalls, so each worker counts them:

* host syncs with a `TorchDispatchMode` (``aten._local_scalar_dense``, which
  ``.item()``, ``bool(t)``, ``int(t)`` and ``float(t)`` reach, ``aten.equal``, and
  ``aten.lift_fresh``, which ``torch.tensor(python_values)`` reaches), and
  ``Tensor.tolist`` (invisible to dispatch modes) by wrapping it;
* collectives by wrapping `torch.distributed`'s collective functions, and every
  reference to them that a `distribute` module bound at import.

Each count records where it came from (the innermost frames inside `distribute/`),
so a failure names the lines to fix. Budgets are per worker and per step.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import distribute as ds
from distribute import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

# -- budgets, per worker and per steady-state step ----------------------------------------

#: `.item()`, `bool(t)`, `int(t)`, `float(t)` (aten._local_scalar_dense): DDP makes none.
LOCAL_SCALAR_DENSE_BUDGET = 0
#: `torch.equal` (aten.equal): compares on the device, then reads one bool back.
EQUAL_BUDGET = 0
#: `Tensor.tolist()`: copies the tensor to the host.
TOLIST_BUDGET = 0
#: `torch.tensor(python_values)` (aten.lift_fresh): on a GPU, a blocking host-to-device copy.
TENSOR_FROM_PYTHON_BUDGET = 0
#: The input's batch index (NOTE [batched tensor datasets]): a shuffled TensorDataset's
#: batch is gathered with one index tensor made from the sampler's indices, on the CPU
#: where the dataset's tensors are (no copy to a device, so no sync). Counted apart so
#: that any other tensor made from Python values still counts above.
INPUT_INDEX_BUDGET = 1
#: `nonzero`, `masked_select`, `unique`, ...: the host waits to learn the output's size.
DATA_DEPENDENT_SHAPE_BUDGET = 0
#: Gradient all-reduces: one per bucket; both models are far below the first bucket (1 MiB).
GRADIENT_BUCKETS = 1
#: Buffer sync (BatchNorm's running statistics): at most one collective per buffer dtype
#: (float32 running_mean/running_var, int64 num_batches_tracked: two dtypes).
BUFFER_SYNC_PER_DTYPE = 1
#: End-of-data agreement: none inside an epoch when every worker's DataLoader knows its
#: length (agreed once per epoch); only loaders of unknown length agree at each step.
END_OF_DATA_PER_STEP = 0

#: Steps before the counted ones: the first step aggregates synchronously, checks the
#: bucket layout and broadcasts the initial values.
WARMUP_STEPS = 3
MEASURED_STEPS = 5
GLOBAL_BATCH = 16
FEATURES, CLASSES = 12, 5

# -- counting, inside the workers ---------------------------------------------------------

_PACKAGE = Path(ds.__file__).resolve().parent
_HERE = str(Path(__file__).resolve())
_TORCH = str(Path(torch.__file__).resolve().parent)

#: The host syncs a dispatch mode sees, by the name they are counted under.
_SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default: "_local_scalar_dense",
    torch.ops.aten.equal.default: "equal",
    torch.ops.aten.lift_fresh.default: "tensor_from_python",
    # Outputs whose shape depends on the data: the host waits for the count.
    torch.ops.aten.nonzero.default: "data_dependent_shape",
    torch.ops.aten.masked_select.default: "data_dependent_shape",
    torch.ops.aten._unique2.default: "data_dependent_shape",
    torch.ops.aten.unique_consecutive.default: "data_dependent_shape",
    torch.ops.aten.repeat_interleave.Tensor: "data_dependent_shape",
}
#: `torch.distributed` functions that are, or start, collectives.
_COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "all_gather_object",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
)


def _where(frame: Any) -> str:
    """Where a count came from: up to three frames inside `distribute/`, innermost
    first, with the collective's name when a frame knows it; else the innermost
    frame outside torch and this file."""
    inside: list[str] = []
    name = None
    outside = None
    while frame is not None and len(inside) < 3:
        path = frame.f_code.co_filename
        if path.startswith(str(_PACKAGE)):
            rel = Path(path).relative_to(_PACKAGE.parent).as_posix()
            inside.append(f"{rel}:{frame.f_lineno} {frame.f_code.co_name}")
            position = frame.f_locals.get("position")  # ProcessGroupCollectives' (n, name)
            if name is None and isinstance(position, tuple) and len(position) == 2:
                name = position[1]
        elif outside is None and path != _HERE and not path.startswith(_TORCH):
            outside = f"{Path(path).name}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    if not inside:
        return outside or "torch internals"
    return (f"[{name}] " if name else "") + " <- ".join(inside)


class _Counts:
    """What the counted steps did: one Counter per step, and where each came from."""

    def __init__(self) -> None:
        self.active = False
        self.steps: list[collections.Counter[str]] = []
        self.where: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self._depth = threading.local()

    def add(self, kind: str, frame: Any) -> None:
        if self.active:
            self.steps[-1][kind] += 1
            self.where[kind][_where(frame)] += 1

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self.steps.append(collections.Counter())
        self.active = True
        try:
            with _SyncMode(self):
                yield
        finally:
            self.active = False

    def collective(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` counted once per outermost call (all_gather_object calls all_gather)."""

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "value", 0)
            if depth == 0:
                self.add("collectives", sys._getframe(1))
            self._depth.value = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.value = depth

        return counted

    def report(self) -> dict[str, Any]:
        return {
            "steps": [dict(c) for c in self.steps],
            "where": {kind: dict(c) for kind, c in self.where.items()},
        }


class _SyncMode(TorchDispatchMode):
    def __init__(self, counts: _Counts) -> None:
        super().__init__()
        self._counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._counts.steps[-1]["aten ops seen"] += 1  # the mode is not blind
        kind = _SYNC_OPS.get(func)
        if kind == "tensor_from_python" and _is_input_index(sys._getframe(1), args[0]):
            kind = "input_index"
        if kind is not None:
            self._counts.add(kind, sys._getframe(1))
        return func(*args, **(kwargs or {}))


_ARRAYS = str(_PACKAGE / "data" / "_arrays.py")


def _is_input_index(frame: Any, tensor: torch.Tensor) -> bool:
    """A CPU tensor made by the input pipeline's batched gather (`Tensors.__getitems__`)."""
    if tensor.device.type != "cpu":
        return False
    for _ in range(8):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "__getitems__" and code.co_filename == str(
            _PACKAGE / "data" / "_arrays.py"
        ):
            return True
        frame = frame.f_back
    return False


def _install(counts: _Counts) -> None:
    """Wraps `Tensor.tolist` and the collectives, including references to them that
    `distribute` modules bound at import (``_all_gather_single``)."""
    original_tolist = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        counts.add("tolist", sys._getframe(1))
        return original_tolist(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    originals = [getattr(dist, name, None) for name in _COLLECTIVES]
    wrapped = {id(fn): counts.collective(fn) for fn in originals if fn is not None}
    modules = [dist, dist.distributed_c10d] + [
        module
        for name, module in list(sys.modules.items())
        if name == "distribute" or name.startswith("distribute.")
    ]
    for module in modules:
        for attr, value in list(vars(module).items()):
            if id(value) in wrapped:
                setattr(module, attr, wrapped[id(value)])


# -- the training run, in each worker -----------------------------------------------------


def _model(batchnorm: bool) -> torch.nn.Module:
    def norm() -> list[torch.nn.Module]:
        return [torch.nn.BatchNorm1d(32)] if batchnorm else []

    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32),
        *norm(),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        *norm(),
        torch.nn.ReLU(),
        torch.nn.Linear(32, CLASSES),
    )


def _train_and_count(batchnorm: bool) -> dict[str, Any]:
    counts = _Counts()
    _install(counts)
    strategy = ds.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _model(batchnorm)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = WARMUP_STEPS + MEASURED_STEPS
    g = torch.Generator().manual_seed(0)
    x = torch.randn((steps + 2) * GLOBAL_BATCH, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (len(x),), generator=g)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=GLOBAL_BATCH, shuffle=True
    )
    batches = iter(strategy.experimental_distribute_dataset(loader))

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    for i in range(steps):
        if i < WARMUP_STEPS:
            strategy.run(step, args=next(batches))
            continue
        with counts.step():  # the input's next step, then the training step
            strategy.run(step, args=next(batches))
    buffer_dtypes = sorted({str(b.dtype) for b in model.buffers()})
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    strategy.shutdown()
    return {**counts.report(), "buffer_dtypes": buffer_dtypes, "state": state}


# -- tests ---------------------------------------------------------------------------------


def _budgets(buffer_dtypes: int) -> dict[str, int]:
    return {
        "_local_scalar_dense": LOCAL_SCALAR_DENSE_BUDGET,
        "equal": EQUAL_BUDGET,
        "tolist": TOLIST_BUDGET,
        "tensor_from_python": TENSOR_FROM_PYTHON_BUDGET,
        "input_index": INPUT_INDEX_BUDGET,
        "data_dependent_shape": DATA_DEPENDENT_SHAPE_BUDGET,
        "collectives": GRADIENT_BUCKETS
        + BUFFER_SYNC_PER_DTYPE * buffer_dtypes
        + END_OF_DATA_PER_STEP,
    }


def _over_budget(out: dict[str, Any], kind: str, budget: int, top: int = 8) -> str | None:
    """What one worker counted of ``kind`` when over ``budget``, and where from."""
    per_step = [s.get(kind, 0) for s in out["steps"]]
    if max(per_step) <= budget:
        return None
    where = sorted(out["where"].get(kind, {}).items(), key=lambda item: (-item[1], item[0]))
    lines = [f"{kind} per step {per_step} (budget {budget}), from:"]
    lines += [f"    {n / len(per_step):g}/step  {location}" for location, n in where[:top]]
    if len(where) > top:
        lines.append(f"    ... and {len(where) - top} more places")
    return "\n".join(lines)


def _check_budgets(results: list[dict[str, Any]], budgets: dict[str, int]) -> None:
    failures: dict[str, list[int]] = {}  # message: the ranks it holds for
    for rank, out in enumerate(results):
        assert len(out["steps"]) == MEASURED_STEPS
        # The counters see the step: its ops, and the all-reduce of its gradients
        # (fewer means the library calls a collective that `_install` does not wrap).
        for counted in out["steps"]:
            assert counted.get("aten ops seen", 0) > 0, out["steps"]
            assert counted.get("collectives", 0) >= GRADIENT_BUCKETS, (
                f"rank {rank} counted fewer collectives than gradient buckets: {out['steps']}"
            )
        for kind, budget in budgets.items():
            message = _over_budget(out, kind, budget)
            if message is not None:
                failures.setdefault(message, []).append(rank)
    if failures:
        pytest.fail(
            "a steady-state training step went over budget:\n"
            + "\n".join(f"rank {', '.join(map(str, r))}: {m}" for m, r in failures.items()),
            pytrace=False,
        )


def _assert_workers_agree(results: list[dict[str, Any]]) -> None:
    """The counted steps trained in sync: every worker ends with the same model."""
    for name, value in results[0]["state"].items():
        for out in results[1:]:
            assert torch.equal(out["state"][name], value), name


def test_batchnorm_training_step_makes_no_host_sync_and_only_bucket_and_buffer_collectives() -> (
    None
):
    results = launch.run(_train_and_count, 2, args=(True,), timeout=150)
    _assert_workers_agree(results)
    assert results[0]["buffer_dtypes"] == ["torch.float32", "torch.int64"]
    _check_budgets(results, _budgets(buffer_dtypes=2))


def test_plain_training_step_makes_no_host_sync_and_only_bucket_collectives() -> None:
    results = launch.run(_train_and_count, 2, args=(False,), timeout=150)
    _assert_workers_agree(results)
    assert results[0]["buffer_dtypes"] == []
    _check_budgets(results, _budgets(buffer_dtypes=0))
