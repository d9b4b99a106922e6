"""A warning when an XLA step keeps compiling new graphs after its warm-up.

# NOTE [recompilation]
torch_xla compiles one graph per distinct program it records, and a step that
records a different program each time (its shapes follow the data, or a host read
such as ``.item()`` cuts the graph at a data-dependent point) compiles on every
step, silently: tens of graphs in twenty steps, each taking seconds to minutes on
a TPU. `CompileWatch` counts torch_xla's compiles around each `TPUStrategy.run`
(or each `one_execution`) and warns when a step compiles again after its warm-up,
once per step *signature* (the step function, the shapes and dtypes of its inputs,
so that the last, partial batch of a loop is a step of its own, and the strategy's
variables, so that the same step over a new model is too). The first run past the
warm-up that compiles is let go and the second warned of: a clean ``fit`` was seen
to compile one more graph once, at a later epoch's start.

* in a custom loop the warm-up is the signature's first `WARMUP_RUNS` runs (the
  first step compiles, the next one again when the optimizer has made its state);
* under ``ds.Model.fit`` it is the first epoch (`epoch`), which also compiles the
  last, shorter execution of ``steps_per_execution``.

The watch reads one torch_xla counter before and after a run; nothing else is
kept per step but a count per signature.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from types import CodeType
from typing import Any

import torch

from distribute.values import DistributedValues, flatten

__all__ = ["WARMUP_RUNS", "CompileWatch", "step_signature"]

#: Runs of one step signature that may compile before a compile is warned of, in a
#: custom loop.
WARMUP_RUNS = 5


def _code_of(fn: Any) -> Any:
    return getattr(getattr(fn, "__func__", fn), "__code__", None)


def step_signature(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Hashable:
    """The step function (its code, and the code of the functions it closes over: a
    closure made anew each step is the same step, one wrapping another function is
    another step) and the shapes and dtypes of its tensor inputs."""
    code = _code_of(fn)
    wrapped: list[Hashable] = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner = _code_of(cell.cell_contents) if callable(cell.cell_contents) else None
        except ValueError:  # an empty cell
            inner = None
        if inner is not None:
            wrapped.append(inner)
    leaves: list[Hashable] = []
    for leaf in flatten((tuple(args), kwargs)):
        parts = leaf.values if isinstance(leaf, DistributedValues) else (leaf,)
        for part in parts:
            if isinstance(part, torch.Tensor):
                leaves.append((tuple(part.shape), part.dtype))
            else:
                leaves.append(type(part).__name__)
    return (code if code is not None else type(fn)), tuple(wrapped), tuple(leaves)


def _name_of(signature: Hashable) -> str:
    """The step function's name: the first code object in the signature (an
    execution's signature holds its steps')."""
    if isinstance(signature, CodeType):
        return repr(getattr(signature, "co_qualname", signature.co_name))  # 3.11+: qualified
    if isinstance(signature, tuple):
        for part in signature:
            name = _name_of(part)
            if name:
                return name
    return ""


class CompileWatch:
    """Counts each step signature's runs and warns the first time one compiles after
    its warm-up (NOTE [recompilation]).

    Args:
        count: the graphs compiled so far in this process (torch_xla's counter).
        warmup_runs: runs of a signature that may compile, outside ``fit``.
    """

    def __init__(self, count: Callable[[], int], warmup_runs: int = WARMUP_RUNS) -> None:
        self._count = count
        self._warmup = warmup_runs
        self._runs: dict[Hashable, int] = {}
        self._warm: set[Hashable] = set()  # past a fit epoch
        self._warned: set[Hashable] = set()
        self._late: dict[Hashable, int] = {}  # runs that compiled past the warm-up
        self._epochs = 0  # fit epochs running
        self._lock = threading.Lock()

    def count(self) -> int:
        """The graphs compiled so far (read before a run, passed to `after`)."""
        return self._count()

    def after(self, signature: Hashable, before: int) -> None:
        """Records one run of ``signature``; warns if it compiled past its warm-up."""
        compiled = self._count() - before
        with self._lock:
            runs = self._runs[signature] = self._runs.get(signature, 0) + 1
            if compiled <= 0 or signature in self._warned:
                return
            if signature not in self._warm and (self._epochs > 0 or runs <= self._warmup):
                return
            # One compile past the warm-up is let go (NOTE [recompilation]).
            late = self._late[signature] = self._late.get(signature, 0) + 1
            if late < 2:
                return
            self._warned.add(signature)
        when = (
            "after the first epoch"
            if signature in self._warm
            else f"at its run {runs}, after {self._warmup} warm-up runs"
        )
        name = _name_of(signature) or "(unnamed)"
        warnings.warn(
            f"TPUStrategy: the step {name} compiled {compiled} new XLA graph(s) {when}, "
            "with inputs of the same shapes: expected one graph per step, compiled once "
            "and reused, but each new graph costs a compile (seconds "
            "to minutes on a TPU). The usual causes: shapes that depend on the data (a "
            "boolean mask, torch.nonzero, a slice by a value read from a tensor) or a host "
            "read inside the step (.item(), float(t), .tolist(), print(t), .cpu()), which "
            "ends the graph at a data-dependent point; keep the step's shapes static (pad "
            "and mask instead) and read values after `run`. "
            "torch_xla.debug.metrics.short_metrics_report() counts the compiles. Said "
            "once per step and input shapes.",
            UserWarning,
            stacklevel=4,
        )

    @contextlib.contextmanager
    def epoch(self) -> Iterator[None]:
        """One epoch of ``fit``: until the first ends, compiles are its warm-up; after
        it, every signature seen is warm, and its next compile is warned of."""
        with self._lock:
            self._epochs += 1
        try:
            yield
        finally:
            with self._lock:
                self._epochs -= 1
                self._warm.update(self._runs)
