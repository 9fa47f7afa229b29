"""A stream that starts with 200 and then carries an error event is an error, through the real response
path (`RequestStream`, fed the ext_proc messages Envoy sends).

The events are the engines' bytes:
- vLLM chat / completions: `data: {"error": {"message", "type", "param", "code": <status>}}` from
  `json.dumps` (spaces after separators), then `data: [DONE]` (vllm-project/vllm
  vllm/entrypoints/openai/chat_completion/serving.py `chat_completion_stream_generator`: the role chunk
  at the first engine output, `_raise_if_error` on `finish_reason == "error"`, the `except` blocks;
  `ErrorInfo` in vllm/entrypoints/serve/engine/protocol.py). No usage chunk follows an error (it is
  inside the `try`), but `continuous_usage_stats` chunks before it carry usage.
- SGLang: the same shape with `"object": "error"` first (sgl-project/sglang
  python/sglang/srt/entrypoints/openai/serving_base.py `create_streaming_error_response`).
- Responses API: `event: error` with OpenAI's `ResponseErrorEvent` (`type`, `code` string or null,
  `message`, `param`, `sequence_number`), and `response.failed`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.server.director import Director
from epp.server.ext_proc import RequestStream
from epp.testing.fakes import FakeClock
from epp.usage import STREAM_ERROR, UsageReader, error_code

from .test_ext_proc_stream import body, director, headers, response_headers

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
RESPONSES = {"model": "m", "input": "hi", "stream": True}
_CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}


def compact(doc: object) -> str:
    return json.dumps(doc, separators=(",", ":"))  # pydantic's model_dump_json


def data(doc: object) -> bytes:
    return f"data: {compact(doc)}\n\n".encode()


def chunk(delta: dict[str, object], completion: int | None = None) -> bytes:
    doc: dict[str, object] = {
        **_CHUNK,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
    }
    if completion is not None:  # stream_options.continuous_usage_stats
        doc["usage"] = {"prompt_tokens": 40, "total_tokens": 40 + completion, "completion_tokens": completion}
    return data(doc)


ROLE = chunk({"role": "assistant", "content": ""}, 0)
VLLM_ERROR = (
    "data: "
    + json.dumps(
        {
            "error": {
                "message": "Internal server error",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
    )
    + "\n\n"
).encode()
SGLANG_ERROR = (
    "data: "
    + json.dumps(
        {
            "error": {
                "object": "error",
                "message": "The input is too long",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        }
    )
    + "\n\n"
).encode()
DONE = b"data: [DONE]\n\n"
# a vLLM chat stream that fails after its first token, with continuous usage
MID_STREAM = ROLE + chunk({"content": "Hi"}, 1) + VLLM_ERROR + DONE
NORMAL = (
    ROLE
    + chunk({"content": "Hi"}, 1)
    + data(
        {**_CHUNK, "choices": [], "usage": {"prompt_tokens": 40, "total_tokens": 42, "completion_tokens": 2}}
    )
    + DONE
)


def sample(d: Director, name: str, **labels: str) -> float | None:
    return d.metrics.registry.get_sample_value(name, labels)


def errors(d: Director, code: str) -> float | None:
    """Stream error events by the code they gave (`epp_stream_errors_total`)."""
    return sample(d, "epp_stream_errors_total", endpoint="10.0.0.0:80", error_code=code)


def request_errors(d: Director) -> float | None:
    """The request errors, where every model server error is `ModelServerError` (as in the reference)."""
    return sample(
        d,
        "inference_objective_request_error_total",
        model_name="m",
        target_model_name="m",
        error_code="ModelServerError",
    )


def routed(
    d: Director, path: bytes = b"/v1/chat/completions", doc: dict[str, object] = CHAT
) -> RequestStream:
    s = RequestStream(d, 1 << 30)
    s.on_message(headers(path=path))
    s.on_message(body(json.dumps(doc).encode(), True))
    assert s.routed is not None
    return s


def send(s: RequestStream, raw: bytes, eos: bool = False) -> list[pb.ProcessingResponse]:
    return list(s.on_message(pb.ProcessingRequest(response_body=pb.HttpBody(body=raw, end_of_stream=eos))))


def echoed(out: list[pb.ProcessingResponse]) -> bytes:
    return b"".join(r.response_body.response.body_mutation.streamed_response.body for r in out)


def chunks(raw: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(raw), size):
        yield raw[i : i + size]


def observations(d: Director) -> int:
    assert d.cost is not None
    return int(d.cost.coefficients().get("m", {}).get("observations", 0))


def run(raw: bytes, cut: int = 1 << 20, status: bytes = b"200", at: int | None = None) -> Director:
    """Route a streamed chat request, answer it with `raw` cut every `cut` bytes (and at byte `at`),
    end it."""
    clock = FakeClock()
    d = director(n=1, clock=clock)
    s = routed(d)
    s.on_message(response_headers(status=status))
    clock.advance(0.2)
    out: list[pb.ProcessingResponse] = []
    parts = [raw] if at is None else [raw[:at], raw[at:]]
    for part in parts:
        for c in chunks(part, cut):
            out += send(s, c)
        clock.advance(0.1)
    out += send(s, b"", eos=True)
    assert echoed(out) == raw  # the response is the backend's, untouched
    assert d.datastore.total_in_flight() == 0
    assert sample(d, "epp_response_accounting_errors_total") == 0
    return d


def released(d: Director) -> dict[str, float | None]:
    return {c: sample(d, "epp_requests_released_total", cause=c) for c in ("complete", "error", "disconnect")}


# -- an error event in a 200 stream -------------------------------------------------------------------


def test_an_error_mid_stream_is_an_error_and_its_usage_still_counts() -> None:
    d = run(MID_STREAM, at=MID_STREAM.index(VLLM_ERROR))
    assert errors(d, "ModelServerError500") == 1
    assert request_errors(d) == 1
    assert released(d) == {"complete": None, "error": 1, "disconnect": None}
    # the last usage it sent before the error (continuous usage stats): the tokens it spent
    assert sample(d, "epp_usage_tokens_total", endpoint="10.0.0.0:80", kind="prompt") == 40
    assert sample(d, "epp_usage_tokens_total", endpoint="10.0.0.0:80", kind="completion") == 1
    # its first token came in a chunk before the error: a real time to first token, already fed
    assert observations(d) == 1


def test_an_error_at_the_start_is_an_error_with_no_first_token() -> None:
    d = run(SGLANG_ERROR + DONE)
    assert errors(d, "ModelServerError400") == 1
    assert released(d)["error"] == 1 and released(d)["complete"] is None
    assert observations(d) == 0
    assert sample(d, "epp_time_to_first_byte_seconds_count", endpoint="10.0.0.0:80") is None


def test_a_first_output_that_comes_with_the_error_does_not_calibrate() -> None:
    """vLLM sends its role chunk at the engine's first output, and the error of that same output right
    after it: arriving together, the role chunk is no time to first token."""
    d = run(ROLE + VLLM_ERROR + DONE)
    assert errors(d, "ModelServerError500") == 1
    assert observations(d) == 0
    # still its first byte (out of the prefill backlog)
    assert sample(d, "epp_time_to_first_byte_seconds_count", endpoint="10.0.0.0:80") == 1


@pytest.mark.parametrize("cut", [1, 2, 5, 13, 64])
def test_an_error_split_across_chunks_is_found(cut: int) -> None:
    d = run(MID_STREAM, cut=cut)
    assert errors(d, "ModelServerError500") == 1
    assert released(d)["error"] == 1


def test_an_error_in_a_last_line_without_its_newline_is_found_at_the_end() -> None:
    d = run(ROLE + VLLM_ERROR.rstrip(b"\n"))
    assert errors(d, "ModelServerError500") == 1
    assert released(d)["error"] == 1


def test_only_the_first_error_event_counts() -> None:
    d = run(VLLM_ERROR + SGLANG_ERROR + DONE)
    assert errors(d, "ModelServerError500") == 1
    assert errors(d, "ModelServerError400") is None
    assert request_errors(d) == 1


def test_an_error_then_a_disconnect_is_counted_and_released_as_a_disconnect() -> None:
    d = director(n=1)
    s = routed(d)
    s.on_message(response_headers())
    send(s, ROLE + VLLM_ERROR)
    assert errors(d, "ModelServerError500") == 1  # counted when it passed
    s.close()
    assert released(d) == {"complete": None, "error": None, "disconnect": 1}


def test_an_error_status_with_an_error_body_counts_once_by_its_status() -> None:
    d = run(VLLM_ERROR, status=b"503")
    assert request_errors(d) == 1
    assert sample(d, "epp_backend_errors_total", endpoint="10.0.0.0:80", status="503") == 1
    assert errors(d, "ModelServerError500") is None  # not read as a stream error as well
    assert released(d)["error"] == 1


# -- the Responses API ------------------------------------------------------------------------------


def event(kind: str, seq: int, **fields: object) -> bytes:
    return f"event: {kind}\ndata: {compact({**fields, 'sequence_number': seq, 'type': kind})}\n\n".encode()


CREATED = event("response.created", 0, response={"id": "resp_1", "status": "in_progress", "error": None})


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (event("error", 1, code="server_error", message="boom", param=None), STREAM_ERROR),
        (event("error", 1, code=None, message="boom", param=None), STREAM_ERROR),
        (
            event(
                "response.failed",
                1,
                response={
                    "id": "resp_1",
                    "status": "failed",
                    "error": {"code": "server_error", "message": "x"},
                },
            ),
            STREAM_ERROR,
        ),
        (b"event: error\ndata: engine died\n\n", STREAM_ERROR),  # not JSON: an error by its name
        # vLLM's responses_stream_generator sends its GenerationError as the chat-shaped body
        (VLLM_ERROR, "ModelServerError500"),
    ],
    ids=["error-event", "error-event-null-code", "response-failed", "error-event-not-json", "vllm-body"],
)
def test_responses_api_error_events(raw: bytes, code: str) -> None:
    d = director(n=1)
    s = routed(d, b"/v1/responses", RESPONSES)
    s.on_message(response_headers())
    send(s, CREATED)
    send(s, raw, eos=True)
    assert errors(d, code) == 1
    assert request_errors(d) == 1
    assert released(d)["error"] == 1


# -- not errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    ["error", '{"error": {"code": 500}}', '"type": "error"', "response.failed", 'data: {"error": 1}'],
)
def test_content_that_merely_says_error_stays_complete(content: str) -> None:
    d = run(ROLE + chunk({"content": content}, 1) + chunk({"content": "!"}, 2) + DONE)
    assert released(d) == {"complete": 1, "error": None, "disconnect": None}
    assert errors(d, STREAM_ERROR) is None and errors(d, "ModelServerError500") is None
    assert request_errors(d) is None
    assert observations(d) == 1


def test_events_with_an_empty_error_field_stay_complete() -> None:
    """A Responses API object carries `"error": null`; a chunk may carry an `error` next to its choices."""
    raw = (
        CREATED
        + data({"error": None, "usage": None})
        + data({**_CHUNK, "error": {"code": 500}, "choices": [{"index": 0, "delta": {"content": "x"}}]})
        + data({"error": ""})
        + data({"error": False})
        + DONE
    )
    d = run(raw)
    assert released(d)["complete"] == 1 and released(d)["error"] is None


def test_a_normal_stream_is_complete() -> None:
    d = run(NORMAL, cut=7)
    assert released(d) == {"complete": 1, "error": None, "disconnect": None}
    assert sample(d, "epp_usage_tokens_total", endpoint="10.0.0.0:80", kind="completion") == 2
    assert observations(d) == 1


def test_a_json_body_is_not_read_for_error_events() -> None:
    """Only SSE: a non-streamed error comes with its own status (vLLM and SGLang answer it as JSON)."""
    d = director(n=1)
    s = routed(d, doc={**CHAT, "stream": False})
    s.on_message(response_headers(sse=False))
    send(s, VLLM_ERROR[len(b"data: ") :].strip(), eos=True)
    assert released(d)["complete"] == 1


# -- the label, from hostile values -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "code"),
    [
        ({"error": {"code": 500}}, "ModelServerError500"),
        ({"error": {"code": 599}}, "ModelServerError599"),
        ({"error": {"code": 200}}, STREAM_ERROR),  # not an error status
        ({"error": {"code": 600}}, STREAM_ERROR),
        ({"error": {"code": -1}}, STREAM_ERROR),
        ({"error": {"code": 10**30}}, STREAM_ERROR),
        ({"error": {"code": "500"}}, STREAM_ERROR),
        ({"error": {"code": 500.0}}, STREAM_ERROR),
        ({"error": {"code": True}}, STREAM_ERROR),
        ({"error": {"code": "x" * 10_000}}, STREAM_ERROR),  # never a label of the server's choosing
        ({"error": "boom"}, STREAM_ERROR),
        ({"error": [1]}, STREAM_ERROR),
        ({"type": "error", "code": 503}, "ModelServerError503"),
        ({"type": "response.failed", "response": None}, STREAM_ERROR),
        ({"type": "response.failed", "response": {"error": "x"}}, STREAM_ERROR),
        ({"error": None}, None),
        ({"error": {}}, None),
        ({"error": {"code": 500}, "choices": []}, None),
        ([{"error": {"code": 500}}], None),
        ("error", None),
    ],
)
def test_error_code_labels_stay_bounded(doc: object, code: str | None) -> None:
    assert error_code(doc) == code


@pytest.mark.parametrize(
    "raw",
    [
        b'data: {"error": \n\n',  # truncated JSON, no event name: not an error
        b'data: "error"\n\n',
        b'data: {"error"' + b"[" * 100_000 + b"\n\n",  # nested too deeply
        b": error\n\n",  # a comment
    ],
)
def test_undecodable_lines_that_mention_error_are_no_error_and_never_raise(raw: bytes) -> None:
    r = UsageReader(sse=True)
    r.feed(raw)
    r.finish()
    assert r.error is None
