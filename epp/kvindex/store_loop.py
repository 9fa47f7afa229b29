"""A flush's stores in the common case, as one compiled call: the body of `Holdings.add`. Pure.

`store_batch` chains the batch's blocks (`block_chain.chain_blocks`, `block_rows`) and then, when the
caller says the batch may take the fast path (no (pod, engine hash) stored twice, room in `records` for
every block without growth, `blocks` grown beforehand for a row per block), does what `records.upsert`
(the compiled `cuckoo.upsert_run`, the column writes, `_settle`'s cuckoo steps) and `Holdings._add_units`
(`ownership.add_units`) do, with the same results: the same slots, in the same order. Where that path
does not apply it stops at a point the general path takes over from, with everything it computed:

- CHAINED: only the chain and the rows are done (not the fast path, or a record, held or new, owns keys
  besides its implicit one: `extra` rows), nothing in the tables changed;
- STUCK: the records are placed except stuck[k:nstuck] (both buckets full and more than `cuckoo`'s single
  step can place, or too many of them: `table.HashTable._settle` takes them), the units not added;
- DONE: all of it; the caller counts what `ownership.add_units` left to it (extra copies and owners, and
  keys without room in `blocks`).

A Python `add` took ~40 numpy calls and 9 compiled calls around the same loops (a simulator flush of ~25
blocks: ~45 us in `Holdings.add`).

Compiled with numba (`docs/architecture.md`, "Compiled loops").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, NamedTuple

import numba
import numpy as np
import numpy.typing as npt

from epp.kvindex.block_chain import block_rows, chain_blocks
from epp.kvindex.cuckoo import _pair, find_one, kick_place, place, prefetch_pair
from epp.kvindex.ownership import add_units, has_extra_rows
from epp.kvindex.prefetch import AHEAD

if TYPE_CHECKING:
    from epp.kvindex.holdings import U64, Batch, Holdings
    from epp.kvindex.probe import Index

DONE: Final = 0
CHAINED: Final = 1
STUCK: Final = 2
KICK_ITEMS: Final = 16  # table._KICK_ITEMS: more stuck items than this go to `_insert` together
WI_ROWS: Final = 9
"""Rows of the intp workspace: nkeys, npend, nextra, tiers, slots, stuck, copies, later, again."""
WU_ROWS: Final = 2
"""Blocks' worth of uint64 workspace before the `extra` keys: the chain states, the units' keys."""


@numba.njit(cache=True, nogil=True)
def store_batch(  # pragma: no cover - compiled
    ev: Any,
    s0: Any,
    tokens: Any,
    bs: int,
    stamp: int,
    fast: bool,
    rkeys: Any,
    rtags: Any,
    rcount: Any,
    rnb: int,
    state: Any,
    info: Any,
    stamps: Any,
    masks: Any,
    bkeys: Any,
    btags: Any,
    bcount: Any,
    bnb: int,
    broom: int,
    counts: Any,
    units: Any,
    hashes: Any,
    wi: Any,
    wu: Any,
    w32: Any,
    tags: Any,
    new: Any,
) -> tuple[int, int, int, int, int, int, int, int, int, int, int]:
    """The batch's events are the columns of `ev` (rows pid, tid, blocks, tokens, engine block size, parent
    block in the batch or -1, tokens pending at start), with start states `s0`; one block per `hashes`.
    Workspace (filled for the caller): `wi` (WI_ROWS rows of intp), `wu` (the chain states, the units'
    keys, then the `extra` keys), `w32` (rows: the blocks' stamps, their records' `info`), `tags` (the
    blocks' pods), `new` (False: set where a record was inserted). Returns (DONE | CHAINED | STUCK,
    records placed, k, stuck items, whether records moved, and what `ownership.add_units` returns: copies,
    later, again, `used` added, entries created, rows inserted)."""
    n = hashes.shape[0]
    nkeys, npend, nextra, tiers, slots, stuck = wi[0], wi[1], wi[2], wi[3], wi[4], wi[5]
    state_end, keys, extra = wu[:n], wu[n : 2 * n], wu[2 * n :]
    stamp_of, rinfo = w32[0], w32[1]
    chain_blocks(ev[2], ev[3], ev[4], ev[6], ev[5], s0, tokens, bs, state_end, nkeys, npend, nextra, extra)
    block_rows(ev[2], ev[0], ev[1], stamp, npend, nkeys, tags, tiers, stamp_of, rinfo)
    if not fast:
        return CHAINED, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
    for i in range(n):  # distinct records: none placed below moves another, so these slots stay valid
        if i + AHEAD < n:
            prefetch_pair(rkeys, rcount, rnb, hashes[i + AHEAD], tags[i + AHEAD])
        s = find_one(rkeys, rtags, rcount, rnb, hashes[i], tags[i])[0]
        if has_extra_rows(info[s] if s >= 0 else rinfo[i]):
            return CHAINED, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        slots[i] = s
    placed = 0
    nstuck = 0
    for i in range(n):  # `cuckoo.upsert_run`, with room for all
        if slots[i] >= 0:
            continue
        b1, b2 = _pair(hashes[i], tags[i], rnb)
        s = place(rkeys, rtags, rcount, b1, b2, hashes[i], tags[i])
        if s < 0:
            stuck[nstuck] = i
            nstuck += 1
            continue
        slots[i] = s
        new[i] = True
        state[s] = state_end[i]
        info[s] = rinfo[i]
        placed += 1
    if nstuck > KICK_ITEMS:
        return STUCK, placed, 0, nstuck, 0, 0, 0, 0, 0, 0, 0
    moved = 0
    for k in range(nstuck):  # `HashTable._settle`'s cuckoo steps
        i = stuck[k]
        at, src, dest = kick_place(rkeys, rtags, rcount, rnb, hashes[i], tags[i])
        if at < 0:
            return STUCK, placed, k, nstuck, moved, 0, 0, 0, 0, 0, 0
        if src >= 0:  # the occupant moved out of the item's slot, with its columns
            state[dest] = state[src]
            info[dest] = info[src]
            for col in stamps:
                col[dest] = col[src]
        state[at] = state_end[i]
        info[at] = rinfo[i]
        for col in stamps:
            col[at] = numba.uint32(0xFFFFFFFF)
        slots[i] = at
        new[i] = True
        placed += 1
        moved = 1
    if moved:
        for i in range(n):
            slots[i] = find_one(rkeys, rtags, rcount, rnb, hashes[i], tags[i])[0]
    ncopies, nlater, nagain, used, created, inserted = add_units(
        state, info, rtags, stamps, masks, bkeys, btags, bcount, bnb, broom, counts, units, slots, tiers,
        stamp_of, keys, wi[6], wi[7], wi[8],
    )  # fmt: skip
    return DONE, placed, 0, 0, moved, ncopies, nlater, nagain, used, created, inserted


class Upserted(NamedTuple):
    """A batch whose records are upserted, for the general path of `Holdings.add`: per block its record's
    slot, whether it was inserted, its pod, tier and stamp, and its `extra` keys (`nextra` of them each, in
    order in `extra`)."""

    slots: Index
    new: npt.NDArray[np.bool_]
    tags: npt.NDArray[np.uint16]
    tiers: Index
    stamps: npt.NDArray[np.uint32]
    nextra: Index
    extra: U64


def store(h: Holdings, b: Batch) -> Upserted | None:
    """`Holdings.add` by `store_batch` (stamps start at `h.stamp`; the caller advances it): None when it did
    everything, else the batch with its records upserted, for the general path to go on with."""
    n = len(b.hashes)
    rec, blocks = h.records, h.blocks
    fast = not b.dups and rec.room() >= n
    if fast:
        blocks.reserve(n)  # a new row per unit at most (as `_add_units`): the table grows once, before
    wi = np.empty((WI_ROWS, n), dtype=np.intp)
    wu = np.empty(WU_ROWS * n + len(b.tokens) // h.bs + n, dtype=np.uint64)
    w32 = np.empty((2, n), dtype=np.uint32)
    tags = np.empty(n, dtype=np.uint16)
    new = np.zeros(n, dtype=np.bool_)
    code, placed, k, nstuck, moved, ncopies, nlater, nagain, used, created, inserted = store_batch(
        b.ev, np.array(b.s0, dtype=np.uint64), b.tokens, h.bs, h.stamp, fast, rec.keys, rec.tags, rec.count,
        rec.nb, rec.cols["state"], rec.cols["info"], h.stamp_columns(), h.mask_columns(), blocks.keys,
        blocks.tags, blocks.count, blocks.nb, blocks.room(), h.counts, h.units, b.hashes, wi, wu, w32, tags,
        new,
    )  # fmt: skip
    slots, tiers, stamps = wi[4], wi[3], w32[0]
    if code == DONE:
        rec.size += placed
        keys = wu[n : 2 * n]
        h.units_added(
            slots, tiers, keys, wi[6][:ncopies], wi[7][:nlater], wi[8][:nagain], used, created, inserted
        )
        return None
    values = {"state": wu[:n], "info": w32[1]}
    if code == STUCK:  # the records `store_batch` could not place: as `HashTable.upsert` places them
        rec.size += placed
        if k < nstuck:
            moved |= rec._settle(wi[5][k:nstuck], b.hashes, tags, values, slots, new)
        if moved:
            slots = rec.find(b.hashes, tags)
    else:
        slots, new = rec.upsert(b.hashes, tags, values)
    return Upserted(slots, new, tags, tiers, stamps, wi[2], wu[2 * n :])


def warm_up(ntiers: int = 1) -> None:
    """Compile (or load the cached machine code of) the loop for `ntiers` tier columns, for a token array
    of its own and a read-only one over bytes."""
    cols = tuple(np.zeros(8, dtype=np.uint32) for _ in range(ntiers))
    ev = np.array([[0], [0], [1], [1], [1], [-1], [0]], dtype=np.intp)
    u64, u16 = np.zeros(8, dtype=np.uint64), np.full(8, 0xFFFF, dtype=np.uint16)
    count = np.zeros(1, dtype=np.uint8)
    for tokens in (np.zeros(1, dtype=np.int64), np.frombuffer(bytes(8), dtype=np.int64)):
        store_batch(
            ev, np.zeros(1, dtype=np.uint64), tokens, 16, 0, True, u64.copy(), u16.copy(), count.copy(), 1,
            u64.copy(), np.zeros(8, dtype=np.uint32), cols, cols, u64.copy(), u16.copy(), count.copy(), 1, 1,
            np.zeros((1, 12), dtype=np.int64), np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.uint64),
            np.zeros((WI_ROWS, 1), dtype=np.intp), np.zeros(4, dtype=np.uint64),
            np.zeros((2, 1), dtype=np.uint32), np.zeros(1, dtype=np.uint16), np.zeros(1, dtype=np.bool_),
        )  # fmt: skip
