"""The GPU check's driver (tests/gpu/device_check.py) judges its parts' processes right.

A lent GPU is used once, so the driver must say what happened to every part whatever
happened: a part that raises, crashes, hangs past its limit, skips, or finds no time
left gets the status that says so, the others still run, and the report is on disk
after each part. The parts here are tiny scripts that speak the part protocol (JSON
lines in ``records.jsonl``; see tests/gpu/_check_common.py): no torch, no GPU.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

DRIVER = Path(__file__).resolve().parents[1] / "gpu" / "device_check.py"

#: A part module: each part records what its name says, then ends as its name says.
FAKE_PARTS = """
import argparse, json, os, sys, time

parser = argparse.ArgumentParser()
parser.add_argument("parts", nargs="+")
parser.add_argument("--work", required=True)
parser.add_argument("--budget", type=float)
parser.add_argument("--dry-run", action="store_true")
args = parser.parse_args()
os.makedirs(args.work, exist_ok=True)

def write(**record):
    with open(os.path.join(args.work, "records.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\\n")

for part in args.parts:
    if part == "passes":
        write(part=part, kind="figure", name="a ratio", ratio=1.01, paired_ratio=1.0,
              paired_ratio_iqr=[0.99, 1.02], goal="<= 1.05")
        write(part=part, kind="check", name="numbers agree", status="passed")
    elif part == "fails":
        write(part=part, kind="check", name="numbers agree", status="failed: 0.1 apart")
    elif part == "skips":
        write(part=part, kind="check", name="needs CUDA", status="skipped: no CUDA")
    elif part == "crashes":
        print("about to crash", flush=True)
        os._exit(3)
    elif part == "hangs":
        write(part=part, kind="check", name="started", status="passed")
        print("hanging", flush=True)
        time.sleep(600)
    write(part=part, kind="done", seconds=0.0, ok=True)
"""


@pytest.fixture
def driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The driver module, finding its part modules in ``tmp_path``."""
    spec = importlib.util.spec_from_file_location("device_check_under_test", DRIVER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look it up there
    spec.loader.exec_module(module)
    (tmp_path / "_fake_parts.py").write_text(FAKE_PARTS)
    monkeypatch.setattr(module, "HERE", tmp_path)
    return module


def _run(
    driver: ModuleType, tmp_path: Path, names: list[str], limit: float, budget: float
) -> dict[str, Any]:
    parts = [driver.Part(n, "_fake_parts", limit, f"the part that {n}") for n in names]
    out = tmp_path / "out"
    out.mkdir()
    run = driver.Run(out, False, budget, [])
    driver.run_parts(run, parts, driver._env([], False), tmp_path / "work")
    report = json.loads((out / "device_check.json").read_text())
    assert report["parts"].keys() == set(names)
    return {"run": run, "report": report, "log": (out / "device_check.log").read_text()}


def test_each_part_gets_the_status_of_how_it_ended(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(driver, "MIN_PART_SECONDS", 1)
    start = time.monotonic()
    got = _run(driver, tmp_path, ["passes", "fails", "skips", "crashes", "hangs"], 3, 300)
    elapsed = time.monotonic() - start
    parts = got["report"]["parts"]
    assert parts["passes"]["status"] == "passed"
    assert parts["passes"]["figures"][0]["ratio"] == 1.01
    assert parts["fails"]["status"].startswith("failed: 1 check(s): numbers agree")
    assert "0.1 apart" in parts["fails"]["status"]
    assert parts["skips"]["status"] == "skipped: no CUDA"
    assert parts["crashes"]["status"] == "failed: its process exited 3 before the part finished"
    assert "about to crash" in parts["crashes"]["output_tail"]
    assert parts["hangs"]["status"] == "failed: timed out after 3 s before the part finished"
    assert parts["hangs"]["checks"] == [{"name": "started", "status": "passed"}]
    assert elapsed < 30, f"the hanging part was not stopped at its limit ({elapsed:.0f} s)"
    assert got["report"]["summary"] == {
        "passed": 1,
        "failed": 3,
        "skipped": 1,
        "setup_failed": [],
    }
    assert "hanging" in got["log"] and "about to crash" in got["log"]
    summary = driver.summary(got["run"])
    assert all(name in summary for name in parts), summary


def test_a_part_that_cannot_start_in_the_budget_is_skipped_saying_so(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(driver, "MIN_PART_SECONDS", 5)
    got = _run(driver, tmp_path, ["passes", "skips"], 3, 4)
    for status in (p["status"] for p in got["report"]["parts"].values()):
        assert status.startswith("skipped: out of time"), status
