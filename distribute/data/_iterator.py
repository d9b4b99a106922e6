"""`DistributedIterator`: steps handed out per replica, the end of data agreed across
workers (NOTE [end of data]), and the input position a checkpoint saves.
"""

from __future__ import annotations

import collections
import pickle
from collections.abc import Callable
from typing import Any

import torch

from distribute.data import _position
from distribute.data._batches import (
    _MISSING,
    _NEED_TEMPLATE,
    _check_not_in_replica_context,
    _CopyStreams,
    _pack,
    _spec,
    _Step,
    _template_of,
)
from distribute.data._workers import InputWorkers
from distribute.data.options import (
    InputOptions,
)
from distribute.errors import InvalidArgumentError
from distribute.values import (
    select_replica,
)

__all__ = ["DistributedIterator", "OptionalValue"]


class OptionalValue:
    """A step's element that may be absent, from `get_next_as_optional`.

    Example::

        >>> from distribute.data import OptionalValue
        >>> opt = OptionalValue(None, has_value=False)
        >>> opt.has_value()
        False
    """

    def __init__(self, value: Any, *, has_value: bool) -> None:
        self._value = value
        self._has_value = has_value

    def has_value(self) -> bool:
        """Whether the iterator produced an element."""
        return self._has_value

    def get_value(self) -> Any:
        """The element.

        Raises:
          ValueError: when there is none (the iterator was exhausted).
        """
        if not self._has_value:
            raise InvalidArgumentError(
                "get_value() on an empty OptionalValue: the iterator was exhausted; check "
                "has_value() first."
            )
        return self._value


# -- steps: batches as columns of leaves ----------------------------------------------------
#


class DistributedIterator:
    """Iterates a distributed dataset one step at a time.

    Each step is a nest whose leaves are `PerReplica` (plain values with one
    local replica). ``next`` must be called in cross-replica context.

    Example::

        >>> import torch, distribute as ds
        >>> it = iter(ds.OneDeviceStrategy("cpu").experimental_distribute_dataset([torch.ones(2)]))
        >>> it.get_next_as_optional().has_value()
        True
        >>> it.get_next_as_optional().has_value()
        False
    """

    def __init__(
        self,
        read: Callable[[], _Step | None],  # this worker's next step, None when it has none
        workers: InputWorkers,
        options: InputOptions,
        template: Callable[[], Any],
        spec_batch_dim: int | None,
        prefetch: bool,
        # The next step, as handed out, when there is nothing to agree on or copy
        # (see NOTE [direct steps]); the steps then come from it alone.
        direct: Callable[[], Any] | None = None,
        # How many steps this worker's epoch has, when its loader knows (see
        # NOTE [end of data]).
        known_steps: Callable[[], int | None] | None = None,
    ) -> None:
        self._read = read
        self._workers = workers
        self._options = options
        self._template_fn = template
        # An empty batch of the data's structure, as (structure, leaves).
        self._template: tuple[Any, list[Any]] | None = None
        self._spec_batch_dim = spec_batch_dim
        # Steps read ahead, each with the loader's state after it (NOTE [input position]).
        self._buffer: collections.deque[tuple[_Step, Any]] = collections.deque()
        self._depth = options.experimental_per_replica_buffer_size if prefetch else 0
        self._cpu_only = workers.cpu_only
        self._done = False
        self._element_spec: Any = None
        self._direct = direct
        self._known_steps = known_steps
        self._horizon: int | None = None  # steps every worker is known to have
        self._taken = 0
        self._copies = _CopyStreams()
        # NOTE [input position]: set by the dataset that made this iterator.
        self._owner: Any = None
        self._epoch = 0
        self._random_state: dict[str, Any] | None = None
        self._loader: Any = None  # a StatefulDataLoader, whose state is the position
        self._draws: _position.RecordedDraws | None = None
        self._steps = 0
        self._position: Any = None  # the loader's state after the last step handed out

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        _check_not_in_replica_context("next(iterator)")
        if self._direct is not None:
            value = self._direct()
            if self._template is None:  # for element_spec: the first step's structure
                self._template = _template_of(select_replica(0, value))
            self._steps += 1
            return value
        if not self._buffer:
            step = self._prepare()
            if step is None:
                raise StopIteration
            self._buffer.append((step, self._snapshot()))
        step, position = self._buffer.popleft()
        while len(self._buffer) < self._depth:
            ahead = self._prepare()
            if ahead is None:
                break
            self._buffer.append((ahead, self._snapshot()))
        self._copies.wait(step)
        self._steps += 1
        self._position = position
        return step.value()

    def _skip_without_reading(self, steps: int) -> bool:
        """Skips ``steps`` batches by their indices alone, where one batch of a
        single-process loader is one step of one worker (no data is loaded)."""
        draws = self._draws
        if draws is None or self._workers.num_workers != 1 or self._buffer or self._steps:
            return False
        return draws.skip_indices(steps)

    @property
    def steps(self) -> int:
        """Global steps handed out in this epoch (counting those before a restore)."""
        return self._steps

    def _snapshot(self) -> Any:
        return self._loader.state_dict() if self._loader is not None else None

    # -- position (NOTE [input position]) ------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this iterator is: the epoch, the global steps handed out, and the
        loader's state or the random state its epoch started from.

        Raises:
            InvalidArgumentError: the data is a Python iterator or generator, which
                cannot start again: pass a DataLoader (or torchdata's
                StatefulDataLoader) to checkpoint the input position.
        """
        if self._owner is None or self._random_state is None:
            raise InvalidArgumentError(
                "this iterator's position cannot be saved: its data is a Python iterator or "
                "generator, which cannot start again at a given batch. Pass a DataLoader (or "
                "torchdata's StatefulDataLoader, which resumes without reading the batches "
                "before), or leave the iterator out of the checkpoint"
            )
        position = self._snapshot() if self._direct is not None else self._position
        return {
            "shuffle_seeds": [s._seed for s in self._owner._seeded_samplers()],
            "epoch": self._epoch,
            "steps": self._steps,
            "loader": position,
            "random_state": self._random_state,
            "first_draw": self._draws.state() if self._draws is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Moves this iterator to ``state`` (from `state_dict`): the next step is the
        one after the last step handed out when it was saved, with the same shuffle."""
        owner = self._owner
        if owner is None:
            raise InvalidArgumentError(
                "this iterator's position cannot be restored: its data is a Python iterator "
                "or generator; pass a DataLoader"
            )
        owner._epoch = int(state["epoch"]) - 1  # the next iter() starts that epoch
        seeded = owner._seeded_samplers()
        for sampler, seed in zip(seeded, state.get("shuffle_seeds", ())):
            sampler._seed = int(seed)  # the order every worker agreed on when saving
        steps = int(state["steps"])
        # Making this iterator drew from torch's generator (a DataLoader iterator draws
        # its base seed); it stands in for the saved one, whose draws were made before
        # the save, so torch's generator goes back to before this one was made.
        before_this = self._random_state["cpu"] if self._random_state is not None else None
        if state.get("loader") is not None and self._loader is not None:
            self._loader.load_state_dict(state["loader"])
            fresh = iter(owner)
            fresh._taken = fresh._steps = steps
            fresh._random_state = state["random_state"]
        else:
            generators = owner._generators()
            with _position.replayed_random_state(state["random_state"], generators):
                if hasattr(owner, "_replay_first_draw"):
                    owner._replay_first_draw = state.get("first_draw")
                fresh = iter(owner)
                if fresh._skip_without_reading(steps):
                    fresh._taken = fresh._steps = steps
                else:
                    for _ in range(steps):  # the same shuffle; their data is read again
                        next(fresh)
        self.__dict__.update(fresh.__dict__)
        if before_this is not None:
            torch.set_rng_state(before_this)

    def get_next(self) -> Any:
        """The next step's element; raises `StopIteration` at the end of data."""
        return next(self)

    def get_next_as_optional(self) -> OptionalValue:
        """The next step's element as an `OptionalValue`, empty at the end of data."""
        try:
            return OptionalValue(next(self), has_value=True)
        except StopIteration:
            return OptionalValue(None, has_value=False)

    @property
    def element_spec(self) -> Any:
        """`TensorSpec` nest of one replica's element: from the first step taken, or
        before any, from the dataset's first element."""
        if self._element_spec is None:
            structure, empty = self._empty_template()
            self._element_spec = _spec(_pack(structure, empty), self._spec_batch_dim)
        return self._element_spec

    def _empty_template(self) -> tuple[Any, list[Any]]:
        if self._template is None:
            self._template = _template_of(self._template_fn())
        return self._template

    def _has_template(self) -> bool:
        """Whether this worker knows (or can read) what an empty batch looks like."""
        try:
            self._empty_template()
        except InvalidArgumentError:  # no data here to infer it from
            return False
        return True

    def _exchange_template(self) -> None:
        """Every worker shares its empty batch; one that has none takes another's."""
        try:
            mine = pickle.dumps(self._template) if self._template is not None else b""
        except Exception:  # cannot be shared; the others still need this worker's call
            mine = b""
        theirs = self._workers.gather_across_workers(mine)
        if self._template is None:
            # Bytes from this job's own workers: as trusted as the process group itself.
            self._template = pickle.loads(next(t for t in theirs if t))

    def _agree_horizon(self) -> int:
        """The number of steps every worker is known to have: the least of their
        loaders' lengths (one exchange per epoch), 0 where one cannot tell."""
        mine = self._known_steps() if self._known_steps is not None else None
        if self._workers.num_workers == 1:
            return 0  # nothing to agree on: the sum across workers is free
        theirs = self._workers.gather_across_workers(str(-1 if mine is None else mine).encode())
        lengths = [int(t) for t in theirs]
        return 0 if min(lengths) < 0 else min(lengths)

    def _prepare(self) -> _Step | None:
        if self._done:
            return None
        if self._horizon is None:
            self._horizon = self._agree_horizon()
        step = self._read()
        workers = self._workers
        local = workers.local_replicas
        have = 0 if step is None else local - len(step.missing)
        if self._template is None and step is not None and have:
            self._template = step.template()
        if self._taken < self._horizon:
            # NOTE [end of data]: every worker's loader said it has this step, so
            # there is nothing to agree on (DDP-like: no collective, no host sync).
            self._taken += 1
            if step is None:
                raise InvalidArgumentError(
                    f"worker {workers.worker_index}'s DataLoader ended after {self._taken - 1} "
                    f"batches, but its len() promised at least {self._horizon}, which the other "
                    "workers relied on; make the dataset's __len__ match what it yields"
                )
            return self._finish(step)
        self._taken += 1
        # A worker with no data at all (an empty shard) cannot know what an empty
        # batch looks like: it asks, in the same all-reduce as the end-of-data count.
        need = int((step is None or bool(step.missing)) and not self._has_template())
        total = workers.sum_across_workers(have + need * _NEED_TEMPLATE)
        if total % _NEED_TEMPLATE == 0:
            self._done = True
            return None
        if total >= _NEED_TEMPLATE:
            self._exchange_template()
        if step is None:
            structure, empty = self._empty_template()
            columns = [[_MISSING] * local for _ in empty]
            step = _Step(structure, columns, local, missing=range(local))
        return self._finish(step)

    def _finish(self, step: _Step) -> _Step:
        """Fills the replicas without data with empty batches; starts the copies."""
        if step.missing:
            structure, empty = self._empty_template()
            step = step.filled(structure, empty)
        if self._options.experimental_fetch_to_device:
            step = step.to(self._workers.devices, self._cpu_only, self._copies)
        return step
