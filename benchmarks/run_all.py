"""Reruns the benchmarks behind the performance page and stores one dated results file.

    python benchmarks/run_all.py --quick        # a few minutes on a quiet 2-core machine
    python benchmarks/run_all.py                # the full runs (about half an hour)
    python benchmarks/run_all.py --quick --tf-python ~/.cache/distribute/tf-venv/bin/python
    python benchmarks/charts.py                 # the page's charts and table from it

Every benchmark script of ``SCRIPTS`` runs ``--repeats`` times, each time as a new
process, the scripts taking turns (A B C A B C ...: a load that comes and goes hits
them alike). From each run's JSON lines one number per figure of ``FIGURES`` is
taken: a repetition. The results go to ``benchmarks/results/<date>-<mode>.jsonl``:
a ``run`` line (date, machine, versions, command, the load average before and after)
and one ``figure`` line per figure with every repetition, their median, minimum and
maximum, the load average (1 minute) before each repetition, the script's command,
the baseline, the goal and the caveat the page prints beside it. A figure whose
script failed or could not run (no TensorFlow environment) is stored with
``"status": "not rerun"`` and the reason; the page says so in its row.

The TensorFlow head-to-head needs TensorFlow 2.21 in its own environment
(``bench_vs_tensorflow.py``): ``--tf-python`` or ``DISTRIBUTE_TF_PYTHON``, else
``~/.cache/distribute/tf-venv/bin/python`` when it exists.

Timings taken on a loaded machine are noise: each line carries the load average, and
the page prints the range of the repetitions, never the best one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_TF_PYTHON = Path.home() / ".cache" / "distribute" / "tf-venv" / "bin" / "python"

Line = dict[str, Any]


@dataclass(frozen=True)
class Script:
    """A benchmark script and its arguments in each mode."""

    name: str
    path: str
    quick: tuple[str, ...]
    full: tuple[str, ...]
    needs_tf: bool = False
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: int = 900


@dataclass(frozen=True)
class Figure:
    """One number taken from one run of a script."""

    name: str
    script: str
    title: str
    group: str  # "speed", "memory" or "overhead": which chart or table shows it
    select: dict[str, Any]  # fields the line must have (dotted for config fields)
    value: Callable[[Line], float]
    unit: str
    better: str  # "higher" or "lower"
    baseline: str
    goal: str | None
    caveat: str
    modes: tuple[str, ...] = ("quick", "full")


SCRIPTS = [
    Script(
        "vs_tensorflow",
        "benchmarks/bench_vs_tensorflow.py",
        ("--runs", "1"),
        ("--runs", "1"),
        needs_tf=True,
    ),
    Script(
        "multi_worker",
        "benchmarks/bench_multi_worker.py",
        ("--quick",),
        (),
        env={"OMP_NUM_THREADS": "1"},
    ),
    Script(
        "sharded_memory",
        "benchmarks/bench_sharded.py",
        ("--only", "memory", "--workers", "2", "--runs", "1"),
        ("--only", "memory", "--runs", "1"),
    ),
    Script(
        "mirrored",
        "benchmarks/bench_mirrored.py",
        ("--quick", "--only", "train_step,step_overhead"),
        ("--only", "train_step,step_overhead"),
    ),
    Script("fit", "benchmarks/bench_fit.py", ("--quick",), ()),
    Script("dataset", "benchmarks/bench_dataset.py", ("--quick", "--only", "map_style"), ()),
]

_TIME_CAVEAT = "a time ratio: on a loaded machine it swings with the load (see the load column)"

FIGURES = [
    Figure(
        "vs_tensorflow_loop",
        "vs_tensorflow",
        "Custom loop vs TensorFlow 2.21 (MirroredStrategy, 2 CPU devices)",
        "speed",
        {"bench": "loop"},
        lambda line: line["distribute_steps_per_s"] / line["tensorflow_steps_per_s"],
        "speed ratio",
        "higher",
        "TensorFlow 2.21's custom loop (tf.function step), its own process",
        None,
        "each side in its own process, one after the other: the pair sees different load",
    ),
    Figure(
        "vs_tensorflow_fit",
        "vs_tensorflow",
        "Model.fit vs Keras fit, TF 2.21 (MirroredStrategy, 2 CPU devices)",
        "speed",
        {"bench": "fit"},
        lambda line: line["distribute_steps_per_s"] / line["tensorflow_steps_per_s"],
        "speed ratio",
        "higher",
        "Keras 3's fit on TensorFlow 2.21 (second epoch timed)",
        None,
        "Keras's fit runs extra per-epoch work (callbacks, logs) on top of the step",
    ),
    Figure(
        "vs_ddp_step",
        "multi_worker",
        "Training step vs DDP (MultiWorkerMirrored, 2 gloo workers)",
        "speed",
        {"bench": "train_step_vs_ddp"},
        lambda line: line["baseline_ms"] / line["distribute_ms"],
        "speed ratio",
        "higher",
        "DistributedDataParallel, same model, buckets and threads, interleaved",
        ">= 1.0",
        "with one worker per process on 2 cores; on a GPU with one worker DDP pays an "
        "all-reduce that the strategy skips, so compare at 2 or more workers",
    ),
    *[
        Figure(
            f"sharded_{key}_{workers}",
            "sharded_memory",
            f"FullyShardedStrategy: {what} per worker, {workers} workers",
            "memory",
            {"bench": f"{key}_vs_mirrored", "workers": workers},
            lambda line: line["ratio"],
            "memory ratio",
            "lower",
            "MultiWorkerMirroredStrategy, same model (8 x Linear(1024, 1024), Adam)",
            goal,
            caveat,
            modes=("quick", "full") if workers == 2 else ("full",),
        )
        for workers in (2, 4)
        for key, what, goal, caveat in (
            ("state", "state kept", f"1/{workers}", "exact; independent of the load"),
            (
                "peak",
                "peak of live tensors",
                None,
                "plus a transient of about one gathered layer, which does not shrink with W",
            ),
            (
                "rss",
                "resident set growth",
                None,
                "includes some 40 MiB of allocator and gloo memory that does not shrink with W",
            ),
        )
    ],
    Figure(
        "mirrored_step_sgd",
        "mirrored",
        "MirroredStrategy, 1 replica, training step (SGD momentum)",
        "overhead",
        {"bench": "train_step", "config.replicas": 1, "config.optimizer": "sgd_momentum"},
        lambda line: line["paired_ratio"],
        "time ratio",
        "lower",
        "plain PyTorch, same model (MLP 2.1M params, batch 256) and optimizer",
        "<= 1.05",
        _TIME_CAVEAT,
    ),
    Figure(
        "mirrored_step_adam",
        "mirrored",
        "MirroredStrategy, 1 replica, training step (Adam)",
        "overhead",
        {"bench": "train_step", "config.replicas": 1, "config.optimizer": "adam"},
        lambda line: line["paired_ratio"],
        "time ratio",
        "lower",
        "plain PyTorch, same model and optimizer",
        "<= 1.05",
        _TIME_CAVEAT,
    ),
    Figure(
        "mirrored_fixed_cost",
        "mirrored",
        "MirroredStrategy, 1 replica: fixed cost per step (tiny MLP)",
        "overhead",
        {"bench": "step_overhead"},
        lambda line: line["overhead_us"],
        "microseconds per step",
        "lower",
        "plain PyTorch, MLP 32-64-10, batch 32",
        None,
        "a difference of two short times: the noisiest figure here",
    ),
    Figure(
        "fit_vs_loop",
        "fit",
        "ds.Model.fit vs the same steps by hand (1 replica)",
        "overhead",
        {"bench": "fit_step", "config.replicas": 1, "config.metrics": []},
        lambda line: line["paired_ratio"],
        "time ratio",
        "lower",
        "a hand-written strategy.run loop, same model, data and optimizer",
        "<= 1.03",
        _TIME_CAVEAT,
    ),
    Figure(
        "dataset_map_style",
        "dataset",
        "DistributedDataset vs the bare DataLoader (4 replicas)",
        "overhead",
        {"bench": "map_style", "config.replicas": 4},
        lambda line: line["ratio"],
        "throughput ratio",
        "higher",
        "the same DataLoader iterated bare (map-style, default collate)",
        ">= 0.97",
        "splitting any batch in 4 costs something: the floor is printed by the script",
    ),
]


def _field(line: Line, dotted: str) -> Any:
    value: Any = line
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def matches(line: Line, select: dict[str, Any]) -> bool:
    """Whether ``line`` has every field of ``select`` (``config.replicas``: nested)."""
    return all(_field(line, key) == want for key, want in select.items())


def json_lines(text: str) -> list[Line]:
    """The JSON object lines of a script's output (warnings and other lines skipped)."""
    lines = []
    for raw in text.splitlines():
        raw = raw.strip()
        if raw.startswith("{"):
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                continue
    return lines


def summary(values: list[float]) -> dict[str, float]:
    """Median, minimum and maximum of the repetitions."""
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip()


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                model = text.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        memory_gib = round(pages * size / 2**30, 1)
    except (OSError, ValueError, AttributeError):
        pass
    return {
        "cpu": model,
        "cpu_count": os.cpu_count(),
        "memory_gib": memory_gib,
        "system": platform.platform(),
    }


def versions(tf_python: str | None) -> dict[str, Any]:
    import numpy
    import torch

    found: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "distribute_commit": _git("rev-parse", "--short", "HEAD"),
        "distribute_tree_clean": _git("status", "--porcelain") == "",
    }
    if tf_python:
        try:
            out = subprocess.run(
                [tf_python, "-c", "import tensorflow as tf; print(tf.__version__)"],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
            )
            found["tensorflow"] = out.stdout.strip().splitlines()[-1] if out.stdout else None
        except (OSError, subprocess.SubprocessError, IndexError):
            found["tensorflow"] = None
    return found


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def run_script(script: Script, quick: bool, tf_python: str | None) -> dict[str, Any]:
    """One run of ``script``: its command, JSON lines, seconds, load before and after."""
    args = [*(script.quick if quick else script.full)]
    if script.needs_tf:
        assert tf_python is not None
        args += ["--tf-python", tf_python]
    command = [sys.executable, script.path, *args]
    env = {**os.environ, **script.env, "PYTHONPATH": str(ROOT)}
    before, start = _load(), time.perf_counter()
    try:
        proc = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=script.timeout_s
        )
        error = None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr[-800:]}"
        stdout = proc.stdout
    except subprocess.TimeoutExpired as exc:
        error, stdout = f"timed out after {script.timeout_s} s", str(exc.stdout or "")
    return {
        "command": shlex.join(["python", *command[1:]]),
        "lines": json_lines(stdout),
        "seconds": round(time.perf_counter() - start, 1),
        "loadavg_1m_before": before,
        "loadavg_1m_after": _load(),
        "error": error,
    }


def figure_line(figure: Figure, runs: list[dict[str, Any]], common: Line) -> Line:
    """The stored line of ``figure`` from the runs of its script."""
    script = next(s for s in SCRIPTS if s.name == figure.script)
    record: Line = {
        "kind": "figure",
        **common,
        "figure": figure.name,
        "title": figure.title,
        "group": figure.group,
        "script": script.path,
        "unit": figure.unit,
        "better": figure.better,
        "baseline": figure.baseline,
        "goal": figure.goal,
        "caveat": figure.caveat,
    }
    values, loads, raw, problems = [], [], [], []
    for run in runs:
        if "skipped" in run:
            problems.append(run["skipped"])
            continue
        found = [line for line in run["lines"] if matches(line, figure.select)]
        if not found:
            problems.append(run["error"] or f"no line matching {figure.select}")
            continue
        values.append(round(float(figure.value(found[0])), 4))
        loads.append(run["loadavg_1m_before"])
        raw.append(found[0])
    if runs and "command" in runs[0]:
        record["script_command"] = runs[0]["command"]
    if not values:
        reason = problems[0] if problems else "not run"
        return {**record, "status": "not rerun", "reason": reason}
    return {
        **record,
        "status": "measured",
        "repetitions": values,
        **summary(values),
        "loadavg_1m_before_each": loads,
        "failed_repetitions": problems,
        "raw": raw,
    }


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the quick sizes (minutes)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each script")
    parser.add_argument("--tf-python", help="an interpreter with tensorflow 2.21")
    parser.add_argument(
        "--only", help="comma-separated script names: " + ", ".join(s.name for s in SCRIPTS)
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of results files")
    args = parser.parse_args(argv)
    tf_python = args.tf_python or os.environ.get("DISTRIBUTE_TF_PYTHON")
    if tf_python is None and DEFAULT_TF_PYTHON.exists():
        tf_python = str(DEFAULT_TF_PYTHON)
    chosen = [s for s in SCRIPTS if not args.only or s.name in args.only.split(",")]
    mode = "quick" if args.quick else "full"
    started = dt.datetime.now(dt.timezone.utc)
    command = shlex.join(["python", "benchmarks/run_all.py", *(argv or sys.argv[1:])])
    common: Line = {
        "date": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "mode": mode,
        "command": command,
        "machine": machine(),
        "versions": versions(tf_python),
    }
    load_before = _load()
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in chosen}
    for repeat in range(args.repeats):
        for script in chosen if repeat % 2 == 0 else chosen[::-1]:
            if script.needs_tf and not tf_python:
                runs[script.name].append(
                    {"skipped": "no TensorFlow environment (--tf-python); not rerun"}
                )
                continue
            run = run_script(script, args.quick, tf_python)
            runs[script.name].append(run)
            state = "failed: " + run["error"][:200] if run["error"] else "ok"
            print(
                f"[{repeat + 1}/{args.repeats}] {script.name}: {run['seconds']} s, "
                f"load {run['loadavg_1m_before']} -> {run['loadavg_1m_after']}, {state}",
                file=sys.stderr,
                flush=True,
            )
    finished = dt.datetime.now(dt.timezone.utc)
    header: Line = {
        "kind": "run",
        **common,
        "finished": finished.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "repeats": args.repeats,
        "scripts": [s.name for s in chosen],
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": _load(),
        "note": "load averages above the core count mean the timings are noisy",
    }
    lines = [header]
    lines += [
        figure_line(f, runs[f.script], common)
        for f in FIGURES
        if f.script in runs and mode in f.modes
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{started.strftime('%Y-%m-%dT%H%MZ')}-{mode}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    print(path)
    return path


if __name__ == "__main__":
    main()
