from __future__ import annotations

import json

import pytest

from epp.usage import MAX_JSON_BODY, Usage, UsageReader

USAGE = {
    "prompt_tokens": 12,
    "completion_tokens": 3,
    "total_tokens": 15,
    "prompt_tokens_details": {"cached_tokens": 8},
}


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 10_000])
def test_sse_usage_survives_any_chunking(chunk_size: int) -> None:
    body = sse({"choices": [{"text": "a"}], "usage": None}, {"choices": [], "usage": USAGE})
    r = UsageReader(sse=True)
    for i in range(0, len(body), chunk_size):
        r.feed(body[i : i + chunk_size])
    assert r.finish() == Usage(12, 3, 15, 8)


def test_json_usage() -> None:
    r = UsageReader(sse=False)
    r.feed(json.dumps({"id": "x", "usage": USAGE}).encode())
    assert r.finish() == Usage(12, 3, 15, 8)


@pytest.mark.parametrize(
    ("sse_mode", "body"),
    [
        (False, b"{broken"),
        (False, b'{"usage": "lots"}'),
        (True, b"data: {broken usage\n\n"),
        (True, b"event: ping\n\n"),
        (False, b""),
    ],
)
def test_missing_or_broken_usage_is_none(sse_mode: bool, body: bytes) -> None:
    r = UsageReader(sse=sse_mode)
    r.feed(body)
    assert r.finish() is None


def test_oversized_json_is_not_buffered() -> None:
    r = UsageReader(sse=False)
    r.feed(b"x" * (MAX_JSON_BODY + 1))
    r.feed(json.dumps({"usage": USAGE}).encode())
    assert r.finish() is None


def test_negative_or_wrong_typed_counts_become_zero() -> None:
    r = UsageReader(sse=False)
    r.feed(b'{"usage": {"prompt_tokens": -4, "completion_tokens": "x", "total_tokens": 2}}')
    assert r.finish() == Usage(0, 0, 2, 0)
