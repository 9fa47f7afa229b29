"""The store queue of the block index (`index.BlockIndex`): runs of stores and queued positions. Pure.

`IndexQueue` is a mixin. `_store` (one BlockStored, for `BlockIndex.store`) checks the event, resolves
where its chain starts (`_chain_start`: the root, a queued parent, a held parent, or an orphan, whose
hashes join the pod's unknown chain) and queues it (`_enqueue`); `store_run` takes a run
of stores given as columns (what the compiled scan of a message gives, `event_scan.py`) and, when every
event chains from something known and nothing queued forces a flush in between, queues the whole run in
one pass (`_queue_run`: one set update, one token array, and the hashes' uint64 array when the caller
has one: the scan's, queued as it is instead of converting Python ints at the flush) with the same effects
as `store` for each.
`BlockIndex` provides the state, `_flush` and the pod and tier ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from epp.kvindex.holdings import Holdings
from epp.kvindex.packing import StoreTokens, pack_tokens, unsigned, unsigned_parent

FLUSH_TOKENS: Final = 1 << 16
FLUSH_BLOCKS: Final = 4096

QueuedEvent = tuple[int, int, int, int, int, int, int]
"""(pod, tier, blocks, tokens, engine block size, parent's queue position or -1, tokens past the boundary
at start)."""


class IndexQueue:
    block_size: int
    max_entries: int
    _max_ebs: int
    _h: Holdings
    _roots: dict[int, int]
    _unknown: dict[int, dict[int, None]]
    _r_left: dict[int, dict[int, int]]
    _d_set: dict[int, set[int]]
    _q_ev: list[QueuedEvent]
    _q_s0: list[int]
    _q_hashes: list[int]
    _q_arrays: list[npt.NDArray[np.uint64] | None]
    _q_tokens: list[bytes | npt.NDArray[np.integer]]
    _q_set: dict[int, set[int]]
    _q_last: dict[int, dict[int, int]]
    _q_full: dict[int, dict[int, int]]
    _q_full_upto: int
    _q_full_g: int
    _q_blocks: int
    _q_tok: int
    _q_weight: int
    _q_dups: bool
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

    def _ids(self, pod: str, tier: str) -> tuple[int, int]:
        """The pod's and the tier's ids, given on first sight (-1: over the limits)."""
        pid = self._pod_ids.get(pod)
        if pid is None:
            pid = self._new_pod(pod)
        tid = self._tier_ids.get(tier)
        if tid is None:
            tid = self._new_tier(tier)
        return pid, tid

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
    ) -> int:
        """Consecutive BlockStored events of `pod` on one tier from one root, as columns: event e has
        hashes_per_event[e] of `hashes` (in order), parent `parents[e]`, tokens_per_event[e] of `tokens` and
        engine block size block_sizes[e]. The same as `store` for each, in order; returns how many were
        orphans. A run whose events all chain from known blocks is queued in one pass (`_queue_run`).
        `hash_array`: the same hashes as a uint64 array (the compiled scan has it), queued as it is
        instead of converting `hashes` at the flush; kept by reference until then. With it, `hashes` are
        taken as unsigned (the array's values), not checked for signed ones."""
        if not len(parents) == len(hashes_per_event) == len(tokens_per_event) == len(block_sizes):
            raise ValueError("store_run: parents and the per-event counts and sizes differ in length")
        if sum(hashes_per_event) != len(hashes) or sum(tokens_per_event) != len(tokens):
            raise ValueError("store_run: the per-event counts do not add up to the hashes and tokens given")
        if hash_array is not None and (hash_array.dtype != np.uint64 or hash_array.shape != (len(hashes),)):
            raise ValueError("store_run: hash_array is not the hashes' uint64 array")
        if hash_array is None:  # (with the array, the hashes are its values: unsigned already)
            hashes = unsigned(hashes)
        if any(p is not None and p < 0 for p in parents):
            parents = [unsigned_parent(p) for p in parents]
        pid, tid = self._ids(pod, tier)
        if (
            len(parents) > 1
            and pid >= 0
            and tid >= 0
            and isinstance(tokens, np.ndarray)
            and self._queue_run(
                pid,
                tid,
                root,
                hashes,
                parents,
                hashes_per_event,
                tokens,
                tokens_per_event,
                block_sizes,
                hash_array,
            )
        ):
            return 0
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
        hash_array: npt.NDArray[np.uint64] | None,
    ) -> bool:
        """Queue a run of stores as `_store` would one by one, when that needs no flush in between and no
        event is an orphan or malformed; False (nothing changed) otherwise. Each event's parent is the last
        block of an earlier event of the run, queued, held, or None (the root)."""
        bs = self.block_size
        max_ebs = self._max_ebs
        weight = 0
        for n, ntok, ebs in zip(hashes_per_event, tokens_per_event, block_sizes, strict=True):
            if not (n and 1 <= ebs <= max_ebs and (n - 1) * ebs < ntok <= n * ebs):
                return False
            weight += (ntok + bs - 1) // bs + (0 if ebs >= bs and ntok == n * ebs else n)
        if tokens.dtype.kind not in "iu" or self._h.used + self._q_weight + weight > self.max_entries:
            return False  # (a store that may evict flushes first)
        run = set(hashes)
        if len(run) != len(hashes):
            return False
        left = self._r_left.get(pid)
        if left and not left.keys().isdisjoint(run):
            return False
        discarded = self._d_set.get(pid)
        if discarded and not (discarded.isdisjoint(run) and discarded.isdisjoint(parents)):
            return False
        ends: dict[int, int] = {}  # the run's events' last blocks -> their positions
        g = self._q_blocks
        evs: list[QueuedEvent] = []
        s0s: list[int] = []
        h = 0
        for parent, n, ntok, ebs in zip(
            parents, hashes_per_event, tokens_per_event, block_sizes, strict=True
        ):
            v = None if parent is None else ends.get(parent)
            if v is not None:
                pref, npend0, s0 = v >> 8, v & 0xFF, 0
            elif parent is not None and parent in run:
                return False  # a block of the run other than an event's last
            else:
                start = self._chain_start(pid, parent, root, left)
                if start is None:
                    return False  # an orphan: `_store` counts it
                pref, npend0, s0 = start
            evs.append((pid, tid, n, ntok, ebs, pref, npend0))
            s0s.append(s0)
            h += n
            g += n
            ends[hashes[h - 1]] = (g - 1) * 256 + (npend0 + ntok) % bs
        self._enqueue(pid, evs, s0s, hashes, tokens, ends, len(tokens), weight, hash_array)
        return True

    def _enqueue(
        self,
        pid: int,
        evs: list[QueuedEvent],
        s0s: list[int],
        hashes: Sequence[int],
        tokens: bytes | npt.NDArray[np.integer],
        ends: dict[int, int],
        ntok: int,
        weight: int,
        hash_array: npt.NDArray[np.uint64] | None = None,
    ) -> None:
        """Queue stores of `pid` whose chains are resolved: their rows, start states, hashes (in order; also
        as a uint64 array when the caller has one), token ids and the positions of their last blocks; flush
        when the queue is full."""
        unknown = self._unknown.get(pid)
        if unknown:
            for x in hashes:
                unknown.pop(x, None)
        self._q_ev.extend(evs)
        self._q_s0.extend(s0s)
        self._q_hashes.extend(hashes)
        self._q_arrays.append(hash_array)
        self._q_tokens.append(tokens)
        queued = self._q_set.get(pid)
        if queued is None:
            queued = self._q_set[pid] = set()
            self._q_last[pid] = {}
        size = len(queued) + len(hashes)
        queued.update(hashes)
        if len(queued) != size:
            self._q_dups = True  # a hash queued twice for the pod
        self._q_last[pid].update(ends)
        self._q_blocks += len(hashes)
        self._q_tok += ntok
        self._q_weight += weight
        if self._q_tok >= FLUSH_TOKENS or self._q_blocks >= FLUSH_BLOCKS:
            self._flush()

    def _chain_start(
        self, pid: int, parent: int | None, root: int, left: dict[int, int] | None
    ) -> tuple[int, int, int] | None:
        """Where an event's chain starts: (queue position of its parent block, or -1; tokens the parent
        left past an index boundary; the start state when the parent is not queued: the root's, or the
        held parent record's). None when the parent is not known for the pod (an orphan); `left`: the
        pod's queued removals (a parent whose last tier goes in them is not known)."""
        if parent is None:
            s0 = self._roots.get(root, -1)
            return -1, 0, s0 if s0 >= 0 else self._root_state(root)
        v = self._queued_at(pid, parent)
        if v is not None:
            return v >> 8, v & 0xFF, 0
        if left and left.get(parent) == 0:
            return None
        slot = self._h.find_record(pid, parent)
        if slot < 0:
            return None
        return -1, self._h.record_info(slot) & 0xFF, self._h.record_state(slot)

    def _queued_at(self, pid: int, ehash: int) -> int | None:
        """The position of the latest queued store of (pod, engine hash), or None when none is queued."""
        queued = self._q_set.get(pid)
        if not queued or ehash not in queued:
            return None
        if not self._q_dups:  # each hash queued once: an event's last block is where `_q_last` says
            v = self._q_last[pid].get(ehash)
            if v is not None:
                return v
        bs = self.block_size
        g = self._q_full_g
        hashes = self._q_hashes
        for pod, _, n, ntok, ebs, _, npend0 in self._q_ev[self._q_full_upto :]:
            index = self._q_full.get(pod)
            if index is None:
                index = self._q_full[pod] = {}
            if ebs % bs == 0 and ntok == n * ebs:  # every block leaves the chain where the event began it
                index.update(zip(hashes[g : g + n], range(g * 256 + npend0, (g + n) * 256, 256), strict=True))
            else:
                ends = [min((j + 1) * ebs, ntok) if j < n - 1 else ntok for j in range(n)]
                index.update(
                    zip(
                        hashes[g : g + n],
                        [(g + j) * 256 + (npend0 + e) % bs for j, e in enumerate(ends)],
                        strict=True,
                    )
                )
            g += n
        self._q_full_upto = len(self._q_ev)
        self._q_full_g = g
        return self._q_full[pid][ehash]

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
        bs = self.block_size
        tokens = None
        if n and pid >= 0 and tid >= 0 and 1 <= ebs <= self._max_ebs and (n - 1) * ebs < ntok <= n * ebs:
            tokens = pack_tokens(token_ids, ntok)
        if tokens is None:
            if n:
                self._rejected += 1
                if pid >= 0:
                    self._forget_chain(pid, engine_hashes)
            return 0
        # what the event may add to the bound: its keys, + 1 per engine block that might complete none
        full = ntok == n * ebs
        weight = (ntok + bs - 1) // bs + (0 if ebs >= bs and full else n)
        if self._q_blocks and self._h.used + self._q_weight + weight > self.max_entries:
            self._flush()  # this store may evict: what it sees must include the queued stores' evictions
        left = self._r_left.get(pid)
        if left and not left.keys().isdisjoint(engine_hashes):
            self._flush()
            left = None
        discarded = self._d_set.get(pid)
        if discarded and (parent_engine_hash in discarded or not discarded.isdisjoint(engine_hashes)):
            self._flush()  # whether the parent is still held, and the order of effects
            left = None

        start = self._chain_start(pid, parent_engine_hash, root, left)
        if start is None:
            self._orphan(pid, parent_engine_hash, engine_hashes)  # type: ignore[arg-type]  # (not None here)
            return -1
        pref, npend0, s0 = start

        end = (self._q_blocks + n - 1) * 256 + (npend0 + ntok) % bs
        ev = (pid, tid, n, ntok, ebs, pref, npend0)
        self._enqueue(pid, [ev], [s0], engine_hashes, tokens, {engine_hashes[-1]: end}, ntok, weight)
        return (npend0 + ntok) // bs

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
