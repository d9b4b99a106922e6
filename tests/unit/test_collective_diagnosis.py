"""The pure parts of the collectives' failure diagnosis (no process group)."""

from __future__ import annotations

import time

import pytest
from torch.distributed import HashStore

from distribute.collectives import _rendezvous
from distribute.collectives._liveness import PeerReport, WatchState, explain, mismatch_error
from distribute.errors import InvalidArgumentError

POSITION = (5, "all_reduce 'gradients'")


def test_explain_names_dead_stuck_and_misplaced_ranks_and_skips_the_arrived() -> None:
    reports = {
        1: PeerReport(1, alive=False, gone=True),
        5: PeerReport(5, alive=False),
        2: PeerReport(2, alive=True, waiting=POSITION, done=(4, "barrier 'x'")),
        3: PeerReport(3, alive=True, waiting=None, done=(4, "barrier 'x'")),
        4: PeerReport(4, alive=True, waiting=(5, "broadcast 'w'"), done=(4, "barrier 'x'")),
    }
    missing, details = explain(POSITION, 0, 6, reports)
    assert missing == [1, 3, 4, 5]
    assert details == (
        "rank 1 is dead (its process is gone, or it shut down); "
        "rank 3 is alive but stuck elsewhere (its last finished collective: #4 barrier 'x'); "
        "rank 4 is alive but waiting in a different collective, #5 broadcast 'w'; "
        "rank 5 does not answer (its host is down, or its process died or is frozen)"
    )


def test_explain_counts_a_rank_missing_from_the_reports_as_not_answering() -> None:
    missing, details = explain(POSITION, 1, 2, {})
    assert missing == [0] and details.startswith("rank 0 does not answer")


def test_watch_state_reports_where_the_main_thread_is() -> None:
    state = WatchState()
    state.waiting = POSITION
    state.done = (4, "barrier 'x'")
    report = state.report()
    assert report["waiting"] == POSITION and report["done"] == (4, "barrier 'x'")


def test_mismatch_error_without_a_store_describes_this_rank_only() -> None:
    error = mismatch_error(
        None, POSITION, (["float32[3]", "int64[2]"], "(SUM)"), rank=0, odd=1, grace=0.1
    )
    assert str(error).startswith(
        "all_reduce 'gradients': rank 0 passed [float32[3], int64[2]] (SUM) but rank 1 passed "
        "(unknown: it posted no description in time)"
    )
    assert isinstance(error, ValueError)


def test_a_rank_with_another_cluster_is_never_counted_as_joined() -> None:
    """Counted before comparing, such a rank could complete rank 0's wait just before it
    posted the difference, and rank 0 would go on alone into the process group."""
    store = HashStore()
    store.set("cluster/0", "workers=[a, b]")  # rank 0 is waiting for one more rank
    store.set("joined/0", "1")
    store.add("joined", 1)
    start = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="different clusters"):
        _rendezvous._join(store, 1, 2, "workers=[a, b, c]", "127.0.0.1:1", start, start + 5.0, 5.0)
    assert int(store.add("joined", 0)) == 1
    assert store.check(["error"])  # and rank 0 is told
