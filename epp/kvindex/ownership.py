"""The compiled loops of `Holdings._own`: one owner of (key, pod, tier) added or dropped per item. Pure.

An entry is its pod's bit in the tier's mask of the key's `blocks` row (`holdings.py`). `add_owners`
sets the bit of each item, or, when it is already set (another owner, or an earlier item of the same
batch), flags the item: the caller counts it in the `multi` table. `drop_owners` clears the bits of
items whose entry has no other owner (the caller takes the vectorised path whenever `multi` holds
anything) and reports the rows left with no bit in any tier, for the caller to delete. Both keep the
per-(pod, tier) entry counts. Items are taken in order, which gives the batch semantics of the
vectorised version (an entry named twice gains one bit and one extra owner, or loses its bit once).

Compiled with numba (`docs/architecture.md`, "Compiled loops"): the vectorised version sorted the
batch's (row, tier, pod) ids to merge repeats, ~25 numpy calls per flush.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from epp.kvindex.block_chain import fmix
from epp.kvindex.cuckoo import find_one


@numba.njit(cache=True, nogil=True)
def add_owners(  # pragma: no cover - compiled
    masks: Any, rows: Any, pods: Any, tiers: Any, counts: Any, again: Any
) -> int:
    """Set each item's bit; again[i] = True where it was set already. Returns the entries created."""
    created = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        t = tiers[i]
        p = pods[i]
        bit = numba.uint32(1) << numba.uint32(p & 31)
        m = masks[t]
        if m[r] & bit:
            again[i] = True
        else:
            m[r] |= bit
            counts[p, t] += 1
            created += 1
    return created


@numba.njit(cache=True, nogil=True, inline="always")
def _clear(masks: Any, counts: Any, r: Any, t: Any, p: Any) -> int:  # pragma: no cover - compiled
    """Clear pod p's bit on tier t of block row r: 0 when it was not set, 1 when it was, 2 when the
    row then holds no bit on any tier."""
    bit = numba.uint32(1) << numba.uint32(p & 31)
    m = masks[t]
    if not m[r] & bit:
        return 0
    m[r] &= ~bit
    counts[p, t] -= 1
    held = numba.uint32(0)
    for col in masks:
        held |= col[r]
    return 2 if held == 0 else 1


@numba.njit(cache=True, nogil=True)
def drop_owners(  # pragma: no cover - compiled
    masks: Any, rows: Any, pods: Any, tiers: Any, counts: Any, emptied: Any
) -> tuple[int, int]:
    """Clear each item's bit (rows < 0 are skipped). Returns (entries removed, rows emptied: the first
    ones of `emptied`)."""
    removed = 0
    k = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        cleared = _clear(masks, counts, r, tiers[i], pods[i])
        removed += cleared > 0
        if cleared == 2:
            emptied[k] = r
            k += 1
    return removed, k


@numba.njit(cache=True, nogil=True)
def remove_units(  # pragma: no cover - compiled
    state: Any,
    info: Any,
    rtags: Any,
    stamps: Any,
    masks: Any,
    bkeys: Any,
    btags: Any,
    bcount: Any,
    nb: int,
    counts: Any,
    units: Any,
    slots: Any,
    tiers: Any,
    gone: Any,
    emptied: Any,
) -> tuple[int, int, int, int]:
    """`Holdings.remove_units` for units whose records own only their implicit key (no `extra` rows),
    while no entry has extra owners and no unit extra copies (the caller checks the tables): per unit,
    its accounting, its key's bit on its tier, its stamp and tier bit; a record left on no tier goes to
    `gone`, a block row left with no bit to `emptied` (the caller deletes both). Returns (entries
    removed, `used` released, records gone, rows emptied), or (-1, 0, 0, 0), changing nothing, when a
    record has `extra` rows."""
    for i in range(slots.shape[0]):
        v = info[slots[i]]
        nk: Any = (v >> numba.uint32(8)) & numba.uint32(0xFFF)
        if nk > (1 if (v & numba.uint32(0xFF)) == 0 else 0):
            return -1, 0, 0, 0
    removed = 0
    used: Any = 0
    ngone = 0
    nempty = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        t = tiers[i]
        pod = np.int64(rtags[s])
        v = info[s]
        nk = np.int64((v >> numba.uint32(8)) & numba.uint32(0xFFF))
        units[pod] -= 1
        used += nk if nk > 1 else 1
        if nk > 0 and (v & numba.uint32(0xFF)) == 0:  # the record's key, implied by its state
            r = find_one(bkeys, btags, bcount, nb, fmix(state[s]), pod >> 5)[0]
            if r >= 0:
                cleared = _clear(masks, counts, r, t, pod)
                removed += cleared > 0
                if cleared == 2:
                    emptied[nempty] = r
                    nempty += 1
        stamps[t][s] = numba.uint32(0xFFFFFFFF)
        v &= ~(numba.uint32(1) << numba.uint32(t + 20))
        info[s] = v
        if (v >> numba.uint32(20)) == 0:
            gone[ngone] = s
            ngone += 1
    return removed, used, ngone, nempty


def warm_up(ntiers: int = 1) -> None:
    """Compile (or load the cached machine code of) the loops for `ntiers` tier columns."""
    masks = tuple(np.zeros(1, dtype=np.uint32) for _ in range(ntiers))
    one = np.zeros(1, dtype=np.intp)
    counts = np.zeros((1, 12), dtype=np.int64)
    add_owners(masks, one, one, one, counts, np.zeros(1, dtype=np.bool_))
    drop_owners(masks, one, one, one, counts, np.zeros(1, dtype=np.intp))
    u64, u32, u16 = np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.uint32), np.zeros(1, dtype=np.uint16)
    out = np.zeros(1, dtype=np.intp)
    remove_units(
        u64, u32, u16, masks, masks, u64, u16, np.zeros(1, dtype=np.uint8), 1, counts, out, one, one, out, out
    )
