"""OpenAI response bodies as vLLM shapes them: completions, chat completions, their stream chunks, usage.

Every answer stops at `max_tokens` (`finish_reason` "length"): the engine model never samples an end
of sequence. `usage.prompt_tokens_details.cached_tokens` is the engine's count of prompt tokens it did
not compute (GPU prefix-cache hit plus CPU-tier loads), what vLLM reports with
`--enable-prompt-tokens-details`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode

DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """The fixed parts of one response: its id, creation time, model, and kind."""

    request_id: str
    created: int
    model: str
    chat: bool

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def complete(self, text: str, use: dict[str, Any]) -> bytes:
        """The non-streaming response."""
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            doc = self._head("chat.completion")
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            doc = self._head("text_completion")
        doc["choices"] = [choice]
        doc["usage"] = use
        return _encode(doc)

    def chunk(self, text: str, *, first: bool, last: bool, include_usage: bool) -> bytes:
        """One SSE event carrying `text` (the first chat chunk also carries the assistant role)."""
        finish = "length" if last else None
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            doc = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            doc = self._head("text_completion")
        if last:
            choice["stop_reason"] = None
        doc["choices"] = [choice]
        if include_usage:
            doc["usage"] = None
        return b"data: " + _encode(doc) + b"\n\n"

    def usage_chunk(self, use: dict[str, Any]) -> bytes:
        """The final chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
        doc = self._head("chat.completion.chunk" if self.chat else "text_completion")
        doc["choices"] = []
        doc["usage"] = use
        return b"data: " + _encode(doc) + b"\n\n"


def error_event(body: dict[str, Any]) -> bytes:
    """An error inside an already started stream, as vLLM sends it."""
    return b"data: " + _encode(body) + b"\n\n"
