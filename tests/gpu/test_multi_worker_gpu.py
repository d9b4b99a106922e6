"""MultiWorkerMirroredStrategy over NCCL under a real torchrun, one GPU per process.

Skipped without CUDA, and without at least two GPUs. The processes run
tests/gpu/_workers.py (see its docstring) on ``min(8, torch.cuda.device_count())``
GPUs of this node; each rank saves what it saw and the tests below compare.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from distribute import launch

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.timeout(420),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "_workers.py"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NPROC = min(8, GPUS)
ATOL, RTOL = 1e-5, 1e-4
#: Seconds a plain torchrun of the worker may take (start-up, NCCL init, 2 x 20 steps).
RUN_TIMEOUT = 300
#: The CUDA sanitizer intercepts every op in Python: far slower.
SANITIZER_TIMEOUT = 600

needs_two_gpus = pytest.mark.skipif(
    GPUS < 2, reason=f"needs at least 2 GPUs (one per process), found {GPUS}"
)

#: Launcher variables of an outer job that must not reach our torchrun.
_OUTER_LAUNCHER = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TF_CONFIG",
)


def _kill_workers(out: Path) -> None:
    """Kills the workers that wrote their pid into ``out`` and still run.

    torchrun starts each worker in its own session, so killing the agent's process
    group would leave them behind; only pids whose command line names the worker
    script are killed.
    """
    for pid_file in out.glob("pid-rank*"):
        try:
            pid = int(pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if WORKER.name.encode() in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def torchrun(
    out: Path,
    args: Sequence[str] = (),
    *,
    nproc: int = NPROC,
    script: Path = WORKER,
    env: Mapping[str, str] | None = None,
    timeout: float = RUN_TIMEOUT,
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --nproc_per_node=nproc script args``, bounded.

    On a timeout torchrun gets SIGTERM (its agent then stops the workers), then
    SIGKILL, and any worker still running is killed; the test fails with the
    output's tail.
    """
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={launch.free_ports(1)[0]}",
        str(script),
        *args,
    ]
    full_env = {k: v for k, v in os.environ.items() if k not in _OUTER_LAUNCHER}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    full_env.update(env or {})
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=full_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        _kill_workers(out)
        pytest.fail(
            f"torchrun did not finish within {timeout} s and was stopped; "
            f"command: {' '.join(cmd)}\n--- stderr tail ---\n{stderr[-6000:]}"
        )
    _kill_workers(out)  # nothing should be left; a crashed agent could leave some
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _results(out: Path, proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert proc.returncode == 0, (
        f"torchrun exited with {proc.returncode}\n--- stdout tail ---\n{proc.stdout[-3000:]}"
        f"\n--- stderr tail ---\n{proc.stderr[-8000:]}"
    )
    results = []
    for rank in range(NPROC):
        path = out / f"rank{rank}.pt"
        assert path.exists(), f"rank {rank} wrote no result\n{proc.stderr[-4000:]}"
        results.append(torch.load(path, weights_only=True))
    return results


@pytest.fixture(scope="module")
def nccl_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One torchrun of the worker on NPROC GPUs: every rank's result, in rank order."""
    out = tmp_path_factory.mktemp("nccl_run")
    proc = torchrun(out, ["--out", str(out), "--steps", "20"])
    return _results(out, proc)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _assert_ranks_agree(results: list[dict[str, Any]], run: str, kind: str) -> None:
    first = results[0][run][kind]
    for r in results[1:]:
        for name, value in r[run][kind].items():
            assert torch.equal(value, first[name]), (
                f"{run} {kind} {name!r} differs between rank 0 and rank {r['rank']}"
            )


# -- 2. one GPU per local rank, and DDP parity -------------------------------------------


@needs_two_gpus
def test_each_local_rank_is_bound_to_its_own_gpu(nccl_run: list[dict[str, Any]]) -> None:
    """The strategy sets each process's current CUDA device to ``cuda:LOCAL_RANK``
    (torch's "cuda" then means that GPU) and replicates onto it alone, over NCCL."""
    assert [r["rank"] for r in nccl_run] == list(range(NPROC))
    for r in nccl_run:
        local = r["local_rank"]
        where = f"rank {r['rank']} (LOCAL_RANK {local})"
        assert r["world_size"] == NPROC and r["num_replicas_in_sync"] == NPROC, where
        assert r["backend"] == "nccl", f"{where}: backend {r['backend']!r}"
        assert r["current_device_after_init"] == local, (
            f"{where}: torch.cuda.current_device() is {r['current_device_after_init']} after "
            "the strategy was built; the strategy must bind the process to its GPU"
        )
        assert r["worker_devices"] == [f"cuda:{local}"], f"{where}: {r['worker_devices']}"
        assert r["in_run"] == {"current": local, "new": f"cuda:{local}"}, (
            f"{where}: inside run {r['in_run']}"
        )
        steps = r["strategy"]["steps_seen"]
        assert len(steps) == 20, f"{where}: {len(steps)} steps ran"
        expected = {"x": f"cuda:{local}", "current": local, "new": f"cuda:{local}"}
        assert all(s == expected for s in steps), f"{where}: training steps saw {steps[:3]}..."


@needs_two_gpus
def test_batchnorm_cnn_matches_distributed_data_parallel(nccl_run: list[dict[str, Any]]) -> None:
    """20 steps of SGD with momentum on a BatchNorm CNN, same seed and same per-rank
    batches: the strategy's parameters equal DDP's (1e-5 / 1e-4) on every rank, and
    its parameters and BatchNorm buffers are identical on every rank."""
    _assert_ranks_agree(nccl_run, "strategy", "params")
    _assert_ranks_agree(nccl_run, "strategy", "buffers")
    for r in nccl_run:
        losses = r["strategy"]["losses"]
        assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses))), losses
        ours, ddp = r["strategy"]["params"], r["ddp"]["params"]
        assert sorted(ours) == sorted(ddp)
        for name, expected in ddp.items():
            _assert_close(ours[name], expected, f"rank {r['rank']} parameter {name!r}")
    # Training did something: every parameter moved away from its seeded start.
    first = nccl_run[0]["strategy"]
    for name, start in first["initial_params"].items():
        assert not torch.equal(first["params"][name], start), f"{name!r} never changed"


# -- 8. integer MEAN over nccl -------------------------------------------------------------


@needs_two_gpus
def test_integer_mean_reduce_over_nccl_is_float64(nccl_run: list[dict[str, Any]]) -> None:
    """``reduce("MEAN", int64 values, axis=None)`` gives float64 over nccl, as over gloo,
    with the exact mean of 1..N (never an integer division)."""
    expected = (NPROC + 1) / 2
    for r in nccl_run:
        for source, mean in r["int_mean"].items():
            assert mean == {"dtype": "torch.float64", "value": expected}, (
                f"rank {r['rank']}, value from {source}: {mean}"
            )


# -- 3. the same run under the CUDA sanitizer -------------------------------------------


@needs_two_gpus
@pytest.mark.timeout(SANITIZER_TIMEOUT + 120)
def test_the_nccl_run_is_clean_under_the_cuda_sanitizer(tmp_path: Path) -> None:
    """With ``TORCH_CUDA_SANITIZER=1`` (torch.cuda._sanitizer checks every kernel's
    stream ordering), the same run exits 0: no tensor is used on one stream while
    another writes it (NCCL's stream, a prefetch copy's, the default stream).

    DDP is left out (``--no-ddp``): the sanitizer is here to judge the library.
    """
    proc = torchrun(
        tmp_path,
        ["--out", str(tmp_path), "--steps", "20", "--no-ddp"],
        env={"TORCH_CUDA_SANITIZER": "1"},
        timeout=SANITIZER_TIMEOUT,
    )
    assert "CSAN" not in proc.stderr, proc.stderr[-8000:]
    results = _results(tmp_path, proc)
    assert all(r["sanitizer"] for r in results), "TORCH_CUDA_SANITIZER=1 did not enable it"
    _assert_ranks_agree(results, "strategy", "params")
    _assert_ranks_agree(results, "strategy", "buffers")


# -- the README example on every GPU -------------------------------------------------------


@needs_two_gpus
def test_train_digits_example_trains_under_torchrun_on_every_gpu(tmp_path: Path) -> None:
    """``torchrun --nproc_per_node=N examples/train_digits.py --strategy multi_worker``
    (no other argument: one GPU per process by default) learns the digits."""
    pytest.importorskip("sklearn")
    proc = torchrun(
        tmp_path,
        ["--strategy", "multi_worker", "--epochs", "3", "--quiet"],
        script=ROOT / "examples" / "train_digits.py",
    )
    assert proc.returncode == 0, proc.stderr[-8000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1, proc.stdout  # the chief prints one summary
    assert lines[0]["replicas_in_sync"] == NPROC
    assert lines[0]["test_accuracy"] > 0.8, lines[0]
