"""KvIngest: ordering, gaps, replays, restarts and drops, driven without sockets."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epp.kvindex.events import KNOWN_TIERS, BlockRemoved, BlockStored, decode_batch
from epp.kvindex.freshness import Freshness, FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.ingest import Applied, Dropped, KvIngest, NeedReplay, salt_of
from epp.kvindex.keys import block_keys, root_key
from epp.testing.kv_publisher import cleared, encode_batch, removed, stored

BS = 16
P = "10.0.0.1:8000"


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n * BS))


def make(replay: bool = False) -> KvIngest:
    return KvIngest(
        BlockIndex(block_size=BS, max_entries=10_000),
        FreshnessTracker(),
        lambda pod: "m",
        replay_available=replay,
    )


def gpu(ing: KvIngest) -> int:
    return ing.index.pod_counts(P).get("gpu", 0)


B0 = encode_batch([stored([1, 2], None, toks(2))])
B1 = encode_batch([stored([3], 2, toks(1, 32))])
B2 = encode_batch([stored([4], 3, toks(1, 48))])


def test_in_order_messages_are_applied() -> None:
    ing = make()
    assert ing.on_live(P, 0, 0, B0, 1.0) == Applied(1)
    assert ing.on_live(P, 0, 1, B1, 1.0) == Applied(1)
    assert gpu(ing) == 3 and ing.last_seq[P] == 1
    assert ing.freshness.state(P, 1.0).state is Freshness.FRESH


def test_gap_with_replay_holds_live_messages_until_the_replay_ends() -> None:
    ing = make(replay=True)
    ing.on_live(P, 0, 0, B0, 1.0)
    need = ing.on_live(P, 0, 2, B2, 1.0)
    assert need == NeedReplay(P, 0, 1)
    assert gpu(ing) == 2  # B2 held
    assert ing.freshness.state(P, 1.0).reason == "replaying"
    assert ing.on_replayed(P, 0, 0, B0, 1.1) == Applied(0)  # already applied
    assert ing.on_replayed(P, 0, 1, B1, 1.1) == Applied(1)
    assert ing.on_replayed(P, 0, 2, B2, 1.1) == Applied(0)  # the live copy is held
    assert ing.replay_finished(P, 0, 1.2, complete=True) == 1
    assert gpu(ing) == 4 and ing.counters[P].replays["complete"] == 1
    assert ing.freshness.state(P, 1.2).state is Freshness.FRESH


def test_incomplete_replay_clears_the_pod_and_goes_stale() -> None:
    ing = make(replay=True)
    ing.on_live(P, 0, 0, B0, 1.0)
    ing.on_live(P, 0, 2, B2, 1.0)
    ing.replay_finished(P, 0, 1.5, complete=False)
    assert ing.freshness.state(P, 1.5).reason == "unrecovered_gap"
    # Cleared, then the held B2 is applied; its parent (3) is unknown now, so it is an orphan.
    assert gpu(ing) == 0 and ing.counters[P].orphans == 1


def test_gap_without_replay_clears_and_continues() -> None:
    ing = make()
    ing.on_live(P, 0, 0, B0, 1.0)
    assert ing.on_live(P, 0, 2, encode_batch([stored([9], None, toks(1, 900))]), 1.0) == Applied(1)
    assert gpu(ing) == 1 and ing.counters[P].gaps == 1
    assert ing.freshness.state(P, 1.0).state is Freshness.STALE


@pytest.mark.parametrize(
    ("seq", "replay", "state"), [(0, False, Freshness.FRESH), (1, False, Freshness.STALE)]
)
def test_restart_clears_the_pod_first(seq: int, replay: bool, state: Freshness) -> None:
    ing = make(replay)
    ing.on_live(P, 0, 0, B0, 1.0)
    ing.on_live(P, 0, 1, B1, 1.0)
    ing.on_live(P, 0, seq, encode_batch([stored([7], None, toks(1, 700))]), 2.0)
    assert gpu(ing) == 1 and ing.counters[P].restarts == 1
    assert ing.freshness.state(P, 2.0).state is state


def test_restart_mid_stream_with_replay_replays_the_new_run_from_zero() -> None:
    ing = make(replay=True)
    ing.on_live(P, 0, 0, B0, 1.0)
    ing.on_live(P, 0, 1, B1, 1.0)
    new1 = encode_batch([stored([21], 20, toks(1, 2016))])
    assert ing.on_live(P, 0, 1, new1, 2.0) == NeedReplay(P, 0, 0)
    assert gpu(ing) == 0  # old blocks gone before any new event
    ing.on_replayed(P, 0, 0, encode_batch([stored([20], None, toks(1, 2000))]), 2.1)
    ing.replay_finished(P, 0, 2.2, complete=True)
    assert gpu(ing) == 2
    assert ing.freshness.state(P, 2.2).state is Freshness.FRESH


def test_malformed_payload_is_dropped_counted_and_does_not_look_like_a_gap() -> None:
    ing = make()
    ing.on_live(P, 0, 0, B0, 1.0)
    assert ing.on_live(P, 0, 1, b"\xc1", 1.0) == Dropped("msgpack")
    assert ing.on_live(P, 0, 2, encode_batch([stored([9], None, toks(1, 90))]), 1.0) == Applied(1)
    assert ing.counters[P].drops["msgpack"] == 1 and ing.counters[P].gaps == 0
    assert ing.freshness.state(P, 1.0).reason == "malformed"


def test_removed_and_cleared_events() -> None:
    ing = make()
    ing.on_live(P, 0, 0, B0, 1.0)
    ing.on_live(P, 0, 1, encode_batch([removed([2])]), 1.0)
    assert gpu(ing) == 1
    ing.on_live(P, 0, 2, encode_batch([cleared()]), 1.0)
    assert gpu(ing) == 0


def test_unknown_model_is_dropped_and_lora_name_wins() -> None:
    ing = KvIngest(BlockIndex(block_size=BS, max_entries=1000), FreshnessTracker(), lambda pod: None)
    ing.on_live(P, 0, 0, B0, 1.0)
    assert ing.counters[P].drops["unknown_model"] == 1 and gpu(ing) == 0
    ing.on_live(P, 0, 1, encode_batch([stored([5], None, toks(1), lora_name="adapter")]), 1.0)
    assert gpu(ing) == 1


def test_held_messages_are_bounded() -> None:
    ing = KvIngest(
        BlockIndex(block_size=BS, max_entries=1000),
        FreshnessTracker(),
        lambda pod: "m",
        replay_available=True,
        max_held=2,
    )
    ing.on_live(P, 0, 0, B0, 1.0)
    ing.on_live(P, 0, 5, B2, 1.0)  # replay starts; held 1
    ing.on_live(P, 0, 6, B2, 1.0)  # held 2
    assert ing.on_live(P, 0, 7, B2, 1.0) == Dropped("overflow")


def test_remove_pod_forgets_everything() -> None:
    ing = make()
    ing.on_live(P, 0, 0, B0, 1.0)
    ing.remove_pod(P)
    assert P not in ing.index.pods() and P not in ing.counters and ing.freshness.pods() == []


def test_lag_is_measured_against_the_batch_timestamp() -> None:
    ing = make()
    ing.on_live(P, 0, 0, encode_batch([], ts=100.0), 1.0, wall_now=105.0)
    assert ing.freshness.state(P, 1.0).reason == "lagging"


@pytest.mark.parametrize(
    ("extra", "salt", "expected"),
    [
        (None, None, None),
        (None, "t1", "t1"),
        (("s",), None, "s"),
        ((["s", 3],), None, "s"),
        (((1, 2),), None, None),
    ],
)
def test_salt_of(extra: object, salt: str | None, expected: str | None) -> None:
    assert salt_of(extra, salt) == expected  # type: ignore[arg-type]


def test_salted_chains_get_their_own_keys() -> None:
    ing = make()
    ing.on_live(P, 0, 0, encode_batch([stored([1], None, toks(1), extra_keys=[["tenant-a"]])]), 1.0)
    plain = block_keys(toks(1), BS, root_key("m", None))
    salted = block_keys(toks(1), BS, root_key("m", "tenant-a"))
    assert ing.index.lookup(plain, [P])[P].get("any", 0) == 0
    assert ing.index.lookup(salted, [P])[P]["any"] == 1


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_message_is_applied_as_its_events_one_by_one(data: st.DataObject) -> None:
    """`_apply` hands runs of BlockStored to `store_many`: the index ends as when every event of every
    message goes to `store` / `remove` / `clear_pod` in order (models, salts, tiers, orphans included)."""
    ing = make()
    ref = BlockIndex(block_size=BS, max_entries=10_000)
    ref_orphans = 0
    ref_unknown_tiers: Counter[str] = Counter()
    held: list[int] = []  # hashes stored so far, to chain from and to remove
    chains: list[list[int]] = []
    nxt = 1
    for seq in range(data.draw(st.integers(1, 6))):
        events: list[Any] = []
        for _ in range(data.draw(st.integers(0, 8))):
            kind = data.draw(st.sampled_from(["stored", "stored", "stored", "removed", "cleared"]))
            if kind == "removed" and held:
                events.append(removed(data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=3))))
            elif kind == "cleared" and data.draw(st.booleans()):
                events.append(cleared())
            else:
                n = data.draw(st.integers(1, 3))
                parent = data.draw(st.sampled_from([None, 10**9, *held[-6:]]))
                hashes = list(range(nxt, nxt + n))
                nxt += n
                tokens = data.draw(st.lists(st.integers(0, 3), min_size=n * BS, max_size=n * BS))
                extra = data.draw(st.sampled_from([None, [None] * n, [["tenant"]] + [None] * (n - 1)]))
                lora = data.draw(st.sampled_from([None, "adapter"]))
                medium = data.draw(st.sampled_from(["GPU", "cpu", "weird"]))
                events.append(stored(hashes, parent, tokens, medium=medium, lora_name=lora, extra_keys=extra))
                held.extend(hashes)
                chains.append(tokens)
        payload = encode_batch(events, ts=0.0)
        assert ing.on_live(P, 0, seq, payload, 1.0) == Applied(len(events))
        for ev in decode_batch(payload).events:
            if isinstance(ev, BlockStored):
                model = ev.lora_name or "m"
                root = root_key(model, salt_of(ev.extra_keys, ev.cache_salt))
                if ev.tier not in KNOWN_TIERS:
                    ref_unknown_tiers[ev.tier] += 1
                out = ref.store(
                    P, ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.tier, root
                )
                ref_orphans += out.orphan
            elif isinstance(ev, BlockRemoved):
                ref.remove(P, ev.block_hashes, ev.tier)
            else:
                ref.clear_pod(P)
    index = ing.index
    assert index.stats() == ref.stats()
    assert index.pod_counts(P) == ref.pod_counts(P)
    assert ing.counters[P].orphans == ref_orphans
    assert ing.counters[P].unknown_tiers == ref_unknown_tiers
    for tokens in chains:
        for root in (
            root_key("m"),
            root_key("m", "tenant"),
            root_key("adapter"),
            root_key("adapter", "tenant"),
        ):
            keys = block_keys(tokens, BS, root)
            assert index.lookup(keys, [P]) == ref.lookup(keys, [P])
