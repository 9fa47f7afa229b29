"""KvIngest: ordering, gaps, replays, restarts and drops, driven without sockets."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epp.kvindex import batch_reader
from epp.kvindex import ingest as ingest_module
from epp.kvindex.batch_reader import salt_of
from epp.kvindex.events import KNOWN_TIERS, BlockRemoved, BlockStored, decode_batch
from epp.kvindex.freshness import Freshness, FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.ingest import Applied, Dropped, KvIngest, NeedReplay
from epp.kvindex.keys import block_keys, root_key
from epp.testing.fakes import FakeClock
from epp.testing.kv_publisher import cleared, encode_batch, removed, stored
from epp.testing.kv_wire import BlockRemoved as WireRemoved
from epp.testing.kv_wire import BlockStored as WireStored

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


def test_a_payload_that_does_not_decode_loses_its_events_the_pod_is_cleared_and_stale() -> None:
    """Its events may have removed blocks, and a replay would send the same bytes: the pod's entries
    go, and it is stale (`lost_events`) until `recovery` seconds of in-order events. Its seq counts as
    received: the next message is in order, not a gap."""
    ing = make()
    ing.on_live(P, 0, 0, B0, 1.0)
    assert ing.on_live(P, 0, 1, b"\xc1", 1.0) == Dropped("msgpack")
    assert gpu(ing) == 0 and verdict(ing, 1.0) == (Freshness.STALE, "lost_events")
    assert ing.on_live(P, 0, 2, encode_batch([stored([9], None, toks(1, 90))]), 1.0) == Applied(1)
    assert ing.counters[P].drops["msgpack"] == 1 and ing.counters[P].gaps == 0 and gpu(ing) == 1
    assert verdict(ing, 1.0 + ing.freshness.recovery - 1) == (Freshness.STALE, "lost_events")
    assert verdict(ing, 1.0 + ing.freshness.recovery + 1) == (Freshness.FRESH, "ok")


def test_central_mode_a_malformed_payload_counts_for_the_rank_whose_stream_it_continues() -> None:
    """In central mode the rank comes from the payload (rank -1 here): a payload that does not decode is
    counted for the pod's publisher that expected its seq next, as in per-pod mode (no gap follows), and
    the pod is cleared whichever rank sent it."""
    ing = make()
    ing.on_live(P, -1, 0, encode_batch([stored([1, 2], None, toks(2))], dp_rank=0), 1.0)
    ing.on_live(P, -1, 7, encode_batch([stored([5], None, toks(1, 70))], dp_rank=1), 1.0)
    assert ing.on_live(P, -1, 1, b"\xc1", 1.0) == Dropped("msgpack")  # rank 0's next
    assert gpu(ing) == 0 and verdict(ing, 1.0) == (Freshness.STALE, "lost_events")
    after = encode_batch([stored([9], None, toks(1, 90))], dp_rank=0)
    assert ing.on_live(P, -1, 2, after, 1.0) == Applied(1)
    assert ing.counters[P].gaps == 0 and gpu(ing) == 1
    assert ing.on_live(P, -1, 5, b"\xc1", 1.0) == Dropped("msgpack")  # no rank's next: cleared all the same
    assert gpu(ing) == 0
    assert ing.on_live(P, -1, 8, encode_batch([stored([6], None, toks(1, 86))], dp_rank=1), 1.0) == Applied(1)
    assert ing.counters[P].gaps == 0 and gpu(ing) == 1


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


@pytest.mark.parametrize(
    ("extra", "lora", "expected"),
    [
        ((("sql",), ("sql",)), "sql", None),  # vLLM 0.18+: the adapter's name leads every block's keys
        ((("sql", "tenant-a"), ("sql",)), "sql", "tenant-a"),  # then the first block's cache_salt
        (("sql",), "sql", None),
        ((("tenant-a",),), "sql", "tenant-a"),  # not the adapter's name: a salt
        ((("sql", "tenant-a"),), None, "sql\x00tenant-a"),  # no adapter: every string is the salt's
        (((7, "tenant-a"),), "sql", "tenant-a"),  # vLLM before 0.18: the adapter's int id
    ],
)
def test_salt_of_leaves_out_the_adapter_name(extra: object, lora: str | None, expected: str | None) -> None:
    assert salt_of(extra, None, lora) == expected  # type: ignore[arg-type]


def test_lora_blocks_match_requests_for_the_adapter() -> None:
    """vLLM puts the adapter's name in every block's extra keys (and the salt after it in the first):
    the blocks are indexed under the adapter (and the salt), as a request for the adapter looks them up."""
    ing = make()
    keys = [["sql"], ["sql"]]
    ing.on_live(P, 0, 0, encode_batch([stored([1, 2], None, toks(2), lora_name="sql", extra_keys=keys)]), 1.0)
    salted = [["sql", "tenant-a"]]
    ing.on_live(
        P, 0, 1, encode_batch([stored([3], None, toks(1, 99), lora_name="sql", extra_keys=salted)]), 1.0
    )
    assert ing.index.lookup(block_keys(toks(2), BS, root_key("sql", None)), [P])[P]["gpu"] == 2
    assert ing.index.lookup(block_keys(toks(1, 99), BS, root_key("sql", "tenant-a")), [P])[P]["gpu"] == 1
    assert ing.index.lookup(block_keys(toks(1, 99), BS, root_key("sql", None)), [P])[P].get("gpu", 0) == 0
    assert ing.index.lookup(block_keys(toks(2), BS, root_key("m", None)), [P])[P].get("gpu", 0) == 0


def _group_store(hashes: list[int], group: int, kind: str) -> Any:
    return WireStored(hashes, None, toks(len(hashes)), BS, None, "GPU", None, None, group, kind)


@pytest.mark.parametrize("scan", [True, False], ids=["compiled-scan", "msgspec"])
def test_a_removal_in_a_sliding_window_group_leaves_the_full_attention_block(
    scan: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hybrid model's engine publishes a block's hash in every KV group. Stores of groups that are not
    full attention are skipped; so are their removals (of the groups seen skipped for the pod), while a
    removal in the full-attention group still removes the block."""
    monkeypatch.setattr(batch_reader, "SCAN_FROM", 0 if scan else 1 << 30)
    ing = make()
    swa = _group_store([1, 2], 1, "sliding_window")
    ing.on_live(P, 0, 0, encode_batch([_group_store([1, 2], 0, "full_attention"), swa]), 1.0)
    assert gpu(ing) == 2 and ing.counters[P].skipped_groups == 1
    ing.on_live(P, 0, 1, encode_batch([WireRemoved([1, 2], "GPU", 1)]), 1.0)
    assert gpu(ing) == 2 and ing.counters[P].skipped_groups == 2  # + the removal not applied
    assert ing.counters[P].events == 1  # the full-attention store: skipped events are not counted
    ing.on_live(P, 0, 2, encode_batch([WireRemoved([2], "GPU", 0)]), 1.0)
    assert gpu(ing) == 1
    other = "10.0.0.2:8000"  # the groups are learnt per pod: one never seen skipping group 1 applies it
    ing.on_live(other, 0, 0, encode_batch([_group_store([1], 0, "full_attention")]), 1.0)
    ing.on_live(other, 0, 1, encode_batch([WireRemoved([1], "GPU", 1)]), 1.0)
    assert ing.index.pod_counts(other).get("gpu", 0) == 0


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
                root = root_key(model, salt_of(ev.extra_keys, ev.cache_salt, ev.lora_name))
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


# -- lost contact, reconnects, replay merging, the held-bytes cap ---------------------------------


def chain(n: int) -> list[bytes]:
    """`n` messages, each storing one block chained to the previous one (message i: engine hash i + 1,
    parent i), so that a message applied out of order or twice shows in the index."""
    return [encode_batch([stored([i + 1], i or None, toks(1, i * BS))]) for i in range(n)]


def chain_len(ing: KvIngest, n: int) -> int:
    """How many blocks of `chain(n)`'s prompt the index finds for the pod, from the start."""
    return ing.index.lookup(block_keys(toks(n), BS, root_key("m")), [P])[P].get("gpu", 0)


def published(payloads: list[bytes]) -> KvIngest:
    """The index every message applied once, in order: what a loss-free stream gives."""
    ref = make()
    for seq, payload in enumerate(payloads):
        assert ref.on_live(P, 0, seq, payload, 1.0) == Applied(1)
    return ref


def assert_same_index(ing: KvIngest, ref: KvIngest, n: int) -> None:
    assert chain_len(ing, n) == chain_len(ref, n) == n
    assert ing.index.pod_counts(P) == ref.index.pod_counts(P)
    assert ing.index.stats().entries == ref.index.stats().entries
    assert ing.counters[P].orphans == 0


def lose_contact(ing: KvIngest, now: float) -> None:
    """What the edge reports when the publisher's connection drops."""
    ing.freshness.disconnected(P, now)
    ing.on_disconnected(P, 0)


def regain_contact(ing: KvIngest, now: float) -> NeedReplay | None:
    """What the edge reports when the publisher's connection is back (the ZMTP handshake done)."""
    ing.freshness.connected(P, now)
    return ing.on_connected(P, 0, now)


def verdict(ing: KvIngest, now: float) -> tuple[Freshness, str]:
    v = ing.freshness.state(P, now)
    return v.state, v.reason


def test_live_messages_while_disconnected_are_dropped_and_change_nothing() -> None:
    clock = FakeClock()
    ing = make()
    p = chain(3)
    ing.on_live(P, 0, 0, p[0], clock.now())
    ing.on_live(P, 0, 1, p[1], clock.now())
    lose_contact(ing, clock.now())

    def state() -> tuple[object, ...]:
        return (ing.index.pod_counts(P), ing.index.stats().entries, ing.counters[P].messages, ing.last_seq[P])

    before = state()
    assert ing.on_live(P, 0, 2, p[2], clock.now()) == Dropped("disconnected")
    assert ing.on_live(P, 0, 3, encode_batch([cleared()]), clock.now()) == Dropped("disconnected")
    assert ing.counters[P].drops["disconnected"] == 2
    assert state() == before
    assert chain_len(ing, 2) == 2
    assert verdict(ing, clock.now()) == (Freshness.STALE, "publisher_unreachable")
    clock.advance(1.0)
    regain_contact(ing, clock.now())  # from here on, messages are taken again
    assert ing.on_live(P, 0, 2, encode_batch([stored([50], None, toks(1, 5000))]), clock.now()) == Applied(1)
    assert ing.counters[P].drops["disconnected"] == 2 and gpu(ing) == 1


def test_a_malformed_message_while_disconnected_does_not_move_the_stream_on() -> None:
    """Garbage queued before the connection dropped says nothing about the next engine's counter."""
    clock = FakeClock()
    ing = make()
    p = chain(2)
    ing.on_live(P, 0, 0, p[0], clock.now())
    ing.on_live(P, 0, 1, p[1], clock.now())
    lose_contact(ing, clock.now())
    assert ing.on_live(P, 0, 50, b"\xc1", clock.now()) == Dropped("msgpack")
    clock.advance(ing.freshness.hold + 1.0)  # past the `malformed` problem's hold
    regain_contact(ing, clock.now())
    # The new connection's first message continues the old counter: no restart, no gap.
    ing.on_live(P, 0, 2, encode_batch([stored([50], None, toks(1, 5000))]), clock.now())
    assert ing.counters[P].restarts == 0 and ing.counters[P].gaps == 0
    assert verdict(ing, clock.now()) == (Freshness.DEGRADED, "joined_late")


@pytest.mark.parametrize(
    ("seq", "restarts", "gaps", "expected"),
    [
        (2, 0, 0, (Freshness.DEGRADED, "joined_late")),  # the old counter continued: may be a new process
        (1, 1, 0, (Freshness.STALE, "restart_without_replay")),  # the counter went back, its start missed
        (0, 1, 0, (Freshness.FRESH, "ok")),  # a new process, seen from its first message
        (5, 0, 1, (Freshness.STALE, "unrecovered_gap")),  # messages lost meanwhile
    ],
)
def test_reconnect_without_replay_forgets_the_pod_and_takes_the_stream_up_anew(
    seq: int, restarts: int, gaps: int, expected: tuple[Freshness, str]
) -> None:
    clock = FakeClock()
    ing = make()
    p = chain(2)
    ing.on_live(P, 0, 0, p[0], clock.now())
    ing.on_live(P, 0, 1, p[1], clock.now())
    lose_contact(ing, clock.now())
    clock.advance(1.0)
    assert regain_contact(ing, clock.now()) is None
    assert gpu(ing) == 0  # forgotten at once, before any message of the new connection
    assert verdict(ing, clock.now()) == (Freshness.DEGRADED, "joined_late")
    clock.advance(1.0)
    first = encode_batch([stored([70], None, toks(1, 7000))])
    assert ing.on_live(P, 0, seq, first, clock.now()) == Applied(1)
    assert gpu(ing) == 1 and chain_len(ing, 2) == 0  # the new block only: the old ones stay gone
    assert (ing.counters[P].restarts, ing.counters[P].gaps) == (restarts, gaps)
    assert verdict(ing, clock.now()) == expected
    assert ing.last_seq[P] == seq


def test_reconnect_with_replay_replays_from_zero_and_the_replay_rebuilds_the_pod() -> None:
    clock = FakeClock()
    ing = make(replay=True)
    p = chain(4)
    ing.on_live(P, 0, 0, p[0], clock.now())
    ing.on_live(P, 0, 1, p[1], clock.now())
    lose_contact(ing, clock.now())
    clock.advance(1.0)
    assert regain_contact(ing, clock.now()) == NeedReplay(P, 0, 0)
    assert gpu(ing) == 0
    assert verdict(ing, clock.now()) == (Freshness.DEGRADED, "replaying")
    assert ing.on_live(P, 0, 3, p[3], clock.now()) == Applied(0)  # held until the replay ends
    for seq in range(3):
        ing.on_replayed(P, 0, seq, p[seq], clock.now())
    assert ing.replay_finished(P, 0, clock.now(), complete=True) == 1
    assert_same_index(ing, published(p), 4)
    assert ing.counters[P].replays["complete"] == 1
    assert verdict(ing, clock.now()) == (Freshness.FRESH, "ok")


def test_a_reconnect_abandons_the_replay_in_progress_and_its_held_messages() -> None:
    ing = make(replay=True)
    p = chain(3)
    ing.on_live(P, 0, 0, p[0], 1.0)
    assert ing.on_live(P, 0, 2, p[2], 1.0) == NeedReplay(P, 0, 1)  # p[2] held
    lose_contact(ing, 2.0)
    assert regain_contact(ing, 3.0) == NeedReplay(P, 0, 0)  # a new replay, of whoever answers now
    new = encode_batch([stored([80], None, toks(1, 8000))])
    ing.on_replayed(P, 0, 0, new, 3.1)
    assert ing.replay_finished(P, 0, 3.2, complete=True) == 0  # the old engine's held message is not applied
    assert gpu(ing) == 1 and chain_len(ing, 3) == 0
    assert verdict(ing, 3.2) == (Freshness.FRESH, "ok")


@pytest.mark.parametrize("replay", [False, True])
def test_an_engine_that_restarted_and_stayed_idle_is_not_reported_fresh(replay: bool) -> None:
    """Disconnected, reachable again, nothing sent: its old blocks may be gone with the old process."""
    clock = FakeClock()
    ing = make(replay)
    p = chain(2)
    ing.on_live(P, 0, 0, p[0], clock.now())
    ing.on_live(P, 0, 1, p[1], clock.now())
    assert verdict(ing, clock.now()) == (Freshness.FRESH, "ok")
    lose_contact(ing, clock.now())
    clock.advance(1.0)
    need = regain_contact(ing, clock.now())
    assert need == (NeedReplay(P, 0, 0) if replay else None)
    clock.advance(1.0)
    assert gpu(ing) == 0 and chain_len(ing, 2) == 0
    assert verdict(ing, clock.now()) == (
        (Freshness.DEGRADED, "replaying") if replay else (Freshness.DEGRADED, "joined_late")
    )
    if replay:  # the new process has nothing to replay: the empty index is then the whole truth
        assert ing.replay_finished(P, 0, clock.now(), complete=True) == 0
        assert gpu(ing) == 0 and verdict(ing, clock.now()) == (Freshness.FRESH, "ok")


def test_a_gap_replay_merges_what_the_live_stream_lost_and_applies_duplicates_once() -> None:
    clock = FakeClock()
    ing = make(replay=True)
    p = chain(8)
    ing.on_live(P, 0, 0, p[0], clock.now())
    ing.on_live(P, 0, 1, p[1], clock.now())
    # live 2 lost
    assert ing.on_live(P, 0, 3, p[3], clock.now()) == NeedReplay(P, 0, 2)
    # live 4 lost
    assert ing.on_live(P, 0, 5, p[5], clock.now()) == Applied(0)
    assert ing.on_replayed(P, 0, 1, p[1], clock.now()) == Applied(0)  # applied already
    assert ing.on_replayed(P, 0, 2, p[2], clock.now()) == Applied(1)  # before the first held: applied now
    for seq in (3, 4, 5, 6):  # 3, 5: held live copies; 4: the live stream lost it; 6: not received live yet
        assert ing.on_replayed(P, 0, seq, p[seq], clock.now()) == Applied(0)
    assert chain_len(ing, 8) == 3  # nothing past the first held message is applied yet
    assert ing.on_live(P, 0, 6, p[6], clock.now()) == Applied(0)  # its replayed copy is held already
    assert ing.on_live(P, 0, 7, p[7], clock.now()) == Applied(0)
    assert ing.replay_finished(P, 0, clock.now(), complete=True) == 5  # 3, 4, 5, 6, 7 in seq order
    assert_same_index(ing, published(p), 8)
    assert ing.counters[P].messages == 8  # every message applied once
    assert ing.counters[P].replays["complete"] == 1 and ing.counters[P].gaps == 1
    assert ing.last_seq[P] == 7
    assert verdict(ing, clock.now()) == (Freshness.FRESH, "ok")
    # One copy of each block: one removal each takes it away (a second copy would keep it).
    assert ing.on_live(P, 0, 8, encode_batch([removed([4, 6, 7])]), clock.now()) == Applied(1)
    assert gpu(ing) == 5 and chain_len(ing, 8) == 3


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_gap_replay_interleaved_with_the_live_stream_loses_no_block(data: st.DataObject) -> None:
    """Live messages are lost after a first one; the replay (from the first lost, up to some point at
    or after the message that revealed the gap) arrives interleaved with the rest of the live stream in
    any order. When the replay reaches every lost message the index ends as the published stream gives
    it, each message applied once; when a live message past the replay's end was lost, the pod is
    stale and keeps no block it cannot vouch for."""
    n = data.draw(st.integers(3, 12), label="messages")
    p = chain(n)
    lost = set(data.draw(st.lists(st.integers(1, n - 2), min_size=1, unique=True), label="lost"))
    first_lost = min(lost)
    trigger = next(s for s in range(first_lost, n) if s not in lost)
    end = data.draw(st.integers(trigger, n - 1), label="replay end")
    ing = make(replay=True)
    for seq in range(first_lost):
        assert ing.on_live(P, 0, seq, p[seq], 1.0) == Applied(1)
    assert ing.on_live(P, 0, trigger, p[trigger], 1.0) == NeedReplay(P, 0, first_lost)
    replayed = list(range(first_lost, end + 1))
    live = [s for s in range(trigger + 1, n) if s not in lost]
    while replayed or live:
        if replayed and (not live or data.draw(st.booleans(), label="replayed next")):
            seq = replayed.pop(0)
            ing.on_replayed(P, 0, seq, p[seq], 1.1)
        else:
            seq = live.pop(0)
            assert ing.on_live(P, 0, seq, p[seq], 1.1) == Applied(0)
    ing.replay_finished(P, 0, 1.2, complete=True)
    if max(lost) <= end:
        assert_same_index(ing, published(p), n)
        assert ing.counters[P].messages == n
        assert verdict(ing, 1.2) == (Freshness.FRESH, "ok")
    else:
        assert verdict(ing, 1.2) == (Freshness.STALE, "unrecovered_gap")
        assert ing.counters[P].gaps == 2
        assert chain_len(ing, n) == 0  # cleared; what follows the loss cannot be chained


def make_capped(max_held_bytes: int) -> KvIngest:
    return KvIngest(
        BlockIndex(block_size=BS, max_entries=10_000),
        FreshnessTracker(),
        lambda pod: "m",
        replay_available=True,
        max_held_bytes=max_held_bytes,
    )


def test_the_first_held_message_is_kept_whatever_the_byte_cap() -> None:
    ing = make_capped(1)
    p = chain(3)
    ing.on_live(P, 0, 0, p[0], 1.0)
    assert ing.on_live(P, 0, 2, p[2], 1.0) == NeedReplay(P, 0, 1)
    ing.on_replayed(P, 0, 1, p[1], 1.1)
    assert ing.replay_finished(P, 0, 1.2, complete=True) == 1
    assert_same_index(ing, published(p), 3)
    assert ing.counters[P].drops["overflow"] == 0
    assert verdict(ing, 1.2) == (Freshness.FRESH, "ok")


@pytest.mark.parametrize("replay_end", [2, 3, 4])
def test_holding_past_the_byte_cap_drops_and_the_replay_is_incomplete(replay_end: int) -> None:
    """A live message dropped for the cap is lost whether or not the replay reaches it (its replayed
    copy does not fit either): the pod is cleared and stale, even once the drop is old news."""
    clock = FakeClock()
    p = chain(6)
    ing = make_capped(max(map(len, p)))  # room for one message
    ing.on_live(P, 0, 0, p[0], clock.now())
    assert ing.on_live(P, 0, 2, p[2], clock.now()) == NeedReplay(P, 0, 1)
    assert ing.on_live(P, 0, 3, p[3], clock.now()) == Dropped("overflow")
    assert ing.counters[P].drops["overflow"] == 1
    for seq in range(1, replay_end + 1):
        ing.on_replayed(P, 0, seq, p[seq], clock.now())
    ing.replay_finished(P, 0, clock.now(), complete=True)
    assert ing.counters[P].replays == Counter({"incomplete": 1})
    clock.advance(ing.freshness.hold + 1.0)  # past the `dropped` problem's hold
    assert verdict(ing, clock.now()) == (Freshness.STALE, "unrecovered_gap")
    assert chain_len(ing, 6) < 4  # never claims the message it dropped


def test_held_bytes_are_given_back_when_the_replay_ends() -> None:
    p = chain(8)
    ing = make_capped(2 * max(map(len, p)))  # room for two messages
    ing.on_live(P, 0, 0, p[0], 1.0)
    for gap_at in (2, 5):
        assert ing.on_live(P, 0, gap_at, p[gap_at], 1.0) == NeedReplay(P, 0, gap_at - 1)
        assert ing.on_live(P, 0, gap_at + 1, p[gap_at + 1], 1.0) == Applied(0)
        if gap_at == 5:
            ing.on_replayed(P, 0, 4, p[4], 1.1)
        ing.on_replayed(P, 0, gap_at - 1, p[gap_at - 1], 1.1)
        assert ing.replay_finished(P, 0, 1.2, complete=True) == 2
    ing.on_live(P, 0, 7, p[7], 1.3)
    assert ing.counters[P].drops["overflow"] == 0
    assert_same_index(ing, published(p), 8)


def test_a_message_held_live_and_replayed_takes_its_room_once() -> None:
    p = chain(4)
    ing = make_capped(2 * max(map(len, p)))  # room for two messages
    ing.on_live(P, 0, 0, p[0], 1.0)
    assert ing.on_live(P, 0, 2, p[2], 1.0) == NeedReplay(P, 0, 1)
    for seq in (1, 2, 3):  # 2: its live copy is held; 3: merged, not received live yet
        assert ing.on_replayed(P, 0, seq, p[seq], 1.1) == Applied(1 if seq == 1 else 0)
    assert ing.on_live(P, 0, 3, p[3], 1.1) == Applied(0)  # held already: no room needed
    assert ing.replay_finished(P, 0, 1.2, complete=True) == 2
    assert ing.counters[P].drops["overflow"] == 0 and ing.counters[P].replays["complete"] == 1
    assert_same_index(ing, published(p), 4)


def test_a_malformed_message_in_a_replay_makes_it_incomplete() -> None:
    """Seq 3 is malformed at the source (live and replayed copies alike): both copies are counted as
    malformed, and since its events are lost the pod is cleared and stale when it comes to be applied
    (the replayed copy is held with the live messages after the first held one)."""
    clock = FakeClock()
    good = chain(4)
    p = [good[0], good[1], good[2], b"\xc1", good[3]]  # good[3] chains to good[2]
    ing = make(replay=True)
    ing.on_live(P, 0, 0, p[0], clock.now())
    assert ing.on_live(P, 0, 2, p[2], clock.now()) == NeedReplay(P, 0, 1)
    assert ing.on_live(P, 0, 3, p[3], clock.now()) == Dropped("msgpack")
    assert ing.on_live(P, 0, 4, p[4], clock.now()) == Applied(0)
    for seq in range(1, 5):
        ing.on_replayed(P, 0, seq, p[seq], clock.now())
    assert chain_len(ing, 3) == 2  # seq 0, and seq 1 replayed (2 on are held: the live copies come last)
    ing.replay_finished(P, 0, clock.now(), complete=True)
    assert chain_len(ing, 4) == 0 and ing.counters[P].orphans == 1  # seq 4 chains to a cleared block
    assert ing.counters[P].replays["complete"] == 1 and ing.counters[P].gaps == 1  # (the replay itself)
    assert ing.counters[P].drops["msgpack"] == 2  # the live copy and the replayed one
    assert ing.last_seq[P] == 4
    assert verdict(ing, clock.now()) == (Freshness.STALE, "lost_events")


def test_skipped_kv_groups_are_distinct_in_order_and_bounded_per_pod() -> None:
    """An engine sending thousands of distinct non-full-attention group ids: the batch lists each once,
    in order of appearance, and the pod remembers at most MAX_PARTIAL_GROUPS of them."""
    events = [_group_store([i + 1], g, "sliding_window") for i, g in enumerate([3, 1, 3, *range(10, 1010)])]
    payload = encode_batch(events)
    for batch in (batch_reader.decode(payload), batch_reader.runs_of(decode_batch(payload))):
        assert batch.partial_groups[:3] == (3, 1, 10) and len(batch.partial_groups) == 1002
    ing = make()
    ing.on_live(P, 0, 0, payload, 1.0)
    assert len(ing._partial_groups[P]) == ingest_module.MAX_PARTIAL_GROUPS
    assert ing.counters[P].skipped_groups == len(events) and gpu(ing) == 0
