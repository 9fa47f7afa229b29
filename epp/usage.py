"""Read `usage` from a model server's response body, JSON or SSE, as it streams past. Pure.

SSE: every `data:` line that mentions `"usage"` is decoded (the last non-null one wins);
`[DONE]` is skipped. JSON: the body is kept up to a bound and decoded at the end; a larger
body is not parsed (usage is then unknown, which is counted, never fatal). A count above
`MAX_TOKENS` (a model server's bug, or a hostile one: JSON integers have no bound) makes that
usage invalid: it is dropped whole (`UsageReader.invalid`), never passed on to the metrics.
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
    """The `usage` of a decoded response (None without one). Raises InvalidUsage."""
    if not isinstance(doc, dict):
        return None
    u = doc.get("usage")
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    cached = _as_int(details.get("cached_tokens")) if isinstance(details, dict) else 0
    return Usage(
        _as_int(u.get("prompt_tokens")),
        _as_int(u.get("completion_tokens")),
        _as_int(u.get("total_tokens")),
        cached,
    )


class UsageReader:
    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self.usage: Usage | None = None
        self.invalid = False  # the (last) usage seen had an impossible count: ignored
        self._buf = bytearray()
        self._overflow = False

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
        if not line.startswith(b"data:") or b'"usage"' not in line:
            return
        payload = line[5:].strip()
        try:
            found = usage_from(_decoder.decode(payload))
        except (msgspec.DecodeError, RecursionError):  # not JSON, or nested too deeply
            return
        except InvalidUsage:
            self.usage, self.invalid = None, True
            return
        if found is not None:
            self.usage, self.invalid = found, False

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
