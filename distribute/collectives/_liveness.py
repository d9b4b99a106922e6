"""Failure diagnosis for cross-process collectives: who is alive, and where.

Nothing here runs while collectives succeed. Each rank keeps a tiny *watcher*: a
daemon thread blocked in ``accept()`` on a TCP socket of its own, whose address
it published once in the rendezvous store. The main thread records in plain
attributes which collective it is waiting in and which one it finished last. When
a rank gives up on a collective (a peer's connection closed, or its deadline
passed) it *probes* every other rank's watcher directly, in parallel:

1. a refused (or reset) connection means the rank's process is gone (dead); no
   answer within a short grace period means its host is down or its process is
   frozen;
2. a live watcher answers at once with where its main thread is (waiting in
   collective #k, or idle after #k) and tells its main thread that the group is
   broken, so a rank blocked in the same collective stops waiting within a
   fraction of a second instead of at the timeout;
3. the prober sends its verdict to every live watcher, so the interrupted ranks
   quote it even if the prober is gone by the time they look.

The watchers do not depend on the store after start-up, so the death of rank 0
(which serves the store) is diagnosed like any other. A probe can only make a
rank give up; the watcher's port accepts connections from the cluster's network
like gloo's own ports do.

# NOTE [failure diagnosis]
What `ProcessGroupCollectives` does when a collective fails or outlives its deadline
(NOTE [no silent hangs] in process_group.py):

* A rank gives up when the
  backend raises (a peer's connection closed: it died) or when its deadline, the
  timeout less a short grace period (at most 1 s), passes. It then probes every
  other rank's *watcher*, a daemon thread blocked in ``accept()`` on a socket
  whose address was exchanged once at start-up. A refused connection means the
  process is gone, so a death is named within milliseconds; a live watcher
  answers with the collective its main thread is in (or the last one it
  finished), so a stuck rank is named as alive and located. A probe also tells
  every rank blocked in a collective to stop waiting, so ranks that gloo does not
  connect directly to the dead one fail within a quarter second too, quoting the
  prober's verdict. After a failure the group is marked broken and later
  collectives raise at once.
* Why not ``monitored_barrier`` or arrival marks in the store: a monitored
  barrier is a collective (a round trip on every call, and no help with a peer
  stuck inside the data collective), and arrival marks written to the store
  before every collective put a store round trip on the hot path. Watchers that
  block on the store itself were tried too: they print c10d warnings whenever
  rank 0, which serves the store, exits first, and they cannot tell a dead rank
  from a slow one. The socket watcher costs one idle thread and one idle socket.

Example::

    liveness = Liveness(store, rank=0, world_size=2, host="127.0.0.1", timeout=30.0)
    liveness.start()
    probe_id, reports = liveness.probe((7, "all_reduce 'x'"), grace=1.0)
    missing, details = explain((7, "all_reduce 'x'"), 0, 2, reports)
    liveness.stop()
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from distribute._torch import PrefixStore, Store
from distribute.errors import CollectiveMismatchError, CollectiveTimeoutError

__all__ = [
    "Interrupt",
    "Liveness",
    "PeerReport",
    "WatchState",
    "diagnose",
    "diagnose_transport",
    "explain",
    "local_address_towards",
    "start_watcher",
    "mismatch_error",
]

logger = logging.getLogger(__name__)

#: Poll interval while waiting for a verdict or a store key.
_POLL_SECONDS = 0.01
#: The largest message a watcher reads (a verdict is a few hundred bytes).
_MAX_MESSAGE = 1 << 16

Position = tuple[int, str]  # (collective number, "kind 'name'")


@dataclasses.dataclass(frozen=True)
class Interrupt:
    """Why the watcher told the main thread to stop waiting.

    Attributes:
        prober: the rank that gave up.
        probe_id: the probe's id, under which the prober sends its verdict.
        position: the collective the prober gave up on.
    """

    prober: int
    probe_id: str
    position: Position | None


class WatchState:
    """What the main thread and the watcher share (plain attributes; GIL-atomic)."""

    def __init__(self) -> None:
        self.waiting: Position | None = None
        self.done: Position | None = None
        self.interrupt: Interrupt | None = None
        self.verdicts: dict[str, str] = {}
        self.diagnosing = False
        self.closed = False

    def report(self) -> dict[str, Any]:
        return {"waiting": self.waiting, "done": self.done, "pid": os.getpid()}


@dataclasses.dataclass(frozen=True)
class PeerReport:
    """One rank's answer to a probe.

    Attributes:
        rank: the rank probed.
        alive: it answered.
        gone: its watcher refused or dropped the connection (the process has exited).
        waiting: the collective its main thread waits in, if any.
        done: the last collective it finished.
    """

    rank: int
    alive: bool
    gone: bool = False
    waiting: Position | None = None
    done: Position | None = None


def _position(value: Any) -> Position | None:
    if value is None:
        return None
    return int(value[0]), str(value[1])


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent).

    Example::

        >>> from distribute.collectives._liveness import local_address_towards
        >>> local_address_towards("127.0.0.1")
        '127.0.0.1'
    """
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as s:
            s.connect(address)
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _read_message(conn: socket.socket) -> Any:
    data = b""
    while not data.endswith(b"\n") and len(data) < _MAX_MESSAGE:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return json.loads(data) if data else None


def _ask(address: tuple[str, int], message: Mapping[str, Any], timeout: float) -> tuple[Any, bool]:
    """Sends one message to a watcher; returns (its answer or None, whether it is gone).

    Gone: the connection was refused, reset or closed without an answer, which
    happens when the process has exited (or is exiting) or shut its watcher down.
    A timeout is not "gone": the host may be down or the process frozen.
    """
    try:
        with socket.create_connection(address, timeout=max(timeout, 0.05)) as conn:
            conn.sendall(json.dumps(message).encode() + b"\n")
            answer = _read_message(conn)
            return answer, answer is None
    except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError):
        return None, True
    except (OSError, ValueError):
        return None, False


def _serve(server: socket.socket, state: WatchState) -> None:
    """The watcher thread: answers probes and records verdicts until stopped."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            if state.closed:
                return
            try:
                conn.settimeout(2.0)
                message = _read_message(conn)
                if not isinstance(message, dict):
                    continue
                if "verdict" in message:
                    state.verdicts[str(message["probe"])] = str(message["verdict"])
                    conn.sendall(b"{}\n")
                elif "probe" in message:
                    conn.sendall(json.dumps(state.report()).encode() + b"\n")
                    if state.interrupt is None and not state.diagnosing:
                        state.interrupt = Interrupt(
                            prober=int(message["rank"]),
                            probe_id=str(message["probe"]),
                            position=_position(message["position"]),
                        )
            except (OSError, ValueError, KeyError, TypeError):
                logger.debug("bad message to the watcher", exc_info=True)


class Liveness:
    """The watcher and the probe protocol of one rank.

    Publishes this rank's watcher address in ``store`` and reads every other
    rank's (so every rank must construct its `Liveness` at the same point).

    Args:
        store: the rendezvous store (read at start-up and for mismatch reports).
        rank: this process's rank.
        world_size: the number of ranks.
        host: the address the other ranks can reach this one at.
        timeout: how long to wait for the other ranks' addresses.
    """

    def __init__(
        self, store: Store, rank: int, world_size: int, *, host: str, timeout: float
    ) -> None:
        self._store: Store | None = store
        self._rank = rank
        self._world_size = world_size
        self._probes = 0
        self.state = WatchState()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = socket.create_server((host, 0), family=family, backlog=128)
        self._address = (host, int(self._server.getsockname()[1]))
        store.set(f"watcher/{rank}", json.dumps(self._address))
        keys = [f"watcher/{r}" for r in range(world_size)]
        store.wait(keys, datetime.timedelta(seconds=timeout))
        self._peers = {
            r: (str(h), int(p))
            for r, (h, p) in enumerate(json.loads(v) for v in store.multi_get(keys))
            if r != rank
        }
        self._thread = threading.Thread(
            target=_serve,
            args=(self._server, self.state),
            name=f"distribute-watcher-rank{rank}",
            daemon=True,
        )

    @property
    def world_size(self) -> int:
        return self._world_size

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stops the watcher and lets go of the store (idempotent)."""
        if self.state.closed:
            return
        self.state.closed = True
        self._store = None  # rank 0's store server closes with its last reference
        if self._thread.is_alive():
            _ask(self._address, {"stop": True}, 0.5)  # wakes accept()
            self._thread.join(timeout)
        self._server.close()

    def _ask_all(
        self, ranks: Sequence[int], message: Mapping[str, Any], timeout: float
    ) -> dict[int, tuple[Any, bool]]:
        if not ranks:
            return {}
        with concurrent.futures.ThreadPoolExecutor(min(32, len(ranks))) as pool:
            answers = pool.map(lambda r: _ask(self._peers[r], message, timeout), ranks)
            return dict(zip(ranks, answers))

    def probe(self, position: Position, grace: float) -> tuple[str, dict[int, PeerReport]]:
        """Asks every other rank where it is; takes at most about ``grace`` seconds."""
        self._probes += 1
        probe_id = f"{self._rank}.{self._probes}"
        message = {"probe": probe_id, "rank": self._rank, "position": position}
        reports: dict[int, PeerReport] = {}
        for r, (answer, gone) in self._ask_all(list(self._peers), message, grace).items():
            if isinstance(answer, dict):
                reports[r] = PeerReport(
                    r, True, False, _position(answer["waiting"]), _position(answer["done"])
                )
            else:
                reports[r] = PeerReport(r, False, gone)
        return probe_id, reports

    def publish_verdict(
        self, probe_id: str, message: str, reports: Mapping[int, PeerReport], grace: float
    ) -> None:
        """Sends the prober's diagnosis to every rank that answered the probe."""
        alive = [r for r, report in reports.items() if report.alive]
        self._ask_all(alive, {"probe": probe_id, "verdict": message}, grace)

    def await_verdict(self, probe_id: str, timeout: float) -> str | None:
        """The verdict of probe ``probe_id``, once the watcher received it (None
        if it does not come within ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while probe_id not in self.state.verdicts:
            if time.monotonic() > deadline:
                return None
            time.sleep(_POLL_SECONDS)
        return self.state.verdicts[probe_id]

    def exchange(self, key: str, mine: str, ranks: Sequence[int], timeout: float) -> dict[int, str]:
        """Posts ``mine`` under ``key`` and reads what ``ranks`` posted there."""
        found = {self._rank: mine}
        store = self._store
        if store is None:
            return found
        try:
            store.set(f"{key}/{self._rank}", mine)
            deadline = time.monotonic() + timeout
            pending = [r for r in ranks if r != self._rank]
            while pending and time.monotonic() <= deadline:
                for r in list(pending):
                    if store.check([f"{key}/{r}"]):
                        found[r] = store.get(f"{key}/{r}").decode()
                        pending.remove(r)
                if pending:
                    time.sleep(_POLL_SECONDS)
        except Exception:
            logger.debug("could not exchange %s", key, exc_info=True)
        return found


def start_watcher(
    store: Store | None, rank: int, world_size: int, host: str | None, timeout: float
) -> Liveness | None:
    """This rank's started `Liveness` over ``store`` (None: one rank, or no store to
    share, so no diagnosis of missing ranks). The n-th collectives object of each rank
    shares the n-th key space; ``host`` None: this machine's address towards the store.

    Example::

        liveness = start_watcher(store, rank=0, world_size=2, host=None, timeout=30.0)
    """
    if store is None or world_size <= 1:
        return None
    from distribute.collectives._group_setup import store_host

    generation = int(store.add(f"distribute/generation/{rank}", 1))
    liveness = Liveness(
        PrefixStore(f"distribute/{generation}/", store),
        rank,
        world_size,
        host=host if host is not None else local_address_towards(store_host(store)),
        timeout=max(timeout, 30.0),
    )
    liveness.start()
    return liveness


def _where(position: Position | None) -> str:
    return "none yet" if position is None else f"#{position[0]} {position[1]}"


def explain(
    position: Position, me: int, world_size: int, reports: Mapping[int, PeerReport]
) -> tuple[list[int], str]:
    """Which ranks never arrived at ``position``, and why, from the probe's answers.

    Returns:
        The missing ranks (sorted) and one clause per missing rank.

    Example::

        >>> from distribute.collectives._liveness import PeerReport, explain
        >>> explain((3, "all_reduce 'g'"), 0, 2, {1: PeerReport(1, alive=False, gone=True)})
        ([1], 'rank 1 is dead (its process is gone, or it shut down)')
    """
    missing: list[int] = []
    clauses: list[str] = []
    for r in range(world_size):
        if r == me:
            continue
        report = reports.get(r, PeerReport(r, False))
        if report.alive and report.waiting == position:
            continue
        missing.append(r)
        if report.gone:
            clauses.append(f"rank {r} is dead (its process is gone, or it shut down)")
        elif not report.alive:
            clauses.append(
                f"rank {r} does not answer (its host is down, or its process died or is frozen)"
            )
        elif report.waiting is not None:
            clauses.append(
                f"rank {r} is alive but waiting in a different collective, {_where(report.waiting)}"
            )
        else:
            clauses.append(
                f"rank {r} is alive but stuck elsewhere (its last finished collective: "
                f"{_where(report.done)})"
            )
    return missing, "; ".join(clauses)


def _quoted_verdict(liveness: Liveness, state: WatchState, grace: float) -> tuple[int, str] | None:
    """(the prober, its verdict) when a peer that gave up first told this rank, and
    its verdict arrives in time; else None (this rank diagnoses itself)."""
    interrupt = state.interrupt
    if interrupt is None or interrupt.probe_id is None:
        return None
    verdict = liveness.await_verdict(interrupt.probe_id, 2 * grace + 1.0)
    return None if verdict is None else (interrupt.prober, verdict)


def _probe(
    liveness: Liveness, state: WatchState, position: Position, grace: float
) -> tuple[str, dict[int, PeerReport]]:
    """`Liveness.probe`; meanwhile this rank's watcher does not take a peer's probe for
    an interrupt (both ranks are diagnosing the same failure)."""
    state.diagnosing = True
    try:
        return liveness.probe(position, grace)
    finally:
        state.diagnosing = False


def diagnose(
    liveness: Liveness | None,
    state: WatchState,
    position: Position,
    *,
    rank: int,
    timeout: float,
    grace: float,
    elapsed: float,
    exc: BaseException | None,
) -> CollectiveTimeoutError:
    """The error for a collective that failed (``exc``) or outlived its deadline.

    Quotes the verdict of a peer that gave up first; otherwise probes every rank
    and publishes the verdict for the others.
    """
    what = f"{position[1]} (collective #{position[0]})"
    cause = f" The backend said: {exc}" if exc is not None else ""
    if liveness is None:
        return CollectiveTimeoutError(
            f"{what} failed on rank {rank} after {elapsed:.1f} s (timeout {timeout:.1f} s); the "
            "missing ranks cannot be named because the process group's store cannot be "
            f"shared. Check that every rank runs the same collectives and that no process "
            f"died.{cause}"
        )
    quoted = _quoted_verdict(liveness, state, grace)
    if quoted is not None:
        prober, verdict = quoted
        return CollectiveTimeoutError(
            f"{what} cannot complete on rank {rank} (waited {elapsed:.1f} s): rank "
            f"{prober} gave up on the group. Its diagnosis: {verdict}"
        )
    probe_id, reports = _probe(liveness, state, position, grace)
    missing, details = explain(position, rank, liveness.world_size, reports)
    verb = "failed" if exc is not None else "timed out"
    if missing:
        dead = sorted(r.rank for r in reports.values() if not r.alive)
        fix = (
            f"Check the log of rank {dead[0]} for why it died or hangs."
            if dead
            else "Every rank must call the same collectives in the same order; if a rank is "
            "legitimately slow, raise CommunicationOptions(timeout_seconds=...)."
        )
        message = (
            f"{what} {verb} after {elapsed:.1f} s on rank {rank} (timeout {timeout:.1f} s): "
            f"ranks {missing} never arrived: {details}. {fix}"
        )
    else:
        message = (
            f"{what} {verb} after {elapsed:.1f} s on rank {rank} (timeout {timeout:.1f} s) "
            "although every rank arrived: the transport is too slow or broken. Raise "
            f"CommunicationOptions(timeout_seconds=...) or check the network.{cause}"
        )
    liveness.publish_verdict(probe_id, message, reports, grace)
    return CollectiveTimeoutError(message)


def diagnose_transport(
    liveness: Liveness | None,
    state: WatchState,
    what: str,
    *,
    rank: int,
    timeout: float,
    grace: float,
    elapsed: float,
    exc: BaseException | None,
    describe: Callable[[int], str] = lambda r: f"rank {r}",
) -> CollectiveTimeoutError:
    """The error for a collective that failed in code that numbers no collectives
    (torch's own: DTensor's redistributions, FSDP inside a mesh, a sub-group): which
    ranks are gone, named by ``describe`` (global ranks, with their mesh coordinates).

    Probes every rank (a live one is told the group broke, as by `diagnose`) and
    publishes the verdict. Ranks that answer are not blamed: their position in a
    collective that is not numbered cannot be compared.

    Example::

        error = diagnose_transport(liveness, state, "a DTensor collective in the step",
                                   rank=0, timeout=30.0, grace=1.0, elapsed=0.2, exc=exc)
    """
    cause = f" The backend said: {exc}" if exc is not None else ""
    head = f"{what} failed on {describe(rank)} after {elapsed:.1f} s (timeout {timeout:.1f} s)"
    if liveness is None:
        return CollectiveTimeoutError(
            f"{head}; the missing ranks cannot be named because the process group's store "
            f"cannot be shared. Check that no process died.{cause}"
        )
    quoted = _quoted_verdict(liveness, state, grace)
    if quoted is not None:
        prober, verdict = quoted
        return CollectiveTimeoutError(
            f"{head}: {describe(prober)} gave up on the group first. Its diagnosis: {verdict}"
        )
    probe_id, reports = _probe(liveness, state, (0, what), grace)
    lost = sorted(r for r, report in reports.items() if not report.alive)
    if lost:
        clauses = [
            f"{describe(r)} is dead (its process is gone, or it shut down)"
            if reports[r].gone
            else f"{describe(r)} does not answer (its host is down, or its process died or "
            "is frozen)"
            for r in lost
        ]
        message = (
            f"{head}: ranks {lost} are lost: {'; '.join(clauses)}. Check the log of "
            f"{describe(lost[0])} for why it died or hangs, then restart every worker."
        )
    else:
        message = (
            f"{head} although every rank answers: a rank called a different collective, or "
            "the transport is too slow or broken. Every worker must run the same steps; if "
            f"one is legitimately slow, raise CommunicationOptions(timeout_seconds=...).{cause}"
        )
    liveness.publish_verdict(probe_id, message, reports, grace)
    return CollectiveTimeoutError(message)


def _render(items: Sequence[str], suffix: str, other: Sequence[str]) -> str:
    """One rank's call, for a mismatch message; long lists show the first difference."""
    if len(items) == 1:
        body = items[0]
    elif len(items) <= 4:
        body = "[" + ", ".join(items) + "]"
    else:
        body = f"{len(items)} tensors"
        differ = [i for i, (a, b) in enumerate(zip(items, other)) if a != b]
        if differ:
            suffix = f"{suffix}, #{differ[0]} being {items[differ[0]]}".lstrip(", ")
    return f"{body} {suffix}".strip()


def mismatch_error(
    liveness: Liveness | None,
    position: Position,
    description: tuple[list[str], str],
    *,
    rank: int,
    odd: int,
    grace: float,
) -> CollectiveMismatchError:
    """The error for a signature mismatch, from rank 0's and rank ``odd``'s own words.

    ``description`` is (one string per tensor, a suffix such as the operation).
    Every rank posts its own to the store and reads the two others.

    Example::

        >>> from distribute.collectives._liveness import mismatch_error
        >>> str(mismatch_error(None, (1, "all_reduce 'x'"), (["float32[3]"], "(SUM)"),
        ...                    rank=0, odd=1, grace=1.0)).split(" but ")[0]
        "all_reduce 'x': rank 0 passed float32[3] (SUM)"
    """
    mine = json.dumps([position[1], *description])
    found = {rank: mine}
    if liveness is not None:
        found = liveness.exchange(f"signature/{position[0]}", mine, [0, odd], 2 * grace + 1.0)
    unknown = json.dumps(["?", ["(unknown: it posted no description in time)"], ""])
    (label0, items0, suffix0), (label1, items1, suffix1) = (
        json.loads(found.get(r, unknown)) for r in (0, odd)
    )
    what0 = _render(items0, suffix0, items1)
    what1 = _render(items1, suffix1, items0)
    if label0 == label1 or "?" in (label0, label1):
        head = f"{position[1]}: rank 0 passed {what0} but rank {odd} passed {what1}"
    else:
        head = (
            f"collective #{position[0]}: rank 0 called {label0} with {what0} but rank {odd} "
            f"called {label1} with {what1}"
        )
    return CollectiveMismatchError(
        f"{head}; every rank must pass the same structure, shapes, dtypes and operation to the "
        "same collective, in the same order."
    )
