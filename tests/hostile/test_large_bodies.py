"""20 MB and 100 MB request bodies through the real gRPC ext_proc server, in duplex-streamed chunks as
Envoy sends them: over `max_body_bytes` the answer is 413 as soon as the limit is crossed (the EPP
stops reading and holds nothing), under it the body is routed and echoed intact; either way the
server serves the next request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.config import StaticEndpoint, parse_config
from epp.server.app import EppServer, ServerSettings
from epp.server.ext_proc import RequestStream
from epp.server.ext_proc_wire import MAX_CHUNK

from .grpc_rig import BUFFERED, CONFIG, ENDPOINTS, ServerThread, body, destination, echoed, headers

MB = 1_000_000
CHUNK = 1 << 20  # Envoy passes duplex bodies on as they arrive; 1 MiB pieces


def big_body(size: int) -> bytes:
    head = b'{"model": "m", "prompt": "'
    tail = b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


class Sender:
    """The request messages of one stream, produced lazily; counts the body bytes gRPC took."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.sent = 0

    def __iter__(self) -> Iterator[pb.ProcessingRequest]:
        yield headers(path=b"/v1/completions")
        view = memoryview(self.data)
        for start in range(0, len(view), CHUNK):
            piece = bytes(view[start : start + CHUNK])
            self.sent += len(piece)
            yield body(piece, start + CHUNK >= len(view))


@pytest.fixture(scope="module")
def epp() -> Iterator[ServerThread]:
    with ServerThread() as server:  # the default limit, 32 MiB
        yield server


@pytest.fixture(scope="module")
def small_limit() -> Iterator[ServerThread]:
    with ServerThread(max_body_bytes=4 * 1024 * 1024) as server:
        yield server


def test_a_100_mb_body_is_413_once_the_limit_is_crossed(epp: ServerThread) -> None:
    data = big_body(100 * MB)
    sender = Sender(data)
    before = epp.sample_sum("epp_rejections_total", status="413")
    out = list(epp.stream(iter(sender)))
    [resp] = out
    assert resp.immediate_response.status.code == 413
    assert f"exceeds {epp.settings.max_body_bytes} bytes".encode() in resp.immediate_response.body
    # The stream ended at the limit: gRPC stopped taking the rest of the body (flow control windows
    # let a few MB more through, never the 100 MB).
    assert sender.sent < 64 * MB, sender.sent
    assert epp.sample_sum("epp_rejections_total", status="413") == before + 1
    assert epp.in_flight() == 0
    epp.assert_serves()


def test_a_20_mb_body_over_a_smaller_limit_is_413(small_limit: ServerThread) -> None:
    sender = Sender(big_body(20 * MB))
    [resp] = small_limit.stream(iter(sender))
    assert resp.immediate_response.status.code == 413
    assert sender.sent < 20 * MB
    small_limit.assert_serves()


def test_a_20_mb_body_under_the_limit_is_routed_and_echoed_intact(epp: ServerThread) -> None:
    data = big_body(20 * MB)
    out = list(epp.stream(iter(Sender(data))))
    assert destination(out[0])
    chunks = list(echoed(out[1:]))
    assert all(len(c) <= MAX_CHUNK for c in chunks)
    assert b"".join(chunks) == data
    assert out[-1].request_body.response.body_mutation.streamed_response.end_of_stream
    epp.wait_idle()  # the stream ended without a response: released as a disconnect
    epp.assert_serves()


def test_a_40_mb_buffered_body_in_one_message_is_413(epp: ServerThread) -> None:
    data = big_body(40 * MB)
    out = list(epp.stream(iter([headers(mode=BUFFERED), body(data, True)])))
    assert out[0].HasField("request_headers")  # BUFFERED: the headers are answered at once
    assert out[-1].immediate_response.status.code == 413
    epp.assert_serves()


def test_the_stream_never_holds_more_than_the_limit() -> None:
    """The state machine itself, fed 100 MB in 1 MiB chunks: the buffer stays under the limit, and
    is dropped at the 413 (no network: what the gRPC test cannot see from outside)."""
    limit = 32 * 1024 * 1024
    server = EppServer(ServerSettings(), parse_config(CONFIG, "hostile.yaml"), [StaticEndpoint(ENDPOINTS[0])])
    d = server.director
    s = RequestStream(d, limit)
    assert list(s.on_message(headers())) == []
    piece = b"x" * CHUNK
    answered: list[pb.ProcessingResponse] = []
    for _ in range(100):
        answered.extend(s.on_message(body(piece, False)))
        assert len(s.body) <= limit
        if s.done:
            break
    [resp] = answered
    assert resp.immediate_response.status.code == 413
    assert len(s.body) == 0 and d.datastore.total_in_flight() == 0
    assert json.loads(resp.immediate_response.body)["error"]["code"] == 413
