"""The cache prefetch hint of the compiled table loops (`epp/kvindex/prefetch.py`)."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import pytest

from epp.kvindex import cuckoo
from epp.kvindex.prefetch import AHEAD, prefetch


@numba.njit
def _sum_prefetching(a: Any, order: Any) -> Any:  # pragma: no cover - compiled
    total = a[0] * 0
    n = order.shape[0]
    for i in range(n):
        if i + AHEAD < n:
            prefetch(a, order[i + AHEAD])
        total += a[order[i]]
    return total


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint64, np.float64])
def test_prefetch_leaves_every_result_as_it_is(dtype: type[np.generic]) -> None:
    rng = np.random.default_rng(3)
    a = rng.integers(0, 100, 10_000).astype(dtype)
    order = rng.permutation(len(a))
    assert _sum_prefetching(a, order) == a.sum()
    assert _sum_prefetching(a[:3], order[:3] % 3) == a[:3][order[:3] % 3].sum()  # shorter than AHEAD


def test_prefetch_of_something_other_than_an_array_is_a_typing_error() -> None:
    @numba.njit
    def bad(x: Any) -> None:  # pragma: no cover - compiled
        prefetch(x, 0)

    with pytest.raises(numba.core.errors.TypingError, match="prefetch"):
        bad(3)


def test_find_run_with_prefetch_agrees_with_one_probe_at_a_time() -> None:
    """The batched probe prefetches the buckets of the item AHEAD places on; what it finds is exactly what
    probing each item alone finds, for batches longer and shorter than that distance."""
    rng = np.random.default_rng(5)
    nb = 64
    tkeys = np.zeros(nb * cuckoo.BUCKET, dtype=np.uint64)
    ttags = np.full(nb * cuckoo.BUCKET, 0xFFFF, dtype=np.uint16)
    count = np.zeros(nb, dtype=np.uint8)
    keys = rng.integers(0, 2**63, 300, dtype=np.uint64)
    tags = rng.integers(0, 4, 300).astype(np.uint16)
    slots = np.full(300, -1, dtype=np.intp)
    new = np.zeros(300, dtype=bool)
    stuck = np.empty(300, dtype=np.intp)
    cuckoo.upsert_run(tkeys, ttags, count, nb, keys, tags, 0, 10**6, slots, new, stuck, 0)
    probe = np.concatenate([keys[::2], rng.integers(0, 2**63, 50, dtype=np.uint64)])
    probe_tags = np.concatenate([tags[::2], np.zeros(50, dtype=np.uint16)])
    for n in (len(probe), 3):
        out = np.empty(n, dtype=np.intp)
        cuckoo.find_run(tkeys, ttags, count, nb, probe[:n], probe_tags[:n], out)
        one = [int(cuckoo.find_one(tkeys, ttags, count, nb, probe[i], probe_tags[i])[0]) for i in range(n)]
        assert out.tolist() == one
        held = slots[::2][: min(n, 150)]  # where the insert put them (-1: set aside, not inserted)
        assert out[: len(held)].tolist() == held.tolist()
        assert (out[150:] == -1).all()
