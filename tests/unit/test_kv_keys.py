"""Our block keys: deterministic, chained from a root that carries model / adapter / salt, vectorised."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.kvindex.block_chain import chain_blocks
from epp.kvindex.keys import (
    MULT,
    TOKEN_SEED,
    advance,
    block_keys,
    chain,
    fmix,
    fmix_inv,
    key_of,
    root_key,
    state_of,
)

M64 = (1 << 64) - 1


def reference_keys(tokens: list[int], block_size: int, parent: int) -> list[int]:
    """The definition, token by token, in plain Python ints (independent of keys.py's helpers)."""

    def mix(x: int) -> int:
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & M64
        x ^= x >> 33
        x = (x * 0xC4CEB9FE1A85EC53) & M64
        return x ^ (x >> 33)

    def unmix(x: int) -> int:
        x ^= x >> 33  # x ^= x >> 33 undoes itself (33 >= 32)
        x = (x * pow(0xC4CEB9FE1A85EC53, -1, 1 << 64)) & M64
        x ^= x >> 33
        x = (x * pow(0xFF51AFD7ED558CCD, -1, 1 << 64)) & M64
        return x ^ (x >> 33)

    state = unmix(parent)
    assert mix(state) == parent & M64
    out = []
    for i, t in enumerate(tokens[: len(tokens) // block_size * block_size]):
        state = (state * 0x9E3779B97F4A7C15 + mix((t + 0x632BE59BD9B4E019) & M64)) & M64
        if (i + 1) % block_size == 0:
            out.append(mix(state))
    return out


def test_constants_match_the_reference() -> None:
    assert MULT == 0x9E3779B97F4A7C15
    assert TOKEN_SEED == 0x632BE59BD9B4E019


@given(st.integers(0, M64))
def test_fmix_is_a_bijection_with_its_inverse(x: int) -> None:
    assert fmix_inv(fmix(x)) == x
    assert fmix(fmix_inv(x)) == x
    assert key_of(state_of(x)) == x


def test_root_key_depends_on_model_and_salt() -> None:
    keys = {
        root_key("llama"),
        root_key("llama", "tenant-a"),
        root_key("llama", "tenant-b"),
        root_key("llama-lora-sql"),
        root_key("llama-lora-sql", "tenant-a"),
        root_key("llam", "atenant-a"),  # no ambiguity between model and salt
    }
    assert len(keys) == 6
    assert all(0 <= k <= M64 for k in keys)


def test_root_key_salt_forms() -> None:
    assert root_key("m", "s") == root_key("m", b"s")
    assert root_key("m", None) == root_key("m", "") == root_key("m", b"") == root_key("m")


def test_root_key_is_stable_across_processes() -> None:
    code = (
        "from epp.kvindex.keys import root_key, block_keys\n"
        "print(root_key('m', 's'), block_keys(list(range(40)), 16, root_key('m')).tolist())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    assert outs.pop() == f"{root_key('m', 's')} {block_keys(list(range(40)), 16, root_key('m')).tolist()}\n"


def test_keys_are_pinned() -> None:
    # Changing the key function silently would invalidate nothing in a running router, but it would
    # break the promise that keys are stable across versions run side by side (e.g. simulator traces).
    ks = block_keys(list(range(32)), 16, 0).tolist()
    assert ks == [5554177878826166183, 10372201103109559622]
    assert root_key("llama", "tenant") == 15061082100770676815
    assert ks == reference_keys(list(range(32)), 16, 0)
    assert ks == [chain(0, range(16)), chain(ks[0], range(16, 32))]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 300_000), max_size=200),
    st.integers(1, 40),
    st.integers(0, M64),
)
def test_compiled_keys_equal_the_reference(tokens: list[int], block_size: int, parent: int) -> None:
    got = block_keys(tokens, block_size, parent)
    assert got.dtype == np.uint64
    assert got.tolist() == reference_keys(tokens, block_size, parent)
    assert block_keys(np.array(tokens, dtype=np.int32), block_size, parent).tolist() == got.tolist()
    assert block_keys(tuple(tokens), block_size, parent).tolist() == got.tolist()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-(2**40), 2**40), max_size=64), st.integers(1, 8))
def test_large_and_negative_ids_match_the_reference(tokens: list[int], block_size: int) -> None:
    assert block_keys(tokens, block_size, 7).tolist() == reference_keys(tokens, block_size, 7)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=64), st.integers(1, 8))
def test_every_integer_dtype_gives_the_reference_keys(tokens: list[int], block_size: int) -> None:
    """The compiled chain is specialised per dtype: each must take ids modulo 2^64 as the definition does
    (a negative int32 id is the same id as the int64 one; uint64 ids reach 2^64 - 1)."""
    want = reference_keys(tokens, block_size, 7)
    for dtype in (np.int32, np.int64):
        assert block_keys(np.array(tokens, dtype=dtype), block_size, 7).tolist() == want
    wrapped = [t % 2**64 for t in tokens]
    assert block_keys(np.array(wrapped, dtype=np.uint64), block_size, 7).tolist() == want
    small = [t % 2**32 for t in tokens]
    assert block_keys(np.array(small, dtype=np.uint32), block_size, 7).tolist() == reference_keys(
        small, block_size, 7
    )


def test_partial_block_is_ignored() -> None:
    tokens = list(range(100))
    assert len(block_keys(tokens, 16, 1)) == 6
    assert block_keys(tokens, 16, 1).tolist() == block_keys(tokens[:96], 16, 1).tolist()
    assert len(block_keys(tokens[:15], 16, 1)) == 0
    assert len(block_keys([], 16, 1)) == 0


def test_equal_prefixes_give_equal_keys_and_divergence_changes_the_rest() -> None:
    a = list(range(64))
    b = [*range(40), 999, *range(41, 64)]
    ka, kb = block_keys(a, 16, 5).tolist(), block_keys(b, 16, 5).tolist()
    assert ka[:2] == kb[:2]
    assert ka[2] != kb[2] and ka[3] != kb[3]  # chained: a change affects every later block


def test_keys_depend_on_parent_root_order_and_block_size() -> None:
    tokens = list(range(64))
    base = block_keys(tokens, 16, root_key("m")).tolist()
    assert block_keys(tokens, 16, root_key("m", "salt")).tolist() != base
    assert block_keys(tokens, 16, root_key("other")).tolist() != base
    assert len(set(base) & set(block_keys(tokens, 16, root_key("other")).tolist())) == 0
    swapped = [*range(16, 32), *range(16), *range(32, 64)]
    assert block_keys(swapped, 16, root_key("m")).tolist()[1:] != base[1:]
    assert block_keys([1, 0, *range(2, 16)], 16, 0).tolist() != block_keys(list(range(16)), 16, 0).tolist()


def test_a_key_names_a_token_prefix_whatever_the_block_size() -> None:
    tokens = list(range(64))
    by16 = block_keys(tokens, 16, 0).tolist()
    by8 = block_keys(tokens, 8, 0).tolist()
    assert by8[1::2] == by16  # the same prefix (tokens[:16k]) has the same key
    assert not set(by8[0::2]) & set(by16)


def test_chaining_continues_from_any_key() -> None:
    tokens = list(range(200))
    full = block_keys(tokens, 16, 3).tolist()
    tail = block_keys(tokens[64:], 16, full[3]).tolist()
    assert tail == full[4:]
    assert chain(full[3], tokens[64:80]) == full[4]


def test_keys_do_not_depend_on_how_tokens_were_grouped() -> None:
    # The chain state is per token, so feeding 1, 5 or 64 tokens at a time gives the same states.
    tokens = list(range(1000, 1128))
    state = state_of(9)
    for i in range(0, 128, 5):
        state = advance(state, tokens[i : i + 5])
    assert key_of(state) == block_keys(tokens, 128, 9).tolist()[0]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        block_keys([1, 2], 0, 0)
    with pytest.raises(TypeError):
        block_keys(np.array([1.5, 2.0]), 1, 0)


@st.composite
def stored_batches(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int, int, int, int]], list[int]]:
    """(index block size, events (n, ntok, ebs, npend0, pref, s0), tokens): chained like a flush's."""
    bs = draw(st.integers(1, 16))
    events, tokens, blocks = [], [], 0
    for _ in range(draw(st.integers(1, 6))):
        n, ebs = draw(st.integers(1, 4)), draw(st.integers(1, 40))
        ntok = draw(st.integers((n - 1) * ebs + 1, n * ebs))
        pref = draw(st.integers(-1, blocks - 1)) if blocks else -1
        events.append((n, ntok, ebs, draw(st.integers(0, bs - 1)), pref, draw(st.integers(0, 2**64 - 1))))
        tokens += draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=ntok, max_size=ntok))
        blocks += n
    return bs, events, tokens


@settings(max_examples=300, deadline=None)
@given(stored_batches())
def test_the_compiled_chain_of_stored_blocks_follows_the_definition(
    batch: tuple[int, list[tuple[int, int, int, int, int, int]], list[int]],
) -> None:
    bs, events, tokens = batch
    cols = [np.array([e[i] for e in events], dtype=np.intp) for i in range(5)]
    nblocks = int(cols[0].sum())
    out = [np.empty(nblocks, dtype=np.uint64), *(np.empty(nblocks, dtype=np.intp) for _ in range(3))]
    extra = np.empty(len(tokens) // bs + nblocks, dtype=np.uint64)
    s0 = np.array([e[5] for e in events], dtype=np.uint64)
    count = chain_blocks(*cols, s0, np.array(tokens, dtype=np.int64), bs, *out, extra)
    want_state, want_keys, want_pend, want_extra = [], [], [], []
    t = 0
    for n, ntok, ebs, pend, pref, s in events:
        state = want_state[pref] if pref >= 0 else s
        for j in range(n):
            keys = []
            for tok in tokens[t : t + (ntok - j * ebs if j == n - 1 else ebs)]:
                state = advance(state, [tok])
                pend = (pend + 1) % bs
                if pend == 0:
                    keys.append(key_of(state))
            t += ntok - j * ebs if j == n - 1 else ebs
            implicit = pend == 0 and keys
            want_state.append(state)
            want_keys.append(len(keys))
            want_pend.append(pend)
            want_extra.append(keys[:-1] if implicit else keys)
    assert out[0].tolist() == want_state
    assert out[1].tolist() == want_keys and out[2].tolist() == want_pend
    assert out[3].tolist() == [len(k) for k in want_extra]
    assert extra[:count].tolist() == [k for ks in want_extra for k in ks]
