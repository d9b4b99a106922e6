"""The process-wide torch hooks a strategy needs, installed at first use.

# NOTE [hooks at first use]
Capturing the parameters and buffers a scope builds needs torch's global module,
parameter and buffer registration hooks (`variables.py`), and giving
`optimizer.step()` its meaning inside `run` needs the global optimizer step hooks
(`gradients/_hooks.py`); a parameter-server strategy adds one more pre-hook that
sends gradients to the ps tasks (`ps/_variables.py`, installed when such a strategy
is built). None of them is installed by `import distribute`: the first time any
strategy's scope is entered or its `run` called, they are, once for the process,
and they stay (a variable made in a scope may be used long after it). Before that,
plain PyTorch code in a process that imported the library runs none of its code;
after it, outside any scope the hooks return at once unless a module slot or an
optimizer holds a strategy's variable.
"""

from __future__ import annotations

import threading

__all__ = ["ensure_installed", "installed"]

_state = {"installed": False}
_lock = threading.Lock()


def installed() -> bool:
    """Whether the hooks are installed in this process."""
    return _state["installed"]


def ensure_installed() -> None:
    """Installs the registration and optimizer hooks, once (NOTE [hooks at first use])."""
    if _state["installed"]:
        return
    with _lock:
        if _state["installed"]:
            return
        from distribute import variables
        from distribute.gradients import _hooks

        variables.install_registration_hooks()
        _hooks.install()
        _state["installed"] = True
