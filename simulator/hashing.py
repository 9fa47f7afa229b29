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

Being linear, the hashes of all blocks of a sequence are one matrix product and one cumulative
sum (`hash_b = M^b (M parent + sum_{i<=b} M^-i c_i)`, the prefix-scan trick of `keys.py`): six
numpy operations, about 3 us for 2,000 tokens. Two different (parent, block) pairs collide only
when `M * dparent + sum_j C_j * dt_j = 0 (mod 2^64)`, which natural token data does not produce
(about 2^-64 per pair); it is not a cryptographic hash, and a final bit mixer would not change
which pairs collide, so there is none.
"""

from __future__ import annotations

import hashlib
from operator import mul
from typing import Final

import numpy as np
import numpy.typing as npt

from epp.kvindex.keys import MASK64, MULT, powers

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
    if nb <= 2:  # numpy's fixed costs exceed the work: the scalar definition
        coefs: list[int] = coefficients(block_size).tolist()
        toks: list[int] = token_ids[: nb * block_size].tolist()
        hashes = []
        h = parent
        for b in range(0, nb * block_size, block_size):
            h = (h * MULT + sum(map(mul, toks[b : b + block_size], coefs))) & MASK64
            hashes.append(h)
        return np.array(hashes, dtype=np.uint64)
    flat = token_ids[: nb * block_size]
    if flat.dtype == np.int64 and flat.flags.c_contiguous:
        blocks = flat.view(np.uint64).reshape(nb, block_size)  # ids are >= 0: the same bits
    else:
        blocks = flat.astype(np.uint64).reshape(nb, block_size)
    out = blocks @ coefficients(block_size)  # c_b, wrapping modulo 2^64
    pos, neg = powers(nb + 1)
    out *= neg[:nb]
    np.add.accumulate(out, out=out)  # sum_{i<=b} M^-i c_i
    out += np.array((parent * MULT) & MASK64, dtype=np.uint64)
    out *= pos[:nb]  # hash_b = M^b (M parent + sum_{i<=b} M^-i c_i) = M hash_{b-1} + c_b
    return out
