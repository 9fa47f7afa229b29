"""The prefix cache's memory bound counts what its entries really hold (measured with tracemalloc).

The bound is on an estimate per entry; if the estimate undercounts, a "64 MiB" cache holds more than
64 MiB. tracemalloc sees every Python and numpy allocation (not malloc's own headers, so the real
footprint is a little higher still): the estimate must cover at least what it reports, and not be so
high that the cache keeps a small fraction of what its bound allows.
"""

from __future__ import annotations

import gc
import re
import tracemalloc
from collections.abc import Iterator

import pytest

from epp.kvindex.prefix_cache import Chunker, PrefixCache
from epp.testing.tokenizer import generated_text

_WORD = re.compile(r"\s*\S+")


def _encode(text: str) -> list[int]:
    """One id per word with its leading spaces: cutting before a space never changes the ids."""
    return [1000 + sum(map(ord, w)) % 50_000 for w in _WORD.findall(text)]


def _cache(chunk_chars: int, max_bytes: int) -> PrefixCache:
    return PrefixCache(
        _encode, lambda texts: [_encode(t) for t in texts], Chunker(chunk_chars), max_bytes=max_bytes
    )


def _texts(count: int, chars: int) -> Iterator[str]:
    for seed in range(count):
        yield f"doc {seed}: " + generated_text(chars, seed=seed + 1)


def _footprint(cache: PrefixCache, texts: list[str]) -> int:
    """Bytes tracemalloc sees held after the texts went through the cache (the ids it returned are
    dropped), less what is held once the cache is cleared again."""
    gc.collect()
    tracemalloc.start()
    try:
        for text in texts:
            cache.encode(text)
        gc.collect()
        filled = tracemalloc.get_traced_memory()[0]
        cache.clear()
        gc.collect()
        return filled - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(("chunk_chars", "text_chars"), [(1024, 6000), (64, 1500), (8, 400)])
def test_the_estimate_covers_what_the_entries_hold(chunk_chars: int, text_chars: int) -> None:
    texts = list(_texts(60, text_chars))
    # The stats a full cache reports (what the bound compares), from an identical twin: the measured
    # one is cleared to take its measure.
    twin = _cache(chunk_chars, max_bytes=1 << 40)  # no eviction: every chunk stays
    for text in texts:
        twin.encode(text)
    estimated, entries = twin.stats()["bytes"], twin.stats()["entries"]
    cache = _cache(chunk_chars, max_bytes=1 << 40)
    held = _footprint(cache, texts)
    assert entries > 100, entries  # the texts were cut and cached
    assert cache.stats()["entries"] == 0  # cleared: nothing else was measured as the cache's
    assert held <= estimated, (held, estimated, entries)
    assert held >= 0.6 * estimated, (held, estimated, entries)


def test_a_full_cache_holds_no_more_than_its_bound() -> None:
    bound = 512 * 1024
    cache = _cache(256, max_bytes=bound)
    texts = list(_texts(200, 3000))
    twin = _cache(256, max_bytes=bound)
    for text in texts:
        twin.encode(text)
    stats = twin.stats()
    assert stats["evictions"] > 0 and stats["bytes"] <= bound  # it filled and evicted
    held = _footprint(cache, texts)
    assert held <= bound, (held, bound, stats)
