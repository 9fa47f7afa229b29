"""Sequence tracking and freshness verdicts (pure)."""

from __future__ import annotations

import pytest

from epp.kvindex.freshness import Freshness, FreshnessTracker
from epp.kvindex.sequence import SeqKind, SequenceTracker


@pytest.mark.parametrize(
    ("applied", "seq", "kind", "missing"),
    [
        ([], 0, SeqKind.FIRST, None),
        ([], 17, SeqKind.FIRST, None),
        ([0], 1, SeqKind.NEXT, None),
        ([0, 1, 2], 5, SeqKind.GAP, (3, 4)),
        ([9], 11, SeqKind.GAP, (10, 10)),
        ([0, 1, 2], 0, SeqKind.RESTART, None),
        ([100], 100, SeqKind.RESTART, None),
        ([100], 7, SeqKind.RESTART, None),
    ],
)
def test_sequence_classification(
    applied: list[int], seq: int, kind: SeqKind, missing: tuple[int, int] | None
) -> None:
    t = SequenceTracker()
    for s in applied:
        t.advance(s)
    v = t.classify(seq)
    assert v.kind is kind
    if missing:
        assert (v.missing_from, v.missing_to) == missing


def test_already_applied_is_for_replays() -> None:
    t = SequenceTracker()
    assert not t.already_applied(0)
    t.advance(5)
    assert t.already_applied(5) and t.already_applied(0) and not t.already_applied(6)


def ft() -> FreshnessTracker:
    return FreshnessTracker(recovery=30.0, hold=10.0, silence=10.0, lag_degraded=1.0, silent_misses=64)


def test_unknown_pod_is_stale_and_a_watched_connected_pod_without_events_is_degraded() -> None:
    f = ft()
    assert f.state("p", 0).state is Freshness.STALE
    f.watch("p", 0)
    assert f.state("p", 0).state is Freshness.STALE  # not connected yet
    f.connected("p", 1)
    assert (f.state("p", 1).state, f.state("p", 1).reason) == (Freshness.DEGRADED, "no_events")
    f.message("p", 2)
    assert f.state("p", 2).state is Freshness.FRESH


def test_disconnect_is_stale_until_reconnected_and_messages_flow() -> None:
    f = ft()
    f.message("p", 0)
    f.disconnected("p", 1)
    assert (f.state("p", 5).state, f.state("p", 5).reason) == (Freshness.STALE, "publisher_unreachable")
    f.connected("p", 6)
    f.message("p", 7)
    assert f.state("p", 7).state is Freshness.FRESH


def test_unrecovered_gap_is_stale_for_the_recovery_window_of_in_order_messages() -> None:
    f = ft()
    f.message("p", 0)
    f.gap("p", 1, replaying=False)
    assert f.state("p", 1).reason == "unrecovered_gap"
    f.message("p", 2)  # recovery starts with the first in-order message
    assert f.state("p", 31).state is Freshness.STALE
    assert f.state("p", 32.5).state is Freshness.FRESH


def test_replay_is_degraded_then_fresh_or_stale() -> None:
    f = ft()
    f.message("p", 0)
    f.gap("p", 1, replaying=True)
    assert (f.state("p", 1).state, f.state("p", 1).reason) == (Freshness.DEGRADED, "replaying")
    f.replay_done("p", 2, complete=True)
    assert f.state("p", 2).state is Freshness.FRESH
    f.gap("p", 3, replaying=True)
    f.replay_done("p", 4, complete=False)
    assert f.state("p", 4).reason == "unrecovered_gap"


@pytest.mark.parametrize(("recovered", "state"), [(True, Freshness.FRESH), (False, Freshness.STALE)])
def test_restart(recovered: bool, state: Freshness) -> None:
    f = ft()
    f.message("p", 0)
    f.restart("p", 1, recovered=recovered)
    f.message("p", 1)
    assert f.state("p", 2).state is state


@pytest.mark.parametrize("reason", ["orphans", "malformed", "dropped"])
def test_transient_problems_degrade_for_the_hold_time(reason: str) -> None:
    f = ft()
    f.message("p", 0)
    f.problem("p", 1, reason)
    assert (f.state("p", 5).state, f.state("p", 5).reason) == (Freshness.DEGRADED, reason)
    assert f.state("p", 11.5).state is Freshness.FRESH


def test_lost_events_are_stale_until_recovery_of_in_order_messages() -> None:
    f = ft()
    f.message("p", 0)
    f.lost_events("p", 1)
    assert (f.state("p", 1).state, f.state("p", 1).reason) == (Freshness.STALE, "lost_events")
    assert f.state("p", 100).state is Freshness.STALE  # no in-order message since: no recovery
    f.message("p", 100)
    assert f.state("p", 129).reason == "lost_events"
    assert f.state("p", 131).state is Freshness.FRESH


def test_joined_late_and_lagging_are_degraded() -> None:
    f = ft()
    f.joined_late("p", 0)
    f.message("p", 0)
    assert f.state("p", 1).reason == "joined_late"
    assert f.state("p", 31).state is Freshness.FRESH
    f.message("p", 32, lag=3.0)
    assert f.state("p", 32).reason == "lagging"


def test_silent_publisher_while_the_engine_misses_is_stale() -> None:
    f = ft()
    f.engine_misses("p", 1000)
    f.message("p", 0)
    f.engine_misses("p", 1030)
    assert f.state("p", 20).state is Freshness.FRESH  # misses rose less than the threshold
    f.engine_misses("p", 1200)
    assert f.state("p", 5).state is Freshness.FRESH  # not silent long enough
    assert (f.state("p", 20).state, f.state("p", 20).reason) == (Freshness.STALE, "silent")
    f.message("p", 21)
    assert f.state("p", 21).state is Freshness.FRESH


def test_an_engine_restarted_without_events_turns_silent_once_its_new_counter_rises() -> None:
    """Its metrics count from 0 again; the baseline follows, or the pod would stay fresh forever."""
    f = ft()
    f.engine_misses("p", 50_000)
    f.message("p", 0)
    f.engine_misses("p", 50_010)
    f.engine_misses("p", 0)  # a new engine process
    f.engine_misses("p", 300)  # missing, and publishing nothing
    assert (f.state("p", 20).state, f.state("p", 20).reason) == (Freshness.STALE, "silent")
    f.message("p", 21)
    assert f.state("p", 21).state is Freshness.FRESH


def test_a_pod_that_never_publishes_while_missing_is_stale() -> None:
    f = ft()
    f.watch("p", 0)
    f.connected("p", 0)
    f.engine_misses("p", 0)
    f.engine_misses("p", 500)
    assert f.state("p", 11).reason == "silent"


def test_forget() -> None:
    f = ft()
    f.message("p", 0)
    f.forget("p")
    assert f.pods() == []
