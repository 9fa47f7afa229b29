"""What the timing histograms measure: every scheduling cycle, refusals included, and a request's
duration from its headers, in the reference's buckets."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.server.director import Director
from epp.server.ext_proc import RequestStream
from epp.testing.fakes import FakeClock
from epp.types import MetricsSnapshot

from .test_ext_proc_stream import BODY, body, director, headers, response_headers

CYCLES = "inference_extension_scheduler_e2e_duration_seconds_count"
DURATION = "inference_objective_request_duration_seconds"
MODEL = {"model_name": "m", "target_model_name": "m"}


def sample(d: Director, name: str, labels: dict[str, str] | None = None) -> float | None:
    return d.metrics.registry.get_sample_value(name, labels or {})


def test_a_cycle_that_sheds_the_request_is_observed() -> None:
    d = director(n=1)
    d.datastore.record_metrics("10.0.0.0:80", MetricsSnapshot(observed_at=d.clock.now(), waiting=10_000))
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(objective=b"batch"))
    [resp] = s.on_message(body(BODY, True))
    assert resp.immediate_response.status.code == 429
    assert sample(d, CYCLES) == 1


def test_a_cycle_that_routes_is_observed_once() -> None:
    d = director(n=1)
    s = RequestStream(d, 1 << 30)
    s.on_message(headers())
    s.on_message(body(BODY, True))
    assert s.routed is not None and sample(d, CYCLES) == 1


def test_the_request_duration_starts_at_the_request_headers() -> None:
    clock = FakeClock()
    d = director(n=1, clock=clock)
    s = RequestStream(d, 1 << 30)
    s.on_message(headers())
    clock.advance(2.0)  # the body takes its time to come
    s.on_message(body(BODY, True))
    s.on_message(response_headers(sse=False))
    clock.advance(0.5)
    s.on_message(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=False)))
    clock.advance(0.5)
    s.on_message(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)))
    assert sample(d, f"{DURATION}_sum", MODEL) == 3.0
    # the time to first byte is still the endpoint's: from the pick
    assert sample(d, "epp_time_to_first_byte_seconds_sum", {"endpoint": "10.0.0.0:80"}) == 0.5


def test_the_request_duration_buckets_reach_an_hour_as_the_references_do() -> None:
    clock = FakeClock()
    d = director(n=1, clock=clock)
    s = RequestStream(d, 1 << 30)
    s.on_message(headers())
    s.on_message(body(BODY, True))
    clock.advance(3000.0)
    s.close()
    assert sample(d, f"{DURATION}_bucket", {**MODEL, "le": "2700.0"}) == 0
    assert sample(d, f"{DURATION}_bucket", {**MODEL, "le": "3600.0"}) == 1
    assert sample(d, f"{DURATION}_bucket", {**MODEL, "le": "0.005"}) == 0


def test_a_request_routed_without_its_headers_time_starts_at_the_cycle() -> None:
    clock = FakeClock()
    d = director(n=1, clock=clock)
    routed = d.route({":path": "/v1/chat/completions"}, BODY)
    clock.advance(0.5)
    d.finish(routed, "complete")
    assert sample(d, f"{DURATION}_sum", MODEL) == 0.5
