"""Eviction by the memory bound, least recently stored units first: the `Holdings` mixin. Pure.

Every stored unit carries a stamp per tier (`Holdings.add`: later stores, higher stamps; within one event
the last block the lowest, so a chain goes tail first). `evict` removes the oldest units until enough is
free; finding them scans every stamp, so one scan keeps several rounds' worth of candidates (see `evict`).
`_rebase_stamps` keeps the stamps in 32 bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from epp.kvindex.probe import Index
    from epp.kvindex.table import HashTable

U64 = npt.NDArray[np.uint64]

STAMP_NONE: Final = 0xFFFFFFFF  # a unit's stamp on a tier it is not stored on
MAX_KEYS_PER_RECORD: Final = 0xFFF  # a record's `info`, bits 8-19: the index keys it completes


class Eviction:
    """Needs of `Holdings`: the records table (stamp columns `s0`, `s1`, ...; `info`), the tier count,
    `used`, the store counter `stamp`, and `remove_units`."""

    records: HashTable
    ntiers: int
    used: int
    stamp: int

    def remove_units(self, slots: Index, tiers: Index) -> int:
        raise NotImplementedError

    def _select_none(self) -> None:
        self._cand_hashes: U64 = np.zeros(0, dtype=np.uint64)
        self._cand_pods: npt.NDArray[np.uint16] = np.zeros(0, dtype=np.uint16)
        self._cand_tiers: Index = np.zeros(0, dtype=np.intp)
        self._cand_stamps: npt.NDArray[np.uint32] = np.zeros(0, dtype=np.uint32)
        self._cand_pos = 0

    def evict(self, need: int) -> int:
        """Remove the least recently stored units until `used` dropped by at least `need`; returns the
        entries removed.

        Finding the oldest units scans every stamp, so a scan keeps several rounds' worth of candidates
        (by identity and stamp: slots move). A candidate whose stamp changed was refreshed or removed
        since and is skipped; units stored since are newer than every candidate. So the candidates
        still valid are always the oldest units, in order, and eviction stays exactly LRU."""
        removed = 0
        while need > 0 and self.used > 0 and self.ntiers:
            if self._cand_pos >= len(self._cand_stamps):
                self._select(need)
            lo, hi = self._cand_pos, self._cand_pos + need  # weights are >= 1: `need` units are enough
            hashes, pods = self._cand_hashes[lo:hi], self._cand_pods[lo:hi]
            tiers, stamps = self._cand_tiers[lo:hi], self._cand_stamps[lo:hi]
            slots = self.records.find(hashes, pods)
            now = np.full(len(slots), STAMP_NONE, dtype=np.uint32)
            for t in np.flatnonzero(np.bincount(tiers, minlength=self.ntiers)).tolist():
                sel = (tiers == t) & (slots >= 0)
                now[sel] = self.records.cols[f"s{t}"][slots[sel]]
            valid = np.flatnonzero(now == stamps)
            info = self.records.cols["info"][slots[valid]]
            w = np.maximum((info >> 8) & MAX_KEYS_PER_RECORD, 1).astype(np.int64)
            cut = min(int(np.searchsorted(np.cumsum(w), need)) + 1, len(valid))
            self._cand_pos = lo + (int(valid[cut - 1]) + 1 if cut < len(valid) else len(slots))
            need -= int(w[:cut].sum())
            removed += self.remove_units(slots[valid[:cut]], tiers[valid[:cut]])
        return removed

    def _select(self, need: int) -> None:
        """Candidates for eviction: the oldest units, a few rounds' worth, oldest first."""
        cap = self.records.capacity
        flat = np.concatenate([self.records.cols[f"s{t}"] for t in range(self.ntiers)])
        k = min(len(flat), max(4 * need, 1024))
        idx = np.argpartition(flat, k - 1)[:k] if k < len(flat) else np.arange(len(flat))
        idx = idx[np.argsort(flat[idx], kind="stable")]
        idx = idx[flat[idx] != STAMP_NONE]
        slots = idx % cap
        self._cand_hashes = self.records.keys[slots]
        self._cand_pods = self.records.tags[slots]
        self._cand_tiers = idx // cap
        self._cand_stamps = flat[idx]
        self._cand_pos = 0

    def _rebase_stamps(self) -> None:
        """Keep stamps in 32 bits: stamps older than the last 2^31 stores become 0 (ties, the oldest)."""
        self._select_none()  # candidates are compared by stamp
        base = max(0, self.stamp - (1 << 31))
        for t in range(self.ntiers):
            col = self.records.cols[f"s{t}"]
            live = col != STAMP_NONE
            col[live] = np.maximum(col[live].astype(np.int64) - base, 0).astype(np.uint32)
        self.stamp -= base
