"""Where the host time of one steady training step goes, by function (issue 40).

    python benchmarks/profile_step.py                         # every path, ~1 min
    python benchmarks/profile_step.py --path one_replica      # or four_replica,
                                                              # multi_worker, fit
    python benchmarks/profile_step.py --path fit --top 30 --steps 200

The step is bench_mirrored.py's step_overhead step: an MLP 32-64-10, global batch 32,
cross-entropy, SGD with momentum (``--optimizer adam`` for Adam), written the
tf.distribute way (``strategy.reduce("sum", strategy.run(step, args=(x, y)))`` with
`compute_average_loss`, backward, step and zero_grad inside). Paths:

    one_replica    OneDeviceStrategy("cpu") and MirroredStrategy(["cpu:0"]).
    four_replica   MirroredStrategy over 4 logical CPUs, batches pre-split into
                   PerReplica (the replica threads are profiled too).
    multi_worker   MultiWorkerMirroredStrategy, 2 worker processes (gloo), batch 16
                   per worker; rank 0's profile.
    fit            ``ds.Model.fit`` under MirroredStrategy(["cpu:0"]), one epoch of
                   ``--steps`` steps over arrays, ``verbose=0``; per step = the epoch's
                   profile divided by its steps (the epoch's fixed cost included).
    baseline       the same step in plain PyTorch, for scale.

For each path, after a warm-up, ``--steps`` steady steps run twice: once under a call
counter (``sys.setprofile``: Python-level calls, all of them and those whose code is
in ``distribute/``), once under cProfile timed by each thread's CPU clock
(``time.thread_time``, which the machine's load moves less than the wall clock). It
prints one JSON line per path with the calls per step and the own CPU time per step
by where the code lives, then the top functions by cumulative time (per step, all
threads merged; ``--library``: the library's only): calls, own time and cumulative
time in microseconds. The counts are deterministic; the times are a profiler's
(inflated by its own hooks, about 1 µs a call) and move with the load.
tests/unit/test_host_budget.py pins the library's call counts.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

import distribute as ds  # noqa: E402  (after the path insert)

LIBRARY = str(ROOT / "distribute")
WARMUP = 5
LIBRARY_ONLY = False  # --library: list only the library's functions
LAYERS = (32, 64, 10)
BATCH = 32


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(LAYERS[0], LAYERS[1]), torch.nn.ReLU(), torch.nn.Linear(*LAYERS[1:])
    )


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def batches(global_batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(global_batch, LAYERS[0], generator=g),
            torch.randint(0, LAYERS[-1], (global_batch,), generator=g),
        )
        for _ in range(4)
    ]


# -- counting and profiling -----------------------------------------------------------


class CallCounter:
    """Counts Python 'call' events on every thread that `start` runs on."""

    def __init__(self) -> None:
        self.all = 0
        self.library = 0
        self._lock = threading.Lock()

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            library = frame.f_code.co_filename.startswith(LIBRARY)
            with self._lock:
                self.all += 1
                self.library += library

    def start(self) -> None:
        sys.setprofile(self._hook)

    def stop(self) -> None:
        sys.setprofile(None)


class ThreadProfiles:
    """One cProfile.Profile per thread that `start` runs on, merged by `stats`."""

    def __init__(self) -> None:
        self._profiles: list[cProfile.Profile] = []
        self._local = threading.local()
        self._lock = threading.Lock()

    def start(self) -> None:
        profile = cProfile.Profile(time.thread_time)  # CPU time: load moves it less
        self._local.profile = profile
        with self._lock:
            self._profiles.append(profile)
        profile.enable()

    def stop(self) -> None:
        self._local.profile.disable()

    def stats(self) -> pstats.Stats:
        first, *rest = self._profiles
        stats = pstats.Stats(first)
        for other in rest:
            stats.add(other)
        return stats


def on_every_thread(strategy: ds.Strategy | None, action: Callable[[], None]) -> None:
    """Runs ``action`` on this thread and, with replica threads, on each of them."""
    action()
    if strategy is not None and strategy.extended.worker_devices[1:]:
        strategy.run(action)


def measure(
    step: Callable[[], Any], steps: int, strategy: ds.Strategy | None = None
) -> tuple[CallCounter, pstats.Stats]:
    for _ in range(WARMUP):
        step()
    counter = CallCounter()
    on_every_thread(strategy, counter.start)
    for _ in range(steps):
        step()
    on_every_thread(strategy, counter.stop)
    profiles = ThreadProfiles()
    on_every_thread(strategy, profiles.start)
    for _ in range(steps):
        step()
    on_every_thread(strategy, profiles.stop)
    return counter, profiles.stats()


def where(filename: str) -> str:
    if filename.startswith(LIBRARY):
        return "distribute/" + filename[len(LIBRARY) + 1 :]
    if "/torch/" in filename:
        return "torch/" + filename.split("/torch/", 1)[1]
    return filename.rsplit("/", 1)[-1]


def top_functions(
    stats: pstats.Stats, per: int, top: int, library_only: bool
) -> list[dict[str, Any]]:
    rows = []
    for (filename, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if library_only and not filename.startswith(LIBRARY):
            continue
        rows.append(
            {
                "function": f"{where(filename)}:{line}({name})" if line else name,
                "calls": round(calls / per, 2),
                "own_us": round(own / per * 1e6, 1),
                "cum_us": round(cumulative / per * 1e6, 1),
            }
        )
    rows.sort(key=lambda r: r["cum_us"], reverse=True)
    return rows[:top]


def own_time_by_place(stats: pstats.Stats, per: int) -> dict[str, float]:
    """Own (exclusive) time per step by where the code is, in microseconds."""
    places: dict[str, float] = {}
    for (filename, _, _name), (_, _, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if filename.startswith(LIBRARY):
            place = "distribute (Python)"
        elif "/torch/" in filename:
            place = "torch (Python)"
        elif filename == "~":
            place = "C functions (torch ops, builtins)"
        else:
            place = "other Python (stdlib, ...)"
        places[place] = places.get(place, 0.0) + own / per * 1e6
    return {k: round(v, 1) for k, v in sorted(places.items(), key=lambda kv: -kv[1])}


def report(path: str, counter: CallCounter, stats: pstats.Stats, steps: int, top: int) -> None:
    print(
        json.dumps(
            {
                "path": path,
                "steps": steps,
                "python_calls_per_step": round(counter.all / steps, 2),
                "library_calls_per_step": round(counter.library / steps, 2),
                "own_us_per_step_by_place": own_time_by_place(stats, steps),
                "loadavg_1m": round(os.getloadavg()[0], 2),
            }
        ),
        flush=True,
    )
    for row in top_functions(stats, steps, top, LIBRARY_ONLY):
        print(
            f"  {row['calls']:>8} {row['own_us']:>9} {row['cum_us']:>9}  {row['function']}",
            flush=True,
        )


# -- the paths ------------------------------------------------------------------------


def strategy_step(strategy: ds.Strategy, optimizer_name: str) -> Callable[[], float]:
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer(optimizer_name, model.parameters())
    n = len(strategy.extended.worker_devices)  # local replicas
    workers = strategy.num_replicas_in_sync // n
    data: list[Any] = [
        (x, y) if n == 1 else (ds.PerReplica(x.chunk(n)), ds.PerReplica(y.chunk(n)))
        for x, y in batches(BATCH // workers, seed=strategy.extended.worker_index)
    ]
    counter = iter(range(sys.maxsize))

    def replica_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    def step() -> float:
        x, y = data[next(counter) % len(data)]
        return float(strategy.reduce("sum", strategy.run(replica_step, args=(x, y)), axis=None))

    return step


def baseline_step(optimizer_name: str) -> Callable[[], float]:
    model = make_model()
    optimizer = make_optimizer(optimizer_name, model.parameters())
    data = batches(BATCH)
    counter = iter(range(sys.maxsize))

    def step() -> float:
        x, y = data[next(counter) % len(data)]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach())

    return step


def fit_epoch(steps: int, optimizer_name: str) -> Callable[[], Any]:
    import numpy as np

    strategy = ds.MirroredStrategy(["cpu:0"])
    x = np.random.default_rng(0).normal(size=(steps * BATCH, LAYERS[0])).astype(np.float32)
    y = np.random.default_rng(1).integers(0, LAYERS[-1], size=steps * BATCH)
    with strategy.scope():
        model = ds.Model(make_model())
    model.compile(
        optimizer=lambda p: make_optimizer(optimizer_name, p),
        loss=torch.nn.CrossEntropyLoss(),
    )
    return lambda: model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def run_path(path: str, steps: int, optimizer_name: str, top: int) -> None:
    if path == "one_replica":
        for name, make in (
            ("one_replica OneDeviceStrategy", lambda: ds.OneDeviceStrategy("cpu")),
            ("one_replica MirroredStrategy(['cpu:0'])", lambda: ds.MirroredStrategy(["cpu:0"])),
        ):
            strategy = make()
            counter, stats = measure(strategy_step(strategy, optimizer_name), steps)
            report(name, counter, stats, steps, top)
    elif path == "four_replica":
        strategy = ds.MirroredStrategy([f"cpu:{i}" for i in range(4)])
        step = strategy_step(strategy, optimizer_name)
        counter, stats = measure(step, steps, strategy)
        report("four_replica MirroredStrategy(4 CPUs)", counter, stats, steps, top)
        strategy.extended._threads.shutdown(join=True)  # type: ignore[attr-defined]
    elif path == "fit":
        epoch = fit_epoch(steps, optimizer_name)
        counter, stats = measure(epoch, 1)
        report(f"fit (one epoch of {steps} steps, per step)", counter, stats, steps, top)
    elif path == "baseline":
        counter, stats = measure(baseline_step(optimizer_name), steps)
        report("baseline plain PyTorch", counter, stats, steps, top)
    elif path == "multi_worker":
        from distribute import launch

        lines = launch.run(
            _multi_worker, 2, args=(steps, optimizer_name, top, LIBRARY_ONLY), timeout=300
        )
        print(lines[0], end="", flush=True)
    else:
        raise SystemExit(f"unknown path {path!r}")


def _multi_worker(steps: int, optimizer_name: str, top: int, library_only: bool) -> str:
    import contextlib
    import io

    global LIBRARY_ONLY
    LIBRARY_ONLY = library_only

    torch.set_num_threads(1)
    strategy = ds.MultiWorkerMirroredStrategy()
    step = strategy_step(strategy, optimizer_name)
    counter, stats = measure(step, steps)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report(
            "multi_worker MultiWorkerMirroredStrategy (2 workers, rank 0)",
            counter,
            stats,
            steps,
            top,
        )
    return out.getvalue()


PATHS = ("baseline", "one_replica", "four_replica", "multi_worker", "fit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", choices=PATHS, action="append")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--optimizer", choices=("sgd_momentum", "adam"), default="sgd_momentum")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--library", action="store_true", help="list distribute/ only")
    args = parser.parse_args()
    global LIBRARY_ONLY
    LIBRARY_ONLY = args.library
    torch.set_num_threads(args.threads)
    print("columns: calls/step  own_us/step  cum_us/step  function", flush=True)
    for path in args.path or PATHS:
        run_path(path, args.steps, args.optimizer, args.top)


if __name__ == "__main__":
    main()
