"""The tiered prefix block index against a plain-dict reference model, and its hash table."""

from __future__ import annotations

import hashlib
import itertools
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from epp.kvindex import store_queue
from epp.kvindex.index import BlockIndex, StoreArgs, StoreOutcome
from epp.kvindex.keys import advance, block_keys, key_of, root_key, state_of
from epp.kvindex.table import HashTable, filled

BS = 16
ROOT = root_key("model")
GPU, CPU, DISK = "gpu", "cpu", "storage"


# -- reference model ----------------------------------------------------------------------
@dataclass
class RefRecord:
    state: int
    npend: int
    keys: list[int]
    tiers: dict[str, int] = field(default_factory=dict)  # tier -> stamp
    copies: dict[str, int] = field(default_factory=dict)  # tier -> physical copies held there


class ReferenceIndex:
    """The index's documented semantics with plain dicts, one event at a time."""

    def __init__(
        self, block_size: int = BS, max_entries: int = 10**9, headroom: int = 0, max_unknown: int = 4096
    ):
        self.bs = block_size
        self.max_entries = max_entries
        self.headroom = headroom
        self.max_unknown = max_unknown
        self.records: dict[tuple[str, int], RefRecord] = {}
        self.unknown: dict[str, dict[int, None]] = {}
        self.stamp = 0
        self.evicted = self.orphans = self.descendants = self.rejected = 0

    def _forget(self, pod: str, hashes: Sequence[int]) -> None:
        u = self.unknown.setdefault(pod, {})
        for h in hashes:
            u[h] = None
        while len(u) > self.max_unknown:
            del u[next(iter(u))]

    def store(
        self,
        pod: str,
        hashes: Sequence[int],
        parent: int | None,
        tokens: Sequence[int],
        ebs: int,
        tier: str,
        root: int,
    ) -> StoreOutcome:
        n, ntok = len(hashes), len(tokens)
        if n == 0:
            return StoreOutcome(0, False)
        if ebs < 1 or not (n - 1) * ebs < ntok <= n * ebs:
            self.rejected += 1
            self._forget(pod, hashes)
            return StoreOutcome(0, False)
        if parent is None:
            state, npend = state_of(root), 0
        else:
            rec = self.records.get((pod, parent))
            if rec is None:
                self.orphans += 1
                if parent in self.unknown.get(pod, {}):
                    self.descendants += 1
                self._forget(pod, hashes)
                return StoreOutcome(0, True)
            state, npend = rec.state, rec.npend
        npend0 = npend
        u = self.unknown.get(pod)
        if u:
            for h in hashes:
                u.pop(h, None)
        for j, h in enumerate(hashes):
            chunk = tokens[j * ebs : (j + 1) * ebs] if j < n - 1 else tokens[j * ebs :]
            keys = []
            for t in chunk:
                state = advance(state, [t])
                npend += 1
                if npend == self.bs:
                    keys.append(key_of(state))
                    npend = 0
            rec = self.records.get((pod, h))
            if rec is None:
                rec = self.records[(pod, h)] = RefRecord(state, npend, keys)
            rec.tiers[tier] = self.stamp + n - 1 - j
            rec.copies[tier] = rec.copies.get(tier, 0) + 1
        self.stamp += n
        if self.used() > self.max_entries:
            self.evict(self.used() - max(0, self.max_entries - self.headroom))
        return StoreOutcome((npend0 + ntok) // self.bs, False)

    def used(self) -> int:
        return sum(max(len(r.keys), 1) * len(r.tiers) for r in self.records.values())

    def evict(self, need: int) -> None:
        before = self.entries()
        units = sorted(
            (stamp, pod, h, tier) for (pod, h), r in self.records.items() for tier, stamp in r.tiers.items()
        )
        for _, pod, h, tier in units:
            if need <= 0:
                break
            need -= max(len(self.records[(pod, h)].keys), 1)
            self._drop(pod, h, tier)
        self.evicted += before - self.entries()

    def _drop(self, pod: str, h: int, tier: str) -> int:
        """The unit goes, with all its copies."""
        rec = self.records[(pod, h)]
        del rec.tiers[tier]
        del rec.copies[tier]
        if not rec.tiers:
            del self.records[(pod, h)]
        return len(rec.keys)

    def remove(self, pod: str, hashes: Sequence[int], tier: str) -> int:
        """One copy per hash; returns the keys owned on the tier by the engine blocks whose last copy there
        went (released ownerships)."""
        removed = 0
        for h in hashes:
            self.unknown.get(pod, {}).pop(h, None)
            rec = self.records.get((pod, h))
            if rec is not None and tier in rec.tiers:
                if rec.copies[tier] > 1:
                    rec.copies[tier] -= 1
                else:
                    removed += self._drop(pod, h, tier)
        return removed

    def clear_pod(self, pod: str) -> int:
        removed = sum(self.pod_counts(pod).values())
        for pod_h in [k for k in self.records if k[0] == pod]:
            del self.records[pod_h]
        self.unknown.pop(pod, None)
        return removed

    def held(self) -> dict[str, dict[str, set[int]]]:
        out: dict[str, dict[str, set[int]]] = {}
        for (pod, _), rec in self.records.items():
            for tier in rec.tiers:
                out.setdefault(pod, {}).setdefault(tier, set()).update(rec.keys)
        return out

    def lookup(self, keys: Sequence[int], pods: Sequence[str]) -> dict[str, dict[str, int]]:
        held = self.held()
        known = {pod for (pod, _) in self.records}
        out: dict[str, dict[str, int]] = {}
        for pod in pods:
            if pod not in known:
                out[pod] = {}
                continue
            tiers = held.get(pod, {})

            def prefix(has: set[int]) -> int:
                n = 0
                while n < len(keys) and keys[n] in has:
                    n += 1
                return n

            res = {"any": prefix(set().union(*tiers.values()) if tiers else set())}
            for tier, has in tiers.items():
                if prefix(has):
                    res[tier] = prefix(has)
            out[pod] = res
        return out

    def lookup_weighted(
        self, keys: Sequence[int], pods: Sequence[str], weights: dict[str, float], unknown: float
    ) -> dict[str, float]:
        held = self.held()
        out = {}
        for pod, res in self.lookup(keys, pods).items():
            if res:
                tiers = held.get(pod, {})
                out[pod] = sum(
                    max(weights.get(t, unknown) for t, has in tiers.items() if k in has)
                    for k in keys[: res["any"]]
                )
        return out

    def pod_counts(self, pod: str) -> dict[str, int]:
        return {tier: len(keys) for tier, keys in self.held().get(pod, {}).items() if keys}

    def pods(self) -> list[str]:
        return sorted({pod for (pod, _) in self.records})

    def entries(self) -> int:
        return sum(len(keys) for tiers in self.held().values() for keys in tiers.values())


# -- an engine that emits events --------------------------------------------------------------
def engine_hash(parent: int | None, tokens: Sequence[int], root: int) -> int:
    """Content hash as engines compute them (prefix + block), opaque to the index."""
    data = repr((parent, tuple(tokens), root if parent is None else 0)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def events_for(
    tokens: Sequence[int], ebs: int, per_event: int, root: int = ROOT
) -> list[tuple[list[int], int | None, list[int]]]:
    """(hashes, parent, tokens) of the BlockStored events an engine with block size `ebs` sends for
    `tokens` (full blocks only, except a last partial page when ebs < BS), `per_event` blocks each."""
    blocks = [list(tokens[i : i + ebs]) for i in range(0, len(tokens), ebs)]
    hashes: list[int] = []
    parent: int | None = None
    for b in blocks:
        parent = engine_hash(parent, b, root)
        hashes.append(parent)
    out = []
    for i in range(0, len(blocks), per_event):
        hs = hashes[i : i + per_event]
        toks = [t for b in blocks[i : i + per_event] for t in b]
        out.append((hs, hashes[i - 1] if i else None, toks))
    return out


def store_all(
    index: BlockIndex, pod: str, tokens: Sequence[int], ebs: int, tier: str = GPU, per_event: int = 4
) -> int:
    stored = 0
    for hs, parent, toks in events_for(tokens, ebs, per_event):
        out = index.store(pod, hs, parent, toks, ebs, tier, ROOT)
        assert not out.orphan
        stored += out.stored
    return stored


TOKENS = list(range(1000, 1256))  # 256 tokens = 16 index blocks
KEYS = block_keys(TOKENS, BS, ROOT)


# -- table-driven cases -------------------------------------------------------------------
@pytest.mark.parametrize("ebs", [16, 64, 32, 8, 1, 5, 24, 48, 15, 17, 256])
@pytest.mark.parametrize("per_event", [1, 3, 16])
def test_engine_block_sizes_give_block_keys_of_the_whole_sequence(ebs: int, per_event: int) -> None:
    index = BlockIndex(BS)
    stored = store_all(index, "p", TOKENS, ebs, per_event=per_event)
    assert stored == 16
    assert index.lookup(KEYS, ["p"]) == {"p": {"any": 16, GPU: 16}}
    assert index.pod_counts("p") == {GPU: 16}
    assert index.stats().entries == 16
    # removing the engine blocks one by one removes exactly the index blocks they completed
    total = 0
    for hs, _, _ in events_for(TOKENS, ebs, per_event):
        total += index.remove("p", hs, GPU)
    assert total == 16
    assert index.stats().entries == 0 and index.pods() == []


def test_index_keys_do_not_depend_on_engine_grouping() -> None:
    index = BlockIndex(BS)
    for pod, ebs in [("a", 64), ("b", 1), ("c", 5), ("d", 16)]:
        store_all(index, pod, TOKENS[:200], ebs)  # 12 full index blocks and 8 pending tokens
    assert index.lookup(KEYS, ["a", "b", "c", "d"]) == {p: {"any": 12, GPU: 12} for p in "abcd"}


CASES = [
    # (name, ops, expected lookup of KEYS for pod "p", expected counts)
    ("store", [("store", 0, 16, GPU)], {"any": 16, GPU: 16}, {GPU: 16}),
    ("store prefix", [("store", 0, 5, GPU)], {"any": 5, GPU: 5}, {GPU: 5}),
    (
        "two tiers",
        [("store", 0, 16, GPU), ("store", 0, 8, CPU)],
        {"any": 16, GPU: 16, CPU: 8},
        {GPU: 16, CPU: 8},
    ),
    (
        "remove one tier",
        [("store", 0, 16, GPU), ("store", 0, 16, CPU), ("remove", 4, 5, GPU)],
        {"any": 16, GPU: 4, CPU: 16},
        {GPU: 15, CPU: 16},
    ),
    (
        "mixed tiers",
        [("store", 0, 4, GPU), ("store", 4, 8, CPU), ("store", 8, 12, GPU)],
        {"any": 12, GPU: 4},
        {GPU: 8, CPU: 4},
    ),
    ("hole", [("store", 0, 16, GPU), ("remove", 0, 1, GPU)], {"any": 0}, {GPU: 15}),
    ("remove unknown tier", [("store", 0, 16, GPU), ("remove", 0, 16, CPU)], {"any": 16, GPU: 16}, {GPU: 16}),
    (
        "restore after remove",
        [("store", 0, 16, GPU), ("remove", 3, 16, GPU), ("store", 0, 16, GPU)],
        {"any": 16, GPU: 16},
        {GPU: 16},
    ),
    ("clear", [("store", 0, 16, GPU), ("clear",)], {}, {}),
    # duplicate physical copies under one engine hash (vLLM re-stores a recomputed last block)
    (
        "two copies, one removed",
        [("store", 0, 16, GPU), ("store", 15, 16, GPU), ("remove", 15, 16, GPU)],
        {"any": 16, GPU: 16},
        {GPU: 16},
    ),
    (
        "two copies, both removed",
        [("store", 0, 16, GPU), ("store", 15, 16, GPU), ("remove", 15, 16, GPU), ("remove", 15, 16, GPU)],
        {"any": 15, GPU: 15},
        {GPU: 15},
    ),
    (
        "removed once more than stored",
        [("store", 0, 16, GPU), ("store", 15, 16, GPU)] + [("remove", 15, 16, GPU)] * 3,
        {"any": 15, GPU: 15},
        {GPU: 15},
    ),
    (
        "three copies, two removed",
        [("store", 0, 16, GPU), ("store", 0, 16, GPU), ("store", 0, 16, GPU)] + [("remove", 0, 16, GPU)] * 2,
        {"any": 16, GPU: 16},
        {GPU: 16},
    ),
    (
        "copies per tier: gpu twice, cpu once, gpu removed once",
        [("store", 0, 16, GPU), ("store", 15, 16, GPU), ("store", 0, 16, CPU), ("remove", 15, 16, GPU)],
        {"any": 16, GPU: 16, CPU: 16},
        {GPU: 16, CPU: 16},
    ),
    (
        "copies per tier: gpu twice, cpu once, gpu removed twice",
        [("store", 0, 16, GPU), ("store", 15, 16, GPU), ("store", 0, 16, CPU)]
        + [("remove", 15, 16, GPU)] * 2,
        {"any": 16, GPU: 15, CPU: 16},
        {GPU: 15, CPU: 16},
    ),
    (
        "copies per tier: gpu twice, cpu once, cpu removed once",
        [("store", 0, 16, GPU), ("store", 15, 16, GPU), ("store", 0, 16, CPU), ("remove", 15, 16, CPU)],
        {"any": 16, GPU: 16, CPU: 15},
        {GPU: 16, CPU: 15},
    ),
    (
        "clear drops all copies",
        [("store", 0, 16, GPU), ("store", 0, 16, GPU), ("store", 15, 16, CPU), ("clear",)],
        {},
        {},
    ),
    (
        "after clear, copies count afresh",
        [
            ("store", 0, 16, GPU),
            ("store", 15, 16, GPU),
            ("clear",),
            ("store", 0, 16, GPU),
            ("remove", 15, 16, GPU),
        ],
        {"any": 15, GPU: 15},
        {GPU: 15},
    ),
    (
        "after the last copy went, copies count afresh",
        [("store", 0, 16, GPU), ("store", 15, 16, GPU)]
        + [("remove", 15, 16, GPU)] * 2
        + [("store", 15, 16, GPU), ("remove", 15, 16, GPU)],
        {"any": 15, GPU: 15},
        {GPU: 15},
    ),
    (
        "clear and store",
        [("store", 0, 16, GPU), ("clear",), ("store", 0, 2, DISK)],
        {"any": 2, DISK: 2},
        {DISK: 2},
    ),
]


@pytest.mark.parametrize(("ops", "want", "counts"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cases(ops: list[tuple[Any, ...]], want: dict[str, int], counts: dict[str, int]) -> None:
    index, ref = BlockIndex(BS), ReferenceIndex()
    evs = events_for(TOKENS, BS, 1)  # one event per block
    for op in ops:
        for target in (index, ref):
            if op[0] == "store":
                _, lo, hi, tier = op
                for hs, parent, toks in evs[lo:hi]:
                    target.store("p", hs, parent, toks, BS, tier, ROOT)
            elif op[0] == "remove":
                _, lo, hi, tier = op
                for hs, _, _ in evs[lo:hi]:
                    target.remove("p", hs, tier)
            else:
                target.clear_pod("p")
    assert index.lookup(KEYS, ["p", "other"]) == {"p": want, "other": {}}
    assert ref.lookup(KEYS.tolist(), ["p", "other"]) == {"p": want, "other": {}}
    assert index.pod_counts("p") == counts


def test_store_returns_entries_added_or_refreshed() -> None:
    index = BlockIndex(BS)
    (hs, parent, toks), *_ = events_for(TOKENS, 64, 2)
    assert index.store("p", hs, parent, toks, 64, GPU, ROOT) == StoreOutcome(8, False)
    assert index.store("p", hs, parent, toks, 64, GPU, ROOT) == StoreOutcome(8, False)  # refresh
    assert index.stats().entries == 8
    assert index.store("p", hs, parent, toks, 64, CPU, ROOT) == StoreOutcome(8, False)
    assert index.stats().entries == 16


def test_remove_of_never_stored_hash_is_a_no_op() -> None:
    index = BlockIndex(BS)
    assert index.remove("nobody", [1, 2], GPU) == 0
    store_all(index, "p", TOKENS, BS)
    assert index.remove("p", [12345], GPU) == 0
    assert index.remove("p", [], GPU) == 0
    assert index.remove("p", events_for(TOKENS, BS, 1)[0][0], "unknown-tier") == 0
    assert index.stats().entries == 16


def test_remove_of_a_queued_block_and_store_after_remove_keep_their_order() -> None:
    index = BlockIndex(BS)
    evs = events_for(TOKENS, BS, 4)
    for hs, parent, toks in evs:
        index.store("p", hs, parent, toks, BS, GPU, ROOT)
    assert index.remove("p", evs[3][0], GPU) == 4  # queued store, then its removal
    assert index.lookup(KEYS, ["p"]) == {"p": {"any": 12, GPU: 12}}
    assert index.remove("p", evs[2][0], GPU) == 4
    index.store("p", *evs[2][:1], evs[2][1], evs[2][2], BS, GPU, ROOT)  # removal queued, then re-store
    assert index.lookup(KEYS, ["p"]) == {"p": {"any": 12, GPU: 12}}


@pytest.mark.parametrize("flush", [False, True])
def test_each_copy_under_one_engine_hash_needs_its_own_removal(flush: bool) -> None:
    # vLLM stores a recomputed block again under its hash (a second physical copy) and later evicts each
    # copy with its own BlockRemoved: the engine block stays held until the last one.
    index = BlockIndex(BS)
    evs = events_for(TOKENS, 64, 1)  # 4 engine blocks of 4 index blocks
    last, parent, toks = evs[-1]

    def step() -> None:
        if flush:
            index.flush()

    store_all(index, "p", TOKENS, 64, per_event=1)
    step()
    assert index.store("p", last, parent, toks, 64, GPU, ROOT) == StoreOutcome(4, False)  # copy 2
    step()
    assert index.stats().entries == 16 and index.stats().engine_blocks == 4
    assert index.remove("p", last, GPU) == 0  # copy 1 of 2: nothing released
    step()
    assert index.lookup(KEYS, ["p"]) == {"p": {"any": 16, GPU: 16}}
    assert index.stats().entries == 16
    assert index.store("p", last, parent, toks, 64, GPU, ROOT).stored == 4  # back to 2 copies
    step()
    assert index.remove("p", last, GPU) == 0
    step()
    assert index.remove("p", last, GPU) == 4  # the last copy
    step()
    assert index.remove("p", last, GPU) == 0  # no copy left: a no-op
    assert index.lookup(KEYS, ["p"]) == {"p": {"any": 12, GPU: 12}}
    assert index.stats().entries == 12 and index.stats().engine_blocks == 3
    assert index._h.copies.size == 0


def test_copies_stored_in_one_batch_and_removed_in_one_call() -> None:
    index = BlockIndex(BS)
    evs = events_for(TOKENS, BS, 4)
    for hs, parent, toks in [*evs, evs[-1], evs[-1], evs[-2]]:  # queued together: the last event 3 times
        index.store("p", hs, parent, toks, BS, GPU, ROOT)
    assert index.remove("p", [*evs[-1][0], *evs[-1][0]], GPU) == 0  # 2 of 3 copies
    assert index.remove("p", evs[-2][0], GPU) == 0  # 1 of 2
    assert index.lookup(KEYS, ["p"]) == {"p": {"any": 16, GPU: 16}}
    assert index.remove("p", [*evs[-1][0], *evs[-2][0], *evs[-1][0]], GPU) == 8  # both last copies
    assert index.lookup(KEYS, ["p"]) == {"p": {"any": 8, GPU: 8}}
    assert index._h.copies.size == 0


def test_eviction_drops_every_copy_of_a_unit() -> None:
    index = BlockIndex(BS, max_entries=4, evict_headroom=0)
    a, b = list(range(32)), list(range(100, 164))
    ka = block_keys(a, BS, ROOT)
    (a0, _, t0), (a1, p1, t1) = events_for(a, BS, 1)
    store_all(index, "p", a, BS, per_event=1)
    index.store("p", a1, p1, t1, BS, GPU, ROOT)  # a second copy of a1, the newest unit
    store_all(index, "p", b, BS, per_event=1)  # 6 > 4: a0 and a1 (both copies) go
    assert index.lookup(ka, ["p"]) == {"p": {"any": 0}}
    assert index.stats().evicted == 2 and index._h.copies.size == 0
    assert index.remove("p", a1, GPU) == 0
    index.store("p", a0, None, t0, BS, GPU, ROOT)  # one copy each now (b's oldest block goes)
    index.store("p", a1, p1, t1, BS, GPU, ROOT)
    assert index.lookup(ka, ["p"]) == {"p": {"any": 2, GPU: 2}}
    assert index.remove("p", a1, GPU) == 1
    assert index.lookup(ka, ["p"]) == {"p": {"any": 1, GPU: 1}}


def test_parent_removed_from_every_tier_makes_children_orphans() -> None:
    index = BlockIndex(BS)
    evs = events_for(TOKENS, BS, 4)
    index.store("p", *evs[0][:2], evs[0][2], BS, GPU, ROOT)
    index.store("p", *evs[0][:2], evs[0][2], BS, CPU, ROOT)
    index.remove("p", evs[0][0][-1:], GPU)
    assert not index.store("p", evs[1][0], evs[1][1], evs[1][2], BS, GPU, ROOT).orphan  # still on CPU
    index.remove("p", evs[1][0][-1:], GPU)
    assert index.store("p", evs[2][0], evs[2][1], evs[2][2], BS, GPU, ROOT).orphan


def test_orphans_are_counted_and_never_indexed() -> None:
    index = BlockIndex(BS)
    evs = events_for(TOKENS, BS, 4)
    # the first event is lost: everything after it is an orphan
    out = [index.store("p", hs, parent, toks, BS, GPU, ROOT) for hs, parent, toks in evs[1:]]
    assert out == [StoreOutcome(0, True)] * 3
    stats = index.stats()
    assert (stats.orphans, stats.orphan_descendants, stats.entries) == (3, 2, 0)
    assert index.lookup(KEYS, ["p"]) == {"p": {}}
    # replay: the chain arrives whole; now it is indexed under the right keys
    for hs, parent, toks in evs:
        assert not index.store("p", hs, parent, toks, BS, GPU, ROOT).orphan
    assert index.lookup(KEYS, ["p"]) == {"p": {"any": 16, GPU: 16}}


def test_unknown_chain_is_bounded() -> None:
    index = BlockIndex(BS, max_unknown=3)
    evs = events_for(TOKENS, BS, 1)
    for hs, parent, toks in evs[1:]:
        index.store("p", hs, parent, toks, BS, GPU, ROOT)
    stats = index.stats()
    assert stats.orphans == 15 and stats.orphan_descendants == 14
    assert len(index._unknown[0]) == 3


@pytest.mark.parametrize(
    ("hashes", "tokens", "ebs"),
    [([1, 2], list(range(16)), 16), ([1], list(range(17)), 16), ([1], [], 16), ([1], list(range(16)), 0)],
)
def test_malformed_events_are_rejected(hashes: list[int], tokens: list[int], ebs: int) -> None:
    index = BlockIndex(BS)
    assert index.store("p", hashes, None, tokens, ebs, GPU, ROOT) == StoreOutcome(0, False)
    assert index.stats().rejected == 1 and index.stats().entries == 0
    assert index.store("p", [9], hashes[-1], list(range(16)), 16, GPU, ROOT).orphan


def test_an_index_block_completed_by_two_engine_blocks_stays_until_both_go() -> None:
    # Engine blocks of 64 tokens: two prompts sharing their first 40 tokens have different first engine
    # blocks, which complete the same first two index blocks.
    index = BlockIndex(BS)
    a = TOKENS[:64]
    b = [*TOKENS[:40], *range(5000, 5024)]
    (ha, _, _), (hb, _, _) = events_for(a, 64, 1)[0], events_for(b, 64, 1)[0]
    assert index.store("p", ha, None, a, 64, GPU, ROOT).stored == 4
    assert index.store("p", hb, None, b, 64, GPU, ROOT).stored == 4
    assert index.stats().entries == 6 and index.pod_counts("p") == {GPU: 6}
    assert index.remove("p", ha, GPU) == 4  # its keys, released; two are still held through b
    assert index.lookup(KEYS, ["p"]) == {"p": {"any": 2, GPU: 2}}
    assert index.stats().entries == 4
    assert index.clear_pod("p") == 4


# -- a real vLLM's events ---------------------------------------------------------------------
# What vLLM 0.32 (CPU build, --block-size 32, prefix caching) published during the first test of
# `make test-vllm`, as tests/vllm/conftest.py's EventRecorder captured it: one BlockStored per batch,
# medium GPU, model "tiny", no salt. seq 0: prompt A (309 tokens, 9 full blocks); 1: "B: diverges at
# 208" (A's blocks 0-5 hit, new blocks 6-7, the first 16 tokens of block 6 being A[192:208]); 2: "B:
# diverges at 200"; 3: "B: A[:256] exactly", whose last block vLLM recomputes (the hit cap) and
# re-stores under A's hash; 4: "B: A + 40 new tokens"; 5-7: "C" (diverges from A at 150: 5 blocks at
# prefill, then 2 blocks filled while decoding, each in its own batch with its parent).
VLLM_EBS = 32
VLLM_ROOT = root_key("tiny")
VLLM_EVENTS: list[tuple[int, list[int], int | None, str]] = [  # (seq, block_hashes, parent, token_ids)
    (
        0,
        [
            14361914673777341215,
            2854050802433612853,
            10830311523203405931,
            2995319263061260186,
            7582368648252452420,
            9345838194532425879,
            10075457688748096837,
            10525246998580642859,
            12333301579199414750,
        ],
        None,
        "0 268 291 73 297 225 37 30 225 75 281 73 91 69 93 225 80 69 93 300 225 84 89 70 80 361 76 300 "
        "225 70 310 71 79 225 75 281 73 91 69 93 225 80 69 93 300 225 84 89 70 80 361 76 300 225 70 310 "
        "71 79 225 75 281 73 91 69 93 225 80 69 93 300 225 84 89 70 80 361 76 300 225 70 310 71 79 225 75 "
        "281 73 91 69 93 225 80 69 93 300 225 84 89 70 80 361 76 300 225 70 310 71 79 225 75 281 73 91 69 "
        "93 225 80 69 93 300 225 84 89 70 80 361 76 300 225 70 310 71 79 225 75 281 73 91 69 93 225 80 69 "
        "93 300 225 84 89 70 80 361 76 300 225 70 310 71 79 225 75 281 73 91 69 93 225 80 69 93 300 225 "
        "84 89 70 80 361 76 300 225 70 310 71 79 225 75 281 73 91 69 93 225 80 69 93 300 225 84 89 70 80 "
        "361 76 300 225 70 310 71 79 225 75 281 73 91 69 93 225 80 69 93 300 225 84 89 70 80 361 76 300 "
        "225 70 310 71 79 225 75 281 73 91 69 93 225 80 69 93 300 225 84 89 70 80 361 76 300 225 70 310 "
        "71 79 225 75 281 73 91 69 93 225 80 69 93 300 225 84 89 70 80 361 76 300 225 70 310 71 79 225 75 "
        "281 73 91",
    ),
    (
        1,
        [6985326520106107137, 12567119006062733296],
        9345838194532425879,
        "69 93 300 225 84 89 70 80 361 76 300 225 70 310 71 79 326 327 328 329 330 331 332 333 334 335 "
        "336 337 338 339 340 341 342 343 344 345 346 347 348 349 350 351 352 353 354 355 100 101 102 103 "
        "104 105 106 107 108 109 110 111 112 113 114 115 116 117",
    ),
    (
        2,
        [9790740206988985584],
        9345838194532425879,
        "69 93 300 225 84 89 70 80 206 207 208 209 210 211 212 213 214 215 216 217 218 219 220 221 222 "
        "223 224 225 226 227 228 229",
    ),
    (
        3,
        [10525246998580642859],
        10075457688748096837,
        "80 361 76 300 225 70 310 71 79 225 75 281 73 91 69 93 225 80 69 93 300 225 84 89 70 80 361 76 "
        "300 225 70 310",
    ),
    (
        4,
        [13149071699371690022],
        12333301579199414750,
        "69 93 225 80 69 93 300 225 84 89 70 80 361 76 300 225 70 310 71 79 18 101 102 103 104 105 106 "
        "107 108 109 110 111",
    ),
    (
        5,
        [
            786429314305146101,
            4098296697262695805,
            14052812173813851840,
            7415999869275479449,
            12994207988379381160,
        ],
        2995319263061260186,
        "225 70 310 71 79 225 75 281 73 91 69 93 225 80 69 93 300 225 84 89 70 80 206 207 208 209 210 211 "
        "212 213 214 215 216 217 218 219 220 221 222 223 224 225 226 227 228 229 230 231 232 233 234 235 "
        "236 237 238 239 240 241 242 243 244 245 246 247 248 249 250 251 252 253 254 255 256 257 258 259 "
        "260 261 262 263 264 265 266 267 268 269 270 271 272 273 274 275 276 277 278 279 280 281 282 283 "
        "284 285 286 287 288 289 290 291 292 293 294 295 296 297 298 299 300 301 302 303 304 305 306 307 "
        "308 309 310 311 312 313 314 315 316 317 318 319 320 321 322 323 324 325 326 327 328 329 330 331 "
        "332 333 334 335 336 337 338 339 340 341 342 343",
    ),
    (
        6,
        [11319560693270829726],
        12994207988379381160,
        "344 345 346 347 348 349 350 351 352 353 354 355 334 393 363 294 445 281 369 222 334 393 363 294 "
        "26 476 369 222 334 393 363 294",
    ),
    (
        7,
        [4896947624670817914],
        11319560693270829726,
        "2 290 163 367 494 285 369 222 334 393 363 294 2 290 163 367 494 285 369 222 334 393 363 294 2 "
        "290 163 367 494 285 369 222",
    ),
]
VLLM_A = VLLM_EVENTS[0][1]  # A's engine blocks 0-8
VLLM_B = VLLM_EVENTS[1][1]  # "diverges at 208": blocks 6-7, children of A's block 5


def vllm_store(index: BlockIndex, event: tuple[int, list[int], int | None, str]) -> None:
    _, hashes, parent, text = event
    out = index.store("vllm", hashes, parent, [int(t) for t in text.split()], VLLM_EBS, GPU, VLLM_ROOT)
    assert not out.orphan


def vllm_chains() -> dict[int, list[int]]:
    """Engine hash -> every token from the start of the sequence to the end of that block."""
    chains: dict[int, list[int]] = {}
    for _, hashes, parent, text in VLLM_EVENTS:
        tokens = [int(t) for t in text.split()]
        prefix = [] if parent is None else chains[parent]
        for j, h in enumerate(hashes):
            prefix = prefix + tokens[j * VLLM_EBS : (j + 1) * VLLM_EBS]
            chains[h] = prefix
    return chains


def test_vllm_engine_blocks_that_share_an_index_block_hold_it_once() -> None:
    # seq 0-1: 11 distinct engine blocks of 32 tokens, yet 21 distinct index blocks of 16, not 22: B's
    # block 6 and A's block 6 both start with the same 16 tokens after the same 192, so both complete
    # index block 12 (tokens 192-207), one (key, pod, tier) entry with two owners.
    index = BlockIndex(BS)
    vllm_store(index, VLLM_EVENTS[0])
    vllm_store(index, VLLM_EVENTS[1])
    chains = vllm_chains()
    a = block_keys(chains[VLLM_A[-1]], BS, VLLM_ROOT)
    b = block_keys(chains[VLLM_B[-1]], BS, VLLM_ROOT)
    assert len(a) == 18 and len(b) == 16
    assert a[:13].tolist() == b[:13].tolist() and a[13] != b[13]
    assert len({*a.tolist(), *b.tolist()}) == 21
    assert index.pod_counts("vllm") == {GPU: 21} and index.stats().entries == 21
    assert index.stats().engine_blocks == 11
    assert index.lookup(a, ["vllm"]) == {"vllm": {"any": 18, GPU: 18}}
    assert index.lookup(b, ["vllm"]) == {"vllm": {"any": 16, GPU: 16}}
    # vLLM evicts deepest first, one BlockRemoved per block: A's blocks 8, 7, 6 release their 6 keys,
    # but index block 12 stays held through B's block 6.
    for h in reversed(VLLM_A[6:]):
        assert index.remove("vllm", [h], GPU) == 2
    assert index.pod_counts("vllm") == {GPU: 16} and index.stats().entries == 16
    assert index.lookup(a, ["vllm"]) == {"vllm": {"any": 13, GPU: 13}}
    assert index.lookup(b, ["vllm"]) == {"vllm": {"any": 16, GPU: 16}}
    for h in reversed(VLLM_B):
        assert index.remove("vllm", [h], GPU) == 2
    assert index.pod_counts("vllm") == {GPU: 12} and index.stats().entries == 12
    assert index.lookup(a, ["vllm"]) == {"vllm": {"any": 12, GPU: 12}}
    assert index.lookup(b, ["vllm"]) == {"vllm": {"any": 12, GPU: 12}}


def test_vllm_event_sequence_holds_the_distinct_index_blocks_of_its_engine_blocks() -> None:
    # The whole recorded sequence, checked after every batch against the index blocks recomputed from
    # each engine block's full token chain: the re-store under a known hash (seq 3) adds nothing, the
    # decode-phase batches (seq 6, 7) chain from their parents, and the two engine blocks that share an
    # index block with one of A's (seq 1: index block 12; seq 5: C's block 4, index block 8) count once.
    index = BlockIndex(BS)
    chains = vllm_chains()
    live: dict[int, None] = {}
    progress = []
    for event in VLLM_EVENTS:
        vllm_store(index, event)
        live.update(dict.fromkeys(event[1]))
        held: set[int] = set()
        for h in live:
            keys = block_keys(chains[h], BS, VLLM_ROOT)
            held.update(keys[-VLLM_EBS // BS :].tolist())  # the index blocks this engine block completes
            assert index.lookup(keys, ["vllm"]) == {"vllm": {"any": len(keys), GPU: len(keys)}}
        assert index.pod_counts("vllm") == {GPU: len(held)} and index.stats().entries == len(held)
        progress.append((len(live), len(held)))
    assert progress == [(9, 18), (11, 21), (12, 23), (12, 23), (13, 25), (18, 34), (19, 36), (20, 38)]
    # seq 3 stored a second physical copy of A's block 7: vLLM evicts each copy with its own BlockRemoved,
    # and serves prefix hits from the other one meanwhile
    a = block_keys(chains[VLLM_A[-1]], BS, VLLM_ROOT)
    assert index.remove("vllm", [VLLM_A[7]], GPU) == 0
    assert index.lookup(a, ["vllm"]) == {"vllm": {"any": 18, GPU: 18}}
    assert index.stats().entries == 38
    assert index.remove("vllm", [VLLM_A[7]], GPU) == 2  # index blocks 14, 15
    assert index.lookup(a, ["vllm"]) == {"vllm": {"any": 14, GPU: 14}}
    assert index.stats().entries == 36


def test_sglang_partial_pages() -> None:
    index = BlockIndex(BS)
    parent = None
    for i in range(0, 40, 7):  # pages of 7 tokens, the last one partial (5)
        page = TOKENS[i : min(i + 7, 40)]
        h = engine_hash(parent, page, ROOT)
        index.store("p", [h], parent, page, 7, GPU, ROOT)
        parent = h
    assert index.lookup(KEYS, ["p"]) == {"p": {"any": 2, GPU: 2}}


def test_signed_engine_hashes_and_numpy_tokens() -> None:
    # SGLang sends signed 64-bit hashes (the decoder makes them unsigned; the index copes either way)
    index = BlockIndex(BS)
    evs = events_for(TOKENS, BS, 4)
    signed = [[h - (1 << 64) if h >= 1 << 63 else h for h in hs] for hs, _, _ in evs]
    parent = None
    for i, (_, _, toks) in enumerate(evs):
        tokens = np.array(toks, dtype=np.int32) if i % 2 else toks
        assert not index.store("p", signed[i], parent, tokens, BS, GPU, ROOT).orphan
        parent = signed[i][-1]
        if i == 1:
            index.flush()  # the next parent is looked up in the tables, not in the queue
    assert index.lookup(KEYS.tolist(), ["p"]) == {"p": {"any": 16, GPU: 16}}
    assert index.remove("p", signed[3], GPU) == 4
    assert index.lookup(KEYS, ["p"]) == {"p": {"any": 12, GPU: 12}}


def test_token_ids_in_every_form_give_the_keys_of_block_keys() -> None:
    """Lists, tuples, int32 / uint64 arrays and ids beyond int64 (taken modulo 2^64), mixed in one batch."""
    index = BlockIndex(BS)
    big = [(1 << 64) - 1 - t for t in TOKENS]  # >= 2^63: not int64
    evs = events_for(big, BS, 4)
    forms = [list, tuple, lambda t: np.array(t, dtype=np.uint64), list]
    parent = None
    for (hs, _, toks), form in zip(evs, forms, strict=True):
        assert index.store("p", hs, parent, form(toks), BS, GPU, ROOT).stored == 4
        parent = hs[-1]
    for hs, parent, toks in events_for(TOKENS, BS, 4)[:2]:
        index.store("q", hs, parent, np.array(toks, dtype=np.int32), BS, GPU, ROOT)
    want = block_keys(np.array(big, dtype=np.uint64), BS, ROOT)
    assert index.lookup(want, ["p"]) == {"p": {"any": 16, GPU: 16}}
    assert index.lookup(KEYS, ["q"]) == {"q": {"any": 8, GPU: 8}}


@pytest.mark.parametrize("tokens", [[0.5] * BS, ["a"] * BS, np.zeros(BS, dtype=np.float64)])
def test_token_ids_that_are_not_integers_are_rejected(tokens: Any) -> None:
    index = BlockIndex(BS)
    assert index.store("p", [1], None, tokens, BS, GPU, ROOT) == StoreOutcome(0, False)
    assert index.stats().rejected == 1 and index.stats().entries == 0


def test_a_parent_in_the_middle_of_a_queued_event() -> None:
    """Branches from blocks inside queued events, from the last block of one, and from a block queued
    twice: the keys are those of the whole token sequence."""
    index = BlockIndex(BS)
    trunk = events_for(TOKENS, BS, 8)  # 2 events of 8 blocks
    for hs, parent, toks in trunk:
        index.store("p", hs, parent, toks, BS, GPU, ROOT)
    index.store("p", *trunk[0][:1], None, trunk[0][2], BS, CPU, ROOT)  # block 0..7 queued twice
    for cut in (3, 8, 11):  # branch after block `cut` - 1 (inside event 0, its last block, inside event 1)
        tokens = TOKENS[: cut * BS] + list(range(9000 + cut * 100, 9000 + cut * 100 + 2 * BS))
        hashes = [h for hs, _, _ in events_for(tokens, BS, 1) for h in hs]
        parent = hashes[cut - 1]
        out = index.store("p", hashes[cut:], parent, tokens[cut * BS :], BS, GPU, ROOT)
        assert out == StoreOutcome(2, False)
        assert index.lookup(block_keys(tokens, BS, ROOT), ["p"])["p"]["any"] == cut + 2


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@pytest.mark.parametrize("max_entries", [10**9, 30])
@given(data=st.data())
def test_store_many_leaves_the_index_as_store_does(max_entries: int, data: st.DataObject) -> None:
    """The same events (stores, some chained, some again, some orphans, and removals) through `store` one
    by one and through `store_many` in random runs: the same outcomes, stats, counts and lookups."""
    one = BlockIndex(BS, max_entries=max_entries, evict_headroom=0)
    many = BlockIndex(BS, max_entries=max_entries, evict_headroom=0)
    seqs: dict[tuple[str, int], tuple[int, ...]] = {}
    ops: list[tuple[Any, ...]] = []
    for _ in range(data.draw(st.integers(1, 30))):
        pod = data.draw(st.sampled_from(PODS[:2]))
        ebs = POD_EBS[pod]
        if seqs and data.draw(st.integers(0, 4)) == 0:
            p, h = data.draw(st.sampled_from(sorted(seqs)))
            ops.append(("remove", p, [h], data.draw(st.sampled_from(TIERS[:2]))))
            continue
        known = sorted(h for (p, h) in seqs if p == pod)
        parent = data.draw(st.sampled_from([None, 12345, *known]))
        prefix = seqs.get((pod, parent), ()) if parent is not None else ()
        tokens = data.draw(st.lists(st.integers(0, 5), min_size=ebs, max_size=3 * ebs))
        tokens = tokens[: len(tokens) // ebs * ebs]
        hashes, h = [], parent
        for i in range(0, len(tokens), ebs):
            h = engine_hash(h, tokens[i : i + ebs], ROOT)
            hashes.append(h)
            seqs[(pod, h)] = prefix + tuple(tokens[: i + ebs])
        ops.append(("store", pod, (hashes, parent, tokens, ebs, data.draw(st.sampled_from(TIERS[:2])), ROOT)))
    i = 0
    while i < len(ops):
        op = ops[i]
        if op[0] == "remove":
            assert one.remove(*op[1:]) == many.remove(*op[1:])
            i += 1
            continue
        run = [op]
        while (
            i + len(run) < len(ops) and ops[i + len(run)][:2] == ("store", op[1]) and data.draw(st.booleans())
        ):
            run.append(ops[i + len(run)])
        orphans = sum(one.store(op[1], *r[2]).orphan for r in run)
        assert many.store_many(op[1], [r[2] for r in run]) == orphans
        i += len(run)
    assert one.stats() == many.stats()
    assert one.pods() == many.pods()
    for pod in PODS[:2]:
        assert one.pod_counts(pod) == many.pod_counts(pod)
    for seq in set(seqs.values()):
        keys = block_keys(list(seq), BS, ROOT)
        assert one.lookup(keys, PODS[:2]) == many.lookup(keys, PODS[:2])


def test_tier_limit() -> None:
    index = BlockIndex(BS)
    hs, _, toks = events_for(TOKENS, BS, 1)[0]
    # 12 tiers; made-up names take at most 9, so gpu, cpu and storage always find a slot.
    for t in range(9):
        assert index.store("p", hs, None, toks, BS, f"tier{t}", ROOT).stored == 1
    assert index.store("p", hs, None, toks, BS, "one-too-many", ROOT) == StoreOutcome(0, False)
    for tier in ("gpu", "cpu", "storage"):
        assert index.store("p", hs, None, toks, BS, tier, ROOT).stored == 1
    assert index.store("p", hs, None, toks, BS, "still-too-many", ROOT) == StoreOutcome(0, False)
    assert index.stats().rejected == 2
    assert index.pod_counts("p") == {**{f"tier{t}": 1 for t in range(9)}, "gpu": 1, "cpu": 1, "storage": 1}


@pytest.mark.parametrize("block_size", [1, 7, 64])
def test_other_index_block_sizes(block_size: int) -> None:
    index = BlockIndex(block_size)
    for pod, ebs in [("a", 16), ("b", 1), ("c", 64)]:
        for hs, parent, toks in events_for(TOKENS, ebs, 3):
            index.store(pod, hs, parent, toks, ebs, GPU, ROOT)
    n = len(TOKENS) // block_size
    keys = block_keys(TOKENS, block_size, ROOT)
    assert index.lookup(keys, ["a", "b", "c"]) == {p: {"any": n, GPU: n} for p in "abc"}


def test_clear_pod_drops_everything_of_the_pod() -> None:
    index = BlockIndex(BS)
    store_all(index, "a", TOKENS, 64)
    store_all(index, "b", TOKENS, 16)
    store_all(index, "a", TOKENS, 64, tier=CPU)
    assert index.clear_pod("a") == 32
    assert index.clear_pod("a") == 0
    assert index.pods() == ["b"]
    assert index.lookup(KEYS, ["a", "b"]) == {"a": {}, "b": {"any": 16, GPU: 16}}
    assert index.stats().engine_blocks == 16
    # its chain is gone: a continuation is an orphan; a fresh chain works
    hs, parent, toks = events_for(TOKENS, 64, 1)[1]
    assert index.store("a", hs, parent, toks, 64, GPU, ROOT).orphan
    store_all(index, "a", TOKENS, 64)
    assert index.lookup(KEYS, ["a"]) == {"a": {"any": 16, GPU: 16}}


def test_many_pods_across_mask_chunks() -> None:
    index = BlockIndex(BS)
    pods = [f"pod-{i}" for i in range(75)]
    for i, pod in enumerate(pods):
        store_all(index, pod, TOKENS[: (i % 17) * BS], BS)
    got = index.lookup(KEYS, [*pods, "ghost"])
    assert got["ghost"] == {}
    for i, pod in enumerate(pods):
        n = i % 17
        assert got[pod] == ({"any": n, GPU: n} if n else {}), pod
    assert index.pods() == sorted(p for i, p in enumerate(pods) if i % 17)


def test_pod_ids_are_reused_after_clear() -> None:
    index = BlockIndex(BS)
    for i in range(200):
        store_all(index, f"pod-{i}", TOKENS[:32], BS)
        assert index.lookup(KEYS, [f"pod-{i}", f"pod-{i - 1}"]) == {
            f"pod-{i}": {"any": 2, GPU: 2},
            f"pod-{i - 1}": {},
        }
        index.clear_pod(f"pod-{i}")
    assert len(index._pod_names) == 1


def test_lookup_weighted_takes_the_best_tier_of_each_block() -> None:
    index = BlockIndex(BS)
    evs = events_for(TOKENS, BS, 1)
    for j, (hs, parent, toks) in enumerate(evs[:10]):
        index.store("p", hs, parent, toks, BS, GPU if j < 2 else CPU, ROOT)  # 2 gpu, 8 cpu
    for hs, parent, toks in evs[:4]:
        index.store("p", hs, parent, toks, BS, DISK, ROOT)  # blocks 0-3 also on disk
    index.store("q", *evs[0][:2], evs[0][2], BS, "hbm3", ROOT)  # a tier without a weight
    weights = {GPU: 1.0, CPU: 0.8, DISK: 0.5}
    got = index.lookup_weighted(KEYS, ["p", "q", "ghost"], weights, unknown=0.25)
    assert got == pytest.approx({"p": 2 * 1.0 + 8 * 0.8, "q": 0.25})
    assert index.lookup_weighted(KEYS, ["ghost"], weights) == {}


def test_lookup_edge_cases() -> None:
    index = BlockIndex(BS)
    store_all(index, "p", TOKENS, BS)
    assert index.lookup(np.zeros(0, dtype=np.uint64), ["p", "q"]) == {"p": {"any": 0}, "q": {}}
    assert index.lookup(KEYS, []) == {}
    other = block_keys(TOKENS, BS, root_key("other-model"))
    assert index.lookup(other, ["p"]) == {"p": {"any": 0}}
    assert index.lookup(KEYS[:3].tolist(), ["p"]) == {"p": {"any": 3, GPU: 3}}


# -- memory bound ------------------------------------------------------------------------
def test_memory_bound_evicts_least_recently_stored_first() -> None:
    index = BlockIndex(BS, max_entries=6, evict_headroom=0)
    a = list(range(64))
    b = list(range(100, 164))
    ka, kb = block_keys(a, BS, ROOT), block_keys(b, BS, ROOT)
    store_all(index, "p", a, BS, per_event=4)
    store_all(index, "p", b, BS, per_event=4)  # 8 > 6: a's two deepest blocks go first
    assert index.lookup(ka, ["p"]) == {"p": {"any": 2, GPU: 2}}
    assert index.lookup(kb, ["p"]) == {"p": {"any": 4, GPU: 4}}
    stats = index.stats()
    assert (stats.entries, stats.evicted) == (6, 2)
    # re-storing a's head refreshes it: b goes next
    ev = events_for(a, BS, 2)[0]
    index.store("p", ev[0], ev[1], ev[2], BS, GPU, ROOT)
    index.store("q", *events_for(list(range(300, 332)), BS, 2)[0][:2], list(range(300, 332)), BS, GPU, ROOT)
    assert index.lookup(kb, ["p"]) == {"p": {"any": 2, GPU: 2}}
    assert index.lookup(ka, ["p"]) == {"p": {"any": 2, GPU: 2}}
    assert index.stats().entries == 6 and index.stats().evicted == 4


def test_memory_bound_with_headroom_evicts_in_batches() -> None:
    index = BlockIndex(BS, max_entries=10, evict_headroom=4)
    store_all(index, "p", list(range(11 * BS)), BS, per_event=1)
    stats = index.stats()
    assert stats.entries == 6 and stats.evicted == 5
    assert index.lookup(block_keys(list(range(11 * BS)), BS, ROOT), ["p"]) == {"p": {"any": 0}}


def test_stamps_stay_ordered_when_rebased() -> None:
    index = BlockIndex(BS, max_entries=8, evict_headroom=0)
    index._h.stamp = 0xFFFFFFFF - 20
    a, b = list(range(64)), list(range(100, 164))
    for _ in range(3):
        store_all(index, "p", a, BS, per_event=4)
        store_all(index, "p", b, BS, per_event=4)
    assert index._h.stamp < 1 << 32
    store_all(index, "p", list(range(500, 532)), BS, per_event=1)  # evicts the 2 oldest: a's
    assert index.lookup(block_keys(a, BS, ROOT), ["p"]) == {"p": {"any": 2, GPU: 2}}
    assert index.lookup(block_keys(b, BS, ROOT), ["p"]) == {"p": {"any": 4, GPU: 4}}


def test_batches_flush_by_themselves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_queue, "FLUSH_BLOCKS", 5)
    index = BlockIndex(BS)
    store_all(index, "p", TOKENS, BS, per_event=2)
    assert index._q_blocks < 5
    assert index.lookup(KEYS, ["p"]) == {"p": {"any": 16, GPU: 16}}


def test_growth_to_many_entries() -> None:
    index = BlockIndex(BS)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50_000, size=20_000 * BS)
    for p in range(3):
        store_all(index, f"p{p}", tokens.tolist(), BS, per_event=64)
    keys = block_keys(tokens, BS, ROOT)
    assert index.lookup(keys, ["p0", "p1", "p2"]) == {f"p{p}": {"any": 20_000, GPU: 20_000} for p in range(3)}
    assert index.stats().entries == 60_000


# -- the state machine ------------------------------------------------------------------
PODS = ["a", "b", "c", "d"]
POD_EBS = {"a": 16, "b": 32, "c": 1, "d": 5}
TIERS = [GPU, CPU, DISK]
ROOTS = [ROOT, root_key("model", "tenant")]


class IndexMachine(RuleBasedStateMachine):
    max_entries = 10**9
    headroom = 0

    @initialize()
    def setup(self) -> None:
        self.index = BlockIndex(BS, max_entries=self.max_entries, evict_headroom=self.headroom, max_unknown=8)
        self.ref = ReferenceIndex(BS, self.max_entries, self.headroom, max_unknown=8)
        # every hash an engine sent, with the tokens from the root to its end and its root
        self.seqs: dict[tuple[str, int], tuple[tuple[int, ...], int]] = {}
        # the indexed events (pod, hashes, parent, tokens, root), to send again: more physical copies
        self.sent: list[tuple[str, list[int], int | None, list[int], int]] = []

    def _both(self, method: str, *args: object) -> object:
        got = getattr(self.index, method)(*args)
        want = getattr(self.ref, method)(*args)
        assert got == want, (method, args, got, want)
        return got

    def _draw_store(
        self, pod: str, tier: str, data: st.DataObject, nblocks: int, vocab: int
    ) -> tuple[StoreArgs, tuple[int, ...]] | None:
        """A BlockStored for the pod (its parent: none, a block it holds, or an unknown one) and the tokens
        before it; None when the drawn blocks repeat a hash."""
        ebs = POD_EBS[pod]
        known = [h for (p, h) in self.seqs if p == pod]
        how = data.draw(st.sampled_from(["root", "known", "known", "unknown"]))
        parent: int | None
        if how == "known" and known:
            parent = data.draw(st.sampled_from(sorted(known)))
            prefix, root = self.seqs[(pod, parent)]
        elif how == "unknown":
            parent, prefix, root = data.draw(st.integers(0, 2**64 - 1)), (), ROOTS[0]
        else:
            parent, prefix, root = None, (), data.draw(st.sampled_from(ROOTS))
        ntok = nblocks * ebs
        if ebs < BS and nblocks == 1 and data.draw(st.booleans()):
            ntok = data.draw(st.integers(1, ebs))  # a partial page
        tokens = data.draw(st.lists(st.integers(0, vocab), min_size=ntok, max_size=ntok))
        hashes, p = [], parent
        for i in range(0, ntok, ebs):
            p = engine_hash(p, tokens[i : i + ebs], root)
            hashes.append(p)
        if len(set(hashes)) < len(hashes):
            return None
        return (hashes, parent, tokens, ebs, tier, root), prefix

    def _stored(self, pod: str, args: StoreArgs, prefix: tuple[int, ...], out: StoreOutcome) -> None:
        hashes, parent, tokens, ebs, _, root = args
        if not out.orphan:
            self.sent.append((pod, list(hashes), parent, list(tokens), root))
            for i, h in enumerate(hashes):
                self.seqs[(pod, h)] = (prefix + tuple(tokens[: (i + 1) * ebs]), root)

    @rule(
        pod=st.sampled_from(PODS),
        tier=st.sampled_from(TIERS),
        data=st.data(),
        nblocks=st.integers(1, 4),
        vocab=st.integers(2, 6),
    )
    def store(self, pod: str, tier: str, data: st.DataObject, nblocks: int, vocab: int) -> None:
        drawn = self._draw_store(pod, tier, data, nblocks, vocab)
        if drawn is None:
            return
        args, prefix = drawn
        out = self._both("store", pod, *args)
        assert isinstance(out, StoreOutcome)
        self._stored(pod, args, prefix, out)

    @rule(pod=st.sampled_from(PODS), data=st.data(), count=st.integers(1, 5))
    def store_many(self, pod: str, data: st.DataObject, count: int) -> None:
        """Several BlockStored of one pod in one `store_many` call (later ones may chain from earlier
        ones, or store them again), against the reference applying them one by one."""
        stores: list[StoreArgs] = []
        orphans = 0
        for _ in range(count):
            tier = data.draw(st.sampled_from(TIERS))
            again = [e for e in self.sent if e[0] == pod]
            if again and data.draw(st.integers(0, 3)) == 0:
                _, hashes, parent, tokens, root = data.draw(st.sampled_from(again))
                args: StoreArgs = (hashes, parent, tokens, POD_EBS[pod], tier, root)
                orphans += self.ref.store(pod, *args).orphan
                stores.append(args)
                continue
            drawn = self._draw_store(
                pod, tier, data, data.draw(st.integers(1, 4)), data.draw(st.integers(2, 6))
            )
            if drawn is None:
                continue
            args, prefix = drawn
            out = self.ref.store(pod, *args)
            orphans += out.orphan
            self._stored(pod, args, prefix, out)
            stores.append(args)
        assert self.index.store_many(pod, stores) == orphans

    @precondition(lambda self: self.sent)
    @rule(data=st.data(), tier=st.sampled_from(TIERS))
    def store_again(self, data: st.DataObject, tier: str) -> None:
        """An engine storing blocks it already holds: another physical copy of each (or, if its parent
        went meanwhile, an orphan)."""
        pod, hashes, parent, tokens, root = data.draw(st.sampled_from(self.sent))
        self._both("store", pod, hashes, parent, tokens, POD_EBS[pod], tier, root)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tier=st.sampled_from(TIERS))
    def remove(self, data: st.DataObject, tier: str) -> None:
        pod, h = data.draw(st.sampled_from(sorted(self.seqs)))
        self._both("remove", pod, [h], tier)

    @precondition(lambda self: self.sent)
    @rule(data=st.data(), tier=st.sampled_from(TIERS))
    def remove_event(self, data: st.DataObject, tier: str) -> None:
        """A BlockRemoved naming several blocks, some of them possibly twice (two copies)."""
        pod, hashes, _, _, _ = data.draw(st.sampled_from(self.sent))
        picked = data.draw(st.lists(st.sampled_from(hashes), min_size=1, max_size=2 * len(hashes)))
        self._both("remove", pod, picked, tier)

    @rule(pod=st.sampled_from(PODS), h=st.integers(0, 2**64 - 1), tier=st.sampled_from(TIERS))
    def remove_unknown(self, pod: str, h: int, tier: str) -> None:
        self._both("remove", pod, [h], tier)

    @precondition(lambda self: self.sent)
    @rule(data=st.data(), tier=st.sampled_from(TIERS), unknown=st.integers(0, 2**64 - 1))
    def discard(self, data: st.DataObject, tier: str, unknown: int) -> None:
        """`discard`: a BlockRemoved resolved in the next batch, mixed with everything else."""
        pod, hashes, _, _, _ = data.draw(st.sampled_from(self.sent))
        picked = data.draw(
            st.lists(st.sampled_from([*hashes, unknown]), min_size=1, max_size=2 * len(hashes))
        )
        self.index.discard(pod, picked, tier)
        self.ref.remove(pod, picked, tier)

    @rule(pod=st.sampled_from(PODS))
    def clear_pod(self, pod: str) -> None:
        self._both("clear_pod", pod)

    @rule()
    def flush(self) -> None:
        self.index.flush()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 6), max_size=40))
    def lookup(self, data: st.DataObject, extra: list[int]) -> None:
        seq, root = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        keys = block_keys([*seq, *extra], BS, root)
        pods = [*PODS, "ghost"]
        assert self.index.lookup(keys, pods) == self.ref.lookup(keys.tolist(), pods)
        weights = data.draw(st.dictionaries(st.sampled_from(TIERS), st.sampled_from([0.0, 0.5, 0.8, 1.0])))
        unknown = data.draw(st.sampled_from([0.0, 0.25]))
        got = self.index.lookup_weighted(keys, pods, weights, unknown)
        want = self.ref.lookup_weighted(keys.tolist(), pods, weights, unknown)
        assert got.keys() == want.keys()
        assert all(abs(got[p] - want[p]) < 1e-9 for p in got), (got, want)

    @rule()
    def compare(self) -> None:
        stats = self.index.stats()
        assert stats.entries == self.ref.entries()
        assert stats.entries <= self.max_entries
        assert (stats.evicted, stats.orphans, stats.orphan_descendants, stats.rejected) == (
            self.ref.evicted,
            self.ref.orphans,
            self.ref.descendants,
            self.ref.rejected,
        )
        assert stats.engine_blocks == len(self.ref.records)
        assert self.index.pods() == self.ref.pods()
        for pod in PODS:
            assert self.index.pod_counts(pod) == self.ref.pod_counts(pod)

    @invariant()
    def bounded(self) -> None:
        assert self.index._h.used <= self.max_entries  # queued stores count once applied


class EvictingMachine(IndexMachine):
    max_entries = 12
    headroom = 0


class EvictingWithHeadroomMachine(IndexMachine):
    max_entries = 20
    headroom = 5


_SETTINGS = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)
TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = _SETTINGS
TestEvictingMachine = EvictingMachine.TestCase
TestEvictingMachine.settings = _SETTINGS
TestEvictingWithHeadroomMachine = EvictingWithHeadroomMachine.TestCase
TestEvictingWithHeadroomMachine.settings = _SETTINGS


# -- the hash table ----------------------------------------------------------------------
@pytest.mark.parametrize("roomy_until", [0, 1 << 30, 20_000])
@pytest.mark.parametrize("n", [10, 3000, 40_000])
def test_hash_table_against_a_dict(n: int, roomy_until: int) -> None:
    """Growth by `growth`, by doubling (roomy), and doubling then `growth` past `roomy_until`. Two buckets
    at first: many items have equal first and second buckets (adjusted pairs) while the table is small."""
    rng = np.random.default_rng(n)
    table = HashTable(np.uint16, {"v": (np.uint64, 7)}, buckets=2, roomy_until=roomy_until)
    ref: dict[tuple[int, int], int] = {}
    keys = rng.integers(0, 2**64 - 1, size=n, dtype=np.uint64)
    keys[: n // 3] = keys[n // 3 : 2 * (n // 3)]  # equal keys under different tags
    tags = rng.integers(0, 5, size=n).astype(np.uint16)
    for lo in range(0, n, 997):
        k, t = keys[lo : lo + 997], tags[lo : lo + 997]
        vals = rng.integers(0, 1000, size=len(k)).astype(np.uint64)
        slots, new = table.upsert(k, t, {"v": vals})
        for i, (kk, tt) in enumerate(zip(k.tolist(), t.tolist(), strict=True)):
            if (kk, tt) not in ref:
                assert new[i]
                ref[(kk, tt)] = int(vals[i])
            assert table.cols["v"][slots[i]] == ref[(kk, tt)]
        assert table.size == len(ref)
        gone = [x for j, x in enumerate(sorted(ref)) if j % 3 == 0]
        found = table.find(
            np.array([g[0] for g in gone], dtype=np.uint64), np.array([g[1] for g in gone], dtype=np.uint16)
        )
        assert (found >= 0).all()
        table.delete(np.concatenate([found, found[:5]]))  # duplicates allowed
        for g in gone:
            del ref[g]
        assert table.size == len(ref)
    ks = np.array([k for k, _ in ref], dtype=np.uint64)
    ts = np.array([t for _, t in ref], dtype=np.uint16)
    found = table.find(ks, ts)
    assert (found >= 0).all() and len(set(found.tolist())) == len(ref)
    assert table.cols["v"][found].tolist() == [
        ref[(k, t)] for k, t in zip(ks.tolist(), ts.tolist(), strict=True)
    ]
    assert all(
        table.find_one(k, t) == s
        for k, t, s in zip(ks[:50].tolist(), ts[:50].tolist(), found[:50].tolist(), strict=True)
    )
    assert table.find(np.array([1, 2], dtype=np.uint64), np.array([9, 9], dtype=np.uint16)).tolist() == [
        -1,
        -1,
    ]
    assert table.find_one(1, 9) == -1
    occ = table.occupied()
    assert len(occ) == table.size


def test_hash_table_find_one_reads_every_key_width() -> None:
    """The scalar probe is compiled and takes a key as the signed int of its bits: keys at and above 2^63
    (and the table's empty key, 0) must come back the same as from the batched probe."""
    table = HashTable(np.uint16, {})
    keys = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 63) + 5, (1 << 64) - 1]
    table.upsert(np.array(keys, dtype=np.uint64), np.full(len(keys), 3, dtype=np.uint16), {})
    found = table.find(np.array(keys, dtype=np.uint64), np.full(len(keys), 3, dtype=np.uint16)).tolist()
    assert min(found) >= 0
    assert [table.find_one(k, 3) for k in keys] == found
    assert [table.find_one(k, 4) for k in keys] == [-1] * len(keys)
    assert table.find_one(2, 3) == -1


def test_hash_table_added_column_keeps_the_items_and_starts_empty() -> None:
    """Adding a column (a new tier) to a table with items: every item keeps its values, the new column
    holds its empty value, and deleting moves every column with its items."""
    table = HashTable(np.uint16, {"state": (np.uint64, 0), "info": (np.uint32, 7)})
    keys = np.arange(1, 201, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    tags = np.arange(200, dtype=np.uint16) % 5
    state = keys ^ np.uint64(0xFFFF0000FFFF0000)
    info = np.arange(200, dtype=np.uint32) * 3
    table.upsert(keys, tags, {"state": state, "info": info})
    table.add_column("s0", np.uint32, 0xFFFFFFFF)
    at = table.find(keys, tags)
    assert table.cols["state"][at].tolist() == state.tolist()
    assert table.cols["info"][at].tolist() == info.tolist()
    assert set(table.cols["s0"].tolist()) == {0xFFFFFFFF}
    table.cols["s0"][at] = np.arange(200, dtype=np.uint32)
    table.delete(at[::2])
    left = table.find(keys[1::2], tags[1::2])
    assert (left >= 0).all()
    assert table.cols["state"][left].tolist() == state[1::2].tolist()
    assert table.cols["s0"][left].tolist() == list(range(1, 200, 2))
    free = np.setdiff1d(np.arange(table.capacity), table.occupied())
    assert set(table.cols["info"][free].tolist()) == {7}  # free slots hold every column's empty value
    assert set(table.cols["s0"][free].tolist()) == {0xFFFFFFFF}


def test_hash_table_at_high_load_uses_cuckoo_moves() -> None:
    table = HashTable(np.uint16, {}, buckets=64, max_load=0.97)
    keys = np.arange(1, 64 * 8 * 97 // 100, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    tags = np.zeros(len(keys), dtype=np.uint16)
    for i in range(0, len(keys), 50):
        table.upsert(keys[i : i + 50], tags[i : i + 50], {})
    assert table.size == len(keys)
    assert (table.find(keys, tags) >= 0).all()


@pytest.mark.parametrize(
    ("n", "dtype", "value"), [(1 << 17, np.uint64, 0), (3 << 20, np.uint16, 0xFFFF), (1000, np.uint32, 5)]
)
def test_large_arrays_start_on_a_huge_page_boundary(n: int, dtype: type[np.generic], value: int) -> None:
    """From 1 MB on, a table's array is its own private mapping, 2 MB-aligned and holding its last 2 MB
    page whole, so that transparent huge pages can back it (a 4 KB-aligned one never got them)."""
    arr = filled(n, dtype, value)
    assert arr.shape == (n,) and arr.dtype == np.dtype(dtype) and (arr == value).all()
    arr[-1] = 1
    assert filled(n, dtype, value)[-1] == value  # arrays do not share memory
    size = n * np.dtype(dtype).itemsize
    if size < 1 << 20:
        return
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert arr.ctypes.data % (1 << 21) == 0
        end = arr.ctypes.data + size
        mapping = np.frombuffer(arr.base, dtype=np.uint8)  # the whole mapping
        assert mapping.ctypes.data + mapping.size >= -(-end // (1 << 21)) * (1 << 21)
        assert mapping.size < size + (2 << 21)  # the padding: under one huge page each side


def test_roomy_tables_double_and_keep_every_item() -> None:
    table = HashTable(np.uint32, {"v": (np.uint64, 0), "w": (np.uint32, 9)}, buckets=3, roomy_until=1 << 30)
    rng = np.random.default_rng(7)
    keys = rng.integers(0, 2**64 - 1, size=50_000, dtype=np.uint64)
    tags = rng.integers(0, 3, size=len(keys)).astype(np.uint32)
    keys, first = np.unique(keys, return_index=True)
    tags = tags[first]
    sizes = []
    for lo in range(0, len(keys), 5000):
        k, t = keys[lo : lo + 5000], tags[lo : lo + 5000]
        table.insert(k, t, {"v": k})
        sizes.append(table.nb)
        assert table.size <= table.roomy_load * table.capacity
    assert all(b % a == 0 and (b // a) & (b // a - 1) == 0 for a, b in itertools.pairwise(sizes))  # doubled
    found = table.find(keys, tags)
    assert (found >= 0).all() and len(set(found.tolist())) == len(keys)
    assert (table.cols["v"][found] == keys).all() and (table.cols["w"][found] == 9).all()
    occ = table.occupied()
    assert len(occ) == table.size == len(keys)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 2)), max_size=60), min_size=1, max_size=8),
    st.sampled_from([0.5, 0.92, 1.0]),
)
@example(  # set aside, then the table grew: its bucket has room when it is placed; its copy is not new
    [
        [(0, 1), (0, 2), (1, 0), (5, 0), (21, 0), (1, 0), (36, 0), (36, 2), (37, 0)],
        [(4, 0), (30, 0), (31, 0), (20, 1)],
        [(22, 2), (24, 0), (34, 0), (38, 0)],
        [
            (0, 0),
            (0, 0),
            (1, 2),
            (2, 0),
            (3, 0),
            (5, 2),
            (6, 2),
            (9, 2),
            (0, 0),
            (27, 2),
            (2, 1),
            (20, 2),
            (24, 0),
            (8, 2),
            (35, 2),
            (19, 1),
        ],
        [(7, 2), (13, 0), (11, 1), (2, 2), (0, 2), (4, 2), (11, 1)],
    ],
    1.0,
)
@example(  # an item set aside (both buckets full), then the table full, then its copy: the first one wins
    [
        [(k, t) for k in range(12) for t in range(3) if (k, t) not in {(0, 2), (1, 0), (1, 2), (6, 0)}][:29],
        [(0, 2), (1, 2), (6, 0), (1, 0), (6, 0)],
    ],
    1.0,
)
def test_upsert_with_repeats_full_buckets_and_growth_against_a_dict(
    batches: list[list[tuple[int, int]]], max_load: float
) -> None:
    """The compiled upsert: items repeated within a batch are inserted once with their first values, an
    item whose buckets are both full or a table at its load limit is settled by relocation or growth."""
    table = HashTable(np.uint16, {"v": (np.uint64, 7)}, buckets=2, max_load=max_load, growth=1.3)
    ref: dict[tuple[int, int], int] = {}
    for n, batch in enumerate(batches):
        keys = np.array([k * 0x9E3779B97F4A7C15 % 2**64 for k, _ in batch], dtype=np.uint64)
        tags = np.array([t for _, t in batch], dtype=np.uint16)
        vals = np.arange(len(batch), dtype=np.uint64) + 1000 * n
        slots, new = table.upsert(keys, tags, {"v": vals})
        first: dict[tuple[int, int], int] = {}
        for i, item in enumerate(zip(keys.tolist(), tags.tolist(), strict=True)):
            first.setdefault(item, i)
            assert new[i] == (item not in ref and first[item] == i)
        for item, i in first.items():
            ref.setdefault(item, int(vals[i]))
        assert table.size == len(ref) <= max_load * table.capacity
        assert table.cols["v"][slots].tolist() == [
            ref[it] for it in zip(keys.tolist(), tags.tolist(), strict=True)
        ]
    ks = np.array([k for k, _ in ref], dtype=np.uint64)
    ts = np.array([t for _, t in ref], dtype=np.uint16)
    found = table.find(ks, ts)
    assert len(set(found.tolist())) == len(ref) and (found >= 0).all()


@pytest.mark.parametrize("tag_dtype", [np.uint16, np.uint32])
def test_small_batches_meeting_full_buckets_take_one_cuckoo_step_and_keep_every_value(
    tag_dtype: type[np.unsignedinteger[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One item at a time into a table run at 97% load: the items whose two buckets are full are placed by
    one compiled cuckoo step (an occupant moves to its other bucket with its columns), the rest by the
    vectorised path; every item keeps its values, and the moved occupants theirs."""
    from epp.kvindex import cuckoo

    kicks: list[int] = []
    kick = cuckoo.kick_place

    def counted(*args: Any) -> Any:
        out = kick(*args)
        kicks.append(int(out[1]))  # the slot an occupant left, or -1
        return out

    monkeypatch.setattr(cuckoo, "kick_place", counted)
    table = HashTable(tag_dtype, {"v": (np.uint64, 7), "w": (np.uint32, 3)}, buckets=64, max_load=0.97)
    rng = np.random.default_rng(5)
    keys = np.unique(rng.integers(0, 2**64 - 1, size=480, dtype=np.uint64))
    tags = (keys % np.uint64(5)).astype(tag_dtype)
    for i in range(len(keys)):  # (a repeat of an earlier item now and then)
        at = [i, i // 2] if i % 7 == 0 else [i]
        slots, new = table.upsert(keys[at], tags[at], {"v": keys[at] ^ np.uint64(1)})
        assert table.cols["v"][slots].tolist() == (keys[at] ^ np.uint64(1)).tolist()
        assert new.tolist() == [True, False][: len(at)]
    assert any(k >= 0 for k in kicks), "no item was placed by a cuckoo step (an occupant moved)"
    found = table.find(keys, tags)
    assert (found >= 0).all() and len(set(found.tolist())) == len(keys) == table.size
    assert (table.cols["v"][found] == keys ^ np.uint64(1)).all() and (table.cols["w"][found] == 3).all()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 10**6), max_size=30)), max_size=12))
def test_the_compiled_owner_loops_equal_the_vectorised_batch_and_a_multiset(
    batches: list[tuple[bool, list[int]]],
) -> None:
    """`Holdings._own` (compiled loops, vectorised when `multi` holds anything) and `own_batch` give the
    same masks, counts and extra owners; an entry exists exactly while it has an owner."""
    from collections import Counter

    from epp.kvindex import ownership
    from epp.kvindex.holdings import Holdings

    compiled, batch = Holdings(16), Holdings(16)
    for h in (compiled, batch):
        for _ in range(3):
            h.add_tier()
        h.ensure_pod(70)
    owners: Counter[tuple[int, int, int]] = Counter()
    for add, draws in batches:
        if add:
            items = [(d % 7 + 1, d // 7 % 70, d // 490 % 3) for d in draws]
        else:
            held = sorted(owners.elements())
            if not held:
                continue
            items = [held[d % len(held)] for d in draws]
            take: Counter[tuple[int, int, int]] = Counter()
            items = [it for it in items if take.update([it]) or take[it] <= owners[it]]  # only owners held
        if not items:
            continue
        keys = np.array([k for k, _, _ in items], dtype=np.uint64)
        pods = np.array([p for _, p, _ in items], dtype=np.intp)
        tiers = np.array([t for _, _, t in items], dtype=np.intp)
        sign = 1 if add else -1
        made = compiled._own(keys, pods, tiers, sign)
        tags = (pods >> 5).astype(np.uint16)
        assert made == ownership.own_batch(batch, keys, pods, tiers, tags, sign)
        for it in items:
            owners[it] += sign
        owners = +owners
        for h in (compiled, batch):
            held_bits = set()
            for t in range(3):
                col = h.blocks.cols[f"m{t}"]
                for slot in h.blocks.occupied().tolist():
                    chunk, mask = int(h.blocks.tags[slot]), int(col[slot])
                    key = int(h.blocks.keys[slot])
                    held_bits |= {(key, chunk * 32 + b, t) for b in range(32) if mask >> b & 1}
            assert held_bits == set(owners)
            assert h.blocks.size == len({(k, p >> 5) for k, p, _ in owners})  # emptied rows are deleted
            assert h.entries == len(owners)
            assert all(
                h.counts[p, t] == sum(1 for _, q, u in owners if (q, u) == (p, t))
                for p in range(70)
                for t in range(3)
            )
            extra = {
                (int(h.multi.keys[s]), int(h.multi.tags[s])): int(h.multi.cols["n"][s])
                for s in h.multi.occupied().tolist()
            }
            assert extra == {(k, p | t << 16): n - 1 for (k, p, t), n in owners.items() if n > 1}


@pytest.mark.parametrize("how", ["remove", "discard"])
def test_a_removal_on_a_tier_never_stored_on_still_ends_the_unknown_chain(how: str) -> None:
    """An orphan's hash, then evicted from a tier the index has never seen: a later child of it is a new
    loss (an orphan), not a descendant of the first one (found by the state machine test)."""
    index = BlockIndex(BS)
    assert index.store("p", [7], 999, list(range(BS)), BS, "gpu", ROOT).orphan
    getattr(index, how)("p", [7], "cpu")
    assert index.store("p", [8], 7, list(range(BS)), BS, "gpu", ROOT).orphan
    stats = index.stats()
    assert (stats.orphans, stats.orphan_descendants, stats.entries) == (2, 0, 0)


def test_store_many_rejects_token_ids_that_are_not_integers_as_store_does() -> None:
    stores: list[StoreArgs] = [([1], None, [1.5, 2.0], 2, "gpu", ROOT), ([2], 1, [3, 4], 2, "gpu", ROOT)]  # type: ignore[list-item]
    many, one = BlockIndex(2), BlockIndex(2)
    assert many.store_many("p", stores) == sum(one.store("p", *args).orphan for args in stores) == 1
    assert many.stats() == one.stats()
    assert (many.stats().rejected, many.stats().entries) == (1, 0)


@pytest.mark.parametrize("calls", [[[2, 2]], [[2], [2]], [[3, 2], [2, 3]]])
def test_a_block_discarded_twice_in_one_batch_goes_once(calls: list[list[int]]) -> None:
    """Discards are resolved together at the next flush: a unit named twice (in one call or two) is one
    removal of its one copy, as two `remove` calls are (the second finds nothing)."""
    tokens = list(range(3 * BS))
    discarded, removed = BlockIndex(BS), BlockIndex(BS)
    for index in (discarded, removed):
        index.store("p", [1, 2, 3], None, tokens, BS, "gpu", ROOT)
        index.flush()
    for hashes in calls:
        discarded.discard("p", hashes, "gpu")
        for h in hashes:
            removed.remove("p", [h], "gpu")
    discarded.flush()
    removed.flush()
    assert discarded.stats() == removed.stats()
    assert discarded.stats().entries == 3 - len({h for hashes in calls for h in hashes})
    # what the memory bound counts, and the units per pod, moved once per unit too
    assert (discarded._h.used, discarded._h.units.tolist()) == (removed._h.used, removed._h.units.tolist())
    keys = block_keys(tokens, BS, ROOT)
    assert discarded.lookup(keys, ["p"]) == removed.lookup(keys, ["p"]) == {"p": {"any": 1, "gpu": 1}}
