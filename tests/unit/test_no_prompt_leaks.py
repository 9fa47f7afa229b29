"""Nothing of a prompt reaches what the EPP shows operators: its logs (at debug level), `/metrics`, the
`/debug/*` outputs and the `x-epp-decision` header hold no prompt text and no token ids, whatever the
prompt holds, whether it is routed, refused or cannot be keyed, and when the engines' KV events carry
it. The composition root (`EppServer`, not started) is driven through the ext_proc stream state machine
with generated prompts; `tests/faults/test_tenant_isolation.py` checks the same through Envoy."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from epp.config import DEFAULT_CONFIG_YAML, StaticEndpoint, parse_config
from epp.server.admin import endpoint_json
from epp.server.app import EppServer, ServerSettings
from epp.server.decisions import DECISION_HEADER, DecisionRecord
from epp.server.ext_proc import RequestStream
from epp.tenancy import TenantSalter
from epp.testing.kv_wire import encode_batch, stored
from epp.testing.tokenizer import build_tiny_tokenizer
from epp.types import Decision, MetricsSnapshot

MODEL = "m"
BS = 16
PODS = ("10.0.0.1:8000", "10.0.0.2:8000")
SECRET = b"unit-test-tenancy-secret-0123"
SALTER = TenantSalter("x-tenant-id", SECRET)
DUPLEX = 4


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        exc = logging.Formatter().formatException(record.exc_info) if record.exc_info else ""
        self.lines.append(f"{record.name} {record.getMessage()} {exc}")


@contextlib.contextmanager
def captured_logs() -> Iterator[Captured]:
    """Every log record of the process at debug level and up (a hypothesis example's own capture)."""
    root = logging.getLogger()
    handler, level = Captured(), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> EppServer:
    tmp = tmp_path_factory.mktemp("leaks")
    tok = build_tiny_tokenizer(tmp / "tok")
    secret = tmp / "secret"
    secret.write_bytes(SECRET)
    text = (
        DEFAULT_CONFIG_YAML
        + "kvEvents: {mode: per-pod, port: 5557}\n"
        + f"tokenizers: {{{MODEL}: '{tok}'}}\n"
        + f"tenancy: {{header: x-tenant-id, secretFile: '{secret}'}}\n"
        + "explain: {keep: 10000, responseHeader: true}\n"
    )
    settings_ = ServerSettings(secure_serving=False, seed=1)
    return EppServer(settings_, parse_config(text, "leaks.yaml"), [StaticEndpoint(p, MODEL) for p in PODS])


def scraped(server: EppServer) -> None:
    """Fresh metrics for every pod (the staleness filter drops metrics older than 2s)."""
    for p in PODS:
        snap = MetricsSnapshot(
            server.clock.now(), block_size=BS, num_gpu_blocks=4096, models=frozenset({MODEL})
        )
        server.datastore.record_metrics(p, snap)


def header(key: str, value: str) -> base_pb2.HeaderValue:
    return base_pb2.HeaderValue(key=key, raw_value=value.encode())


def exchange(
    server: EppServer, path: str, doc: Any, headers: dict[str, str], response: bytes | None
) -> list[str]:
    """One request through the ext_proc state machine (duplex both ways); the response headers Envoy
    would get back from the EPP (as "key: value")."""
    stream = RequestStream(server.director, 1 << 24)
    hs = [header(":path", path), header(":method", "POST"), *(header(k, v) for k, v in headers.items())]
    mode = pb.ProtocolConfiguration(request_body_mode=DUPLEX, response_body_mode=DUPLEX)
    out = list(
        stream.on_message(
            pb.ProcessingRequest(
                request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs)), protocol_config=mode
            )
        )
    )
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    out += stream.on_message(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True)))
    if response is not None and not stream.done:
        sse = b"data: " in response
        rh = [
            header(":status", "200"),
            header("content-type", "text/event-stream" if sse else "application/json"),
        ]
        out += stream.on_message(
            pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=rh)))
        )
        out += stream.on_message(
            pb.ProcessingRequest(response_body=pb.HttpBody(body=response, end_of_stream=True))
        )
    stream.close()
    seen = []
    for resp in out:
        if resp.HasField("response_headers"):
            for h in resp.response_headers.response.header_mutation.set_headers:
                seen.append(f"{h.header.key}: {h.header.raw_value.decode()}")
        if resp.HasField("immediate_response"):
            seen.append(resp.immediate_response.details)
    return seen


def operator_outputs(server: EppServer, headers: list[str]) -> dict[str, str]:
    now = server.clock.now()
    return {
        "/metrics": generate_latest(server.metrics.registry).decode(),
        "/debug/index": json.dumps(server.admin.debug_index() if server.admin.debug_index else None),
        "/debug/decisions": json.dumps(
            server.admin.debug_decisions(10_000) if server.admin.debug_decisions else None
        ),
        "/debug/endpoints": json.dumps([endpoint_json(r, now) for r in server.datastore.records()]),
        DECISION_HEADER: "\n".join(headers),
    }


def needles(words: list[str], ids: list[int]) -> set[str]:
    """The words, and every pair of consecutive token ids written as a sequence (a log line, a list)."""
    out = {w.lower() for w in words}
    for a, b in itertools.pairwise(ids):
        out.update({f"{a}, {b}", f"{a},{b}", f"{a} {b}"})
    return out


def leaks(outputs: dict[str, str], found_in: set[str]) -> list[tuple[str, str]]:
    return [(where, n) for where, text in outputs.items() for n in found_in if n in text.lower()]


_seq = itertools.count()
_hashes = itertools.count(1 << 40)
words_st = st.lists(
    st.text("abcdefghijklmnopqrstuvwxyz", min_size=8, max_size=14).map(lambda w: "zq" + w),
    min_size=2,
    max_size=4,
)
ids_st = st.lists(st.integers(200_000_000, 2**31 - 1), min_size=BS + 1, max_size=6 * BS)


@settings(max_examples=25, deadline=None)
@given(words=words_st, ids=ids_st, tenant=st.sampled_from(["acme", "", "globex"]))
def test_no_prompt_text_or_token_ids_reach_logs_metrics_or_debug_output(
    server: EppServer, words: list[str], ids: list[int], tenant: str
) -> None:
    with captured_logs() as logs:
        outputs = route_everything(server, words, ids, tenant)
        outputs["logs"] = "\n".join(logs.lines)
    found_in = needles(words, ids)
    assert leaks(outputs, found_in) == []
    # The search can find them: the prompt and its ids as a request or a log line would write them.
    text = " ".join(words)
    control = {"body": json.dumps({"prompt": ids, "text": text}), "log": f"prompt {text} ids {ids}"}
    assert {where for where, _ in leaks(control, found_in)} == set(control)
    # And the outputs are not empty: the decisions, the pod's blocks and the counters are there.
    assert json.loads(outputs["/debug/decisions"])["kept"] >= 4
    assert json.loads(outputs["/debug/index"])["pods"][PODS[0]]["blocks"]["gpu"] > 0
    assert "epp_usage_tokens_total" in outputs["/metrics"]


def route_everything(server: EppServer, words: list[str], ids: list[int], tenant: str) -> dict[str, str]:
    """The prompt published in a KV event, routed four ways and refused four ways; what operators see."""
    scraped(server)
    # The engine of pod 0 publishes the prompt's blocks (salted for the tenant, as vLLM does).
    full = ids[: len(ids) // BS * BS]
    hashes = [next(_hashes) for _ in range(len(full) // BS)]
    extra = [[SALTER.salt(tenant)]] + [None] * (len(hashes) - 1)
    payload = encode_batch([stored(hashes, None, full, BS, extra_keys=extra)], None, time.time())
    server.ingest.on_live(PODS[0], 0, next(_seq), payload, server.clock.now(), MODEL, time.time())
    server.kv_index.flush()
    text = " ".join(words)
    tenant_h = {"x-tenant-id": tenant} if tenant else {}
    usage = {"usage": {"prompt_tokens": len(ids), "completion_tokens": 2, "total_tokens": len(ids) + 2}}
    sse = (
        f"data: {json.dumps({'choices': [{'text': text}]})}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n"
    )
    headers: list[str] = []
    # Routed: token ids, text completions, chat (streamed), with client-sent salts carrying the prompt.
    headers += exchange(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": ids, "cache_salt": text, "max_tokens": 2},
        tenant_h,
        json.dumps({"choices": [{"text": text}], **usage}).encode(),
    )
    headers += exchange(server, "/v1/completions", {"model": MODEL, "prompt": text}, tenant_h, sse.encode())
    chat = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": True}
    headers += exchange(server, "/v1/chat/completions", chat, tenant_h, sse.encode())
    # Routed without cache credit: a chat the template refuses (its error names the role).
    odd = {"model": MODEL, "messages": [{"role": words[0], "content": text}]}
    headers += exchange(server, "/v1/chat/completions", odd, tenant_h, b"{}")
    # Refused: an ambiguous tenant, wrong types carrying the prompt, a body that is not JSON.
    refused = [
        exchange(
            server, "/v1/completions", {"model": MODEL, "prompt": ids}, {"x-tenant-id": f"{words[0]},b"}, None
        ),
        exchange(server, "/v1/chat/completions", {"model": MODEL, "messages": text}, tenant_h, None),
        exchange(
            server, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": text}, tenant_h, None
        ),
        exchange(server, "/v1/completions", f"{text} {ids}".encode(), tenant_h, None),
    ]
    assert all(r for r in refused)  # each got an immediate response
    assert server.datastore.total_in_flight() == 0
    return operator_outputs(server, headers)


def test_the_decision_log_keeps_no_request_content() -> None:
    """A kept decision holds the request's id, model and priority, not the request (or its prompt)."""
    assert {f.name for f in dataclasses.fields(DecisionRecord)} == {
        "at",
        "request_id",
        "model",
        "priority",
        "decision",
        "calibration",  # the cost model's coefficients (numbers) the decision's estimates used
    }
    assert not any("prompt" in f.name or "messages" in f.name for f in dataclasses.fields(Decision))
