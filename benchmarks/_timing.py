"""Timing helpers shared by the benchmarks: interleaved repetitions, quartiles, output.

Imported by the benchmark scripts, which run with this directory first on
``sys.path`` (and hand that path on to the worker processes they launch).
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any


def interleaved(
    cases: dict[str, Callable[[], Any]],
    reps: int,
    calls_per_rep: int,
    *,
    warmup_calls: int = 0,
    collect_each: bool = True,
) -> dict[str, list[float]]:
    """Seconds per call of each case, one sample per repetition of `calls_per_rep` calls.

    The cases run in turn inside every repetition, in an order that alternates
    (forward, then reversed), so slow drifts of the machine hit all of them alike.
    Each case is first called `warmup_calls` times. The garbage collector runs
    before every timed chunk (`collect_each`), or once before the first.
    """
    names = list(cases)
    for fn in cases.values():
        for _ in range(warmup_calls):
            fn()
    samples: dict[str, list[float]] = {n: [] for n in names}
    if not collect_each:
        gc.collect()
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            fn = cases[name]
            if collect_each:
                gc.collect()
            start = time.perf_counter()
            for _ in range(calls_per_rep):
                fn()
            samples[name].append((time.perf_counter() - start) / calls_per_rep)
    return samples


def quartiles(xs: list[float]) -> list[float]:
    """The first and third quartiles (both the value itself for one sample)."""
    if len(xs) < 2:
        return [xs[0], xs[0]]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[2]]


def emit(record: dict[str, Any]) -> None:
    """Prints one JSON line."""
    print(json.dumps(record), flush=True)
