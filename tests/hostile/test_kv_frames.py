"""Hostile KV-event messages: random frame counts, seq frames, topics, msgpack garbage, and well-formed
batches with wrong-typed fields, into the decoder (`epp/kvindex/events.py`) and the subscriber
(`KvEventSubscriber.handle`, per-pod and central), then over real ZeroMQ sockets.

Every message is either applied or dropped and counted under one reason; nothing raises; a valid
message afterwards still lands its blocks in the index.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epp.clock import MonotonicClock
from epp.config import KvEventsConfig
from epp.datastore import Datastore
from epp.kvindex.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    decode_batch,
)
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.ingest import MAX_DP_RANKS, MAX_UNKNOWN_TIERS, OTHER_TIER, KvIngest
from epp.kvindex.keys import block_keys, root_key
from epp.sources.kv_events import MAX_MESSAGE_BYTES, UNKNOWN_POD, KvEventSubscriber
from epp.testing.envoy import free_port
from epp.testing.kv_publisher import KvEventPublisher, encode_batch, stored
from epp.testing.wait import eventually

BS = 16
POD = "127.0.0.2:8000"
REASONS = {"msgpack", "batch_shape", "event_shape", "field_type", "unknown_event"}
EDGE_REASONS = {"frame_count", "bad_seq", "bad_topic", "unknown_pod"}

# msgpack can carry: ints in [-2**63, 2**64), floats (NaN, inf), str, bin, arrays, maps.
mp_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=40),
)
mp_values: st.SearchStrategy[Any] = st.recursive(
    mp_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=12), st.integers(-5, 5)), inner, max_size=4),
    ),
    max_leaves=15,
)
hashes = st.one_of(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.integers(min_value=-(2**63), max_value=-1),
    st.binary(min_size=16, max_size=16),
    st.binary(min_size=32, max_size=32),
)


def field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a valid value, sometimes anything."""
    return st.one_of(valid, valid, mp_values)


stored_events = st.fixed_dictionaries(
    {
        "type": field(st.just("BlockStored")),
        "block_hashes": field(st.lists(hashes, min_size=1, max_size=3)),
        "parent_block_hash": field(st.one_of(st.none(), hashes)),
        "token_ids": field(st.lists(st.integers(0, 2**31), max_size=3 * BS)),
        "block_size": field(st.sampled_from([BS, 1, 0, -1, 2**40])),
    },
    optional={
        "medium": field(st.one_of(st.sampled_from(["GPU", "cpu", "DISK", "weird"]), st.text(max_size=8))),
        "lora_name": field(st.one_of(st.none(), st.text(max_size=8))),
        "extra_keys": field(
            st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(mp_scalars, max_size=3))))
        ),
        "cache_salt": field(st.one_of(st.none(), st.text(max_size=8))),
        "kv_cache_spec_kind": field(st.sampled_from(["full_attention", "sliding_window", "mamba"])),
        "group_idx": field(st.integers(0, 3)),
    },
)
removed_events = st.fixed_dictionaries(
    {"type": field(st.just("BlockRemoved")), "block_hashes": field(st.lists(hashes, max_size=3))},
    optional={"medium": field(st.sampled_from(["GPU", "CPU"]))},
)
map_events = st.one_of(stored_events, removed_events, st.just({"type": "AllBlocksCleared"}), mp_values)
# The same events array-encoded (vLLM 0.9-0.23): [tag, fields in order...].
array_events = map_events.map(
    lambda ev: [ev.get("type"), *(v for k, v in ev.items() if k != "type")] if isinstance(ev, dict) else ev
)
batches = st.tuples(
    field(st.floats(min_value=0, max_value=2e9)),
    field(st.lists(st.one_of(map_events, array_events), max_size=4)),
    field(st.one_of(st.none(), st.integers(0, 3), st.integers(min_value=-(2**63), max_value=2**64 - 1))),
).map(list)


def pack(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


payloads = st.one_of(
    st.binary(max_size=200),
    mp_values.map(pack),
    batches.map(pack),
    batches.map(lambda b: pack(b[:2])),
    batches.map(lambda b: pack(b)[: max(1, len(pack(b)) // 2)]),  # truncated
)


def decode(payload: bytes) -> EventBatch | DecodeError:
    try:
        return decode_batch(payload)
    except DecodeError as err:
        assert err.reason in REASONS and str(err)
        return err


@settings(max_examples=400, deadline=None)
@given(payloads)
def test_any_payload_decodes_or_is_a_decode_error_with_a_reason(payload: bytes) -> None:
    batch = decode(payload)
    if isinstance(batch, EventBatch):  # what the ingest relies on: typed events, unsigned 64-bit hashes
        assert isinstance(batch.ts, float) and batch.skipped >= 0
        assert batch.data_parallel_rank is None or type(batch.data_parallel_rank) is int
        for ev in batch.events:
            assert isinstance(ev, BlockStored | BlockRemoved | AllBlocksCleared)
            if not isinstance(ev, AllBlocksCleared):
                assert all(type(h) is int and 0 <= h < 2**64 for h in ev.block_hashes)
                assert isinstance(ev.tier, str) and ev.tier == ev.tier.lower()
            if isinstance(ev, BlockStored):
                assert ev.parent_block_hash is None or 0 <= ev.parent_block_hash < 2**64
                assert ev.block_size >= 1 and all(type(t) is int for t in ev.token_ids)


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_payloads_are_decode_errors(depth: int) -> None:
    payload = b"\x91" * depth + b"\x01"  # fixarray(1) nested depth times
    assert isinstance(decode(payload), DecodeError)
    extra = [[[1]]]
    for _ in range(depth):
        extra = [extra]
    try:
        deep = pack(
            [
                0.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "parent_block_hash": None,
                        "token_ids": list(range(BS)),
                        "block_size": BS,
                        "extra_keys": [extra],
                    }
                ],
            ]
        )
    except RecursionError:  # too deep for the encoder: the raw bytes below say the same
        deep = b"\x92\xcb" + b"\x00" * 8 + b"\x91" + b"\x91" * depth + b"\x01"
    decode(deep)


# -- the subscriber: frames -> counted outcome ---------------------------------------------------

topics = st.one_of(
    st.sampled_from(
        [b"", f"kv@{POD}@m".encode(), b"kv@127.0.0.2@m", b"kv@10.9.9.9:1@m", b"kv@", b"\xff\xfe"]
    ),
    st.binary(max_size=20),
)
seqs = st.one_of(st.integers(0, 2**64 - 1).map(lambda s: s.to_bytes(8, "big")), st.binary(max_size=12))
frames_strategy = st.one_of(
    st.tuples(topics, seqs, payloads).map(list),
    st.lists(st.binary(max_size=30), max_size=6),
)


class Rig:
    def __init__(self, mode: str) -> None:
        self.clock = MonotonicClock()
        self.datastore = Datastore(self.clock)
        self.datastore.add_endpoint(POD, "m")
        self.index = BlockIndex(block_size=BS, max_entries=100_000)
        self.ingest = KvIngest(self.index, FreshnessTracker(), lambda pod: "m")
        settings = KvEventsConfig(mode=mode, bind="tcp://127.0.0.1:0")
        self.sub = KvEventSubscriber(self.datastore, self.ingest, self.clock, settings)
        self.pod: str | None = POD if mode == "per-pod" else None
        self.next_hash = 1 << 40

    def outcomes(self) -> int:
        """Messages applied + messages dropped (every reason), over every pod."""
        return sum(c.messages + sum(c.drops.values()) for c in self.ingest.counters.values())

    def valid(self) -> None:
        """A valid message lands its block in the index, whatever came before it."""
        tokens = list(range(self.next_hash % 1000, self.next_hash % 1000 + BS))
        payload = encode_batch([stored([self.next_hash], None, tokens, BS)])
        self.next_hash += 1
        before = self.outcomes()
        self.sub.handle(
            [f"kv@{POD}@m".encode(), (2**40).to_bytes(8, "big"), payload], self.pod, 0 if self.pod else -1
        )
        assert self.outcomes() == before + 1
        self.index.flush()
        keys = block_keys(tokens, BS, root_key("m", None))
        assert self.index.lookup(keys, [POD])[POD]["gpu"] == 1


@pytest.fixture(params=["per-pod", "central"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    r = Rig(request.param)
    yield r
    r.sub.ctx.destroy(linger=0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(frames_strategy, min_size=1, max_size=6))
def test_every_message_is_applied_or_dropped_under_one_reason(rig: Rig, messages: list[list[bytes]]) -> None:
    for frames in messages:
        before = rig.outcomes()
        rig.sub.handle(frames, rig.pod, 0 if rig.pod else -1)  # raises nothing
        assert rig.outcomes() == before + 1, frames
    reasons = set().union(*(c.drops for c in rig.ingest.counters.values()))
    assert reasons <= REASONS | EDGE_REASONS
    if rig.pod is None:  # central mode: nothing is attributed to a pod the topic does not name
        assert set(rig.ingest.counters) <= {POD, UNKNOWN_POD}
    rig.valid()


def test_a_batch_claiming_a_far_data_parallel_rank_is_dropped_not_tracked() -> None:
    r = Rig("central")
    topic = f"kv@{POD}@m".encode()
    for i in range(2000):
        batch = encode_batch([], dp_rank=MAX_DP_RANKS + i)
        r.sub.handle([topic, (0).to_bytes(8, "big"), batch], None, -1)
    assert r.ingest.counters[POD].drops["field_type"] == 2000
    assert len(r.ingest._publishers) == 0  # no per-rank state for made-up ranks
    r.valid()
    r.sub.ctx.destroy(linger=0)


def test_unknown_tier_names_are_counted_in_a_bounded_table() -> None:
    r = Rig("per-pod")
    for i in range(500):
        payload = encode_batch([stored([i + 1], None, list(range(BS)), BS, medium=f"tier-{i}")])
        r.sub.handle([b"", i.to_bytes(8, "big"), payload], POD, 0)
    unknown = r.ingest.counters[POD].unknown_tiers
    assert len(unknown) == MAX_UNKNOWN_TIERS + 1
    assert sum(unknown.values()) == 500 and unknown[OTHER_TIER] == 500 - MAX_UNKNOWN_TIERS
    r.valid()
    r.sub.ctx.destroy(linger=0)


# -- over real sockets ----------------------------------------------------------------------------


async def test_garbage_over_a_real_socket_is_counted_and_the_subscriber_keeps_indexing() -> None:
    rng = random.Random(8)
    port = free_port()
    clock = MonotonicClock()
    ds = Datastore(clock)
    ds.add_endpoint(POD, "m")
    index = BlockIndex(block_size=BS, max_entries=100_000)
    ingest = KvIngest(index, FreshnessTracker(), lambda pod: "m")
    settings = KvEventsConfig(mode="per-pod", port=port, sync_interval=0.05)
    sub = KvEventSubscriber(ds, ingest, clock, settings)
    await sub.start()
    try:
        async with KvEventPublisher(f"tcp://127.0.0.2:{port}") as pub:
            # Joined once an empty batch has arrived (ZeroMQ's slow joiner).
            for _ in range(500):
                await pub.publish([])
                if POD in ingest.last_seq:
                    break
                await asyncio.sleep(0.01)
            counters = ingest.counters[POD]
            assert not counters.drops
            garbage: list[list[bytes]] = []
            for _ in range(200):
                shape = rng.randrange(3)
                if shape == 0:  # any frames
                    garbage.append(
                        [rng.randbytes(rng.randrange(40)) for _ in range(rng.choice([1, 2, 4, 5]))]
                    )
                elif shape == 1:  # three frames, the seq frame of a wrong length
                    garbage.append([b"", rng.randbytes(rng.choice([0, 4, 7, 9])), rng.randbytes(20)])
                else:  # a well-framed message whose payload is not a batch (or a truncated one)
                    batch = encode_batch([stored([rng.randrange(2**64)], None, list(range(BS)), BS)])
                    payload = rng.choice([rng.randbytes(30), batch[: rng.randrange(len(batch))], b"\xc1"])
                    garbage.append([b"", rng.randrange(2**64).to_bytes(8, "big"), payload])
            for frames in garbage:
                await pub.send_raw(frames)
            tokens = list(range(500, 500 + 2 * BS))
            keys = block_keys(tokens, BS, root_key("m", None))
            await pub.publish([stored([77, 78], None, tokens, BS)])
            await eventually(
                lambda: (
                    sum(counters.drops.values()) == len(garbage)
                    and index.lookup(keys, [POD])[POD].get("gpu") == 2
                ),
                "every garbage message counted, and the valid one's blocks indexed",
            )
            assert set(counters.drops) <= REASONS | EDGE_REASONS
    finally:
        await sub.stop()


async def test_an_oversized_message_in_central_mode_is_refused_and_the_publisher_is_heard_again() -> None:
    port = free_port()
    clock = MonotonicClock()
    ds = Datastore(clock)
    ds.add_endpoint(POD, "m")
    index = BlockIndex(block_size=BS, max_entries=100_000)
    ingest = KvIngest(index, FreshnessTracker(), lambda pod: "m")
    settings = KvEventsConfig(mode="central", bind=f"tcp://127.0.0.1:{port}", sync_interval=0.05)
    sub = KvEventSubscriber(ds, ingest, clock, settings)
    await sub.start()
    try:
        endpoint = f"tcp://127.0.0.1:{port}"
        async with KvEventPublisher(endpoint, connect=True, topic=f"kv@{POD}@m") as pub:
            for _ in range(500):
                await pub.publish([])
                if POD in ingest.last_seq:
                    break
                await asyncio.sleep(0.01)
            await pub.publish([], payload=b"\x00" * (MAX_MESSAGE_BYTES + 1))
            tokens = list(range(900, 900 + BS))
            keys = block_keys(tokens, BS, root_key("m", None))
            # ZeroMQ dropped the connection at the oversized frame; the publisher reconnects and its
            # next messages arrive.
            for attempt in range(500):
                await pub.publish([stored([5000 + attempt], None, tokens, BS)])
                await asyncio.sleep(0.02)
                if index.lookup(keys, [POD])[POD].get("gpu") == 1:
                    break
            assert index.lookup(keys, [POD])[POD].get("gpu") == 1
            assert ingest.counters[POD].drops["msgpack"] == 0  # the oversized payload was never handled
    finally:
        await sub.stop()
