"""Usage and the first token as vLLM 0.32 and SGLang send them, byte for byte (their serializers' field
order and framing), cut into chunks wherever Envoy may cut them.

- vLLM chat / completions: `chat_completion/serving.py` (`chat_completion_stream_generator`: a role chunk
  at the first engine output, `model_dump_json(exclude_unset=True)` chunks, the `include_usage` chunk
  with empty `choices` after the `finish_reason` chunk, `prompt_tokens_details` only with
  `--enable-prompt-tokens-details`), `serve/utils/sse_keep_alive.py` (`: keep-alive` comments).
- vLLM Responses API: `responses/serving.py` (`response.created` and `response.in_progress` before the
  engine runs, `response.completed` carrying `usage`), `responses/api_router.py`
  (`event: <type>\\ndata: <json>\\n\\n`), `responses/protocol.py` (`ResponseUsage`: `input_tokens`,
  `input_tokens_details.cached_tokens`, ...).
- SGLang: `serving_chat.py` (`"usage":null` on every pydantic-dumped chunk, the usage chunk after the
  finish chunk), `usage_processor.py` / `protocol.py` (`prompt_tokens_details: {"cached_tokens": N}`
  with `--enable-cache-report`, a top-level `reasoning_tokens`).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.server.director import Director
from epp.server.ext_proc import RequestStream
from epp.testing.fakes import FakeClock
from epp.usage import Usage, UsageReader

from .test_ext_proc_stream import body, director, headers, response_headers


def sample(d: Director, name: str, **labels: str) -> float | None:
    return d.metrics.registry.get_sample_value(name, labels)


def compact(doc: object) -> str:
    """pydantic's `model_dump_json` / msgspec: no spaces."""
    return json.dumps(doc, separators=(",", ":"))


def data(doc: object) -> bytes:
    return f"data: {compact(doc)}\n\n".encode()


def chunks(raw: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(raw), size):
        yield raw[i : i + size]


CUTS = [1, 2, 5, 13, 64, 1 << 20]

# -- vLLM chat completions (stream_options.include_usage, --enable-prompt-tokens-details) -----------

_CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}


def vllm_chat_stream(continuous: bool = False) -> bytes:
    def chunk(delta: dict[str, object], finish: str | None = None, usage: object = None) -> bytes:
        choice: dict[str, object] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
        doc: dict[str, object] = {**_CHUNK, "choices": [choice]}
        if continuous:
            doc["usage"] = usage
        return data(doc)

    out = chunk(
        {"role": "assistant", "content": ""},
        usage={"prompt_tokens": 40, "total_tokens": 40, "completion_tokens": 0},
    )
    out += chunk({"content": "Hi"}, usage={"prompt_tokens": 40, "total_tokens": 41, "completion_tokens": 1})
    out += chunk(
        {"content": "!"}, "stop", usage={"prompt_tokens": 40, "total_tokens": 42, "completion_tokens": 2}
    )
    final = {
        **_CHUNK,
        "choices": [],
        "usage": {
            "prompt_tokens": 40,
            "total_tokens": 42,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 32},
        },
    }
    return out + data(final) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("continuous", [False, True])
@pytest.mark.parametrize("cut", CUTS)
def test_vllm_chat_stream_usage_and_cached_tokens(continuous: bool, cut: int) -> None:
    r = UsageReader(sse=True)
    for c in chunks(vllm_chat_stream(continuous), cut):
        r.feed(c)
    assert r.finish() == Usage(40, 2, 42, 32)


def test_vllm_chat_json_usage_with_null_details() -> None:
    """Without --enable-prompt-tokens-details vLLM's JSON carries `prompt_tokens_details: null`."""
    doc = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": 40,
            "total_tokens": 42,
            "completion_tokens": 2,
            "prompt_tokens_details": None,
        },
    }
    r = UsageReader(sse=False)
    r.feed(compact(doc).encode())
    assert r.finish() == Usage(40, 2, 42, 0)


# -- vLLM Responses API ------------------------------------------------------------------------------

RESPONSES_USAGE = {
    "input_tokens": 40,
    "input_tokens_details": {
        "cached_tokens": 32,
        "cache_write_tokens": 0,
        "input_tokens_per_turn": [40],
        "cached_tokens_per_turn": [32],
    },
    "output_tokens": 2,
    "output_tokens_details": {
        "reasoning_tokens": 0,
        "tool_output_tokens": 0,
        "output_tokens_per_turn": [2],
        "tool_output_tokens_per_turn": [0],
    },
    "total_tokens": 42,
}


def responses_response(status: str, usage: object, output: list[object]) -> dict[str, object]:
    return {
        "id": "resp_1",
        "created_at": 1700000000,
        "incomplete_details": None,
        "instructions": None,
        "metadata": None,
        "model": "m",
        "object": "response",
        "output": output,
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "background": False,
        "max_output_tokens": 100,
        "status": status,
        "truncation": "disabled",
        "usage": usage,
        "user": None,
    }


def event(kind: str, seq: int, **fields: object) -> bytes:
    return f"event: {kind}\ndata: {compact({**fields, 'sequence_number': seq, 'type': kind})}\n\n".encode()


MESSAGE = {"id": "msg_1", "content": [], "role": "assistant", "status": "in_progress", "type": "message"}
PREAMBLE = event("response.created", 0, response=responses_response("in_progress", None, [])) + event(
    "response.in_progress", 1, response=responses_response("in_progress", None, [])
)
OUTPUT = (
    event("response.output_item.added", 2, item=MESSAGE, output_index=0)
    + event(
        "response.output_text.delta",
        3,
        content_index=0,
        delta="Hi",
        item_id="msg_1",
        logprobs=[],
        output_index=0,
    )
    + event("response.completed", 4, response=responses_response("completed", RESPONSES_USAGE, [MESSAGE]))
)


@pytest.mark.parametrize("cut", CUTS)
def test_vllm_responses_stream_usage_rides_on_response_completed(cut: int) -> None:
    r = UsageReader(sse=True)
    for c in chunks(PREAMBLE + OUTPUT, cut):
        r.feed(c)
    assert r.finish() == Usage(40, 2, 42, 32)


def test_vllm_responses_json_usage_uses_input_and_output_tokens() -> None:
    r = UsageReader(sse=False)
    r.feed(compact(responses_response("completed", RESPONSES_USAGE, [MESSAGE])).encode())
    assert r.finish() == Usage(40, 2, 42, 32)


# -- SGLang ---------------------------------------------------------------------------------------------


def test_sglang_chat_stream_with_null_usage_on_every_chunk_and_cache_report() -> None:
    base = {"id": "abc", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}
    choice = {"index": 0, "logprobs": None, "finish_reason": None, "matched_stop": None}
    stream = (
        data({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        + data({**base, "choices": [{**choice, "delta": {"role": None, "content": "Hi"}}], "usage": None})
        + data({**base, "choices": [{**choice, "delta": {}, "finish_reason": "stop"}], "usage": None})
        + data(
            {
                **base,
                "choices": [],
                "usage": {
                    "prompt_tokens": 40,
                    "total_tokens": 42,
                    "completion_tokens": 2,
                    "prompt_tokens_details": {"cached_tokens": 32},
                    "reasoning_tokens": 0,
                },
            }
        )
        + b"data: [DONE]\n\n"
    )
    for cut in CUTS:
        r = UsageReader(sse=True)
        for c in chunks(stream, cut):
            r.feed(c)
        assert r.finish() == Usage(40, 2, 42, 32)


# -- SSE framing ---------------------------------------------------------------------------------------


def test_a_data_line_with_an_odd_type_is_output_and_never_raises() -> None:
    r = UsageReader(sse=True)
    r.feed(b'data: {"type": [1], "usage": {"prompt_tokens": 3}}\n\n')
    assert r.first_token and r.finish() == Usage(3, 0, 0, 0)


def test_crlf_framing_and_comments() -> None:
    usage = {"prompt_tokens": 5, "total_tokens": 6, "completion_tokens": 1}
    raw = (
        b": keep-alive\r\n\r\nid: 1\r\ndata: "
        + compact({"choices": [], "usage": usage}).encode()
        + b"\r\n\r\n"
    )
    r = UsageReader(sse=True)
    for c in chunks(raw, 3):
        r.feed(c)
    assert r.first_token and r.finish() == Usage(5, 1, 6, 0)


# -- the first token -------------------------------------------------------------------------------------


def routed(d: Director, path: bytes, doc: dict[str, object]) -> RequestStream:
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(path=path))
    s.on_message(body(json.dumps(doc).encode(), True))
    assert s.routed is not None
    return s


def send(s: RequestStream, raw: bytes, eos: bool = False) -> None:
    s.on_message(pb.ProcessingRequest(response_body=pb.HttpBody(body=raw, end_of_stream=eos)))


def backlog(d: Director, s: RequestStream) -> int:
    assert s.routed is not None
    rec = d.datastore.get(s.routed.decision.primary)
    assert rec is not None
    return rec.prefill_backlog.requests


def observations(d: Director) -> int:
    assert d.cost is not None
    return int(d.cost.coefficients().get("m", {}).get("observations", 0))


def first_event(raw: bytes) -> bytes:
    return raw[: raw.index(b"\n\n") + 2]


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
RESPONSES = {"model": "m", "input": "hi", "stream": True}


@pytest.mark.parametrize(
    ("path", "request_body", "before", "first"),
    [
        # vLLM --sse-keep-alive-interval: comments while the request queues / prefills
        (b"/v1/chat/completions", CHAT, b": keep-alive\n\n: keep-alive\n\n", first_event(vllm_chat_stream())),
        # vLLM /v1/responses: created + in_progress before the engine runs
        (b"/v1/responses", RESPONSES, PREAMBLE, first_event(OUTPUT)),
        # an event split across chunks: the first token is its line's end
        (b"/v1/chat/completions", CHAT, vllm_chat_stream()[:20], first_event(vllm_chat_stream())[20:]),
    ],
)
def test_the_first_token_is_the_first_event_with_output(
    path: bytes, request_body: dict[str, object], before: bytes, first: bytes
) -> None:
    clock = FakeClock()
    d = director(n=1, clock=clock)
    s = routed(d, path, request_body)
    s.on_message(response_headers())
    clock.advance(0.01)
    for c in chunks(before, 7):
        send(s, c)
    assert backlog(d, s) == 1 and observations(d) == 0  # not a token yet
    clock.advance(0.5)
    send(s, first)
    assert backlog(d, s) == 0 and observations(d) == 1
    assert s.routed is not None and s.routed.first_byte_at == pytest.approx(s.routed.routed_at + 0.51)
    assert sample(d, "epp_response_accounting_errors_total") == 0


def test_an_error_event_before_any_token_does_not_calibrate() -> None:
    clock = FakeClock()
    d = director(n=1, clock=clock)
    s = routed(d, b"/v1/chat/completions", CHAT)
    s.on_message(response_headers())
    clock.advance(0.2)
    err = {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    send(s, f"data: {json.dumps(err)}\n\n".encode())
    send(s, b"data: [DONE]\n\n", eos=True)
    assert observations(d) == 0
    assert d.datastore.total_in_flight() == 0


def test_a_compressed_body_is_not_read_and_its_first_byte_still_counts() -> None:
    clock = FakeClock()
    d = director(n=1, clock=clock)
    s = routed(d, b"/v1/chat/completions", CHAT)
    rh = response_headers()
    rh.response_headers.headers.headers.add(key="content-encoding", raw_value=b"gzip")
    s.on_message(rh)
    raw = gzip.compress(vllm_chat_stream())
    clock.advance(0.2)
    send(s, raw[:10])
    assert backlog(d, s) == 0 and observations(d) == 1
    send(s, raw[10:], eos=True)
    assert d.datastore.total_in_flight() == 0
    assert s.routed is not None
    assert sample(d, "epp_usage_tokens_total", endpoint=s.routed.decision.primary, kind="prompt") is None
    assert sample(d, "epp_response_accounting_errors_total") == 0


def test_responses_stream_usage_reaches_the_metrics() -> None:
    d = director(n=1)
    s = routed(d, b"/v1/responses", RESPONSES)
    s.on_message(response_headers())
    for c in chunks(PREAMBLE + OUTPUT, 50):
        send(s, c)
    send(s, b"", eos=True)
    assert s.routed is not None
    ep = s.routed.decision.primary
    assert sample(d, "epp_usage_tokens_total", endpoint=ep, kind="prompt") == 40
    assert sample(d, "epp_usage_tokens_total", endpoint=ep, kind="cached") == 32
    assert sample(d, "epp_usage_tokens_total", endpoint=ep, kind="completion") == 2
