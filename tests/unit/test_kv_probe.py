"""The batched read probe of the hash table (`HashTable.locate`, `find`) and `Holdings.masks`, against a
per-key Python lookup that scans the two buckets `_pair` names."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epp.kvindex import cuckoo
from epp.kvindex import probe as probe_module
from epp.kvindex.holdings import CHUNK_BITS
from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import block_keys, root_key
from epp.kvindex.probe import BUCKET
from epp.kvindex.table import HashTable

BS = 4
_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def lookup(table: HashTable, key: int, tag: int) -> int:
    """Slot of (key, tag) or -1, one slot at a time: the occupied slots of both of its buckets."""
    for b in table._pair(key, tag):
        for at in range(b * BUCKET, b * BUCKET + int(table.count[b])):
            if int(table.keys[at]) == key and int(table.tags[at]) == tag:
                return at
    return -1


def check_probe(table: HashTable, probe_keys: list[int], probe_tags: list[int], model: set[Any]) -> None:
    keys = np.array(probe_keys, dtype=np.uint64)
    expected = [[lookup(table, k, t) for k in probe_keys] for t in probe_tags]
    for row, t in zip(expected, probe_tags, strict=True):
        assert [s >= 0 for s in row] == [(k, t) in model for k in probe_keys]
    slots, found = table.locate(keys, probe_tags)  # every key under every tag
    assert slots.shape == found.shape == (len(probe_tags) * len(keys),)
    assert ((slots >= 0) & (slots < table.capacity)).all()  # valid indices even where absent
    assert np.where(found, slots, -1).tolist() == [s for row in expected for s in row]
    # One tag per key, and `find` on top of it.
    tags = np.array([probe_tags[i % len(probe_tags)] for i in range(len(keys))], dtype=table.tag_dtype)
    want = [lookup(table, k, t) for k, t in zip(probe_keys, tags.tolist(), strict=True)]
    assert table.find(keys, tags).tolist() == want
    slots, found = table.locate(keys, tags)
    assert np.where(found, slots, -1).tolist() == want


@st.composite
def contents(draw: st.DrawFn) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    """A pool of keys (0 is the key of empty slots, so it matches them all), items (key, tag) with
    several tags per key, and which items to delete afterwards."""
    pool = draw(
        st.lists(
            st.one_of(st.sampled_from([0, 1, 2**64 - 1]), st.integers(0, 2**64 - 1)),
            min_size=1,
            max_size=30,
            unique=True,
        )
    )
    items = draw(
        st.lists(st.tuples(st.integers(0, len(pool) - 1), st.integers(0, 7)), max_size=120, unique=True)
    )
    gone = draw(st.lists(st.integers(0, max(0, len(items) - 1)), max_size=len(items) // 2))
    return pool, [(pool[k], t) for k, t in items], gone


@_SETTINGS
@given(
    data=contents(),
    buckets=st.sampled_from([2, 3, 5, 16]),
    roomy=st.booleans(),
    tag_dtype=st.sampled_from([np.uint16, np.uint32]),
    batches=st.integers(1, 4),
    extra=st.lists(st.integers(0, 2**64 - 1), max_size=10),
    probe_tags=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    small_steps=st.booleans(),
)
def test_the_probe_matches_a_per_key_lookup(
    data: tuple[list[int], list[tuple[int, int]], list[int]],
    buckets: int,
    roomy: bool,
    tag_dtype: type[np.unsignedinteger[Any]],
    batches: int,
    extra: list[int],
    probe_tags: list[int],
    small_steps: bool,
) -> None:
    """Tiny tables at high load: keys under several tags share buckets (several matches of one key in
    the 16 slots), items sit in their first and second buckets, equal first and second buckets are
    adjusted, cuckoo moves and deletions compact buckets."""
    pool, items, gone = data
    table = HashTable(
        tag_dtype, {"v": (np.uint32, 0)}, buckets=buckets, max_load=0.97, roomy_until=1 << 30 if roomy else 0
    )
    model: set[tuple[int, int]] = set()
    size = max(1, -(-len(items) // batches))
    for lo in range(0, len(items), size):
        part = items[lo : lo + size]
        keys = np.array([k for k, _ in part], dtype=np.uint64)
        tags = np.array([t for _, t in part], dtype=tag_dtype)
        values = {"v": np.arange(len(part), dtype=np.uint32)}
        if lo == 0:  # (`insert` takes its buckets from `_pairs`, `upsert` from the probe)
            table.insert(keys, tags, values)
        else:
            table.upsert(keys, tags, values)
        model.update(part)
    dead = sorted({items[i] for i in gone if i < len(items)})
    if dead:
        slots = table.find(
            np.array([k for k, _ in dead], dtype=np.uint64), np.array([t for _, t in dead], dtype=tag_dtype)
        )
        assert (slots >= 0).all()
        table.delete(slots)
        model.difference_update(dead)
    assert table.size == len(model)
    with pytest.MonkeyPatch.context() as mp:
        if small_steps:  # the probe in pieces (bounded temporaries)
            mp.setattr(probe_module, "_PROBE_ITEMS", 3)
        check_probe(table, pool + [k for k in extra if k not in pool], probe_tags, model)


@pytest.mark.parametrize("buckets", [2, 3, 5])
@pytest.mark.parametrize("seed", range(4))
def test_full_tiny_tables(buckets: int, seed: int) -> None:
    """Tables that do not grow, filled to the last slot: with so few buckets many items have equal
    first and second choices (the second is adjusted to the next bucket), and both buckets are used."""
    rng = np.random.default_rng(seed)
    table = HashTable(np.uint16, {}, buckets=buckets, max_load=1.0)
    n = buckets * BUCKET - int(rng.integers(0, 3))
    keys = rng.integers(0, 2**64 - 1, size=n, dtype=np.uint64)
    keys[: n // 4] = keys[n // 4 : 2 * (n // 4)]  # some keys under two tags
    tags = np.where(np.arange(n) < n // 4, 1, 0).astype(np.uint16)
    table.insert(keys, tags, {})
    assert table.nb == buckets and table.size == n
    model = set(zip(keys.tolist(), tags.tolist(), strict=True))
    check_probe(table, [*dict.fromkeys(keys.tolist()), 5], [0, 1, 2], model)


def test_a_key_under_many_tags_is_settled_slot_by_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """One key under 40 tags in 2..16 buckets: its 16 slots hold it several times, so the word of
    matches says nothing of the tag and `_settle` decides."""
    rng = np.random.default_rng(3)
    table = HashTable(np.uint16, {}, buckets=2, roomy_until=1 << 30)
    key = 0x1234_5678_9ABC_DEF0
    others = rng.integers(0, 2**64 - 1, size=60, dtype=np.uint64)
    table.insert(np.full(40, key, dtype=np.uint64), np.arange(0, 80, 2, dtype=np.uint16), {})
    table.insert(others, np.zeros(len(others), dtype=np.uint16), {})
    calls = []
    settle = probe_module._settle

    def spy(table: HashTable, items: Any, *args: Any) -> None:
        calls.append(len(items))
        settle(table, items, *args)

    monkeypatch.setattr(probe_module, "_settle", spy)
    probe = [key, *others.tolist(), 7]
    check_probe(
        table,
        probe,
        list(range(0, 82)),
        {(key, t) for t in range(0, 80, 2)} | {(k, 0) for k in others.tolist()},
    )
    assert calls


def test_items_in_second_buckets_and_empty_tables() -> None:
    rng = np.random.default_rng(5)
    table = HashTable(np.uint16, {}, buckets=64, max_load=0.95)
    keys = rng.integers(0, 2**64 - 1, size=400, dtype=np.uint64)
    tags = rng.integers(0, 3, size=400).astype(np.uint16)
    slots, found = table.locate(keys, [0, 1])  # empty table
    assert not found.any() and ((slots >= 0) & (slots < table.capacity)).all()
    table.insert(keys, tags, {})
    slots, found = table.locate(keys, tags)
    assert found.all()
    pairs = [table._pair(k, t) for k, t in zip(keys.tolist(), tags.tolist(), strict=True)]
    second = [s // BUCKET == b2 for (_, b2), s in zip(pairs, slots.tolist(), strict=True)]
    assert 0 < sum(second) < len(second)  # both buckets are used
    assert [s >= 0 for s in table.find(keys, tags)] == [True] * len(keys)
    assert table.locate(keys[:0], [0, 1])[0].shape == (0,)
    assert table.locate(keys, [])[1].shape == (0,)


def test_masks_match_a_per_key_lookup() -> None:
    """`Holdings.masks` over 3 chunks of pods and 2 tiers, with absent keys and removed blocks."""
    rng = np.random.default_rng(11)
    index = BlockIndex(BS, max_entries=100_000)
    pods = [f"pod-{i}" for i in range(70)]  # chunks 0, 1, 2
    root = root_key("m")
    tokens = rng.integers(1, 50_000, size=64 * BS).tolist()
    hashes = list(range(1, 65))
    for p, pod in enumerate(pods):
        n = int(rng.integers(0, 65))
        tier = "gpu" if p % 3 else "cpu"
        if n:
            index.store(pod, hashes[:n], None, tokens[: n * BS], BS, tier, root)
        if n > 4 and p % 5 == 0:
            index.remove(pod, hashes[n - 3 : n], tier)
    index.flush()
    h = index._h
    keys = np.array(
        [*block_keys(tokens, BS, root), *rng.integers(0, 2**64 - 1, size=8, dtype=np.uint64).tolist()],
        dtype=np.uint64,
    )
    tiers = list(range(h.ntiers))
    for chunks in ([0], [0, 1, 2], [2, 0], [1, 3]):
        got = h.masks(keys, chunks, tiers)
        assert got.shape == (len(tiers), len(chunks), len(keys))
        for ci, c in enumerate(chunks):
            for j, k in enumerate(keys.tolist()):
                at = lookup(h.blocks, k, c)
                for ti, t in enumerate(tiers):
                    assert got[ti, ci, j] == (0 if at < 0 else h.blocks.cols[f"m{t}"][at])
    held = h.masks(keys, [0, 1, 2], tiers)
    assert held.any() and not held[:, :, -8:].any()
    for pod, p in index._pod_ids.items():  # the masks agree with lookup()
        res = index.lookup(keys[:64], [pod])[pod]
        bits = (np.bitwise_or.reduce(held, axis=0)[p >> CHUNK_BITS, :64] >> (p & 31)) & 1
        assert res.get("any", 0) == int(np.cumprod(bits).sum())
    assert h.masks(keys, [], tiers).shape == (len(tiers), 0, len(keys))
    assert h.masks(keys[:0], [0], tiers).shape == (len(tiers), 1, 0)


def _numpy_move_rows(new: Any, old: Any, src: Any, dest: Any, moved: int) -> None:
    """What `table_growth.split` did before `cuckoo.move_rows`: numpy's fancy indexing."""
    new[dest[:moved]] = old[src[:moved]]


@pytest.mark.parametrize("seed", range(3))
def test_a_split_moves_the_columns_as_numpy_fancy_indexing_does(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tables grown from empty by doubling (`table_growth.split`, roomy) hold the same keys, tags and
    column values in the same slots whether the compiled loop or numpy moves the columns."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 2**64 - 1, size=20_000, dtype=np.uint64)
    tags = rng.integers(0, 50, size=len(keys)).astype(np.uint16)
    values = {
        "state": rng.integers(0, 2**64 - 1, size=len(keys), dtype=np.uint64),
        "info": rng.integers(0, 2**32 - 1, size=len(keys), dtype=np.uint64).astype(np.uint32),
    }

    def grown() -> HashTable:
        table = HashTable(np.uint16, {"state": (np.uint64, 0), "info": (np.uint32, 0)}, roomy_until=1 << 20)
        table.add_column("s0", np.uint32, 0xFFFFFFFF)
        for lo in range(0, len(keys), 700):
            chunk = {name: col[lo : lo + 700] for name, col in values.items()}
            chunk["s0"] = (np.arange(lo, min(lo + 700, len(keys))) * 3).astype(np.uint32)
            table.upsert(keys[lo : lo + 700], tags[lo : lo + 700], chunk)
        return table

    compiled = grown()
    with monkeypatch.context() as m:
        m.setattr(cuckoo, "move_rows", _numpy_move_rows)
        reference = grown()
    assert compiled.nb == reference.nb > 16 and compiled.size == reference.size == len(keys)
    for a, b in [
        (compiled.keys, reference.keys),
        (compiled.tags, reference.tags),
        (compiled.count, reference.count),
    ]:
        np.testing.assert_array_equal(a, b)
    for name in ("state", "info", "s0"):
        np.testing.assert_array_equal(compiled.cols[name], reference.cols[name])
    slots = compiled.find(keys, tags)
    assert (slots >= 0).all()
    np.testing.assert_array_equal(compiled.cols["state"][slots], values["state"])
