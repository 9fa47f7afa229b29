"""The hash table's write and point-probe loops, compiled: `HashTable.upsert` / `insert` / `find`. Pure.

`upsert_run` takes items in order: a present one gets its slot; an absent one goes into the emptier of
its two buckets (the first on a tie), as `HashTable._insert` places an item, and a later copy of it in
the same batch then finds it. Items whose buckets are both full are set aside for the caller to
settle in one vectorised call (relocation, the cuckoo walk and growth: `table_growth.py`), and it
stops when the table reaches its load limit (`room` inserts left). `find_run` is the plain probe of
both buckets. The hashing is `table.HashTable._pair`'s (`keys.fmix` of key ^ tag * constant), as in
`prefix_walk._walk`.

Compiled with numba (`docs/architecture.md`, "Compiled loops"): batches here are often small (a few
events per flush in the simulator), where the vectorised insert's ~40 numpy calls cost more than the
work; as a loop an item costs one or two cache misses.
"""

from __future__ import annotations

from typing import Any, Final

import numba
import numpy as np

from epp.kvindex.prefetch import AHEAD, prefetch

BUCKET: Final = 8  # probe.BUCKET (a literal here: numba reads module globals as constants)
DONE: Final = 0
NO_ROOM: Final = 1


@numba.njit(cache=True, nogil=True, inline="always")
def _pair(key: Any, tag: Any, nb: int) -> tuple[Any, Any]:  # pragma: no cover - compiled
    x = key ^ (numba.uint64(tag) * numba.uint64(0xD6E8FEB86659FD93))
    x ^= x >> numba.uint64(33)
    x *= numba.uint64(0xFF51AFD7ED558CCD)
    x ^= x >> numba.uint64(33)
    x *= numba.uint64(0xC4CEB9FE1A85EC53)
    x ^= x >> numba.uint64(33)
    unb = numba.uint64(nb)
    b1 = np.int64(((x >> numba.uint64(32)) * unb) >> numba.uint64(32))
    b2 = np.int64(((x & numba.uint64(0xFFFFFFFF)) * unb) >> numba.uint64(32))
    if b2 == b1:
        b2 = (b1 + 1) % nb
    return b1, b2


@numba.njit(cache=True, nogil=True, inline="always")
def _probe(tkeys: Any, ttags: Any, count: Any, b: int, key: Any, tag: Any) -> int:  # pragma: no cover
    base = b * BUCKET
    for s in range(base, base + np.int64(count[b])):
        if tkeys[s] == key and ttags[s] == tag:
            return s
    return -1


@numba.njit(cache=True, nogil=True, inline="always")
def find_one(tkeys: Any, ttags: Any, count: Any, nb: int, key: Any, tag: Any) -> tuple[Any, Any, Any]:
    """(the slot of (key, tag) or -1, its first bucket, its second bucket)."""  # pragma: no cover
    b1, b2 = _pair(key, tag, nb)
    s = _probe(tkeys, ttags, count, b1, key, tag)
    if s < 0:
        s = _probe(tkeys, ttags, count, b2, key, tag)
    return s, b1, b2


@numba.njit(cache=True, nogil=True, inline="always")
def prefetch_pair(tkeys: Any, count: Any, nb: int, key: Any, tag: Any) -> None:  # pragma: no cover
    """Start loading what probing (key, tag) reads first: both buckets' counts and keys."""
    b1, b2 = _pair(key, tag, nb)
    prefetch(count, b1)
    prefetch(count, b2)
    prefetch(tkeys, b1 * BUCKET)
    prefetch(tkeys, b2 * BUCKET)


@numba.njit(cache=True, nogil=True, inline="always")
def place(  # pragma: no cover - compiled
    tkeys: Any, ttags: Any, count: Any, b1: Any, b2: Any, key: Any, tag: Any
) -> Any:
    """Put an absent item into the emptier of its buckets (the first on a tie): its slot, or -1 (nothing
    written) when that bucket is full."""
    b = b2 if count[b2] < count[b1] else b1
    c = np.int64(count[b])
    if c >= BUCKET:
        return -1
    s = b * BUCKET + c
    tkeys[s] = key
    ttags[s] = tag
    count[b] = c + 1
    return s


@numba.njit(cache=True, nogil=True)
def kick_place(tkeys: Any, ttags: Any, count: Any, nb: int, key: Any, tag: Any) -> tuple[Any, Any, Any]:
    """Place an absent item whose two buckets are both full by moving one occupant of them to that
    occupant's other bucket, the first (in bucket order) whose other bucket has room: one cuckoo step,
    which is all an item needs at the loads the tables run at. Returns (the item's slot, the occupant's
    old slot, its new slot: the caller moves its columns), or (-1, -1, -1), nothing changed, when no
    occupant can move. When a bucket has room after all (the table grew since the item was set aside), the
    item simply goes there: (its slot, -1, -1)."""  # pragma: no cover - compiled
    b1, b2 = _pair(key, tag, nb)
    s = place(tkeys, ttags, count, b1, b2, key, tag)
    if s >= 0:
        return s, -1, -1
    for b in (b1, b2):
        for s in range(b * BUCKET, b * BUCKET + np.int64(count[b])):
            o1, o2 = _pair(tkeys[s], ttags[s], nb)
            alt = o2 if o1 == b else o1
            c = np.int64(count[alt])
            if c < BUCKET:
                d = alt * BUCKET + c
                tkeys[d] = tkeys[s]
                ttags[d] = ttags[s]
                count[alt] = c + 1
                tkeys[s] = key
                ttags[s] = tag
                return s, s, d
    return -1, -1, -1


@numba.njit(cache=True, nogil=True)
def find_scalar(tkeys: Any, ttags: Any, count: Any, nb: int, key: int, tag: int) -> Any:  # pragma: no cover
    """The slot of one (key, tag), or -1. `key` comes as a signed 64-bit int (the key's bits: Python ints
    of 2^63 and above do not pass as a numba int64), reinterpreted here as the unsigned key."""
    return find_one(tkeys, ttags, count, nb, numba.uint64(key), tag)[0]


@numba.njit(cache=True, nogil=True)
def find_run(  # pragma: no cover - compiled
    tkeys: Any, ttags: Any, count: Any, nb: int, keys: Any, tags: Any, out: Any
) -> None:
    """out[i]: the slot of (keys[i], tags[i]), or -1."""
    n = keys.shape[0]
    for i in range(n):
        if i + AHEAD < n:
            prefetch_pair(tkeys, count, nb, keys[i + AHEAD], tags[i + AHEAD])
        out[i] = find_one(tkeys, ttags, count, nb, keys[i], tags[i])[0]


@numba.njit(cache=True, nogil=True)
def upsert_run(  # pragma: no cover - compiled
    tkeys: Any,
    ttags: Any,
    count: Any,
    nb: int,
    keys: Any,
    tags: Any,
    start: int,
    room: int,
    slots: Any,
    new: Any,
    stuck: Any,
    nstuck: int,
) -> tuple[int, int, int]:
    """Items start, start + 1, ...: slots[i] = the slot of item i, inserting it (new[i] = True) when absent;
    an absent item whose buckets are both full is added to `stuck` (its first `nstuck` are taken) and
    left for the caller. Returns (the item it stopped at, DONE | NO_ROOM, items now in `stuck`)."""
    n = keys.shape[0]
    for i in range(start, n):
        if i + AHEAD < n:
            prefetch_pair(tkeys, count, nb, keys[i + AHEAD], tags[i + AHEAD])
        key = keys[i]
        tag = tags[i]
        s, b1, b2 = find_one(tkeys, ttags, count, nb, key, tag)
        if s >= 0:
            slots[i] = s
            continue
        if room <= 0:
            return i, NO_ROOM, nstuck
        s = place(tkeys, ttags, count, b1, b2, key, tag)
        if s < 0:
            stuck[nstuck] = i
            nstuck += 1
            continue
        room -= 1
        slots[i] = s
        new[i] = True
    return n, DONE, nstuck


@numba.njit(cache=True, nogil=True, inline="always")
def bucket_moves(  # pragma: no cover - compiled
    ttags: Any, count: Any, empty_tag: Any, b: Any, src: Any, dest: Any, moves: Any
) -> tuple[Any, Any, Any]:
    """The moves that close up bucket b once some of its items are deleted (their tags `empty_tag`), its
    other items kept in order in its first slots: src[moves:] to dest[moves:], which change nothing yet
    (no move reads a slot an earlier one writes). Returns (moves now, items kept, items before)."""
    base = b * BUCKET
    c = np.int64(count[b])
    k = 0
    for j in range(c):
        if ttags[base + j] != empty_tag:
            if j != k:
                src[moves] = base + j
                dest[moves] = base + k
                moves += 1
            k += 1
    return moves, k, c


@numba.njit(cache=True, nogil=True)
def delete_run(  # pragma: no cover - compiled
    tkeys: Any, ttags: Any, count: Any, empty_tag: int, slots: Any, src: Any, dest: Any, tail: Any
) -> tuple[int, int]:
    """Delete the items at `slots` (occupied; repeats allowed): each bucket they were in keeps its other
    items in order in its first slots (`bucket_moves`). Moves keys and tags; the caller moves the columns
    the same way, src[:moves] to dest[:moves] (as one gather: no move reads a slot an earlier one wrote),
    and empties them at tail[:freed]. Returns (moves, freed)."""
    for i in range(slots.shape[0]):
        ttags[slots[i]] = empty_tag
    moves = 0
    freed = 0
    for i in range(slots.shape[0]):
        b = slots[i] // BUCKET
        first = moves
        moves, k, c = bucket_moves(ttags, count, empty_tag, b, src, dest, moves)
        for m in range(first, moves):
            tkeys[dest[m]] = tkeys[src[m]]
            ttags[dest[m]] = ttags[src[m]]
        for s in range(b * BUCKET + k, b * BUCKET + c):
            tkeys[s] = 0  # no stale copies of moved keys: lookups of them stay on the fast path
            ttags[s] = empty_tag
            tail[freed] = s
            freed += 1
        count[b] = k
    return moves, freed


@numba.njit(cache=True, nogil=True)
def split_run(  # pragma: no cover - compiled
    okeys: Any,
    otags: Any,
    ocount: Any,
    onb: int,
    lo: int,
    hi: int,
    nkeys: Any,
    ntags: Any,
    ncount: Any,
    src: Any,
    dest: Any,
    left: Any,
) -> tuple[int, int]:
    """Double a table (`table_growth.split`), old buckets lo..hi - 1: the item in slot j of old bucket b
    goes to new bucket 2b or 2b + 1, the same choice (first or second) of its pair; items whose pair was
    adjusted (equal choices) are left for the caller (`left`). Moves keys and tags; the caller moves
    the columns, src[:moved] to dest[:moved]. Returns (moved, left)."""
    nnb = 2 * onb
    moved = 0
    nleft = 0
    u32 = numba.uint64(32)
    low = numba.uint64(0xFFFFFFFF)
    for b in range(lo, hi):
        base = b * BUCKET
        for j in range(np.int64(ocount[b])):
            s = base + j
            key = okeys[s]
            x = key ^ (numba.uint64(otags[s]) * numba.uint64(0xD6E8FEB86659FD93))
            x ^= x >> numba.uint64(33)
            x *= numba.uint64(0xFF51AFD7ED558CCD)
            x ^= x >> numba.uint64(33)
            x *= numba.uint64(0xC4CEB9FE1A85EC53)
            x ^= x >> numba.uint64(33)
            hi = x >> u32
            if np.int64((hi * numba.uint64(onb)) >> u32) == b:
                side = np.int64((hi * numba.uint64(nnb)) >> u32) - 2 * b
            else:
                side = np.int64(((x & low) * numba.uint64(nnb)) >> u32) - 2 * b
            if side != 0 and side != 1:
                left[nleft] = s
                nleft += 1
                continue
            nbk = 2 * b + side
            d = nbk * BUCKET + np.int64(ncount[nbk])
            ncount[nbk] += 1
            nkeys[d] = key
            ntags[d] = otags[s]
            src[moved] = s
            dest[moved] = d
            moved += 1
    return moved, nleft


@numba.njit(cache=True, nogil=True)
def move_rows(new: Any, old: Any, src: Any, dest: Any, moved: int) -> None:  # pragma: no cover - compiled
    """new[dest[k]] = old[src[k]] for k < moved: a column's rows after `split_run` (numpy's fancy indexing
    does the same through a temporary, at a few times the cost)."""
    for k in range(moved):
        new[dest[k]] = old[src[k]]


def warm_up() -> None:
    """Compile (or load the cached machine code of) the loops for the index's key and tag types now."""
    for tag_dtype in (np.uint16, np.uint32):
        tkeys = np.zeros(2 * BUCKET, dtype=np.uint64)
        ttags = np.full(2 * BUCKET, np.iinfo(tag_dtype).max, dtype=tag_dtype)
        count = np.zeros(2, dtype=np.uint8)
        keys = np.array([1], dtype=np.uint64)
        tags = np.array([1], dtype=tag_dtype)
        slots = np.full(1, -1, dtype=np.intp)
        upsert_run(tkeys, ttags, count, 2, keys, tags, 0, 1, slots, np.zeros(1, dtype=np.bool_), slots, 0)
        find_run(tkeys, ttags, count, 2, keys, tags, slots)
        buf = np.zeros(BUCKET, dtype=np.intp)
        delete_run(
            tkeys, ttags, count, int(np.iinfo(tag_dtype).max), np.zeros(1, dtype=np.intp), buf, buf, buf
        )
        find_scalar(tkeys, ttags, count, 2, 1, 1)
        kick_place(tkeys, ttags, count, 2, keys[0], tags[0])
        big = (
            np.zeros(4 * BUCKET, dtype=np.uint64),
            np.full(4 * BUCKET, ttags[0]),
            np.zeros(4, dtype=np.uint8),
        )
        split_run(tkeys, ttags, count, 2, 0, 2, *big, buf, buf, buf)
    for dtype in (np.uint64, np.uint32):  # the columns' types (`holdings.py`)
        col = np.zeros(BUCKET, dtype=dtype)
        move_rows(col, col, np.zeros(1, dtype=np.intp), np.zeros(1, dtype=np.intp), 1)
