"""``steps_per_execution`` steps of `fit`, `evaluate` and `predict` as one XLA
execution, under `TPUStrategy`.

# NOTE [steps per execution]
TPU users set Keras's ``steps_per_execution=N`` so that the device runs N training
steps per call from the host, not one: Keras compiles a ``tf.function`` whose body
loops over N steps. torch_xla records operations lazily and executes what it
recorded when a step is marked, so the same effect needs only that nothing ends
the XLA step, or reads a value, between the N steps:

* `TPUStrategy.one_execution()` makes ``run`` leave the step open; leaving it marks
  one step on every device: the N steps are one graph, compiled once (the same N
  steps give the same graph every time) and executed once.
* ``fit`` reads each step's loss (``strategy.reduce`` then ``float``) and the
  running metrics only after the execution: a read inside it would execute the
  graph recorded so far. Batch callbacks run every N steps (Keras's rule), after
  the execution, so they see the logs of its last step.
* Where no callback reads batch logs (no progress bar per batch, no user
  ``on_train_batch_end``), ``fit`` does not read them after each execution either:
  the losses stay on the devices until the epoch ends (or `MAX_UNREAD` steps wait),
  then come to the host in one transfer. A host read waits for the execution the
  devices are running (measured in SPMD mode: torch_xla takes the device's lock),
  so a read per execution kept the host from recording the next execution while
  the devices ran the last one (``fit`` took 1.3x the hand-written loop's time).
  So the host already prepares execution N+1 (draws its batches, sends them to the
  devices, records its steps) while the devices run N: ending N+1 then waits for
  N (torch_xla's device lock). Measured in ``benchmarks/bench_tpu_fit.py``'s SPMD
  epoch with N = 8 on the CPU backend: the first mark of an epoch, on idle devices,
  took 0.7 ms, the next ones 6-11 ms of waiting, so the devices bound the epoch
  and drawing batches further ahead would hide nothing there.
* The last execution of an epoch may hold fewer steps (the epoch's steps modulo
  N): one more graph, compiled in the first epoch and reused in the next ones.
  A partial last batch under `TPUStrategy` is already padded to the full batch
  (`_data._PadToFull`), so it adds no graph of its own.

``evaluate`` and ``predict`` group their steps the same way (their batch hooks
every N steps, each step's loss or outputs read after its execution, or at the
end where no callback reads batch logs), outside `TPUStrategy.one_epoch`: an
inference call is no training epoch, and its executions warm up as a custom
loop's steps do for the recompilation warning (a call on data of another length
has a last execution of another size: a graph of its own).

In SPMD mode the N steps are one program over every device (GSPMD inserts the
gradients' all-reduce): one execution per N steps. Replica mode cannot fuse steps:
the optimizer's gradient sum meets on the host at every step (NOTE [host
reduction] in `collectives/xla.py`: the CPU backend has no per-device collectives
in one process), which executes each device's graph up to the gradients. Leaving
the step open there chained each step's pending update into the next step's graph
(N + 1 executions per N steps and device instead of 2N, but N + 1 graphs to
compile, a BERT's taking minutes, for no measured gain in step time), so
`one_execution` leaves replica mode's steps as they are: there N spaces the
callbacks and the reads of the logs only. Other strategies have no graph to fuse:
one step per execution, and N only spaces the callbacks.

Example::

    executions = StepExecutions(strategy, steps_per_execution=8)
    with executions:
        executions.run(16, strategy.run, step, (batch,))
        if executions.full:
            for size, logs in executions.finish():   # the 8 steps have run
                ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

from distribute._enums import StepRunner
from distribute.values import DistributedValues, flatten, map_structure

__all__ = ["StepExecutions"]

#: A step's global batch size and the logs its ``train_step`` returned.
Step = tuple[int, Any]

#: Steps whose logs may stay unread on the devices, where no one reads batch logs.
MAX_UNREAD = 1024


class StepExecutions:
    """Steps grouped into executions of ``steps_per_execution`` steps where the
    strategy records steps into one XLA graph (`TPUStrategy`), else of one step.

    Use it as a context manager around the loop: leaving it (an error included)
    ends an execution still open, so the strategy marks its steps again.

    Args:
        strategy: the strategy that runs the steps.
        steps_per_execution: Keras's ``steps_per_execution``.
        epoch: whether the steps are one of ``fit``'s epochs, whose first is the
            steps' warm-up for the recompilation warning (`TPUStrategy.one_epoch`);
            ``evaluate`` and ``predict`` pass False: their executions warm up as a
            custom loop's steps do.
        defer: whether, on other strategies too, `finish` without ``wait`` may
            leave logs unread (the caller's steps return detached values, so that
            no step's graph stays alive, and need no collective per step).
    """

    def __init__(
        self, strategy: Any, steps_per_execution: int, epoch: bool = True, defer: bool = False
    ) -> None:
        self._strategy = strategy
        self._xla = strategy.extended.step_runner is StepRunner.XLA_EXECUTIONS
        self._defer = self._xla or defer
        #: Steps per execution: ``steps_per_execution`` on XLA, else 1.
        self.size = steps_per_execution if self._xla else 1
        self._open: contextlib.ExitStack | None = None
        # On XLA, the epoch is the steps' warm-up for the recompilation warning
        # (NOTE [recompilation] in strategies/_xla_compiles.py).
        self._epoch = contextlib.ExitStack()
        if self._xla and epoch:
            self._epoch.enter_context(strategy.one_epoch())
        self._steps: list[Step] = []  # the open execution's
        self._unread: list[Step] = []  # of executions ended

    def run(self, size: int, step: Callable[..., Any], *args: Any) -> None:
        """Runs ``step(*args)`` (one ``strategy.run`` of a step of global batch size
        ``size``) in the current execution, opening one where none is; its logs come
        back from `finish`."""
        if self._open is None and self.size > 1:
            self._open = contextlib.ExitStack()
            self._open.enter_context(self._strategy.one_execution())
        self._steps.append((size, step(*args)))

    @property
    def full(self) -> bool:
        """Whether the current execution holds its ``size`` steps."""
        return len(self._steps) >= self.size

    @property
    def pending(self) -> bool:
        """Whether steps have run whose logs `finish` has not returned yet."""
        return bool(self._steps or self._unread)

    def finish(self, wait: bool = True) -> list[Step]:
        """Ends the current execution (the devices start it) and returns, in order, the
        steps whose logs are read now, their XLA tensors copied to the host in one
        transfer per device: with ``wait``, every step so far; without, on XLA
        (or with ``defer``), none until `MAX_UNREAD` steps wait (a read waits for
        the execution running on the devices, so reading each execution's logs
        would keep the host from recording the next steps meanwhile; elsewhere the
        reads of many steps cost the host less in one batch)."""
        if self._open is not None:
            self._close()
        self._unread += self._steps
        self._steps = []
        if self._defer and not wait and len(self._unread) < MAX_UNREAD:
            return []
        steps, self._unread = self._unread, []
        return _on_host(steps) if self._xla else steps

    def _close(self) -> None:
        scope, self._open = self._open, None
        if scope is not None:
            scope.close()

    def __enter__(self) -> StepExecutions:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._close()
        finally:
            self._epoch.close()


def _on_host(steps: list[Step]) -> list[Step]:
    """The steps' logs with every XLA tensor (per-replica components included) copied
    to the host, in one transfer per device."""
    from distribute.collectives import xla

    tensors: dict[int, torch.Tensor] = {}
    for _, logs in steps:
        for leaf in flatten(logs):
            for part in leaf.values if isinstance(leaf, DistributedValues) else (leaf,):
                if isinstance(part, torch.Tensor) and part.device.type == "xla":
                    tensors[id(part)] = part
    if not tensors:
        return steps
    host = dict(zip(tensors, xla.to_host(list(tensors.values()))))

    def swap(leaf: Any) -> Any:
        if isinstance(leaf, DistributedValues):
            return type(leaf)(tuple(host.get(id(part), part) for part in leaf.values))
        return host.get(id(leaf), leaf)

    return [(size, map_structure(swap, logs)) for size, logs in steps]
