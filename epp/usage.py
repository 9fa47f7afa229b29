"""Read `usage` from a model server's response body, JSON or SSE, as it streams past. Pure.

SSE: every `data:` line that mentions `"usage"` is decoded (the last non-null one wins);
`[DONE]` is skipped. JSON: the body is kept up to a bound and decoded at the end; a larger
body is not parsed (usage is then unknown, which is counted, never fatal). A count above
`MAX_TOKENS` (a model server's bug, or a hostile one: JSON integers have no bound) makes that
usage invalid: it is dropped whole (`UsageReader.invalid`), never passed on to the metrics.

Both usage shapes are read: Chat / Completions (`prompt_tokens`, `completion_tokens`,
`prompt_tokens_details.cached_tokens`; vLLM and SGLang alike) and the Responses API
(`input_tokens`, `output_tokens`, `input_tokens_details.cached_tokens`), the latter at the top of a
non-streamed response or in the `response` of a streamed `response.completed` event.

SSE also tells when the first token came (`UsageReader.first_token`): at the first complete `data:`
line that carries output. Not output: comments (vLLM's `--sse-keep-alive-interval` sends
`: keep-alive` while a request queues or prefills), the Responses API's `response.created`,
`response.in_progress` and `response.queued` events (vLLM sends the first two before it schedules
the request), error events and `[DONE]`.

SSE also tells when a stream that started with a 2xx status failed on the way (`UsageReader.error`,
the `error_code` label it is counted under; None while it has not): the engines send the error as an
event, not as a status, once the 200 is out.

- Chat / Completions, vLLM: `data: {"error": {"message", "type", "param", "code": <HTTP status>}}`
  then `data: [DONE]` (vllm-project/vllm vllm/entrypoints/openai/chat_completion/serving.py and
  completion/serving.py, `create_streaming_error_response`; `ErrorInfo` in
  vllm/entrypoints/serve/engine/protocol.py). SGLang sends the same shape, its `ErrorResponse` with
  `"object": "error"` (sgl-project/sglang python/sglang/srt/entrypoints/openai/serving_base.py
  `create_streaming_error_response`, used by serving_chat.py / serving_completions.py).
- Responses API: an `error` event (`"type": "error"`, a string or null `code`, OpenAI's
  `ResponseErrorEvent`) or `response.failed` (its `response.error.code`); vLLM's
  vllm/entrypoints/openai/responses/serving.py (`responses_stream_generator`) builds the event for a
  `GenerationError` from the same `{"error": {...}}` JSON as above.

`error_code` (the label of `epp_stream_errors_total`): `ModelServerError<code>` when the error's
`code` is an HTTP status (400..599), else `ModelServerError` (no code, or a string one: a fixed label,
so a model server cannot grow the metric's series). Only `data:` lines with the bytes `"error"` or
`response.failed` (or in an `event: error` / `event: response.failed`) are decoded for it: the
per-chunk cost stays a substring search. The first error wins; a stream that errs before any output
has no first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

_decoder = msgspec.json.Decoder()
MAX_JSON_BODY = 4 * 1024 * 1024
MAX_SSE_LINE = 1024 * 1024
MAX_TOKENS = 2**53
"""The largest token count taken as real (every integer up to it is exact as a float)."""
PREAMBLE_EVENTS = frozenset({"response.created", "response.in_progress", "response.queued"})
"""Responses API stream events sent before any output (vLLM: as soon as the request is accepted)."""
_PREAMBLE_EVENT_NAMES = frozenset(e.encode() for e in PREAMBLE_EVENTS)


STREAM_ERROR = "ModelServerError"
"""The `error_code` of a stream error event without an HTTP status as its `code`."""
_ERROR_EVENTS = frozenset({b"error", b"response.failed"})


class InvalidUsage(ValueError):
    """A `usage` count outside 0..MAX_TOKENS."""


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0


def _as_int(v: Any) -> int:
    """A count: a non-negative int (anything else, e.g. a float or a negative, is 0). Raises
    InvalidUsage above MAX_TOKENS."""
    if type(v) is not int or v < 0:
        return 0
    if v > MAX_TOKENS:
        raise InvalidUsage(f"usage count over {MAX_TOKENS}")
    return v


def usage_from(doc: Any) -> Usage | None:
    """The `usage` of a decoded response, chunk or Responses API event (None without one). Raises
    InvalidUsage."""
    if not isinstance(doc, dict):
        return None
    u = doc.get("usage")
    if u is None:
        response = doc.get("response")  # a Responses API event: `response.completed` carries the usage
        if isinstance(response, dict):
            u = response.get("usage")
    if not isinstance(u, dict):
        return None
    if "prompt_tokens" not in u and "input_tokens" in u:  # the Responses API's names
        prompt, completion, details = (
            u.get("input_tokens"),
            u.get("output_tokens"),
            u.get("input_tokens_details"),
        )
    else:
        prompt, completion, details = (
            u.get("prompt_tokens"),
            u.get("completion_tokens"),
            u.get("prompt_tokens_details"),
        )
    cached = _as_int(details.get("cached_tokens")) if isinstance(details, dict) else 0
    return Usage(_as_int(prompt), _as_int(completion), _as_int(u.get("total_tokens")), cached)


def _is_output(payload: bytes, event: bytes) -> bool:
    """Whether an SSE event's data (`event`: its `event:` field) carries output: not a Responses API
    preamble event, an error or `[DONE]`. Data that is not JSON counts as output."""
    if event in _PREAMBLE_EVENT_NAMES or payload == b"[DONE]":
        return False
    try:
        doc = _decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return True
    if not isinstance(doc, dict):
        return True
    kind = doc.get("type")
    if isinstance(kind, str) and (kind in PREAMBLE_EVENTS or kind == "error"):
        return False
    return not ("error" in doc and "choices" not in doc)  # vLLM / SGLang mid-stream error bodies


def error_code(doc: Any) -> str | None:
    """The `error_code` of a decoded SSE event if it reports an error (None if it does not)."""
    if not isinstance(doc, dict):
        return None
    kind = doc.get("type")
    if kind == "error":  # Responses API `error` event: the code at the top
        return _code_label(doc.get("code"))
    if kind == "response.failed":
        response = doc.get("response")
        err = response.get("error") if isinstance(response, dict) else None
        return _code_label(err.get("code") if isinstance(err, dict) else None)
    err = doc.get("error")
    if not err or "choices" in doc:
        return None  # a chunk (`choices`), or an event whose `error` is empty (null, false, "")
    return _code_label(err.get("code") if isinstance(err, dict) else None)


def _code_label(code: Any) -> str:
    if type(code) is int and 400 <= code <= 599:
        return f"ModelServerError{code}"
    return STREAM_ERROR


class UsageReader:
    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self.usage: Usage | None = None
        self.invalid = False  # the (last) usage seen had an impossible count: ignored
        self.first_token = False  # SSE: a complete `data:` line with output has been seen
        self.error: str | None = None  # SSE: the `error_code` of the first error event seen
        self._buf = bytearray()
        self._overflow = False
        self._event = b""  # SSE: the current event's `event:` field

    def feed(self, chunk: bytes) -> None:
        if self._overflow or not chunk:
            return
        if not self.sse:
            if len(self._buf) + len(chunk) > MAX_JSON_BODY:
                self._overflow = True
                self._buf.clear()
            else:
                self._buf += chunk
            return
        self._buf += chunk
        if b"\n" not in chunk:
            if len(self._buf) > MAX_SSE_LINE:
                self._buf.clear()
            return
        lines = self._buf.split(b"\n")
        self._buf = bytearray(lines.pop())
        for line in lines:
            self._line(bytes(line))

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            line = line.rstrip(b"\r")
            if not line:
                self._event = b""  # an event ends at a blank line
            elif line.startswith(b"event:"):
                self._event = line[6:].strip()
            return  # also comments (`: keep-alive`), `id:` and `retry:`
        payload = line[5:].strip()
        if self.error is None and (
            b'"error"' in payload or b"response.failed" in payload or self._event in _ERROR_EVENTS
        ):
            self.error = self._error(payload)
        if not self.first_token and self.error is None and _is_output(payload, self._event):
            self.first_token = True
        if b'"usage"' not in payload:
            return
        try:
            found = usage_from(_decoder.decode(payload))
        except (msgspec.DecodeError, RecursionError):  # not JSON, or nested too deeply
            return
        except InvalidUsage:
            self.usage, self.invalid = None, True
            return
        if found is not None:
            self.usage, self.invalid = found, False

    def _error(self, payload: bytes) -> str | None:
        try:
            code = error_code(_decoder.decode(payload))
        except (msgspec.DecodeError, RecursionError):  # not JSON: an error only by its `event:` name
            return STREAM_ERROR if self._event in _ERROR_EVENTS else None
        if code is None and self._event in _ERROR_EVENTS:
            return STREAM_ERROR
        return code

    def finish(self) -> Usage | None:
        if self.sse:
            if self._buf:
                self._line(bytes(self._buf).rstrip(b"\r"))
        elif self._buf and not self._overflow:
            try:
                self.usage = usage_from(_decoder.decode(self._buf))
            except (msgspec.DecodeError, RecursionError):
                self.usage = None
            except InvalidUsage:
                self.usage, self.invalid = None, True
        self._buf.clear()
        return self.usage
