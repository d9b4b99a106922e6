"""ParameterServerStrategy: scaling over workers, and the cost of one round trip.

    python benchmarks/bench_ps.py            # ~3 min
    python benchmarks/bench_ps.py --quick    # smoke run

Prints JSON lines.

``{"bench": "ps_scaling", "read_ms", "workers", "steps_per_s", "speedup", "goal"}``:
a step dominated by waiting (a "slow data read" of ``read_ms``, 50 ms and 20 ms,
then a small model's forward, backward and an SGD update applied on the ps)
scheduled ``steps`` times with 1, 2 and 4 workers and 1 ps; ``speedup`` = steps/s
over the 1-worker figure at the same read time, goal: 4 workers >= 3.6. On a
2-core machine the 7 processes of the 4-worker cluster (chief, 4 workers, ps, and
the benchmark) share the cores: the shorter the read, the more the steps' CPU work
(about 5 ms a step, spread over chief, worker and ps) limits the speedup.

``{"bench": "ps_round_trip", "what", "baseline_ms", "distribute_ms", "ratio", "goal"}``:
``schedule+fetch`` of a closure returning a constant against a bare
``rpc_sync`` to a worker of a function returning a constant (its name); ``variable read``
(`ParameterServerVariable.read_value` of a 1,000-element variable) against a bare
``rpc_sync`` of the ps-side read itself (so the ratio is the chief-side cost:
the call's wrapper, error translation and the local copy's update). Repetitions
of 20 calls each, the bare and ours adjacent and in alternating order; ``ratio`` is
the median of the repetitions' ratios, the times their medians (2 workers, 1 ps);
goal ratio <= 1.5.

Each configuration runs in its own process (rpc is per process); the tasks are
local processes (`ds.coordinator.LocalCluster`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import distribute as ds

READ_MS = (50, 20)


def _scaling(workers: int, steps: int, read_ms: int) -> dict[str, Any]:
    read_seconds = read_ms / 1000
    with ds.coordinator.LocalCluster(num_workers=workers, num_ps=1) as cluster:
        strategy = ds.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            model = torch.nn.Linear(32, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        coordinator = ds.coordinator.ClusterCoordinator(strategy)

        def step() -> float:
            time.sleep(read_seconds)  # the slow data read
            x = torch.randn(16, 32)
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return float(loss.detach())

        for _ in range(2 * workers):  # warm-up: every worker has the function
            coordinator.schedule(step)
        coordinator.join()
        start = time.perf_counter()
        for _ in range(steps):
            coordinator.schedule(step)
        coordinator.join()
        elapsed = time.perf_counter() - start
        strategy.shutdown()
    return {"workers": workers, "read_ms": read_ms, "steps_per_s": steps / elapsed}


def _round_trip(reps: int) -> list[dict[str, Any]]:
    import torch.distributed.rpc as rpc

    # Bare rpc_sync calls of Python functions on the tasks: a constant (the task's
    # name), and the ps's read of the variable (what read_value asks the ps for).
    from distribute.ps._runtime import ps_read, worker_ping

    with ds.coordinator.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = ds.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            variable = ds.Variable(torch.zeros(1000))
        coordinator = ds.coordinator.ClusterCoordinator(strategy)

        def constant() -> int:
            return 1

        coordinator.schedule(constant).fetch()
        coordinator.schedule(constant).fetch()
        cases = {
            "schedule+fetch": (
                lambda: rpc.rpc_sync("worker_0", worker_ping),
                lambda: coordinator.schedule(constant).fetch(),
            ),
            "variable read": (
                lambda: rpc.rpc_sync("ps_0", ps_read, args=([variable.handle.var_id],)),
                variable.read_value,
            ),
        }
        out = []
        for what, (bare, ours) in cases.items():
            base, mine = [], []
            for rep in range(reps):
                # adjacent in time, in alternating order: a rep's ratio is immune to
                # the machine's drift between reps
                pairs = ((bare, base), (ours, mine))
                for fn, times in pairs if rep % 2 == 0 else pairs[::-1]:
                    start = time.perf_counter()
                    for _ in range(20):
                        fn()
                    times.append((time.perf_counter() - start) / 20 * 1000)
            out.append(
                {
                    "bench": "ps_round_trip",
                    "what": what,
                    "baseline_ms": round(statistics.median(base), 4),
                    "distribute_ms": round(statistics.median(mine), 4),
                    "ratio": round(statistics.median(m / b for b, m in zip(base, mine)), 3),
                    "goal": "<= 1.5",
                }
            )
        strategy.shutdown()
    return out


def _child(case: str, quick: bool) -> None:
    if case == "round_trip":
        for line in _round_trip(5 if quick else 60):
            print(json.dumps(line), flush=True)
    else:
        workers, read_ms = (int(part) for part in case.split(":"))
        steps = 12 if quick else 60 * workers
        print(json.dumps(_scaling(workers, steps, read_ms)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case is not None:
        _child(args.case, args.quick)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(case: str) -> list[dict[str, Any]]:
        cmd = [sys.executable, __file__, "--case", case] + (["--quick"] if args.quick else [])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"case {case} failed:\n{done.stderr[-3000:]}")
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    print(json.dumps({"loadavg_1m_before": os.getloadavg()[0]}))
    for read_ms in READ_MS:
        scaling = [run(f"{w}:{read_ms}")[0] for w in (1, 2, 4)]
        one = scaling[0]["steps_per_s"]
        for row in scaling:
            print(
                json.dumps(
                    {
                        "bench": "ps_scaling",
                        "read_ms": read_ms,
                        "workers": row["workers"],
                        "steps_per_s": round(row["steps_per_s"], 2),
                        "speedup": round(row["steps_per_s"] / one, 3),
                        "goal": ">= 3.6 at 4 workers",
                    }
                )
            )
    for line in run("round_trip"):
        print(json.dumps(line))


if __name__ == "__main__":
    main()
