"""The numpy state of the block index: engine blocks, their keys, and who holds which key where. Pure.

Five tables (`table.HashTable`), all batched:

- `records`: (engine hash, pod) -> one engine block of one pod: the chain `state` after its last token,
  and `info` = tokens past the last index boundary (bits 0-7) | index keys it completes (bits 8-19) |
  tiers it is stored on (bits 20-31). Plus one uint32 store stamp per tier (`s0`, `s1`, ...; MAX when
  not stored there). A *unit* is (record, tier): what one BlockStored adds and one BlockRemoved removes,
  the unit of recency and eviction.
- `extra`: (engine hash, pod | j << 16) -> key: the keys a record completes that are not implied by its
  state. A record whose last token ends an index block owns fmix(state) implicitly, so an engine block
  the size of the index block needs no extra row; an engine block of 64 tokens needs 3.
- `blocks`: (key, pod chunk) -> per tier (`m0`, `m1`, ...) a uint32 bit mask of the pods of the 32-pod
  chunk that hold the key on the tier. A lookup reads one row per (key, chunk) instead of one per
  (key, pod, tier).
- `multi`: (key, pod | tier << 16) -> owners beyond the first, for the few entries that several units
  of a pod own (engine blocks larger than index blocks whose contents diverge after a shared start).
  A pod's bit stays set while any owner is left.
- `copies`: (engine hash, pod | tier << 16) -> copies of a unit beyond the first, for the few units the
  engine holds more than one physical copy of (vLLM stores a recomputed block again under its hash).
  Each BlockStored of a live unit adds one, each BlockRemoved takes one; the unit goes with its last.

The caller guarantees batch semantics (see `index.py`): units given to `remove_units` are live, copies
given to `remove_copies` are held, and a batch given to `add` does not involve a record that has a
removal pending.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from epp.kvindex import ownership, store_loop
from epp.kvindex.eviction import MAX_KEYS_PER_RECORD, STAMP_NONE, Eviction
from epp.kvindex.keys import MASK64, fmix_array
from epp.kvindex.probe import Index
from epp.kvindex.table import HashTable

MAX_TIERS: Final = 12
MAX_PODS: Final = 0xFFFF  # pod ids 0..65534 (65535 marks an empty slot)
TIER_SHIFT: Final = 20
CHUNK_BITS: Final = 5  # 32 pods per mask
_U = np.uint64
_STAMP_LIMIT: Final = STAMP_NONE - 1
_FEW: Final = 64  # up to this many items, a set tells distinct ones faster than a sort

U64 = npt.NDArray[np.uint64]


@dataclass(slots=True)
class Batch:
    """Pending BlockStored events, in order. Per event (the columns of `ev`): pod, tier, blocks, tokens,
    engine block size, parent block index in this batch (or -1), tokens pending at start; its start state
    (when it has no parent in the batch) in `s0`."""

    ev: Index  # 7 rows (one contiguous row per field: the compiled loops take one array layout)
    s0: U64  # (uint64)
    hashes: U64
    tokens: npt.NDArray[np.integer]
    dups: bool  # some (pod, engine hash) is stored more than once

    @property
    def tiers(self) -> list[int]:
        """The tiers the batch stores on."""
        return sorted(set(self.ev[1].tolist()))


class Holdings(Eviction):
    def __init__(self, block_size: int, roomy_until: int = 0) -> None:
        """`roomy_until`: tables holding fewer items trade memory for speed (`table.py`, Growth)."""
        self.bs = block_size
        r = roomy_until
        self.records = HashTable(np.uint16, {"state": (np.uint64, 0), "info": (np.uint32, 0)}, roomy_until=r)
        self.extra = HashTable(np.uint32, {"key": (np.uint64, 0)}, roomy_until=r)
        self.blocks = HashTable(np.uint16, {}, roomy_until=r)  # + a mask column per tier
        self.multi = HashTable(np.uint32, {"n": (np.uint32, 0)}, roomy_until=r)
        self.copies = HashTable(np.uint32, {"n": (np.uint32, 0)}, roomy_until=r)
        self.ntiers = 0
        self.counts = np.zeros((16, MAX_TIERS), dtype=np.int64)  # entries per (pod, tier)
        self.units = np.zeros(16, dtype=np.int64)  # units per pod
        self.entries = 0
        self.used = 0  # sum over units of max(keys, 1): what the memory bound counts
        self.stamp = 0
        self._select_none()

    def add_tier(self) -> int:
        t = self.ntiers
        self.records.add_column(f"s{t}", np.uint32, STAMP_NONE)
        self.blocks.add_column(f"m{t}", np.uint32, 0)
        self.ntiers += 1
        return t

    def ensure_pod(self, pid: int) -> None:
        if pid >= len(self.units):
            size = max(pid + 1, 2 * len(self.units))
            self.units = np.concatenate([self.units, np.zeros(size - len(self.units), dtype=np.int64)])
            extra_rows = np.zeros((size - len(self.counts), MAX_TIERS), dtype=np.int64)
            self.counts = np.concatenate([self.counts, extra_rows])

    def nbytes(self) -> int:
        tables = (self.records, self.extra, self.blocks, self.multi, self.copies)
        return sum(t.nbytes() for t in tables)

    # -- scalar reads (store / remove bookkeeping) -------------------------------------
    def find_record(self, pid: int, ehash: int) -> int:
        return self.records.find_one(ehash & MASK64, pid)

    def record_info_of(self, pid: int, ehash: int) -> int:
        """`info` of the record (pod, engine hash), or -1 when there is none."""
        slot = self.records.find_one(ehash & MASK64, pid)
        return -1 if slot < 0 else int(self.records.cols["info"][slot])

    def record_info(self, slot: int) -> int:
        return int(self.records.cols["info"][slot])

    def record_state(self, slot: int) -> int:
        return int(self.records.cols["state"][slot])

    def extra_copies(self, pid: int, ehash: int, tid: int) -> int:
        """Copies of the unit (pod, engine hash, tier) beyond the first (0 when none, or not held)."""
        at = self.copies.find_one(ehash & MASK64, pid | tid << 16)
        return 0 if at < 0 else int(self.copies.cols["n"][at])

    # -- add -----------------------------------------------------------------------------
    def add(self, b: Batch) -> None:
        if self.stamp + len(b.hashes) >= _STAMP_LIMIT:
            self._rebase_stamps()
        done = store_loop.store(self, b)  # the common case: one compiled call
        self.stamp += len(b.hashes)
        if done is None:
            return
        slots, new, tags, tiers, stamps, nextra, extra = done
        if new.any():
            u = np.flatnonzero(new)
            u = u[nextra[u] > 0]
            if u.size:
                self._add_extra(u, nextra, extra, b.hashes, tags)

        info_col = self.records.cols["info"]
        times: Index | None = None  # stores of each unit in the batch, when some has several
        if b.dups:  # a (pod, engine hash) queued twice: one unit per (record, tier), its latest stamp
            uid = (slots * MAX_TIERS + tiers).astype(np.uint64)
            order = np.sort((uid << _U(32)) | stamps.astype(np.uint64))
            last = np.r_[(order[1:] >> _U(32)) != (order[:-1] >> _U(32)), True]
            times = np.diff(np.r_[-1, np.flatnonzero(last)])
            uid, stamps = order[last] >> _U(32), (order[last] & _U(0xFFFFFFFF)).astype(np.uint32)
            slots, tiers = (uid // MAX_TIERS).astype(np.intp), (uid % MAX_TIERS).astype(np.intp)
        if times is None and self._add_units(slots, tiers, stamps):
            return
        shift = (tiers + TIER_SHIFT).astype(np.uint32)
        was = (info_col[slots] >> shift) & 1
        more = was.astype(np.intp) if times is None else times - 1 + was  # copies added to held ones
        if more.any():
            self._add_copies(slots, tiers, more)
        batch_tiers = b.tiers
        for t in batch_tiers:
            col = self.records.cols[f"s{t}"]
            if len(batch_tiers) == 1:
                col[slots] = stamps
            else:
                sel = tiers == t
                col[slots[sel]] = stamps[sel]
        bits = np.left_shift(np.uint32(1), shift)
        if b.dups:
            np.bitwise_or.at(info_col, slots, bits)
        else:
            info_col[slots] |= bits
        fresh = was == 0
        if fresh.any():
            self._link(slots[fresh], tiers[fresh])

    def _add_units(self, slots: Index, tiers: Index, stamps: npt.NDArray[np.uint32]) -> bool:
        """The rest of `add` for distinct units by `ownership.add_units` (one compiled pass); False, nothing
        done, when a record has `extra` rows."""
        rec, blocks = self.records, self.blocks
        n = len(slots)
        keys = np.empty(n, dtype=np.uint64)
        copies, later, again = (np.empty(n, dtype=np.intp) for _ in range(3))
        blocks.reserve(n)  # a new row per unit at most: the table grows once, before the loop
        room = blocks.room()
        ncopies, nlater, nagain, used, created, inserted = ownership.add_units(
            rec.cols["state"], rec.cols["info"], rec.tags, self.stamp_columns(), self.mask_columns(),
            blocks.keys, blocks.tags, blocks.count, blocks.nb, room, self.counts, self.units, slots, tiers,
            stamps, keys, copies, later, again,
        )  # fmt: skip
        if ncopies < 0:
            return False
        self.units_added(
            slots, tiers, keys, copies[:ncopies], later[:nlater], again[:nagain], used, created, inserted
        )
        return True

    def units_added(
        self, slots: Index, tiers: Index, keys: U64, copies: Index, later: Index, again: Index, used: int,
        created: int, inserted: int,
    ) -> None:  # fmt: skip
        """The rest of `ownership.add_units`' work on units (slots, tiers): the counts it returns, extra
        copies of units (`copies`), extra owners (`again`) and keys without room in `blocks` (`later`)."""
        self.blocks.size += inserted
        self.used += used
        self.entries += created
        if len(copies):
            self._add_copies(slots[copies], tiers[copies], np.ones(len(copies), dtype=np.intp))
        if len(again):
            self._more_owners(keys[again], self.records.tags[slots[again]].astype(np.intp), tiers[again])
        if len(later):  # no room in the blocks table for these: the general path (growth, the cuckoo walk)
            self._own(keys[later], self.records.tags[slots[later]].astype(np.intp), tiers[later], +1)

    def _add_copies(self, slots: Index, tiers: Index, more: Index) -> None:
        """Count `more` copies (beyond the first) of the units (slots, tiers); units are distinct."""
        u = np.flatnonzero(more)
        slots, tiers = slots[u], tiers[u]
        tags = (self.records.tags[slots].astype(np.intp) | (tiers << 16)).astype(np.uint32)
        at, _ = self.copies.upsert(self.records.keys[slots], tags, {})
        self.copies.cols["n"][at] += more[u].astype(np.uint32)

    def _add_extra(
        self, u: Index, nextra: Index, extra: U64, hashes: U64, pods: npt.NDArray[np.uint16]
    ) -> None:
        """Extra rows for the new records of blocks `u`: the keys they complete before their last one
        (`block_chain.chain_blocks` put each block's `nextra` of them in order in `extra`)."""
        counts = nextra[u]
        kb = np.repeat(u, counts)
        jj = np.arange(len(kb)) - np.repeat(np.cumsum(counts) - counts, counts)
        first = np.cumsum(nextra) - nextra  # where each block's keys start in `extra`
        tags = (pods[kb].astype(np.intp) | (jj << 16)).astype(np.uint32)
        self.extra.insert(hashes[kb], tags, {"key": extra[first[kb] + jj]})

    # -- keys of records -----------------------------------------------------------------
    def owned(self, slots: Index) -> tuple[Index, U64]:
        """The keys the records at `slots` complete, as (position in `slots`, key) pairs."""
        info = self.records.cols["info"][slots]
        nk = ((info >> 8) & MAX_KEYS_PER_RECORD).astype(np.intp)
        implicit = ((info & 0xFF) == 0) & (nk > 0)
        who = np.flatnonzero(implicit)
        keys = fmix_array(self.records.cols["state"][slots[who]])
        nsr = nk - implicit
        if not nsr.any():
            return who, keys
        u = np.repeat(np.arange(len(slots)), nsr)
        jj = np.arange(len(u)) - np.repeat(np.cumsum(nsr) - nsr, nsr)
        pods = self.records.tags[slots[u]].astype(np.intp)
        found = self.extra.find(self.records.keys[slots[u]], (pods | (jj << 16)).astype(np.uint32))
        ok = found >= 0  # always, unless the tables disagree
        return np.concatenate([who, u[ok]]), np.concatenate([keys, self.extra.cols["key"][found[ok]]])

    def _link(self, slots: Index, tiers: Index) -> None:
        """Units that became live: they own their records' keys on their tier."""
        self._account(slots, tiers, +1)
        who, keys = self.owned(slots)
        if len(keys):
            self._own(keys, self.records.tags[slots][who].astype(np.intp), tiers[who], +1)

    def _account(self, slots: Index, tiers: Index, sign: int) -> None:
        pods = self.records.tags[slots].astype(np.intp)
        nk = ((self.records.cols["info"][slots] >> 8) & MAX_KEYS_PER_RECORD).astype(np.int64)
        self.units += sign * np.bincount(pods, minlength=len(self.units))
        self.used += sign * int(np.maximum(nk, 1).sum())

    def _own(self, keys: U64, pods: Index, tiers: Index, sign: int) -> int:
        """Add (+1) or drop (-1) one owner of (key, pod, tier) per item. An entry exists while it has an
        owner: its pod's bit in the tier's mask of the `blocks` row; owners beyond the first are counted
        in `multi`. Returns the entries created or removed. The compiled loops (`ownership.py`) do the
        masks; a removal while `multi` holds anything takes the vectorised path (`ownership.own_batch`)."""
        tags = (pods >> CHUNK_BITS).astype(np.uint16)
        if sign > 0:
            rows, _ = self.blocks.upsert(keys, tags, {})
            again = np.zeros(len(rows), dtype=bool)
            created = ownership.add_owners(self.mask_columns(), rows, pods, tiers, self.counts, again)
            if again.any():
                self._more_owners(keys[again], pods[again], tiers[again])
            self.entries += created
            return int(created)
        if self.multi.size:
            return ownership.own_batch(self, keys, pods, tiers, tags, sign)
        rows = self.blocks.find(keys, tags)
        emptied = np.empty(len(rows), dtype=np.intp)
        removed, k = ownership.drop_owners(self.mask_columns(), rows, pods, tiers, self.counts, emptied)
        self.blocks.delete(emptied[:k])
        self.entries -= removed
        return int(removed)

    def _more_owners(self, keys: U64, pods: Index, tiers: Index) -> None:
        """Count owners beyond the first of entries (key, pod, tier) in `multi`, one per item."""
        at, _ = self.multi.upsert(keys, (pods | (tiers << 16)).astype(np.uint32), {})
        np.add.at(self.multi.cols["n"], at, np.uint32(1))

    def mask_columns(self) -> tuple[npt.NDArray[np.uint32], ...]:
        cols = self.blocks.cols
        return tuple(cols[f"m{t}"] for t in range(self.ntiers))

    def stamp_columns(self) -> tuple[npt.NDArray[np.uint32], ...]:
        cols = self.records.cols
        return tuple(cols[f"s{t}"] for t in range(self.ntiers))

    # -- remove ------------------------------------------------------------------------
    def remove_copies(self, slots: Index, tiers: Index) -> int:
        """Remove one copy per (record slot, tier) pair (a pair may repeat: as many copies as it is named);
        a unit whose last copy goes is removed. Returns the entries removed."""
        if slots.size == 0:
            return 0
        uid = slots * MAX_TIERS + tiers
        if self.copies.size == 0 and len(uid) <= _FEW and len(set(uid.tolist())) == len(uid):
            return self.remove_units(slots, tiers)  # (distinct units, each with one copy; no sort)
        uid, k = np.unique(uid, return_counts=True)
        if self.copies.size == 0:  # every unit has one copy: each named unit goes
            return self.remove_units(uid // MAX_TIERS, uid % MAX_TIERS)
        slots, tiers = uid // MAX_TIERS, uid % MAX_TIERS
        tags = (self.records.tags[slots].astype(np.intp) | (tiers << 16)).astype(np.uint32)
        at = self.copies.find(self.records.keys[slots], tags)
        spare = np.zeros(len(slots), dtype=np.int64)
        has = at >= 0
        spare[has] = self.copies.cols["n"][at[has]]
        left = spare - k  # copies beyond the first left; < 0: the unit goes
        keep = has & (left >= 0)
        self.copies.cols["n"][at[keep]] = left[keep].astype(np.uint32)
        self.copies.delete(at[keep & (left == 0)])
        gone = left < 0
        return self.remove_units(slots[gone], tiers[gone])

    def remove_units(self, slots: Index, tiers: Index) -> int:
        """Remove live units (distinct (record slot, tier) pairs) with all their copies; returns the
        entries removed (an entry that another unit of the pod still owns stays)."""
        if slots.size == 0:
            return 0
        if not (self.copies.size or self.multi.size):  # the common case, as one compiled loop
            removed = self._remove_simple(slots, tiers)
            if removed >= 0:
                return removed
        if self.copies.size:
            tags = (self.records.tags[slots].astype(np.intp) | (tiers << 16)).astype(np.uint32)
            at = self.copies.find(self.records.keys[slots], tags)
            self.copies.delete(at[at >= 0])
        self._account(slots, tiers, -1)
        who, keys = self.owned(slots)
        removed = 0
        if len(keys):
            removed = self._own(keys, self.records.tags[slots][who].astype(np.intp), tiers[who], -1)
        for t in np.flatnonzero(np.bincount(tiers, minlength=self.ntiers)).tolist():
            self.records.cols[f"s{t}"][slots[tiers == t]] = STAMP_NONE
        info_col = self.records.cols["info"]
        np.bitwise_and.at(info_col, slots, ~(1 << (tiers + TIER_SHIFT)).astype(np.uint32))
        gone = slots[(info_col[slots] >> TIER_SHIFT) == 0]  # may repeat a record; delete copes
        if gone.size:
            info = info_col[gone]
            nk = ((info >> 8) & MAX_KEYS_PER_RECORD).astype(np.intp)
            nsr = nk - (((info & 0xFF) == 0) & (nk > 0))
            if nsr.any():
                u = np.repeat(gone, nsr)
                jj = np.arange(len(u)) - np.repeat(np.cumsum(nsr) - nsr, nsr)
                tags32 = (self.records.tags[u].astype(np.intp) | (jj << 16)).astype(np.uint32)
                found = self.extra.find(self.records.keys[u], tags32)
                self.extra.delete(found[found >= 0])
            self.records.delete(gone)
        return removed

    def _remove_simple(self, slots: Index, tiers: Index) -> int:
        """`remove_units` by `ownership.remove_units` (no extra copies or owners anywhere); -1, nothing
        done, when a record has `extra` rows."""
        rec, blocks = self.records, self.blocks
        gone = np.empty(len(slots), dtype=np.intp)
        emptied = np.empty(len(slots), dtype=np.intp)
        removed, used, ngone, nempty = ownership.remove_units(
            rec.cols["state"], rec.cols["info"], rec.tags, self.stamp_columns(), self.mask_columns(),
            blocks.keys, blocks.tags, blocks.count, blocks.nb, self.counts, self.units, slots, tiers, gone,
            emptied,
        )  # fmt: skip
        if removed < 0:
            return -1
        self.used -= used
        self.entries -= removed
        blocks.delete(emptied[:nempty])
        rec.delete(gone[:ngone])
        return int(removed)

    def units_of_pod(self, pid: int) -> tuple[Index, Index]:
        slots = np.flatnonzero(self.records.tags == pid)
        tiers = self.records.cols["info"][slots] >> TIER_SHIFT
        ts = [np.full(int(((tiers >> t) & 1).sum()), t, dtype=np.intp) for t in range(self.ntiers)]
        ss = [slots[((tiers >> t) & 1) == 1] for t in range(self.ntiers)]
        return np.concatenate([np.zeros(0, np.intp), *ss]), np.concatenate([np.zeros(0, np.intp), *ts])

    # -- lookup ------------------------------------------------------------------------
    def masks(self, keys: U64, chunks: list[int], tiers: list[int]) -> npt.NDArray[np.uint32]:
        """(tier, chunk, key) masks of the pods holding each key, 0 where absent: one probe per (key,
        chunk) whatever the number of tiers."""
        n = len(keys)
        out = np.empty((len(tiers), len(chunks) * n), dtype=np.uint32)
        if self.blocks.size == 0 or out.size == 0:
            out.fill(0)
        else:
            slots, found = self.blocks.locate(keys, chunks)  # slots are valid indices, even where absent
            for i, t in enumerate(tiers):
                self.blocks.cols[f"m{t}"].take(slots, out=out[i], mode="clip")  # ("raise": via a copy)
            out *= found
        return out.reshape(len(tiers), len(chunks), n)
