"""The reference EPP's size, NTPOT, per-pod queue and build metrics: what each observes, and when not."""

from __future__ import annotations

import json

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry, generate_latest

import epp
from epp.server.director import Director
from epp.server.ext_proc import RequestStream
from epp.server.metrics import EppMetrics
from epp.testing.fakes import FakeClock

from .test_ext_proc_stream import BODY, body, director, headers, response_headers

MODEL = {"model_name": "m", "target_model_name": "m"}
NONE = 0  # response_body_mode NONE


def sample(d: Director, name: str, labels: dict[str, str] | None = None) -> float | None:
    return d.metrics.registry.get_sample_value(name, labels or {})


def chunk(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=eos))


def usage_event(completion: int) -> bytes:
    usage = {"prompt_tokens": 10, "completion_tokens": completion, "total_tokens": 10 + completion}
    return b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n"


def test_request_and_response_sizes_and_ntpot_are_observed_for_a_completed_response() -> None:
    clock = FakeClock()
    d = director(n=1, clock=clock)
    s = RequestStream(d, 1 << 30)
    s.on_message(headers())
    s.on_message(body(BODY, True))
    assert sample(d, "inference_objective_request_sizes_sum", MODEL) == len(BODY)
    s.on_message(response_headers())
    first = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    last = usage_event(completion=4)
    s.on_message(chunk(first, False))
    clock.advance(2.0)
    s.on_message(chunk(last, True))
    assert sample(d, "inference_objective_response_sizes_sum", MODEL) == len(first) + len(last)
    assert sample(d, "inference_objective_response_sizes_count", MODEL) == 1
    ntpot = "inference_objective_normalized_time_per_output_token_seconds"
    assert sample(d, f"{ntpot}_sum", MODEL) == 2.0 / 4  # the whole duration over the output tokens
    assert sample(d, f"{ntpot}_bucket", {**MODEL, "le": "0.5"}) == 1


def test_a_response_cut_short_or_without_a_body_sent_or_without_tokens_observes_no_size_or_ntpot() -> None:
    d = director(n=1)
    cut = RequestStream(d, 1 << 30)
    cut.on_message(headers())
    cut.on_message(body(BODY, True))
    cut.on_message(response_headers())
    cut.on_message(chunk(b'data: {"choices":[]}\n\n', False))
    cut.close()  # the client went away mid-answer: the size is not the response's
    none = RequestStream(d, 1 << 30)
    none.on_message(headers(response_mode=NONE))
    none.on_message(body(BODY, True))
    none.on_message(response_headers(sse=False))
    none.close()  # response_body_mode NONE: Envoy sends no body, so its size is unknown
    assert sample(d, "inference_objective_response_sizes_count", MODEL) is None
    assert sample(d, "inference_objective_request_sizes_count", MODEL) == 2
    empty = RequestStream(d, 1 << 30)
    empty.on_message(headers())
    empty.on_message(body(BODY, True))
    empty.on_message(response_headers())
    empty.on_message(chunk(usage_event(completion=0), True))  # no output token: no NTPOT
    assert sample(d, "inference_objective_response_sizes_count", MODEL) == 1
    ntpot = "inference_objective_normalized_time_per_output_token_seconds_count"
    assert sample(d, ntpot, MODEL) is None


def test_the_per_pod_queue_size_is_each_scraped_endpoint_in_rotation_s_waiting_queue() -> None:
    d = director(n=3)  # waiting 0, 100, 200 (the helper's scrapes)
    d.datastore.add_endpoint("10.0.0.9:80")  # never scraped: no sample
    for _ in range(3):  # out of rotation after `unhealthy_after_failures` failed scrapes
        d.datastore.record_scrape_failure("10.0.0.2:80", "refused")
    d.metrics.attach_pool(d.datastore, d.clock, "pool")
    name = "inference_pool_per_pod_queue_size"
    got = {
        pod: sample(d, name, {"name": "pool", "model_server_pod": pod})
        for pod in ("10.0.0.0:80", "10.0.0.1:80", "10.0.0.2:80", "10.0.0.9:80")
    }
    assert got == {"10.0.0.0:80": 0.0, "10.0.0.1:80": 100.0, "10.0.0.2:80": None, "10.0.0.9:80": None}
    d.datastore.set_names(
        {"10.0.0.1:80": "vllm-7f9c-rank-0"}
    )  # discovery knows the pod: the reference's name
    assert sample(d, name, {"name": "pool", "model_server_pod": "vllm-7f9c-rank-0"}) == 100.0
    assert sample(d, name, {"name": "pool", "model_server_pod": "10.0.0.1:80"}) is None
    assert sample(d, name, {"name": "pool", "model_server_pod": "10.0.0.0:80"}) == 0.0


def test_the_build_info_names_the_commit_given_and_the_version() -> None:
    m = EppMetrics(CollectorRegistry(), commit="abc123")
    labels = {"commit": "abc123", "build_ref": epp.__version__}
    assert m.registry.get_sample_value("inference_extension_info", labels) == 1.0
    unknown = EppMetrics(CollectorRegistry(), commit="")
    text = generate_latest(unknown.threadsafe).decode()
    assert f'inference_extension_info{{build_ref="{epp.__version__}",commit="unknown"}} 1.0' in text
