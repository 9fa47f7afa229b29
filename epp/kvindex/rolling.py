"""The rolling hash of `keys.py` as compiled loops: its constants, `fmix` and the chain over a prompt. Pure.

A leaf module (it imports nothing of ours), so that both `keys.py` (the definition, and `block_keys` for
prompts) and `block_chain.py` (the index's stored blocks) run the same compiled arithmetic.

`chain_keys` is `keys.block_keys`'s loop: S <- S * MULT + fmix(t + TOKEN_SEED) over the tokens, a key
fmix(S) at every block boundary. One pass and no temporaries, where the vectorised form (a prefix sum
of powers) took five passes over the prompt and four arrays of its length.

Compiled with numba (`docs/architecture.md`, "Compiled loops").
"""

from __future__ import annotations

from typing import Any, Final

import numba
import numpy as np

MULT: Final = 0x9E3779B97F4A7C15  # odd, multiplicative order 2^62 modulo 2^64
TOKEN_SEED: Final = 0x632BE59BD9B4E019


@numba.njit(cache=True, nogil=True, inline="always")
def fmix(x: Any) -> Any:  # pragma: no cover - compiled
    """`keys.fmix` on a uint64, compiled."""
    x ^= x >> numba.uint64(33)
    x *= numba.uint64(0xFF51AFD7ED558CCD)
    x ^= x >> numba.uint64(33)
    x *= numba.uint64(0xC4CEB9FE1A85EC53)
    return x ^ (x >> numba.uint64(33))


@numba.njit(cache=True, nogil=True)
def chain_keys(tokens: Any, bs: int, state: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out[b] = the key of block b of `tokens` (len(out) full blocks of `bs`), the chain starting from
    `state` (a uint64). Token ids are taken modulo 2^64, as `keys.mix_token` takes them."""
    mult = numba.uint64(MULT)
    seed = numba.uint64(TOKEN_SEED)
    s = numba.uint64(state)
    t = 0
    for b in range(out.shape[0]):
        for _ in range(bs):
            s = s * mult + fmix(numba.uint64(tokens[t]) + seed)
            t += 1
        out[b] = fmix(s)


def warm_up() -> None:
    """Compile (or load from the cache) `chain_keys` for the token arrays prompts come as."""
    for dtype in (np.int64, np.int32, np.uint32, np.uint64):
        chain_keys(np.zeros(1, dtype=dtype), 1, np.uint64(0), np.zeros(1, dtype=np.uint64))
