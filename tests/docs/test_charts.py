"""benchmarks/charts.py draws the performance page's charts from the stored JSON lines."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _charts() -> ModuleType:
    pytest.importorskip("matplotlib", reason="matplotlib (the docs extra) draws the charts")
    spec = importlib.util.spec_from_file_location("charts", ROOT / "benchmarks" / "charts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stored_results_give_both_charts(tmp_path: Path) -> None:
    charts = _charts()
    written = charts.main(["--out", str(tmp_path)])
    assert [p.name for p in written] == ["speed.png", "sharded_memory.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (ROOT / "docs" / "assets" / "charts" / path.name).exists()  # committed


def test_speed_is_a_ratio_where_higher_is_faster_for_every_baseline() -> None:
    charts = _charts()
    lines = [
        {"bench": "loop", "distribute_steps_per_s": 300.0, "tensorflow_steps_per_s": 200.0},
        {"bench": "train_step_vs_ddp", "distribute_ms": 40.0, "baseline_ms": 50.0},
        {"bench": "train_step_vs_ddp", "distribute_ms": 60.0, "baseline_ms": 50.0},
    ]
    bars = dict(charts.speed_bars(lines))
    assert [round(v, 3) for v in bars.values()] == [1.5, 1.0]  # DDP: the inverted median time


def test_memory_is_read_per_world_size_from_bench_sharded_lines(tmp_path: Path) -> None:
    charts = _charts()
    line = {
        "bench": "peak_vs_mirrored",
        "workers": 4,
        "baseline_mib": {"median": 160.0, "max": 161.0},
        "distribute_mib": {"median": 50.0, "max": 54.0},
    }
    (tmp_path / "sharded.jsonl").write_text("warning: not JSON\n" + json.dumps(line) + "\n")
    table = charts.memory_table(charts.read_lines([tmp_path / "sharded.jsonl"]))
    assert table == {4: {"peak": (160.0, 50.0)}}
