"""Where a distributed iterator is in its data, so that a checkpoint can resume there.

# NOTE [input position]
A distributed iterator's position is (epoch, global steps delivered), plus one of:

* the loader's own state, where the loader is torchdata's ``StatefulDataLoader``
  (also after DATA sharding rebuilt it): taken after each batch is read, and
  kept with the step in the read-ahead buffer, so the saved state is that of the
  last step *handed out*, not of the last one read ahead. Restoring loads it and
  the loader resumes at the next batch without reading the earlier ones;
* otherwise the random states the epoch's shuffle drew from (torch's CPU
  generator, the loader's and its sampler's generators), twice: when the epoch's
  ``iter(loader)`` was made (a loader with worker processes draws then) and at its
  first batch (a sampler draws its permutation lazily, then). Restoring makes the
  epoch again under the first, draws the first batch under the second (the same
  shuffle), skips the steps already taken (by their indices alone where one batch
  of a single-process loader is one step, else by reading them again), and puts
  torch's generator back as it was.

Python iterators and generators cannot start again, so their position cannot be
saved: `state_dict` raises and says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from distribute.errors import InvalidArgumentError

__all__ = [
    "BATCH_SAMPLERS",
    "RANDOM_SAMPLERS",
    "RecordedDraws",
    "generators_of",
    "is_stateful",
    "loader_of",
    "random_state",
    "replayed_random_state",
]


def _torchdata_samplers() -> tuple[tuple[type, ...], tuple[type, ...]]:
    try:
        from torchdata.stateful_dataloader import sampler
    except ImportError:
        return (), ()
    return (sampler.BatchSampler,), (sampler.RandomSampler,)


#: Batch samplers and shufflers that DATA sharding replaces with seeded ones:
#: torch's, and torchdata's (which a StatefulDataLoader makes; not subclasses).
BATCH_SAMPLERS: tuple[type, ...] = (BatchSampler, *_torchdata_samplers()[0])
RANDOM_SAMPLERS: tuple[type, ...] = (RandomSampler, *_torchdata_samplers()[1])


def is_stateful(loader: Any) -> bool:
    """Whether ``loader`` is torchdata's ``StatefulDataLoader`` (it can save its place)."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:  # a dependency, but an install without it still runs
        return False
    return isinstance(loader, StatefulDataLoader)


def loader_of(iterable: Any) -> DataLoader[Any] | None:
    return iterable if isinstance(iterable, DataLoader) else None


def generators_of(iterable: Any) -> list[torch.Generator]:
    """The generators an epoch of ``iterable`` draws its order from, besides torch's own."""
    found: list[torch.Generator] = []
    candidates = [iterable]
    loader = loader_of(iterable)
    if loader is not None:
        batch_sampler = loader.batch_sampler
        candidates += [loader, loader.sampler, batch_sampler]
        candidates.append(getattr(batch_sampler, "sampler", None))
    for candidate in candidates:
        generator = getattr(candidate, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def random_state(generators: list[torch.Generator]) -> dict[str, Any]:
    """torch's CPU generator's state and ``generators``' states, now."""
    return {"cpu": torch.get_rng_state(), "generators": [g.get_state() for g in generators]}


@contextlib.contextmanager
def replayed_random_state(
    state: dict[str, Any], generators: list[torch.Generator]
) -> Iterator[None]:
    """Sets the generators to ``state`` for the block; puts torch's own back after it.

    The loader's own generators keep what the block left: nothing but the loader
    draws from them, so their state after the replayed draws is the state they
    had at the same point of the interrupted run.
    """
    saved = torch.get_rng_state() if state["cpu"] is not None else None
    if len(state["generators"]) != len(generators):
        raise InvalidArgumentError(
            f"the saved input position drew from {len(state['generators'])} generators but this "
            f"loader has {len(generators)}; restore into the same kind of loader"
        )
    try:
        if state["cpu"] is not None:  # None: torch's generator is left as it is
            torch.set_rng_state(state["cpu"])
        for generator, value in zip(generators, state["generators"]):
            generator.set_state(value)
        yield
    finally:
        if saved is not None:
            torch.set_rng_state(saved)


class RecordedDraws:
    """An epoch's batches whose first batch records (or replays) the random state.

    Args:
        batches: the epoch's iterator of batches.
        generators: the generators the epoch draws from besides torch's own.
        replay: the state to draw the first batch under (a restore); None records
            the state it is drawn under, in `first_draw`.
    """

    def __init__(
        self, batches: Iterator[Any], generators: list[torch.Generator], replay: Any = None
    ) -> None:
        # NOTE [input position]: an epoch not yet drawn from at a save replays its
        # own generators as they are at the save (nothing else draws from them);
        # torch's global generator is then ``ds.RNGState``'s to restore.
        self._batches = batches
        self._generators = generators
        self._replay = replay
        self._started = False
        self.first_draw: dict[str, Any] | None = replay

    def __iter__(self) -> RecordedDraws:
        return self

    def __next__(self) -> Any:
        if self._started:
            return next(self._batches)
        self._started = True
        if self._replay is not None:
            with replayed_random_state(self._replay, self._generators):
                return next(self._batches)
        self.first_draw = random_state(self._generators)
        return next(self._batches)

    def close(self) -> None:
        """Lets go of the epoch's iterator once it has ended (a multi-process
        DataLoader's iterator then shuts its workers down and closes its pipes at
        once, not when the cyclic collector next runs)."""
        self._batches = iter(())

    def skip_indices(self, count: int) -> bool:
        """Skips ``count`` batches of a single-process DataLoader iterator by drawing
        their indices only (the first under the recorded state); False where the
        iterator is of another kind (its data would have to be read)."""
        iterator: Any = self._batches
        sampler_iter = getattr(iterator, "_sampler_iter", None)
        if type(iterator).__name__ != "_SingleProcessDataLoaderIter" or sampler_iter is None:
            return False
        for _ in range(count):
            try:
                if not self._started:
                    self._started = True
                    if self._replay is not None:
                        with replayed_random_state(self._replay, self._generators):
                            next(sampler_iter)
                    else:
                        self.first_draw = random_state(self._generators)
                        next(sampler_iter)
                else:
                    next(sampler_iter)
            except StopIteration:
                break
            iterator._num_yielded += 1
        return True

    def state(self) -> dict[str, Any]:
        """The state the first batch was (or, not drawn yet, will be) drawn under."""
        if self.first_draw is not None:
            return self.first_draw
        return {"cpu": None, "generators": [g.get_state() for g in self._generators]}
