"""Speculative prefix entries (llm-d's speculative indexing): a routed prompt's blocks count for the
chosen pod until they expire, prefixes are found by a binary search, and the memory stays bounded."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.kvindex.speculative import SpeculativeBlocks


def chain(prefix: int, n: int, tag: object = None) -> list[int]:
    """Chained keys of an n-block prompt whose first `prefix` blocks are shared by every prompt and whose
    other blocks are its own (`tag`): key i stands for blocks 0..i, as the index's keys do."""
    keys, h = [], 0
    for i in range(n):
        h = hash((h, "shared" if i < prefix else (tag, n))) & (2**63 - 1)
        keys.append(h)
    return keys


def test_a_routed_prompt_counts_for_its_pod_until_the_ttl() -> None:
    s = SpeculativeBlocks(2.0)
    s.add("a", np.array(chain(10, 10), dtype=np.uint64), now=1.0)
    same = chain(10, 10)
    longer = chain(10, 30)  # the same first 10 blocks, then more
    other = chain(4, 12)  # shares 4 blocks
    assert s.prefix(same, ["a", "b"], now=2.9) == {"a": 10}
    assert s.prefix(longer, ["a"], now=2.9) == {"a": 10}
    assert s.prefix(other, ["a"], now=2.9) == {"a": 4}
    assert s.prefix(same, ["a"], now=3.0) == {}  # expired at 1 + 2
    assert s.prefix([], ["a"], now=1.5) == {}


def test_a_later_add_refreshes_the_blocks_it_shares_and_expired_entries_go_in_bulk() -> None:
    s = SpeculativeBlocks(2.0)
    s.add("a", chain(10, 10), now=0.0)
    s.add("a", chain(4, 8), now=1.5)  # shares the first 4 blocks, refreshed until 3.5
    assert s.prefix(chain(10, 10), ["a"], now=2.5) == {"a": 4}
    s.add("b", chain(0, 1), now=2.5)  # a new generation: a's entries are now the previous one
    assert s.prefix(chain(10, 10), ["a"], now=2.5) == {"a": 4}
    assert s.prefix(chain(4, 8), ["a"], now=3.4) == {"a": 8}
    assert s.size() == 14 + 1
    s.add("b", chain(0, 1), now=4.5)  # another: a's generation (all expired by 3.5) is dropped whole
    assert s.size() == 1 + 1 and s.prefix(chain(4, 8), ["a"], now=4.5) == {}
    s.add("c", chain(0, 3), now=20.0)  # long after: both generations expired, both dropped
    assert s.size() == 3 and s.prefix(chain(0, 1), ["b"], now=20.0) == {}


def test_entries_are_bounded_oldest_first() -> None:
    s = SpeculativeBlocks(10.0, max_entries=25)
    s.add("a", chain(0, 10), now=0.0)
    s.add("b", chain(0, 11), now=0.1)
    assert s.size() == 21
    s.add("c", chain(0, 12), now=0.2)  # 33 > 25: the generation holding a and b goes early
    assert s.size() == 12
    assert s.prefix(chain(0, 10), ["a"], now=0.3) == {}
    assert s.prefix(chain(0, 12), ["c"], now=0.3) == {"c": 12}
    s.add("d", chain(0, 13), now=0.4)  # 25: fits
    assert s.size() == 25 and s.prefix(chain(0, 12), ["c"], now=0.4) == {"c": 12}
    s.add("e", chain(0, 40), now=0.5)  # longer than the bound on its own: its first 25 blocks
    assert s.size() == 25 and s.prefix(chain(0, 40), ["e"], now=0.5) == {"e": 25}


@pytest.mark.parametrize(("ttl", "cap"), [(0.0, 10), (-1.0, 10), (1.0, 0)])
def test_bad_settings_are_clear_errors(ttl: float, cap: int) -> None:
    with pytest.raises(ValueError, match=r"TTL|max_entries"):
        SpeculativeBlocks(ttl, cap)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("ab"), st.integers(0, 12), st.integers(1, 16), st.floats(0, 0.5)),
        max_size=25,
    ),
    st.integers(0, 12),
    st.integers(1, 16),
)
def test_the_binary_search_agrees_with_a_walk_over_unexpired_adds(
    adds: list[tuple[str, int, int, float]], shared: int, n: int
) -> None:
    """Against a model that keeps every add: a pod holds key i while some unexpired add of it has key i;
    its prefix is the walk from block 0 while it holds each key."""
    s = SpeculativeBlocks(1.0)
    now = 0.0
    log: list[tuple[float, str, set[int]]] = []
    for i, (pod, prefix, length, dt) in enumerate(adds):
        now += dt
        keys = chain(prefix, length, i)
        s.add(pod, keys, now)
        log.append((now + 1.0, pod, set(keys)))
    query = chain(shared, n, "query") if n > shared else chain(shared, n)
    for pod in "ab":
        alive = set().union(*[k for e, p, k in log if p == pod and e > now])
        expected = next((i for i, k in enumerate(query) if k not in alive), len(query))
        assert s.prefix(query, [pod], now).get(pod, 0) == expected
