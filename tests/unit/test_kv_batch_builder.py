"""`batch_reader.BatchBuilder`: a batch handed to `KvIngest` decoded has the effects of the same events sent
as vLLM's msgpack, and the simulator's engines hand theirs that way."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.kvindex.batch_reader import BatchBuilder, decode, held_size
from epp.kvindex.event_scan import ScannedBatch
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.ingest import Applied, KvIngest, NeedReplay
from epp.kvindex.keys import block_keys, root_key
from epp.testing.kv_wire import cleared, encode_batch, removed, stored
from simulator.events import EventSink

BS = 16
PODS = ("10.0.0.1:8000", "10.0.0.2:8000")


def make(replay: bool = False) -> KvIngest:
    return KvIngest(
        BlockIndex(block_size=BS, max_entries=100_000),
        FreshnessTracker(),
        lambda pod: "m",
        replay_available=replay,
    )


# One chain per (adapter, salt): stores extend it block by block (or start it again from the root), removals
# take a block stored before, clears drop everything. Events go to either pod.
Step = tuple[str, int, Any]
steps = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "store", "remove", "clear"]),
        st.integers(0, 1),  # pod
        st.tuples(
            st.integers(0, 3), st.integers(1, 3), st.sampled_from(["GPU", "CPU"])
        ),  # chain, blocks, medium
    ),
    max_size=40,
)
CHAINS = [(None, None), ("sql", None), (None, "tenant"), ("sql", "tenant")]


def replay_both(
    script: list[Step], per_batch: int
) -> tuple[KvIngest, KvIngest, list[tuple[str | None, str | None, list[int]]]]:
    """Run `script` into one ingest as msgpack payloads and into another as builder batches."""
    wire, built = make(), make()
    chains: dict[tuple[int, int], list[int]] = {}  # (pod, chain) -> engine hashes stored, in chain order
    tokens: dict[int, list[int]] = {}  # chain -> its token ids so far (the same content on both pods)
    held: list[tuple[str | None, str | None, list[int]]] = []
    events: dict[int, list[Any]] = {0: [], 1: []}
    builders = {0: BatchBuilder(), 1: BatchBuilder()}
    seqs = {0: 0, 1: 0}

    def send(pod: int) -> None:
        if not events[pod]:
            return
        payload = encode_batch(events[pod], None, 1.0)
        batch = builders[pod].take(1.0)
        assert wire.on_live(PODS[pod], 0, seqs[pod], payload, 1.0) == built.on_live(
            PODS[pod], 0, seqs[pod], batch, 1.0
        )
        seqs[pod] += 1
        events[pod] = []

    for i, (kind, pod, (c, n, medium)) in enumerate(script):
        lora, salt = CHAINS[c]
        mine = chains.setdefault((pod, c), [])
        if kind == "store":
            toks = tokens.setdefault(c, [])
            start = len(mine)
            while len(toks) < (start + n) * BS:
                toks.append(len(toks) * 7 + c)
            hashes = [hash((c, j)) & 0xFFFFFFFFFFFFFFFF for j in range(start, start + n)]
            parent = mine[-1] if mine else None
            ids = toks[start * BS : (start + n) * BS]
            extra: list[Any] | None = None
            if lora:
                extra = [[lora] for _ in hashes]
                if salt and parent is None:
                    extra[0] = [lora, salt]
            elif salt and parent is None:
                extra = [[salt]] + [None] * (n - 1)
            events[pod].append(stored(hashes, parent, ids, BS, medium, lora, extra))
            builders[pod].stored(hashes, parent, ids, BS, medium, lora, salt)
            mine.extend(hashes)
            held.append((lora, salt, ids))
        elif kind == "remove" and mine:
            h = mine.pop()
            events[pod].append(removed([h], medium))
            builders[pod].removed([h], medium)
        elif kind == "clear":
            events[pod].append(cleared())
            builders[pod].cleared()
            for key in [k for k in chains if k[0] == pod]:
                chains[key] = []
        if i % per_batch == per_batch - 1:
            send(pod)
            send(1 - pod)
    send(0)
    send(1)
    return wire, built, held


@settings(max_examples=150, deadline=None)
@given(script=steps, per_batch=st.integers(1, 6))
def test_a_built_batch_has_the_effects_of_its_msgpack(script: list[Step], per_batch: int) -> None:
    wire, built, held = replay_both(script, per_batch)
    a, b = wire.index.stats(), built.index.stats()
    assert (a.entries, a.orphans, a.engine_blocks) == (b.entries, b.orphans, b.engine_blocks)
    for pod in PODS:
        assert wire.index.pod_counts(pod) == built.index.pod_counts(pod)
        assert (
            wire.counters[pod].events == built.counters[pod].events
            if pod in wire.counters
            else pod not in built.counters
        )
    for lora, salt, ids in held:
        keys = block_keys(ids, BS, root_key(lora or "m", salt))
        assert wire.index.lookup(keys, list(PODS)) == built.index.lookup(keys, list(PODS))


def test_a_store_is_indexed_under_its_adapter_and_salt() -> None:
    ing = make()
    b = BatchBuilder()
    ids = list(range(2 * BS))
    b.stored([11, 12], None, ids, BS, "GPU", "sql", "tenant")
    b.stored([13], 12, list(range(2 * BS, 3 * BS)), BS, "GPU", "sql", "ignored: not a chain's first block")
    b.removed([13], "GPU")
    batch = b.take(2.0, dp_rank=1)
    # (the salt keys a chain's first block only, so the second store starts a run of its own, as decoded)
    assert (batch.ts, batch.data_parallel_rank, batch.events, len(batch.runs)) == (2.0, 1, 3, 3)
    assert len(b) == 0 and b.take(3.0).runs == []  # it starts empty again
    assert ing.on_live(PODS[0], 0, 0, batch, 2.0) == Applied(3)
    keys = block_keys(ids, BS, root_key("sql", "tenant"))
    assert ing.index.lookup(keys, [PODS[0]])[PODS[0]]["gpu"] == 2
    assert ing.index.lookup(block_keys(ids, BS, root_key("sql")), [PODS[0]])[PODS[0]].get("gpu", 0) == 0


def test_bad_stores_are_refused_and_the_batch_keeps_what_it_had() -> None:
    b = BatchBuilder()
    b.stored([1], None, list(range(BS)), BS, "GPU")
    with pytest.raises(ValueError, match="token ids do not fit"):
        b.stored([2], 1, list(range(BS + 1)), BS, "GPU")
    with pytest.raises(ValueError, match="token ids do not fit"):
        b.stored([], 1, [], BS, "GPU")
    b.removed([], "GPU")  # nothing to remove: no event
    assert len(b) == 1 and decode(b.take(1.0)).events == 1


def test_a_decoded_batch_is_held_during_a_replay_and_applied_after_it() -> None:
    ing = make(replay=True)
    later = BatchBuilder()
    later.stored([2], 1, list(range(BS, 2 * BS)), BS, "GPU")
    batch1 = later.take(1.0)
    assert held_size(batch1) == 64
    # first heard from at seq 1: replayed from 0, the live batch held meanwhile
    assert ing.on_live(PODS[0], 0, 1, batch1, 1.0) == NeedReplay(PODS[0], 0, 0)
    payload0 = encode_batch([stored([1], None, list(range(BS)))], None, 1.0)
    assert ing.on_replayed(PODS[0], 0, 0, payload0, 1.0) == Applied(1)
    assert ing.replay_ended(PODS[0], 0, 1.0) is None
    assert ing.replay_finished(PODS[0], 0, 1.0, complete=True) == 1
    assert ing.index.pod_counts(PODS[0]) == {"gpu": 2}


def test_an_event_sink_takes_exactly_one_callback() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        EventSink(None, BS)
    with pytest.raises(ValueError, match="exactly one"):
        EventSink(lambda *a: None, BS, on_batches=lambda *a: None)
    got: list[tuple[int, ScannedBatch, float]] = []
    sink = EventSink(None, BS, on_batches=lambda seq, batch, at: got.append((seq, batch, at)))
    sink.flush(1.0)  # nothing to send
    sink.stored([5], None, list(range(BS)), "GPU", None, None)
    sink.removed([5], "GPU")
    sink.flush(2.0)
    assert [(seq, batch.events, at) for seq, batch, at in got] == [(0, 2, 2.0)] and sink.published == 2
