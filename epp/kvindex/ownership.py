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
        t = tiers[i]
        p = pods[i]
        bit = numba.uint32(1) << numba.uint32(p & 31)
        m = masks[t]
        if not m[r] & bit:
            continue
        m[r] &= ~bit
        counts[p, t] -= 1
        removed += 1
        held = numba.uint32(0)
        for col in masks:
            held |= col[r]
        if held == 0:
            emptied[k] = r
            k += 1
    return removed, k


def warm_up(ntiers: int = 1) -> None:
    """Compile (or load the cached machine code of) the loops for `ntiers` tier columns."""
    masks = tuple(np.zeros(1, dtype=np.uint32) for _ in range(ntiers))
    one = np.zeros(1, dtype=np.intp)
    counts = np.zeros((1, 12), dtype=np.int64)
    add_owners(masks, one, one, one, counts, np.zeros(1, dtype=np.bool_))
    drop_owners(masks, one, one, one, counts, np.zeros(1, dtype=np.intp))
