"""The ext_proc answers against the reference EPP's (Gateway API Inference Extension, its handlers now in
llm-d/llm-d-router): the destination's header and `envoy.lb` metadata, fallbacks, the subset hint, the error
body, and the request body modes Envoy routes on the headers in (STREAMED, NONE), which the EPP refuses.
Messages are fed to the state machine directly (no network)."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.config import parse_config
from epp.server.ext_proc import RequestStream
from tests.support.configs import FALLBACKS

from .test_ext_proc_stream import BODY, BUFFERED, DUPLEX, body, destination, director, headers

STREAMED, NONE = 1, 0
DEST = "x-gateway-destination-endpoint"


def error_of(resp: pb.ProcessingResponse) -> dict[str, object]:
    doc = json.loads(resp.immediate_response.body)
    assert isinstance(doc, dict)
    err = doc["error"]
    assert isinstance(err, dict)
    return err


def test_the_destination_is_one_overwriting_header_and_the_same_envoy_lb_metadata() -> None:
    s = RequestStream(director(), 1 << 30)
    s.on_message(headers())
    out = list(s.on_message(body(BODY, True)))
    common = out[0].request_headers.response
    assert common.clear_route_cache
    [h] = [x for x in common.header_mutation.set_headers if x.header.key == DEST]
    # A client-sent copy of the header is replaced, never appended to.
    assert h.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert set(out[0].dynamic_metadata.fields) == {"envoy.lb"}
    assert destination(out[0]) == "10.0.0.0:80"
    # The body is unchanged, so its content-length stands (the reference re-sends its re-encoded body
    # and sets one; a changed body gets one here too: test_ext_proc_stream's tenant tests). The request
    # came without an x-request-id: the one the EPP generated goes with it (test_ext_proc_interop.py).
    keys = [x.header.key for x in common.header_mutation.set_headers]
    assert keys == [DEST, "x-request-id"]


def test_fallbacks_follow_the_primary_comma_joined_without_spaces() -> None:
    d = director(n=3, config=parse_config(FALLBACKS, "fallbacks.yaml"))
    s = RequestStream(d, 1 << 30)
    s.on_message(headers())
    out = list(s.on_message(body(BODY, True)))
    assert destination(out[0]) == "10.0.0.0:80,10.0.0.1:80,10.0.0.2:80"  # least waiting first


@pytest.mark.parametrize(("subset", "expected"), [(None, "10.0.0.0:80"), (["10.0.0.1:80"], "10.0.0.1:80")])
def test_without_a_hint_every_endpoint_is_a_candidate_and_a_hint_restricts(
    subset: list[str] | None, expected: str
) -> None:
    s = RequestStream(director(), 1 << 30)
    s.on_message(headers(subset=subset))
    first, *_ = s.on_message(body(BODY, True))
    assert destination(first) == expected


def test_a_subset_namespace_without_the_key_is_no_hint() -> None:
    req = headers()
    req.metadata_context.filter_metadata["envoy.lb.subset_hint"].update({"other": ["10.0.0.1:80"]})
    s = RequestStream(director(), 1 << 30)
    s.on_message(req)
    assert s.subset is None
    first, *_ = s.on_message(body(BODY, True))
    assert destination(first) == "10.0.0.0:80"


def test_an_empty_subset_hint_is_503_service_unavailable_as_in_the_reference() -> None:
    d = director()
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(subset=[]))
    [resp] = s.on_message(body(BODY, True))
    assert resp.immediate_response.status.code == 503
    err = error_of(resp)
    assert err["type"] == "ServiceUnavailable" and err["code"] == 503
    assert str(err["message"]).startswith("inference error: ServiceUnavailable - ")  # the reference's text
    assert d.datastore.total_in_flight() == 0


def test_a_bad_body_is_400_bad_request_in_the_references_words() -> None:
    s = RequestStream(director(), 1 << 30)
    s.on_message(headers())
    [resp] = s.on_message(body(b"not json", True))
    assert resp.immediate_response.status.code == 400
    assert str(error_of(resp)["message"]).startswith("inference error: BadRequest - ")


@pytest.mark.parametrize(("mode", "name"), [(STREAMED, "STREAMED"), (NONE, "NONE")])
def test_a_body_in_a_mode_envoy_routes_on_the_headers_in_is_refused_at_the_headers(
    mode: int, name: str
) -> None:
    """Envoy passes the headers to the router as soon as they are answered in these modes (checked with
    real Envoy: tests/integration/test_ext_proc_reference.py): an answer without the pick would send the
    request to no endpoint, or to the endpoint a client-sent destination header names."""
    d = director()
    s = RequestStream(d, 1 << 30)
    [resp] = s.on_message(headers(mode=mode))
    assert resp.immediate_response.status.code == 500
    err = error_of(resp)
    assert err["type"] == "Internal"
    message = str(err["message"])
    assert f"request_body_mode {name} is not supported" in message
    assert "FULL_DUPLEX_STREAMED" in message and "BUFFERED" in message
    assert s.done and s.routed is None and d.datastore.total_in_flight() == 0
    rejected = d.metrics.registry.get_sample_value(
        "epp_rejections_total", {"status": "500", "code": "Internal"}
    )
    assert rejected == 1


@pytest.mark.parametrize("mode", [STREAMED, NONE, BUFFERED, DUPLEX])
def test_a_request_without_a_body_is_picked_at_its_headers_in_every_mode(mode: int) -> None:
    s = RequestStream(director(), 1 << 30)
    [resp] = s.on_message(headers(eos=True, mode=mode))
    assert resp.HasField("request_headers") and destination(resp) == "10.0.0.0:80"
    assert not s.done and s.routed is not None
    s.close()


def test_buffered_mode_still_answers_the_headers_at_once_and_routes_on_the_body() -> None:
    s = RequestStream(director(), 1 << 30)
    [first] = s.on_message(headers(mode=BUFFERED))
    assert (
        first.HasField("request_headers") and not first.request_headers.response.header_mutation.set_headers
    )
    [resp] = s.on_message(body(BODY, True))
    assert destination(resp) == "10.0.0.0:80"
