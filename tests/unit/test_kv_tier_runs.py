"""`BlockIndex.lookup_tier_runs` (what the TTFT estimate reads) and the compiled walk under it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.kvindex.holdings import CHUNK_BITS
from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import block_keys, root_key
from epp.kvindex.prefix_walk import walk_runs

BS = 16
ROOT = root_key("model")
N_BLOCKS = 40
TOKENS = list(range(5000, 5000 + N_BLOCKS * BS))
KEYS = block_keys(TOKENS, BS, ROOT)
ORDER = ["gpu", "cpu", "storage"]


def naive_runs(masks: np.ndarray) -> np.ndarray:
    flat = masks.reshape(-1, masks.shape[-1])
    out = np.zeros((len(flat), 32), dtype=np.int64)
    for r, row in enumerate(flat.tolist()):
        for bit in range(32):
            n = 0
            while n < len(row) and row[n] >> bit & 1:
                n += 1
            out[r, bit] = n
    return out.reshape(*masks.shape[:-1], 32)


def chain_index(layout: dict[str, dict[str, set[int]]], fillers: int = 0) -> BlockIndex:
    """`fillers` pods holding something else take the first pod ids (so the layout's pods may spread over
    two 32-pod chunks); every layout pod stores the whole chain on a hidden tier (so any block's parent
    is known), then the blocks of `layout` on their tiers."""
    index = BlockIndex(BS)
    for i in range(fillers):
        index.store(f"filler-{i}", [10_000 + i], None, list(range(BS)), BS, "gpu", root_key("other"))
    for pod, tiers in layout.items():
        index.store(pod, list(range(N_BLOCKS)), None, TOKENS, BS, "hidden", ROOT)
        for tier, blocks in tiers.items():
            for b in sorted(blocks):
                index.store(
                    pod, [b], None if b == 0 else b - 1, TOKENS[b * BS : (b + 1) * BS], BS, tier, ROOT
                )
    return index


def expected(layout: dict[str, dict[str, set[int]]], pods: list[str]) -> np.ndarray:
    out = np.zeros((len(ORDER), len(pods)), dtype=np.int64)
    for i, pod in enumerate(pods):
        tiers = layout.get(pod, {})
        for k in range(len(ORDER)):
            held = set().union(*(tiers.get(t, set()) for t in ORDER[: k + 1]))
            n = 0
            while n in held:
                n += 1
            out[k, i] = n
    return out


def test_runs_follow_the_engines_use_of_tiers() -> None:
    layout = {
        "a": {"gpu": set(range(10)), "cpu": set(range(20))},  # GPU prefix 10, completed from CPU to 20
        "b": {"cpu": {0}, "gpu": set(range(1, 8))},  # block 0 only on CPU: no GPU prefix at all
        "c": {"storage": set(range(N_BLOCKS))},
        "d": {"gpu": {0, 1, 3}},  # a hole: the prefix ends at 2
    }
    index = chain_index(layout)
    pods = ["a", "b", "c", "d", "unknown"]
    got = index.lookup_tier_runs(KEYS, pods, ORDER)
    assert got.tolist() == [
        [10, 0, 0, 2, 0],
        [20, 8, 0, 2, 0],
        [20, 8, N_BLOCKS, 2, 0],
    ]
    assert np.array_equal(got, expected(layout, pods))
    # a tier outside `order` gives nothing (the hidden tier holds every block)
    assert index.lookup_tier_runs(KEYS, ["a"], ["gpu"]).tolist() == [[10]]
    assert index.lookup_tier_runs(KEYS[:0], ["a"], ORDER).tolist() == [[0], [0], [0]]


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([f"10.0.0.{i}:80" for i in range(40)]),  # two 32-pod chunks
        st.dictionaries(st.sampled_from(ORDER), st.sets(st.integers(0, N_BLOCKS - 1), max_size=N_BLOCKS)),
        max_size=6,
    ),
    st.lists(st.integers(1, 15), min_size=1, max_size=5),
)
def test_runs_match_a_per_block_model_across_chunks(
    layout: dict[str, dict[str, set[int]]], rows: list[int]
) -> None:
    index = chain_index(layout, fillers=29)  # pod ids 29.. : the layout's pods straddle two chunks
    pods = [*sorted(layout), "10.9.9.9:80"]
    got = index.lookup_tier_runs(KEYS, pods, ORDER)
    assert np.array_equal(got, expected(layout, pods))
    # The walk under it, for any union of tiers per row, against the vectorised masks counted bit by bit.
    h = index._h
    tiers = list(range(len(index._tier_names)))
    chunks = sorted({pid >> CHUNK_BITS for pid in index._pod_ids.values()})
    masks = h.masks(np.asarray(KEYS, dtype=np.uint64), chunks, tiers)
    unions = np.zeros((len(rows), *masks.shape[1:]), dtype=np.uint32)
    for i, r in enumerate(rows):  # row i: the OR of the tiers whose bits r sets
        for t in tiers:
            if r >> t & 1:
                unions[i] |= masks[t]
    cols = [h.blocks.cols[f"m{t}"] for t in tiers]
    assert np.array_equal(
        walk_runs(h.blocks, cols, rows, np.asarray(KEYS, dtype=np.uint64), chunks), naive_runs(unions)
    )
