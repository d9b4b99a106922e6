"""The rendezvous: the `TCPStore` every rank joins, served by rank 0 or by the launcher.

# NOTE [rendezvous]
Every wait here ends by one deadline, ``start + max(timeout_seconds,
min_wait_seconds)`` (a worker's start, importing torch, can take longer than a
collective timeout suited to the steps; the message prints the bound it used):

* rank 0's store listens on the rendezvous address only (torch's would listen
  on every interface of the host);
* opening the store runs in a helper thread, so a port held by a program that
  accepts connections and never answers cannot block a rank past the deadline
  (torch's own connect retries and handshake have no such bound);
* each rank publishes a description of the cluster it was started with
  (``cluster/<rank>``), and every other rank compares its own with rank 0's while
  it waits: workers started with different cluster specs (two TF_CONFIG worker
  lists) fail at once, naming the difference, instead of in a raw store timeout;
  a rank claims its rank and counts as joined only once it agrees with rank 0, so
  rank 0 never goes on with a rank about to report a difference, and a task of
  another cluster is named as such, not as a duplicate of the task holding its rank;
* each rank claims ``owner/<rank>`` with its process's id: a second process
  claiming the same rank (two tasks with one TF_CONFIG index) is named, while the
  same process joining again after a dropped connection is not; one that claims
  rank 0 while another serves it is named too, and, while the rendezvous still
  gathers, it posts that for the one serving (both fail at once);
* with ``rejoin`` (a parameter-server worker), a process claiming a rank whose
  holder has died takes it over: it posts ``rejoin/<rank>`` and waits until the
  chief, having found the holder dead, releases ``owner/<rank>`` (or says that the
  holder is alive: two processes claim the task);
* a problem found while the ranks gather is posted under ``error`` for all to
  raise; after rank 0 has seen everyone (``complete``), a latecomer's problem is
  raised by the latecomer alone;
* ranks that never come are named when the deadline passes.

Keys live under ``<prefix><n>``: the prefix separates a launcher's attempts
(torchrun's agent keeps its store across restarts, and a restarted worker must not
read the dead attempt's keys), and ``n`` counts this process's completed
rendezvous at that address (a failed attempt does not count, so a retry meets the
others), so the n-th strategy of every rank meets the n-th of the others (several
strategies in one torchrun process), while a second process claiming a running
rank meets that rank's keys and is named.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import errno
import ipaddress
import logging
import socket
import threading
import time
import uuid
from typing import Any, NoReturn

from torch.distributed import DistNetworkError

from distribute._torch import PrefixStore, Store, TCPStore
from distribute.errors import CollectiveTimeoutError, InvalidArgumentError, RendezvousError

__all__ = ["MIN_WAIT_SECONDS", "rendezvous"]

logger = logging.getLogger(__name__)

#: The shortest wait for the other ranks to start (importing torch takes seconds).
MIN_WAIT_SECONDS = 30.0
#: How long a rank that could not serve rank 0's store looks for who holds the port.
_PROBE_SECONDS = 3.0
_POLL_SECONDS = 0.01
_MAX_POLL_SECONDS = 0.25
#: Tells this process's claims on a rank from another process's.
_PROCESS_ID = uuid.uuid4().hex

# This process's completed rendezvous, per (address, prefix): see the module docstring.
_made: collections.Counter[tuple[str, str]] = collections.Counter()


def rendezvous(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_seconds: float,
    *,
    cluster: str = "",
    prefix: str = "",
    launcher_serves: bool = False,
    min_wait_seconds: float = MIN_WAIT_SECONDS,
    rejoin: bool = False,
) -> Store:
    """Opens the store (rank 0 serves it unless the launcher does) and waits for every rank.

    Args:
        rank: this process's rank.
        world_size: the number of ranks.
        master_addr: the store's host.
        master_port: the store's port.
        timeout_seconds: the bound on the whole rendezvous (at least
            ``min_wait_seconds``).
        cluster: a description of the cluster this rank was started with; every
            rank's must be equal.
        prefix: a key prefix for this attempt of the job.
        launcher_serves: the launcher serves the store (torchrun's agent): rank 0
            joins it like the others.
        min_wait_seconds: the shortest bound, for workers that start slowly.
        rejoin: once the rendezvous is complete, this process may take over its
            rank from a dead process (NOTE [rendezvous]).

    Returns:
        The store, under this rendezvous's own key prefix.

    Raises:
        CollectiveTimeoutError: the store could not be opened, or ranks never
            joined, within the bound (the message says which and why).
        InvalidArgumentError: ranks were started with different clusters, or two
            processes claim one rank.
        RendezvousError: the store went away (rank 0 died) while this rank joined.

    Example::

        store = rendezvous(0, 1, "127.0.0.1", 29500, timeout_seconds=60)
    """
    start = time.monotonic()
    bound = max(timeout_seconds, min_wait_seconds)
    deadline = start + bound
    where = f"{master_addr}:{master_port}"
    serve = rank == 0 and not launcher_serves
    namespace = f"{prefix}{_made[(where, prefix)] + 1}"
    while True:
        raw = _open(
            rank, world_size, master_addr, master_port, serve, deadline, bound, cluster, prefix
        )
        try:
            store = PrefixStore(namespace, raw)
            _join(store, rank, world_size, cluster, where, start, deadline, bound, rejoin)
            break
        except DistNetworkError as exc:
            # A rank that finished a previous strategy first can reach rank 0's old
            # store just before it closes: the connection drops, and the rank joins
            # again (rank 0's new store is what it reaches next).
            if serve or time.monotonic() > deadline:
                raise RendezvousError(
                    f"rank {rank} lost the rendezvous store at {where} after "
                    f"{time.monotonic() - start:.1f} s: {exc}. Check that rank 0 is alive"
                ) from exc
            logger.debug("the rendezvous store at %s went away; joining again", where)
    _made[(where, prefix)] += 1  # only a rendezvous that happened counts
    # The store was opened with what was left of the bound; later waits on it (gloo's
    # connection set-up, the failure diagnosis) get the whole bound again.
    raw.set_timeout(datetime.timedelta(seconds=bound))
    return store


def _join(
    store: Store,
    rank: int,
    world_size: int,
    cluster: str,
    where: str,
    start: float,
    deadline: float,
    bound: float,
    rejoin: bool = False,
) -> None:
    """Publishes this rank and waits until every rank has (see NOTE [rendezvous]).

    Polls back off from 10 ms to a quarter second, and each costs two or three
    store requests whatever the world size, so a large cluster does not flood
    rank 0's store.
    """
    store.set(f"cluster/{rank}", cluster)
    # A rank compares its cluster with rank 0's before it claims its rank or is
    # counted: a task of another cluster is named as such (not as a duplicate of
    # whichever task holds its rank there), and a rank about to report a
    # difference never completes rank 0's wait (rank 0 would go on alone).
    agreed = rank == 0
    if agreed:
        _claim(store, rank, where)
        _count(store, rank, world_size)
    poll = _POLL_SECONDS
    while True:
        if store.check(["error"]):
            raise InvalidArgumentError(store.get("error").decode())
        if not agreed and store.check(["cluster/0"]):
            theirs = store.get("cluster/0").decode()
            if theirs != cluster:
                _refuse(
                    store,
                    f"rank {rank} and rank 0 were started with different clusters: rank {rank} "
                    f"has {_short(cluster)} but rank 0 has {_short(theirs)}. Give every task "
                    "the same cluster spec (the same TF_CONFIG cluster, WORLD_SIZE and "
                    "MASTER_ADDR:MASTER_PORT)",
                )
            agreed = True
            _claim(store, rank, where, deadline if rejoin else None)
            _count(store, rank, world_size)
        if agreed and int(store.add("joined", 0)) >= world_size:
            return
        if time.monotonic() > deadline:
            absent = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
            raise CollectiveTimeoutError(
                f"rendezvous at {where} timed out after {time.monotonic() - start:.1f} s (the "
                f"bound: {bound:.0f} s): ranks {absent} of {world_size} never joined. Start "
                "every worker with the same cluster (WORLD_SIZE, or TF_CONFIG's worker list), "
                "or raise the timeout if they start slowly (CommunicationOptions."
                "timeout_seconds; a parameter-server strategy's timeout_seconds)"
            )
        time.sleep(poll)
        poll = min(poll * 1.5, _MAX_POLL_SECONDS)


def _claim(store: Store, rank: int, where: str, rejoin_by: float | None = None) -> None:
    """Claims `rank` for this process; another process holding it is named (with
    `rejoin_by`, a deadline, this process may take over from a dead holder)."""
    owner = store.compare_set(f"owner/{rank}", "", _PROCESS_ID).decode()
    if owner != _PROCESS_ID and rejoin_by is not None and store.check(["complete"]):
        _take_over(store, rank, where, rejoin_by)
    elif owner != _PROCESS_ID:
        _refuse(
            store,
            f"two processes claim rank {rank} of the rendezvous at {where}: each task needs "
            "its own index (check TF_CONFIG's task index, or RANK), and a restarted task "
            "must wait until the old one is gone",
        )


def _take_over(store: Store, rank: int, where: str, deadline: float) -> None:
    """Asks the chief for `rank`, held by another process, and waits for its answer:
    the rank (its holder was dead) or a refusal (it is alive)."""
    store.set(f"rejoin/{rank}", _PROCESS_ID)
    store.add("rejoins", 1)
    poll = _POLL_SECONDS
    while store.compare_set(f"owner/{rank}", "", _PROCESS_ID).decode() != _PROCESS_ID:
        if store.check([f"refused/{_PROCESS_ID}"]):
            raise InvalidArgumentError(store.get(f"refused/{_PROCESS_ID}").decode())
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"rank {rank} of the rendezvous at {where} is still held by another process, "
                "and the chief did not release it: it answered neither that the holder is "
                "dead nor that it is alive (is the chief running?)"
            )
        time.sleep(poll)
        poll = min(poll * 1.5, _MAX_POLL_SECONDS)


def _refuse(store: Store, message: str) -> NoReturn:
    """Raises `message`; while the rendezvous is still gathering, posts it for every
    rank too (they were started inconsistently). Once it is complete, a latecomer
    (a stray task of another job, a duplicate) fails alone: the running job and
    whoever joins next are not told its error."""
    if store.check(["complete"]):
        raise InvalidArgumentError(message)
    _post(store, message)


def _count(store: Store, rank: int, world_size: int) -> None:
    """Counts this rank as joined, once (a rank joining again after a dropped
    connection is not counted twice); the last to join marks the rendezvous
    complete at once, before any rank goes on."""
    if not store.check([f"joined/{rank}"]):
        store.set(f"joined/{rank}", "1")
        if int(store.add("joined", 1)) >= world_size:
            store.set("complete", "1")


def _post(store: Store, message: str) -> NoReturn:
    """Raises ``message`` here and posts it for every other rank of the rendezvous."""
    store.set("error", message)
    raise InvalidArgumentError(message)


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _open(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    serve: bool,
    deadline: float,
    bound: float,
    cluster: str,
    prefix: str,
) -> TCPStore:
    """Serves or joins the store by the deadline, explaining a failure."""
    where = f"{host}:{port}"
    start = time.monotonic()
    try:
        return _open_bounded(host, port, world_size, serve, deadline)
    except TimeoutError:
        if not serve and not _accepts(host, port):
            raise CollectiveTimeoutError(
                f"rank {rank} could not reach the rendezvous at {where} (gave up after "
                f"{time.monotonic() - start:.1f} s of a {bound:.0f} s bound): nothing "
                "listens there. Check that rank 0 started and that MASTER_ADDR/MASTER_PORT "
                "(or TF_CONFIG) name rank 0's host and port."
            ) from None
        raise CollectiveTimeoutError(
            f"rank {rank} reached {where} but no rendezvous store answered there within "
            f"{bound:.0f} s: another program holds that port, or it is not rank 0's "
            "address. Check MASTER_ADDR/MASTER_PORT (or TF_CONFIG's first worker)"
        ) from None
    except Exception as exc:
        elapsed = time.monotonic() - start
        if serve and _address_in_use(exc):
            raise _port_taken(rank, host, port, world_size, cluster, prefix, exc) from exc
        action = "serve" if serve else "reach"
        raise CollectiveTimeoutError(
            f"rank {rank} could not {action} the rendezvous at {where} (gave up after "
            f"{elapsed:.1f} s of a {bound:.0f} s bound): {exc}. "
            + (
                "Check that the port is free on this host."
                if serve
                else "Check that rank 0 started and that MASTER_ADDR/MASTER_PORT (or "
                "TF_CONFIG) name rank 0's host and port."
            )
        ) from exc


def _open_bounded(host: str, port: int, world_size: int, serve: bool, deadline: float) -> TCPStore:
    """`TCPStore(...)` in a helper thread; `TimeoutError` if it has not returned by the
    deadline (the thread is left blocked: a daemon, it ends with the process)."""
    remaining = max(deadline - time.monotonic(), 0.001)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["store"] = TCPStore(
                host,
                port,
                world_size,
                is_master=serve,
                timeout=datetime.timedelta(seconds=remaining),
                wait_for_workers=False,
                master_listen_fd=_listen(host, port) if serve else None,
            )
        except BaseException as exc:  # delivered to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="distribute-rendezvous-open", daemon=True)
    thread.start()
    thread.join(remaining + 1.0)
    if "store" in box:
        store: TCPStore = box["store"]
        return store
    if "error" in box:
        raise box["error"]
    raise TimeoutError


def _listen(host: str, port: int) -> int | None:
    """A socket listening on `host`:`port` only, for the store to serve on (torch's
    own listens on every interface); None (every interface, as torch does) when
    `host` is not an address of this machine (a name for a NAT'ed or proxied
    address), which is logged.

    Raises:
        OSError: the port is taken.
    """
    if loopback_alias(host):
        logger.warning(
            "%s names this machine but resolves to a loopback address here (as /etc/hosts "
            "often maps the hostname); the rendezvous store listens on every interface so "
            "that other machines reach it",
            host,
        )
        return None
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno != errno.EADDRNOTAVAIL:
            raise
        logger.warning(
            "the rendezvous address %s:%s is not an address of this machine; its store "
            "listens on every interface",
            host,
            port,
        )
        return None
    sock.listen(1024)
    return sock.detach()


def loopback_alias(host: str) -> bool:
    """Whether `host` is a name (not an address, not ``localhost``) that resolves to
    a loopback address here: Debian's /etc/hosts maps the hostname to 127.0.1.1,
    while other machines reach that name at the host's network address, so a
    listener bound to its resolution would shut them out."""
    if host == "localhost" or host.startswith("localhost."):
        return False
    try:
        ipaddress.ip_address(host)
        return False  # an address: bind it
    except ValueError:
        pass
    try:
        return any(
            ipaddress.ip_address(info[4][0]).is_loopback
            for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        )
    except (OSError, ValueError):
        return False


def _accepts(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at host:port (within half a second)."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _address_in_use(exc: BaseException) -> bool:
    text = str(exc)
    return (
        "EADDRINUSE" in text
        or "address already in use" in text.lower()
        or (isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE)
    )


def _port_taken(
    rank: int, host: str, port: int, world_size: int, cluster: str, prefix: str, exc: BaseException
) -> Exception:
    """Why rank 0 could not serve: another process of this cluster serves it (a
    duplicated task; while its rendezvous still gathers, it is told too, so that it
    does not wait out the bound for a rank that will not come), or another program
    holds the port."""
    where = f"{host}:{port}"
    gathering: list[Store] = []
    theirs = None
    try:
        other = _open_bounded(host, port, world_size, False, time.monotonic() + _PROBE_SECONDS)
        # Their first strategies' namespaces; the server publishes its cluster just
        # after it starts serving, so look again for a moment.
        spaces = [PrefixStore(f"{prefix}{n}", other) for n in range(1, 17)]
        deadline = time.monotonic() + _PROBE_SECONDS
        while True:
            serving = [ns for ns in spaces if ns.check(["cluster/0"])]
            if serving or time.monotonic() > deadline:
                break
            time.sleep(_POLL_SECONDS)
        theirs = serving[-1].get("cluster/0").decode() if serving else None
        gathering = [ns for ns in serving if not ns.check(["complete"])]
    except Exception:
        theirs = None
    if theirs is not None and theirs == cluster:
        for namespace in gathering:  # a running job is left alone
            with contextlib.suppress(Exception):
                namespace.set(
                    "error",
                    f"two processes claim rank 0 of the rendezvous at {where}: another process "
                    "of this cluster tried to serve it too. Each task needs its own index "
                    "(check TF_CONFIG's task index, or RANK)",
                )
        return InvalidArgumentError(
            f"rank {rank} cannot serve the rendezvous at {where}: another process of this "
            "cluster already serves it, so two tasks claim rank 0 (check TF_CONFIG's task "
            "index, or RANK), or an earlier run of this job is still alive"
        )
    return RendezvousError(
        f"rank {rank} could not serve the rendezvous at {where}: the port is already in use "
        f"by another program ({exc}); pick a free port for MASTER_PORT (or TF_CONFIG's first "
        "worker address)"
    )
