"""The block pool's free queue operations, as compiled loops over its arrays. Pure.

`blocks.BlockPool` orders its free blocks by a stamp per block: the FIFO (`q`, entries [head, tail);
the entry at index t is live while its block's stamp is t + 1) after a stack of front pushes (`fb`,
`fs`: block and stamp, the last pushed first; stamps there are negative). An entry whose stamp no
longer matches is stale and skipped (`touch` and `take` reset a block's stamp to 0). `take` pops
blocks front first and marks them used; `give_back` releases one request's blocks in the order
given. As numpy calls these were ~25% of a simulated request's engine time.

Compiled with numba (`docs/architecture.md`, "Compiled loops").
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from simulator import block_map


@numba.njit(cache=True, nogil=True)
def take(  # pragma: no cover - compiled
    q: Any,
    stamp: Any,
    ref: Any,
    hashed: Any,
    head: int,
    tail: int,
    fb: Any,
    fs: Any,
    flen: int,
    out: Any,
    evicted: Any,
    block_hash: Any,
    evicted_hashes: Any,
    map_keys: Any,
    map_vals: Any,
    unmap: bool,
) -> tuple[int, int, int]:
    """Pop len(out) live blocks into `out` (front stack first, then the FIFO), each now used by one
    request (ref 1, stamp 0); those still hashed (their cached content is evicted) go to `evicted`,
    their hashes to `evicted_hashes`, and with `unmap` (no block holds a second copy of anything)
    they are unhashed and their hashes leave the prefix-cache map here. Returns (new head, new front
    length, evicted count), or head -1 when the queue ran out."""
    n = out.shape[0]
    k = 0
    while flen > 0 and k < n:
        flen -= 1
        b = fb[flen]
        if stamp[b] == fs[flen]:
            out[k] = b
            k += 1
    while k < n:
        if head >= tail:
            return -1, flen, 0
        b = q[head]
        head += 1
        if stamp[b] == head:  # the entry at index head - 1 is stamped head
            out[k] = b
            k += 1
    nev = 0
    for i in range(n):
        b = out[i]
        stamp[b] = 0
        ref[b] = 1
        if hashed[b]:
            evicted[nev] = b
            evicted_hashes[nev] = block_hash[b]
            nev += 1
            if unmap:
                hashed[b] = False
                block_map.remove(map_keys, map_vals, block_hash[b])
    return head, flen, nev


@numba.njit(cache=True, nogil=True)
def give_back(  # pragma: no cover - compiled
    ids: Any,
    ref: Any,
    hashed: Any,
    stamp: Any,
    q: Any,
    tail: int,
    fb: Any,
    fs: Any,
    flen: int,
    next_front: int,
) -> tuple[int, int, int, int]:
    """Release one hold on each of `ids`, in order: a block nobody uses any more goes to the FIFO's tail
    when hashed, onto the front stack otherwise. The caller leaves room for len(ids) in both. Returns
    (new tail, new front length, next front stamp, blocks freed)."""
    freed = 0
    for i in range(ids.shape[0]):
        b = ids[i]
        r = ref[b] - 1
        ref[b] = r
        if r > 0:
            continue
        freed += 1
        if hashed[b]:
            q[tail] = b
            tail += 1
            stamp[b] = tail
        else:
            stamp[b] = next_front
            fb[flen] = b
            fs[flen] = next_front
            flen += 1
            next_front -= 1
    return tail, flen, next_front, freed


@numba.njit(cache=True, nogil=True)
def touch(ids: Any, ref: Any, stamp: Any, need: int, num_free: int) -> int:  # pragma: no cover - compiled
    """A request takes hit blocks `ids` (distinct), if `need` more blocks can then be allocated (the
    hit blocks that sit in the free queue leave it, using free capacity): the new free count, or -1
    (nothing touched) when they do not fit."""
    idle = 0
    for i in range(ids.shape[0]):
        if ref[ids[i]] == 0:
            idle += 1
    if need + idle > num_free:
        return -1
    for i in range(ids.shape[0]):
        b = ids[i]
        if ref[b] == 0:
            stamp[b] = 0
        ref[b] += 1
    return num_free - idle


def warm_up() -> None:
    """Compile (or load the cached machine code of) the loops now."""
    z = np.zeros(4, dtype=np.int64)
    ids = np.array([1], dtype=np.int64)
    hashed = np.zeros(4, dtype=np.bool_)
    give_back(ids, np.ones(4, dtype=np.int64), hashed, z, z.copy(), 0, z.copy(), z.copy(), 0, -1)
    u = np.zeros(4, dtype=np.uint64)
    keys, vals = block_map.new_map(2)
    take(
        z, z.copy(), z.copy(), hashed, 0, 0, z.copy(), z.copy(), 0, np.zeros(0, dtype=np.int64), z.copy(),
        u, u.copy(), keys, vals, True,
    )  # fmt: skip
    touch(ids, z.copy(), z.copy(), 0, 1)
