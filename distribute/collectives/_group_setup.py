"""Starting and ending the process group a `ProcessGroupCollectives` works over.

The rendezvous (NOTE [rendezvous] in _rendezvous.py), the check that no two ranks
drive one GPU, `init_process_group`, the count of the group's users, and the
finalizer that destroys the group when its last user goes, or keeps it for good when
a collective was abandoned mid-flight.

# NOTE [shared groups]
torch has one default process group per process, and several strategies may use it
at once: a second `MultiWorkerMirroredStrategy` adopts the group the first one
created (``strategy = ds.MultiWorkerMirroredStrategy()`` twice), and so does a
`ModelParallelStrategy` or `FullyShardedStrategy` built after one. A group this
library initialised is therefore counted, not owned: `GroupUsers` records every
collectives object over it (the one that created it and each that adopted it), and
the last to be shut down or collected destroys it, in whatever order they go. A
group the user initialised (``dist.init_process_group`` before any strategy) is
never destroyed by the library. The record of the library's groups is
process-wide, as torch's default group is.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import logging
import socket
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from distribute._torch import PrefixStore, Store
from distribute.collectives._deadlines import nccl_group_timeout
from distribute.collectives._liveness import Liveness
from distribute.collectives._rendezvous import rendezvous
from distribute.errors import CollectiveTimeoutError, InvalidArgumentError

__all__ = [
    "GroupUsers",
    "check_distinct_devices",
    "close_group",
    "default_group_matches",
    "device_identity",
    "init_default_group",
    "store_host",
    "work_done",
]

logger = logging.getLogger(__name__)


def default_group_matches(rank: int, world_size: int) -> bool:
    """Whether `torch.distributed` already has a default group for this rank and world
    size (then it is adopted, not created).

    Raises:
        InvalidArgumentError: a bad rank, or a group initialised differently.
        CollectiveTimeoutError: the default group broke in an earlier collective.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgumentError(
            f"rank must be in [0, world_size={world_size}), got rank {rank}; check the "
            "cluster resolver's RANK and WORLD_SIZE."
        )
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if id(dist.group.WORLD) in _ABANDONED:
        raise CollectiveTimeoutError(
            "torch.distributed's default process group broke in an earlier "
            "collective of this process (a peer failed, or it was interrupted), and "
            "it cannot be used again; restart every worker"
        )
    if dist.get_rank() != rank or dist.get_world_size() != world_size:
        raise InvalidArgumentError(
            f"torch.distributed is already initialised as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, but the cluster says rank {rank} of {world_size}; "
            "destroy the existing group or pass a matching cluster resolver."
        )
    return True


def init_default_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    *,
    backend: str,
    timeout_seconds: float,
    cluster: str,
    prefix: str,
    launcher_serves: bool,
    device: torch.device | None,
) -> Store:
    """Meets the other ranks and initialises the default group; returns the store."""
    store = rendezvous(
        rank,
        world_size,
        master_addr,
        master_port,
        timeout_seconds,
        cluster=cluster,
        prefix=prefix,
        launcher_serves=launcher_serves,
    )
    if device is not None and device.type == "cuda" and world_size > 1:
        check_distinct_devices(
            store, rank, world_size, device_identity(device), max(timeout_seconds, 30.0)
        )
    _bind_torch_defaults_before_init()
    group_timeout = (
        nccl_group_timeout(timeout_seconds)
        if backend == "nccl"
        else datetime.timedelta(seconds=timeout_seconds)
    )
    dist.init_process_group(
        backend,
        store=PrefixStore("pg/", store),
        rank=rank,
        world_size=world_size,
        timeout=group_timeout,
        device_id=device,
    )
    return store


def _bind_torch_defaults_before_init() -> None:
    """Imports `torch.distributed.nn.functional` while no default group exists.

    Its functions take ``group=group.WORLD`` as a default argument, evaluated at
    import, and `torch._dynamo` imports it lazily (the first optimizer does). Imported
    after `init_process_group`, those defaults pin the default group forever, so
    `destroy_process_group` cannot free it and gloo's worker threads outlive the
    interpreter: one that drops a finished collective's tensors during interpreter
    finalization needs the GIL and aborts the process ("terminate called without an
    active exception"). Imported now, the defaults are None (the default group).
    """
    import torch.distributed.nn.functional  # noqa: F401


def store_host(store: Store) -> str:
    """The host serving ``store`` (a TCPStore, possibly behind PrefixStores)."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return str(getattr(store, "host", "127.0.0.1"))


class GroupUsers:
    """The collectives objects that use one process group this library initialised
    (NOTE [shared groups]); the last of them to leave destroys the group.

    Build it with `share_group`. Thread-safe: finalizers may run in any thread.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group: dist.ProcessGroup | None = group  # None once the last user left
        self._count = 0
        self._broken = False
        self._lock = threading.Lock()

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The shared group (None once its last user left)."""
        return self._group

    @property
    def count(self) -> int:
        """How many collectives objects use the group now."""
        return self._count

    def join(self) -> GroupUsers:
        """Counts one more user; returns self."""
        with self._lock:
            self._count += 1
        return self

    def leave(self, broken: bool) -> None:
        """One user is gone (``broken``: it abandoned a collective, or one failed);
        the last destroys the group, unless any user left it broken."""
        with self._lock:
            self._count -= 1
            self._broken = self._broken or broken
            last = self._count == 0
            group = self._group
            if last:
                # Not held past its end: the group holds the store, whose port the
                # next strategy's rendezvous may serve again.
                self._group = None
        if group is None:
            return
        if broken:
            # A collective was abandoned mid-flight (a peer failed, or Ctrl-C in a
            # wait): destroying the group, or freeing it as the interpreter ends,
            # would wait for that collective (gloo's destructor drains its queue),
            # up to its timeout. The group is kept until the process is gone, and
            # no new strategy adopts it.
            logger.debug("keeping a process group with abandoned work")
            _keep_until_exit(group)
        if not last:
            return
        with _SHARED_LOCK:
            if _SHARED.get(id(group)) is self:
                del _SHARED[id(group)]
        if self._broken or not dist.is_initialized():
            return
        default = dist.group.WORLD is group
        try:
            dist.destroy_process_group(None if default else group)
        except Exception:  # interpreter shutdown, or the user destroyed it already
            logger.debug("destroy_process_group failed", exc_info=True)


def share_group(group: dist.ProcessGroup | None, created: bool) -> GroupUsers | None:
    """Counts a new collectives object over ``group`` (None: the default group) among
    its users (NOTE [shared groups]).

    Args:
        group: the group the object works over.
        created: whether the caller initialised the group for this object.

    Returns:
        The group's users, this object counted, when the library initialised the
            group (now or for an earlier object); None for a group someone else made,
            which the library never destroys.
    """
    if group is None:
        if not dist.is_initialized():
            return None
        group = dist.group.WORLD
    if group is None:
        return None
    with _SHARED_LOCK:
        users = _SHARED.get(id(group))
        if users is None or users.group is not group:
            if not created:
                return None
            users = _SHARED[id(group)] = GroupUsers(group)
        return users.join()


def close_group(
    liveness: Liveness | None,
    users: GroupUsers | None,
    state: list[Any],
    launched: list[Any],
) -> None:
    """Stops the watcher and leaves the group, destroying it if this was its last
    user (the finalizer of a collectives object). At the interpreter's exit, the
    group's unwaited works are kept for good (NOTE [works at exit])."""
    if liveness is not None:
        liveness.stop()
    abandoned = not all(work.is_completed() for work in launched)
    if _EXITING[0]:
        for work in launched:
            _never_free(work)
    launched.clear()  # a work holds the group, and the group the store's server port
    if users is not None:
        if state[0] is not None:
            logger.debug("leaving a process group that broke: %s", state[0])
        users.leave(broken=state[0] is not None or abandoned)


def check_distinct_devices(
    store: Store, rank: int, world_size: int, identity: str, timeout_seconds: float
) -> None:
    """Raises on every rank when two ranks would drive one GPU.

    Each rank posts ``identity`` (host and GPU UUID) to the rendezvous store and
    reads everyone's, before NCCL is initialised, whose own message for this
    ("Duplicate GPU detected") names neither the ranks nor the fix.

    Raises:
        InvalidArgumentError: two ranks share a device (both are named).
    """
    store.set(f"device/{rank}", identity)
    keys = [f"device/{r}" for r in range(world_size)]
    store.wait(keys, datetime.timedelta(seconds=timeout_seconds))
    owners: dict[str, int] = {}
    for r in range(world_size):
        seen = store.get(f"device/{r}").decode()
        if seen in owners:
            raise InvalidArgumentError(
                f"ranks {owners[seen]} and {r} both use GPU {seen!r}: each worker process "
                "needs its own GPU. Start one process per GPU (torchrun --nproc_per_node = "
                "GPUs per host), give each its own CUDA_VISIBLE_DEVICES, or pass distinct "
                "devices"
            )
        owners[seen] = r


def device_identity(device: torch.device) -> str:
    """``host/GPU UUID`` of a CUDA device (its index where the UUID is unknown)."""
    properties = torch.cuda.get_device_properties(device)
    uuid = getattr(properties, "uuid", None)
    return f"{socket.gethostname()}/{uuid if uuid is not None else device.index}"


# Groups left with an abandoned collective (by id: they are never freed, so an id is
# never reused). Such a group cannot be adopted again.
_ABANDONED: set[int] = set()

# The users of each group this library initialised and has not destroyed yet, by the
# group's id (the record holds the group, so that id is not reused meanwhile).
_SHARED: dict[int, GroupUsers] = {}
_SHARED_LOCK = threading.Lock()


# NOTE [works at exit]
# A gloo worker thread (`pt_gloo_runloop`) drops its own reference to a finished work
# a moment after waking the waiter. If the waiter has already dropped its own, the
# worker frees the work, and with it the work's tensors, whose Python objects torch
# keeps alive from C++: freeing them takes the GIL. When the process's last collective
# is followed at once by the interpreter's exit, that worker may wake inside
# `Py_FinalizeEx`, where taking the GIL ends the thread, and the C++ runtime aborts the
# process ("terminate called without an active exception", SIGABRT, after the
# script's own work is done; 1 run in 12 of the fully sharded example under torchrun
# on 2 busy cores, and 7 in 24 when the script called `strategy.shutdown()` last).
# So the exit waits for the workers: every collective this library waits for records
# when it finished (`work_done`), and the atexit phase, while the interpreter still
# runs every thread, first sleeps until `SETTLE_SECONDS` have passed since the last
# one (`_settle`; at most that long, and only when a collective finished that
# recently). Works launched and never waited for are kept for good when their group
# is closed at exit (`_never_free`): gloo may still be running them.
# The first fix kept each collectives object's last four waited works alive instead:
# that held their buffers (the initial broadcast's, the size of the model) for the
# rest of the run, 14 MiB more at FullyShardedStrategy's peak on the benchmark's
# model (0.48 -> 0.58 of MultiWorkerMirrored), and could not help a group closed by
# `shutdown()` before the exit.
SETTLE_SECONDS = 0.1
_LAST_DONE = [float("-inf")]


def work_done() -> None:
    """Records that a collective just finished (NOTE [works at exit])."""
    _LAST_DONE[0] = time.monotonic()


def _settle() -> None:
    """Sleeps until `SETTLE_SECONDS` after the last finished collective, if that is
    still ahead: gloo's workers let their works go while the interpreter runs."""
    left = SETTLE_SECONDS - (time.monotonic() - _LAST_DONE[0])
    if left > 0:
        time.sleep(left)


_EXITING = [False]


def _mark_exiting() -> None:
    _EXITING[0] = True
    _settle()


# atexit runs the hook registered last first, and the collectives objects are closed
# at exit by `weakref.finalize`'s own hook: making a finalizer registers that hook (if
# nothing did yet), so that `_mark_exiting`, registered after it, runs before it.
weakref.finalize(_mark_exiting, _mark_exiting).atexit = False
atexit.register(_mark_exiting)


def _never_free(obj: Any) -> None:
    """Takes a reference to ``obj`` that is never released, not even when the
    interpreter clears modules at exit: its destructor never runs."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _keep_until_exit(group: Any) -> None:
    """Keeps ``group``, abandoned, for good (`_never_free`): no strategy adopts it again."""
    if group is not None and id(group) not in _ABANDONED:
        _never_free(group)
        _ABANDONED.add(id(group))
