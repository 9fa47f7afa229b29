"""Our block keys: 64-bit, chained from a root that names the model / adapter and the tenant salt. Pure.

Engine block hashes are opaque (they depend on the engine's hash function, seed and block size), so
the router recomputes its own keys from token ids. Keys are deterministic across processes and runs:
no Python `hash()`, no random seeds, only fixed constants.

Definition (a polynomial rolling hash over mixed tokens, finalised per block):

- every token id t is mixed: g(t) = fmix64(t + TOKEN_SEED) (bijective, so distinct ids stay distinct);
- a chain *state* S runs over the tokens: S <- S * MULT + g(t)  (mod 2**64);
- the key of the block that ends at a token boundary is fmix64(S) at that boundary;
- a chain starts from a key K with S = fmix64^-1(K) (fmix64 is a bijection): a block's key is both its
  name and the chain state its successors continue from. The first block continues from
  `root_key(model, salt)`.

So the key of block b depends on the root and on every token before the end of b, and nothing else: it
is independent of how the tokens were grouped into engine blocks (which is what lets the index chain
engine blocks of 64, 32 or 1 token into index blocks of 16). A prompt's keys are one compiled pass over
its tokens (`rolling.chain_keys`).

Collision resistance is that of a 64-bit hash against natural data (about n^2 / 2^65 for n keys). It is
not a cryptographic MAC: a prompt crafted to collide (for instance with Thue-Morse patterns of two
blocks, the classic attack on polynomial hashes modulo 2^64) can make the router over-estimate a cache
hit. That only mis-routes the crafter's request; engines verify their own caches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from epp.kvindex.rolling import MULT as MULT  # (the constants live with the compiled loops)
from epp.kvindex.rolling import TOKEN_SEED as TOKEN_SEED
from epp.kvindex.rolling import chain_keys

Keys = npt.NDArray[np.uint64]

MASK64: Final = (1 << 64) - 1
_F1: Final = 0xFF51AFD7ED558CCD  # murmur3 fmix64 multipliers
_F2: Final = 0xC4CEB9FE1A85EC53
_F1_INV: Final = pow(_F1, -1, 1 << 64)
_F2_INV: Final = pow(_F2, -1, 1 << 64)
_U33: Final = np.uint64(33)
_U_F1: Final = np.uint64(_F1)
_U_F2: Final = np.uint64(_F2)
_ROOT_PERSON: Final = b"epp-kv-root-v1"


def fmix(x: int) -> int:
    """murmur3's 64-bit finaliser (a bijection of 64-bit ints)."""
    x ^= x >> 33
    x = (x * _F1) & MASK64
    x ^= x >> 33
    x = (x * _F2) & MASK64
    return x ^ (x >> 33)


def fmix_inv(x: int) -> int:
    """The inverse of `fmix` (x ^= x >> 33 is its own inverse: 33 >= 64 / 2)."""
    x ^= x >> 33
    x = (x * _F2_INV) & MASK64
    x ^= x >> 33
    x = (x * _F1_INV) & MASK64
    return x ^ (x >> 33)


def fmix_array(x: Keys) -> Keys:
    """`fmix` over a uint64 array (a new array)."""
    x = x ^ (x >> _U33)
    x *= _U_F1
    x ^= x >> _U33
    x *= _U_F2
    x ^= x >> _U33
    return x


def state_of(key: int) -> int:
    """The chain state a key continues from."""
    return fmix_inv(key & MASK64)


def key_of(state: int) -> int:
    """The key of a block whose last token leaves the chain in `state`."""
    return fmix(state)


def mix_token(t: int) -> int:
    return fmix((t + TOKEN_SEED) & MASK64)


def advance(state: int, token_ids: Sequence[int]) -> int:
    """The chain state after `token_ids` (scalar; for short sequences)."""
    for t in token_ids:
        state = (state * MULT + fmix((int(t) + TOKEN_SEED) & MASK64)) & MASK64
    return state


def chain(parent: int, token_ids: Sequence[int]) -> int:
    """The key of one block made of `token_ids` (all of them, whatever their number) after `parent`."""
    return key_of(advance(state_of(parent), token_ids))


def root_key(model: str, salt: str | bytes | None = None) -> int:
    """Chain root: a 64-bit key from the model (the LoRA adapter name when set, else the base model) and
    the tenant / cache salt, so different models, adapters and tenants never share keys.

    A str salt and its UTF-8 bytes are the same salt; None and an empty salt mean no salt.
    """
    m = model.encode()
    s = salt.encode() if isinstance(salt, str) else (salt or b"")
    h = hashlib.blake2b(digest_size=8, person=_ROOT_PERSON)
    h.update(len(m).to_bytes(8, "little"))
    h.update(m)
    h.update(s)
    return int.from_bytes(h.digest(), "little")


def as_tokens(token_ids: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.integer]:
    """Token ids as an integer array (no copy when already one)."""
    if isinstance(token_ids, (list, tuple)):
        try:
            return np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
        except (TypeError, ValueError, OverflowError):
            pass  # not plain ints: let numpy say what they are
    arr = np.asarray(token_ids)
    if arr.dtype.kind not in "iu":
        if arr.size:
            raise TypeError(f"token ids must be integers, got {arr.dtype}")
        arr = arr.astype(np.int64)
    return arr


def block_keys(token_ids: Sequence[int] | npt.NDArray[np.integer], block_size: int, parent: int) -> Keys:
    """uint64 keys of the FULL blocks of token_ids (a trailing partial block is ignored), each chained
    from the previous key (the first from `parent`): one compiled pass (`rolling.chain_keys`)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    tokens = as_tokens(token_ids)
    out = np.empty(len(tokens) // block_size, dtype=np.uint64)
    if len(out):
        chain_keys(tokens, block_size, np.uint64(state_of(parent)), out)
    return out
