"""Engine KV-event batches read in one compiled pass into columns, for ingestion. Pure.

`decode_batch` (`events.py`) builds a Python object per event and a Python int per token id and hash:
for a vLLM batch of 8 BlockStored of 256 tokens, that is most of the cost of ingesting it, and the index
then packs the ids back into int64. `scan_batch` reads the msgpack bytes once, in compiled code, and
writes what the index needs as columns: the hashes as uint64, the token ids as int64 (a uint64 id wraps,
as the keys take ids modulo 2^64), and per run of consecutive events of one kind, tier, model and KV
group kind, where its hashes and tokens are and each event's parent, counts and block size
(`ScannedBatch`: the runs `ingest.KvIngest` applies, one `BlockIndex.store_run` or `discard` each).

It takes the shapes engines send (both encodings, every field of the reference, int and 32/16-byte
digest hashes) and only what `decode_batch` would accept and read the same way. Anything else is left
to `decode_batch` (`scan_batch` returns None), which accepts what the schema allows and names what is
wrong: an unknown or repeated field, a field of another event kind, missing required fields, an
extension or bool where a number belongs, a string that is not UTF-8, trailing bytes, nesting beyond
the shapes, `extra_keys` other than nils and the adapter's name (a tenant salt, multimodal ids), a
`cache_salt` that is not nil, sizes beyond int64. A
property test checks that every batch the scan takes reads as `decode_batch` reads it.

Compiled with numba (`docs/architecture.md`, "Compiled loops").
"""

from __future__ import annotations

import struct
from typing import Any, Final, NamedTuple

import numba
import numpy as np
import numpy.typing as npt

from epp.kvindex.events import FULL_ATTENTION_KINDS, GPU, normalize_tier
from epp.kvindex.packing import StoreTokens

STORED: Final = 0
REMOVED: Final = 1
CLEARED: Final = 2
# columns of an event's row; a string is (offset in the payload, length), length -1 for nil
KIND, H_AT, H_N, PARENT, HAS_PARENT, T_AT, T_N, BLOCK_SIZE, MEDIUM_AT, MEDIUM_N, LORA_AT, LORA_N = range(12)
SPEC_AT, SPEC_N, GROUP = 12, 13, 14  # GROUP: group_idx, -1 for nil
EXTRA_AT, EXTRA_N = 15, 16  # the one string extra_keys entries hold ([s] per block: the adapter), if any
ROW: Final = 17

_NAMES: Final = (
    "type",  # 0
    "block_hashes",  # 1
    "parent_block_hash",  # 2
    "token_ids",  # 3
    "block_size",  # 4
    "lora_id",  # 5
    "medium",  # 6
    "lora_name",  # 7
    "extra_keys",  # 8
    "group_idx",  # 9
    "kv_cache_spec_kind",  # 10
    "kv_cache_spec_sliding_window",  # 11
    "cache_salt",  # 12
)
_NAME_BYTES: Final = np.frombuffer(b"".join(n.encode() for n in _NAMES), dtype=np.uint8)
_NAME_AT: Final = np.cumsum([0] + [len(n) for n in _NAMES]).astype(np.int64)
_TAGS: Final = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
_TAG_BYTES: Final = np.frombuffer(b"".join(t.encode() for t in _TAGS), dtype=np.uint8)
_TAG_AT: Final = np.cumsum([0] + [len(t) for t in _TAGS]).astype(np.int64)
# fields (bit = 1 << name number) each kind may carry in the map form, and required ones
_ALLOWED: Final = np.array([(1 << 13) - 1, 1 | 2 | 64 | 512, 1], dtype=np.int64)
_REQUIRED: Final = np.array([1 | 2 | 4 | 8 | 16, 1 | 2, 1], dtype=np.int64)
# array form: the fields after the tag, in order (cache_salt is map-only)
_ORDER: Final = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 6, 9], dtype=np.int64)
_ORDER_AT: Final = np.array([0, 11, 14, 14], dtype=np.int64)
_REQUIRED_N: Final = np.array([4, 1, 0], dtype=np.int64)

_BAD: Final = -1


@numba.njit(cache=True, nogil=True, inline="always")
def _be(buf: Any, p: Any, n: Any) -> Any:  # pragma: no cover - compiled
    """n bytes at p, big-endian, as uint64."""
    v = numba.uint64(0)
    for k in range(n):
        v = (v << numba.uint64(8)) | numba.uint64(buf[p + k])
    return v


@numba.njit(cache=True, nogil=True, inline="always")
def _int(buf: Any, p: Any, end: Any) -> tuple[Any, ...]:  # pragma: no cover - compiled
    """A msgpack int at p: (kind, its 64 bits as uint64, position after it); kind 1 signed, 2 unsigned
    above int64's range, 0 not an int (or cut short)."""
    if p >= end:
        return 0, numba.uint64(0), p
    c = np.int64(buf[p])
    if c <= 0x7F:
        return 1, numba.uint64(c), p + 1
    if c >= 0xE0:
        return 1, numba.uint64(np.int64(c) - 256), p + 1  # wraps, as int64 -> uint64 does
    if 0xCC <= c <= 0xD3:
        n = 1 << ((c - 0xCC) & 3)
        if p + 1 + n > end:
            return 0, numba.uint64(0), p
        v = _be(buf, p + 1, n)
        if c >= 0xD0:  # intN: sign-extend
            shift = numba.uint64(64 - 8 * n)
            v = numba.uint64(np.int64(v << shift) >> np.int64(shift))
            return 1, v, p + 1 + n
        return (2 if n == 8 and v >> numba.uint64(63) else 1), v, p + 1 + n
    return 0, numba.uint64(0), p


@numba.njit(cache=True, nogil=True, inline="always")
def _head(buf: Any, p: Any, end: Any, fix: Any, b16: Any) -> tuple[Any, ...]:  # pragma: no cover - compiled
    """The length of an array (fix 0x90, b16 0xDC) or map (0x80, 0xDE) header at p: (n, after), or
    (-1, p)."""
    if p >= end:
        return -1, p
    c = np.int64(buf[p])
    if fix <= c <= fix + 15:
        return c - fix, p + 1
    if c == b16 and p + 3 <= end:
        return np.int64(_be(buf, p + 1, 2)), p + 3
    if c == b16 + 1 and p + 5 <= end:
        return np.int64(_be(buf, p + 1, 4)), p + 5
    return -1, p


@numba.njit(cache=True, nogil=True, inline="always")
def _str(buf: Any, p: Any, end: Any) -> tuple[Any, ...]:  # pragma: no cover - compiled
    """A msgpack str at p: (offset of its bytes, length, after); length -1 for nil, -2 for anything else."""
    if p >= end:
        return 0, -2, p
    c = np.int64(buf[p])
    if c == 0xC0:
        return 0, -1, p + 1
    if 0xA0 <= c <= 0xBF:
        n, q = c - 0xA0, p + 1
    elif c == 0xD9 and p + 2 <= end:
        n, q = np.int64(buf[p + 1]), p + 2
    elif c == 0xDA and p + 3 <= end:
        n, q = np.int64(_be(buf, p + 1, 2)), p + 3
    elif c == 0xDB and p + 5 <= end:
        n, q = np.int64(_be(buf, p + 1, 4)), p + 5
    else:
        return 0, -2, p
    if q + n > end:
        return 0, -2, p
    return q, n, q + n


@numba.njit(cache=True, nogil=True, inline="always")
def _hash(buf: Any, p: Any, end: Any) -> tuple[Any, ...]:  # pragma: no cover - compiled
    """An engine hash at p (any int, or a bin of 32 or 16 bytes: its last 8 bytes), as `engine_hash`."""
    kind, v, q = _int(buf, p, end)
    if kind:
        return True, v, q
    if p + 2 <= end and buf[p] == 0xC4:
        n = np.int64(buf[p + 1])
        if (n == 32 or n == 16) and p + 2 + n <= end:
            return True, _be(buf, p + 2 + n - 8, 8), p + 2 + n
    return False, numba.uint64(0), p


@numba.njit(cache=True, nogil=True)
def _match(buf: Any, at: Any, n: Any, names: Any, starts: Any) -> int:  # pragma: no cover - compiled
    """Which of the names buf[at:at + n] is, or -1."""
    for k in range(starts.shape[0] - 1):
        s = starts[k]
        if starts[k + 1] - s != n:
            continue
        same = True
        for j in range(n):
            if buf[at + j] != names[s + j]:
                same = False
                break
        if same:
            return k
    return -1


@numba.njit(cache=True, nogil=True)
def _field(  # pragma: no cover - compiled
    buf: Any, p: Any, end: Any, f: Any, row: Any, hashes: Any, nh: Any, tokens: Any, nt: Any
) -> tuple[Any, ...]:
    """Field number f (of `_NAMES`, not 0) at p into the event's row: (after, hashes used, tokens used),
    after -1 when the value is not of the shape taken."""
    if f == 1 or f == 3:  # block_hashes, token_ids
        n, q = _head(buf, p, end, 0x90, 0xDC)
        if n < 0:
            return _BAD, nh, nt
        if f == 1:
            row[H_AT] = nh
            row[H_N] = n
            for _ in range(n):
                ok, v, q = _hash(buf, q, end)
                if not ok:
                    return _BAD, nh, nt
                hashes[nh] = v
                nh += 1
        else:
            row[T_AT] = nt
            row[T_N] = n
            stop = nt + n
            while nt < stop:
                c = buf[q] if q < end else 0xC1
                if c <= 0x7F:
                    tokens[nt] = c
                    q += 1
                elif c == 0xCD and q + 3 <= end:  # uint16, uint32: the common token ids
                    tokens[nt] = (np.int64(buf[q + 1]) << 8) | buf[q + 2]
                    q += 3
                elif c == 0xCE and q + 5 <= end:
                    tokens[nt] = np.int64(_be(buf, q + 1, 4))
                    q += 5
                else:
                    kind, v, q = _int(buf, q, end)
                    if not kind:
                        return _BAD, nh, nt
                    tokens[nt] = np.int64(v)
                nt += 1
        return q, nh, nt
    if f == 2:  # parent_block_hash
        if p < end and buf[p] == 0xC0:
            row[HAS_PARENT] = 0
            return p + 1, nh, nt
        ok, v, q = _hash(buf, p, end)
        if not ok:
            return _BAD, nh, nt
        row[PARENT] = np.int64(v)  # its bits: read back as uint64
        row[HAS_PARENT] = 1
        return q, nh, nt
    if f == 4:  # block_size
        kind, v, q = _int(buf, p, end)
        if kind != 1 or np.int64(v) < 1:
            return _BAD, nh, nt
        row[BLOCK_SIZE] = np.int64(v)
        return q, nh, nt
    if f == 5 or f == 9 or f == 11:  # lora_id, group_idx, sliding window: nil or an int; group_idx kept
        if p < end and buf[p] == 0xC0:
            return p + 1, nh, nt
        kind, v, q = _int(buf, p, end)
        if f == 9:
            if kind != 1 or np.int64(v) < 0:
                return _BAD, nh, nt  # (a negative or huge group: decode_batch reads it)
            row[GROUP] = np.int64(v)
        return (q if kind else _BAD), nh, nt
    if f == 6 or f == 7 or f == 10:  # medium, lora_name, kv_cache_spec_kind: nil or a str
        at, n, q = _str(buf, p, end)
        if n == -2:
            return _BAD, nh, nt
        col = MEDIUM_AT if f == 6 else LORA_AT if f == 7 else SPEC_AT
        row[col] = at
        row[col + 1] = n
        return q, nh, nt
    if f == 8:  # extra_keys: nil, or per block nil or [s], one string s throughout (vLLM 0.18+ puts the
        # adapter's name there; `scan_batch` checks it is the event's lora_name: anything else is a salt)
        if p < end and buf[p] == 0xC0:
            return p + 1, nh, nt
        n, q = _head(buf, p, end, 0x90, 0xDC)
        if n < 0:
            return _BAD, nh, nt
        for _ in range(n):
            if q < end and buf[q] == 0xC0:
                q += 1
                continue
            k, q = _head(buf, q, end, 0x90, 0xDC)
            if k != 1:
                return _BAD, nh, nt
            at, m, q = _str(buf, q, end)
            if m < 0:
                return _BAD, nh, nt
            if row[EXTRA_N] < 0:
                row[EXTRA_AT] = at
                row[EXTRA_N] = m
            elif m != row[EXTRA_N]:
                return _BAD, nh, nt
            else:
                for j in range(m):
                    if buf[at + j] != buf[row[EXTRA_AT] + j]:
                        return _BAD, nh, nt
        return q, nh, nt
    if f == 12 and p < end and buf[p] == 0xC0:  # cache_salt: nil only
        return p + 1, nh, nt
    return _BAD, nh, nt


@numba.njit(cache=True, nogil=True)
def _event(  # pragma: no cover - compiled
    buf: Any, p: Any, end: Any, row: Any, hashes: Any, nh: Any, tokens: Any, nt: Any
) -> tuple[Any, ...]:
    """One event at p into row: (after, hashes used, tokens used), after -1 when not taken."""
    row[:] = 0
    row[MEDIUM_N] = -1
    row[LORA_N] = -1
    row[SPEC_N] = -1
    row[GROUP] = -1
    row[EXTRA_N] = -1
    if p >= end:
        return _BAD, nh, nt
    if 0x80 <= buf[p] <= 0x8F or buf[p] == 0xDE or buf[p] == 0xDF:
        n, q = _head(buf, p, end, 0x80, 0xDE)
        if n < 0:
            return _BAD, nh, nt
        seen = 0
        kind = -1
        for _ in range(n):
            at, k, q = _str(buf, q, end)
            if k < 0:
                return _BAD, nh, nt
            f = _match(buf, at, k, _NAME_BYTES, _NAME_AT)
            if f < 0 or seen & (1 << f):
                return _BAD, nh, nt
            seen |= 1 << f
            if f == 0:
                at, k, q = _str(buf, q, end)
                kind = _match(buf, at, k, _TAG_BYTES, _TAG_AT) if k >= 0 else -1
                if kind < 0:
                    return _BAD, nh, nt
            else:
                q, nh, nt = _field(buf, q, end, f, row, hashes, nh, tokens, nt)
                if q < 0:
                    return _BAD, nh, nt
        if kind < 0 or seen & ~_ALLOWED[kind] or seen & _REQUIRED[kind] != _REQUIRED[kind]:
            return _BAD, nh, nt
        row[KIND] = kind
        return q, nh, nt
    n, q = _head(buf, p, end, 0x90, 0xDC)
    if n < 1:
        return _BAD, nh, nt
    at, k, q = _str(buf, q, end)
    kind = _match(buf, at, k, _TAG_BYTES, _TAG_AT) if k >= 0 else -1
    if kind < 0 or n - 1 < _REQUIRED_N[kind] or n - 1 > _ORDER_AT[kind + 1] - _ORDER_AT[kind]:
        return _BAD, nh, nt
    for j in range(n - 1):
        q, nh, nt = _field(buf, q, end, _ORDER[_ORDER_AT[kind] + j], row, hashes, nh, tokens, nt)
        if q < 0:
            return _BAD, nh, nt
    row[KIND] = kind
    return q, nh, nt


@numba.njit(cache=True, nogil=True, inline="always")
def _same(buf: Any, a: Any, b: Any, col: int) -> bool:  # pragma: no cover - compiled
    """Whether rows a and b carry the same string (or both nil) at column col."""
    n = a[col + 1]
    if n != b[col + 1]:
        return False
    for k in range(n):  # noqa: SIM110 (numba compiles no generator inside all())
        if buf[a[col] + k] != buf[b[col] + k]:
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _group(buf: Any, rows: Any, n: int, runs: Any) -> int:  # pragma: no cover - compiled
    """Runs of consecutive events of one kind with the same medium, lora_name, kv_cache_spec_kind and
    group_idx (AllBlocksCleared: one run each) into runs[r] = (kind, first event, end event, first hash,
    end hash, first token, end token, medium, lora_name, spec, group of the first event); returns their
    number."""
    r = -1
    for e in range(n):
        row = rows[e]
        if r >= 0:
            head = rows[runs[r, 1]]
            if (
                row[KIND] == head[KIND]
                and row[KIND] != CLEARED
                and _same(buf, row, head, MEDIUM_AT)
                and _same(buf, row, head, LORA_AT)
                and _same(buf, row, head, SPEC_AT)
                and row[GROUP] == head[GROUP]
                and _same(buf, row, head, EXTRA_AT)
            ):
                runs[r, 2] = e + 1
                runs[r, 4] = row[H_AT] + row[H_N]
                if row[KIND] == STORED:
                    runs[r, 6] = row[T_AT] + row[T_N]
                continue
        r += 1
        runs[r, 0] = row[KIND]
        runs[r, 1] = e
        runs[r, 2] = e + 1
        runs[r, 3] = row[H_AT]
        runs[r, 4] = row[H_AT] + row[H_N]
        runs[r, 5] = row[T_AT]
        runs[r, 6] = row[T_AT] + row[T_N]
        runs[r, 7:13] = row[MEDIUM_AT : SPEC_N + 1]
        runs[r, 13] = row[GROUP]
        runs[r, 14] = row[EXTRA_AT]
        runs[r, 15] = row[EXTRA_N]
    return r + 1


_HEAD: Final = 4  # work[:4]: ts's 64 bits, dp rank, 1 if the rank was sent and not nil, events
_RUN: Final = 16  # a run's columns (`_group`)
_EVENT: Final = 4  # per event, after the runs: has parent, hashes, tokens, block size


@numba.njit(cache=True, nogil=True)
def _scan(buf: Any, work: Any, data: Any, cap: int) -> tuple[int, int, int]:  # pragma: no cover - compiled
    """The batch in buf. `work` (int64) gets the head (`_HEAD`), the runs (`_group`) and then per event
    `_EVENT` columns, in that order and nothing between; its tail is scratch for the events' rows.
    `data` (int64, 2 * len(buf) + cap) gets the block hashes, then each event's parent hash (as 64
    bits), and from len(buf) + cap on, the token ids. `work` holds `cap` events: the caller sizes it.
    Returns (runs, events, block hashes); runs -1 when the batch is not of the shape taken, -2 when it
    has more than `cap` events."""
    end = buf.shape[0]
    runs = work[_HEAD : _HEAD + cap * _RUN].reshape((cap, _RUN))
    rows = work[work.shape[0] - cap * ROW :].reshape((cap, ROW))
    hashes = data[:end].view(np.uint64)
    tokens = data[end + cap :]
    if end < 2 or not (buf[0] == 0x92 or buf[0] == 0x93):
        return -1, 0, 0
    p = 1
    ts = np.empty(1, dtype=np.float64)
    if buf[p] == 0xCB and p + 9 <= end:
        ts.view(np.uint64)[0] = _be(buf, p + 1, 8)
        p += 9
    elif buf[p] == 0xCA and p + 5 <= end:
        f32 = np.empty(1, dtype=np.uint32)
        f32[0] = np.uint32(_be(buf, p + 1, 4))
        ts[0] = np.float64(f32.view(np.float32)[0])
        p += 5
    else:
        kind, v, p = _int(buf, p, end)
        if kind == 0:
            return -1, 0, 0
        ts[0] = np.float64(np.int64(v)) if kind == 1 else np.float64(v)
    work[0] = ts.view(np.int64)[0]
    n, p = _head(buf, p, end, 0x90, 0xDC)
    if n < 0 or n > end // 8:  # an event takes at least 8 bytes
        return -1, 0, 0
    if n > cap:
        return -2, 0, 0
    nh = 0
    nt = 0
    for e in range(n):
        p, nh, nt = _event(buf, p, end, rows[e], hashes, nh, tokens, nt)
        if p < 0:
            return -1, 0, 0
    work[1] = 0
    work[2] = 0
    if buf[0] == 0x93:
        if p < end and buf[p] == 0xC0:
            p += 1
        else:
            kind, v, p = _int(buf, p, end)
            if kind != 1:
                return -1, 0, 0
            work[1] = np.int64(v)
            work[2] = 1
    if p != end:
        return -1, 0, 0
    work[3] = n
    nruns = _group(buf, rows, n, runs)
    at = _HEAD + nruns * _RUN
    for e in range(
        n
    ):  # after the runs (`rows` starts beyond all this: cap * ROW >= cap * (_RUN + _EVENT) + _HEAD)
        row = rows[e]
        work[at] = row[HAS_PARENT]
        work[at + 1] = row[H_N]
        work[at + 2] = row[T_N]
        work[at + 3] = row[BLOCK_SIZE]
        at += _EVENT
        data[nh + e] = row[PARENT]
    return nruns, n, nh


StoredRun = tuple[
    int,
    str,
    "str | None",
    "str | None",
    list[int],
    "list[int | None]",
    list[int],
    "StoreTokens",
    list[int],
    list[int],
    "npt.NDArray[np.uint64] | None",
]
"""(STORED, tier, lora_name, tenant salt, engine hashes, parent hash per event, hashes per event, token ids,
tokens per event, engine block size per event, the engine hashes as a uint64 array or None): consecutive
BlockStored with the same tier, model and salt. (The scan gives the array: the index queues it as it is.)"""
RemovedRun = tuple[int, str, list[int], "int | None", int]
"""(REMOVED, tier, engine hashes, KV-cache group or None, events): consecutive BlockRemoved of one tier and
group."""
Cleared = tuple[int]
Run = StoredRun | RemovedRun | Cleared


RunArrays = tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64]] | npt.NDArray[np.uint64] | None
"""Per run, what the compiled scan has as arrays: a StoredRun's events (one row each: has a parent, hashes,
tokens, engine block size) and parents (the value where there is none is not read); a RemovedRun's hashes;
None."""


class ScannedBatch(NamedTuple):
    """A batch in the form ingestion applies: runs of events (`Run`); also made from `decode_batch`'s result
    (`batch_reader.decode`). `events`: how many events the runs hold; `skipped`: events of KV groups that
    are not full attention, left out; `partial_groups`: their `group_idx`s (the groups whose BlockRemoved
    events `ingest.KvIngest` must not apply: an engine publishes a block's hash in every group)."""

    ts: float
    data_parallel_rank: int | None
    runs: list[Run]
    events: int
    skipped: int
    partial_groups: tuple[int, ...] = ()
    arrays: tuple[RunArrays, ...] = ()
    """The scan's arrays of each run, in order (empty when the batch has none: the index converts the
    lists)."""


def scan_batch(payload: bytes) -> ScannedBatch | None:
    """The batch, or None when it is not of a shape the scan takes (use `decode_batch`)."""
    size = len(payload)
    buf = np.frombuffer(payload, dtype=np.uint8)
    cap = size // 256 + 16  # events are longer than that, but may be as short as 8 bytes: then again
    while True:
        work = np.empty(_HEAD + cap * (_RUN + _EVENT + ROW), dtype=np.int64)
        data = np.empty(2 * size + cap, dtype=np.int64)
        nruns, n, nh = _scan(buf, work, data, cap)
        if nruns != -2:
            break
        cap = size // 8 + 1
    if nruns < 0:
        return None
    w = work[: _HEAD + nruns * _RUN + n * _EVENT].tolist()
    ha = data[: nh + n].view(np.uint64)  # block hashes, then the events' parents
    hl = ha.tolist()
    tokens = data[size + cap :]
    out: list[Run] = []
    arrays: list[RunArrays] = []
    skipped = 0
    partial: dict[int, None] = {}  # (distinct, in order of appearance: a dict, not a list's linear scan)
    ev_at = _HEAD + nruns * _RUN
    try:
        for r in range(_HEAD, ev_at, _RUN):
            kind, e0, e1, h0, h1, t0, t1, m_at, m_n, l_at, l_n, s_at, s_n, grp, x_at, x_n = w[r : r + _RUN]
            if kind == CLEARED:
                out.append(_CLEARED)
                arrays.append(None)
                continue
            tier = GPU if m_n < 0 else normalize_tier(payload[m_at : m_at + m_n].decode())
            if kind == REMOVED:
                out.append((REMOVED, tier, hl[h0:h1], None if grp < 0 else grp, e1 - e0))
                arrays.append(ha[h0:h1])
                continue
            if s_n >= 0 and payload[s_at : s_at + s_n].decode() not in FULL_ATTENTION_KINDS:
                skipped += e1 - e0
                if grp >= 0:
                    partial[grp] = None
                continue
            if x_n >= 0 and (x_n != l_n or payload[x_at : x_at + x_n] != payload[l_at : l_at + l_n]):
                return None  # extra keys other than the adapter's name: a tenant salt (decode_batch's)
            cols = w[ev_at + e0 * _EVENT : ev_at + e1 * _EVENT]
            has = cols[0::_EVENT]
            parents = hl[nh + e0 : nh + e1]
            if 0 in has:
                parents = [x if f else None for x, f in zip(parents, has, strict=True)]
            out.append(
                (
                    STORED,
                    tier,
                    None if l_n < 0 else payload[l_at : l_at + l_n].decode(),
                    None,
                    hl[h0:h1],
                    parents,
                    cols[1::_EVENT],
                    tokens[t0:t1],
                    cols[2::_EVENT],
                    cols[3::_EVENT],
                    ha[h0:h1],
                )
            )
            arrays.append(
                (
                    work[ev_at + e0 * _EVENT : ev_at + e1 * _EVENT].reshape(e1 - e0, _EVENT),
                    ha[nh + e0 : nh + e1],
                )
            )
    except UnicodeDecodeError:
        return None  # decode_batch names it
    ts = struct.unpack("<d", struct.pack("<q", w[0]))[0]
    return ScannedBatch(
        ts, w[1] if w[2] else None, out, w[3] - skipped, skipped, tuple(partial), tuple(arrays)
    )


_CLEARED: Final[Cleared] = (CLEARED,)


def warm_up() -> None:
    """Compile (or load from numba's cache) the scan."""
    scan_batch(b"\x92\xcb" + bytes(8) + b"\x90")
