"""llm-d's current names for the request's control headers, read beside the Gateway API Inference Extension's.

llm-d/llm-d-router pkg/epp/metadata/consts.go names them `x-llm-d-inference-objective`,
`x-llm-d-inference-fairness-id` and `x-llm-d-model-name-rewrite`, keeping the `x-gateway-*` names as aliases
that `GetLowerCaseHeaderValue` reads after them: when both are sent the llm-d name wins, even with an empty
value. The Inference Extension protocol's destination, subset and served keys keep their `x-gateway-*` names
there (no aliases), so they do here. Everything goes through `RequestStream`, as Envoy's messages do."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from epp.requests import (
    FAIRNESS_HEADER,
    GIE_FAIRNESS_HEADER,
    GIE_MODEL_REWRITE_HEADER,
    GIE_OBJECTIVE_HEADER,
    MODEL_REWRITE_HEADER,
    OBJECTIVE_HEADER,
)
from epp.server.director import Director
from epp.server.ext_proc import RequestStream
from epp.server.ext_proc_wire import served_endpoint, subset_hint

from .test_ext_proc_interop import add_endpoint, error_message, forwarded_body, sample, set_headers
from .test_ext_proc_stream import BODY, body, destination, director, headers

OLD_ROUTER_SUBSET = "x-llm-d-router-destination-endpoint-subset"  # an earlier llm-d-router spelling


def sent(*pairs: tuple[str, str], eos: bool = False) -> pb.ProcessingRequest:
    req = headers(eos=eos)
    for key, value in pairs:
        req.request_headers.headers.headers.append(base_pb2.HeaderValue(key=key, raw_value=value.encode()))
    return req


def routed(
    d: Director, *pairs: tuple[str, str], doc: bytes = BODY
) -> tuple[RequestStream, list[pb.ProcessingResponse]]:
    s = RequestStream(d, 1 << 30)
    assert list(s.on_message(sent(*pairs))) == []
    return s, list(s.on_message(body(doc, True)))


# -- the objective (-> priority) -------------------------------------------------------------------


@pytest.mark.parametrize("name", [OBJECTIVE_HEADER, GIE_OBJECTIVE_HEADER, "X-LLM-D-Inference-Objective"])
def test_either_objective_name_sets_the_priority(name: str) -> None:
    d = director()  # objectives: {"batch": -1}
    s, out = routed(d, (name, "batch"))
    assert destination(out[0]) == "10.0.0.0:80"
    assert s.routed is not None
    assert s.routed.request.objective == "batch" and s.routed.request.priority == -1
    assert s.routed.request.sheddable


@pytest.mark.parametrize(
    ("llmd", "gie", "objective", "priority"),
    [
        ("batch", "other", "batch", -1),  # llm-d's name wins
        ("other", "batch", "other", 0),  # ... even naming an unknown objective
        ("", "batch", None, 0),  # ... and even empty, as the reference's GetLowerCaseHeaderValue has it
    ],
)
def test_with_both_objective_names_llmds_wins(
    llmd: str, gie: str, objective: str | None, priority: int
) -> None:
    s, out = routed(director(), (GIE_OBJECTIVE_HEADER, gie), (OBJECTIVE_HEADER, llmd))
    assert destination(out[0]) == "10.0.0.0:80"
    assert s.routed is not None
    assert (s.routed.request.objective, s.routed.request.priority) == (objective, priority)


@pytest.mark.parametrize("value", ["nope", "batch,batch"])  # unknown, or the header sent twice
def test_an_unknown_objective_under_the_llmd_name_is_priority_0_as_under_the_gie_name(value: str) -> None:
    for name in (OBJECTIVE_HEADER, GIE_OBJECTIVE_HEADER):
        d = director()
        s, out = routed(d, (name, value))
        assert destination(out[0]) == "10.0.0.0:80"  # routed, not refused
        assert s.routed is not None and s.routed.request.priority == 0 and s.routed.request.objective == value
        assert d.datastore.total_in_flight() == 1


# -- the fairness id (kept with the request; no flow control acts on it) ------------------------------


def test_both_fairness_names_are_kept_with_the_request_as_sent() -> None:
    s, out = routed(director(), (FAIRNESS_HEADER, "tenant-a"), (GIE_FAIRNESS_HEADER, "tenant-b"))
    assert destination(out[0]) == "10.0.0.0:80"
    assert s.routed is not None
    kept = s.routed.request.headers
    assert kept[FAIRNESS_HEADER] == "tenant-a" and kept[GIE_FAIRNESS_HEADER] == "tenant-b"


def test_the_llmd_names_are_kept_with_the_request_as_the_gie_names_are() -> None:
    pairs = [
        (OBJECTIVE_HEADER, "batch"),
        (MODEL_REWRITE_HEADER, "t"),
        (FAIRNESS_HEADER, "f"),
        ("x-other", "o"),
    ]
    s, _ = routed(director(), *pairs)
    assert s.routed is not None
    assert {k: v for k, v in s.routed.request.headers.items() if k.startswith("x-llm-d-")} == dict(pairs[:3])
    assert "x-other" not in s.routed.request.headers


# -- the model rewrite --------------------------------------------------------------------------------


def test_the_llmd_rewrite_name_rewrites_the_body_and_the_metrics_carry_both_models() -> None:
    d = director()
    s, out = routed(d, (MODEL_REWRITE_HEADER, "served-lora"))
    forwarded = forwarded_body(out)
    assert json.loads(forwarded) == {**json.loads(BODY), "model": "served-lora"}
    assert set_headers(out[0].request_headers.response)["content-length"] == str(len(forwarded))
    assert s.routed is not None and s.routed.request.model == "served-lora"
    labels = {"model_name": "m", "target_model_name": "served-lora"}
    assert sample(d, "inference_objective_request_total", labels) == 1


@pytest.mark.parametrize(
    ("llmd", "gie", "model"),
    [
        ("new", "old", "new"),  # llm-d's name wins
        ("", "old", "m"),  # an empty llm-d header is no rewrite, and still shadows the GIE one
        ("  ", "old", "m"),
        ("m", "old", "m"),  # a rewrite to the same model
        ("new", "a,b", "new"),  # the GIE header's copies are not looked at
    ],
)
def test_with_both_rewrite_names_llmds_wins(llmd: str, gie: str, model: str) -> None:
    d = director()
    s, out = routed(d, (GIE_MODEL_REWRITE_HEADER, gie), (MODEL_REWRITE_HEADER, llmd))
    assert destination(out[0]) == "10.0.0.0:80"
    assert json.loads(forwarded_body(out))["model"] == model
    assert s.routed is not None and s.routed.request.model == model
    labels = {"model_name": "m", "target_model_name": model}
    assert sample(d, "inference_objective_request_total", labels) == 1


@pytest.mark.parametrize(
    "pairs",
    [
        [(MODEL_REWRITE_HEADER, "a"), (MODEL_REWRITE_HEADER, "b")],  # sent twice: Envoy's copies joined
        [(MODEL_REWRITE_HEADER, "a,b")],
        [(MODEL_REWRITE_HEADER, "a,b"), (GIE_MODEL_REWRITE_HEADER, "good")],  # the winner is the bad one
        [(MODEL_REWRITE_HEADER, "a"), ("X-LLM-D-Model-Name-Rewrite", "b")],  # one name in two cases
    ],
)
def test_the_llmd_rewrite_sent_twice_is_the_same_400_naming_it_and_nothing_is_held(
    pairs: list[tuple[str, str]],
) -> None:
    d = director()
    s, [resp] = routed(d, *pairs)
    assert resp.immediate_response.status.code == 400
    assert error_message(resp) == (
        "inference error: BadRequest - header 'x-llm-d-model-name-rewrite' must name one model, once "
        "(got 'a,b')"
    )
    assert s.done and s.routed is None and not s.body and d.datastore.total_in_flight() == 0
    assert sample(d, "epp_rejections_total", {"status": "400", "code": "BadRequest"}) == 1
    # the next request on the same director, under either name, is routed as usual
    for name in (MODEL_REWRITE_HEADER, GIE_MODEL_REWRITE_HEADER):
        s, out = routed(d, (name, "a"))
        assert destination(out[0]) == "10.0.0.0:80" and json.loads(forwarded_body(out))["model"] == "a"
        s.close()
    assert d.datastore.total_in_flight() == 0


def test_a_body_without_a_valid_model_is_400_with_the_llmd_rewrite_too() -> None:
    d = director()
    s, [resp] = routed(d, (MODEL_REWRITE_HEADER, "t"), doc=json.dumps({"prompt": "x"}).encode())
    assert resp.immediate_response.status.code == 400
    assert "'model' is missing or not a non-empty string" in error_message(resp)
    assert s.routed is None and d.datastore.total_in_flight() == 0


def test_a_request_without_a_body_ignores_the_llmd_rewrite() -> None:
    s = RequestStream(director(), 1 << 30)
    [resp] = s.on_message(sent((MODEL_REWRITE_HEADER, "a,b"), eos=True))
    assert destination(resp) == "10.0.0.0:80"
    assert "content-length" not in set_headers(resp.request_headers.response)


# -- what is sent, and the protocol's keys, keep the GIE names ---------------------------------------


def test_the_answer_names_the_endpoint_under_the_protocols_names_only() -> None:
    _, out = routed(director(), (OBJECTIVE_HEADER, "batch"), (MODEL_REWRITE_HEADER, "t"))
    keys = set(set_headers(out[0].request_headers.response))
    assert keys == {"x-gateway-destination-endpoint", "content-length", "x-request-id"}
    assert set(out[0].dynamic_metadata.fields) == {"envoy.lb"}
    assert set(out[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields) == {
        "x-gateway-destination-endpoint"
    }


def test_the_subset_hint_and_the_served_endpoint_are_read_under_the_protocols_keys_only() -> None:
    d = director()
    add_endpoint(d, "10.0.0.5:80", waiting=500)
    req = sent()
    hint = struct_pb2.Struct()
    hint.update({OLD_ROUTER_SUBSET: ["10.0.0.5:80"]})
    req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    assert subset_hint(req) is None  # no hint: every endpoint is a candidate
    s = RequestStream(d, 1 << 30)
    s.on_message(req)
    assert destination(next(iter(s.on_message(body(BODY, True))))) == "10.0.0.0:80"
    served = pb.ProcessingRequest()
    served.metadata_context.filter_metadata["envoy.lb"].update(
        {"x-llm-d-router-destination-endpoint-served": "10.0.0.1:80"}
    )
    assert served_endpoint(served) is None
    served.metadata_context.filter_metadata["envoy.lb"].update(
        {"x-gateway-destination-endpoint-served": "10.0.0.1:80"}
    )
    assert served_endpoint(served) == "10.0.0.1:80"


# llm-d/llm-d-router PR #1161 before review (commit 29cd704): renamed x-llm-d-* before it merged
DRAFT_NAMES = (
    ("x-llm-d-router-inference-objective", "batch"),
    ("x-llm-d-router-model-name-rewrite", "served-lora"),
)


def test_the_draft_router_names_are_not_read_and_the_current_ones_still_win() -> None:
    d = director()
    s, out = routed(d, *DRAFT_NAMES)
    assert destination(out[0]) == "10.0.0.0:80"
    assert s.routed is not None
    assert (s.routed.request.objective, s.routed.request.priority, s.routed.request.model) == (None, 0, "m")
    assert json.loads(forwarded_body(out))["model"] == "m"
    s, out = routed(d, *DRAFT_NAMES, (OBJECTIVE_HEADER, ""), (GIE_OBJECTIVE_HEADER, "batch"))
    assert s.routed is not None and s.routed.request.objective is None  # llm-d's name, empty, still wins
