from __future__ import annotations

import pytest

from epp.datastore import Datastore
from epp.testing.fakes import FakeClock
from epp.types import NO_WORK, Endpoint, MetricsSnapshot, PrefillWork


def test_in_flight_accounting_is_released_exactly_once() -> None:
    ds = Datastore(FakeClock())
    ds.add_endpoint("a:1")
    t = ds.begin("a:1", prompt_tokens=100)
    t2 = ds.begin("a:1", prompt_tokens=50)
    view = ds.candidates()[0]
    assert (view.in_flight_requests, view.in_flight_prompt_tokens) == (2, 150)
    assert ds.release(t) is True
    assert ds.release(t) is False
    assert ds.candidates()[0].in_flight_requests == 1
    ds.release(t2)
    assert ds.total_in_flight() == 0


def test_release_after_the_endpoint_left_is_harmless() -> None:
    ds = Datastore(FakeClock())
    ds.add_endpoint("a:1")
    t = ds.begin("a:1", 10)
    ds.remove_endpoint("a:1")
    assert ds.release(t) is True
    ds.add_endpoint("a:1")
    assert ds.candidates()[0].in_flight_requests == 0


def test_unhealthy_after_n_failures_and_back_on_success() -> None:
    clock = FakeClock()
    ds = Datastore(clock, unhealthy_after_failures=3)
    ds.add_endpoint("a:1")
    ds.add_endpoint("b:1")
    assert [ds.record_scrape_failure("a:1", "timeout") for _ in range(3)] == [False, False, True]
    assert [e.id for e in ds.candidates()] == ["b:1"]
    assert ds.get("a:1").last_error == "timeout"  # type: ignore[union-attr]
    ds.record_metrics("a:1", MetricsSnapshot(observed_at=clock.now(), waiting=2))
    assert sorted(e.id for e in ds.candidates()) == ["a:1", "b:1"]
    assert ds.candidates(subset={"a:1"})[0].metrics.waiting == 2  # type: ignore[union-attr]


def test_set_endpoints_reports_changes() -> None:
    ds = Datastore(FakeClock())
    assert ds.set_endpoints([("a:1", None), ("b:1", "m")]) == ({"a:1", "b:1"}, set())
    assert ds.set_endpoints([("b:1", "m"), ("c:1", None)]) == ({"c:1"}, {"a:1"})
    assert sorted(ds.ids()) == ["b:1", "c:1"]


def test_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Datastore(FakeClock(), unhealthy_after_failures=0)


# -- prefill backlog and decoding accounting (for the cost model) -------------------------------------
W1 = PrefillWork(1, 1000, 1000 * 500.0)
W2 = PrefillWork(1, 300, 300 * (2000 + 150.0))


def _view(ds: Datastore, ep: str = "a:1") -> Endpoint:
    (view,) = ds.candidates(subset={ep})
    return view


def test_begin_with_work_joins_the_prefill_backlog_until_the_first_token() -> None:
    ds = Datastore(FakeClock())
    ds.add_endpoint("a:1")
    t1 = ds.begin("a:1", prompt_tokens=1000, work=W1, first_token_by=1030.0)
    t2 = ds.begin("a:1", prompt_tokens=2300, work=W2, first_token_by=1030.0)
    v = _view(ds)
    assert v.prefill_backlog == W1 + W2
    assert (v.decoding_requests, v.decoding_tokens) == (0, 0)
    assert (v.in_flight_requests, v.in_flight_prompt_tokens) == (2, 3300)

    assert ds.first_token(t1) is True
    assert ds.first_token(t1) is False  # once only
    v = _view(ds)
    assert v.prefill_backlog == W2
    assert (v.decoding_requests, v.decoding_tokens) == (1, 1000)
    assert v.in_flight_requests == 2  # still in flight while decoding

    assert ds.release(t1) is True
    v = _view(ds)
    assert (v.decoding_requests, v.decoding_tokens, v.in_flight_requests) == (0, 0, 1)
    # released before its first token (error, disconnect): out of the backlog, never decoding
    assert ds.release(t2) is True
    assert ds.first_token(t2) is False
    v = _view(ds)
    assert v.prefill_backlog == NO_WORK
    assert (v.decoding_requests, v.in_flight_requests, v.in_flight_prompt_tokens) == (0, 0, 0)


def test_the_backlog_drains_to_exactly_empty_despite_float_sums() -> None:
    ds = Datastore(FakeClock())
    ds.add_endpoint("a:1")
    works = [PrefillWork(1, n, n * (0.1 + n / 3.0)) for n in (7, 1001, 333, 12, 9999)]
    tickets = [ds.begin("a:1", w.tokens, w) for w in works]
    for t in tickets[::2]:
        ds.first_token(t)
    for t in tickets:
        ds.release(t)
    assert _view(ds).prefill_backlog is NO_WORK


def test_a_request_without_work_counts_only_as_decoding_after_its_first_token() -> None:
    ds = Datastore(FakeClock())
    ds.add_endpoint("a:1")
    t = ds.begin("a:1", prompt_tokens=50)
    assert _view(ds).prefill_backlog == NO_WORK
    assert ds.first_token(t) is True
    assert (_view(ds).decoding_requests, _view(ds).decoding_tokens) == (1, 50)
    ds.release(t)
    assert _view(ds).decoding_requests == 0


def test_a_request_past_its_first_token_deadline_leaves_the_backlog() -> None:
    clock = FakeClock(1000.0)
    ds = Datastore(clock)
    ds.add_endpoint("a:1")
    late = ds.begin("a:1", 1000, W1, first_token_by=1005.0)
    later = ds.begin("a:1", 2300, W2, first_token_by=1010.0)
    clock.advance(4.9)
    assert _view(ds).prefill_backlog == W1 + W2
    clock.advance(0.1)  # at the deadline: candidates() expires it
    v = _view(ds)
    assert v.prefill_backlog == W2
    assert (v.decoding_requests, v.decoding_tokens) == (1, 1000)
    assert late.decoding is True
    # its first token arriving afterwards changes nothing
    assert ds.first_token(late) is False
    assert _view(ds).decoding_requests == 1
    # a ticket released before its deadline is not moved when the deadline passes
    ds.release(later)
    clock.advance(60)
    assert ds.expire_backlog() == 0
    v = _view(ds)
    assert (v.prefill_backlog, v.decoding_requests, v.in_flight_requests) == (NO_WORK, 1, 1)


def test_expire_backlog_moves_every_overdue_request_and_counts_them() -> None:
    clock = FakeClock(1000.0)
    ds = Datastore(clock)
    ds.add_endpoint("a:1")
    ds.add_endpoint("b:1")
    for ep, deadline in (("a:1", 1001.0), ("b:1", 1002.0), ("a:1", 1003.0), ("b:1", 1100.0)):
        ds.begin(ep, 100, PrefillWork(1, 100, 5000.0), first_token_by=deadline)
    never = ds.begin("a:1", 100, PrefillWork(1, 100, 5000.0))  # no deadline: stays until first token
    clock.advance(3.0)
    assert ds.expire_backlog() == 3
    assert ds.expire_backlog() == 0
    a, b = _view(ds, "a:1"), _view(ds, "b:1")
    assert (a.decoding_requests, a.prefill_backlog) == (2, PrefillWork(1, 100, 5000.0))
    assert (b.decoding_requests, b.prefill_backlog) == (1, PrefillWork(1, 100, 5000.0))
    clock.advance(1000.0)
    ds.candidates()
    assert _view(ds, "b:1").prefill_backlog == NO_WORK
    assert _view(ds, "a:1").prefill_backlog == PrefillWork(1, 100, 5000.0)
    assert never.decoding is False


def test_an_old_ticket_does_not_corrupt_a_re_added_endpoint() -> None:
    clock = FakeClock(1000.0)
    ds = Datastore(clock)
    ds.add_endpoint("a:1")
    old = ds.begin("a:1", 1000, W1, first_token_by=1005.0)
    old_decoding = ds.begin("a:1", 500, W2, first_token_by=1100.0)
    ds.first_token(old_decoding)
    ds.remove_endpoint("a:1")
    ds.add_endpoint("a:1")
    new = ds.begin("a:1", 2300, W2, first_token_by=1100.0)
    fresh = _view(ds)
    assert fresh.prefill_backlog == W2
    assert (fresh.decoding_requests, fresh.in_flight_requests, fresh.in_flight_prompt_tokens) == (0, 1, 2300)

    clock.advance(10.0)  # old's deadline passes on the new record
    ds.candidates()
    assert ds.first_token(old) is False
    assert ds.release(old) is True
    assert ds.release(old_decoding) is True
    v = _view(ds)
    assert v.prefill_backlog == W2
    assert (v.decoding_requests, v.decoding_tokens, v.in_flight_requests, v.in_flight_prompt_tokens) == (
        0,
        0,
        1,
        2300,
    )
    ds.first_token(new)
    ds.release(new)
    v = _view(ds)
    assert (v.prefill_backlog, v.decoding_requests, v.in_flight_requests) == (NO_WORK, 0, 0)


def test_a_ticket_for_an_unknown_endpoint_never_counts_on_it_later() -> None:
    ds = Datastore(FakeClock())
    t = ds.begin("a:1", 100, W1, first_token_by=1001.0)
    ds.add_endpoint("a:1")
    assert ds.first_token(t) is False  # nothing was counted on the new record
    assert ds.release(t) is True
    v = _view(ds)
    assert (v.prefill_backlog, v.decoding_requests, v.in_flight_requests) == (NO_WORK, 0, 0)


def test_views_are_rebuilt_when_the_backlog_changes() -> None:
    ds = Datastore(FakeClock())
    ds.add_endpoint("a:1")
    before = _view(ds)
    assert _view(ds) is before  # unchanged: the same immutable view
    t = ds.begin("a:1", 100, W1)
    during = _view(ds)
    assert during is not before
    assert before.prefill_backlog == NO_WORK  # the old view is not mutated
    ds.first_token(t)
    assert _view(ds).prefill_backlog == NO_WORK
    assert during.prefill_backlog == W1


def test_served_models_follow_the_endpoints_and_their_metrics() -> None:
    clock = FakeClock()
    ds = Datastore(clock)
    assert ds.served_models() == frozenset()
    ds.add_endpoint("10.0.0.1:80", "base")
    assert ds.served_models() == {"base"}
    snap = MetricsSnapshot(
        observed_at=clock.now(), models=frozenset({"m2"}), waiting_lora_adapters=frozenset({"sql"})
    )
    ds.record_metrics("10.0.0.1:80", snap)
    assert ds.served_models() == {"base", "m2", "sql"}
    ds.add_endpoint("10.0.0.2:80", "other")
    assert ds.served_models() == {"base", "m2", "sql", "other"}
    ds.remove_endpoint("10.0.0.1:80")
    assert ds.served_models() == {"other"}
