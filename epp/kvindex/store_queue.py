"""The store queue of the block index (`index.BlockIndex`): runs of stores and queued positions. Pure.

`IndexQueue` is a mixin. `_store` (one BlockStored, for `BlockIndex.store`) and `store_run` (a run of
stores given as columns: what the compiled scan of a message gives, `event_scan.py`) queue their events
through the compiled bookkeeping of `queue_loop.py`: each event is checked, its chain start resolved (the
root, a queued parent, a held parent, or an orphan, whose hashes join the pod's unknown chain) and queued
in the queue's arrays, with the same effects as `store` for each, in order; where an event must come after
a flush (it may evict, or it names a block with a queued discard) or the queue is full, the loop stops, the
queue is flushed and the loop goes on from there. A run's token ids are queued as one array (the scan's),
and its hashes' uint64 array (the scan's) is read as it is.
`BlockIndex` provides the state, `_flush` and the pod and tier ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from epp.kvindex import queue_loop
from epp.kvindex.holdings import Holdings
from epp.kvindex.packing import StoreTokens, as_u64, pack_tokens, unsigned, unsigned_parent
from epp.kvindex.queue_loop import FULL, NBLK, NEV, NTOK, ORPHAN, QCOUNT, QUEUED, REJECT, WEIGHT

FLUSH_TOKENS: Final = 1 << 16
FLUSH_BLOCKS: Final = 4096
_I64MAX: Final = (1 << 63) - 1
_TWO64: Final = 1 << 64
_SLACK: Final = 1024
"""Blocks a call may queue without the arrays' room checked against the counters (`_room`)."""


def new_table(size: int) -> npt.NDArray[np.uint64]:
    """An empty table of the queue (`queue_loop.py`): rows of key, tag, value, epoch (none taken)."""
    table = np.zeros((size, 4), dtype=np.uint64)
    table[:, 3] = np.iinfo(np.uint64).max
    return table


class IndexQueue:
    block_size: int
    max_entries: int
    _max_ebs: int
    _h: Holdings
    _roots: dict[int, int]
    _unknown: dict[int, dict[int, None]]
    _r_left: dict[int, dict[int, int]]
    # the queue (`queue_loop.py`): events (7 rows: pod, tier, blocks, tokens, engine block size, parent's
    # queue position or -1, tokens past the boundary at start), start states, hashes, counters, the table
    # of queued positions and discards; token ids per store or run
    _q_ev: npt.NDArray[np.intp]
    _q_s0: npt.NDArray[np.uint64]
    _q_h: npt.NDArray[np.uint64]
    _q_cap: int
    _q_one: npt.NDArray[np.uint64]
    _q_st: npt.NDArray[np.int64]
    _qt: npt.NDArray[np.uint64]
    _q_tokens: list[bytes | npt.NDArray[np.integer]]
    _pod_ids: dict[str, int]
    _tier_ids: dict[str, int]
    max_unknown: int
    _orphans: int
    _descendants: int
    _rejected: int

    def _flush(self) -> None:
        raise NotImplementedError

    def _new_pod(self, pod: str) -> int:
        raise NotImplementedError

    def _new_tier(self, tier: str) -> int:
        raise NotImplementedError

    def _root_state(self, root: int) -> int:
        raise NotImplementedError

    # the queue's counters (`queue_loop.STATE_SIZE`)
    @property
    def _q_blocks(self) -> int:
        return int(self._q_st[NBLK])

    @property
    def _q_tok(self) -> int:
        return int(self._q_st[NTOK])

    @property
    def _q_weight(self) -> int:
        return int(self._q_st[WEIGHT])

    def _ids(self, pod: str, tier: str) -> tuple[int, int]:
        """The pod's and the tier's ids, given on first sight (-1: over the limits)."""
        pid = self._pod_ids.get(pod)
        if pid is None:
            pid = self._new_pod(pod)
        tid = self._tier_ids.get(tier)
        if tid is None:
            tid = self._new_tier(tier)
        return pid, tid

    def _keys(self, hashes: Sequence[int]) -> npt.NDArray[np.uint64]:
        """The hashes as a uint64 array: one hash in an array kept for it (read before the next call)."""
        if len(hashes) == 1:
            try:
                self._q_one[0] = hashes[0]
            except OverflowError:  # (an oversized hash: `as_u64` wraps it)
                return as_u64(hashes)
            return self._q_one
        return as_u64(hashes)

    def _room(self, events: int, blocks: int) -> None:
        """Make room in the queue's arrays for `events` and `blocks` more (and their table entries). When a
        call begins, the queue holds fewer than FLUSH_BLOCKS blocks (a full one is flushed at once), hence
        as many events at most, and fewer than FLUSH_BLOCKS discards: arrays of FLUSH_BLOCKS + `blocks`
        and a table of twice 2 * FLUSH_BLOCKS + `blocks` rows are enough, checked without reading the
        counters."""
        if blocks + FLUSH_BLOCKS <= self._q_cap and 2 * (2 * FLUSH_BLOCKS + blocks) <= self._qt.shape[0]:
            return
        st = self._q_st
        nev, nblk = int(st[NEV]), int(st[NBLK])
        cap = max(nev + events, nblk + blocks, FLUSH_BLOCKS + max(blocks, _SLACK))
        if cap > self._q_ev.shape[1]:
            ev = np.empty((7, cap), dtype=np.intp)
            ev[:, :nev] = self._q_ev[:, :nev]
            s0 = np.empty(cap, dtype=np.uint64)
            s0[:nev] = self._q_s0[:nev]
            self._q_ev, self._q_s0 = ev, s0
        if cap > self._q_h.shape[0]:
            qh = np.empty(cap, dtype=np.uint64)
            qh[:nblk] = self._q_h[:nblk]
            self._q_h = qh
        self._q_cap = min(self._q_ev.shape[1], self._q_h.shape[0])
        need = 2 * max(int(st[QCOUNT]) + blocks, 2 * FLUSH_BLOCKS + max(blocks, _SLACK))
        if need > self._qt.shape[0]:
            new = new_table(1 << (need - 1).bit_length())
            queue_loop.rehash(self._qt, new, int(st[queue_loop.EPOCH]))
            self._qt = new

    def store_run(
        self,
        pod: str,
        tier: str,
        root: int,
        hashes: Sequence[int],
        parents: Sequence[int | None],
        hashes_per_event: Sequence[int],
        tokens: StoreTokens,
        tokens_per_event: Sequence[int],
        block_sizes: Sequence[int],
        hash_array: npt.NDArray[np.uint64] | None = None,
        event_array: npt.NDArray[np.int64] | None = None,
        parent_array: npt.NDArray[np.uint64] | None = None,
    ) -> int:
        """Consecutive BlockStored events of `pod` on one tier from one root, as columns: event e has
        hashes_per_event[e] of `hashes` (in order), parent `parents[e]`, tokens_per_event[e] of `tokens` and
        engine block size block_sizes[e]. The same as `store` for each, in order; returns how many were
        orphans. An integer token array is queued as it is (`_queue_run`).
        `hash_array`: the same hashes as a uint64 array (the compiled scan has it), read as it is instead
        of converting `hashes`. With it, `hashes` are taken as unsigned (the array's values), not checked
        for signed ones. `event_array` and `parent_array` (the scan's, given together): per event a row of
        (whether it has a parent, hashes, tokens, engine block size), and the parents (unsigned; the value of
        an event without one is not read), read instead of converting the lists."""
        if not len(parents) == len(hashes_per_event) == len(tokens_per_event) == len(block_sizes):
            raise ValueError("store_run: parents and the per-event counts and sizes differ in length")
        if sum(hashes_per_event) != len(hashes) or sum(tokens_per_event) != len(tokens):
            raise ValueError("store_run: the per-event counts do not add up to the hashes and tokens given")
        if hash_array is not None and (hash_array.dtype != np.uint64 or hash_array.shape != (len(hashes),)):
            raise ValueError("store_run: hash_array is not the hashes' uint64 array")
        if hash_array is None:  # (with the array, the hashes are its values: unsigned already)
            hashes = unsigned(hashes)
        if event_array is not None or parent_array is not None:
            if not (
                event_array is not None
                and parent_array is not None
                and event_array.shape == (len(parents), 4)
                and parent_array.shape == (len(parents),)
            ):
                raise ValueError("store_run: event_array and parent_array are not the events' columns")
        elif any(p is not None and p < 0 for p in parents):
            parents = [unsigned_parent(p) for p in parents]
        pid, tid = self._ids(pod, tier)
        if (
            len(parents) > 1
            and pid >= 0
            and tid >= 0
            and isinstance(tokens, np.ndarray)
            and tokens.dtype.kind in "iu"
        ):
            return self._queue_run(
                pid, tid, root, hashes, parents, hashes_per_event, tokens, tokens_per_event, block_sizes,
                as_u64(hashes) if hash_array is None else hash_array, event_array, parent_array,
            )  # fmt: skip
        if len(parents) == 1:  # (no slices to take)
            return int(self._store(pid, tid, hashes, parents[0], tokens, block_sizes[0], root) < 0)
        orphans = 0
        h = t = 0
        for parent, n, ntok, ebs in zip(
            parents, hashes_per_event, tokens_per_event, block_sizes, strict=True
        ):
            if self._store(pid, tid, hashes[h : h + n], parent, tokens[t : t + ntok], ebs, root) < 0:
                orphans += 1
            h += n
            t += ntok
        return orphans

    def _queue_run(
        self,
        pid: int,
        tid: int,
        root: int,
        hashes: Sequence[int],
        parents: Sequence[int | None],
        hashes_per_event: Sequence[int],
        tokens: npt.NDArray[np.integer],
        tokens_per_event: Sequence[int],
        block_sizes: Sequence[int],
        hash_array: npt.NDArray[np.uint64],
        cols: npt.NDArray[np.int64] | None,
        par: npt.NDArray[np.uint64] | None,
    ) -> int:
        """`store_run` for a pod id, a tier id and an integer token array: the compiled loop queues the
        events until one stops it (`queue_loop.queue_run`), then this handles that one and goes on.
        Returns how many were orphans."""
        ne = len(parents)
        if cols is None or par is None:
            has = [p is not None for p in parents]
            cols = np.array(
                list(zip(has, hashes_per_event, tokens_per_event, block_sizes, strict=True)), np.int64
            )
            par = np.array([0 if p is None else p for p in parents], dtype=np.uint64)
        root_s0 = np.uint64(self._root_s0(root)) if None in parents else np.uint64(0)
        self._room(ne, len(hashes))
        orphans = 0
        e = h = t = 0
        while e < ne:
            rec = self._h.records
            e0, h0 = e, h
            code, e, h = queue_loop.queue_run(
                pid, tid, hash_array, par, cols, e, h, root_s0, self.block_size, self._max_ebs,
                self.max_entries, self._h.used, FLUSH_TOKENS, FLUSH_BLOCKS, self._q_ev, self._q_s0, self._q_h,
                self._qt, self._q_st, rec.keys, rec.tags, rec.count, rec.nb, rec.cols["state"],
                rec.cols["info"],
            )  # fmt: skip
            if e > e0:  # events e0..e queued: their token ids
                t1 = t + sum(tokens_per_event[e0:e])
                self._q_tokens.append(tokens if t == 0 and t1 == len(tokens) else tokens[t:t1])
                t = t1
                unknown = self._unknown.get(pid)
                if unknown:
                    for x in hashes[h0:h]:
                        unknown.pop(x, None)
            if code == QUEUED:
                break
            if code == FULL:
                self._flush()
                continue
            n = hashes_per_event[e]
            if code == REJECT:
                if n:  # (an event without blocks changes nothing)
                    self._rejected += 1
                    self._forget_chain(pid, hashes[h : h + n])
            elif code == ORPHAN:
                orphans += 1
                self._orphan(pid, parents[e], hashes[h : h + n])  # type: ignore[arg-type]  # (not None)
            else:  # FLUSH: then this event again
                self._flush()
                continue
            e += 1
            h += n
            t += tokens_per_event[e - 1]
        return orphans

    def _root_s0(self, root: int) -> int:
        s0 = self._roots.get(root, -1)
        return s0 if s0 >= 0 else self._root_state(root)

    def _store(
        self,
        pid: int,
        tid: int,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int] | npt.NDArray[np.integer],
        ebs: int,
        root: int,
    ) -> int:
        """`store` for a pod id and tier id: the index blocks the event completes, or -1 for an orphan."""
        n = len(engine_hashes)
        ntok = len(token_ids)
        tokens = None
        if n and pid >= 0 and tid >= 0 and 1 <= ebs <= self._max_ebs and (n - 1) * ebs < ntok <= n * ebs:
            tokens = pack_tokens(token_ids, ntok)
        if tokens is None:
            if n:
                self._rejected += 1
                if pid >= 0:
                    self._forget_chain(pid, engine_hashes)
            return 0
        hashes = self._keys(engine_hashes)
        has_parent = parent_engine_hash is not None
        # (as int64 bits: numba takes a Python int as int64; the loop reads them back as uint64)
        parent = 0 if parent_engine_hash is None else parent_engine_hash
        if parent > _I64MAX:
            parent -= _TWO64
        root_s0 = 0 if has_parent else self._root_s0(root)
        if root_s0 > _I64MAX:
            root_s0 -= _TWO64
        self._room(1, n)
        while True:
            rec = self._h.records
            code, k = queue_loop.queue_one(
                pid, tid, hashes, parent, has_parent, ntok, ebs, root_s0, self.block_size, self._max_ebs,
                self.max_entries, self._h.used, FLUSH_TOKENS, FLUSH_BLOCKS, self._q_ev, self._q_s0, self._q_h,
                self._qt, self._q_st, rec.keys, rec.tags, rec.count, rec.nb, rec.cols["state"],
                rec.cols["info"],
            )  # fmt: skip
            if code in (QUEUED, FULL):
                break
            if code == ORPHAN:
                self._orphan(pid, parent_engine_hash, engine_hashes)  # type: ignore[arg-type]  # (not None)
                return -1
            self._flush()  # FLUSH: then the event again (checked above: not REJECT)
        self._q_tokens.append(tokens)
        unknown = self._unknown.get(pid)
        if unknown:
            for x in engine_hashes:
                unknown.pop(x, None)
        if code == FULL:
            self._flush()
        return int(k)

    def _orphan(self, pid: int, parent: int, engine_hashes: Sequence[int]) -> None:
        self._orphans += 1
        unknown = self._unknown.get(pid)
        if unknown is not None and parent in unknown:
            self._descendants += 1
        self._forget_chain(pid, engine_hashes)

    def _forget_chain(self, pid: int, engine_hashes: Sequence[int]) -> None:
        unknown = self._unknown.get(pid)
        if unknown is None:
            unknown = self._unknown[pid] = {}
        for h in engine_hashes:
            unknown[h] = None
        while len(unknown) > self.max_unknown:
            del unknown[next(iter(unknown))]
