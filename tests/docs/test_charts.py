"""The performance page's figures come from one results file of benchmarks/run_all.py.

benchmarks/charts.py draws the charts and writes the tables (benchmarks/results/figures.md,
included by docs/guide/performance.md) from the newest results file only; these pin
that the committed charts and tables are what the committed results file gives, that
ranges (not best runs) are shown, and that a figure that could not run says so.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _charts() -> ModuleType:
    pytest.importorskip("matplotlib", reason="matplotlib (the docs extra) draws the charts")
    return _module("charts")


def _run_line(**changes: object) -> dict[str, object]:
    line = {
        "kind": "run",
        "date": "2026-11-28T22:43:00Z",
        "finished": "2026-11-28T22:50:00Z",
        "mode": "quick",
        "command": "python benchmarks/run_all.py --quick",
        "machine": {"cpu": "a CPU", "cpu_count": 2, "memory_gib": 8.0, "system": "Linux"},
        "versions": {
            "python": "3.11.7",
            "torch": "2.13.0+cpu",
            "tensorflow": None,
            "distribute_commit": "abc1234",
        },
        "repeats": 3,
        "loadavg_1m_before": 0.5,
        "loadavg_1m_after": 0.7,
    }
    return {**line, **changes}


def _figure(name: str, group: str, values: list[float] | None, **extra: object) -> dict:
    line = {
        "kind": "figure",
        "figure": name,
        "title": f"{name} title",
        "group": group,
        "unit": "speed ratio",
        "better": "higher",
        "baseline": f"{name} baseline",
        "goal": None,
        "caveat": f"{name} caveat",
        **extra,
    }
    if values is None:
        return {**line, "status": "not rerun", "reason": "no TensorFlow environment"}
    return {
        **line,
        "status": "measured",
        "repetitions": values,
        "median": sorted(values)[len(values) // 2],
        "min": min(values),
        "max": max(values),
        "loadavg_1m_before_each": [0.5, 0.6, 0.7][: len(values)],
    }


def _results(tmp_path: Path, run: dict[str, object]) -> Path:
    memory = {
        "bench": "state_vs_mirrored",
        "workers": 2,
        "baseline_mib": {"median": 128.0},
        "distribute_mib": {"median": 64.0},
    }
    lines = [
        run,
        _figure("vs_tensorflow_loop", "speed", None),
        _figure("vs_ddp_step", "speed", [0.9, 1.0, 1.1]),
        _figure("sharded_state_2", "memory", [0.5, 0.5, 0.5], raw=[memory] * 3),
        _figure("fit_vs_loop", "overhead", [1.01, 1.02, 1.05]),
    ]
    path = tmp_path / "2026-11-28T2243Z-quick.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_charts_and_tables_come_from_the_results_file(tmp_path: Path) -> None:
    charts = _charts()
    path = _results(tmp_path, _run_line())
    written = charts.main(
        ["--results", str(path), "--out", str(tmp_path), "--tables", str(tmp_path / "t.md")]
    )
    assert [p.name for p in written] == ["speed.png", "sharded_memory.png", "t.md"]
    for png in written[:2]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = written[2].read_text()
    assert "`python benchmarks/run_all.py --quick`" in text
    assert "2026-11-28T22:43:00Z" in text and path.name in text
    assert "**1.00** (0.90-1.10, 3 runs)" in text  # the median and the whole range
    assert "not rerun: no TensorFlow environment" in text
    assert "vs_ddp_step caveat" in text  # the caveat in the figure's row
    assert "A loaded machine" not in text
    for section in ("run", "speed", "memory", "overhead"):
        assert f"[start:{section}]" in text and f"[end:{section}]" in text


def test_a_loaded_machine_is_said_beside_the_figures(tmp_path: Path) -> None:
    charts = _charts()
    run, figures = charts.read_run(_results(tmp_path, _run_line(loadavg_1m_after=9.5)))
    text = charts.tables(run, figures, tmp_path / "x.jsonl")
    assert "A loaded machine" in text and "0.5 to 9.5 on 2 cores" in text


def test_memory_is_read_per_world_size_from_the_raw_lines(tmp_path: Path) -> None:
    charts = _charts()
    _, figures = charts.read_run(_results(tmp_path, _run_line()))
    assert charts.memory_table(figures) == {2: {"state": (128.0, 64.0)}}


def test_the_committed_tables_and_charts_are_those_of_the_newest_results_file(
    tmp_path: Path,
) -> None:
    charts = _charts()
    files = charts.results_files(ROOT / "benchmarks" / "results")
    assert files, "no results file of benchmarks/run_all.py is committed"
    run, figures = charts.read_run(files[-1])
    assert run["date"][:4].isdigit() and figures
    committed = (ROOT / "benchmarks" / "results" / "figures.md").read_text()
    assert committed == charts.tables(run, figures, files[-1]), (
        "benchmarks/results/figures.md is not what benchmarks/charts.py writes from "
        f"{files[-1].name}: run python benchmarks/charts.py"
    )
    for name in ("speed.png", "sharded_memory.png"):
        assert (ROOT / "docs" / "assets" / "charts" / name).stat().st_size > 10_000


def test_run_all_keeps_every_repetition_and_names_a_figure_it_could_not_run() -> None:
    run_all = _module("run_all")
    figure = next(f for f in run_all.FIGURES if f.name == "vs_ddp_step")
    runs = [
        {
            "command": "python benchmarks/bench_multi_worker.py --quick",
            "lines": [{"bench": "train_step_vs_ddp", "baseline_ms": 10.0, "distribute_ms": ms}],
            "loadavg_1m_before": 1.0,
            "error": None,
        }
        for ms in (10.0, 8.0, 12.5)
    ]
    line = run_all.figure_line(figure, runs, {"date": "d"})
    assert line["repetitions"] == [1.0, 1.25, 0.8]
    assert (line["median"], line["min"], line["max"]) == (1.0, 0.8, 1.25)
    assert line["loadavg_1m_before_each"] == [1.0, 1.0, 1.0]
    tf = next(f for f in run_all.FIGURES if f.name == "vs_tensorflow_loop")
    skipped = run_all.figure_line(tf, [{"skipped": "no TensorFlow environment"}], {})
    assert skipped["status"] == "not rerun" and "TensorFlow" in skipped["reason"]
