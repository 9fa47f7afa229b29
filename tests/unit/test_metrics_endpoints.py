"""Series labelled by endpoint go when the endpoint leaves the pool, and start from zero if it returns."""

from __future__ import annotations

from prometheus_client import generate_latest

from epp.server.director import Director
from epp.server.ext_proc import RequestStream
from epp.server.metrics import EppMetrics
from epp.testing.fakes import FakeClock
from epp.usage import Usage

from .test_ext_proc_stream import BODY, body, director, headers, response_headers

A, B = "10.0.0.1:80", "10.0.0.2:80"


def record_everything(m: EppMetrics, ep: str) -> None:
    m.picks(ep, "default", "scored").inc()
    m.ttfb(ep).observe(0.1)
    m.usage_tokens(ep, "prompt").inc(5)
    m.usage_invalid(ep).inc()
    m.backend_errors(ep, "503").inc()
    m.on_scrape(ep, False, "timeout", 0.1)
    m.on_scrape(ep, True, None, 0.1)


def exposition(m: EppMetrics) -> str:
    return generate_latest(m.registry).decode()


def test_forgetting_an_endpoint_removes_each_of_its_series_and_keeps_the_others() -> None:
    m = EppMetrics()
    record_everything(m, A)
    record_everything(m, B)
    m.forget_endpoint(A)
    text = exposition(m)
    assert f'"{A}"' not in text
    for name in (
        "epp_picks_total",
        "epp_time_to_first_byte_seconds_count",
        "epp_usage_tokens_total",
        "epp_usage_invalid_total",
        "epp_backend_errors_total",
        "epp_metrics_scrapes_total",
        "epp_metrics_scrape_errors_total",
    ):
        assert any(line.startswith(name) and f'"{B}"' in line for line in text.splitlines()), name


def test_an_endpoint_that_comes_back_starts_from_zero() -> None:
    m = EppMetrics()
    record_everything(m, A)
    m.forget_endpoint(A)
    m.picks(A, "default", "scored").inc()
    sample = m.registry.get_sample_value
    assert sample("epp_picks_total", {"endpoint": A, "profile": "default", "reason": "scored"}) == 1
    assert sample("epp_metrics_scrapes_total", {"endpoint": A, "outcome": "ok"}) is None


def test_forgetting_an_unknown_endpoint_does_nothing() -> None:
    m = EppMetrics()
    record_everything(m, B)
    before = exposition(m)
    m.forget_endpoint(A)
    assert exposition(m) == before


def routed(d: Director) -> RequestStream:
    s = RequestStream(d, 1 << 30)
    s.on_message(headers())
    s.on_message(body(BODY, True))
    assert s.routed is not None
    return s


def endpoint_lines(d: Director, ep: str) -> list[str]:
    return [line for line in exposition(d.metrics).splitlines() if f'"{ep}"' in line]


def test_a_response_that_ends_after_its_endpoint_left_leaves_no_series_behind() -> None:
    d = director()
    s = routed(d)
    assert s.routed is not None
    ep = s.routed.endpoint
    d.datastore.remove_endpoint(ep)
    d.metrics.forget_endpoint(ep)
    s.on_message(response_headers(b"503"))
    d.on_first_byte(s.routed)
    d.finish(s.routed, "error", Usage(prompt_tokens=3, completion_tokens=1), usage_invalid=True)
    assert endpoint_lines(d, ep) == []
    # the request's own figures are kept (they are not the endpoint's)
    labels = {"model_name": "m", "target_model_name": "m"}
    assert d.metrics.registry.get_sample_value("inference_objective_input_tokens_count", labels) == 1


def test_a_stray_from_before_the_endpoint_came_back_is_not_counted_on_the_new_one() -> None:
    clock = FakeClock()
    d = director(clock=clock)
    s = routed(d)
    assert s.routed is not None
    ep = s.routed.endpoint
    d.datastore.remove_endpoint(ep)
    d.metrics.forget_endpoint(ep)
    clock.advance(1.0)
    d.datastore.add_endpoint(ep)  # the same address again
    s.on_message(response_headers(b"500"))
    assert not any("epp_backend_errors_total" in line for line in endpoint_lines(d, ep))


def test_a_response_of_an_endpoint_still_in_the_pool_is_counted() -> None:
    d = director()
    s = routed(d)
    assert s.routed is not None
    s.on_message(response_headers(b"500"))
    got = d.metrics.registry.get_sample_value(
        "epp_backend_errors_total", {"endpoint": s.routed.endpoint, "status": "500"}
    )
    assert got == 1
