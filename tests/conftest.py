"""Shared fixtures: the strategy combinations most tests run under.

Adding a strategy to `STRATEGY_FACTORIES` makes every parametrized test cover it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import distribute as ds

# `launch.run`'s workers fork from a preloaded interpreter instead of importing torch
# afresh (1.5-2.5 s of CPU each): the suite's multi-process tests run about twice as
# fast. `--launch-start=fresh` starts them as new interpreters, as users run (CI runs
# the multi-process tests both ways); tests/distributed/test_launch.py covers both.
pytest_plugins = ["_preloaded_launch"]

STRATEGY_FACTORIES: dict[str, Callable[[], ds.Strategy]] = {
    "default": ds.get_strategy,
    "one_device": lambda: ds.OneDeviceStrategy("cpu"),
    "mirrored_1": lambda: ds.MirroredStrategy(["cpu:0"]),
    "mirrored_4": lambda: ds.MirroredStrategy([f"cpu:{i}" for i in range(4)]),
    "central_storage": lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}


@pytest.fixture(params=sorted(STRATEGY_FACTORIES))
def strategy(request: pytest.FixtureRequest) -> ds.Strategy:
    """Every strategy combination in turn."""
    return STRATEGY_FACTORIES[request.param]()


def per_replica(strategy: ds.Strategy, values: list[object]) -> object:
    """Wraps one value per local replica the way `run` would return them."""
    return values[0] if len(values) == 1 else ds.PerReplica(values)
