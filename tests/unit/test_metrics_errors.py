"""`inference_objective_request_error_total` as the reference counts it: `ModelServerError` for any
model server error, and the EPP's own refusals under the request's model with the EPP's code."""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.server.director import Director
from epp.server.ext_proc import RequestStream
from epp.types import MetricsSnapshot

from .test_ext_proc_interop import with_headers
from .test_ext_proc_stream import BODY, body, director, headers, response_headers

ERRORS = "inference_objective_request_error_total"


def error_series(d: Director) -> dict[tuple[str, str, str], float]:
    return {
        (s.labels["model_name"], s.labels["target_model_name"], s.labels["error_code"]): s.value
        for fam in d.metrics.registry.collect()
        for s in fam.samples
        if s.name == ERRORS
    }


def rejections(d: Director, status: str, code: str) -> float | None:
    return d.metrics.registry.get_sample_value("epp_rejections_total", {"status": status, "code": code})


def send(d: Director, raw: bytes = BODY, *extra: tuple[str, str]) -> list[pb.ProcessingResponse]:
    s = RequestStream(d, 1 << 30)
    req = headers()
    for key, value in extra:
        req.request_headers.headers.headers.append(base_pb2.HeaderValue(key=key, raw_value=value.encode()))
    s.on_message(req)
    return list(s.on_message(body(raw, True)))


def test_any_model_server_status_is_model_server_error_and_its_status_is_kept_per_endpoint() -> None:
    d = director(n=1)
    for status in (b"503", b"500", b"429"):
        s = RequestStream(d, 1 << 30)
        s.on_message(headers())
        s.on_message(body(BODY, True))
        s.on_message(response_headers(status))
        s.close()
    assert error_series(d) == {("m", "m", "ModelServerError"): 3}
    sample = d.metrics.registry.get_sample_value
    for status in ("503", "500", "429"):
        assert sample("epp_backend_errors_total", {"endpoint": "10.0.0.0:80", "status": status}) == 1


def test_no_endpoint_is_counted_under_the_model_as_service_unavailable() -> None:
    d = director(n=0)
    [resp] = send(d)
    assert resp.immediate_response.status.code == 503
    assert error_series(d) == {("m", "m", "ServiceUnavailable"): 1}
    assert rejections(d, "503", "ServiceUnavailable") == 1


def test_a_shed_request_is_counted_under_the_model_as_resource_exhausted() -> None:
    d = director(n=1)
    d.datastore.record_metrics("10.0.0.0:80", MetricsSnapshot(observed_at=d.clock.now(), waiting=10_000))
    [resp] = send(d, BODY, ("x-gateway-inference-objective", "batch"))
    assert resp.immediate_response.status.code == 429
    assert error_series(d) == {("m", "m", "InferencePoolResourceExhausted"): 1}
    assert rejections(d, "429", "InferencePoolResourceExhausted") == 1


def test_a_refused_rewritten_request_is_counted_under_the_client_and_target_models() -> None:
    d = director(n=0)
    s = RequestStream(d, 1 << 30)
    s.on_message(with_headers(headers(), **{"x-gateway-model-name-rewrite": "m-v2"}))
    s.on_message(body(BODY, True))
    assert error_series(d) == {("m", "m-v2", "ServiceUnavailable"): 1}


def test_a_request_refused_before_its_model_is_known_is_only_a_rejection() -> None:
    d = director(n=1)
    [resp] = send(d, b"{not json")
    assert resp.immediate_response.status.code == 400
    [resp] = send(d, json.dumps({"messages": []}).encode())  # no model
    assert resp.immediate_response.status.code == 400
    assert error_series(d) == {}
    assert rejections(d, "400", "BadRequest") == 2
