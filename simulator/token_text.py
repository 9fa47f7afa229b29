"""A JSON list of token ids, as text, to an int64 array in one compiled pass. Pure.

`engine-replay` reads prompts of thousands of ids per line; its parser (`engine_replay.parse_requests`)
hands the raw text of each `prompt_token_ids` list (JSON that msgspec has already checked) to
`parse_ids`. The common case, non-negative integers separated by commas and whitespace, is converted
here at about a byte per nanosecond; anything else (a sign, a fraction or exponent, a string, a nested
list, an id beyond int64) returns None so that the caller takes the exact path, which names the problem.

Compiled with numba (`docs/architecture.md`, "Compiled loops"): numpy's text parser took ~2.5x as long
and needed a separate scan of the text for characters other than digits.
"""

from __future__ import annotations

from typing import Final

import msgspec
import numba
import numpy as np
import numpy.typing as npt

_INT64_MAX: Final = int(np.iinfo(np.int64).max)


@numba.njit(cache=True, nogil=True)
def _parse(text: npt.NDArray[np.uint8], out: npt.NDArray[np.int64]) -> int:
    """Ids of the JSON list `text` into `out` (room for (len + 1) // 2); their number, or -1 when the
    list holds anything but non-negative integers that fit in int64."""
    n = len(text)
    if n < 2 or text[0] != 91 or text[n - 1] != 93:  # [ ... ]
        return -1
    limit = (_INT64_MAX - 9) // 10  # below it, v * 10 + digit cannot overflow
    count = 0
    v = 0
    digits = 0
    spaced = False  # whitespace after the current number's digits
    for k in range(1, n - 1):
        c = text[k]
        if 48 <= c <= 57:  # 0-9
            if spaced or (v > limit and v > (_INT64_MAX - (c - 48)) // 10):
                return -1
            v = v * 10 + (c - 48)
            digits += 1
        elif c == 44:  # ,
            if digits == 0:
                return -1
            out[count] = v
            count += 1
            v = 0
            digits = 0
            spaced = False
        elif c == 32 or c == 9 or c == 10 or c == 13:  # whitespace (JSON's four)
            spaced = digits > 0
        else:
            return -1
    if digits:
        out[count] = v
        count += 1
    elif count:  # a trailing comma: not JSON (msgspec would not have passed it)
        return -1
    return count


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
        n = _parse(buf, self._arena[start:])
        if n < 0:
            return None
        self._used = start + n
        view = self._arena[start : start + n]
        view.flags.writeable = False
        return view


def parse_ids(text: bytes | memoryview | msgspec.Raw) -> npt.NDArray[np.int64] | None:
    """`IdReader.read` for one list, in an array of its own."""
    return IdReader(0).read(text)


def warm_up() -> None:
    """Compile (or load the cached machine code of) the parser now."""
    parse_ids(b"[1]")
