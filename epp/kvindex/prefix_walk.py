"""The compiled prefix walk: probe the block table for a prompt's keys and measure every pod's run. Pure.

The read path's hot loop (`IndexReads.lookup_tier_runs`, `IndexReads.lookup`). For each 32-pod chunk it
walks the prompt's keys from block 0: one probe of the (key, chunk) item in the cuckoo table (the
hashing of `table.HashTable._pair`, both buckets, slots up to each bucket's count), then, for every
output row, the union of that row's tier mask columns at the slot, ANDed into the row's running mask;
a bit that drops out ends that pod's run there. The walk of a chunk stops at the first block that no
pod of the chunk still holds in any row, so a prompt costs as many probes as its longest held prefix
(plus one), not its length.

Compiled with numba (`docs/architecture.md`, "Compiled loops"): as numpy the same work took ~30 array
calls of ~1 us each plus the probe's temporaries; as one loop it is a few ns per block. The result is
the same as the vectorised probe's masks (`Holdings.masks`, which `lookup_by_best_tier` still uses)
counted bit by bit, and the tests compare the two on random indexes. `warm_up()` compiles it (about a
second, or a cache hit from `__pycache__`), so servers call it before they report ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numba
import numpy as np
import numpy.typing as npt

Runs = npt.NDArray[np.int64]


@numba.njit(cache=True, nogil=True)
def _low_bit(v: Any) -> int:  # pragma: no cover - compiled
    bit = 0
    while (v & 1) == 0:
        v >>= 1
        bit += 1
    return bit


@numba.njit(cache=True, nogil=True)
def _walk(
    tkeys: Any, ttags: Any, tcount: Any, nb: int, cols: Any, rows: Any, keys: Any, chunks: Any, out: Any
) -> None:  # pragma: no cover - compiled
    """out[r, c, bit]: run of row r (the OR of the columns whose bits are set in rows[r]) for pod bit
    `bit` of chunk chunks[c]; `out` comes zeroed."""
    n = keys.shape[0]
    nrows = rows.shape[0]
    ncols = len(cols)
    run = np.empty(nrows, dtype=np.uint32)
    held = np.empty(ncols, dtype=np.uint32)
    unb = numba.uint64(nb)
    for ci in range(chunks.shape[0]):
        tag = chunks[ci]
        mix = numba.uint64(tag) * numba.uint64(0xD6E8FEB86659FD93)
        for r in range(nrows):
            run[r] = numba.uint32(0xFFFFFFFF)
        p = 0
        while p < n:
            key = keys[p]
            x = key ^ mix  # keys.fmix, as table.HashTable._pair
            x ^= x >> numba.uint64(33)
            x *= numba.uint64(0xFF51AFD7ED558CCD)
            x ^= x >> numba.uint64(33)
            x *= numba.uint64(0xC4CEB9FE1A85EC53)
            x ^= x >> numba.uint64(33)
            b1 = ((x >> numba.uint64(32)) * unb) >> numba.uint64(32)
            b2 = ((x & numba.uint64(0xFFFFFFFF)) * unb) >> numba.uint64(32)
            if b2 == b1:
                b2 = (b1 + numba.uint64(1)) % unb
            slot = -1
            base = int(b1) * 8
            for j in range(tcount[b1]):
                if tkeys[base + j] == key and ttags[base + j] == tag:
                    slot = base + j
                    break
            if slot < 0:
                base = int(b2) * 8
                for j in range(tcount[b2]):
                    if tkeys[base + j] == key and ttags[base + j] == tag:
                        slot = base + j
                        break
            for t in range(ncols):
                held[t] = cols[t][slot] if slot >= 0 else numba.uint32(0)
            alive = False
            for r in range(nrows):
                acc = numba.uint32(0)
                for t in range(ncols):
                    if (rows[r] >> t) & 1:
                        acc |= held[t]
                kept = run[r] & acc
                lost = run[r] ^ kept
                if p > 0:
                    while lost:
                        out[r, ci, _low_bit(lost)] = p
                        lost &= lost - numba.uint32(1)
                run[r] = kept
                if kept:
                    alive = True
            if not alive:
                break
            p += 1
        if p == n:
            for r in range(nrows):
                left = run[r]
                while left:
                    out[r, ci, _low_bit(left)] = n
                    left &= left - numba.uint32(1)


def walk_runs(
    table: Any,
    columns: Sequence[npt.NDArray[np.uint32]],
    rows: Sequence[int],
    keys: npt.NDArray[np.uint64],
    chunks: Sequence[int],
) -> Runs:
    """(len(rows), len(chunks), 32) runs: for every row (a bit set over `columns`, the tiers whose masks
    it ORs) and every pod bit of every chunk, how many leading keys the pod holds in that row. `table`
    is the blocks' `HashTable` (keys, tags, count, nb; the columns are its per-tier mask columns)."""
    out = np.zeros((len(rows), len(chunks), 32), dtype=np.int64)
    if len(keys) == 0 or not chunks or not rows or table.size == 0:
        return out
    _walk(
        table.keys,
        table.tags,
        table.count,
        int(table.nb),
        tuple(columns),
        np.asarray(rows, dtype=np.int64),
        np.ascontiguousarray(keys, dtype=np.uint64),
        np.asarray(chunks, dtype=np.int64),
        out,
    )
    return out


@numba.njit(cache=True, nogil=True)
def _place(lengths: Any, first: Any, where: Any, out: Any) -> None:  # pragma: no cover - compiled
    nrows = first.shape[0]
    for r in range(nrows):
        stop = first[r + 1] if r + 1 < nrows else out.shape[0]
        for j in range(where.shape[1]):
            c = where[0, j]
            if c >= 0:
                v = lengths[r, c, where[1, j]]
                for k in range(first[r], stop):
                    out[k, j] = v


def place_runs(
    lengths: Runs, first: npt.NDArray[np.int64], where: npt.NDArray[np.int64], out: npt.NDArray[np.int64]
) -> None:
    """Spread `walk_runs` rows over output rows, in place: row r of `lengths` fills `out` rows
    first[r] up to first[r + 1] (the rows after a tier the index does not know continue the union
    before it), and column j takes chunk row where[0, j], pod bit where[1, j] (-1: left as it is)."""
    _place(lengths, first, where, out)


def warm_up() -> None:
    """Compile `_walk` for the column counts the index uses (1-4 tiers), from the cache when it has it."""
    from epp.kvindex.table import HashTable

    table = HashTable(np.uint16, {"m": (np.uint32, 0)})
    table.upsert(
        np.array([1], dtype=np.uint64), np.array([0], dtype=np.uint16), {"m": np.array([1], np.uint32)}
    )
    keys = np.array([1, 2], dtype=np.uint64)
    for n in range(1, 5):
        runs = walk_runs(table, [table.cols["m"]] * n, [1] * n, keys, [0])
        place_runs(
            runs, np.arange(n, dtype=np.int64), np.zeros((2, 1), dtype=np.int64), np.zeros((n, 1), np.int64)
        )
