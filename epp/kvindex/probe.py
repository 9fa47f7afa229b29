"""The hash table's batched read probe: where each (key, tag) item sits, for many items at once. Pure.

Split from `table.HashTable` (whose layout it reads: `keys`, `tags`, `nb`, `size`, `tag_dtype`) because
it is the read side's hot path and its own piece of vectorised code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from epp.kvindex.keys import _U33, _U_F1, _U_F2, MASK64  # keys.fmix, inlined in place below

BUCKET: Final = 8
_TAG_MUL: Final = 0xD6E8FEB86659FD93
_U_TAG_MUL: Final = np.uint64(_TAG_MUL)
_U32: Final = np.uint64(32)
_LOW32: Final = np.uint64(0xFFFFFFFF)
_PROBE_ITEMS: Final = 1 << 15
_POS_MUL: Final = np.uint64(0x0001020304050607)  # (1 << 8p) * this has p in its top byte, for p < 8
_U56: Final = np.uint64(56)

Index = npt.NDArray[np.intp]
Array = npt.NDArray[Any]
Bools = npt.NDArray[np.bool_]


def locate(
    table: Any, keys: npt.NDArray[np.uint64], tags: Array | Sequence[int]
) -> tuple[Index, Bools, Index]:
    """`locate`, plus the two buckets of every item ((2, items) as `_pairs` gives them).

    One pass for all items, both buckets at once: hash in place; gather the keys of both buckets (one
    cache line each); compare them with the item's key, so that a bucket's 8 bools, read as one word,
    say where the key is. Where it is exactly once among the 16 slots, the word gives its slot without
    a search, and the item is there if that slot has its tag ((key, tag) items are unique), else it is
    absent; no key match: absent. The rare items whose key is there several times (under other tags)
    are settled apart (`_settle`)."""
    n = len(keys)
    per_key = isinstance(tags, np.ndarray)
    s = 1 if per_key else len(tags)
    if s * n == 0:
        return np.zeros(0, dtype=np.intp), np.zeros(0, dtype=bool), np.zeros((2, 0), dtype=np.intp)
    step = max(1, _PROBE_ITEMS // s)
    if n > step:  # bounded temporaries (about 200 bytes per item)
        parts = [
            locate(table, keys[lo : lo + step], tags[lo : lo + step] if per_key else tags)
            for lo in range(0, n, step)
        ]
        return (
            np.concatenate([p[0].reshape(s, -1) for p in parts], axis=1).reshape(-1),
            np.concatenate([p[1].reshape(s, -1) for p in parts], axis=1).reshape(-1),
            np.concatenate([p[2].reshape(2, s, -1) for p in parts], axis=2).reshape(2, -1),
        )
    mixed: list[npt.NDArray[np.uint64] | np.uint64]
    if isinstance(tags, np.ndarray):
        want: Array = tags.reshape(1, n)
        mixed = [tags.astype(np.uint64) * _U_TAG_MUL]
    else:
        want = np.array(tags, dtype=table.tag_dtype).reshape(-1, 1)
        mixed = [np.uint64((t * _TAG_MUL) & MASK64) for t in want[:, 0].tolist()]
    total = s * n

    # The two buckets of every item, as `_pairs` (in place): item s * n + i hashes keys[i] ^ mixed[s].
    h = np.empty(total, dtype=np.uint64)
    for i, t in enumerate(mixed):
        np.bitwise_xor(keys, t, out=h[i * n : (i + 1) * n])
    pair = np.empty((2, total), dtype=np.uint64)
    tmp = pair[0]  # scratch until the buckets go there
    np.right_shift(h, _U33, out=tmp)  # keys.fmix
    h ^= tmp
    h *= _U_F1
    np.right_shift(h, _U33, out=tmp)
    h ^= tmp
    h *= _U_F2
    np.right_shift(h, _U33, out=tmp)
    h ^= tmp
    np.right_shift(h, _U32, out=pair[0])
    np.bitwise_and(h, _LOW32, out=pair[1])
    pair *= np.uint64(table.nb)
    pair >>= _U32
    b1, b2 = pair[0], pair[1]
    same = b1 == b2
    if same.any():
        b2[same] = (b1[same] + np.uint64(1)) % np.uint64(table.nb)
    buckets: Index = pair.view(np.intp)  # < 2 ** 32: the same values
    if table.size == 0:
        return buckets[1] * BUCKET, np.zeros(total, dtype=bool), buckets

    # The keys of both buckets of every item, compared with the item's: the keys repeated once (not per
    # tag), so that each comparison runs over contiguous memory.
    rows = table.keys.reshape(table.nb, BUCKET).take(buckets, axis=0)  # (2, items, BUCKET)
    match = np.empty(rows.shape, dtype=bool)
    np.equal(
        rows.reshape(2, s, n, BUCKET),
        np.repeat(keys, BUCKET).reshape(n, BUCKET),
        out=match.reshape(2, s, n, BUCKET),
    )
    # A bucket's 8 bools are one word, 1 << 8p for a single match at position p.
    words = match.view(np.uint64).reshape(2, total)
    w1, w2 = words[0], words[1]
    either = w1 | w2
    found = either != 0
    multi = np.count_nonzero(match) != np.count_nonzero(found)
    slot = np.where(w1 != 0, buckets[0], buckets[1])
    either *= _POS_MUL  # 1 << 8p  ->  p in the top byte
    either >>= _U56
    slot <<= 3
    slot |= either.view(np.intp)
    slot *= found  # no key match: slot 0, the same cache line for all of them (cheaper gathers)
    # (The slot of an item whose key is there several times is garbage until settled: hence "clip".)
    found &= (table.tags.take(slot, mode="clip").reshape(s, n) == want).reshape(total)
    if multi:
        again = np.flatnonzero((np.bitwise_count(w1) + np.bitwise_count(w2)) > 1)
        _settle(table, again, slot, found, buckets, match, want, n)
    return slot, found, buckets


def _settle(
    table: Any, items: Index, slot: Index, found: Bools, buckets: Index, match: Bools, want: Array, n: int
) -> None:
    """Exact answers for `items` of `locate` (in place): key and tag compared in all 16 slots."""
    k = len(items)
    b = buckets[:, items]
    tags = want[items // n, 0] if want.shape[1] == 1 else want[0, items]
    both = match[:, items] & (table.tags.reshape(table.nb, BUCKET).take(b, axis=0) == tags[:, None])
    at = np.flatnonzero(both)  # (bucket choice * k + item) * BUCKET + position
    row = at // BUCKET
    slot[items] = 0
    found[items] = False
    slot[items[row % k]] = b.reshape(-1)[row] * BUCKET + at % BUCKET
    found[items[row % k]] = True
