from __future__ import annotations

import pytest

from epp.datastore import Datastore
from epp.testing.fakes import FakeClock
from epp.types import MetricsSnapshot


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
