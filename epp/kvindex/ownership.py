"""Owners of index entries: `Holdings._own` and the removal of units, as compiled loops. Pure.

An entry is its pod's bit in the tier's mask of the key's `blocks` row (`holdings.py`). `add_owners`
sets the bit of each item, or, when it is already set (another owner, or an earlier item of the same
batch), flags the item: the caller counts it in the `multi` table. `drop_owners` clears the bits of
items whose entry has no other owner (the caller takes the vectorised path whenever `multi` holds
anything) and reports the rows left with no bit in any tier, for the caller to delete. Both keep the
per-(pod, tier) entry counts. Items are taken in order, which gives the batch semantics of the
vectorised version (an entry named twice gains one bit and one extra owner, or loses its bit once).

`add_units` and `remove_units` add and remove whole units in the common case (records that own only
their implicit key): stamps, tier bits, accounting and the key's bit, one pass over the batch.
`own_batch` is the vectorised version of `Holdings._own` (it sorts the batch's (row, tier, pod) ids to
merge repeats, ~25 numpy calls per flush): the path while `multi` holds anything, and the reference the
loops are tested against.

Compiled with numba (`docs/architecture.md`, "Compiled loops").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numba
import numpy as np
import numpy.typing as npt

from epp.kvindex.cuckoo import BUCKET, _pair, find_one, place
from epp.kvindex.prefetch import AHEAD, prefetch
from epp.kvindex.rolling import fmix

if TYPE_CHECKING:
    from epp.kvindex.holdings import U64, Holdings
    from epp.kvindex.probe import Index


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


@numba.njit(cache=True, nogil=True, inline="always")
def has_extra_rows(v: Any) -> bool:  # pragma: no cover - compiled
    """Whether a record of `info` v owns keys besides its implicit one (rows in `extra`)."""
    nk: Any = (v >> numba.uint32(8)) & numba.uint32(0xFFF)
    return bool(nk > (1 if (v & numba.uint32(0xFF)) == 0 else 0))


@numba.njit(cache=True, nogil=True, inline="always")
def _with_extra_rows(info: Any, slots: Any) -> bool:  # pragma: no cover - compiled
    """Whether a record at `slots` owns keys besides its implicit one (rows in `extra`)."""
    for i in range(slots.shape[0]):  # noqa: SIM110 (numba compiles no generator inside any())
        if has_extra_rows(info[slots[i]]):
            return True
    return False


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
    `gone`, a block row left with no bit to `emptied` (the caller deletes both). A unit named again is
    removed once (`Holdings.remove_units` names each once; `removal_loop.remove_held` may not). Returns
    (entries removed, `used` released, records gone, rows emptied), or (-1, 0, 0, 0), changing nothing,
    when a record has `extra` rows."""
    if _with_extra_rows(info, slots):
        return -1, 0, 0, 0
    removed = 0
    used: Any = 0
    ngone = 0
    nempty = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        t = tiers[i]
        v = info[s]
        tbit = numba.uint32(1) << numba.uint32(t + 20)
        if not v & tbit:
            continue  # a unit named again (`removal_loop.remove_held`'s batches): removed already
        pod = np.int64(rtags[s])
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
        v &= ~tbit
        info[s] = v
        if (v >> numba.uint32(20)) == 0:
            gone[ngone] = s
            ngone += 1
    return removed, used, ngone, nempty


@numba.njit(cache=True, nogil=True)
def add_units(  # pragma: no cover - compiled
    state: Any,
    info: Any,
    rtags: Any,
    stamps: Any,
    masks: Any,
    bkeys: Any,
    btags: Any,
    bcount: Any,
    nb: int,
    room: int,
    counts: Any,
    units: Any,
    slots: Any,
    tiers: Any,
    stamp_of: Any,
    keys: Any,
    copies: Any,
    later: Any,
    again: Any,
) -> tuple[int, int, int, int, int, int]:
    """The unit half of `Holdings.add` for distinct units (slots[i], tiers[i]) whose records own only
    their implicit key (no `extra` rows): each gets its stamp; one held already is listed in `copies` (the
    caller counts one more copy); a new one gets its tier bit and its accounting, and its record's key
    (keys[i]) its pod's bit on the tier, in a `blocks` row inserted when absent (`room` inserts at most;
    an item whose two buckets are full, or past `room`, goes to `later` for the caller's `_own`). An
    item whose bit was set already goes to `again` (the caller counts the owner in `multi`). Returns
    (copies, later, again, `used` added, entries created, rows inserted), or -1s, changing nothing, when
    a record has `extra` rows."""
    if _with_extra_rows(info, slots):
        return -1, -1, -1, -1, -1, -1
    ncopies = nlater = nagain = 0
    used: Any = 0
    created = 0
    inserted = 0
    n = slots.shape[0]
    for i in range(n):
        if i + 2 * AHEAD < n:  # the record a few items on: its state (for its key), info and stamp
            s = slots[i + 2 * AHEAD]
            prefetch(state, s)
            prefetch(info, s)
            prefetch(stamps[tiers[i + 2 * AHEAD]], s)
        if i + AHEAD < n:  # the blocks buckets its key probes, and their masks (its state is loaded)
            s = slots[i + AHEAD]
            b1, b2 = _pair(fmix(state[s]), np.int64(rtags[s]) >> 5, nb)
            prefetch(bcount, b1)
            prefetch(bcount, b2)
            prefetch(bkeys, b1 * BUCKET)
            prefetch(bkeys, b2 * BUCKET)
            m = masks[tiers[i + AHEAD]]
            prefetch(m, b1 * BUCKET)
            prefetch(m, b2 * BUCKET)
        s = slots[i]
        t = tiers[i]
        stamps[t][s] = stamp_of[i]
        tbit = numba.uint32(1) << numba.uint32(t + 20)
        v = info[s]
        if v & tbit:
            copies[ncopies] = i
            ncopies += 1
            continue
        info[s] = v | tbit
        pod = np.int64(rtags[s])
        units[pod] += 1
        nk = np.int64((v >> numba.uint32(8)) & numba.uint32(0xFFF))
        used += nk if nk > 1 else 1
        if nk == 0:
            continue  # a block shorter than an index block completes no key
        key = fmix(state[s])
        keys[i] = key
        tag = pod >> 5
        r, b1, b2 = find_one(bkeys, btags, bcount, nb, key, tag)
        if r < 0:
            r = place(bkeys, btags, bcount, b1, b2, key, tag) if room > 0 else -1
            if r < 0:
                later[nlater] = i
                nlater += 1
                continue
            room -= 1
            inserted += 1
        m = masks[t]
        bit = numba.uint32(1) << numba.uint32(pod & 31)
        if m[r] & bit:
            again[nagain] = i
            nagain += 1
        else:
            m[r] |= bit
            counts[pod, t] += 1
            created += 1
    return ncopies, nlater, nagain, used, created, inserted


def own_batch(
    h: Holdings, keys: U64, pods: Index, tiers: Index, tags: npt.NDArray[np.uint16], sign: int
) -> int:
    """`Holdings._own` for a whole batch at once, with vectorised calls (repeats merged by sorting):
    the path while `multi` holds anything, and the reference the loops above are tested against."""
    from epp.kvindex.holdings import CHUNK_BITS, MAX_TIERS  # (holdings imports this module)

    if sign > 0:
        rows, _ = h.blocks.upsert(keys, tags, {})
    else:
        rows = h.blocks.find(keys, tags)
        ok = rows >= 0  # always, unless the tables disagree
        keys, pods, tiers, rows = keys[ok], pods[ok], tiers[ok], rows[ok]
    ids = (rows * MAX_TIERS + tiers) * 32 + (pods & 31)  # one per (key, pod, tier)
    ids.sort(kind="stable")  # (faster than the default here) items naming one entry are alike: keep one
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    owners = np.diff(np.r_[starts, len(ids)])  # how many items name each entry
    ids = ids[starts]
    rows = ids // (MAX_TIERS * 32)
    tiers = (ids // 32) % MAX_TIERS
    pods = (h.blocks.tags[rows].astype(np.intp) << CHUNK_BITS) | (ids & 31)
    keys = h.blocks.keys[rows]
    bits = np.left_shift(np.uint32(1), (pods & 31).astype(np.uint32))
    present = np.flatnonzero(np.bincount(tiers, minlength=h.ntiers)).tolist()
    by_tier = [(h.blocks.cols[f"m{t}"], tiers == t) for t in present]
    had = np.zeros(len(rows), dtype=bool)
    for mask, sel in by_tier:
        had[sel] = (mask[rows[sel]] & bits[sel]) != 0
    multi_tags = (pods | (tiers << 16)).astype(np.uint32)
    if sign > 0:
        extra = owners - 1 + had
        changed = ~had
        for mask, sel in by_tier:
            np.bitwise_or.at(mask, rows[sel & changed], bits[sel & changed])
        more = np.flatnonzero(extra)
        if more.size:
            at, _ = h.multi.upsert(keys[more], multi_tags[more], {})
            h.multi.cols["n"][at] += extra[more].astype(np.uint32)
    else:
        extra = np.zeros(len(rows), dtype=np.int64)
        at = np.full(len(rows), -1, dtype=np.intp)
        if h.multi.size:
            at = h.multi.find(keys, multi_tags)
            extra[at >= 0] = h.multi.cols["n"][at[at >= 0]]
        left = 1 + extra - owners  # owners still there
        changed = left <= 0
        for mask, sel in by_tier:
            np.bitwise_and.at(mask, rows[sel & changed], ~bits[sel & changed])
        has = np.flatnonzero(at >= 0)
        if has.size:
            h.multi.cols["n"][at[has]] = np.maximum(left[has] - 1, 0).astype(np.uint32)
            h.multi.delete(at[has][left[has] <= 1])
        emptied = rows[changed]
        held = np.zeros(len(emptied), dtype=np.uint32)
        for t in range(h.ntiers):
            held |= h.blocks.cols[f"m{t}"][emptied]
        h.blocks.delete(emptied[held == 0])
    n = np.bincount(pods[changed] * MAX_TIERS + tiers[changed], minlength=len(h.units) * MAX_TIERS)
    h.counts += sign * n.reshape(len(h.units), MAX_TIERS)
    created = int(changed.sum())
    h.entries += sign * created
    return created


def warm_up(ntiers: int = 1) -> None:
    """Compile (or load the cached machine code of) the loops for `ntiers` tier columns."""
    masks = tuple(np.zeros(1, dtype=np.uint32) for _ in range(ntiers))
    one = np.zeros(1, dtype=np.intp)
    counts = np.zeros((1, 12), dtype=np.int64)
    add_owners(masks, one, one, one, counts, np.zeros(1, dtype=np.bool_))
    drop_owners(masks, one, one, one, counts, np.zeros(1, dtype=np.intp))
    u64, u32, u16 = np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.uint32), np.zeros(1, dtype=np.uint16)
    out = np.zeros(1, dtype=np.intp)
    stamps = masks  # (uint32 columns, one per tier)
    add_units(
        u64, u32, u16, stamps, masks, u64, u16, np.zeros(1, dtype=np.uint8), 1, 0, counts, out, one,
        one, u32, u64, out, out, out,
    )  # fmt: skip
    remove_units(
        u64, u32, u16, masks, masks, u64, u16, np.zeros(1, dtype=np.uint8), 1, counts, out, one, one, out, out
    )
