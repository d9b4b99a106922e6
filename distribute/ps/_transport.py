"""The one interface parameter-server tasks talk through, and its rpc implementation.

Everything the parameter-server code sends between tasks goes through `Transport`:
start it, call a module-level function on a named task (a future), forget a dead
task (its restarted process may then join), stop it. The implementation here is
`torch.distributed.rpc` over TensorPipe, which upstream has put in maintenance
mode; another transport (gRPC, a socket protocol) replaces it by implementing
these few methods.

The rpc agent joins through the store of this library's rendezvous (`rendezvous()`:
bounded, comparing every task's cluster spec, naming a duplicated task), so a task
of another job that reaches the same port is refused before any rpc is set up.

Example::

    transport = RpcTransport.start("worker_0", rank=1, world_size=4, store=store,
                                   timeout_seconds=60)
    future = transport.call("ps_0", some_module.some_function, (x,))
    value = future.wait()
    transport.shutdown()
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from torch.futures import Future

from distribute import _env, _torch
from distribute.errors import CollectiveTimeoutError, InvalidArgumentError

logger = logging.getLogger(__name__)

__all__ = ["RpcTransport", "Transport"]


class Transport(Protocol):
    """What the parameter-server tasks need from a transport."""

    @property
    def name(self) -> str: ...

    def call(
        self, task: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float
    ) -> Future[Any]:
        """Runs ``fn(*args)`` on `task`; the future fails when the task dies or the
        call takes longer than `timeout` seconds."""
        ...

    @property
    def restarted(self) -> bool:
        """Whether this process took over a task that had died (a rejoining worker)."""
        ...

    def forget(self, task: str) -> None:
        """Forgets dead `task`, so that its restarted process can join."""
        ...

    def quiesce(self) -> None:
        """Marks this task as leaving: peers closing their connections from now on
        are expected, not errors (NOTE [quiet shutdown]). Calls still work."""
        ...

    def shutdown(self) -> None:
        """Stops this task's endpoint without waiting for the others."""
        ...


class RpcTransport:
    """`Transport` over `torch.distributed.rpc` (TensorPipe), one per process.

    The rpc group is dynamic (``world_size=None``), so a worker's restarted process
    can join a running cluster (NOTE [rpc names]).
    """

    def __init__(self, name: str, rpc_name: str, store: Any, timeout: float) -> None:
        self._name = name
        self._rpc_name = rpc_name
        self._store = store
        self._timeout = timeout
        self._stopped = False
        self._quiet = False

    @classmethod
    def start(
        cls,
        name: str,
        *,
        host: str,
        rank: int,
        world_size: int,
        store: Any,
        timeout_seconds: float,
    ) -> RpcTransport:
        """Joins the cluster's rpc group through `store`, listening on `host` (this
        task's address in the cluster spec) only. A task's first process returns
        once every task has joined; a restarted one (its rank started before)
        returns once every live task knows its new rpc name.

        Raises:
            CollectiveTimeoutError: tasks did not join within `timeout_seconds`.
        """
        import torch.distributed.rpc as rpc

        generation = int(store.add(f"transport/starts/{rank}", 1)) - 1
        rpc_name = name if generation == 0 else f"{name}:{generation}"
        worker_id = rank + world_size * generation  # rpc never takes an id back either
        if worker_id > _MAX_WORKER_ID:
            raise InvalidArgumentError(
                f"{name} was restarted {generation} times; rpc has no ids left for it: "
                "restart the cluster"
            )
        _check_listening_interface(host)
        options = rpc.TensorPipeRpcBackendOptions(
            rpc_timeout=timeout_seconds,
            init_method="tcp://unused",
            # TCP only: TensorPipe's shared-memory transport busy-polls, half a core
            # per idle process (a 4-worker cluster on 2 cores spun 3.5 of them), and
            # its multiplexed channel opens 16 more listeners per task.
            _transports=["uv"],
            _channels=["basic"],
        )
        # What init_rpc does after its own rendezvous; the store is ours (module doc).
        _torch.rpc_init_backend(store, rpc_name, worker_id, options)
        transport = cls(name, rpc_name, store, timeout_seconds)
        if generation == 0:
            transport._wait_for_everyone(rank, world_size)
        else:
            transport._announce()
        return transport

    @property
    def name(self) -> str:
        return self._name

    @property
    def restarted(self) -> bool:
        return self._rpc_name != self._name

    def call(
        self, task: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float
    ) -> Future[Any]:
        import torch.distributed.rpc as rpc

        future: Future[Any] = rpc.rpc_async(
            _rpc_names.get(task, task), fn, args=args, timeout=timeout
        )
        return future

    def forget(self, task: str) -> None:
        """Drops dead `task` from rpc's member list, every process it ran as (one
        may have died before its new name reached this task), so that processes
        joining later (its restarted process among them) do not call it."""
        with self._membership_token():
            members = self._store.get(_MEMBERS_KEY).decode()
            kept = [
                m for m in members.split(",") if m and m.rsplit("-", 1)[0].split(":")[0] != task
            ]
            self._store.set(_MEMBERS_KEY, "".join(f"{m}," for m in kept))

    def quiesce(self) -> None:
        if self._stopped or self._quiet:
            return
        self._quiet = True
        # A dynamic group's join: waits for this task's own calls to end and marks
        # its agent as shutting down, closing nothing (NOTE [quiet shutdown]).
        _torch.rpc_current_agent().join(shutdown=True)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        import torch.distributed.rpc as rpc

        rpc.shutdown(graceful=False)
        _rpc_names.clear()  # a next cluster in this process starts with first names

    # -- internals ------------------------------------------------------------------

    def _wait_for_everyone(self, rank: int, world_size: int) -> None:
        """A task's first start: waits until every task has joined the rpc group
        (until then a call to a task that has not joined would fail)."""
        self._store.set(f"transport/ready/{rank}", "1")
        keys = [f"transport/ready/{r}" for r in range(world_size)]
        deadline = time.monotonic() + self._timeout
        while not self._store.check(keys):
            if time.monotonic() > deadline:
                absent = [r for r, k in enumerate(keys) if not self._store.check([k])]
                raise CollectiveTimeoutError(
                    f"{self._name}: ranks {absent} of the parameter-server cluster did not "
                    f"join its rpc group within {self._timeout:.0f} s"
                )
            time.sleep(0.01)

    def _announce(self) -> None:
        """A restarted task: tells every live task its new rpc name."""
        import torch.distributed.rpc as rpc

        futures = [
            (info.name, rpc.rpc_async(info.name, _renamed, args=(self._name, self._rpc_name)))
            for info in _torch.rpc_current_agent().get_worker_infos()
            if info.name != self._rpc_name
        ]
        for member, future in futures:
            try:
                future.wait()
            except RuntimeError as e:  # a member that died since: nothing to tell it
                logger.warning(
                    "%s: %s did not hear this task's new name: %s", self._name, member, e
                )
        _renamed(self._name, self._rpc_name)

    @contextlib.contextmanager
    def _membership_token(self) -> Iterator[None]:
        """Holds rpc's membership token (rpc's joins and leaves hold it too)."""
        mine = f"Token_for_{self._rpc_name}_forget_{uuid.uuid4().hex}"
        expected, seen, since = "", "", time.monotonic()
        while (holder := self._store.compare_set(_TOKEN_KEY, expected, mine).decode()) != mine:
            expected = ""
            if holder != seen:
                seen, since = holder, time.monotonic()
            elif holder and time.monotonic() - since > self._timeout:
                # rpc leaves its token held when a join fails (a member it called
                # had died); one holder for this long is gone: take it over
                logger.warning("%s: taking over rpc's membership token from %s", self._name, holder)
                self._store.set(holder, "Done")
                expected = holder
                continue
            time.sleep(0.01)
        try:
            yield
        finally:
            self._store.set(_TOKEN_KEY, "")
            self._store.set(mine, "Done")  # what a joiner that waited for us waits on


# NOTE [quiet shutdown]
# TensorPipe logs a warning ("encountered error when reading incoming request from
# X: pipe closed / EOF") whenever a peer's connection closes while this agent is not
# shutting down itself, so a plain shutdown of a cluster printed one per pair of
# tasks. A normal exit therefore has two phases: every task is quiesced first (its
# agent marked as shutting down; connections stay open, calls still work), and only
# then does any task close its endpoint. A dead task cannot be quiesced: the others
# still report its connections, which is then news.

# NOTE [rpc names]
# rpc keeps a name, and an id, for good once a process took it, and refuses a second
# process under it; ``-`` separates name and id in its member list. A task's first
# process is named as the task (``worker_1``), a restarted one ``worker_1:<n>``, with
# id ``rank + world_size * n``. Every process maps task names to the current rpc
# names (`_rpc_names`), so callers only ever name tasks. A dead task stays in rpc's
# member list (rpc assumes members leave with a graceful shutdown), and a process
# joining calls every member, so the chief `forget`s dead tasks before a restarted
# one joins. The keys below are rpc's own layout in the store (torch 2.x,
# torch/csrc/distributed/rpc/agent_utils.cpp); the worker-restart test fails if it
# changes.
_MEMBERS_KEY = "names/_ALL_WORKER_INFOS"
_TOKEN_KEY = "RpcGroupManagementToken"
_MAX_WORKER_ID = 32767  # rpc's ids are int16

_rpc_names: dict[str, str] = {}


# NOTE [rpc's listening interface]
# TensorPipe listens on the interface `TP_SOCKET_IFNAME` names, else on the address
# this machine's hostname resolves to; it reads the variable itself, once, when the
# first agent starts, and has no option for it. The library does not write the
# variable into the user's process (it once did, from the cluster spec): whoever starts
# a task sets it. `LocalCluster` sets it for the tasks it starts; a task started
# otherwise, whose hostname's address is not its cluster-spec address, logs which
# value to set (`_check_listening_interface`).


def _check_listening_interface(host: str) -> None:
    """Warns when TensorPipe will listen elsewhere than on `host` (this task's address
    in the cluster spec), naming the ``TP_SOCKET_IFNAME`` that would fix it (NOTE
    [rpc's listening interface]). Quiet when the variable is set."""
    if _env.read_environment().tp_socket_ifname:
        return
    from distribute.collectives._rendezvous import loopback_alias

    if loopback_alias(host):
        logger.warning(
            "%s names this machine but resolves to a loopback address here; rpc listens "
            "where TensorPipe picks (set TP_SOCKET_IFNAME to choose)",
            host,
        )
        return
    interface = interface_of(host)
    if interface is None:
        logger.warning(
            "no network interface of this machine has the address of %s (this task's "
            "address in the cluster spec); rpc listens where TensorPipe picks (set "
            "TP_SOCKET_IFNAME to choose)",
            host,
        )
        return
    hostname = _hostname_address()
    if hostname is None or interface_of(hostname) != interface:
        logger.warning(
            "rpc (TensorPipe) will listen on %s, the address of this machine's hostname, "
            "not on %s, this task's address in the cluster spec; set "
            "TP_SOCKET_IFNAME=%s in the task's environment before it starts to listen "
            "there only",
            hostname,
            host,
            interface,
        )


def _hostname_address() -> str | None:
    """The IPv4 address this machine's hostname resolves to (TensorPipe's default)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def listening_environment(host: str) -> dict[str, str]:
    """The ``TP_SOCKET_IFNAME`` for a task about to be started at `host` (a launcher
    puts it in the task's environment), or nothing when no interface has `host`."""
    interface = interface_of(host)
    return {"TP_SOCKET_IFNAME": interface} if interface is not None else {}


def interface_of(host: str) -> str | None:
    """The name of this machine's network interface with `host`'s IPv4 address
    (Linux), or None."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None
    if not sys.platform.startswith("linux"):
        return None
    import fcntl

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    sock.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode())
                )
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return "lo" if address.startswith("127.") else None


def _renamed(task: str, rpc_name: str) -> None:
    """Run on every live task when `task` comes back as `rpc_name`."""
    _rpc_names[task] = rpc_name
