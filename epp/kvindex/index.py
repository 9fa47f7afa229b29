"""The exact, tiered prefix block index: which pod holds which block on which tier. Pure.

Fed by engine KV events (`store` = BlockStored, `remove` = BlockRemoved, `clear_pod` =
AllBlocksCleared / engine restart / pod removal); read per request by `lookup`, which gives for every
pod and tier the length of the consecutive prefix of the prompt's blocks held there.

Keys. Engine hashes are opaque, so the index recomputes our keys (`keys.py`) from each event's token
ids, chained from the parent's chain state (kept per (pod, engine hash)) or from `root` when the
parent is None. Engine and index block sizes may differ: every engine block keeps the chain state
after its last token and how many tokens it left past the last index boundary, so an engine block of
64 tokens completes 4 index blocks of 16, and SGLang pages of 1..15 tokens complete one every few
pages; the keys equal `block_keys` over the whole token sequence. An engine block owns the index keys
it completes (for removals); one that completes none (a short page) still carries the chain.

Entries. An entry is (key, pod, tier): the pod holds that index block on that tier. A BlockStored on
tier T makes the *units* (engine block, T) live, and each unit owns the index keys its engine block
completes; an entry exists while at least one unit of the pod owns it (two engine blocks of 64 tokens
that share their first 40 tokens complete the same first two index blocks). An engine hash is taken to
name its content (the keys first computed for it are kept), but an engine may hold several physical
copies of one block under its hash (vLLM recomputes the last block of a repeated block-aligned prompt
and stores it again; each copy is evicted with its own BlockRemoved). So a unit counts its copies: each
BlockStored of (pod, engine hash) on T adds one (and renews the unit's recency), each BlockRemoved of
it on T takes one, and the unit stays live, owning its keys, until its last copy goes. A BlockRemoved
returns the keys the units it ended released (what they owned; an entry that another engine block
still owns stays; 0 when a copy is left). A removal of a hash the pod does not hold on T is a no-op.
AllBlocksCleared (`clear_pod`) and eviction by the memory bound drop a unit with all its copies.

Orphans. A BlockStored whose parent hash is unknown for the pod (an earlier event was lost) is not
indexed: its keys cannot be known, and guessing (e.g. chaining from the root) would index blocks under
wrong keys. It is counted (`orphans`, and `StoreOutcome.orphan`), and its engine hashes are remembered
as an *unknown chain* (at most `max_unknown` per pod, oldest forgotten first) so that descendants are
recognised and counted as orphans of a known loss (`orphan_descendants`) rather than new losses; they
are never indexed either. Remembering costs no entries. A later store of the same hashes with a known
parent (e.g. after a replay) indexes them normally. Malformed events (token count not matching the
blocks, over the tier / pod limits) are counted as `rejected`, and their hashes join the unknown chain.

Memory bound. At most `max_entries` entries. The bound counts ownerships (each live unit's keys, and 1
for an engine block that completes none, such as a short page), an upper bound of the entries. When a
store pushes it over `max_entries`, the least recently stored units are evicted (every stored unit gets
its own stamp, so there are no ties; within one event the deeper blocks are older, so a chain loses its
tail first), until `evict_headroom` is free: eviction then runs once per so many stores. Evicting a unit
forgets its chain state once no tier holds it, so later children of that block are orphans. Extra copies
of a unit count nothing (they add no entry; a sparse side table counts them).

Batching. `store` and `remove` do their bookkeeping (is the parent known? how many entries?) at once, a
store's in a compiled loop (`queue_loop.py`), and queue the numpy work, which runs in batches (`flush`): when
the queue holds 4,096 blocks or 64K tokens, before any read (`lookup`, `lookup_weighted`, `pod_counts`,
`pods`, `stats`), before `clear_pod`, before an operation that touches an engine hash with queued work, and
before a store that might push the index over its bound. The order of effects is therefore exactly that of the
calls. A read pays for the queued work (about 1 us per queued block), so a caller that wants steady read
latency calls `flush()` after each batch of events. `store_run` applies a run of BlockStored events of one
tier and root given as columns (what the compiled scan of a message gives, `event_scan.py`) with the same
effects as `store` for each, in one call of that loop while nothing stops it (a flush, an orphan, a malformed
event), with one token array. `store_many` groups a list of stores into runs. Token ids are queued as int64
arrays or packed bytes (`packing.py`). Single writer, not thread-safe. Reads are in `reads.py`.

Limits: 65,534 pods at a time (ids are reused after `clear_pod`), 12 tier names, index blocks of up to
256 tokens, engine blocks of up to 4,095 index blocks. The arrays (`holdings.py`, `table.py`) take 45-60
bytes per entry (10 M entries, engine blocks the size of index blocks, one tier, no shared keys); tables
holding less than a quarter of `max_entries` trade memory for speed (up to about twice that per entry).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from epp.kvindex import queue_loop, store_queue
from epp.kvindex.events import KNOWN_TIERS
from epp.kvindex.eviction import MAX_KEYS_PER_RECORD
from epp.kvindex.holdings import MAX_PODS, MAX_TIERS, Batch, Holdings
from epp.kvindex.keys import state_of
from epp.kvindex.packing import StoreTokens, flat_tokens, pack_tokens, unsigned, unsigned_parent
from epp.kvindex.reads import IndexReads
from epp.kvindex.removals import IndexRemovals
from epp.kvindex.store_queue import IndexQueue

_ROOT_CACHE: Final = 4096

StoreArgs = tuple[Sequence[int], int | None, Sequence[int] | npt.NDArray[np.integer], int, str, int]
"""One BlockStored for `BlockIndex.store_many`: (engine hashes, parent engine hash, token ids, engine block
size, tier, root)."""


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    stored: int  # (block, pod, tier) entries added or refreshed
    orphan: bool  # parent engine hash unknown for this pod


_STORED: Final = [StoreOutcome(k, False) for k in range(1025)]  # immutable: shared, not rebuilt per event
_ORPHAN: Final = StoreOutcome(0, True)


@dataclass(frozen=True, slots=True)
class IndexStats:
    entries: int  # (block key, pod, tier) entries held (distinct)
    max_entries: int
    evicted: int  # entries evicted by the memory bound so far
    orphans: int  # BlockStored events whose parent was unknown
    orphan_descendants: int = 0  # of those, events whose parent was itself an orphan (same loss)
    rejected: int = 0  # malformed BlockStored events (token count, limits), not indexed
    engine_blocks: int = 0  # (pod, engine hash) records held (chain state, removals)
    nbytes: int = 0  # bytes held by the index's arrays


class BlockIndex(IndexQueue, IndexReads, IndexRemovals):
    def __init__(
        self,
        block_size: int = 16,
        max_entries: int = 10_000_000,
        *,
        evict_headroom: int | None = None,
        max_unknown: int = 4096,
    ) -> None:
        """`evict_headroom`: entries freed beyond the bound when evicting (default max_entries / 64),
        so that eviction runs in batches; 0 evicts exactly down to the bound."""
        if not 1 <= block_size <= 256:
            raise ValueError("block_size must be in 1..256")
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.block_size = block_size
        self.max_entries = max_entries
        self.evict_headroom = max_entries // 64 if evict_headroom is None else evict_headroom
        self.max_unknown = max_unknown
        self._max_ebs = block_size * MAX_KEYS_PER_RECORD - block_size + 1
        self._h = Holdings(block_size, roomy_until=max_entries // 4)
        self._pod_ids: dict[str, int] = {}
        self._pod_names: list[str | None] = []
        self._free_ids: list[int] = []
        self._tier_ids: dict[str, int] = {}
        self._tier_names: list[str] = []
        self._unknown: dict[int, dict[int, None]] = {}
        self._roots: dict[int, int] = {}
        self._evicted = 0
        self._orphans = 0
        self._descendants = 0
        self._rejected = 0
        self._new_queue()
        self._reset_queue()

    def _new_queue(self) -> None:
        """The queue's arrays (`store_queue.py`, `queue_loop.py`): they grow as needed and are reused."""
        self._q_ev = np.empty((7, 0), dtype=np.intp)  # (`_room` gives them their size at the first store)
        self._q_s0 = np.empty(0, dtype=np.uint64)
        self._q_h = np.empty(0, dtype=np.uint64)
        self._q_cap = 0
        self._q_one = np.empty(1, dtype=np.uint64)
        self._q_st = np.zeros(queue_loop.STATE_SIZE, dtype=np.int64)
        self._qt = store_queue.new_table(2)

    def _reset_queue(self) -> None:
        # queued stores: the counters, and the table of positions and discards at a new epoch (empty)
        st = self._q_st
        st[: queue_loop.EPOCH] = 0
        st[queue_loop.EPOCH] += 1
        self._q_tokens: list[bytes | npt.NDArray[np.integer]] = []  # int64 bytes, or integer arrays
        self._r_units: list[tuple[int, int, int]] = []  # queued removals: (pod, engine hash, tier)
        self._r_left: dict[int, dict[int, int]] = {}  # pod -> engine hash -> tiers left after them
        self._r_spent: dict[tuple[int, int, int], int] = {}  # unit -> queued removals of its extra copies
        # queued discards (resolved in the batch): per call (pod, tier, hashes), and the pods with some (the
        # hashes are in the table)
        self._d_calls: list[tuple[int, int, Sequence[int]]] = []
        self._d_pods: set[int] = set()
        self._d_count = 0

    # -- events ----------------------------------------------------------------------------
    def store(
        self,
        pod: str,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int] | npt.NDArray[np.integer],
        engine_block_size: int,
        tier: str,
        root: int,
    ) -> StoreOutcome:
        """Index the blocks of one BlockStored event for `pod` on `tier` (see the module docstring).
        Engine hashes are 64-bit ints (`events.decode_batch` makes them unsigned; an engine that always
        sends them signed works too). A `token_ids` array may be kept by reference until the next flush."""
        pid, tid = self._ids(pod, tier)
        hashes, parent = unsigned(engine_hashes), unsigned_parent(parent_engine_hash)
        k = self._store(pid, tid, hashes, parent, token_ids, engine_block_size, root)
        if k < 0:
            return _ORPHAN
        return _STORED[k] if k < len(_STORED) else StoreOutcome(k, False)

    def store_many(self, pod: str, stores: Iterable[StoreArgs]) -> int:
        """Several BlockStored events of `pod`, in order, each given as (engine hashes, parent engine hash,
        token ids, engine block size, tier, root): the same as calling `store` for each. Consecutive ones of
        one tier and root go to `store_run` together. Returns how many of them were orphans."""
        orphans = 0
        run: list[StoreArgs] = []
        for args in [*stores, None]:
            if run and (args is None or args[4:] != run[0][4:]):
                tier, root = run[0][4], run[0][5]
                tokens = [t for r in run for t in r[2]]
                ids = pack_tokens(tokens, len(tokens))  # None unless they are all integers: then one by one
                packed: StoreTokens = (
                    tokens if ids is None else np.frombuffer(ids, np.int64) if isinstance(ids, bytes) else ids
                )
                orphans += self.store_run(
                    pod, tier, root,
                    [h for r in run for h in r[0]], [r[1] for r in run], [len(r[0]) for r in run],
                    packed, [len(r[2]) for r in run], [r[3] for r in run],
                )  # fmt: skip
                run = []
            if args is not None:
                run.append(args)
        return orphans

    def _removals_queued(self) -> None:
        if len(self._r_units) + self._d_count >= store_queue.FLUSH_BLOCKS:
            self._flush()

    def clear_pod(self, pod: str) -> int:
        """Drop everything of the pod (AllBlocksCleared, engine restart, pod removal); returns the
        entries removed."""
        pid = self._pod_ids.get(pod)
        if pid is None:
            return 0
        self._flush()
        removed = self._h.remove_units(*self._h.units_of_pod(pid))
        self._unknown.pop(pid, None)
        del self._pod_ids[pod]
        self._pod_names[pid] = None
        self._free_ids.append(pid)
        return removed

    def flush(self) -> None:
        """Apply queued work now (reads do it themselves; a caller may do it when idle)."""
        self._flush()

    def stats(self) -> IndexStats:
        self._flush()
        h = self._h
        return IndexStats(
            entries=h.entries,
            max_entries=self.max_entries,
            evicted=self._evicted,
            orphans=self._orphans,
            orphan_descendants=self._descendants,
            rejected=self._rejected,
            engine_blocks=h.records.size,
            nbytes=h.nbytes(),
        )

    # -- internals -------------------------------------------------------------------------
    def _new_pod(self, pod: str) -> int:
        if self._free_ids:
            pid = self._free_ids.pop()
        elif len(self._pod_names) < MAX_PODS:
            pid = len(self._pod_names)
            self._pod_names.append(None)
            self._h.ensure_pod(pid)
        else:
            return -1
        self._pod_ids[pod] = pid
        self._pod_names[pid] = pod
        return pid

    def _new_tier(self, tier: str) -> int:
        free = MAX_TIERS - len(self._tier_names)
        # The known tiers always find a slot: names an engine made up cannot use theirs up.
        reserved = 0 if tier in KNOWN_TIERS else len(KNOWN_TIERS - self._tier_ids.keys())
        if free <= reserved:
            return -1
        tid = self._h.add_tier()
        self._tier_ids[tier] = tid
        self._tier_names.append(tier)
        return tid

    def _root_state(self, root: int) -> int:
        s = self._roots.get(root)
        if s is None:
            if len(self._roots) >= _ROOT_CACHE:
                self._roots.clear()
            s = self._roots[root] = state_of(root)
        return s

    def _flush(self) -> None:
        h = self._h
        if self._r_units or self._d_calls:
            self._apply_removals()
        st = self._q_st
        nblk = int(st[queue_loop.NBLK]) if self._q_tokens else 0  # (a queued store has its tokens there)
        if nblk:
            nev = int(st[queue_loop.NEV])
            h.add(
                Batch(
                    ev=self._q_ev[:, :nev].copy(),  # (one contiguous row per field)
                    s0=self._q_s0[:nev],
                    hashes=self._q_h[:nblk].copy(),  # (the queue's array is reused)
                    dups=bool(st[queue_loop.DUPS]),
                    tokens=flat_tokens(self._q_tokens),
                )
            )
        if self._r_units or nblk or self._d_calls:
            self._reset_queue()
        if h.used > self.max_entries:
            target = max(0, self.max_entries - self.evict_headroom)
            self._evicted += h.evict(h.used - target)
