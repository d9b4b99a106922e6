"""The rendezvous: a `TCPStore` served by rank 0 that every rank joins.

Each rank marks itself ``joined/<rank>`` and bumps a counter, so a rendezvous that
times out names the ranks that never came, instead of torch's bare store timeout.
"""

from __future__ import annotations

import datetime
import time

from torch._C._distributed_c10d import Store, TCPStore

from distribute.errors import CollectiveTimeoutError

__all__ = ["rendezvous"]

#: The shortest wait for the other ranks to start (importing torch takes seconds).
_MIN_WAIT_SECONDS = 30.0


def rendezvous(
    rank: int, world_size: int, master_addr: str, master_port: int, timeout_seconds: float
) -> Store:
    """Creates the TCPStore (served by rank 0) and waits until every rank joined.

    Raises:
        CollectiveTimeoutError: the store could not be served or reached, or some
            ranks never joined (they are named).

    Example::

        store = rendezvous(0, 1, "127.0.0.1", 29500, timeout_seconds=60)
    """
    wait = max(timeout_seconds, _MIN_WAIT_SECONDS)
    try:
        store = TCPStore(
            master_addr,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=datetime.timedelta(seconds=wait),
            wait_for_workers=False,
        )
    except Exception as exc:
        where = f"{master_addr}:{master_port}"
        raise CollectiveTimeoutError(
            f"rank {rank} could not {'serve' if rank == 0 else 'reach'} the rendezvous at {where}"
            f" within {wait:.0f} s: {exc}. Check MASTER_ADDR/MASTER_PORT (or TF_CONFIG), that "
            "the port is free on rank 0's host, and that rank 0 started."
        ) from exc
    store.set(f"joined/{rank}", "1")
    store.add("joined", 1)
    deadline = time.monotonic() + wait
    while int(store.add("joined", 0)) < world_size:
        if time.monotonic() > deadline:
            absent = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
            raise CollectiveTimeoutError(
                f"rendezvous at {master_addr}:{master_port} timed out after {wait:.0f} s: ranks "
                f"{absent} of {world_size} never joined. Start every worker with the same "
                "cluster (WORLD_SIZE, or TF_CONFIG's worker list)."
            )
        time.sleep(0.01)
    return store
