"""The simulator's event kernel: every ordering rule, cancellation, errors, `until`."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.clock import Clock
from simulator.kernel import Kernel


def recorder(k: Kernel, log: list[tuple[str, float]], name: str):  # type: ignore[no-untyped-def]
    return lambda: log.append((name, k.now()))


def test_events_run_in_time_order_and_the_clock_jumps_to_each() -> None:
    k = Kernel()
    log: list[tuple[str, float]] = []
    k.schedule(3.0, recorder(k, log, "c"))
    k.schedule(1.0, recorder(k, log, "a"))
    k.at(2.0, recorder(k, log, "b"))
    k.run()
    assert log == [("a", 1.0), ("b", 2.0), ("c", 3.0)]
    assert k.now() == 3.0


def test_same_time_smaller_priority_first() -> None:
    k = Kernel()
    log: list[tuple[str, float]] = []
    k.schedule(1.0, recorder(k, log, "normal"))
    k.schedule(1.0, recorder(k, log, "late"), priority=5)
    k.schedule(1.0, recorder(k, log, "urgent"), priority=-1)
    k.run()
    assert [n for n, _ in log] == ["urgent", "normal", "late"]


def test_same_time_and_priority_is_fifo_in_scheduling_order() -> None:
    k = Kernel()
    log: list[tuple[str, float]] = []
    for name in "abcdef":
        k.at(2.0, recorder(k, log, name))
    k.run()
    assert "".join(n for n, _ in log) == "abcdef"


def test_an_event_scheduled_now_from_a_callback_runs_after_those_already_waiting_now() -> None:
    k = Kernel()
    log: list[str] = []

    def first() -> None:
        log.append("first")
        k.schedule(0.0, lambda: log.append("spawned"))
        k.schedule(0.0, lambda: log.append("spawned-urgent"), priority=-1)

    k.at(1.0, first)
    k.at(1.0, lambda: log.append("second"))
    k.at(1.0, lambda: log.append("urgent-later"), priority=-1)
    k.run()
    # "urgent-later" (priority -1) runs first; "spawned-urgent" is scheduled at t=1 with priority -1
    # while "second" (priority 0) still waits, so it jumps ahead of it; "spawned" is FIFO after "second".
    assert log == ["urgent-later", "first", "spawned-urgent", "second", "spawned"]


def test_cancel_is_lazy_and_idempotent() -> None:
    k = Kernel()
    log: list[str] = []
    h = k.schedule(1.0, lambda: log.append("cancelled"))
    k.schedule(2.0, lambda: log.append("kept"))
    assert k.cancel(h) is True
    assert k.cancel(h) is False
    assert len(k) == 2  # still in the heap until it comes up
    assert k.peek() == 2.0  # peek skips it
    k.run()
    assert log == ["kept"]
    assert k.events_run == 1


def test_cancel_after_running_has_no_effect() -> None:
    k = Kernel()
    h = k.schedule(1.0, lambda: None)
    k.run()
    assert h.cancelled and k.cancel(h) is False


def test_a_callback_can_cancel_a_later_event_at_the_same_time() -> None:
    k = Kernel()
    log: list[str] = []
    later = k.at(1.0, lambda: log.append("later"))
    k.at(0.5, lambda: k.cancel(later))
    k.run()
    assert log == []


@pytest.mark.parametrize("delay", [-1e-9, -1.0, math.nan])
def test_scheduling_in_the_past_is_an_error(delay: float) -> None:
    k = Kernel()
    with pytest.raises(ValueError, match="past"):
        k.schedule(delay, lambda: None)


def test_at_before_now_is_an_error_and_at_now_is_fine() -> None:
    k = Kernel()
    k.schedule(5.0, lambda: None)
    k.run()
    with pytest.raises(ValueError, match="past"):
        k.at(4.999, lambda: None)
    with pytest.raises(ValueError):
        k.at(math.inf, lambda: None)
    k.at(5.0, lambda: None)
    k.run()
    assert k.now() == 5.0


def test_run_until_runs_events_up_to_and_including_until_then_sets_the_clock() -> None:
    k = Kernel()
    log: list[tuple[str, float]] = []
    k.at(1.0, recorder(k, log, "a"))
    k.at(2.0, recorder(k, log, "b"))
    k.at(2.5, recorder(k, log, "c"))
    k.run(until=2.0)
    assert log == [("a", 1.0), ("b", 2.0)]
    assert k.now() == 2.0
    k.run(until=2.2)  # nothing due: the clock still advances
    assert k.now() == 2.2 and len(log) == 2
    k.run()
    assert log[-1] == ("c", 2.5)
    with pytest.raises(ValueError):
        k.run(until=1.0)


def test_run_returns_when_the_heap_is_empty() -> None:
    k = Kernel(start=10.0)
    k.run()
    assert k.now() == 10.0
    assert k.step() is False
    k.schedule(1.0, lambda: None)
    assert k.step() is True and k.now() == 11.0


def test_nested_run_is_an_error() -> None:
    k = Kernel()
    errors: list[Exception] = []

    def nested() -> None:
        try:
            k.run()
        except RuntimeError as err:
            errors.append(err)

    k.schedule(1.0, nested)
    k.run()
    assert len(errors) == 1


def test_the_kernel_is_a_clock() -> None:
    k = Kernel(start=3.0)
    clock: Clock = k
    assert clock.now() == 3.0


def test_two_kernels_fed_the_same_calls_run_identically() -> None:
    def trace() -> list[tuple[str, float]]:
        k = Kernel()
        log: list[tuple[str, float]] = []
        for i in range(20):
            k.at(float(i % 4), recorder(k, log, f"e{i}"), priority=i % 3)
        k.run()
        return log

    assert trace() == trace()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(-2, 2)), min_size=1, max_size=40))
def test_order_is_time_then_priority_then_scheduling_order(events: list[tuple[int, int]]) -> None:
    k = Kernel()
    ran: list[int] = []
    for i, (t, prio) in enumerate(events):
        k.at(float(t), lambda i=i: ran.append(i), priority=prio)  # type: ignore[misc]
    k.run()
    assert ran == sorted(range(len(events)), key=lambda i: (events[i][0], events[i][1], i))


def test_a_key_orders_as_the_event_it_stands_for_would_have() -> None:
    """`key(delay)` is the (time, priority, seq) `schedule(delay)` would give: later than what is already
    scheduled for that time, earlier than what is scheduled after it; `current()` is the running event's."""
    k = Kernel()
    seen: list[tuple[float, int, int]] = []
    keys: dict[str, tuple[float, int, int]] = {}

    def at_one() -> None:
        keys["taken"] = k.key(1.0)  # would run at 2.0, after "before", before "after"
        k.at(2.0, lambda: seen.append(k.current()))

    k.at(2.0, lambda: seen.append(k.current()))  # "before"
    k.at(1.0, at_one)
    k.run()
    before, after = seen
    assert before < keys["taken"] < after
    assert keys["taken"][0] == 2.0 == k.now()
    assert k.current() == after  # the last one run, between events


def test_a_key_in_the_past_is_an_error() -> None:
    k = Kernel()
    with pytest.raises(ValueError, match="past"):
        k.key(-1.0)
