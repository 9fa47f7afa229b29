"""Every compiled loop of the index and the cost model, with the argument types serving gives them. Pure.

numba compiles a loop at its first call for each distinct set of argument types (or loads that machine
code from its cache, `NUMBA_CACHE_DIR`). The modules' own warm-ups call each loop with small arrays
they make, which is not always what serving passes: a read-only array over a message's bytes, an
int64 scalar where they passed a Python int. Four loops (`chain_blocks`, `block_rows`, `find_scalar`,
`split_run`) used to compile with the first KV events a new pod applied, on the event loop (~1 s).

`warm_up()` runs the modules' warm-ups, then a small index through the paths serving takes: KV-event
batches of both encodings, large enough for the compiled scan and small enough for msgspec, stores on
three tiers and under a LoRA adapter, removals, a clear, table growth, eviction at the bound, every
lookup, a prompt's keys from each token type, and the TTFT estimate. `epp serve` calls it before
anything listens, and `epp warm-up` to fill a cache that an image carries (docs/deployment.md).
`tests/integration/test_compiled_cache.py` runs a wider workload after it and checks that nothing
compiles.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from epp.costmodel import estimate
from epp.kvindex import (
    block_chain,
    cuckoo,
    event_scan,
    ownership,
    prefix_walk,
    queue_loop,
    removal_loop,
    rolling,
    store_loop,
)
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.ingest import KvIngest
from epp.kvindex.keys import block_keys, root_key
from epp.testing.kv_wire import Form, cleared, encode_batch, removed, stored

TIERS: Final = ("GPU", "CPU", "DISK")
WARM_TIERS: Final = 4
"""Tiers the ownership loops are compiled for: gpu, cpu, storage and one more (a medium no known tier
takes is a tier of its own). An index that meets a fifth compiles them again then (~4 s)."""
_BLOCK: Final = 16
_PODS: Final = ("warm-up-a:8000", "warm-up-b:8000")


def warm_up() -> None:
    """Compile (or load from numba's cache) every loop for the argument types serving gives them."""
    prefix_walk.warm_up()
    estimate.warm_up()
    cuckoo.warm_up()
    block_chain.warm_up()
    rolling.warm_up()
    event_scan.warm_up()
    queue_loop.warm_up()
    for ntiers in range(1, WARM_TIERS + 1):  # a new number of tiers compiles its own code
        ownership.warm_up(ntiers)
        removal_loop.warm_up(ntiers)
        store_loop.warm_up(ntiers)
    for form in ("map", "array"):
        for ntiers in (1, 2, 3):
            _exercise(form, ntiers)


def _exercise(form: Form, ntiers: int) -> None:
    """An index fed through `KvIngest` as from engines, until its tables grow and it evicts; then read."""
    index = BlockIndex(block_size=_BLOCK, max_entries=500, evict_headroom=32)
    ingest = KvIngest(index, FreshnessTracker(), lambda pod: "warm-up-model")
    seq = 0
    for pod in _PODS:
        parent: int | None = None
        for batch in range(12):
            events = []
            base = (batch + 1) * 1_000 + (7_000_000 if pod == _PODS[1] else 0)
            for e in range(8):  # a chain of 8 events of 4 blocks: the scan's size of message
                hashes = [base + e * 4 + j for j in range(4)]
                tokens = [(h * 31 + t) % 50_000 for h in hashes for t in range(_BLOCK)]
                medium = TIERS[e % ntiers]
                lora = "warm-up-adapter" if batch % 4 == 3 else None
                events.append(stored(hashes, parent, tokens, _BLOCK, medium, lora, form=form))
                parent = hashes[-1]
            if batch >= 2:  # blocks of two batches before, on the tier they were stored on
                old = (batch - 1) * 1_000 + (7_000_000 if pod == _PODS[1] else 0)
                events.append(removed([old, old + 1], TIERS[0], form=form))
            ingest.on_live(pod, 0, seq, encode_batch(events, None, 1.0), 1.0)
            seq += 1
        small = [stored([base + 999], parent, list(range(_BLOCK)), _BLOCK, TIERS[0], form=form)]
        ingest.on_live(pod, 0, seq, encode_batch(small, None, 1.0), 1.0)  # msgspec's size
        seq += 1
    root = root_key("warm-up-model", None)
    prompt = np.arange(8 * _BLOCK, dtype=np.int64)
    for dtype in (np.int64, np.int32, np.uint32, np.uint64):
        block_keys(prompt.astype(dtype), _BLOCK, root)
    keys = block_keys(list(range(8 * _BLOCK)), _BLOCK, root)
    pods = [*_PODS, "warm-up-unknown:8000"]
    index.lookup(keys, pods)
    index.lookup_weighted(keys, pods, {"gpu": 1.0, "cpu": 0.8})
    index.lookup_by_best_tier(keys, pods, lambda tier: {"gpu": 1.0, "cpu": 0.8}.get(tier, 0.5))
    index.lookup_tier_runs(keys, pods, ["gpu", "cpu", "storage"])
    index.pod_counts(_PODS[0])
    ingest.on_live(_PODS[0], 0, seq, encode_batch([cleared(form)], None, 1.0), 1.0)
    index.clear_pod(_PODS[1])
    index.stats()
