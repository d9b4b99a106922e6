"""The host work of one steady training step stays within a recorded budget (issue 40).

The Python the library runs around each step (nest walks in `run`, thread hops,
optimizer hooks, `fit`'s bookkeeping) is what a small model or a fast device
exposes. Timing it in a test would flake, so this pins it by counting instead: the
Python-level calls into code under ``distribute/`` during steady steps (a
``sys.setprofile`` hook on every thread, the replica threads included), per step.
The count is deterministic for one replica and `fit`; with several replicas the
order in which threads meet moves it by a few calls, hence the margins.

A change that adds work to the hot path fails here: make the work once per
signature, layout or optimizer instead of once per step, or, where the work is
needed, raise the budget in the same change and say why.
``python benchmarks/profile_step.py --library --path <path>`` shows where the calls go.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import distribute as ds

_PACKAGE = str(Path(ds.__file__).resolve().parent)

#: Library calls per steady step, ceilings about 10% over what the step made when the
#: budget was recorded (in parentheses; issue 40's cuts brought them down from the
#: figures after "was").
BUDGETS = {
    # (12; was 94, then 48, 41: the quiet hooks and one replica's inline `run`)
    "one_device": 14,
    "mirrored_1": 14,
    # (605; was 2124-2126, then 1349, 870, 773: the gradients unpacked, the op loop)
    "mirrored_4": 670,
    # (50.3 averaged over an epoch of 20 steps; was 146.5, then 85.4, 73.6, 64.6. The
    # arrays' batches are gathered by the library with one index per tensor since,
    # `test_step_paths.py`, where torch's TensorDataset and collate made ~200 calls a
    # step that this count does not see)
    "fit": 56,
}

WARMUP_STEPS = 5
MEASURED_STEPS = 20
LAYERS = (32, 64, 10)
GLOBAL_BATCH = 32


class _LibraryCalls:
    """Counts Python calls into ``distribute/`` on every thread, while `active`."""

    def __init__(self) -> None:
        self.active = False
        self.count = 0
        self._lock = threading.Lock()

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if self.active and event == "call" and frame.f_code.co_filename.startswith(_PACKAGE):
            with self._lock:
                self.count += 1

    def per_step(self, step: Callable[[], Any], steps: int) -> float:
        for _ in range(WARMUP_STEPS):
            step()
        self.active = True
        for _ in range(steps):
            step()
        self.active = False
        return self.count / steps


@contextlib.contextmanager
def _counting() -> Iterator[_LibraryCalls]:
    """A counter hooked into this thread and every thread started from now on (the
    replica threads start at the first multi-replica `run`)."""
    counter = _LibraryCalls()
    threading.setprofile(counter.hook)
    sys.setprofile(counter.hook)
    try:
        yield counter
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]  # None unsets it


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(LAYERS[0], LAYERS[1]), torch.nn.ReLU(), torch.nn.Linear(*LAYERS[1:])
    )


def _custom_loop_step(strategy: ds.Strategy) -> Callable[[], float]:
    """bench_mirrored.py's step_overhead step: `run`, then `reduce`."""
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    n = strategy.num_replicas_in_sync
    x = torch.randn(GLOBAL_BATCH, LAYERS[0])
    y = torch.randint(0, LAYERS[-1], (GLOBAL_BATCH,))
    args: tuple[Any, ...] = (
        (x, y) if n == 1 else (ds.PerReplica(x.chunk(n)), ds.PerReplica(y.chunk(n)))
    )

    def replica_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    def step() -> float:
        return float(strategy.reduce("sum", strategy.run(replica_step, args=args), axis=None))

    return step


MAKERS: dict[str, Callable[[], ds.Strategy]] = {
    "one_device": lambda: ds.OneDeviceStrategy("cpu"),
    "mirrored_1": lambda: ds.MirroredStrategy(["cpu:0"]),
    "mirrored_4": lambda: ds.MirroredStrategy([f"cpu:{i}" for i in range(4)]),
}


def _custom_loop_calls(name: str) -> float:
    strategy = MAKERS[name]()
    with _counting() as counter:
        try:
            return counter.per_step(_custom_loop_step(strategy), MEASURED_STEPS)
        finally:
            threads = getattr(strategy.extended, "_threads", None)
            if threads is not None:
                threads.shutdown(join=True)


def _fit_calls() -> float:
    strategy = ds.MirroredStrategy(["cpu:0"])
    steps = MEASURED_STEPS
    x = np.random.default_rng(0).normal(size=(steps * GLOBAL_BATCH, LAYERS[0])).astype(np.float32)
    y = np.random.default_rng(1).integers(0, LAYERS[-1], size=steps * GLOBAL_BATCH)
    with strategy.scope():
        model = ds.Model(_model())
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
        loss=torch.nn.CrossEntropyLoss(),
    )

    def epoch() -> None:
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)

    with _counting() as counter:
        return counter.per_step(epoch, 1) / steps


def _in_a_fresh_interpreter(name: str) -> float:
    """The count for ``name``, measured in a new interpreter: what earlier tests left
    in this process (a multi-replica strategy's variables, hooks, modes) changes a
    steady step's calls by a few, and the budget is the library's, not the suite's."""
    out = subprocess.run(
        [sys.executable, __file__, name],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_custom_loop_step_stays_within_its_library_call_budget(name: str) -> None:
    per_step = _in_a_fresh_interpreter(name)
    assert per_step <= BUDGETS[name], (
        f"one steady step under {name} made {per_step:.1f} library calls, over its budget "
        f"of {BUDGETS[name]}; see where they go with `python benchmarks/profile_step.py "
        "--library`, and cut them or raise the budget saying why"
    )


def test_fit_step_stays_within_its_library_call_budget() -> None:
    per_step = _in_a_fresh_interpreter("fit")
    assert per_step <= BUDGETS["fit"], (
        f"a steady fit step made {per_step:.1f} library calls (an epoch of "
        f"{MEASURED_STEPS} steps, averaged), over its budget of {BUDGETS['fit']}; see "
        "where they go with `python benchmarks/profile_step.py --library --path fit`, "
        "and cut them or raise the budget saying why"
    )


if __name__ == "__main__":  # one measurement, printed (`_in_a_fresh_interpreter`)
    which = sys.argv[1]
    print(_fit_calls() if which == "fit" else _custom_loop_calls(which))
