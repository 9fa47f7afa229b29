"""The ext_proc stream state machine, fed protobuf messages directly (no network)."""

from __future__ import annotations

import json
import random

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from epp.config import EppConfig, build_scheduler, default_config, parse_config
from epp.costmodel.service import SERVICE_KEY as COST_KEY
from epp.costmodel.service import CostModel
from epp.datastore import Datastore
from epp.scheduling.builtin import default_registry
from epp.server.body_budget import BodyBudget
from epp.server.director import Director
from epp.server.ext_proc import RequestStream
from epp.server.ext_proc_wire import MAX_CHUNK, SubsetHint, subset_hint
from epp.server.metrics import EppMetrics
from epp.tenancy import TenantSalter
from epp.testing.fakes import FakeClock
from epp.types import MetricsSnapshot

DUPLEX, BUFFERED = 4, 2
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def director(
    n: int = 2,
    config: EppConfig | None = None,
    tenancy: TenantSalter | None = None,
    decision_header: bool = False,
    clock: FakeClock | None = None,
) -> Director:
    clock = clock or FakeClock()
    ds = Datastore(clock)
    for i in range(n):
        ds.add_endpoint(f"10.0.0.{i}:80")
        ds.record_metrics(f"10.0.0.{i}:80", MetricsSnapshot(observed_at=clock.now(), waiting=100 * i))
    cost = CostModel()
    sched = build_scheduler(
        config or default_config(), default_registry(), clock, random.Random(0), services={COST_KEY: cost}
    )
    return Director(
        ds,
        sched,
        EppMetrics(),
        clock,
        {"batch": -1},
        cost=cost,
        tenancy=tenancy,
        decision_header=decision_header,
    )


def headers(
    eos: bool = False,
    mode: int = DUPLEX,
    subset: object = None,
    path: bytes = b"/v1/chat/completions",
    response_mode: int = DUPLEX,
    objective: bytes | None = None,
) -> pb.ProcessingRequest:
    """Request headers as Envoy sends them; `objective`: an `x-gateway-inference-objective` header too."""
    hm = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=path),
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        ]
    )
    if objective is not None:
        hm.headers.append(base_pb2.HeaderValue(key="x-gateway-inference-objective", raw_value=objective))
    req = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=hm, end_of_stream=eos),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=response_mode),  # type: ignore[arg-type]
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
    [h] = [x for x in common.header_mutation.set_headers if x.header.key == "x-gateway-destination-endpoint"]
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
    assert subset_hint(headers(subset=subset)) == SubsetHint(frozenset(expected))


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


SALTER = TenantSalter("x-tenant-id", b"0123456789abcdef0123")


def tenant_headers(mode: int, tenant: str | None = "acme") -> pb.ProcessingRequest:
    req = headers(mode=mode, path=b"/v1/completions")
    if tenant is not None:
        req.request_headers.headers.headers.append(
            base_pb2.HeaderValue(key="x-tenant-id", raw_value=tenant.encode())
        )
    return req


def set_header(common: pb.CommonResponse, key: str) -> str | None:
    found = [h.header.raw_value.decode() for h in common.header_mutation.set_headers if h.header.key == key]
    return found[0] if found else None


def test_tenant_salt_replaces_the_clients_and_the_length_follows_in_duplex_mode() -> None:
    s = RequestStream(director(tenancy=SALTER), 1 << 30)
    sent = json.dumps({"model": "m", "prompt": "hi", "cache_salt": "mine"}).encode()
    s.on_message(tenant_headers(DUPLEX))
    out = list(s.on_message(body(sent, True)))
    forwarded = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in out[1:])
    doc = json.loads(forwarded)
    assert doc == {"model": "m", "prompt": "hi", "cache_salt": SALTER.salt("acme")}
    assert set_header(out[0].request_headers.response, "content-length") == str(len(forwarded))
    assert s.routed is not None and s.routed.request.cache_salt == SALTER.salt("acme")


def test_tenant_salt_in_buffered_mode_rewrites_the_body_response() -> None:
    s = RequestStream(director(tenancy=SALTER), 1 << 30)
    s.on_message(tenant_headers(BUFFERED))  # a completion: its prompt is `prompt` (vLLM ignores `messages`)
    [resp] = s.on_message(body(json.dumps({"model": "m", "prompt": "hi"}).encode(), True))
    new = resp.request_body.response.body_mutation.body
    assert json.loads(new)["cache_salt"] == SALTER.salt("acme")
    assert set_header(resp.request_body.response, "content-length") == str(len(new))


def test_streamed_mode_cannot_carry_a_tenant_salt_and_says_so() -> None:
    # Refused at the headers, salt or not (tests/unit/test_ext_proc_reference.py): Envoy would route on them.
    d = director(tenancy=SALTER)
    s = RequestStream(d, 1 << 30)
    [resp] = s.on_message(tenant_headers(1))
    assert resp.immediate_response.status.code == 500
    assert b"request_body_mode STREAMED" in resp.immediate_response.body
    assert s.done and d.datastore.total_in_flight() == 0


def test_a_missing_tenant_header_is_403_when_required() -> None:
    strict = TenantSalter("x-tenant-id", b"0123456789abcdef0123", missing="reject")
    d = director(tenancy=strict)
    s = RequestStream(d, 1 << 30)
    s.on_message(tenant_headers(DUPLEX, tenant=None))
    [resp] = s.on_message(body(BODY, True))
    assert resp.immediate_response.status.code == 403
    assert b"TenantRequired" in resp.immediate_response.body
    assert d.datastore.total_in_flight() == 0


SLO_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins: [{type: ttft-scorer}]
schedulingProfiles: [{name: d, plugins: [{pluginRef: ttft-scorer}]}]
saturationDetector: {queueDepthThreshold: 100000}
admission: {ttftSlo: 0.5s}
"""


def test_slo_breach_for_a_sheddable_request_is_429_with_retry_after() -> None:
    d = director(n=1, config=parse_config(SLO_CONFIG, "slo.yaml"))
    d.datastore.record_metrics("10.0.0.0:80", MetricsSnapshot(observed_at=d.clock.now(), waiting=200))
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(objective=b"batch"))
    [resp] = s.on_message(body(BODY, True))
    ir = resp.immediate_response
    assert ir.status.code == 429
    retry = {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers}["retry-after"]
    assert 1 <= int(retry) <= 60
    assert d.datastore.total_in_flight() == 0


def response_headers(status: bytes = b"200", sse: bool = True) -> pb.ProcessingRequest:
    hs = [base_pb2.HeaderValue(key=":status", raw_value=status)]
    if sse:
        hs.append(base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream"))
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs)))


@pytest.mark.parametrize("stream", [True, False])
def test_the_prefill_backlog_moves_to_decoding_at_the_first_byte_and_streams_calibrate(stream: bool) -> None:
    clock = FakeClock()
    d = director(clock=clock, decision_header=True)
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(path=b"/v1/completions"))
    sent = json.dumps({"model": "m", "prompt": list(range(500)), "stream": stream}).encode()
    s.on_message(body(sent, True))
    assert s.routed is not None
    rec = d.datastore.get(s.routed.decision.primary)
    assert rec is not None and rec.prefill_backlog.requests == 1 and rec.prefill_backlog.tokens == 500
    [rh] = s.on_message(response_headers(sse=stream))
    explained = set_header(rh.response_headers.response, "x-epp-decision")
    assert explained is not None and explained.startswith(f"endpoint={s.routed.decision.primary}; ")
    clock.advance(0.05)
    s.on_message(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: {}\n\n", end_of_stream=False)))
    assert rec.prefill_backlog.requests == 0 and rec.decoding_requests == 1
    assert d.cost is not None
    observed = d.cost.coefficients().get("m", {}).get("observations", 0)
    assert observed == (1 if stream else 0)  # a buffered response's first byte is not its first token
    s.on_message(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)))
    assert rec.decoding_requests == 0 and rec.in_flight_requests == 0


def first_body_byte(s: RequestStream) -> None:
    s.on_message(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: {}\n\n", end_of_stream=False)))


@pytest.mark.parametrize(
    ("response_mode", "served", "observed"),
    [
        (DUPLEX, None, 1),
        (1, None, 1),  # STREAMED: chunks as they come
        (BUFFERED, None, 0),  # Envoy buffers the response: its first byte is the whole answer
        (DUPLEX, "10.0.0.0:80", 1),
        (DUPLEX, "10.0.0.9:80", 0),  # Envoy fell back to another endpoint: not the primary's estimate
    ],
)
def test_calibration_sees_only_first_bytes_that_are_first_tokens_of_the_primary(
    response_mode: int, served: str | None, observed: int
) -> None:
    d = director(n=1)
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(path=b"/v1/completions", response_mode=response_mode))
    s.on_message(body(json.dumps({"model": "m", "prompt": [1, 2, 3], "stream": True}).encode(), True))
    rh = response_headers()
    if served is not None:
        rh.metadata_context.filter_metadata["envoy.lb"].fields[
            "x-gateway-destination-endpoint-served"
        ].string_value = served
    s.on_message(rh)
    d.clock.advance(0.02)  # type: ignore[attr-defined]
    first_body_byte(s)
    assert d.cost is not None
    assert d.cost.coefficients().get("m", {}).get("observations", 0) == observed


@pytest.mark.parametrize(
    ("stream", "response_mode", "generous"),
    [
        (True, DUPLEX, True),
        (False, DUPLEX, False),
        (True, BUFFERED, False),
    ],
)
def test_requests_whose_first_byte_is_not_their_first_token_leave_the_backlog_at_their_estimate(
    stream: bool, response_mode: int, generous: bool
) -> None:
    d = director(n=1)
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(path=b"/v1/completions", response_mode=response_mode))
    s.on_message(
        body(json.dumps({"model": "m", "prompt": list(range(300)), "stream": stream}).encode(), True)
    )
    routed = s.routed
    assert routed is not None and routed.estimate is not None
    deadline = routed.ticket.first_token_by - routed.routed_at
    if generous:  # a first byte will come: wait for it, up to 4x the estimate + 0.5 s
        assert deadline == pytest.approx(4 * routed.estimate.ttft_s + 0.5)
    else:
        assert deadline == pytest.approx(routed.estimate.ttft_s)


def test_a_repeated_tenant_header_is_refused() -> None:
    d = director(tenancy=SALTER)
    s = RequestStream(d, 1 << 30)
    req = tenant_headers(DUPLEX, tenant="acme")
    req.request_headers.headers.headers.append(base_pb2.HeaderValue(key="X-Tenant-Id", raw_value=b"other"))
    s.on_message(req)
    [resp] = s.on_message(body(BODY, True))
    assert resp.immediate_response.status.code == 403
    assert b"TenantAmbiguous" in resp.immediate_response.body
    assert d.datastore.total_in_flight() == 0


@pytest.mark.parametrize("last", ["body", "headers", "trailers"])
def test_the_stream_is_done_once_the_response_has_ended_and_not_before(last: str) -> None:
    """After the response's last message the server reads no more of the stream (a read pending when
    Envoy resets it leaks native memory in grpcio's aio server: docs/operations.md, "Memory")."""
    s = RequestStream(director(), 1 << 30)
    s.on_message(headers())
    s.on_message(body(BODY, True))
    assert not s.done  # routed; the response is still to come
    rh = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    s.on_message(
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=rh, end_of_stream=last == "headers"))
    )
    assert s.done is (last == "headers")
    if last == "headers":
        return
    s.on_message(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=False)))
    assert not s.done  # more body, or trailers, may follow
    s.on_message(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=last == "body")))
    assert s.done is (last == "body")
    if last == "trailers":
        s.on_message(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
        assert s.done
    assert s.director.datastore.total_in_flight() == 0


def test_the_bodies_all_streams_hold_share_one_budget() -> None:
    """Two streams buffering bodies against a budget of 1.5 bodies: the second's chunk that would pass it
    ends that request with 503 (retry shortly); once the first has routed, its bytes are free again."""
    d = director()
    budget = BodyBudget(len(BODY) + len(BODY) // 2)
    a, b = RequestStream(d, 1 << 20, budget), RequestStream(d, 1 << 20, budget)
    for s in (a, b):
        assert list(s.on_message(headers())) == []
    assert list(a.on_message(body(BODY[:-1], False))) == []
    assert budget.held == len(BODY) - 1
    (resp,) = list(b.on_message(body(BODY, False)))
    assert resp.immediate_response.status.code == 503 and b.done
    assert b"--max-buffered-body-size" in resp.immediate_response.body
    assert budget.held == len(BODY) - 1  # b took nothing
    out = list(a.on_message(body(BODY[-1:], True)))
    assert destination(out[0]) == "10.0.0.0:80" and budget.held == 0  # routed: its body is passed on
    c = RequestStream(d, 1 << 20, budget)
    list(c.on_message(headers()))
    list(c.on_message(body(BODY[:10], False)))
    c.close()  # a client gone mid-body gives its bytes back too
    assert budget.held == 0
    a.close()
    buffered = RequestStream(d, 1 << 20, budget)  # BUFFERED: routed on the body, which Envoy keeps
    list(buffered.on_message(headers(mode=BUFFERED)))
    (routed,) = list(buffered.on_message(body(BODY, True)))
    assert routed.HasField("request_body") and budget.held == 0  # free while the response streams
    buffered.close()
    with pytest.raises(ValueError, match="budget"):
        BodyBudget(0)


def test_a_routed_request_keeps_neither_its_prompt_nor_its_new_body() -> None:
    """Once routed, what the response's lifetime needs stays (model, counts, the decision) and the parsed
    prompt and the re-encoded body go: a large chat is not held in memory until its response ends."""
    salter = TenantSalter("x-tenant-id", b"s" * 32)
    s = RequestStream(director(tenancy=salter), 1 << 30)
    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "y"}] * 5000}).encode()
    s.on_message(headers(mode=BUFFERED))
    [resp] = s.on_message(body(big, True))
    sent = resp.request_body.response.body_mutation.body
    assert json.loads(sent)["cache_salt"] == salter.salt("")  # the new body went to Envoy
    routed = s.routed
    assert routed is not None and routed.body is None
    req = routed.request
    assert req.messages is None and req.prompt is None and req.chat is None and req.tokens is None
    assert req.model == "m" and req.prompt_tokens_estimate > 0
    s.close()
    assert s.director.datastore.total_in_flight() == 0


async def test_the_body_timeout_does_not_fire_while_a_complete_body_is_tokenized() -> None:
    """A body complete and waiting for the tokenizer worker is not a stalled upload: the timer finds nothing
    to expire, no 408 is counted, and the request routes with its budget accounted once."""
    import asyncio

    class SlowTokenizing:
        def __init__(self) -> None:
            self.gate = asyncio.Event()

        def plan(self, request: object) -> None:
            return None  # to the worker

        async def tokenize(self, request: object) -> object:
            await self.gate.wait()
            return request

    d = director()
    tok = SlowTokenizing()
    d.tokenizing = tok  # type: ignore[assignment]
    budget = BodyBudget(1 << 20)
    s = RequestStream(d, 1 << 20, budget)
    list(s.on_message(headers()))
    list(s.on_message(body(BODY, True)))
    assert s.pending is not None and budget.held == len(BODY)
    routing = asyncio.create_task(s.resume())
    await asyncio.sleep(0)
    s.expire_body(60.0)  # what the timer does if it fires now
    assert not s.expired and budget.held == len(BODY)
    tok.gate.set()
    out = await routing
    assert destination(out[0]) and s.routed is not None and budget.held == 0
    assert (
        d.metrics.registry.get_sample_value(
            "epp_rejections_total", {"status": "408", "code": "RequestTimeout"}
        )
        is None
    )
    s.close()
    assert d.datastore.total_in_flight() == 0


def headers_only_pick(mode: int) -> pb.ProcessingResponse:
    """The answer to the same request when its headers carried the end of stream."""
    s = RequestStream(director(), 1 << 30)
    [resp] = s.on_message(headers(eos=True, mode=mode))
    s.close()
    return resp


def pick_of(common: pb.CommonResponse) -> tuple[dict[str, str], bool]:
    """A routing answer's headers (but the generated x-request-id's value) and its clear_route_cache."""
    found = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    assert found.pop("x-request-id")  # a request id is generated per request
    return found, common.clear_route_cache


@pytest.mark.parametrize("chunks", [[b""], [b"", b""]])
def test_an_empty_body_at_its_end_in_duplex_mode_is_routed_as_a_header_only_request(
    chunks: list[bytes],
) -> None:
    """HTTP/1.1 `transfer-encoding: chunked` with a zero-length body, or HTTP/2 ending on an empty DATA
    frame: Envoy sends the end of the request as a body message of its own. The held headers get the
    header-only pick's answer, then the empty body goes back with its end of stream."""
    d = director()
    s = RequestStream(d, 1 << 30)
    assert list(s.on_message(headers())) == []
    for chunk in chunks[:-1]:
        assert list(s.on_message(body(chunk, False))) == []
    first, echoed = s.on_message(body(chunks[-1], True))
    picked = headers_only_pick(DUPLEX)
    assert pick_of(first.request_headers.response) == pick_of(picked.request_headers.response)
    assert first.dynamic_metadata == picked.dynamic_metadata and destination(first) == "10.0.0.0:80"
    streamed = echoed.request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b"", True)
    assert s.routed is not None and s.routed.request.model == "" and s.routed.request.body_bytes == 0
    assert not s.done and d.datastore.total_in_flight() == 1
    assert (
        d.metrics.registry.get_sample_value("epp_rejections_total", {"status": "400", "code": "BadRequest"})
        is None
    )
    s.close()
    assert d.datastore.total_in_flight() == 0


def test_an_empty_body_at_its_end_in_buffered_mode_gets_the_pick_in_the_body_answer() -> None:
    """The headers were answered at once (BUFFERED): the header-only pick goes in the body's answer, with
    no body mutation (the empty body stands)."""
    d = director()
    s = RequestStream(d, 1 << 30)
    [first] = s.on_message(headers(mode=BUFFERED))
    assert (
        first.HasField("request_headers") and not first.request_headers.response.header_mutation.set_headers
    )
    [resp] = s.on_message(body(b"", True))
    picked = headers_only_pick(BUFFERED)
    assert pick_of(resp.request_body.response) == pick_of(picked.request_headers.response)
    assert resp.dynamic_metadata == picked.dynamic_metadata and destination(resp) == "10.0.0.0:80"
    assert not resp.request_body.response.HasField("body_mutation")
    assert s.routed is not None and s.routed.request.model == "" and d.datastore.total_in_flight() == 1
    s.close()
    assert d.datastore.total_in_flight() == 0


def test_an_empty_body_ended_by_trailers_is_routed_as_a_header_only_request() -> None:
    s = RequestStream(director(), 1 << 30)
    s.on_message(headers())
    assert list(s.on_message(body(b"", False))) == []
    first, echoed, trailers = s.on_message(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert pick_of(first.request_headers.response) == pick_of(
        headers_only_pick(DUPLEX).request_headers.response
    )
    streamed = echoed.request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b"", False)  # the trailers end the request
    assert trailers.HasField("request_trailers")
    assert s.routed is not None and s.routed.request.model == ""
    s.close()


@pytest.mark.parametrize("mode", [DUPLEX, BUFFERED])
def test_a_body_of_whitespace_is_not_empty_and_still_a_400_that_holds_nothing(mode: int) -> None:
    d = director()
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(mode=mode))
    [resp] = s.on_message(body(b" ", True))
    assert resp.immediate_response.status.code == 400
    assert b"not valid JSON" in resp.immediate_response.body
    assert s.done and s.routed is None and not s.body and d.datastore.total_in_flight() == 0


BUFFERED_PARTIAL = 3


def test_buffered_partial_routes_a_body_that_came_whole_as_buffered_does() -> None:
    d = director()
    s = RequestStream(d, 1 << 30, BodyBudget(1 << 20))
    [first] = s.on_message(headers(mode=BUFFERED_PARTIAL))
    assert (
        first.HasField("request_headers") and not first.request_headers.response.header_mutation.set_headers
    )
    [resp] = s.on_message(body(BODY, True))
    assert resp.HasField("request_body") and destination(resp) == "10.0.0.0:80"
    assert d.datastore.total_in_flight() == 1
    s.close()


def test_a_buffered_partial_body_without_its_end_is_413_naming_envoys_buffer_and_nothing_is_held() -> None:
    """Envoy sends a BUFFERED_PARTIAL body without its end only when the body filled its buffer (and would
    pass the rest on unread): refused for what it is, not parsed into a 400 "truncated" blaming the client."""
    d = director()
    budget = BodyBudget(1 << 20)
    s = RequestStream(d, 1 << 30, budget)
    s.on_message(headers(mode=BUFFERED_PARTIAL))
    [resp] = s.on_message(body(BODY[:20], False))
    ir = resp.immediate_response
    assert ir.status.code == 413
    message = json.loads(ir.body)["error"]["message"]
    assert message == (
        "inference error: PayloadTooLarge - request body exceeds Envoy's buffer limit under "
        "request_body_mode BUFFERED_PARTIAL (Envoy sent its first 20 bytes without the body's end, and "
        "would pass the rest on unread, so the pick cannot be made from the body): raise Envoy's buffer "
        "limit (the listener's per_connection_buffer_limit_bytes) or configure FULL_DUPLEX_STREAMED"
    )
    assert s.done and s.routed is None and not s.body and budget.held == 0
    assert d.datastore.total_in_flight() == 0
    labels = {"status": "413", "code": "PayloadTooLarge"}
    assert d.metrics.registry.get_sample_value("epp_rejections_total", labels) == 1
    # the next request on the same director is routed as usual
    other = RequestStream(d, 1 << 30, budget)
    other.on_message(headers(mode=BUFFERED_PARTIAL))
    assert destination(next(iter(other.on_message(body(BODY, True))))) == "10.0.0.0:80"
    other.close()
    assert d.datastore.total_in_flight() == 0 and budget.held == 0
