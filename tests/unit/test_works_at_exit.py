"""NOTE [works at exit]: the exit waits until gloo's worker threads have let their last
works go, and a closed group's unwaited works are kept for good (the fully sharded
example under torchrun aborted with SIGABRT after its work in about 1 run in 12: a
worker freed a work inside the interpreter's finalization)."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

from distribute.collectives import _group_setup

ROOT = Path(__file__).resolve().parents[2]


class _Work:
    """Stands in for a c10d work: completed, weakly referenceable."""

    def is_completed(self) -> bool:
        return True


def test_a_group_closed_while_running_lets_its_works_go_at_once() -> None:
    """A work holds its group, and the group gloo's threads: `shutdown` must free them."""
    launched = [_Work(), _Work()]
    refs = [weakref.ref(w) for w in launched]
    _group_setup.close_group(None, None, [None], launched)
    assert launched == []
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_group_closed_at_the_interpreters_exit_keeps_its_unwaited_works_for_good(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_group_setup, "_EXITING", [True])
    work = _Work()
    count = sys.getrefcount(work)
    launched = [work]
    _group_setup.close_group(None, None, [None], launched)
    assert launched == []
    assert sys.getrefcount(work) == count + 1  # one reference that is never released
    assert id(work) not in _group_setup._ABANDONED  # a work, not an abandoned group


def test_the_exit_waits_for_gloos_workers_only_after_a_recent_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(_group_setup.time, "sleep", slept.append)
    monkeypatch.setattr(_group_setup, "_LAST_DONE", [float("-inf")])
    _group_setup._settle()
    assert slept == []  # no collective: the exit is not delayed
    _group_setup.work_done()
    _group_setup._settle()
    assert len(slept) == 1 and 0 < slept[0] <= _group_setup.SETTLE_SECONDS


_KEEPS_NOTHING = """
import gc, sys, time, torch
from torch.multiprocessing.reductions import StorageWeakRef
from distribute._enums import ReduceOp
from distribute.collectives.process_group import ProcessGroupCollectives
rank, port = int(sys.argv[1]), int(sys.argv[2])
c = ProcessGroupCollectives.create(rank, 2, "127.0.0.1", port, timeout_seconds=60)
(result,) = c.all_reduce([torch.ones(1 << 18)], ReduceOp.SUM, name="probe")
storage = StorageWeakRef(result.untyped_storage())  # the buffer the collective filled
del result
deadline = time.monotonic() + 5
while not storage.expired() and time.monotonic() < deadline:
    gc.collect()
    time.sleep(0.01)
freed = storage.expired()
c.all_reduce([torch.ones(1)], ReduceOp.SUM, name="done")
print("freed", freed)
c.shutdown()
"""


def test_a_waited_collective_keeps_nothing_of_its_tensors() -> None:
    """The first fix kept the last four works, and with them their tensors (the
    initial broadcast's buffer, the size of the model, for the whole run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    env["OMP_NUM_THREADS"] = "1"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _KEEPS_NOTHING, str(rank), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in ranks]
    for p, (out, err) in zip(ranks, outs):
        assert p.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == "freed True", out


def test_the_finalizers_that_close_groups_at_exit_see_the_exit() -> None:
    """atexit runs the last registered hook first: `_mark_exiting` must run before
    `weakref.finalize`'s own hook, which closes the collectives objects at exit."""
    script = (
        "import weakref\n"
        "from distribute.collectives import _group_setup\n"
        "class Holder: pass\n"
        "holder = Holder()\n"
        "weakref.finalize(holder, lambda: print('exiting', _group_setup._EXITING[0]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "exiting True", out.stdout
