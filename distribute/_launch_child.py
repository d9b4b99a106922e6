"""Entry point of a worker started by `distribute.launch.run`.

Usage (by the launcher only)::

    python -m distribute._launch_child PAYLOAD RESULT PARENT_PID

PAYLOAD holds two pickles: the parent's ``sys.path`` and script path (plain
strings, so they load before anything is imported), then ``(fn, args, kwargs)``,
whose unpickling imports ``fn``'s module from that path. The outcome,
``{"ok": True, "value": ...}`` or the exception's type, message and traceback, is
written to RESULT under a temporary name and renamed, so the parent never reads
half a file. A daemon thread ends the worker if PARENT_PID dies, so a killed
parent leaves no orphans, and removes the launch's temporary directory.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import sys
import threading
import time
import traceback
from typing import Any

_ORPHAN_CHECK_SECONDS = 1.0


def _write(path: str, outcome: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(outcome, f)
    os.replace(tmp, path)


def _import_main(path: str) -> None:
    """Makes the parent's script importable as ``__main__`` (as multiprocessing's spawn
    does), under another ``__name__`` so its ``if __name__ == "__main__"`` block does
    not run."""
    spec = importlib.util.spec_from_file_location("__mp_main__", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["__mp_main__"] = module
    spec.loader.exec_module(module)
    sys.modules["__main__"] = module


def _exit_with_parent(parent_pid: int, payload_path: str) -> None:
    """Ends this worker once the launching process is gone (reparented).

    A parent killed outright (SIGKILL, or SIGTERM's default action) cleans nothing
    up, so the orphaned workers remove the launch's temporary directory.
    """
    while os.getppid() == parent_pid:
        time.sleep(_ORPHAN_CHECK_SECONDS)
    launch_dir = os.path.dirname(os.path.abspath(payload_path))
    if os.path.basename(launch_dir).startswith("distribute-launch-"):
        shutil.rmtree(launch_dir, ignore_errors=True)  # every orphan tries; any may win
    os._exit(1)


def main(argv: list[str]) -> int:
    payload_path, result_path, parent_pid = argv
    threading.Thread(
        target=_exit_with_parent,
        args=(int(parent_pid), payload_path),
        name="orphan-check",
        daemon=True,
    ).start()
    try:
        with open(payload_path, "rb") as f:
            setup: dict[str, Any] = pickle.load(f)
            sys.path[:0] = [p for p in setup["sys_path"] if p not in sys.path]
            if setup["main_path"]:
                _import_main(setup["main_path"])
            fn, args, kwargs = pickle.load(f)
        value = fn(*args, **kwargs)
        try:
            _write(result_path, {"ok": True, "value": value})
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(
                f"the worker's return value ({type(value).__name__}) cannot be pickled: {exc}; "
                "return plain Python values, NumPy arrays or tensors."
            ) from exc
    except BaseException as exc:  # report everything, SystemExit included, to the parent
        _write(
            result_path,
            {
                "ok": False,
                "type": type(exc).__name__,
                "message": str(exc),
                "traceback": traceback.format_exc(),
            },
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
