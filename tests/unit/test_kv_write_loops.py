"""The compiled write paths of a flush (`store_loop.store_batch`, `removal_loop.remove_held`) against the
general paths they shortcut: the same workload through both leaves every table of the index identical,
slot for slot, and the same counters. Small bounds keep the tables at their full load, where items find
both buckets full (the cuckoo steps, `_settle`, growth) and eviction runs."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from epp.kvindex import removal_loop, removals, store_loop
from epp.kvindex.holdings import Holdings
from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import root_key
from epp.kvindex.packing import flat_tokens

BS = 16
ROOT = root_key("model")
TIERS = ("gpu", "cpu")
Seen = collections.Counter[str]


def _general_store() -> Callable[..., Any]:
    """`store_batch` told never to take its fast path: chain only, then `records.upsert` and the rest."""
    fused: Callable[..., Any] = store_loop.store_batch

    def chain_only(*args: Any) -> Any:
        return fused(*args[:5], False, *args[6:])

    return chain_only


def _counting_store(seen: Seen) -> Callable[..., Any]:
    fused = store_loop.store_batch

    def counted(*args: Any) -> Any:
        out = fused(*args)
        code, _, _, nstuck, moved = out[:5]
        seen[f"code {code}"] += 1
        seen["kicked"] += moved
        seen["kick failed"] += code == store_loop.STUCK and 0 < nstuck <= store_loop.KICK_ITEMS
        seen["many stuck"] += code == store_loop.STUCK and nstuck > store_loop.KICK_ITEMS
        seen["rows later"] += code == store_loop.DONE and out[6] > 0
        return out

    return counted


def _general_removal(
    h: Holdings, keys: npt.NDArray[np.uint64], tags: npt.NDArray[np.uint16], tiers: Any, slots: Any
) -> bool:
    """What `_apply_removals` did before `remove_held`: find, the held filter, then `remove_copies`."""
    found = h.records.find(keys, tags)
    info = h.records.cols["info"][found] >> (tiers + 20).astype(np.uint32)
    slots[:] = np.where((found >= 0) & ((info & 1) == 1), found, -1)
    return False


def _state(index: BlockIndex) -> Iterator[tuple[str, Any]]:
    h = index._h
    for name in ("records", "extra", "blocks", "multi", "copies"):
        t = getattr(h, name)
        yield f"{name}.size", t.size
        yield f"{name}.nb", t.nb
        yield f"{name}.keys", t.keys
        yield f"{name}.tags", t.tags
        yield f"{name}.count", t.count
        for col, values in t.cols.items():
            yield f"{name}.{col}", values
    for name in ("counts", "units", "entries", "used", "stamp"):
        yield f"h.{name}", getattr(h, name)
    yield "stats", index.stats()


def _snapshot(index: BlockIndex) -> list[tuple[str, Any]]:
    return [(name, v.copy() if isinstance(v, np.ndarray) else v) for name, v in _state(index)]


def _assert_same(a: list[tuple[str, Any]], b: list[tuple[str, Any]]) -> None:
    for (name, x), (_, y) in zip(a, b, strict=True):
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y), name
        else:
            assert x == y, name


def _workload(seed: int, index: BlockIndex, check: Callable[[], None]) -> None:
    """Chains of stores on a few pods and tiers (engine blocks of index blocks mostly, some of several,
    some shorter; repeated hashes: copies, a block twice in one flush), removals and discards, flushes."""
    rng = np.random.default_rng(seed)
    pods = [f"pod-{i}" for i in range(40)]  # more than one 32-pod chunk
    stored: dict[str, list[int]] = {p: [] for p in pods}
    next_hash = 1 + seed * 10_000_000
    for _ in range(1_500):
        pod = pods[int(rng.integers(len(pods)))] if rng.random() < 0.5 else pods[int(rng.integers(3))]
        tier = TIERS[int(rng.random() < 0.2)]
        held = stored[pod]
        r = rng.random()
        if r < 0.65 or not held:
            n = int(rng.integers(1, 9)) if rng.random() < 0.98 else int(rng.integers(100, 400))  # (a burst)
            ebs = int(rng.choice([BS, BS, BS, BS, 2 * BS, BS // 2]))
            ntok = n * ebs - int(rng.integers(0, ebs)) if rng.random() < 0.2 else n * ebs
            hashes = []
            for _ in range(n):
                if held and rng.random() < 0.05:
                    hashes.append(held[int(rng.integers(len(held)))])  # stored again: a copy or a dup
                else:
                    hashes.append(next_hash)
                    next_hash += 1
            parent = held[int(rng.integers(len(held)))] if held and rng.random() < 0.7 else None
            tokens = rng.integers(0, 50_000, ntok, dtype=np.int64)
            if ntok == 0:
                continue
            if rng.random() < 0.5:
                index.store(pod, hashes, parent, tokens, ebs, tier, ROOT)
            else:
                index.store_run(pod, tier, ROOT, hashes, [parent], [n], tokens, [ntok], [ebs])
            held.extend(hashes)
        else:
            k = int(rng.integers(1, min(8, len(held)) + 1))
            gone = [held[int(i)] for i in rng.choice(len(held), k, replace=False)]
            if rng.random() < 0.5:
                index.discard(pod, gone, tier)
            else:
                index.remove(pod, gone, tier)
        if rng.random() < 0.15:
            index.flush()
            if rng.random() < 0.1:
                check()
    index.flush()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_entries", [600, 5_000])
def test_the_compiled_write_paths_leave_the_same_tables_as_the_general_ones(
    seed: int, max_entries: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: Seen = collections.Counter()
    ref = BlockIndex(block_size=BS, max_entries=max_entries, evict_headroom=8)
    snapshots: list[list[tuple[str, Any]]] = []
    with monkeypatch.context() as m:
        m.setattr(store_loop, "store_batch", _general_store())
        m.setattr(removals, "_remove_held", _general_removal)
        _workload(seed, ref, lambda: snapshots.append(_snapshot(ref)))
    fused = BlockIndex(block_size=BS, max_entries=max_entries, evict_headroom=8)
    monkeypatch.setattr(store_loop, "store_batch", _counting_store(seen))
    compared = iter(snapshots)
    _workload(seed, fused, lambda: _assert_same(next(compared), _snapshot(fused)))
    _assert_same(_snapshot(ref), _snapshot(fused))
    assert seen[f"code {store_loop.DONE}"] and seen[f"code {store_loop.CHAINED}"]


def test_the_workloads_meet_every_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workloads above take each way out of the compiled paths at least once."""
    seen: Seen = collections.Counter()
    monkeypatch.setattr(store_loop, "store_batch", _counting_store(seen))
    held = removal_loop.remove_held

    def counted_removal(*args: Any) -> Any:
        out = held(*args)
        seen["removal extra rows"] += out[0] == removal_loop.EXTRA_ROWS
        return out

    monkeypatch.setattr(removal_loop, "remove_held", counted_removal)
    for seed in range(6):
        for max_entries in (600, 5_000):
            index = BlockIndex(block_size=BS, max_entries=max_entries, evict_headroom=8)
            _workload(seed, index, lambda: None)
    assert seen["kicked"] and seen["removal extra rows"], seen
    assert seen["kick failed"] and seen["many stuck"], seen


@pytest.mark.parametrize(
    "pieces",
    [
        [b"\x01" * 16],
        [np.arange(3)],
        [b"\x02" * 8, np.arange(3), b"\x03" * 16],
        [np.array([2**64 - 1, 5], dtype=np.uint64), b"\x04" * 8],
        [np.arange(3, dtype=np.int32), b"\x05" * 8],  # (not 64-bit: converted)
        [np.arange(6)[::2], b"\x06" * 8],  # (not contiguous)
        [np.arange(3).astype(">i8"), b"\x07" * 8],  # (not native)
    ],
)
def test_flat_tokens_are_the_pieces_as_int64_in_order(pieces: list[bytes | npt.NDArray[np.integer]]) -> None:
    want = np.concatenate(
        [np.frombuffer(p, dtype=np.int64) if isinstance(p, bytes) else p.astype(np.int64) for p in pieces]
    )
    got = flat_tokens(pieces)
    assert got.dtype == np.int64
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("general", [False, True])
def test_one_hash_in_its_signed_and_unsigned_forms_is_one_engine_block(general: bool) -> None:
    """(A review found the fused path placed such a hash twice: the queue keyed it by the Python int.)"""
    saved = store_loop.store_batch
    if general:
        store_loop.store_batch = _general_store()
    try:
        ix = BlockIndex(block_size=4, max_entries=1000)
        root = root_key("m")
        ix.store("a", [-1], None, [1, 2, 3, 4], 4, "gpu", root)
        ix.store("a", [2**64 - 1], None, [1, 2, 3, 4], 4, "gpu", root)  # a second copy of the same block
        ix.store("a", [-2], -1, [5, 6, 7, 8], 4, "gpu", root)  # a signed parent: the same block again
        stats = ix.stats()
        assert (stats.engine_blocks, stats.entries, stats.orphans) == (2, 2, 0)
        ix.remove("a", [2**64 - 1], "gpu")  # one copy of two: the entry stays
        ix.discard("a", [-1], "gpu")  # the last copy, named signed
        ix.discard("a", [2**64 - 2], "gpu")
        assert ix.stats().entries == 0 and ix.stats().engine_blocks == 0
    finally:
        store_loop.store_batch = saved
