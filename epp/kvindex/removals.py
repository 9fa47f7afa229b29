"""BlockRemoved for the block index (`index.BlockIndex`, see its docstring). Pure.

`remove` looks each engine block up at once (one scalar probe per hash) to return the entries it releases;
`discard` has the same effects without the count: it queues the hashes, and the next batch looks them all
up in one vectorised probe, a few times cheaper per hash. Both queue the numpy work of the removal for the
batch. Either flushes first what they must come after (queued stores of the same blocks, stores that may
evict), and a store of a block with a queued removal, or whose parent has one, flushes first too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from epp.kvindex import queue_loop, removal_loop
from epp.kvindex.eviction import MAX_KEYS_PER_RECORD
from epp.kvindex.holdings import TIER_SHIFT, U64, Holdings
from epp.kvindex.packing import as_u64, unsigned
from epp.kvindex.probe import Index
from epp.kvindex.queue_loop import NBLK, WEIGHT


class IndexRemovals:
    max_entries: int
    _h: Holdings
    _pod_ids: dict[str, int]
    _tier_ids: dict[str, int]
    _unknown: dict[int, dict[int, None]]
    _q_st: npt.NDArray[np.int64]
    _qt: npt.NDArray[np.uint64]
    _r_units: list[tuple[int, int, int]]  # queued removals: (pod, engine hash, tier) of live units
    _r_left: dict[int, dict[int, int]]  # pod -> engine hash -> tiers left after them
    _r_spent: dict[tuple[int, int, int], int]  # unit -> queued removals of its extra copies
    _d_calls: list[tuple[int, int, Sequence[int]]]  # queued discards: (pod, tier, engine hashes)
    _q_tokens: list[bytes | npt.NDArray[np.integer]]
    _d_pods: set[int]  # pods with a queued discard (the hashes are in the queue's table)
    _d_count: int

    def _flush(self) -> None:
        raise NotImplementedError

    def _removals_queued(self) -> None:
        raise NotImplementedError

    def _room(self, events: int, blocks: int) -> None:
        raise NotImplementedError

    def _keys(self, hashes: Sequence[int]) -> npt.NDArray[np.uint64]:
        raise NotImplementedError

    def _stores_queued(self) -> int:
        return int(self._q_st[NBLK])

    def _may_evict(self) -> bool:
        """Whether the queued stores may push the index over its bound."""
        if not self._q_tokens:  # (no store queued)
            return False
        st = self._q_st
        return bool(st[NBLK]) and self._h.used + int(st[WEIGHT]) > self.max_entries

    def _known_tier(self, pid: int | None, engine_hashes: Sequence[int], tier: str) -> int | None:
        """The tier's id, or None when nothing is to be done: no hashes, the pod unknown, or the tier never
        stored on (nothing of the pod is held there; the hashes still leave its unknown chain)."""
        tid = self._tier_ids.get(tier)
        if pid is None or not engine_hashes:
            return None
        if tid is None:
            unknown = self._unknown.get(pid)
            if unknown:
                for h in engine_hashes:
                    unknown.pop(h, None)
        return tid

    def remove(self, pod: str, engine_hashes: Sequence[int], tier: str) -> int:
        """BlockRemoved: drop one copy of `tier` of these engine blocks of `pod` (the tier of an engine
        block goes with its last copy). Returns the entries they released: the index blocks completed by
        the engine blocks whose tier went, held on that tier (one still completed by another engine block
        of the pod stays held; `stats().entries` is exact)."""
        engine_hashes = unsigned(engine_hashes)
        pid = self._pod_ids.get(pod)
        tid = self._known_tier(pid, engine_hashes, tier)
        if pid is None or tid is None:
            return 0
        if (
            pid in self._d_pods
            or self._may_evict()
            or (self._q_st[NBLK] and queue_loop.any_queued(self._qt, self._q_st, pid, as_u64(engine_hashes)))
        ):
            self._flush()  # keep the order of effects: queued stores (and their evictions) come first
        unknown = self._unknown.get(pid)
        left = self._r_left.get(pid)
        if left is None:
            left = self._r_left[pid] = {}
        bit = 1 << tid
        removed = 0
        touched: list[int] = []  # hashes whose tiers left changed
        h_info = self._h.record_info_of
        copies = self._h.copies
        for h in engine_hashes:
            if unknown:
                unknown.pop(h, None)
            info = h_info(pid, h)
            if info < 0:
                continue
            tiers = left.get(h, info >> TIER_SHIFT)
            if tiers & bit:
                self._r_units.append((pid, h, tid))
                touched.append(h)
                if copies.size:  # the unit may hold further copies: then only one of them goes
                    unit = (pid, h, tid)
                    spent = self._r_spent.get(unit, 0)
                    if self._h.extra_copies(pid, h, tid) > spent:
                        self._r_spent[unit] = spent + 1
                        left[h] = tiers  # (a store of h flushes first)
                        continue
                left[h] = tiers & ~bit
                removed += (info >> 8) & MAX_KEYS_PER_RECORD
        if (
            touched
        ):  # (in the queue's table too: a store of one flushes first, a parent left on no tier is gone)
            self._room(0, len(touched))
            queue_loop.set_left(
                self._qt,
                self._q_st,
                pid,
                as_u64(touched),
                np.array([left[h] for h in touched], dtype=np.uint64),
            )
        self._removals_queued()
        return removed

    def discard(
        self,
        pod: str,
        engine_hashes: Sequence[int],
        tier: str,
        hash_array: npt.NDArray[np.uint64] | None = None,
    ) -> None:
        """BlockRemoved, as `remove`, without the count of entries released: the engine blocks are looked
        up in the next batch, all at once, instead of one by one now (a few times cheaper). `hash_array`:
        the same hashes as a uint64 array (the compiled scan's), read as it is (then `engine_hashes` are
        taken as unsigned)."""
        if hash_array is None:
            engine_hashes = unsigned(engine_hashes)
        elif hash_array.dtype != np.uint64 or hash_array.shape != (len(engine_hashes),):
            raise ValueError("discard: hash_array is not the hashes' uint64 array")
        pid = self._pod_ids.get(pod)
        tid = self._known_tier(pid, engine_hashes, tier)
        if pid is None or tid is None:
            return
        if self._may_evict():
            self._flush()  # keep the order of effects: queued stores (and their evictions) come first
        unknown = self._unknown.get(pid)
        if unknown:
            for h in engine_hashes:
                unknown.pop(h, None)
        keys = self._keys(engine_hashes) if hash_array is None else hash_array
        self._room(0, len(keys))
        if not queue_loop.add_discards(self._qt, self._q_st, pid, keys):
            self._flush()  # a store of one of them is queued: it comes first
            queue_loop.add_discards(self._qt, self._q_st, pid, keys)
        self._d_pods.add(pid)
        self._d_calls.append((pid, tid, engine_hashes))
        self._d_count += len(engine_hashes)
        self._removals_queued()

    def _apply_removals(self) -> None:
        """The queued removals and discards, in one batch."""
        h = self._h
        pods = [u[0] for u in self._r_units]
        hashes = [u[1] for u in self._r_units]
        tiers = [u[2] for u in self._r_units]
        for pid, tid, engine_hashes in self._d_calls:  # (lists: cheaper than numpy calls for a few)
            hashes.extend(engine_hashes)
            pods.extend(itertools.repeat(pid, len(engine_hashes)))
            tiers.extend(itertools.repeat(tid, len(engine_hashes)))
        keys, tags, units = as_u64(hashes), np.array(pods, dtype=np.uint16), np.array(tiers, dtype=np.intp)
        if not (h.copies.size or h.multi.size):  # the common case, as one compiled loop
            slots = np.empty(len(keys), dtype=np.intp)
            if _remove_held(h, keys, tags, units, slots):
                return
            held = slots >= 0  # (a record has `extra` rows: the general path, with the slots of the held)
        else:
            slots = h.records.find(keys, tags)
            # a discard of a block the pod does not hold on the tier is a no-op (`remove` queues live units)
            info = h.records.cols["info"][slots] >> (units + TIER_SHIFT).astype(np.uint32)
            held = (slots >= 0) & ((info & 1) == 1)
        h.remove_copies(slots[held], units[held])


def _remove_held(h: Holdings, keys: U64, tags: npt.NDArray[np.uint16], tiers: Index, slots: Index) -> bool:
    """The removals (keys[i], tags[i], tiers[i]) by `removal_loop.remove_held`, while `copies` and `multi`
    are empty; False, with the items' slots (-1 where not held) and nothing changed, when a held record
    has `extra` rows."""
    rec, blocks = h.records, h.blocks
    removed, used, rec_freed, rows_freed = removal_loop.remove_held(
        rec.keys, rec.tags, rec.count, rec.nb, rec.empty_tag, rec.cols["state"], rec.cols["info"],
        h.stamp_columns(), h.mask_columns(), blocks.keys, blocks.tags, blocks.count, blocks.nb,
        blocks.empty_tag, h.counts, h.units, keys, tags, tiers, slots,
    )  # fmt: skip
    if removed == removal_loop.EXTRA_ROWS:
        return False
    h.used -= used
    h.entries -= removed
    rec.size -= rec_freed
    blocks.size -= rows_freed
    return True
