"""The block pool (free queue, prefix cache map), the block hashes and the CPU tier, against simple models."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator import block_map
from simulator.blocks import BlockPool
from simulator.hashing import block_hash, block_hashes, root_hash
from simulator.offload import CpuTier


def ids(*b: int) -> np.ndarray:
    return np.array(b, dtype=np.int64)


def cache(pool: BlockPool, blocks: list[int], hashes: list[int]) -> None:
    pool.cache(ids(*blocks), np.array(hashes, dtype=np.uint64))


# -- the pool, rule by rule ---------------------------------------------------------------------


def test_block_zero_is_the_null_block() -> None:
    pool = BlockPool(6, 4)
    assert pool.usable == 5 and pool.num_free == 5
    assert pool.free_queue() == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        pool.allocate(6)
    got, evicted, _ = pool.allocate(5)
    assert got.tolist() == [1, 2, 3, 4, 5] and len(evicted) == 0
    pool.check()


def test_allocation_takes_from_the_front_and_evicts_cached_blocks_in_that_order() -> None:
    pool = BlockPool(6, 4)
    a, _, _ = pool.allocate(3)  # 1, 2, 3
    cache(pool, a.tolist(), [101, 102, 103])
    pool.free(a[::-1])  # hashed -> tail, in reverse: queue 4 5 3 2 1
    assert pool.free_queue() == [4, 5, 3, 2, 1]
    b, evicted, hashes = pool.allocate(4)  # 4, 5, then 3 (evicts 103), 2 (evicts 102)
    assert b.tolist() == [4, 5, 3, 2]
    assert evicted.tolist() == [3, 2] and hashes.tolist() == [103, 102]
    assert pool.lookup([101, 102], 2) == [1]
    pool.check()


def test_partial_blocks_go_to_the_front_hashed_ones_to_the_tail() -> None:
    pool = BlockPool(8, 4)
    a, _, _ = pool.allocate(3)  # 1 2 3; 1 and 2 full, 3 partial
    cache(pool, [1, 2], [11, 12])
    pool.free(a[::-1])  # reverse: 3 (unhashed) -> front; 2, 1 -> tail
    assert pool.free_queue() == [3, 4, 5, 6, 7, 2, 1]
    pool.check()


def test_hit_blocks_leave_the_free_queue_and_are_refreshed_when_freed_again() -> None:
    pool = BlockPool(8, 4)
    a, _, _ = pool.allocate(2)
    cache(pool, [1, 2], [11, 12])
    pool.free(a[::-1])  # 3 4 5 6 7 2 1
    hit = pool.lookup([11, 12, 13], 3)
    assert hit == [1, 2]
    assert pool.free_among(ids(*hit)) == 2
    pool.touch(ids(*hit))
    assert pool.free_queue() == [3, 4, 5, 6, 7]
    _b, _, _ = pool.allocate(1)  # 3
    cache(pool, [3], [13])
    pool.free(ids(3, 2, 1))
    assert pool.free_queue() == [4, 5, 6, 7, 3, 2, 1]
    pool.check()


def test_the_front_stack_drops_entries_that_went_stale_when_it_fills() -> None:
    """Unhashed free blocks only leave the front by being taken, but a caller may touch one: its entry
    goes stale, and once stale entries fill the stack it keeps the live ones in order."""
    pool = BlockPool(5, 4)
    for _ in range(3):
        a, _, _ = pool.allocate(4)  # everything; the free ones (unhashed) went to the front
        pool.free(np.sort(a))  # 1 2 3 4 onto the front: the queue is 4 3 2 1
        pool.touch(ids(4, 3))  # two stale entries left on the stack
        assert pool.free_queue() == [2, 1]
        pool.free(ids(3, 4))
        assert pool.free_queue() == [4, 3, 2, 1]
        pool.check()


def test_a_block_shared_by_two_requests_is_freed_by_the_last() -> None:
    pool = BlockPool(5, 4)
    _a, _, _ = pool.allocate(1)
    cache(pool, [1], [11])
    pool.touch(ids(1))  # a second request hits it
    assert pool.free_among(ids(1)) == 0
    pool.free(ids(1))
    assert 1 not in pool.free_queue()
    pool.free(ids(1))
    assert pool.free_queue()[-1] == 1
    pool.check()


def test_duplicate_copies_the_first_is_used_and_each_is_evicted_on_its_own() -> None:
    pool = BlockPool(6, 4)
    a, _, _ = pool.allocate(2)
    cache(pool, [1], [11])
    cache(pool, [2], [11])  # a second copy of the same hash
    assert pool.copies(11) == [1, 2]
    assert pool.lookup([11], 1) == [1]
    pool.free(a[::-1])  # queue 3 4 5 2 1
    _, evicted, hashes = pool.allocate(4)  # 3 4 5 then 2: the second copy goes first
    assert evicted.tolist() == [2] and hashes.tolist() == [11]
    assert pool.lookup([11], 1) == [1] and pool.copies(11) == [1]
    pool.free(ids(2, 3, 4, 5))
    _, evicted, hashes = pool.allocate(5)  # 1 is the last cached copy
    assert evicted.tolist() == [1] and hashes.tolist() == [11]
    assert pool.lookup([11], 1) == []
    pool.check()


def test_when_the_first_copy_is_evicted_the_next_one_serves_lookups() -> None:
    pool = BlockPool(6, 4)
    pool.allocate(2)
    cache(pool, [1], [11])
    cache(pool, [2], [11])
    pool.free(ids(1))  # only copy 1 is free: queue 3 4 5 1
    pool.allocate(4)  # 3 4 5 1: evicts copy 1
    assert pool.lookup([11], 1) == [2]
    pool.check()


def test_the_fifo_compacts_and_keeps_its_order() -> None:
    pool = BlockPool(4, 1)  # 3 usable; the FIFO buffer holds 4 * 4 + 64 entries
    order: list[int] = []
    for i in range(200):
        got, _, _ = pool.allocate(2)
        cache(pool, got.tolist(), [1000 + 2 * i, 1001 + 2 * i])
        pool.free(got[::-1])
        order = pool.free_queue()
        pool.check()
    assert sorted(order) == [1, 2, 3]


# -- the pool against a literal model of the rules (hypothesis) -----------------------------


class RefPool:
    """The rules with a Python list as the free queue (front = index 0)."""

    def __init__(self, n: int) -> None:
        self.free = list(range(1, n))
        self.ref = [0] * n
        self.hash_of: dict[int, int] = {}
        self.copies: dict[int, list[int]] = {}

    def lookup(self, hashes: list[int], limit: int) -> list[int]:
        out = []
        for h in hashes[:limit]:
            if h not in self.copies:
                break
            out.append(self.copies[h][0])
        return out

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1

    def allocate(self, n: int) -> tuple[list[int], list[int]]:
        got, evicted = [], []
        for _ in range(n):
            b = self.free.pop(0)
            self.ref[b] = 1
            if b in self.hash_of:
                h = self.hash_of.pop(b)
                self.copies[h].remove(b)
                if not self.copies[h]:
                    del self.copies[h]
                evicted.append(h)
            got.append(b)
        return got, evicted

    def cache(self, blocks: list[int], hashes: list[int]) -> None:
        for b, h in zip(blocks, hashes, strict=True):
            self.hash_of[b] = h
            self.copies.setdefault(h, []).append(b)

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.hash_of:
                    self.free.append(b)
                else:
                    self.free.insert(0, b)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(3, 12),
    ops=st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.integers(0, 5), min_size=1, max_size=6), st.booleans()),
        max_size=60,
    ),
)
def test_pool_matches_the_literal_model(n: int, ops: list[tuple[int, list[int], bool]]) -> None:
    """Requests made of chains of hash ids (a small alphabet: lots of sharing and repeats) take their
    hits, allocate the rest, cache full blocks (all but maybe the last), and are freed in reverse,
    interleaved (several requests hold blocks at once)."""
    pool, ref = BlockPool(n, 4), RefPool(n)
    held: list[list[int]] = []
    for kind, chain, partial in ops:
        if kind == 0 and held:  # free the oldest request
            blocks = held.pop(0)
            pool.free(ids(*blocks[::-1]))
            ref.release(blocks[::-1])
        else:
            hashes = [hash(tuple(chain[: i + 1])) & ((1 << 64) - 1) for i in range(len(chain))]
            hit = pool.lookup(hashes, len(hashes))
            assert hit == ref.lookup(hashes, len(hashes))
            need = len(hashes) - len(hit)
            if need + pool.free_among(ids(*hit)) > pool.num_free:
                continue
            pool.touch(ids(*hit))
            ref.touch(hit)
            got, _, evicted = pool.allocate(need)
            rgot, revicted = ref.allocate(need)
            assert got.tolist() == rgot and evicted.tolist() == revicted
            blocks = hit + rgot
            full = len(blocks) - (1 if partial and need else 0)
            if full > len(hit):
                cache(pool, blocks[len(hit) : full], hashes[len(hit) : full])
                ref.cache(blocks[len(hit) : full], hashes[len(hit) : full])
            held.append(blocks)
        assert pool.free_queue() == ref.free
        pool.check()
        assert pool.num_free + sum(1 for b in range(1, n) if ref.ref[b] > 0) + 1 == n
        assert {h: pool.copies(h) for h in pool.cached} == ref.copies


# -- hashes -----------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, 2**31 - 1), max_size=80), st.sampled_from([1, 4, 16]), st.integers(0, 2**64 - 1)
)
def test_compiled_hashes_equal_the_block_by_block_chain(tokens: list[int], bs: int, parent: int) -> None:
    arr = np.array(tokens, dtype=np.int64)
    got = block_hashes(arr, bs, parent).tolist()
    want, p = [], parent
    for b in range(len(tokens) // bs):
        p = block_hash(p, tokens[b * bs : (b + 1) * bs])
        want.append(p)
    assert got == want
    if len(got) > 1:  # a chain can be continued from any block's hash
        assert block_hashes(arr[bs:], bs, got[0]).tolist() == got[1:]


def test_roots_separate_adapters_and_salts() -> None:
    roots = {root_hash(), root_hash("a"), root_hash(None, "a"), root_hash("a", "b"), root_hash("ab")}
    assert len(roots) == 5
    assert root_hash(None, None) == root_hash(None, "") == root_hash("", None)


def test_hashes_differ_for_different_content_and_position() -> None:
    t = np.arange(64, dtype=np.int64)
    h = block_hashes(t, 16, 7).tolist()
    assert len(set(h)) == 4
    assert block_hashes(t[::-1].copy(), 16, 7).tolist()[0] != h[0]
    assert block_hashes(t, 16, 8).tolist()[0] != h[0]


# -- the CPU tier -------------------------------------------------------------------------------


def test_cpu_tier_is_an_lru() -> None:
    cpu = CpuTier(2)
    assert cpu.put(1) == (True, [])
    assert cpu.put(2) == (True, [])
    assert cpu.put(1) == (False, [])  # refreshed: 2 is now the oldest
    assert cpu.put(3) == (True, [2])
    assert cpu.run([1, 3, 2], 0, 3) == 2
    cpu.load([1])  # 3 is now the oldest
    assert cpu.put(4) == (True, [3])
    assert list(cpu.lru) == [1, 4]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32), st.booleans())
def test_the_compiled_hash_map_agrees_with_a_dict_at_high_load(seed: int, tiny: bool) -> None:
    """Linear probing in a 16-slot map kept at up to 15 hashes (long runs that wrap around the end), with
    deletion by shifting entries back: every hash stays findable, whatever was removed before it."""
    rng = random.Random(seed)
    keys, vals = block_map.new_map(8)
    ref: dict[int, int] = {}
    for n in range(300):
        op = rng.random()
        if op < 0.55 and len(ref) < len(keys) - 1:
            h = rng.randrange(64) if tiny else rng.getrandbits(64)
            assert block_map.put(keys, vals, np.uint64(h), n + 1) == ref.setdefault(h, n + 1)
        elif op < 0.9 and ref:
            h = rng.choice(list(ref))
            block_map.remove(keys, vals, np.uint64(h))
            del ref[h]
        elif ref:
            h = rng.choice(list(ref))
            block_map.set_block(keys, vals, np.uint64(h), n + 1)
            ref[h] = n + 1
        assert all(block_map.get(keys, vals, np.uint64(x)) == b for x, b in ref.items())
    live = vals != 0
    assert dict(zip(keys[live].tolist(), vals[live].tolist(), strict=True)) == ref
    probe = np.array([*ref, 2**64 - 1], dtype=np.uint64)
    out = np.empty(len(probe), dtype=np.int64)
    stop = len(ref) if (2**64 - 1) not in ref else len(probe)
    assert block_map.run(keys, vals, probe, len(probe), out) == stop
    assert out[: len(ref)].tolist() == list(ref.values())


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**32))
def test_the_single_block_compiled_paths_agree_with_put_and_remove(seed: int) -> None:
    """`put_block` / `drop_block` (the pool's one-call paths for a decode filling a block and an eviction)
    leave the map and the block arrays as `put` / `remove` and the Python bookkeeping they replace do."""
    rng = random.Random(seed)
    keys, vals = block_map.new_map(8)
    rkeys, rvals = block_map.new_map(8)
    block_hash, hashed = np.zeros(16, dtype=np.uint64), np.zeros(16, dtype=np.bool_)
    rhash, rhashed = block_hash.copy(), hashed.copy()
    for _ in range(200):
        mapped = [b for b in range(1, 16) if hashed[b] and block_map.get(keys, vals, block_hash[b]) == b]
        if rng.random() < 0.6 or not mapped:
            b = rng.randrange(1, 16)
            if hashed[b]:
                continue
            h = rng.randrange(8) if rng.random() < 0.5 else rng.getrandbits(64)
            values = np.array([h], dtype=np.uint64)
            got = block_map.put_block(keys, vals, block_hash, hashed, values, 0, b)
            rhash[b], rhashed[b] = values[0], True
            assert got == block_map.put(rkeys, rvals, values[0], b)
        else:
            b = rng.choice(mapped)
            block_map.drop_block(keys, vals, block_hash, hashed, b)
            rhashed[b] = False
            block_map.remove(rkeys, rvals, rhash[b])
        assert keys.tolist() == rkeys.tolist() and vals.tolist() == rvals.tolist()
        assert block_hash.tolist() == rhash.tolist() and hashed.tolist() == rhashed.tolist()
