"""Out-of-order ext_proc message sequences into the real gRPC server (`epp/server/ext_proc.py` inside
`EppServer`, on a loopback port): bodies before headers, trailers first, headers twice, bodies after
end of stream, response messages before the request, unknown body modes, garbage bodies.

Every stream ends with an OK status (the handler never raises), answers only what was asked, and ends
in at most one immediate (4xx/5xx) response that `epp_rejections_total` counts; afterwards nothing is
in flight, every routed request was released, and a normal request is served.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from epp.usage import UsageReader

from .grpc_rig import BUFFERED, CHAT_BODY, DUPLEX, STREAMED, ServerThread, body, destination, headers


@pytest.fixture(scope="module")
def epp() -> Iterator[ServerThread]:
    with ServerThread() as server:
        yield server


def response_headers(status: bytes, eos: bool) -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":status", raw_value=status),
            base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream"),
        ]
    )
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm, end_of_stream=eos))


def response_body(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=eos))


# What a model server may answer: SSE, JSON usage of odd shapes, garbage, JSON nested too deeply.
DEEP_USAGE = b'{"usage": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
RESPONSE_BODIES = [
    b"data: {}\n\n",
    b'data: {"usage": {"prompt_tokens": 3}}\n\ndata: [DONE]\n\n',
    b"",
    b"\xff",
    b'{"usage": 5}',
    b'{"usage": {"prompt_tokens": -1, "completion_tokens": 1e999}}',
    DEEP_USAGE,
    b"data: " + DEEP_USAGE + b"\n\n",
]
TRAILERS = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
RESPONSE_TRAILERS = pb.ProcessingRequest(response_trailers=pb.HttpTrailers())
EMPTY = pb.ProcessingRequest()  # no oneof set at all

bodies = st.sampled_from(
    [CHAT_BODY, CHAT_BODY[:25], CHAT_BODY[25:], b"", b"\xff\xfe garbage", b"{}", b"[" * 5000, b'{"model": 7}']
)
extra_headers = st.lists(
    st.tuples(
        st.sampled_from(
            ["x-request-id", "x-gateway-inference-objective", "content-type", "X-Request-Id", "x-other"]
        ),
        st.sampled_from([b"a", b"", b"\xff\xfe", b"batch", b"x" * 2000]),
    ),
    max_size=4,
)
request_headers = st.builds(
    headers,
    eos=st.booleans(),
    mode=st.sampled_from([None, 0, STREAMED, BUFFERED, 3, DUPLEX, 99]),
    response_mode=st.sampled_from([0, STREAMED, BUFFERED, DUPLEX]),
    path=st.sampled_from([b"/v1/chat/completions", b"/v1/completions", b"/healthz", b"", b"\xff\xfe"]),
    extra=extra_headers,
)
messages = st.one_of(
    request_headers,
    st.builds(body, bodies, st.booleans()),
    st.just(TRAILERS),
    st.builds(response_headers, st.sampled_from([b"200", b"503", b"abc", b"", b"9" * 30]), st.booleans()),
    st.builds(response_body, st.sampled_from(RESPONSE_BODIES), st.booleans()),
    st.just(RESPONSE_TRAILERS),
    st.just(EMPTY),
)
# The response oneofs each request oneof may be answered with.
ANSWERS = {
    "request_headers": {"request_headers", "request_body"},  # header-only, or body echoed with them
    "request_body": {"request_headers", "request_body"},  # duplex: the held headers, then the body
    "request_trailers": {"request_headers", "request_body", "request_trailers"},
    "response_headers": {"response_headers"},
    "response_body": {"response_body"},
    "response_trailers": {"response_trailers"},
}


def ends_response(m: pb.ProcessingRequest) -> bool:
    which = m.WhichOneof("request")
    return (
        which == "response_trailers"
        or (which == "response_headers" and m.response_headers.end_of_stream)
        or (which == "response_body" and m.response_body.end_of_stream)
    )


def routes_on_headers(first: pb.ProcessingRequest) -> bool:
    """Request headers that announce a body in a mode where Envoy routes on their answer (STREAMED, NONE)."""
    return (
        first.HasField("request_headers")
        and not first.request_headers.end_of_stream
        and first.HasField("protocol_config")
        and first.protocol_config.request_body_mode in (0, STREAMED)
    )


def counters(epp: ServerThread) -> tuple[float, float, float]:
    return (
        epp.sample_sum("epp_rejections_total"),
        epp.sample_sum("inference_objective_request_total"),
        epp.sample_sum("epp_requests_released_total"),
    )


# Most streams start as Envoy starts them (request headers), so that the later messages get a chance.
sequences = st.one_of(
    st.tuples(request_headers, st.lists(messages, max_size=7)).map(lambda t: [t[0], *t[1]]),
    st.lists(messages, min_size=1, max_size=8),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequences)
@example(  # response headers first, then request headers announcing a body in NONE mode (a 500, by design)
    [
        response_headers(b"200", False),
        headers(eos=False, mode=0, response_mode=0, path=b"/v1/chat/completions"),
    ]
)
@example(  # a body before the headers (a 400 protocol error), then headers in NONE mode
    [body(CHAT_BODY, False), headers(eos=False, mode=0, response_mode=0, path=b"/v1/chat/completions")]
)
def test_any_message_sequence_ends_cleanly_and_the_server_keeps_serving(
    epp: ServerThread, sequence: list[pb.ProcessingRequest]
) -> None:
    rejected0, routed0, released0 = counters(epp)
    out = epp.process(sequence)  # raises grpc.RpcError if the handler failed
    kinds = [r.WhichOneof("response") for r in out]
    assert None not in kinds, out
    # The server ends the stream once a response has ended: what a client sends after that is not read.
    last = next((i for i, m in enumerate(sequence) if ends_response(m)), len(sequence))
    sequence = sequence[: last + 1]
    sent = Counter(m.WhichOneof("request") for m in sequence)
    allowed = set().union(*(ANSWERS[k] for k in sent if k is not None))
    immediate = [r.immediate_response for r in out if r.HasField("immediate_response")]
    assert all(k in allowed for k in kinds if k != "immediate_response"), (kinds, sent)
    if immediate:
        assert kinds.index("immediate_response") == len(kinds) - 1, kinds  # nothing after it
        [ir] = immediate
        # (the request path's first message decides: request headers after response headers still count;
        # a body or trailers before them is a 400 protocol error, whatever mode the headers then announce)
        request_path = ("request_headers", "request_body", "request_trailers")
        first = next((m for m in sequence if m.WhichOneof("request") in request_path), sequence[0])
        if routes_on_headers(first):  # a body in STREAMED or NONE mode: refused with a 500
            assert ir.status.code == 500 and b"request_body_mode" in ir.body, ir
        else:
            assert ir.status.code in (400, 413, 429, 503), ir  # never a 500: no internal error
        assert "error" in json.loads(ir.body)
    else:
        # Each response-path message was answered once.
        for kind in ("response_headers", "response_body", "response_trailers"):
            assert kinds.count(kind) == sent[kind], (kind, kinds, sent)
    epp.wait_idle()
    rejected, routed, released = counters(epp)
    assert rejected - rejected0 == len(immediate)
    assert released - released0 == routed - routed0  # every routed request was released
    epp.assert_serves()


def test_headers_twice_after_a_pick_is_a_protocol_error_and_nothing_leaks(epp: ServerThread) -> None:
    before = epp.sample_sum("epp_rejections_total", code="ProtocolError")
    out = epp.process([headers(eos=True), headers(eos=True)])
    assert destination(out[0])
    ir = out[-1].immediate_response
    assert ir.status.code == 400 and b"request headers sent twice" in ir.body
    epp.wait_idle()
    assert epp.sample_sum("epp_rejections_total", code="ProtocolError") == before + 1
    epp.assert_serves()


@pytest.mark.parametrize(
    "first", [body(CHAT_BODY, True), pb.ProcessingRequest(request_trailers=pb.HttpTrailers())]
)
def test_a_body_or_trailers_before_the_headers_is_a_protocol_error(
    epp: ServerThread, first: pb.ProcessingRequest
) -> None:
    out = epp.process([first, headers(), body(CHAT_BODY, True)])
    [resp] = out
    assert resp.immediate_response.status.code == 400
    assert b"before the request headers" in resp.immediate_response.body
    assert epp.in_flight() == 0
    epp.assert_serves()


def test_many_copies_of_a_header_are_joined_once(epp: ServerThread) -> None:
    # 20,000 copies of a 1 KB header: joined in one pass (pairwise joining is quadratic: ~200 GB copied).
    copies = [("x-other", b"v" * 1000)] * 20_000
    out = epp.process([headers(eos=True, extra=copies)])
    assert destination(out[0])
    epp.wait_idle()
    epp.assert_serves()


@pytest.mark.parametrize("sse", [False, True])
def test_a_response_body_nested_too_deeply_is_echoed_and_the_request_released(
    epp: ServerThread, sse: bool
) -> None:
    """The usage reader gives up on it (no usage); the body passes through and the request completes."""
    before = epp.sample_sum("epp_requests_released_total", cause="complete")
    payload = b"data: " + DEEP_USAGE + b"\n\n" if sse else DEEP_USAGE
    out = epp.process(
        [
            headers(),
            body(CHAT_BODY, True),
            response_headers(b"200", False) if sse else plain_response_headers(),
            response_body(payload, True),
        ]
    )
    assert destination(out[0])
    [echo] = [r for r in out if r.HasField("response_body")]
    assert echo.response_body.response.body_mutation.streamed_response.body == payload
    epp.wait_idle()
    assert epp.sample_sum("epp_requests_released_total", cause="complete") == before + 1
    epp.assert_serves()


def plain_response_headers() -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm))


@settings(max_examples=300, deadline=None)
@given(
    st.booleans(), st.lists(st.one_of(st.binary(max_size=60), st.sampled_from(RESPONSE_BODIES)), max_size=5)
)
def test_the_usage_reader_takes_any_response_bytes(sse: bool, chunks: list[bytes]) -> None:
    reader = UsageReader(sse)
    for chunk in chunks:
        reader.feed(chunk)
    usage = reader.finish()
    if usage is not None:
        assert min(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, usage.cached_tokens) >= 0


@pytest.mark.parametrize("end", ["body", "headers"])
def test_the_server_ends_the_stream_after_the_response_without_waiting_for_the_client(
    epp: ServerThread, end: str
) -> None:
    """After the response's last answer the EPP reads no more (a read pending when Envoy resets the
    stream leaks native memory in grpcio's aio server: docs/operations.md, "Memory") and, when no reset
    comes, ends the call itself with OK. The client here neither resets nor half-closes."""
    hold = threading.Event()

    def messages() -> Iterator[pb.ProcessingRequest]:
        yield headers()
        yield body(CHAT_BODY, True)
        yield response_headers(b"200", end == "headers")
        if end == "body":
            yield response_body(b'{"choices": []}', True)
        hold.wait(30)  # the client's side stays open

    call = epp.stream(messages(), timeout=20)
    try:
        out = list(call)  # ends only when the server ends the call
        assert call.code() == grpc.StatusCode.OK
    finally:
        hold.set()
    assert destination(out[0])
    assert out[-1].HasField("response_body" if end == "body" else "response_headers")
    epp.wait_idle()
    epp.assert_serves()
