"""The ext_proc stream state machine, fed protobuf messages directly (no network)."""

from __future__ import annotations

import json
import random

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from epp.config import build_scheduler, default_config
from epp.datastore import Datastore
from epp.scheduling.builtin import default_registry
from epp.server.director import Director
from epp.server.ext_proc import MAX_CHUNK, RequestStream, subset_hint
from epp.server.metrics import EppMetrics
from epp.testing.fakes import FakeClock
from epp.types import MetricsSnapshot

DUPLEX, BUFFERED = 4, 2
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def director(n: int = 2) -> Director:
    clock = FakeClock()
    ds = Datastore(clock)
    for i in range(n):
        ds.add_endpoint(f"10.0.0.{i}:80")
        ds.record_metrics(f"10.0.0.{i}:80", MetricsSnapshot(observed_at=clock.now(), waiting=100 * i))
    sched = build_scheduler(default_config(), default_registry(), clock, random.Random(0))
    return Director(ds, sched, EppMetrics(), clock)


def headers(eos: bool = False, mode: int = DUPLEX, subset: object = None) -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        ]
    )
    req = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=hm, end_of_stream=eos),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=DUPLEX),  # type: ignore[arg-type]
    )
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-subset": subset})
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return req


def body(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def destination(resp: pb.ProcessingResponse) -> str:
    common = resp.request_headers.response if resp.HasField("request_headers") else resp.request_body.response
    [h] = common.header_mutation.set_headers
    assert (
        resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields[h.header.key].string_value
        == h.header.raw_value.decode()
    )
    return h.header.raw_value.decode()


def test_duplex_holds_headers_until_body_end_and_echoes_in_chunks() -> None:
    d = director()
    s = RequestStream(d, 1 << 30)
    big = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x" * (3 * MAX_CHUNK)}]}
    ).encode()
    assert list(s.on_message(headers())) == []
    assert list(s.on_message(body(big[:1000], False))) == []
    out = list(s.on_message(body(big[1000:], True)))
    assert destination(out[0]) == "10.0.0.0:80"
    chunks = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert b"".join(c.body for c in chunks) == big
    assert all(len(c.body) <= MAX_CHUNK for c in chunks)
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert d.datastore.total_in_flight() == 1
    s.close()
    assert d.datastore.total_in_flight() == 0


def test_buffered_answers_headers_at_once_and_routes_in_the_body_response() -> None:
    s = RequestStream(director(), 1 << 30)
    [first] = s.on_message(headers(mode=BUFFERED))
    assert (
        first.HasField("request_headers") and not first.request_headers.response.header_mutation.set_headers
    )
    [resp] = s.on_message(body(BODY, True))
    assert resp.HasField("request_body") and destination(resp) == "10.0.0.0:80"


def test_trailers_end_the_body_in_duplex_mode() -> None:
    s = RequestStream(director(), 1 << 30)
    s.on_message(headers())
    assert list(s.on_message(body(BODY, False))) == []
    out = list(s.on_message(pb.ProcessingRequest(request_trailers=pb.HttpTrailers())))
    assert destination(out[0])
    assert out[1].request_body.response.body_mutation.streamed_response.end_of_stream is False
    assert out[-1].HasField("request_trailers")


@pytest.mark.parametrize(
    ("subset", "expected"),
    [
        (["10.0.0.1:80"], ["10.0.0.1:80"]),
        ("10.0.0.1:80, 10.0.0.0:80", ["10.0.0.1:80", "10.0.0.0:80"]),
        ([], []),
    ],
)
def test_subset_hint_shapes(subset: object, expected: list[str]) -> None:
    assert subset_hint(headers(subset=subset)) == expected


def test_no_subset_hint_is_none() -> None:
    assert subset_hint(headers()) is None


@pytest.mark.parametrize(("subset", "status"), [([], 503), (["10.9.9.9:80"], 503), (["10.0.0.1:80"], 0)])
def test_empty_or_ineligible_subset_is_503(subset: list[str], status: int) -> None:
    s = RequestStream(director(), 1 << 30)
    out = list(s.on_message(headers(eos=True, subset=subset)))
    if status:
        assert out[0].immediate_response.status.code == status
        assert s.done
    else:
        assert destination(out[0]) == "10.0.0.1:80"


def test_response_path_releases_once_and_records_usage() -> None:
    d = director()
    s = RequestStream(d, 1 << 30)
    s.on_message(headers())
    s.on_message(body(BODY, True))
    rh = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    s.on_message(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=rh)))
    usage = {"usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}
    out = list(
        s.on_message(
            pb.ProcessingRequest(
                response_body=pb.HttpBody(body=json.dumps(usage).encode(), end_of_stream=True)
            )
        )
    )
    assert out[0].response_body.response.body_mutation.streamed_response.end_of_stream
    assert d.datastore.total_in_flight() == 0
    s.close()
    value = d.metrics.registry.get_sample_value(
        "epp_usage_tokens_total", {"endpoint": "10.0.0.0:80", "kind": "prompt"}
    )
    assert value == 7
    assert d.metrics.registry.get_sample_value("epp_requests_released_total", {"cause": "complete"}) == 1
    assert d.metrics.registry.get_sample_value("epp_requests_released_total", {"cause": "disconnect"}) is None


def test_body_over_the_limit_is_413_and_nothing_is_held() -> None:
    d = director()
    s = RequestStream(d, 100)
    s.on_message(headers())
    [resp] = s.on_message(body(b"x" * 101, False))
    assert resp.immediate_response.status.code == 413
    assert s.done and not s.body and d.datastore.total_in_flight() == 0
