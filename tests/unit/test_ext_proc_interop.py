"""Three interop points with the reference EPP (Gateway API Inference Extension's EPP, its handlers now in
llm-d/llm-d-router), checked on the ext_proc answers:

- `x-request-id`: a request that came without one is forwarded with the id the EPP generated (the reference:
  llm-d/llm-d-router pkg/epp/handlers/server.go generates it, pkg/epp/handlers/request.go `generateHeaders`
  sets it in the header mutation).
- the subset hint's entries: `ip:port` or a bare IP (every endpoint on that IP, as the reference's
  pkg/epp/requestcontrol/candidates.go `Locate` accepts); malformed entries allow nothing and are named.
- `x-gateway-model-name-rewrite`: the body's `model` becomes the header's (the reference:
  pkg/epp/requestcontrol/director.go `modelRewriteIfNeeded`), the request is scheduled for it, and the
  metrics carry both names. llm-d's current names for it and the objective (`x-llm-d-*`, winning over the
  GIE names) are in test_llmd_headers.py; one gRPC test here sends them.

Most tests feed the state machine directly; the `grpc` ones run a real gRPC server on port 0."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.datastore import Datastore
from epp.server.director import Director
from epp.server.ext_proc import ExtProcService, RequestStream
from epp.server.ext_proc_wire import MAX_CHUNK, SubsetHint, subset_entry, subset_hint
from epp.testing.fakes import FakeClock
from epp.testing.wait import eventually
from epp.types import InferenceRequest, MetricsSnapshot

from .test_ext_proc_stream import BODY, BUFFERED, SALTER, body, destination, director, headers

REQUEST_ID = "x-request-id"
REWRITE = "x-gateway-model-name-rewrite"


def with_headers(req: pb.ProcessingRequest, **extra: str) -> pb.ProcessingRequest:
    for key, value in extra.items():
        req.request_headers.headers.headers.append(
            base_pb2.HeaderValue(key=key.replace("_", "-"), raw_value=value.encode())
        )
    return req


def set_headers(common: pb.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def error_message(resp: pb.ProcessingResponse) -> str:
    return str(json.loads(resp.immediate_response.body)["error"]["message"])


def forwarded_body(out: list[pb.ProcessingResponse]) -> bytes:
    return b"".join(r.request_body.response.body_mutation.streamed_response.body for r in out[1:])


def sample(d: Director, name: str, labels: dict[str, str]) -> float | None:
    return d.metrics.registry.get_sample_value(name, labels)


def add_endpoint(d: Director, endpoint: str, waiting: int = 0) -> None:
    ds: Datastore = d.datastore
    ds.add_endpoint(endpoint)
    ds.record_metrics(endpoint, MetricsSnapshot(observed_at=d.clock.now(), waiting=waiting))


# -- x-request-id ---------------------------------------------------------------------------------


def test_a_request_without_an_id_is_forwarded_with_the_one_the_epp_generated() -> None:
    s = RequestStream(director(), 1 << 30)
    s.on_message(headers())
    out = list(s.on_message(body(BODY, True)))
    common = out[0].request_headers.response
    assert s.routed is not None
    generated = s.routed.request.request_id
    assert uuid.UUID(generated).version == 4
    [h] = [x for x in common.header_mutation.set_headers if x.header.key == REQUEST_ID]
    assert h.header.raw_value.decode() == generated
    assert h.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    # the rest of the answer is as before: the destination in header and metadata, the body echoed
    assert destination(out[0]) == "10.0.0.0:80" and common.clear_route_cache
    assert forwarded_body(out) == BODY


def test_a_client_sent_id_is_kept_and_not_set_again() -> None:
    s = RequestStream(director(), 1 << 30)
    s.on_message(with_headers(headers(), x_request_id="client-id-1"))
    out = list(s.on_message(body(BODY, True)))
    assert REQUEST_ID not in set_headers(out[0].request_headers.response)
    assert s.routed is not None and s.routed.request.request_id == "client-id-1"


def test_an_empty_client_id_counts_as_none_and_gets_a_generated_one() -> None:
    s = RequestStream(director(), 1 << 30)
    s.on_message(with_headers(headers(), x_request_id=""))
    out = list(s.on_message(body(BODY, True)))
    sent = set_headers(out[0].request_headers.response)[REQUEST_ID]
    assert s.routed is not None and sent == s.routed.request.request_id and sent


def test_each_request_gets_its_own_id() -> None:
    d = director()
    ids = []
    for _ in range(3):
        s = RequestStream(d, 1 << 30)
        s.on_message(headers())
        out = list(s.on_message(body(BODY, True)))
        ids.append(set_headers(out[0].request_headers.response)[REQUEST_ID])
        s.close()
    assert len(set(ids)) == 3


def test_the_id_goes_with_the_body_answer_in_buffered_mode_and_the_headers_answer_without_a_body() -> None:
    s = RequestStream(director(), 1 << 30)
    s.on_message(headers(mode=BUFFERED))
    [resp] = s.on_message(body(BODY, True))
    assert s.routed is not None
    assert set_headers(resp.request_body.response)[REQUEST_ID] == s.routed.request.request_id
    s = RequestStream(director(), 1 << 30)
    [resp] = s.on_message(headers(eos=True))
    assert s.routed is not None
    assert set_headers(resp.request_headers.response)[REQUEST_ID] == s.routed.request.request_id


def test_a_refused_request_gets_no_request_id_header() -> None:
    """The reference answers an error with its immediate response alone; so does this EPP."""
    s = RequestStream(director(), 1 << 30)
    s.on_message(headers())
    [resp] = s.on_message(body(b"not json", True))
    assert resp.immediate_response.status.code == 400
    assert REQUEST_ID not in set_headers(pb.CommonResponse(header_mutation=resp.immediate_response.headers))


# -- the subset hint -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "normalised"),
    [
        ("10.0.0.1:80", "10.0.0.1:80"),
        (" 10.0.0.1:080 ", "10.0.0.1:80"),
        ("10.0.0.1", "10.0.0.1"),
        ("fd00::1", "[fd00::1]"),
        ("[FD00:0::1]", "[fd00::1]"),
        ("[fd00::1]:8000", "[fd00::1]:8000"),
        ("fd00::80", "[fd00::80]"),  # a bare address, read whole: not fd00: port 80
        ("pod-1:80", None),
        ("pod-1", None),
        ("10.0.0.1:http", None),
        ("10.0.0.1:0", None),
        ("10.0.0.1:70000", None),
        ("10.0.0.256", None),
        ("[fd00::1]:", None),
        (":80", None),
        ("[10.0.0.1]:80x", None),
    ],
)
def test_a_subset_entry_is_ip_port_or_a_bare_ip_normalised_as_endpoint_ids_are(
    entry: str, normalised: str | None
) -> None:
    assert subset_entry(entry) == normalised


def test_a_bare_ip_allows_every_endpoint_on_it_and_an_ip_port_only_that_endpoint() -> None:
    clock = FakeClock()
    ds = Datastore(clock)
    for ep in ("10.0.0.1:80", "10.0.0.1:81", "10.0.0.2:80", "[fd00::1]:80", "[fd00::1]:81"):
        ds.add_endpoint(ep)
    assert {e.id for e in ds.candidates({"10.0.0.1"})} == {"10.0.0.1:80", "10.0.0.1:81"}
    assert {e.id for e in ds.candidates({"10.0.0.1:81"})} == {"10.0.0.1:81"}
    assert {e.id for e in ds.candidates({"[fd00::1]", "10.0.0.2:80"})} == {
        "[fd00::1]:80",
        "[fd00::1]:81",
        "10.0.0.2:80",
    }
    assert ds.candidates({"10.0.0.3"}) == [] and ds.candidates({"10.0.0.1:82"}) == []


@pytest.mark.parametrize(
    ("hint", "allowed"),
    [
        (["10.0.0.1"], {"10.0.0.1"}),
        ("10.0.0.1", {"10.0.0.1"}),
        (["10.0.0.1", "10.9.9.9:80"], {"10.0.0.1", "10.9.9.9:80"}),
    ],
)
def test_a_request_with_a_bare_ip_hint_is_routed_to_an_endpoint_on_that_ip(
    hint: object, allowed: set[str]
) -> None:
    d = director()  # 10.0.0.0:80 (idle), 10.0.0.1:80 (100 waiting)
    add_endpoint(d, "10.0.0.1:81", waiting=50)
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(subset=hint))
    out = list(s.on_message(body(BODY, True)))
    assert destination(out[0]) == "10.0.0.1:81"  # the least loaded of 10.0.0.1's, never 10.0.0.0
    assert s.subset == SubsetHint(frozenset(allowed))


def test_a_port_in_the_hint_is_held_to() -> None:
    d = director()
    add_endpoint(d, "10.0.0.1:81", waiting=50)
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(subset=["10.0.0.1:80"]))
    out = list(s.on_message(body(BODY, True)))
    assert destination(out[0]) == "10.0.0.1:80"  # 10.0.0.1:81 is less loaded but not allowed


def test_malformed_entries_beside_good_ones_are_ignored_and_logged_at_most_every_30s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    d = director(clock=clock)

    def route() -> str:
        s = RequestStream(d, 1 << 30)
        s.on_message(headers(subset=["bogus", 12, "10.0.0.1:80", "pod:80"]))
        out = list(s.on_message(body(BODY, True)))
        assert s.subset is not None and s.subset.malformed == ("12.0", "bogus", "pod:80")
        s.close()
        return destination(out[0])

    with caplog.at_level(logging.WARNING, logger="epp.director"):
        assert route() == "10.0.0.1:80"  # nothing lost: the good entry routes
        assert route() == "10.0.0.1:80"
        clock.advance(30)
        add_endpoint(d, "10.0.0.1:80")  # fresh metrics again (a stale endpoint is filtered out)
        assert route() == "10.0.0.1:80"
    warnings = [r.getMessage() for r in caplog.records if r.name == "epp.director"]
    assert len(warnings) == 2
    assert "'bogus'" in warnings[0] and "'12.0'" in warnings[0] and "'pod:80'" in warnings[0]
    assert "(0 more requests" in warnings[0] and "(1 more requests" in warnings[1]
    assert d.datastore.total_in_flight() == 0


@pytest.mark.parametrize(
    ("hint", "named"),
    [
        (["pod-1:80"], "'pod-1:80'"),
        ("pod-1:80, ,", "'pod-1:80'"),
        ([True, None], "'true', 'null'"),
        (5, "'5.0'"),
        ({"ip": "10.0.0.1"}, '\'{"ip": "10.0.0.1"}\''),
    ],
)
def test_a_hint_of_malformed_entries_only_is_503_naming_them(hint: object, named: str) -> None:
    d = director()
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(subset=hint))
    [resp] = s.on_message(body(BODY, True))
    assert resp.immediate_response.status.code == 503
    message = error_message(resp)
    assert message.startswith("inference error: ServiceUnavailable - no eligible endpoint")
    assert f"neither ip:port nor an IP, ignored: {named})" in message
    assert s.done and d.datastore.total_in_flight() == 0
    assert sample(d, "epp_rejections_total", {"status": "503", "code": "ServiceUnavailable"}) == 1


def test_many_or_long_malformed_entries_are_named_briefly() -> None:
    s = RequestStream(director(), 1 << 30)
    s.on_message(headers(subset=[f"bad{i}" for i in range(7)] + ["x" * 500]))
    [resp] = s.on_message(body(BODY, True))
    message = error_message(resp)
    assert "'bad0', 'bad1', 'bad2', 'bad3', 'bad4' and 3 more)" in message
    assert s.subset is not None and s.subset.malformed[-1] == "x" * 61 + "..."
    assert "x" * 62 not in message and len(message) < 400


def test_an_ineligible_hint_without_malformed_entries_says_nothing_about_them() -> None:
    s = RequestStream(director(), 1 << 30)
    s.on_message(headers(subset=["10.9.9.9"]))
    [resp] = s.on_message(body(BODY, True))
    assert resp.immediate_response.status.code == 503
    assert "ignored" not in error_message(resp)


def test_subset_hint_keeps_empty_items_out_and_reports_the_rest() -> None:
    assert subset_hint(headers(subset=["", " 10.0.0.1 ", "x"])) == SubsetHint(frozenset({"10.0.0.1"}), ("x",))


# -- x-gateway-model-name-rewrite ----------------------------------------------------------------


def test_the_rewrite_header_replaces_the_bodys_model_and_the_length_follows() -> None:
    d = director()
    s = RequestStream(d, 1 << 30)
    sent = {"model": "public", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    s.on_message(with_headers(headers(), x_gateway_model_name_rewrite="served-lora"))
    out = list(s.on_message(body(json.dumps(sent).encode(), True)))
    forwarded = forwarded_body(out)
    assert json.loads(forwarded) == {**sent, "model": "served-lora"}
    assert set_headers(out[0].request_headers.response)["content-length"] == str(len(forwarded))
    assert destination(out[0]) == "10.0.0.0:80"
    assert s.routed is not None and s.routed.request.model == "served-lora"  # scheduled for the target
    labels = {"model_name": "public", "target_model_name": "served-lora"}
    assert sample(d, "inference_objective_request_total", labels) == 1
    assert sample(d, "inference_objective_running_requests", {"model_name": "public"}) == 1
    s.close()
    assert sample(d, "inference_objective_running_requests", {"model_name": "public"}) == 0
    assert sample(d, "inference_objective_request_duration_seconds_count", labels) == 1


def test_the_rewrite_in_buffered_mode_is_the_body_responses_body() -> None:
    s = RequestStream(director(), 1 << 30)
    s.on_message(with_headers(headers(mode=BUFFERED), x_gateway_model_name_rewrite="t"))
    [resp] = s.on_message(body(BODY, True))
    new = resp.request_body.response.body_mutation.body
    assert json.loads(new) == {**json.loads(BODY), "model": "t"}
    assert set_headers(resp.request_body.response)["content-length"] == str(len(new))


def test_a_large_rewritten_body_is_sent_back_in_chunks() -> None:
    s = RequestStream(director(), 1 << 30)
    sent = json.dumps({"model": "m", "messages": [{"role": "user", "content": "y" * (2 * MAX_CHUNK)}]})
    s.on_message(with_headers(headers(), x_gateway_model_name_rewrite="t"))
    out = list(s.on_message(body(sent.encode(), True)))
    chunks = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert len(chunks) == 3 and all(len(c.body) <= MAX_CHUNK for c in chunks)
    assert [c.end_of_stream for c in chunks] == [False, False, True]
    assert json.loads(b"".join(c.body for c in chunks))["model"] == "t"


@pytest.mark.parametrize("value", ["m", "", "   "])
def test_a_rewrite_to_the_same_model_or_an_empty_one_leaves_the_body_alone(value: str) -> None:
    d = director()
    s = RequestStream(d, 1 << 30)
    s.on_message(with_headers(headers(), x_gateway_model_name_rewrite=value))
    out = list(s.on_message(body(BODY, True)))
    assert forwarded_body(out) == BODY
    assert "content-length" not in set_headers(out[0].request_headers.response)
    assert sample(d, "inference_objective_request_total", {"model_name": "m", "target_model_name": "m"}) == 1


def test_the_rewrite_header_sent_twice_is_400_and_nothing_is_held() -> None:
    d = director()
    s = RequestStream(d, 1 << 30)
    req = with_headers(headers(), x_gateway_model_name_rewrite="a")
    s.on_message(with_headers(req, x_gateway_model_name_rewrite="b"))
    [resp] = s.on_message(body(BODY, True))
    assert resp.immediate_response.status.code == 400
    assert error_message(resp) == (
        "inference error: BadRequest - header 'x-gateway-model-name-rewrite' must name one model, once "
        "(got 'a,b')"
    )
    assert s.done and s.routed is None and not s.body and d.datastore.total_in_flight() == 0
    assert sample(d, "epp_rejections_total", {"status": "400", "code": "BadRequest"}) == 1
    # the next request on the same director is routed as usual
    s = RequestStream(d, 1 << 30)
    s.on_message(with_headers(headers(), x_gateway_model_name_rewrite="a"))
    first, *_ = s.on_message(body(BODY, True))
    assert destination(first) == "10.0.0.0:80"


@pytest.mark.parametrize(
    "doc", [{"messages": [{"role": "user", "content": "hi"}]}, {"model": 7, "prompt": "x"}]
)
def test_a_body_without_a_valid_model_is_400_even_with_the_rewrite_header(doc: dict[str, object]) -> None:
    d = director()
    s = RequestStream(d, 1 << 30)
    s.on_message(with_headers(headers(), x_gateway_model_name_rewrite="t"))
    [resp] = s.on_message(body(json.dumps(doc).encode(), True))
    assert resp.immediate_response.status.code == 400
    assert "'model' is missing or not a non-empty string" in error_message(resp)
    assert d.datastore.total_in_flight() == 0


def test_a_request_without_a_body_ignores_the_rewrite_header() -> None:
    s = RequestStream(director(), 1 << 30)
    [resp] = s.on_message(with_headers(headers(eos=True), x_gateway_model_name_rewrite="t"))
    assert destination(resp) == "10.0.0.0:80"
    assert "content-length" not in set_headers(resp.request_headers.response)


def test_the_rewrite_and_the_tenant_salt_are_both_in_the_forwarded_body() -> None:
    s = RequestStream(director(tenancy=SALTER), 1 << 30)
    req = with_headers(headers(), x_gateway_model_name_rewrite="t", x_tenant_id="acme")
    s.on_message(req)
    out = list(s.on_message(body(BODY, True)))
    doc = json.loads(forwarded_body(out))
    assert doc["model"] == "t" and doc["cache_salt"] == SALTER.salt("acme")


class _SlowTokenizing:
    """Sends every prompt through `RequestStream.resume`, as a long prompt goes."""

    def plan(self, request: InferenceRequest) -> InferenceRequest | None:
        return None

    async def tokenize(self, request: InferenceRequest) -> InferenceRequest:
        return request


async def test_the_rewrite_survives_a_prompt_tokenized_in_the_worker() -> None:
    d = director()
    d.tokenizing = _SlowTokenizing()  # type: ignore[assignment]
    s = RequestStream(d, 1 << 30)
    s.on_message(with_headers(headers(), x_gateway_model_name_rewrite="t"))
    assert list(s.on_message(body(BODY, True))) == [] and s.pending is not None
    out = list(await s.resume())
    assert json.loads(forwarded_body(out))["model"] == "t"
    labels = {"model_name": "m", "target_model_name": "t"}
    assert sample(d, "inference_objective_request_total", labels) == 1


# -- through a real gRPC server --------------------------------------------------------------------


@pytest.fixture
async def stub() -> AsyncIterator[tuple[pb_grpc.ExternalProcessorStub, Director]]:
    d = director()
    add_endpoint(d, "10.0.0.1:81", waiting=50)
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(ExtProcService(d, 1 << 20), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.ExternalProcessorStub(channel), d
    finally:
        await channel.close()
        await server.stop(None)


async def exchange(
    stub: pb_grpc.ExternalProcessorStub, msgs: list[pb.ProcessingRequest], answers: int
) -> list[pb.ProcessingResponse]:
    call = stub.Process()
    for msg in msgs:
        await call.write(msg)
    out = [await call.read() for _ in range(answers)]
    call.cancel()  # as Envoy resets the stream
    return out


async def test_grpc_request_id_subset_ip_and_model_rewrite_in_one_answer(
    stub: tuple[pb_grpc.ExternalProcessorStub, Director],
) -> None:
    client, d = stub
    req = with_headers(headers(subset=["10.0.0.1"]), x_gateway_model_name_rewrite="served")
    out = await exchange(client, [req, body(BODY, True)], answers=2)
    common = out[0].request_headers.response
    sent = set_headers(common)
    assert destination(out[0]) == "10.0.0.1:81"
    assert uuid.UUID(sent[REQUEST_ID]).version == 4
    forwarded = out[1].request_body.response.body_mutation.streamed_response
    assert forwarded.end_of_stream and json.loads(forwarded.body)["model"] == "served"
    assert sent["content-length"] == str(len(forwarded.body))
    labels = {"model_name": "m", "target_model_name": "served"}
    assert sample(d, "inference_objective_request_total", labels) == 1


async def test_grpc_a_malformed_hint_is_503_and_the_next_stream_is_served(
    stub: tuple[pb_grpc.ExternalProcessorStub, Director],
) -> None:
    client, d = stub
    [resp] = await exchange(client, [headers(subset=["pod-1:80"]), body(BODY, True)], answers=1)
    assert d.datastore.total_in_flight() == 0
    assert resp.immediate_response.status.code == 503
    assert "ignored: 'pod-1:80')" in error_message(resp)
    out = await exchange(client, [with_headers(headers(), x_request_id="mine"), body(BODY, True)], answers=2)
    assert destination(out[0]) == "10.0.0.0:80"
    assert REQUEST_ID not in set_headers(out[0].request_headers.response)


async def test_grpc_llmds_rewrite_name_wins_and_its_bad_value_is_the_same_400(
    stub: tuple[pb_grpc.ExternalProcessorStub, Director],
) -> None:
    client, d = stub
    req = with_headers(
        headers(),
        x_llm_d_model_name_rewrite="served",
        x_gateway_model_name_rewrite="other",
        x_llm_d_inference_objective="batch",
    )
    out = await exchange(client, [req, body(BODY, True)], answers=2)
    assert destination(out[0]) in {"10.0.0.0:80", "10.0.0.1:81"}
    forwarded = out[1].request_body.response.body_mutation.streamed_response
    assert json.loads(forwarded.body)["model"] == "served"
    labels = {"model_name": "m", "target_model_name": "served"}
    assert sample(d, "inference_objective_request_total", labels) == 1
    [bad] = await exchange(
        client, [with_headers(headers(), x_llm_d_model_name_rewrite="a,b"), body(BODY, True)], answers=1
    )
    assert bad.immediate_response.status.code == 400
    assert "header 'x-llm-d-model-name-rewrite' must name one model, once (got 'a,b')" in error_message(bad)


@pytest.mark.parametrize("end", ["half-close", "cancel"])
async def test_grpc_a_stream_ending_before_any_response_message_under_body_none_is_unobserved(
    stub: tuple[pb_grpc.ExternalProcessorStub, Director], end: str
) -> None:
    """response_header_mode SKIP with response_body_mode NONE: Envoy sends nothing of the response, and
    ends the stream (a half-close, then a reset) once the HTTP request is over, completed or not. The
    grpc server sees the request messages end either way: the request is released as `unobserved`."""
    client, d = stub
    call = client.Process()
    await call.write(headers(response_mode=0))
    await call.write(body(BODY, True))
    out = [await call.read(), await call.read()]
    assert destination(out[0]) and d.datastore.total_in_flight() == 1
    if end == "half-close":
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF  # the server ends the call itself
    else:
        call.cancel()
    await eventually(lambda: d.datastore.total_in_flight() == 0, "released")
    causes = ("complete", "error", "disconnect", "unobserved")
    released = {c: sample(d, "epp_requests_released_total", {"cause": c}) for c in causes}
    assert released == {c: (1 if c == "unobserved" else None) for c in causes}
