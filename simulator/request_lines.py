"""`engine-replay`'s request lines, scanned in compiled code while the engine runs. Pure.

A requests file is JSONL: one `{"prompt_token_ids": [...], "max_tokens": N, "i": ...}` per line, and
almost every line has exactly that shape. `scan` reads a slice of the file's lines in one compiled
pass (no Python objects, no GIL) and, per line, either takes it (its ids appended to a shared int64
array, its `max_tokens` and `i` noted) or marks it blank, or marks it for the exact path: anything
outside the strict shape (another key, a repeated key, a string escape, a sign or fraction in an id,
a leading zero, a number beyond int64, `max_tokens` below 1, a missing field) is left to msgspec's
typed decoding, which accepts what JSON and the schema allow and names what is wrong. So a line the
scan takes means what msgspec would have read from it, and the errors are msgspec's.

The caller (`engine_replay.iter_requests`) runs `scan` over the file slice by slice in a second thread,
so that reading the file overlaps the engine's work.

Compiled with numba (`docs/architecture.md`, "Compiled loops").
"""

from __future__ import annotations

from typing import Any, Final

import numba
import numpy as np
import numpy.typing as npt

TAKEN: Final = 0
BLANK: Final = 1
EXACT: Final = 2  # for msgspec
# columns of a line's row
STATUS, START, END, IDS_AT, IDS_N, MAX_TOKENS, I_VALUE, I_SET = range(8)
COLUMNS: Final = 8

_PROMPT: Final = np.frombuffer(b"prompt_token_ids", dtype=np.uint8)
_MAX: Final = np.frombuffer(b"max_tokens", dtype=np.uint8)
_INT64_MAX: Final = int(np.iinfo(np.int64).max)


@numba.njit(cache=True, nogil=True, inline="always")
def _ws(buf: Any, p: int, end: int) -> int:  # pragma: no cover - compiled
    while p < end and (buf[p] == 32 or buf[p] == 9 or buf[p] == 13):  # not \n: it ends the line
        p += 1
    return p


@numba.njit(cache=True, nogil=True, inline="always")
def _uint(buf: Any, p: int, end: int) -> tuple[int, int]:  # pragma: no cover - compiled
    """A JSON non-negative integer at p (no sign, fraction, exponent or leading zero) that fits in
    int64: (value, position after it), or (-1, p)."""
    if p >= end or not 48 <= buf[p] <= 57:
        return -1, p
    if buf[p] == 48 and p + 1 < end and 48 <= buf[p + 1] <= 57:
        return -1, p
    v: Any = 0
    limit = (_INT64_MAX - 9) // 10
    while p < end and 48 <= buf[p] <= 57:
        d = buf[p] - 48
        if v > limit and v > (_INT64_MAX - d) // 10:
            return -1, p
        v = v * 10 + d
        p += 1
    if p < end and (buf[p] == 46 or buf[p] == 101 or buf[p] == 69):  # . e E: not an integer
        return -1, p
    return v, p


@numba.njit(cache=True, nogil=True, inline="always")
def _key(buf: Any, p: int, end: int, name: Any) -> bool:  # pragma: no cover - compiled
    n = name.shape[0]
    if p + n + 1 > end or buf[p + n] != 34:
        return False
    for k in range(n):  # noqa: SIM110 (numba compiles no generator inside all())
        if buf[p + k] != name[k]:
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _ids(buf: Any, p: int, end: int, ids: Any, at: int) -> tuple[int, int]:  # pragma: no cover - compiled
    """The ids of a list whose `[` and whitespace are behind p, up to its `]`, into ids[at:]: (count,
    position after `]`), or (-1, p) when anything but non-negative int64 JSON integers is there. Its
    own function: the hot loop (inside `_line` it ran 1.5x slower)."""
    limit = (_INT64_MAX - 9) // 10
    w = at
    q = p
    while True:
        if q >= end:
            return -1, p
        c = buf[q]
        if c < 48 or c > 57:  # a sign, a string, ...
            return -1, p
        v: Any = np.int64(c) - 48
        q += 1
        if v == 0 and q < end and 48 <= buf[q] <= 57:  # a leading zero
            return -1, p
        while q < end:
            c = buf[q]
            if c < 48 or c > 57:
                break
            d = np.int64(c) - 48
            if v > limit and v > (_INT64_MAX - d) // 10:
                return -1, p
            v = v * 10 + d
            q += 1
        ids[w] = v
        w += 1
        q = _ws(buf, q, end)
        if q >= end:
            return -1, p
        c = buf[q]
        q += 1
        if c == 93:  # ]
            return w - at, q
        if c != 44:  # not `,`: a fraction, an exponent, "1 2", ...
            return -1, p
        q = _ws(buf, q, end)


@numba.njit(cache=True, nogil=True)
def _line(  # pragma: no cover - compiled
    buf: Any, p: int, end: int, ids: Any, at: int, row: Any, prompt_key: Any, max_key: Any
) -> tuple[int, int]:
    """The line from p (to the next newline, or `end`): (status, where it stopped: the newline or `end`
    unless EXACT); when TAKEN, its fields in `row` and its ids at ids[at:]. No newline is valid inside
    the shape taken, so the line's end needs no separate pass."""
    p = _ws(buf, p, end)
    if p == end or buf[p] == 10:
        return BLANK, p
    if buf[p] != 123:  # {
        return EXACT, p
    p = _ws(buf, p + 1, end)
    seen = 0  # 1: prompt_token_ids, 2: max_tokens, 4: i
    row[I_SET] = 0
    while True:
        if p >= end or buf[p] != 34:  # "
            return EXACT, p
        p += 1
        if _key(buf, p, end, prompt_key):
            field = 1
            p += prompt_key.shape[0] + 1
        elif _key(buf, p, end, max_key):
            field = 2
            p += max_key.shape[0] + 1
        elif p + 1 < end and buf[p] == 105 and buf[p + 1] == 34:  # "i"
            field = 4
            p += 2
        else:
            return EXACT, p
        if seen & field:
            return EXACT, p
        seen |= field
        p = _ws(buf, p, end)
        if p >= end or buf[p] != 58:  # :
            return EXACT, p
        p = _ws(buf, p + 1, end)
        if field == 1:
            if p >= end or buf[p] != 91:  # [
                return EXACT, p
            p = _ws(buf, p + 1, end)
            n = 0
            if p < end and buf[p] == 93:  # ]
                p += 1
            else:
                n, p = _ids(buf, p, end, ids, at)
                if n < 0:
                    return EXACT, p
            row[IDS_AT] = at
            row[IDS_N] = n
        elif field == 2:
            v, p = _uint(buf, p, end)
            if v < 1:
                return EXACT, p
            row[MAX_TOKENS] = v
        else:
            if (
                p + 4 <= end
                and buf[p] == 110
                and buf[p + 1] == 117
                and buf[p + 2] == 108
                and buf[p + 3] == 108
            ):
                p += 4  # null
            else:
                neg = p < end and buf[p] == 45  # -
                v, p = _uint(buf, p + 1 if neg else p, end)
                if v < 0:
                    return EXACT, p
                row[I_VALUE] = -v if neg else v
                row[I_SET] = 1
        p = _ws(buf, p, end)
        if p < end and buf[p] == 44:
            p = _ws(buf, p + 1, end)
            continue
        if p < end and buf[p] == 125:  # }
            break
        return EXACT, p
    if seen & 3 != 3:
        return EXACT, p
    p = _ws(buf, p + 1, end)
    if p < end and buf[p] != 10:
        return EXACT, p
    return TAKEN, p


@numba.njit(cache=True, nogil=True)
def _scan(  # pragma: no cover - compiled
    buf: Any, start: int, stop: int, ids: Any, at: int, info: Any, first: int, prompt_key: Any, max_key: Any
) -> tuple[int, int]:
    """Lines of buf[start:stop] (stop just after a newline, or the end) into info[first:]; ids from
    ids[at:]. Returns (rows written, ids used)."""
    r = first
    p = start
    used = at
    while p < stop:
        row = info[r]
        row[START] = p
        status, q = _line(buf, p, stop, ids, used, row, prompt_key, max_key)
        if status == EXACT:
            while q < stop and buf[q] != 10:
                q += 1
        row[END] = q
        row[STATUS] = status
        if status == TAKEN:
            used += row[IDS_N]
        r += 1
        p = q + 1
    return r - first, used - at


@numba.njit(cache=True, nogil=True)
def _count_lines(buf: Any, start: int, stop: int) -> int:  # pragma: no cover - compiled
    n = 1
    for q in range(start, stop):
        if buf[q] == 10:
            n += 1
    return n


def scan_slice(
    buf: npt.NDArray[np.uint8], start: int, stop: int, ids: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """`scan` of buf[start:stop] into fresh rows (one per line) and ids[0:]: the rows. The line count
    is compiled too, so a scanning thread holds the GIL only to call this."""
    info = np.empty((_count_lines(buf, start, stop), COLUMNS), dtype=np.int64)
    rows, _ = _scan(buf, start, stop, ids, 0, info, 0, _PROMPT, _MAX)
    return info[:rows]


def scan(
    buf: npt.NDArray[np.uint8], start: int, stop: int, ids: npt.NDArray[np.int64], at: int,
    info: npt.NDArray[np.int64], first: int,
) -> tuple[int, int]:  # fmt: skip
    """The lines of buf[start:stop] (see the module docstring): one row each in info[first:] (columns
    STATUS .. I_SET), the ids of taken lines from ids[at:] (room for (stop - start) // 2 + 1). Returns
    (rows written, ids used). Releases the GIL."""
    rows, used = _scan(buf, start, stop, ids, at, info, first, _PROMPT, _MAX)
    return int(rows), int(used)


def warm_up() -> None:
    """Compile (or load the cached machine code of) the scanner now."""
    line = b'{"prompt_token_ids": [1, 2], "max_tokens": 1, "i": null}\n'
    buf = np.frombuffer(line, dtype=np.uint8)
    scan(buf, 0, len(buf), np.empty(len(buf), dtype=np.int64), 0, np.empty((2, COLUMNS), dtype=np.int64), 0)
    scan_slice(buf, 0, len(buf), np.empty(len(buf), dtype=np.int64))
