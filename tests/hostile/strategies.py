"""Hypothesis strategies shared by the hostile-input tests: JSON values of every shape, and bodies."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# Integers past 64 bits and floats at the edges: the decoder's and the validators' limits.
big_ints = st.one_of(
    st.integers(),
    st.integers(min_value=2**63 - 2, max_value=2**64 + 2),
    st.integers(min_value=-(2**64) - 2, max_value=-(2**63) + 2),
    st.sampled_from([10**30, -(10**30), 2**31, 2**31 - 1, -1]),
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    big_ints,
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values: st.SearchStrategy[Any] = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def dumps(value: Any) -> bytes:
    """JSON as a client may send it: lone surrogates go out as raw (invalid UTF-8) bytes."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


def nested(depth: int, inner: bytes = b"1", open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + inner + close * depth


# Raw byte-level trouble spliced into otherwise plausible bodies.
LITERALS = (
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"1e999",
    b"-1e999",
    b"1" * 5000,
    b"0." + b"0" * 5000 + b"1",
    b"\xff\xfe",
    b'"\xed\xa0\x80"',  # a UTF-8-encoded lone surrogate
    b'"\\ud800"',
    b'"\x00"',
    b"[1,]",
    b"{,}",
    b"tru",
    b"",
)
