"""The chain of a batch of stored engine blocks, compiled: each block's state, keys and leftover. Pure.

`Holdings.add` needs, for every engine block of a batch of BlockStored events, the chain state after its
last token, the index keys it completes and the tokens it leaves past the last index boundary; and, for
a block that completes several keys, the keys before its last one (its `extra` rows). `chain_blocks`
runs the definition of `keys.py` over the batch's tokens in one pass (S <- S * MULT + g(t), a key
fmix64(S) at every index boundary), an event starting from its parent block's state when the parent is
in the batch and from its given start state otherwise. The vectorised form of the same arithmetic (a
prefix sum of powers) took ~25 numpy calls per flush plus a Python loop over chained events.

Compiled with numba (`docs/architecture.md`, "Compiled loops").
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from epp.kvindex.rolling import MULT, TOKEN_SEED, fmix


@numba.njit(cache=True, nogil=True)
def chain_blocks(  # pragma: no cover - compiled
    n: Any,
    ntok: Any,
    ebs: Any,
    npend0: Any,
    pref: Any,
    s0: Any,
    tokens: Any,
    bs: int,
    state: Any,
    nkeys: Any,
    npend: Any,
    nextra: Any,
    extra: Any,
) -> int:
    """Per event e: n[e] engine blocks of ebs[e] tokens (the last one may be shorter) over ntok[e] tokens,
    npend0[e] tokens past an index boundary before them, starting from state[pref[e]] (a block of an
    earlier event) or s0[e]. Per block: state, nkeys (index keys it completes), npend (tokens past its
    last boundary), nextra (its keys before the last one, unless its last token ends a key: then all
    but that implicit one), those keys in order in `extra`. Returns how many `extra` holds."""
    mult = numba.uint64(MULT)
    seed = numba.uint64(TOKEN_SEED)
    k = 0
    t = 0
    x = 0
    for e in range(n.shape[0]):
        s = state[pref[e]] if pref[e] >= 0 else s0[e]
        pend: Any = np.int64(npend0[e])
        size = np.int64(ebs[e])
        nb = np.int64(n[e])
        for j in range(nb):
            end = np.int64(ntok[e]) if j == nb - 1 else (j + 1) * size
            first_extra = x
            count = 0
            for _ in range(j * size, end):
                s = s * mult + fmix(numba.uint64(tokens[t]) + seed)
                t += 1
                pend += 1
                if pend == bs:
                    pend = 0
                    count += 1
                    extra[x] = fmix(s)
                    x += 1
            if pend == 0 and count > 0:
                x -= 1  # the key its last token ends is implied by its state
            state[k] = s
            nkeys[k] = count
            npend[k] = pend
            nextra[k] = x - first_extra
            k += 1
    return x


@numba.njit(cache=True, nogil=True)
def block_rows(  # pragma: no cover - compiled
    n: Any,
    pid: Any,
    tid: Any,
    stamp: int,
    npend: Any,
    nkeys: Any,
    tags: Any,
    tiers: Any,
    stamps: Any,
    info: Any,
) -> None:
    """Per engine block of the batch (events of n[e] blocks, in order): its pod as the records' tag, its
    tier, its store stamp (`stamp` + the blocks of the events before it + the blocks after it in its event:
    a chain's tail is the least recently stored) and its record `info` (npend | nkeys << 8, from
    `chain_blocks`)."""
    k = 0
    base = np.int64(stamp)
    for e in range(n.shape[0]):
        ne = np.int64(n[e])
        for j in range(ne):
            tags[k] = pid[e]
            tiers[k] = tid[e]
            stamps[k] = base + ne - 1 - j
            info[k] = npend[k] | (nkeys[k] << 8)
            k += 1
        base += ne


def warm_up() -> None:
    """Compile (or load the cached machine code of) the loop now."""
    one = np.ones(1, dtype=np.intp)
    zero = np.zeros(1, dtype=np.intp)
    u64 = np.zeros(1, dtype=np.uint64)
    for tokens in (np.zeros(1, dtype=np.int64), np.frombuffer(bytes(8), dtype=np.int64)):  # (+ read-only)
        chain_blocks(
            one, one, one, zero, -one, u64, tokens, 1, np.zeros(1, dtype=np.uint64),
            np.zeros(1, dtype=np.intp), np.zeros(1, dtype=np.intp), np.zeros(1, dtype=np.intp),
            np.zeros(2, dtype=np.uint64),
        )  # fmt: skip
    block_rows(
        one, one, one, 0, one, one, np.zeros(1, dtype=np.uint16), np.zeros(1, dtype=np.intp),
        np.zeros(1, dtype=np.uint32), np.zeros(1, dtype=np.uint32),
    )  # fmt: skip
