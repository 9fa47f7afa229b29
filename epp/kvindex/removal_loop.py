"""A flush's removals in the common case, as one compiled loop: `IndexRemovals._apply_removals`. Pure.

`remove_held` takes the batch's queued removals as (engine hash, pod, tier) items and does in one pass
what `records.find`, the held filter, `Holdings.remove_copies` and `Holdings._remove_simple` (with its two
`HashTable.delete`s) do as ~40 numpy calls: it finds each item's record, skips an item whose unit is not
held (a discard of a block the pod does not hold there, or a unit named twice: its first removal took
it), removes the held units by `ownership.remove_units`, and deletes the emptied `blocks` rows and the
records left on no tier, their columns moving with them as `HashTable.delete` moves them (its buckets
closed up by `cuckoo.bucket_moves`, as there). The caller takes it only while no unit has extra copies
and no entry extra owners (the `copies` and `multi` tables are empty), as `Holdings.remove_units` takes
`ownership.remove_units`; when a held record owns keys besides its implicit one (rows in `extra`) it
changes nothing and leaves the items' slots for the general path.

Compiled with numba (`docs/architecture.md`, "Compiled loops").
"""

from __future__ import annotations

from typing import Any, Final

import numba
import numpy as np

from epp.kvindex.cuckoo import BUCKET, bucket_moves, find_one
from epp.kvindex.ownership import remove_units

EXTRA_ROWS: Final = -1
"""`remove_held`'s first result when a held record has `extra` rows: nothing changed."""


@numba.njit(cache=True, nogil=True, inline="always")
def _compact(  # pragma: no cover - compiled
    tkeys: Any, ttags: Any, count: Any, empty_tag: Any, slots: Any, n: int, c64: Any, cols: Any, empties: Any
) -> Any:
    """`cuckoo.delete_run` over slots[:n] with the columns moved along instead of by the caller: the
    uint64 column `c64` (emptied to 0; a table without one passes its keys) and the uint32 columns of the
    tuple `cols` (cols[j] emptied to empties[j]). Returns the slots freed."""
    for i in range(n):
        ttags[slots[i]] = empty_tag
    plan = np.empty((2, BUCKET), dtype=np.intp)  # a bucket's moves: sources, destinations
    freed: Any = 0
    for i in range(n):
        b = slots[i] // BUCKET
        moves, k, c = bucket_moves(ttags, count, empty_tag, b, plan[0], plan[1], 0)
        for m in range(moves):
            src, dst = plan[0, m], plan[1, m]
            tkeys[dst] = tkeys[src]
            ttags[dst] = ttags[src]
            c64[dst] = c64[src]
            for col in cols:
                col[dst] = col[src]
        for s in range(b * BUCKET + k, b * BUCKET + c):
            tkeys[s] = 0
            ttags[s] = empty_tag
            c64[s] = 0
            for m in range(len(cols)):
                cols[m][s] = empties[m]
        freed += c - k
        count[b] = k
    return freed


@numba.njit(cache=True, nogil=True)
def remove_held(  # pragma: no cover - compiled
    rkeys: Any,
    rtags: Any,
    rcount: Any,
    rnb: int,
    r_empty: int,
    state: Any,
    info: Any,
    stamps: Any,
    masks: Any,
    bkeys: Any,
    btags: Any,
    bcount: Any,
    bnb: int,
    b_empty: int,
    counts: Any,
    units: Any,
    hashes: Any,
    pods: Any,
    tiers: Any,
    slots: Any,
) -> tuple[int, int, int, int]:
    """Items (hashes[i], pods[i], tiers[i]): slots[i] = the record's slot when the unit is held, else -1.
    Then, unless a held record has `extra` rows (returns (EXTRA_ROWS, 0, 0, 0), nothing changed), each held
    unit is removed once (by `ownership.remove_units`) and the emptied `blocks` rows and the records on no
    tier are deleted (the records' columns `state`, `info` and the stamps emptied to 0, 0 and
    0xFFFFFFFF, the rows' masks to 0). Returns (entries removed, `used` released, records freed, rows
    freed)."""
    n = hashes.shape[0]
    held = np.empty(n, dtype=np.intp)  # the held items' slots and tiers
    htiers = np.empty(n, dtype=np.intp)
    nheld = 0
    for i in range(n):
        s = find_one(rkeys, rtags, rcount, rnb, hashes[i], pods[i])[0]
        if s >= 0 and (info[s] >> numba.uint32(tiers[i] + 20)) & numba.uint32(1) == 0:
            s = -1
        slots[i] = s
        if s >= 0:
            held[nheld] = s
            htiers[nheld] = tiers[i]
            nheld += 1
    gone = np.empty(nheld, dtype=np.intp)
    emptied = np.empty(nheld, dtype=np.intp)
    removed, used, ngone, nempty = remove_units(
        state, info, rtags, stamps, masks, bkeys, btags, bcount, bnb, counts, units, held[:nheld],
        htiers[:nheld], gone, emptied,
    )  # fmt: skip
    if removed < 0:  # a held record has `extra` rows: nothing changed
        return EXTRA_ROWS, 0, 0, 0
    rows_freed = 0
    if nempty:
        zeros = np.zeros(len(masks), dtype=np.uint32)
        rows_freed = _compact(bkeys, btags, bcount, b_empty, emptied, nempty, bkeys, masks, zeros)
    rec_freed = 0
    if ngone:
        cols = (info, *stamps)
        empties = np.full(len(cols), 0xFFFFFFFF, dtype=np.uint32)
        empties[0] = 0
        rec_freed = _compact(rkeys, rtags, rcount, r_empty, gone, ngone, state, cols, empties)
    return removed, used, rec_freed, rows_freed


def warm_up(ntiers: int = 1) -> None:
    """Compile (or load the cached machine code of) the loop for `ntiers` tier columns."""
    cols = tuple(np.zeros(BUCKET, dtype=np.uint32) for _ in range(ntiers))
    u64, u32 = np.zeros(BUCKET, dtype=np.uint64), np.zeros(BUCKET, dtype=np.uint32)
    tags = np.full(BUCKET, 0xFFFF, dtype=np.uint16)
    count = np.zeros(1, dtype=np.uint8)
    one = np.zeros(1, dtype=np.intp)
    remove_held(
        u64, tags, count, 1, 0xFFFF, u64, u32, cols, cols, u64, tags, count, 1, 0xFFFF,
        np.zeros((1, 12), dtype=np.int64), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.uint64),
        np.zeros(1, dtype=np.uint16), one, np.zeros(1, dtype=np.intp),
    )  # fmt: skip
