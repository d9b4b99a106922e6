"""The GPU check (issue #26): everything a lent GPU must show, in one bounded run.

    tests/gpu/device_check.sh               # on the GPU machine, from the repository root
    tests/gpu/device_check.sh --dry-run     # the same run on the CPU (CI runs it)
    python3 tests/gpu/device_check.py --only parity,syncs --budget 120

Set-up first: wheels carried in ``.whl/`` (torchdata: the GPU machine has no network)
are installed into a folder put on ``PYTHONPATH``, then this package with ``pip
install --no-build-isolation --no-deps --no-index -e .`` (with ``--dry-run`` added in
a dry run, which leaves the environment alone). Then the parts, each in its own
process with its own time limit, so a hang or a crash costs that part alone:

==================  ==========================================================
pytest              ``pytest tests/gpu`` (what needs two GPUs skips, saying so)
parity              one training, five strategies, the same numbers (1e-4)
two_workers         MultiWorkerMirroredStrategy 2x1 on one GPU over gloo
sharded             FullyShardedStrategy as one NCCL worker: parity, step vs FSDP2 by hand
sharded_two_workers FullyShardedStrategy 2x1 on one GPU over gloo: parity, CUDA memory
syncs               host syncs per steady-state step, counted by the profiler
step_figures        the 1-replica step against plain PyTorch (small, ResNet-18)
ddp_figure          one-worker MultiWorkerMirroredStrategy against one-rank DDP
input_figure        DistributedDataset's prefetch against a bare pinned loader
amp_figures         bf16 autocast under the strategies against plain PyTorch
compile_figures     torch.compile under the strategies against plain PyTorch
==================  ==========================================================

(the ``_check_*.py`` modules' docstrings say exactly what each part does). The whole
run, set-up included, stays inside ``--budget`` seconds (330 by default: under 6
minutes; 600 in a dry run, for a loaded 2-core machine): each part gets its own limit
or what is left, and a part that cannot start with 20 seconds left is skipped, saying so.

Output, in ``--out`` (default ``$OUT``, else ``build/device-check``):
``device_check.json``, the report (rewritten after every part: a run cut short still
leaves one), and ``device_check.log``, every part's full output (tracebacks
included). For each part the report holds its status (``passed``, ``failed: why``,
``skipped: why``), its checks, figures and information, its duration and limit; and
the device, torch, CUDA, cuDNN and NCCL versions. The last lines printed are a summary.

A dry run (``--dry-run``) runs the same parts on the CPU with tiny sizes, five
processes instead of eleven (the parts of a module share one), CUDA-only checks
reporting "skipped: no CUDA"; its figures mean nothing. Without ``--dry-run`` a
machine without CUDA runs nothing and exits 2.

Exit status: 0 when no part and no set-up step failed, 1 when one did (the parts run from
the checkout even when the install failed), 2 without CUDA (not a dry run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WHEELS = ROOT / ".whl"
DEFAULT_BUDGET = 330.0  # seconds: under 6 minutes with the set-up
DRY_RUN_BUDGET = 600.0  # a shared 2-core machine can be 4x slower than an idle one
MIN_PART_SECONDS = 20.0
LOG_LIMIT = 400_000  # characters of one part's output kept in the log (head and tail)


@dataclass(frozen=True)
class Part:
    """One part: its module (None: pytest), its own limit on a GPU, what it does."""

    name: str
    module: str | None
    limit: float
    what: str


PARTS = (
    Part("pytest", None, 120, "pytest tests/gpu"),
    Part("parity", "_check_parity", 60, "5 strategies, the same losses and weights (1e-4)"),
    Part("two_workers", "_check_parity", 90, "MultiWorkerMirrored 2x1 on one GPU over gloo"),
    Part("sharded", "_check_sharded", 45, "FullySharded, one NCCL worker: parity, vs FSDP2"),
    Part("sharded_two_workers", "_check_sharded", 75, "FullySharded 2x1 over gloo: parity, memory"),
    Part("syncs", "_check_syncs", 60, "host syncs per steady-state step (profiler)"),
    Part("step_figures", "_check_figures", 60, "1-replica step vs plain PyTorch"),
    Part("ddp_figure", "_check_figures", 45, "one-worker MultiWorkerMirrored vs DDP"),
    Part("input_figure", "_check_figures", 40, "DistributedDataset prefetch vs pinned loader"),
    Part("amp_figures", "_check_figures", 40, "bf16 autocast vs plain PyTorch"),
    Part("compile_figures", "_check_figures", 120, "torch.compile vs plain PyTorch"),
)


class Run:
    """The report being built, the log being written, and the clock."""

    def __init__(self, out: Path, dry_run: bool, budget: float, argv: Sequence[str]) -> None:
        self.out = out
        self.dry_run = dry_run
        self.started = time.monotonic()
        self.deadline = self.started + budget
        self.log_path = out / "device_check.log"
        self.report_path = out / "device_check.json"
        self.log_path.write_text("")
        self.report: dict[str, Any] = {
            "mode": "dry-run (CPU)" if dry_run else "device",
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"
            ),
            "command": ["tests/gpu/device_check.py", *argv],
            "budget_seconds": budget,
            "commit": _commit(),
            "environment": {},
            "setup": {},
            "parts": {},
        }

    def log(self, text: str) -> None:
        with open(self.log_path, "a") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.report["duration_seconds"] = round(time.monotonic() - self.started, 1)
        statuses = [p["status"] for p in self.report["parts"].values()]
        self.report["summary"] = {
            kind: sum(s.startswith(kind) for s in statuses)
            for kind in ("passed", "failed", "skipped")
        }
        self.report["summary"]["setup_failed"] = [
            name
            for name, step in self.report["setup"].items()
            if step["status"].startswith("failed")
        ]
        tmp = self.report_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        os.replace(tmp, self.report_path)


def _commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def _clip(text: str) -> str:
    if len(text) <= LOG_LIMIT:
        return text
    half = LOG_LIMIT // 2
    return f"{text[:half]}\n[... {len(text) - LOG_LIMIT} characters left out ...]\n{text[-half:]}"


def _command(run: Run, name: str, cmd: list[str], timeout: float = 300) -> dict[str, Any]:
    """A set-up command, bounded; its output goes to the log."""
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        output, code = done.stdout + done.stderr, done.returncode
    except (OSError, subprocess.SubprocessError) as exc:
        output, code = f"{type(exc).__name__}: {exc}", -1
    run.log(f"=== setup: {name}: {' '.join(cmd)} (exit {code})\n{_clip(output)}")
    return {
        "status": "passed" if code == 0 else f"failed: exit {code}: {output.strip()[-500:]}",
        "command": " ".join(cmd),
        "seconds": round(time.monotonic() - start, 1),
    }


def setup(run: Run, work: Path) -> list[str]:
    """Installs the carried wheels and the package; returns the PYTHONPATH entries the
    parts need."""
    paths = []
    wheels = sorted(WHEELS.glob("*.whl"))
    if wheels:
        site = work / "site"
        result = _command(
            run,
            "wheels",
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--no-cache-dir",
                "--upgrade",
                "--target",
                str(site),
                *map(str, wheels),
            ],
        )
        result["wheels"] = [w.name for w in wheels]
        run.report["setup"]["wheels"] = result
        paths.append(str(site))
    else:
        run.report["setup"]["wheels"] = {"status": "skipped: no .whl/*.whl here"}
    install = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-build-isolation",
        "--no-deps",
        "--no-index",
        "-e",
        ".",
    ]
    if run.dry_run:
        install.insert(4, "--dry-run")  # the same command, leaving the environment alone
    run.report["setup"]["package"] = _command(run, "package", install)
    paths.append(str(ROOT))  # the checkout is what runs, installed or not
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        query = "name,driver_version,memory.total,memory.used,temperature.gpu,clocks.sm,clocks.mem"
        result = _command(run, "nvidia-smi", [smi, f"--query-gpu={query}", "--format=csv"], 30)
        run.report["setup"]["nvidia_smi"] = result
    return paths


def _env(pythonpath: list[str], dry_run: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    if dry_run:
        env["OMP_NUM_THREADS"] = "1"
    return env


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the part's process group, then SIGKILL (launch's workers, in their
    own sessions, end by themselves once their parent is gone)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _launch(
    run: Run, label: str, cmd: list[str], env: dict[str, str], timeout: float, work: Path
) -> tuple[int | None, str]:
    """Runs one part's process; returns (exit code or None on a timeout, its output)."""
    work.mkdir(parents=True, exist_ok=True)
    output = work / f"{label}.out"
    with open(output, "wb") as sink:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            code = None
    text = output.read_text(errors="replace")
    run.log(
        f"=== part {label}: {' '.join(cmd)}\n(exit {code}, limit {timeout:.0f} s)\n{_clip(text)}"
    )
    return code, text


def _records(work: Path) -> list[dict[str, Any]]:
    path = work / "records.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut off by a kill
    return records


def _part_result(
    part: Part, records: list[dict[str, Any]], code: int | None, limit: float, tail: str
) -> dict[str, Any]:
    """The report entry of one part from what its process recorded and how it ended."""
    mine = [r for r in records if r.get("part") == part.name]
    done = next((r for r in mine if r["kind"] == "done"), None)
    checks = [r for r in mine if r["kind"] == "check"]
    result: dict[str, Any] = {
        "what": part.what,
        "limit_seconds": round(limit),
        "seconds": done["seconds"] if done else None,
        "checks": [{k: v for k, v in r.items() if k not in ("part", "kind")} for r in checks],
        "figures": [
            {k: v for k, v in r.items() if k not in ("part", "kind")}
            for r in mine
            if r["kind"] == "figure"
        ],
        "info": [
            {k: v for k, v in r.items() if k not in ("part", "kind")}
            for r in mine
            if r["kind"] == "info"
        ],
    }
    failed = [
        f"{c['name']} ({c['status'][:300]})" for c in checks if c["status"].startswith("failed")
    ]
    if done is None:
        ended = f"timed out after {limit:.0f} s" if code is None else f"its process exited {code}"
        status = f"failed: {ended} before the part finished"
        result["output_tail"] = tail[-4000:]
    elif failed:
        status = f"failed: {len(failed)} check(s): {'; '.join(failed)[:1500]}"
        result["output_tail"] = tail[-4000:]
    elif (
        checks and all(c["status"].startswith("skipped") for c in checks) and not result["figures"]
    ):
        status = checks[0]["status"]
    else:
        status = "passed"
    result["status"] = status
    return result


def run_pytest(run: Run, env: dict[str, str], limit: float, work: Path) -> dict[str, Any]:
    junit = work / "junit.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/gpu",
        "-v",
        "-rs",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
    ]
    start = time.monotonic()
    code, text = _launch(run, "pytest", cmd, env, limit, work)
    tests = []
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"error": "failed", "failure": "failed"}.get(child.tag, child.tag)
                    message = (child.get("message") or child.text or "")[:500]
            tests.append(
                {
                    "test": f"{case.get('classname')}::{case.get('name')}",
                    "outcome": outcome,
                    "message": message,
                }
            )
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    if code is None:
        status = f"failed: timed out after {limit:.0f} s"
    elif code not in (0, 5) or counts["failed"]:
        names = [t["test"] for t in tests if t["outcome"] == "failed"]
        status = f"failed: pytest exited {code}; failed: {names[:10]}"
    elif counts["passed"] == 0:
        reasons = sorted({t["message"] for t in tests})
        status = f"skipped: every test skipped ({'; '.join(reasons)[:300]})"
    else:
        status = "passed"
    result = {
        "what": "pytest tests/gpu",
        "status": status,
        "limit_seconds": round(limit),
        "seconds": round(time.monotonic() - start, 1),
        "counts": counts,
        "tests": tests,
    }
    if status.startswith("failed"):
        result["output_tail"] = text[-4000:]
    return result


def run_group(run: Run, group: list[Part], env: dict[str, str], limit: float, work: Path) -> None:
    """Runs one process: pytest, or one or more parts of a ``_check_*.py`` module."""
    names = [p.name for p in group]
    if group[0].module is None:
        run.report["parts"]["pytest"] = run_pytest(run, env, limit, work / "pytest")
        return
    gwork = work / "_".join(names)
    script = HERE / f"{group[0].module}.py"
    budget = limit if run.dry_run else limit / len(group)
    cmd = [sys.executable, str(script), *names, "--work", str(gwork), "--budget", f"{budget:.0f}"]
    if run.dry_run:
        cmd.append("--dry-run")
    code, text = _launch(run, "_".join(names), cmd, env, limit, gwork)
    records = _records(gwork)
    env_info = next((r for r in records if r.get("name") == "environment"), None)
    if env_info and not run.report["environment"]:
        run.report["environment"] = {
            k: v for k, v in env_info.items() if k not in ("part", "kind", "name")
        }
    for part in group:
        run.report["parts"][part.name] = _part_result(part, records, code, limit, text)


def run_parts(run: Run, parts: Sequence[Part], env: dict[str, str], work: Path) -> None:
    """Runs the parts: one process each, or (dry run) one per module."""
    groups: list[list[Part]] = []
    for part in parts:
        if run.dry_run and groups and groups[-1][0].module == part.module and part.module:
            groups[-1].append(part)
        else:
            groups.append([part])
    for group in groups:
        wanted = sum(p.limit for p in group)
        limit = min(wanted, run.left())
        names = [p.name for p in group]
        if limit < MIN_PART_SECONDS:
            for part in group:
                run.report["parts"][part.name] = {
                    "what": part.what,
                    "status": f"skipped: out of time ({run.left():.0f} s left of the budget)",
                }
            run.save()
            continue
        print(f"device_check: {', '.join(names)} (limit {limit:.0f} s) ...", flush=True)
        try:
            run_group(run, group, env, limit, work)
        except Exception as exc:  # the driver's own bug must not cost the other parts
            run.log(f"=== driver error running {names}:\n{traceback.format_exc()}")
            for part in group:
                run.report["parts"][part.name] = {
                    "what": part.what,
                    "status": f"failed: the driver could not run it: {type(exc).__name__}: {exc}",
                }
        for name in names:
            print(f"device_check: {name}: {run.report['parts'][name]['status'][:200]}", flush=True)
        run.save()


def _seconds(part: dict[str, Any]) -> str:
    seconds = part.get("seconds")
    return "-" if seconds is None else str(seconds)


def summary(run: Run) -> str:
    """The lines printed last: each part's status and time, then every figure."""
    lines = [
        f"device_check {run.report['mode']}: {run.report['summary']}, "
        f"{run.report['duration_seconds']} s; report {run.report_path}"
    ]
    for name, step in run.report["setup"].items():
        lines.append(f"  setup {name:10} {step['status'][:200]}")
    env = run.report["environment"]
    lines.append(
        f"  on {env.get('device_name')} (torch {env.get('torch')}, CUDA {env.get('cuda')})"
    )
    for name, part in run.report["parts"].items():
        lines.append(f"  {name:19} {_seconds(part)!s:>6} s  {part['status'][:150]}")
    if run.dry_run:
        lines.append("  figures of a dry run (tiny sizes, on the CPU) mean nothing:")
    for part in run.report["parts"].values():
        for fig in part.get("figures", []):
            if "ratio" in fig:
                paired = f"paired {fig['paired_ratio']}, IQR {fig['paired_ratio_iqr']}"
                value = f"ratio {fig['ratio']} ({paired})"
            elif "memory_ratio" in fig:
                value = f"memory ratio {fig['memory_ratio']} ({fig['distribute_mib']} MiB)"
            else:
                value = f"{fig.get('host_syncs_per_step')} per step"
            lines.append(f"  {fig['name'][:70]:70} {value}  goal {fig.get('goal')}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="the same run on the CPU")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="report folder (default $OUT, else build/device-check)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the whole run (default {DEFAULT_BUDGET:.0f}, "
        f"{DRY_RUN_BUDGET:.0f} in a dry run)",
    )
    parser.add_argument("--only", default="", help="comma-separated parts to run (default all)")
    args = parser.parse_args(argv)
    names = [p.name for p in PARTS]
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(only) - set(names))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; the parts are {names}")
    parts = [p for p in PARTS if not only or p.name in only]

    out = args.out or Path(os.environ.get("OUT") or ROOT / "build" / "device-check")
    out.mkdir(parents=True, exist_ok=True)
    budget = args.budget or (DRY_RUN_BUDGET if args.dry_run else DEFAULT_BUDGET)
    run = Run(out, args.dry_run, budget, list(argv if argv is not None else sys.argv[1:]))
    work = Path(tempfile.mkdtemp(prefix="device-check-"))
    try:
        pythonpath = setup(run, work)
        env = _env(pythonpath, args.dry_run)
        if not args.dry_run and not _has_cuda(env):
            for part in parts:
                run.report["parts"][part.name] = {
                    "what": part.what,
                    "status": "skipped: no CUDA (run with --dry-run for the CPU rehearsal)",
                }
            run.save()
            print(summary(run))
            return 2
        run_parts(run, parts, env, work)
        run.save()
        print(summary(run), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    failed = run.report["summary"]["failed"] or run.report["summary"]["setup_failed"]
    return 1 if failed else 0


def _has_cuda(env: dict[str, str]) -> bool:
    """Whether torch sees a GPU, asked in a child (this process never imports torch, so a
    broken torch cannot stop the report)."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    try:
        return subprocess.run([sys.executable, "-c", probe], env=env, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


if __name__ == "__main__":
    sys.exit(main())
