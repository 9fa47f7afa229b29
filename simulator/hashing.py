"""The simulated engine's block hashes: deterministic, chained, 64-bit, vectorised. Pure.

vLLM names a full block by a hash of (parent block's hash, the block's token ids, extra keys)
and publishes it in its KV events. Routers treat these hashes as opaque ids and recompute
their own keys from the token ids, so the simulator only needs *a* deterministic 64-bit
chained hash, not vLLM's (sha256 / xxhash of a CBOR encoding). Ours, for a block of token ids
`t_0 .. t_{B-1}` after a block hashed `parent`:

    hash = parent * M + sum_j C_j * t_j      (mod 2^64)

with `M` the odd multiplier of `epp.kvindex.keys` and `C_j` fixed odd 64-bit constants
(splitmix64 of j + 1). A chain starts from `root_hash(lora_name, cache_salt)` (vLLM puts the
adapter and the salt in its blocks' extra keys), so tenants and adapters never share blocks.

The hashes of a sequence's blocks are one compiled pass over its tokens (`_chain`, numba:
`docs/architecture.md`, "Compiled loops"), about 2 us for 2,000 tokens. Two different (parent,
block) pairs collide only when `M * dparent + sum_j C_j * dt_j = 0 (mod 2^64)`, which natural
token data does not produce (about 2^-64 per pair); it is not a cryptographic hash, and a final
bit mixer would not change which pairs collide, so there is none.
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

import numba
import numpy as np
import numpy.typing as npt

from epp.kvindex.keys import MASK64, MULT

Hashes = npt.NDArray[np.uint64]

_PERSON: Final = b"epp-sim-engine1"
_EMPTY: Final = np.zeros(0, dtype=np.uint64)
_COEFS: dict[int, Hashes] = {}


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def coefficients(block_size: int) -> Hashes:
    """C_0 .. C_{B-1} (deterministic; cached per block size)."""
    c = _COEFS.get(block_size)
    if c is None:
        c = _COEFS[block_size] = np.array([_splitmix(j + 1) | 1 for j in range(block_size)], dtype=np.uint64)
    return c


def root_hash(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The parent of a chain's first block: depends on the adapter and the tenant salt only."""
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    lora = (lora_name or "").encode()
    h.update(len(lora).to_bytes(4, "little"))
    h.update(lora)
    h.update((cache_salt or "").encode())
    return int.from_bytes(h.digest(), "little")


def block_hash(parent: int, token_ids: npt.ArrayLike) -> int:
    """The hash of one block after `parent` (the scalar definition)."""
    toks: list[int] = np.asarray(token_ids, dtype=np.int64).astype(np.uint64).tolist()
    acc = parent * MULT
    for t, c in zip(toks, coefficients(len(toks)).tolist(), strict=True):
        acc += t * c
    return acc & MASK64


def block_hashes(token_ids: npt.NDArray[np.integer], block_size: int, parent: int) -> Hashes:
    """Hashes of the full blocks of `token_ids` (a trailing partial block is ignored), chained from
    `parent`: equal to chaining `block_hash` block by block."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    nb = len(token_ids) // block_size
    if nb == 0:
        return _EMPTY
    tokens = token_ids if token_ids.dtype == np.int64 else token_ids.astype(np.int64)
    out = np.empty(nb, dtype=np.uint64)
    _chain(tokens, block_size, coefficients(block_size), np.uint64(parent & MASK64), out)
    return out


@numba.njit(cache=True, nogil=True)
def _chain(tokens: Any, bs: int, coefs: Any, parent: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out[b] = M * out[b - 1] + sum_j C_j * t_{b * bs + j} (mod 2^64), out[-1] = parent: the definition,
    one block after the other (ids are >= 0, so their int64 bits are their uint64 value)."""
    mult = numba.uint64(MULT)
    h = parent
    for b in range(out.shape[0]):
        acc = h * mult
        base = b * bs
        for j in range(bs):
            acc += coefs[j] * numba.uint64(tokens[base + j])
        out[b] = acc
        h = acc


def warm_up() -> None:
    """Compile (or load the cached machine code of) the hash loop now."""
    block_hashes(np.zeros(2, dtype=np.int64), 1, 0)
