"""The store queue's compiled bookkeeping (`queue_loop.py`): its table against a dict, and runs through
`store_run` (the compiled loop stopping and going on: orphans, malformed events, discards, flushes in the
middle of a run) against the same events through `store` and `discard` one by one."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epp.kvindex import queue_loop, store_queue
from epp.kvindex.event_scan import scan_batch
from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import block_keys
from epp.testing.kv_wire import cleared, encode_batch, removed, stored
from tests.unit.test_kv_index import BS, ROOT, engine_hash


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "find", "flush", "grow"]), st.integers(0, 40), st.integers(0, 3)),
        max_size=200,
    )
)
def test_the_table_is_a_dict_emptied_by_each_epoch(ops: list[tuple[str, int, int]]) -> None:
    table = store_queue.new_table(16)
    epoch = 0
    model: dict[tuple[int, int], int] = {}
    for i, (op, key, tag) in enumerate(ops):
        key = key * 0x9E3779B97F4A7C15 % (1 << 64) if key % 2 else key  # small keys and wide ones
        if op == "put" and len(model) < 8:  # (the queue keeps the table at most half full)
            assert queue_loop.qt_put(table, epoch, np.uint64(key), tag, i) == ((key, tag) in model)
            model[(key, tag)] = i
        elif op == "find":
            assert queue_loop.qt_find(table, epoch, np.uint64(key), tag) == model.get((key, tag), -1)
        elif op == "flush":
            epoch += 1
            model.clear()
        elif op == "grow":
            new = store_queue.new_table(2 * table.shape[0])
            queue_loop.rehash(table, new, epoch)
            table = new
    for (key, tag), value in model.items():
        assert queue_loop.qt_find(table, epoch, np.uint64(key), tag) == value


def _chain(pod: int, n: int, seed: int, ebs: int) -> list[tuple[list[int], int | None, list[int]]]:
    """Events of one block each (tokens per block `ebs`), chained from the root."""
    events = []
    parent: int | None = None
    for i in range(n):
        tokens = [(seed * 7 + i * 3 + t) % 11 for t in range(ebs)]
        h = engine_hash(parent, tokens, ROOT + pod)
        events.append(([h], parent, tokens))
        parent = h
    return events


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@pytest.mark.parametrize("flush_blocks", [4096, 3])
@pytest.mark.parametrize("max_entries", [10**9, 24])
@given(data=st.data())
def test_runs_stopped_in_the_middle_leave_the_index_as_store_does(
    monkeypatch: pytest.MonkeyPatch, flush_blocks: int, max_entries: int, data: st.DataObject
) -> None:
    """Runs of stores (with orphans, malformed events, blocks again, parents with a queued discard) and
    discards through `store_run` with the hashes' array (the scan's form) and through `store` and `discard`
    one by one: the same orphan counts, stats, counts and lookups."""
    monkeypatch.setattr(store_queue, "FLUSH_BLOCKS", flush_blocks)
    one = BlockIndex(BS, max_entries=max_entries, evict_headroom=0)
    run = BlockIndex(BS, max_entries=max_entries, evict_headroom=0)
    chains = {s: _chain(s, 12, s, data.draw(st.sampled_from([BS, 2 * BS]))) for s in range(3)}
    stored: list[int] = []
    for _ in range(data.draw(st.integers(1, 12))):
        if stored and data.draw(st.integers(0, 3)) == 0:
            gone = data.draw(st.lists(st.sampled_from(stored), min_size=1, max_size=3))
            one.discard("p", gone, "gpu")
            run.discard("p", gone, "gpu")
            continue
        events: list[Any] = []
        for _ in range(data.draw(st.integers(2, 6))):
            s = data.draw(st.integers(0, 2))
            k = data.draw(st.integers(0, 11))
            hashes, parent, tokens = chains[s][k]
            kind = data.draw(st.integers(0, 9))
            if kind == 0:
                parent = 999  # an orphan
            elif kind == 1:
                tokens = tokens[:1] + tokens  # malformed: too many tokens
            events.append((hashes, parent, tokens, len(tokens) if kind != 1 else len(tokens) - 1))
        orphans = sum(one.store("p", h, p, t, ebs, "gpu", ROOT).orphan for h, p, t, ebs in events)
        hashes = [h for e in events for h in e[0]]
        got = run.store_run(
            "p", "gpu", ROOT, hashes, [e[1] for e in events], [len(e[0]) for e in events],
            np.array([t for e in events for t in e[2]], dtype=np.int64), [len(e[2]) for e in events],
            [e[3] for e in events], np.array(hashes, dtype=np.uint64),
        )  # fmt: skip
        assert got == orphans
        stored.extend(hashes)
    assert one.stats() == run.stats()
    assert one.pod_counts("p") == run.pod_counts("p")
    for chain in chains.values():
        for k in range(1, 13):
            tokens = [t for _, _, ts in chain[:k] for t in ts]
            keys = block_keys(tokens, BS, ROOT)
            assert one.lookup(keys, ["p"]) == run.lookup(keys, ["p"])


@pytest.mark.parametrize("form", ["map", "array"])
def test_the_scans_arrays_are_its_runs_columns(form: Any) -> None:
    """`ScannedBatch.arrays`: per StoredRun its events' rows (has a parent, hashes, tokens, engine block
    size) and parents, per RemovedRun its hashes: the values of the run's lists."""
    tokens = list(range(64))
    events = [
        stored([11, 12], None, tokens[:32], 16, "GPU", form=form),
        stored([13], 12, tokens[32:44], 16, "GPU", form=form),
        stored([(1 << 64) - 5, 15], 13, tokens[:32], 16, "GPU", form=form),
        removed([11, (1 << 63) + 1], "GPU", form=form),
        cleared(form),
    ]
    batch = scan_batch(encode_batch(events, None, 1.0))
    assert batch is not None and len(batch.arrays) == len(batch.runs) == 3
    run, removed_run = batch.runs[0], batch.runs[1]
    rows, parents = batch.arrays[0]  # type: ignore[misc]
    parents_, per_event, per_tokens, sizes = run[5], run[6], run[8], run[9]  # type: ignore[misc]
    want = zip(parents_, per_event, per_tokens, sizes, strict=True)
    assert rows.tolist() == [[int(p is not None), n, t, b] for p, n, t, b in want]
    assert [int(x) if p is not None else None for x, p in zip(parents, run[5], strict=True)] == run[5]  # type: ignore[misc]
    assert batch.arrays[1].tolist() == removed_run[2]  # type: ignore[union-attr,misc]
    assert batch.arrays[2] is None


@pytest.mark.parametrize("removal", [False, True])
def test_a_queued_removal_of_another_block_does_not_change_where_a_chain_starts(removal: bool) -> None:
    """A hash held with one chain and queued again with another (an engine that reuses a hash): its child
    chains from the queued copy, whether or not the pod has a queued removal of an unrelated block in
    between (which once flushed the queue first: then the held copy's chain, kept, was taken)."""
    index = BlockIndex(BS)
    a, b, z, child = list(range(16)), list(range(100, 132)), list(range(200, 216)), list(range(300, 316))
    index.store("p", [1], None, a, BS, "gpu", ROOT)
    index.store("p", [9], None, z, BS, "gpu", ROOT)
    index.flush()
    index.store("p", [2, 1], None, b, BS, "gpu", ROOT)  # hash 1 again, after another block
    if removal:
        assert index.remove("p", [9], "gpu") == 1  # (queued)
    index.store("p", [3], 1, child, BS, "gpu", ROOT)
    assert index.lookup(block_keys(b + child, BS, ROOT)[2:], ["p"])["p"]["any"] == 1
    assert index.lookup(block_keys(a + child, BS, ROOT)[1:], ["p"])["p"]["any"] == 0
