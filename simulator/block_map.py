"""The prefix cache's hash -> block map, as compiled loops over two arrays. Pure.

`blocks.BlockPool` keeps, for every cached block hash, the physical block a lookup uses (the first
cached copy). The map is open addressing with linear probing over `keys` (uint64 hashes) and `vals`
(block ids; 0, the null block's id, marks an empty slot), sized to a power of two of at least twice
the blocks, so a probe ends within a few slots; deletion shifts the following entries back (no
tombstones). The pool's other copies of a hash (`BlockPool.dups`) stay in a Python dict: they are
rare, and the pool checks it before it takes these loops' fast paths.

Compiled with numba (`docs/architecture.md`, "Compiled loops"): a 2,000-token request looks up,
caches and evicts ~200 hashes; as Python dict calls that was ~40% of the engine's time.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt


def new_map(num_blocks: int) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]:
    """Empty (keys, vals) for a pool of `num_blocks` blocks."""
    cap = 8
    while cap < 2 * num_blocks:
        cap *= 2
    return np.zeros(cap, dtype=np.uint64), np.zeros(cap, dtype=np.int64)


@numba.njit(cache=True, nogil=True, inline="always")
def _home(h: Any, mask: int) -> Any:  # pragma: no cover - compiled
    x = h ^ (h >> numba.uint64(33))
    x *= numba.uint64(0xFF51AFD7ED558CCD)
    x ^= x >> numba.uint64(33)
    return np.int64(x & numba.uint64(mask))


@numba.njit(cache=True, nogil=True, inline="always")
def _find(keys: Any, vals: Any, h: Any) -> Any:  # pragma: no cover - compiled
    """The slot of `h`, or -1 - the empty slot where it would go."""
    mask = keys.shape[0] - 1
    i = _home(h, mask)
    while vals[i] != 0:
        if keys[i] == h:
            return i
        i = (i + 1) & mask
    return -1 - i


@numba.njit(cache=True, nogil=True)
def get(keys: Any, vals: Any, h: Any) -> Any:  # pragma: no cover - compiled
    """The block of `h`, or 0."""
    i = _find(keys, vals, numba.uint64(h))
    return vals[i] if i >= 0 else 0


@numba.njit(cache=True, nogil=True)
def put(keys: Any, vals: Any, h: Any, b: int) -> Any:  # pragma: no cover - compiled
    """Map `h` to block `b` unless it is mapped: returns the block it maps to now."""
    h = numba.uint64(h)
    i = _find(keys, vals, h)
    if i >= 0:
        return vals[i]
    i = -1 - i
    keys[i] = h
    vals[i] = b
    return b


@numba.njit(cache=True, nogil=True)
def run(keys: Any, vals: Any, hashes: Any, limit: int, out: Any) -> Any:  # pragma: no cover - compiled
    """Blocks of the longest run of mapped hashes from hashes[0], at most `limit`, into `out`."""
    n = min(limit, hashes.shape[0])
    for k in range(n):
        i = _find(keys, vals, hashes[k])
        if i < 0:
            return k
        out[k] = vals[i]
    return n


@numba.njit(cache=True, nogil=True)
def put_all(  # pragma: no cover - compiled
    keys: Any, vals: Any, hashes: Any, blocks: Any, first: Any, block_hash: Any, hashed: Any
) -> bool:
    """`put` for each (hash, block), the block noted as holding it (block_hash, hashed); first[k] =
    the block hashes[k] maps to after it. True when every hash was new (then first == blocks)."""
    fresh = True
    for k in range(hashes.shape[0]):
        h = hashes[k]
        block_hash[blocks[k]] = h
        hashed[blocks[k]] = True
        i = _find(keys, vals, h)
        if i >= 0:
            first[k] = vals[i]
            fresh = False
            continue
        i = -1 - i
        keys[i] = h
        vals[i] = blocks[k]
        first[k] = blocks[k]
    return fresh


@numba.njit(cache=True, nogil=True)
def remove(keys: Any, vals: Any, h: Any) -> None:  # pragma: no cover - compiled
    """Unmap `h` (mapped), shifting the entries after it back to where a probe finds them."""
    mask = keys.shape[0] - 1
    i = _find(keys, vals, numba.uint64(h))
    j = i
    while True:
        j = (j + 1) & mask
        if vals[j] == 0:
            break
        home = _home(keys[j], mask)
        # the entry at j may move to i when its home is not cyclically in (i, j]
        if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
            keys[i] = keys[j]
            vals[i] = vals[j]
            i = j
    vals[i] = 0
    keys[i] = 0


@numba.njit(cache=True, nogil=True)
def remove_all(keys: Any, vals: Any, hashes: Any) -> None:  # pragma: no cover - compiled
    for k in range(hashes.shape[0]):
        remove(keys, vals, hashes[k])


@numba.njit(cache=True, nogil=True)
def put_block(  # pragma: no cover - compiled
    keys: Any, vals: Any, block_hash: Any, hashed: Any, values: Any, k: int, b: int
) -> Any:
    """Block `b` now holds hash values[k]: noted (block_hash, hashed), then `put`. One call where the
    pool's single-block path (a decode filling a block) made four."""
    h = values[k]
    block_hash[b] = h
    hashed[b] = True
    return put(keys, vals, h, b)


@numba.njit(cache=True, nogil=True)
def drop_block(keys: Any, vals: Any, block_hash: Any, hashed: Any, b: int) -> None:  # pragma: no cover
    """Block `b` (hashed, the only copy of its hash) forgets its hash: unhashed, then `remove`."""
    hashed[b] = False
    remove(keys, vals, block_hash[b])


@numba.njit(cache=True, nogil=True)
def set_block(keys: Any, vals: Any, h: Any, b: int) -> None:  # pragma: no cover - compiled
    """Point mapped `h` to block `b`."""
    vals[_find(keys, vals, numba.uint64(h))] = b


def warm_up() -> None:
    """Compile (or load the cached machine code of) the loops now."""
    keys, vals = new_map(2)
    h = np.array([7], dtype=np.uint64)
    b = np.array([1], dtype=np.int64)
    put_all(keys, vals, h, b, b.copy(), np.zeros(2, dtype=np.uint64), np.zeros(2, dtype=np.bool_))
    run(keys, vals, h, 1, b.copy())
    put(keys, vals, 9, 1)
    set_block(keys, vals, 9, 1)
    get(keys, vals, 9)
    remove(keys, vals, 9)
    remove_all(keys, vals, h)
    hashes, hashed = np.zeros(2, dtype=np.uint64), np.zeros(2, dtype=np.bool_)
    put_block(keys, vals, hashes, hashed, h, 0, 1)
    drop_block(keys, vals, hashes, hashed, 1)
