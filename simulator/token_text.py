"""A JSON list of token ids, as text, to an int64 array in one compiled pass. Pure.

`engine-replay` reads most lines with `request_lines.scan`; a line outside its strict shape is decoded
by msgspec with the token list kept raw, and `IdReader.read` converts that raw list (JSON msgspec has
already checked) with the same compiled id loop (`request_lines._ids`), into shared arenas. Anything
but non-negative integers that fit in int64 (a sign, a fraction or exponent, a string, a nested list)
gives None, so that the caller takes the exact path, which names the problem.

Compiled with numba (`docs/architecture.md`, "Compiled loops").
"""

from __future__ import annotations

from typing import Any

import msgspec
import numba
import numpy as np
import numpy.typing as npt

from simulator.request_lines import _ids, _ws


class IdReader:
    """`read` gives each list its ids as a view into large shared arrays (arenas), so that a file of
    prompts costs no allocation or copy per prompt."""

    __slots__ = ("_arena", "_used", "arena_ids")

    def __init__(self, arena_ids: int = 1 << 20) -> None:
        self.arena_ids = arena_ids
        self._arena = np.empty(0, dtype=np.int64)
        self._used = 0

    def read(self, text: bytes | memoryview | msgspec.Raw) -> npt.NDArray[np.int64] | None:
        """The ids of a JSON list of non-negative integers (an int64 array, possibly empty, not to be
        written to), or None when the text is anything else (see the module docstring)."""
        buf = np.frombuffer(text, dtype=np.uint8)
        room = (len(buf) + 1) // 2  # the most ids the text can hold
        if self._used + room > len(self._arena):
            self._arena = np.empty(max(self.arena_ids, room), dtype=np.int64)
            self._used = 0
        start = self._used
        n = _list(buf, self._arena, start)
        if n < 0:
            return None
        self._used = start + n
        view = self._arena[start : start + n]
        view.flags.writeable = False
        return view


@numba.njit(cache=True, nogil=True)
def _list(text: Any, out: Any, at: int) -> int:  # pragma: no cover - compiled
    """The ids of the JSON list `text` (the whole of it) into out[at:] (room for (len + 1) // 2):
    their number, or -1 (the id loop is `request_lines._ids`)."""
    n = text.shape[0]
    if n < 2 or text[0] != 91:  # [
        return -1
    p = _ws(text, 1, n)
    if p == n - 1 and text[p] == 93:  # []
        return 0
    count, q = _ids(text, p, n, out, at)
    return count if count >= 0 and _ws(text, q, n) == n else -1


def warm_up() -> None:
    """Compile (or load the cached machine code of) the parser now."""
    IdReader(0).read(b"[1]")
