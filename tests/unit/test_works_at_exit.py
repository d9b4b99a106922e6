"""NOTE [works at exit]: a closed group's last works are let go only where gloo's worker
threads cannot be the ones to free them (the fully sharded example under torchrun
aborted with SIGABRT after its work in about 1 run in 12: a worker freed a work
inside the interpreter's finalization)."""

from __future__ import annotations

import gc
import os
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
    launched, recent = [_Work()], [_Work(), _Work()]
    refs = [weakref.ref(w) for w in [*launched, *recent]]
    _group_setup.close_group(None, None, [None], launched, recent)
    assert launched == [] and recent == []
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_group_closed_at_the_interpreters_exit_keeps_its_works_for_good(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_group_setup, "_EXITING", [True])
    work = _Work()
    count = sys.getrefcount(work)
    recent = [work]
    _group_setup.close_group(None, None, [None], [], recent)
    assert recent == []
    assert sys.getrefcount(work) == count + 1  # one reference that is never released
    assert id(work) not in _group_setup._ABANDONED  # a work, not an abandoned group
    both = _Work()  # launched, and waited for since: kept once
    count = sys.getrefcount(both)
    _group_setup.close_group(None, None, [None], [both], [both])
    assert sys.getrefcount(both) == count + 1


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
