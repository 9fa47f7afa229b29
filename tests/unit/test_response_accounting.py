"""The response side of an ext_proc stream: the backend's response always passes, whatever the
bookkeeping meets (impossible usage, internal errors); releases follow the response status; per-endpoint
figures and in-flight accounting follow the endpoint Envoy reports it served; decisions keep the
calibration they were made with."""

from __future__ import annotations

import json
import logging

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.config import parse_config
from epp.server.decisions import DecisionLog
from epp.server.director import FAILURE_LOG_EVERY_S, Director
from epp.server.ext_proc import RequestStream
from epp.server.ext_proc_wire import SERVED_KEY
from epp.testing.fakes import FakeClock

from .test_ext_proc_stream import BODY, body, director, headers, response_headers

HUGE = "9" * 400
FALLBACKS = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins: [{type: ttft-scorer}, {type: max-score-picker, parameters: {maxNumOfEndpoints: 2}}]
schedulingProfiles: [{name: d, plugins: [{pluginRef: ttft-scorer}, {pluginRef: max-score-picker}]}]
"""


def sample(d: Director, name: str, **labels: str) -> float | None:
    return d.metrics.registry.get_sample_value(name, labels)


def routed_stream(d: Director, stream: bool = True) -> RequestStream:
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(path=b"/v1/completions"))
    s.on_message(
        body(json.dumps({"model": "m", "prompt": list(range(300)), "stream": stream}).encode(), True)
    )
    assert s.routed is not None
    return s


def response_body(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=eos))


def echoed(out: list[pb.ProcessingResponse]) -> bytes:
    return b"".join(r.response_body.response.body_mutation.streamed_response.body for r in out)


def served_headers(served: str | None, status: bytes = b"200", sse: bool = True) -> pb.ProcessingRequest:
    rh = response_headers(status=status, sse=sse)
    if served is not None:
        rh.metadata_context.filter_metadata["envoy.lb"].fields[SERVED_KEY].string_value = served
    return rh


# -- 1. usage too large to be real; internal errors never fail the response -------------------------


@pytest.mark.parametrize("sse", [False, True])
def test_a_huge_usage_count_passes_through_and_is_counted_invalid(sse: bool) -> None:
    d = director()
    s = routed_stream(d, stream=sse)
    ep = s.routed.decision.primary  # type: ignore[union-attr]
    doc = f'{{"choices": [], "usage": {{"prompt_tokens": {HUGE}, "completion_tokens": 1}}}}'
    payload = (f"data: {doc}\n\ndata: [DONE]\n\n" if sse else doc).encode()
    s.on_message(response_headers(sse=sse))
    out = list(s.on_message(response_body(payload, True)))
    assert echoed(out) == payload
    assert out[-1].response_body.response.body_mutation.streamed_response.end_of_stream
    assert d.datastore.total_in_flight() == 0
    assert sample(d, "epp_usage_invalid_total", endpoint=ep) == 1
    assert sample(d, "epp_usage_tokens_total", endpoint=ep, kind="prompt") is None
    assert sample(d, "epp_requests_released_total", cause="complete") == 1
    assert sample(d, "epp_response_accounting_errors_total") == 0


def test_an_internal_error_in_response_bookkeeping_passes_the_response_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    d = director()
    s = routed_stream(d)

    def boom(*args: object) -> None:
        raise RuntimeError("bookkeeping bug")

    monkeypatch.setattr(d, "on_first_byte", boom)
    monkeypatch.setattr(d, "on_response_status", boom)
    with caplog.at_level(logging.ERROR, logger="epp.director"):
        [rh] = s.on_message(response_headers())
        assert rh.HasField("response_headers")
        out = list(s.on_message(response_body(b"data: {}\n\n", False)))
        out += list(s.on_message(response_body(b"data: [DONE]\n\n", True)))
    assert echoed(out) == b"data: {}\n\ndata: [DONE]\n\n"
    assert d.datastore.total_in_flight() == 0  # released all the same
    assert sample(d, "epp_response_accounting_errors_total") == 3
    logged = [r for r in caplog.records if "response bookkeeping failed" in r.getMessage()]
    assert len(logged) == 1  # rate-limited
    assert logged[0].exc_info is not None and "bookkeeping bug" in str(logged[0].exc_info[1])


def test_a_failing_release_still_frees_the_in_flight_accounting(monkeypatch: pytest.MonkeyPatch) -> None:
    d = director()
    s = routed_stream(d)

    def boom(*args: object) -> None:
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr(d, "finish", boom)
    s.on_message(response_headers())
    out = list(s.on_message(response_body(b"data: [DONE]\n\n", True)))
    assert echoed(out) == b"data: [DONE]\n\n"
    assert d.datastore.total_in_flight() == 0
    assert sample(d, "epp_response_accounting_errors_total") == 1


def test_bookkeeping_failures_are_logged_at_most_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    d = director(clock=clock)
    with caplog.at_level(logging.ERROR, logger="epp.director"):
        for _ in range(3):
            try:
                raise ValueError("x")
            except ValueError:
                d.bookkeeping_failed("test")
        clock.advance(FAILURE_LOG_EVERY_S + 1)
        try:
            raise ValueError("y")
        except ValueError:
            d.bookkeeping_failed("test")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "(2 similar failures since the last report)" in messages[1]
    assert sample(d, "epp_response_accounting_errors_total") == 4


# -- 2. the release cause follows the response status --------------------------------------------


@pytest.mark.parametrize(("status", "cause"), [(b"200", "complete"), (b"503", "error")])
def test_trailers_release_by_the_response_status(status: bytes, cause: str) -> None:
    d = director()
    s = routed_stream(d)
    ep = s.routed.decision.primary  # type: ignore[union-attr]
    usage = b'{"usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}'
    s.on_message(response_headers(status=status, sse=False))
    s.on_message(response_body(usage, False))
    s.on_message(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    assert s.done and d.datastore.total_in_flight() == 0
    assert sample(d, "epp_requests_released_total", cause=cause) == 1
    other = "error" if cause == "complete" else "complete"
    assert sample(d, "epp_requests_released_total", cause=other) is None
    recorded = sample(d, "epp_usage_tokens_total", endpoint=ep, kind="prompt")
    assert recorded == (7 if cause == "complete" else None)  # an error response's usage is not counted


@pytest.mark.parametrize(("status", "cause"), [(b"200", "complete"), (b"500", "error")])
def test_with_response_body_mode_none_the_streams_end_releases_by_status(status: bytes, cause: str) -> None:
    d = director()
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(response_mode=0))
    s.on_message(body(BODY, True))
    s.on_message(response_headers(status=status, sse=False))
    s.close()
    assert sample(d, "epp_requests_released_total", cause=cause) == 1
    assert d.datastore.total_in_flight() == 0


RELEASE_CAUSES = ("complete", "error", "disconnect", "unobserved")


@pytest.mark.parametrize(
    ("response_mode", "cause"),
    [
        (0, "unobserved"),  # body NONE, no response headers: Envoy sent nothing of the response (SKIP)
        (4, "disconnect"),  # a duplex response's end comes as a message: the stream ended before it
        (1, "disconnect"),
        (2, "disconnect"),
    ],
)
def test_a_stream_that_ends_before_any_response_message_is_released_as_unobserved_or_disconnect(
    response_mode: int, cause: str
) -> None:
    d = director()
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(response_mode=response_mode))
    s.on_message(body(BODY, True))
    assert d.datastore.total_in_flight() == 1
    s.close()
    s.close()  # released once
    released = {c: sample(d, "epp_requests_released_total", cause=c) for c in RELEASE_CAUSES}
    assert released == {c: (1 if c == cause else None) for c in RELEASE_CAUSES}
    assert d.datastore.total_in_flight() == 0


# -- 3. figures and in-flight accounting of the endpoint that served the response -------------------


def test_a_fallback_that_served_gets_the_figures_and_the_in_flight_accounting() -> None:
    d = director(config=parse_config(FALLBACKS, "fallbacks.yaml"))
    s = routed_stream(d)
    primary, fallback = s.routed.decision.endpoints  # type: ignore[union-attr]
    p_rec, f_rec = d.datastore.get(primary), d.datastore.get(fallback)
    assert p_rec is not None and f_rec is not None
    assert (p_rec.in_flight_requests, p_rec.prefill_backlog.requests, f_rec.in_flight_requests) == (1, 1, 0)
    s.on_message(served_headers(fallback))
    # Released where it was acquired, taken on the endpoint that serves it (still before its first token).
    assert (p_rec.in_flight_requests, p_rec.in_flight_prompt_tokens, p_rec.prefill_backlog.requests) == (
        0,
        0,
        0,
    )
    assert (f_rec.in_flight_requests, f_rec.in_flight_prompt_tokens, f_rec.prefill_backlog.requests) == (
        1,
        300,
        1,
    )
    d.clock.advance(0.01)  # type: ignore[attr-defined]
    s.on_message(response_body(b'data: {"choices": []}\n\n', False))
    assert (f_rec.prefill_backlog.requests, f_rec.decoding_requests, p_rec.decoding_requests) == (0, 1, 0)
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 300, "completion_tokens": 4}}\n\n'
    s.on_message(response_body(usage, True))
    assert d.datastore.total_in_flight() == 0
    assert (f_rec.in_flight_requests, f_rec.decoding_requests, p_rec.in_flight_requests) == (0, 0, 0)
    assert sample(d, "epp_time_to_first_byte_seconds_count", endpoint=fallback) == 1
    assert sample(d, "epp_time_to_first_byte_seconds_count", endpoint=primary) is None
    assert sample(d, "epp_usage_tokens_total", endpoint=fallback, kind="completion") == 4
    assert sample(d, "epp_usage_tokens_total", endpoint=primary, kind="completion") is None
    assert d.cost is not None and "m" not in d.cost.coefficients()  # not the primary's first token


def test_a_fallbacks_error_status_is_its_own() -> None:
    d = director(config=parse_config(FALLBACKS, "fallbacks.yaml"))
    s = routed_stream(d)
    primary, fallback = s.routed.decision.endpoints  # type: ignore[union-attr]
    s.on_message(served_headers(fallback, status=b"503"))
    s.on_message(response_body(b"overloaded", True))
    assert sample(d, "epp_backend_errors_total", endpoint=fallback, status="503") == 1
    assert sample(d, "epp_backend_errors_total", endpoint=primary, status="503") is None
    assert sample(d, "epp_requests_released_total", cause="error") == 1
    assert d.datastore.total_in_flight() == 0


def test_a_request_already_decoding_moves_as_decoding() -> None:
    d = director(config=parse_config(FALLBACKS, "fallbacks.yaml"))
    s = routed_stream(
        d, stream=False
    )  # its first byte is not its first token: out of the backlog at its estimate
    routed = s.routed
    assert routed is not None
    d.clock.advance(routed.ticket.first_token_by - d.clock.now() + 1)  # type: ignore[attr-defined]
    d.datastore.expire_backlog()
    primary, fallback = routed.decision.endpoints
    p_rec, f_rec = d.datastore.get(primary), d.datastore.get(fallback)
    assert p_rec is not None and f_rec is not None and p_rec.decoding_requests == 1
    s.on_message(served_headers(fallback, sse=False))
    assert (p_rec.decoding_requests, p_rec.in_flight_requests) == (0, 0)
    assert (f_rec.decoding_requests, f_rec.in_flight_requests, f_rec.prefill_backlog.requests) == (1, 1, 0)
    s.on_message(response_body(b"{}", True))
    assert (f_rec.decoding_requests, f_rec.in_flight_requests) == (0, 0)


@pytest.mark.parametrize("served", [None, "10.9.9.9:80"])
def test_without_a_report_naming_a_decision_endpoint_the_primary_keeps_everything(served: str | None) -> None:
    d = director(config=parse_config(FALLBACKS, "fallbacks.yaml"))
    s = routed_stream(d)
    primary = s.routed.decision.primary  # type: ignore[union-attr]
    s.on_message(served_headers(served, status=b"500"))
    rec = d.datastore.get(primary)
    assert rec is not None and rec.in_flight_requests == 1
    s.on_message(response_body(b"", True))
    assert sample(d, "epp_backend_errors_total", endpoint=primary, status="500") == 1
    assert sample(d, "epp_time_to_first_byte_seconds_count", endpoint=primary) == 1
    assert d.datastore.total_in_flight() == 0


# -- 10. a decision keeps the calibration it was made with ----------------------------------------


def test_a_decision_shows_the_calibration_of_its_time() -> None:
    d = director()
    d.decisions = DecisionLog(10)
    routed_stream(d).close()
    assert d.cost is not None
    d.cost.calibrator("m").prefill_scale = 2.5  # the fit moved after the first decision
    routed_stream(d).close()
    newer, older = d.decisions.render(10, d.clock.now())["decisions"]
    assert older["calibration"]["prefill_scale"] == 1.0
    assert older["calibration"]["observations"] == 0
    assert newer["calibration"]["prefill_scale"] == 2.5
    per_token = d.cost.profile("m").prefill_per_token_s
    assert newer["calibration"]["prefill_seconds_per_token"] == pytest.approx(2.5 * per_token)


def test_a_decision_without_estimates_used_no_calibration() -> None:
    d = director(config=parse_config(FALLBACKS.replace("ttft-scorer", "queue-scorer"), "q.yaml"))
    d.decisions = DecisionLog(10)
    routed_stream(d).close()
    [only] = d.decisions.render(10, d.clock.now())["decisions"]
    assert only["calibration"] == {}


def test_an_unknown_header_value_never_breaks_the_response() -> None:
    """A header map with odd bytes still parses; the response headers answer is sent."""
    d = director(decision_header=True)
    s = routed_stream(d)
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"\xff\xfe")])
    [rh] = s.on_message(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm)))
    assert rh.HasField("response_headers")
    s.on_message(response_body(b"", True))
    assert sample(d, "epp_requests_released_total", cause="error") == 1  # an unreadable status is no 2xx
