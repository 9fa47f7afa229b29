"""FreshnessTracker: a pod's silence is measured from when it was first heard of, whichever report came
first (in central mode nothing watches a pod before its metrics or its first event)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from epp.kvindex.freshness import Freshness, FreshnessTracker

T0 = 50_000.0  # a monotonic clock long past 0


def _misses(f: FreshnessTracker, now: float) -> None:
    f.engine_misses("p", 0.0, now)


def _problem(f: FreshnessTracker, now: float) -> None:
    f.problem("p", now, "malformed")


def _connected(f: FreshnessTracker, now: float) -> None:
    f.connected("p", now)


def _gap(f: FreshnessTracker, now: float) -> None:
    f.gap("p", now, replaying=True)
    f.replay_done("p", now, complete=True)


def _joined_late(f: FreshnessTracker, now: float) -> None:
    f.joined_late("p", now)


@pytest.mark.parametrize("first", [_misses, _problem, _connected, _gap, _joined_late])
def test_a_pod_first_heard_of_by_any_report_is_not_silent_at_once(
    first: Callable[[FreshnessTracker, float], None],
) -> None:
    f = FreshnessTracker(silence=10.0, silent_misses=64.0, hold=1.0, recovery=1.0)
    first(f, T0)
    f.engine_misses("p", 0.0, T0)
    f.engine_misses("p", 500.0, T0 + 1.0)  # its first prompts missed; no event yet
    assert f.state("p", T0 + 5.0).reason != "silent"
    later = f.state("p", T0 + 11.0)  # past `silence` with no event: now it is
    assert (later.state, later.reason) == (Freshness.STALE, "silent")


def test_engine_misses_without_now_keeps_the_old_start_at_zero() -> None:
    """(The simulator reports misses without a time; its clock starts at 0.)"""
    f = FreshnessTracker(silence=10.0, silent_misses=64.0)
    f.engine_misses("p", 0.0)
    f.engine_misses("p", 500.0)
    assert f.state("p", 11.0).reason == "silent"
