"""The engine's paged KV block pool and prefix cache, following vLLM's V1 `BlockPool`. Pure.

Rules (`shared/reference/vllm-prefix-cache.md`, observed on vLLM 0.32):

- Block 0 is the reserved **null block**: of `num_blocks`, `num_blocks - 1` hold KV.
- The **free queue** starts as blocks 1, 2, ..., N-1. `allocate(n)` takes `n` blocks from its
  **front**; taking a block that still holds a cached (hashed) block evicts it: its hash leaves
  the cache, and the caller reports a `BlockRemoved`.
- `lookup` finds the longest run of cached full blocks from the start of a chain (the caller
  caps it); `touch` takes the hit blocks: a hit block that is free leaves the free queue while
  in use (reference count > 0), so it is refreshed when it is freed again.
- `cache` gives newly full blocks their hashes. Several physical blocks can hold one hash
  (vLLM recomputes the last block of a repeated block-aligned prompt); a lookup uses the copy
  cached first that is still cached, and each copy is evicted on its own.
- `free` releases a request's blocks in the order given (the engine passes them in reverse):
  a block whose count drops to 0 goes to the **tail** of the free queue if it is hashed, and to
  the **front** if it is not (partial blocks are reused first).

Implementation. The free queue is ordered by a stamp per free block: tail appends are stamped
with their (1-based) index in a numpy FIFO, front pushes with decreasing negative numbers in a
small stack, so the queue is the front pushes (most recent first) followed by the FIFO in order.
Both use lazy deletion: an entry is live while its block's stamp still names it (`touch` and
`allocate` reset a block's stamp to 0). So allocating and freeing a request's blocks are one
compiled loop each (`free_queue.py`), touching them a few numpy operations; the hash -> block map
is an array map fed and drained by compiled loops (`block_map.py`), the extra copies of a hash a
dict beside it.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from simulator import block_map, free_queue

Ids = npt.NDArray[np.int64]
_NO_IDS: Final[Ids] = np.zeros(0, dtype=np.int64)
_NO_HASHES: Final[npt.NDArray[np.uint64]] = np.zeros(0, dtype=np.uint64)


class BlockPool:
    __slots__ = (
        "_fb",
        "_flen",
        "_fs",
        "_head",
        "_keys",
        "_next_front",
        "_pos",
        "_q",
        "_stamp",
        "_tail",
        "_vals",
        "block_size",
        "dups",
        "hash",
        "hashed",
        "num_blocks",
        "num_free",
        "ref",
    )

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = np.zeros(num_blocks, dtype=np.int64)  # requests using the block
        self.hash = np.zeros(num_blocks, dtype=np.uint64)
        self.hashed = np.zeros(num_blocks, dtype=np.bool_)
        self._keys, self._vals = block_map.new_map(num_blocks)  # hash -> the copy a lookup uses (the first)
        self.dups: dict[int, list[int]] = {}  # hash -> every copy, in caching order (2+ copies only)
        usable = num_blocks - 1
        cap = 4 * num_blocks + 64
        self._pos = np.arange(1, cap + 1, dtype=np.int64)  # FIFO index + 1: the stamp of an entry there
        self._q = np.zeros(cap, dtype=np.int64)  # FIFO of block ids; live entries are [_head, _tail)
        self._q[:usable] = np.arange(1, num_blocks)
        self._stamp = np.zeros(num_blocks, dtype=np.int64)  # 0: not in the free queue
        self._stamp[1:] = self._pos[:usable]
        self._head = 0
        self._tail = usable
        self._next_front = -1
        # the front stack, (block, stamp) pairs, the last the front: only unhashed blocks go there, and
        # they leave it only by being taken, so it never holds more than the blocks
        self._fb = np.zeros(num_blocks, dtype=np.int64)
        self._fs = np.zeros(num_blocks, dtype=np.int64)
        self._flen = 0
        self.num_free = usable

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_free

    # -- prefix cache -----------------------------------------------------------------------
    @property
    def cached(self) -> dict[int, int]:
        """hash -> the copy a lookup uses, as a dict built on demand (tests, debugging)."""
        live = self._vals != 0
        return dict(zip(self._keys[live].tolist(), self._vals[live].tolist(), strict=True))

    def lookup(self, hashes: list[int], limit: int) -> list[int]:
        """Blocks of the longest run of cached hashes from hashes[0], at most `limit` of them."""
        got: list[int] = self.lookup_ids(np.array(hashes, dtype=np.uint64), limit).tolist()
        return got

    def lookup_ids(self, values: npt.NDArray[np.uint64], limit: int) -> Ids:
        """`lookup` for hashes as a uint64 array, blocks as an array."""
        out = np.empty(max(0, min(limit, len(values))), dtype=np.int64)
        return out[: block_map.run(self._keys, self._vals, values, limit, out)]

    def cache(self, ids: Ids, values: npt.NDArray[np.uint64]) -> None:
        """Blocks `ids` (in use, unhashed) now hold the full blocks named by the hashes `values`."""
        first = np.empty(len(ids), dtype=np.int64)
        if block_map.put_all(self._keys, self._vals, values, ids, first, self.hash, self.hashed):
            return
        for h, b, f in zip(values.tolist(), ids.tolist(), first.tolist(), strict=True):
            if f != b:
                self._another_copy(h, f, b)

    def cache_one(self, b: int, h: int) -> None:
        """`cache` for a single block (a decode filling it): scalar operations only."""
        self.hash[b] = h
        self.hashed[b] = True
        first = block_map.put(self._keys, self._vals, np.uint64(h), b)
        if first != b:
            self._another_copy(h, first, b)

    def cache_at(self, b: int, values: npt.NDArray[np.uint64], k: int) -> None:
        """`cache_one(b, values[k])` in one compiled call."""
        first = block_map.put_block(self._keys, self._vals, self.hash, self.hashed, values, k, b)
        if first != b:
            self._another_copy(values.item(k), first, b)

    def _another_copy(self, h: int, first: int, b: int) -> None:
        """Block `b` holds `h` too; lookups keep using `first`, the copy cached first."""
        copies = self.dups.get(h)
        if copies is None:
            self.dups[h] = [first, b]
        else:
            copies.append(b)

    def _uncache_one(self, b: int) -> int:
        h: int = self.hash.item(b)
        if self.dups:
            self.hashed[b] = False
            self._unmap(h, b)
        else:  # (no second copy of anything: `_unmap` removes it from the map)
            block_map.drop_block(self._keys, self._vals, self.hash, self.hashed, b)
        return h

    def _unmap(self, h: int, b: int) -> None:
        """Block `b` no longer holds `h`: the next copy serves lookups, or none."""
        copies = self.dups.get(h) if self.dups else None
        if copies is None:
            block_map.remove(self._keys, self._vals, np.uint64(h))
            return
        copies.remove(b)
        block_map.set_block(self._keys, self._vals, np.uint64(h), copies[0])
        if len(copies) == 1:
            del self.dups[h]

    def _uncache(self, ids: Ids) -> npt.NDArray[np.uint64]:
        values = self.hash[ids]
        self.hashed[ids] = False
        if not self.dups:
            block_map.remove_all(self._keys, self._vals, values)
            return values
        for h, b in zip(values.tolist(), ids.tolist(), strict=True):
            self._unmap(h, b)
        return values

    def reset_prefix_cache(self) -> bool:
        """vLLM's `reset_prefix_cache`: every block forgets its hash (the free queue keeps its order);
        refused (False, nothing changed) while a request holds blocks."""
        if self.num_used:
            return False
        self._uncache(np.flatnonzero(self.hashed))
        return True

    def copies(self, h: int) -> list[int]:
        """Physical blocks holding hash `h`, in caching order."""
        copies = self.dups.get(h)
        if copies is not None:
            return list(copies)
        b = block_map.get(self._keys, self._vals, np.uint64(h))
        return [] if b == 0 else [int(b)]

    # -- allocation ---------------------------------------------------------------------------
    def free_among(self, ids: Ids) -> int:
        """How many of `ids` (hit blocks) sit in the free queue: taking them uses free capacity."""
        return int(np.count_nonzero(self.ref[ids] == 0)) if len(ids) else 0

    def touch_if_fits(self, ids: Ids, need: int) -> bool:
        """`touch(ids)` if `need` more blocks can then be allocated (hit blocks that sit in the free queue
        use free capacity); False, touching nothing, otherwise."""
        left = free_queue.touch(ids, self.ref, self._stamp, need, self.num_free)
        if left < 0:
            return False
        self.num_free = left
        return True

    def touch(self, ids: Ids) -> None:
        """A request takes hit blocks `ids` (distinct): free ones leave the free queue."""
        if not len(ids):
            return
        ref = self.ref[ids]
        idle = ids[ref == 0]
        if len(idle):
            self._stamp[idle] = 0
            self.num_free -= len(idle)
        ref += 1
        self.ref[ids] = ref

    def allocate(self, n: int) -> tuple[Ids, Ids, npt.NDArray[np.uint64]]:
        """Take `n` blocks from the front of the free queue: (blocks, the evicted ones among them, their
        hashes), both in the order taken. Raises ValueError when fewer than `n` are free."""
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free} free")
        if n <= 0:
            return _NO_IDS, _NO_IDS, _NO_HASHES
        ids = np.empty(n, dtype=np.int64)
        evicted = np.empty(n, dtype=np.int64)
        hashes = np.empty(n, dtype=np.uint64)
        unmap = not self.dups  # else `_uncache` settles which copy serves lookups
        head, self._flen, nev = free_queue.take(
            self._q, self._stamp, self.ref, self.hashed, self._head, self._tail,
            self._fb, self._fs, self._flen, ids, evicted,
            self.hash, hashes, self._keys, self._vals, unmap,
        )  # fmt: skip
        if head < 0:
            raise AssertionError("free queue exhausted: num_free is out of step")
        self._head = head
        self.num_free -= n
        if not nev:
            return ids, _NO_IDS, _NO_HASHES
        if not unmap:
            self._uncache(evicted[:nev])
        return ids, evicted[:nev], hashes[:nev]

    def allocate_one(self) -> tuple[int, int | None]:
        """`allocate(1)` with scalar operations: (block, the hash it held and lost, or None)."""
        if self.num_free < 1:
            raise ValueError("cannot allocate 1 block, 0 free")
        b = self._pop_one()
        self._stamp[b] = 0
        self.ref[b] = 1
        self.num_free -= 1
        return b, (self._uncache_one(b) if self.hashed.item(b) else None)

    def free(self, ids: Ids) -> None:
        """Release one request's hold on `ids` (distinct), in the order given: blocks nobody uses any more
        go to the tail (hashed) or the front (unhashed) of the free queue."""
        k = len(ids)
        if not k:
            return
        if self._tail + k > len(self._q):
            self._compact(k)
        if self._flen + k > len(self._fb):  # only if stale entries piled up (see __init__)
            self._compact_front()
        self._tail, self._flen, self._next_front, freed = free_queue.give_back(
            ids, self.ref, self.hashed, self._stamp, self._q, self._tail,
            self._fb, self._fs, self._flen, self._next_front,
        )  # fmt: skip
        self.num_free += freed

    # -- the free queue -----------------------------------------------------------------------
    def _compact(self, extra: int) -> None:
        """Make room for `extra` more FIFO entries: drop the stale ones (and grow when needed)."""
        ids = self._q[self._head : self._tail]
        ids = ids[self._stamp[ids] == self._pos[self._head : self._tail]]
        n = len(ids)
        if n + extra > len(self._q):
            size = 2 * (n + extra) + 64
            self._q = np.zeros(size, dtype=np.int64)
            self._pos = np.arange(1, size + 1, dtype=np.int64)
        self._q[:n] = ids
        self._stamp[ids] = self._pos[:n]
        self._head, self._tail = 0, n

    def _compact_front(self) -> None:
        fb, fs = self._fb[: self._flen], self._fs[: self._flen]
        live = self._stamp[fb] == fs
        n = int(live.sum())
        self._fb[:n], self._fs[:n] = fb[live], fs[live]
        self._flen = n

    def _pop_one(self) -> int:
        stamp, fb, fs = self._stamp, self._fb, self._fs
        while self._flen:
            self._flen -= 1
            b: int = fb.item(self._flen)
            if stamp.item(b) == fs.item(self._flen):
                return b
        q = self._q
        head = self._head
        while head < self._tail:
            b = q.item(head)
            head += 1
            if stamp.item(b) == head:  # the entry at index head - 1 is stamped head
                self._head = head
                return b
        raise AssertionError("free queue exhausted: num_free is out of step")

    def free_queue(self) -> list[int]:
        """The free queue, front first (for tests and debugging; O(queue))."""
        stamp = self._stamp
        front = zip(self._fb[: self._flen].tolist(), self._fs[: self._flen].tolist(), strict=True)
        out = [b for b, s in reversed(list(front)) if stamp[b] == s]
        ids = self._q[self._head : self._tail]
        out.extend(ids[stamp[ids] == self._pos[self._head : self._tail]].tolist())
        return out

    def check(self) -> None:
        """Assert the pool's invariants (tests): free + in use + null == total; the free queue holds
        exactly the unused blocks; the cache map names exactly the hashed blocks."""
        queue = self.free_queue()
        assert len(queue) == len(set(queue)) == self.num_free, "free queue and count disagree"
        in_use = int(np.count_nonzero(self.ref[1:] > 0))
        assert self.num_free + in_use + 1 == self.num_blocks, "blocks not conserved"
        assert all(self.ref[b] == 0 for b in queue) and 0 not in queue, "a used block is free"
        hashed = set(np.flatnonzero(self.hashed).tolist())
        named = {b for h in self.cached for b in self.copies(h)}
        assert hashed == named, "cache map and hashed blocks disagree"
        for h in self.cached:
            assert all(int(self.hash[b]) == h for b in self.copies(h)), "a copy under the wrong hash"
