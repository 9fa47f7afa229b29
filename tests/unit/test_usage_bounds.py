"""`usage` counts too large to be real (JSON integers have no bound) are ignored, never passed on."""

from __future__ import annotations

import json

import pytest

from epp.usage import MAX_TOKENS, InvalidUsage, Usage, UsageReader, usage_from

HUGE = int("9" * 400)


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": HUGE, "completion_tokens": 1, "total_tokens": 2},
        {"prompt_tokens": 1, "completion_tokens": MAX_TOKENS + 1, "total_tokens": 2},
        {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": HUGE},
        {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": HUGE}},
    ],
)
@pytest.mark.parametrize("sse_mode", [False, True])
def test_a_count_over_the_bound_makes_the_usage_invalid(usage: dict[str, int], sse_mode: bool) -> None:
    r = UsageReader(sse=sse_mode)
    r.feed(sse({"choices": [], "usage": usage}) if sse_mode else json.dumps({"usage": usage}).encode())
    assert r.finish() is None
    assert r.invalid


def test_the_bound_itself_is_a_count() -> None:
    assert usage_from({"usage": {"prompt_tokens": MAX_TOKENS}}) == Usage(MAX_TOKENS, 0, 0, 0)
    with pytest.raises(InvalidUsage, match="usage count over"):
        usage_from({"usage": {"prompt_tokens": MAX_TOKENS + 1}})


def test_floats_are_wrong_typed_counts_and_out_of_range_ones_no_usage() -> None:
    r = UsageReader(sse=False)
    r.feed(b'{"usage": {"prompt_tokens": 1e300, "completion_tokens": 3, "total_tokens": 3}}')
    assert r.finish() == Usage(0, 3, 3, 0)
    assert not r.invalid
    r = UsageReader(sse=False)  # past a float: the decoder refuses the body, so no usage (no error)
    r.feed(b'{"usage": {"prompt_tokens": 1e400, "completion_tokens": 3, "total_tokens": 3}}')
    assert r.finish() is None


def test_in_sse_the_last_usage_decides() -> None:
    bad = {"prompt_tokens": HUGE}
    good = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    r = UsageReader(sse=True)
    r.feed(sse({"usage": bad}, {"usage": good}))
    assert r.finish() == Usage(5, 2, 7, 0) and not r.invalid
    r = UsageReader(sse=True)
    r.feed(sse({"usage": good}, {"usage": bad}))
    assert r.finish() is None and r.invalid


def test_valid_usage_is_not_invalid() -> None:
    r = UsageReader(sse=False)
    r.feed(b'{"usage": {"prompt_tokens": 4}}')
    assert r.finish() == Usage(4, 0, 0, 0)
    assert not r.invalid
