"""The store queue's bookkeeping, compiled: what `store_queue.IndexQueue` decides per BlockStored. Pure.

The queue (`store_queue.py`) keeps its events, start states and engine hashes in arrays, and where each
queued engine block is in a small open-addressing table of its own (`QT`: (pod, engine hash) -> the
block's *position*, queue position * 256 + tokens past the last index boundary after it; the latest store
of a hash wins). The pods' queued discards are in the same table under the tag pod + `DISCARD`. A flush
empties the table by moving to a new epoch (a slot is taken only when its epoch is the current one).

`queue_run` applies consecutive BlockStored events of one pod and tier with the effects `_store` had one by
one: it checks each event (`REJECT`), stops where a store must come after a flush (`FLUSH`: it may push the
index over its bound, or it names a block with a queued discard: the caller flushes and calls again from
that event), resolves where its chain starts (the root, a queued block, a held record, or `ORPHAN`) and
queues it; `FULL` when the queue reached its flush size after an event. The caller handles what stops it
(counting, the unknown chains, flushing) and calls again from where it stopped. Python kept a set of the
queued hashes per pod and a dict of positions, ~30 us per message of 128 blocks.

Compiled with numba (`docs/architecture.md`, "Compiled loops").
"""

from __future__ import annotations

from typing import Any, Final

import numba
import numpy as np

from epp.kvindex.cuckoo import find_one

QUEUED: Final = 0
FULL: Final = 1
REJECT: Final = 2
FLUSH: Final = 3
ORPHAN: Final = 4

NEV: Final = 0
NBLK: Final = 1
NTOK: Final = 2
WEIGHT: Final = 3
DUPS: Final = 4
QCOUNT: Final = 5
EPOCH: Final = 6
STATE_SIZE: Final = 8
"""The queue's counters, `st`: events, blocks, tokens, weight (an upper bound of what the queued stores add
to `used`), whether a (pod, engine hash) is queued twice, entries of the table, its epoch."""

DISCARD: Final = 1 << 17
"""Tag offset of a pod's queued discards in the table (pods are < 2^16)."""
LEFT: Final = 1 << 18
"""Tag offset of a pod's engine blocks with queued removals (`remove`) in the table: the tiers left to them
after those (the removals' `_r_left`)."""


@numba.njit(cache=True, nogil=True, inline="always")
def _slot(key: Any, tag: Any, mask: Any) -> Any:  # pragma: no cover - compiled
    """Where (key, tag)'s probe starts: by the key and the pod, so that a pod's discard of a hash is on the
    path of its store of it (one cache line for both probes)."""
    x = key ^ (numba.uint64(tag & 0xFFFF) * numba.uint64(0xD6E8FEB86659FD93))
    x ^= x >> numba.uint64(33)
    x *= numba.uint64(0xFF51AFD7ED558CCD)
    x ^= x >> numba.uint64(33)
    return np.int64(x & numba.uint64(mask))


@numba.njit(cache=True, nogil=True, inline="always")
def qt_find(qt: Any, epoch: Any, key: Any, tag: Any) -> Any:  # pragma: no cover - compiled
    """The value of (key, tag) in the table, or -1. A slot is a row: key, tag, value, epoch."""
    mask = qt.shape[0] - 1
    s = _slot(key, tag, mask)
    ep = numba.uint64(epoch)
    k = numba.uint64(key)
    g = numba.uint64(tag)
    while qt[s, 3] == ep:
        if qt[s, 0] == k and qt[s, 1] == g:
            return np.int64(qt[s, 2])
        s = (s + 1) & mask
    return np.int64(-1)


@numba.njit(cache=True, nogil=True, inline="always")
def qt_put(qt: Any, epoch: Any, key: Any, tag: Any, value: Any) -> bool:  # pragma: no cover - compiled
    """Set (key, tag) to value; True when it was there already."""
    mask = qt.shape[0] - 1
    s = _slot(key, tag, mask)
    ep = numba.uint64(epoch)
    k = numba.uint64(key)
    g = numba.uint64(tag)
    while qt[s, 3] == ep:
        if qt[s, 0] == k and qt[s, 1] == g:
            qt[s, 2] = numba.uint64(value)
            return True
        s = (s + 1) & mask
    qt[s, 0] = k
    qt[s, 1] = g
    qt[s, 2] = numba.uint64(value)
    qt[s, 3] = ep
    return False


@numba.njit(cache=True, nogil=True)
def rehash(qt: Any, new: Any, epoch: int) -> None:  # pragma: no cover - compiled
    """Move the table's current entries into a larger one (`new`'s epochs all other than `epoch`)."""
    ep = numba.uint64(epoch)
    for s in range(qt.shape[0]):
        if qt[s, 3] == ep:
            qt_put(new, epoch, qt[s, 0], qt[s, 1], qt[s, 2])


@numba.njit(cache=True, nogil=True, inline="always")
def _queue_one(  # pragma: no cover - compiled
    pid: Any,
    tid: Any,
    hashes: Any,
    h: Any,
    parent: Any,
    has_parent: Any,
    n: Any,
    ntok: Any,
    ebs: Any,
    root_s0: Any,
    bs: Any,
    max_ebs: Any,
    max_entries: Any,
    used: Any,
    flush_tokens: Any,
    flush_blocks: Any,
    qev: Any,
    qs0: Any,
    qh: Any,
    qt: Any,
    st: Any,
    rkeys: Any,
    rtags: Any,
    rcount: Any,
    rnb: Any,
    rstate: Any,
    rinfo: Any,
) -> tuple[Any, Any]:
    """One BlockStored (hashes[h : h + n]): (QUEUED | FULL | REJECT | FLUSH | ORPHAN, index blocks it
    completes)."""
    if not (n > 0 and 1 <= ebs <= max_ebs and (n - 1) * ebs < ntok <= n * ebs):
        return REJECT, 0
    full = ntok == n * ebs
    weight = (ntok + bs - 1) // bs + (0 if ebs >= bs and full else n)
    if st[NBLK] > 0 and used + st[WEIGHT] + weight > max_entries:
        return FLUSH, 0  # this store may evict: what it sees must include the queued stores' evictions
    epoch = st[EPOCH]
    if st[QCOUNT] > 0:
        dtag = pid + DISCARD
        ltag = pid + LEFT
        for j in range(n):  # a block with a queued removal or discard: those first
            x = hashes[h + j]
            if qt_find(qt, epoch, x, ltag) >= 0 or qt_find(qt, epoch, x, dtag) >= 0:
                return FLUSH, 0
        if has_parent and qt_find(qt, epoch, parent, dtag) >= 0:
            return FLUSH, 0  # whether the parent is still held, and the order of effects
    pref = -1
    npend0 = 0
    s0 = numba.uint64(0)
    if not has_parent:
        s0 = root_s0
    else:
        v = qt_find(qt, epoch, parent, pid) if st[NBLK] > 0 else -1
        if v >= 0:
            pref = v >> 8
            npend0 = v & 0xFF
        elif st[QCOUNT] > 0 and qt_find(qt, epoch, parent, pid + LEFT) == 0:
            return ORPHAN, 0  # the queued removals leave the parent on no tier
        else:
            slot = find_one(rkeys, rtags, rcount, rnb, parent, numba.uint16(pid))[0]
            if slot < 0:
                return ORPHAN, 0
            npend0 = rinfo[slot] & 0xFF
            s0 = rstate[slot]
    e = st[NEV]
    g = st[NBLK]
    qev[0, e] = pid
    qev[1, e] = tid
    qev[2, e] = n
    qev[3, e] = ntok
    qev[4, e] = ebs
    qev[5, e] = pref
    qev[6, e] = npend0
    qs0[e] = s0
    dups = False
    for j in range(n):
        end = (j + 1) * ebs if j < n - 1 else ntok
        x = hashes[h + j]
        qh[g + j] = x
        if qt_put(qt, epoch, x, pid, (g + j) * 256 + (npend0 + end) % bs):
            dups = True
        else:
            st[QCOUNT] += 1
    if dups:
        st[DUPS] = 1
    st[NEV] = e + 1
    st[NBLK] = g + n
    st[NTOK] += ntok
    st[WEIGHT] += weight
    k = (npend0 + ntok) // bs
    if st[NTOK] >= flush_tokens or st[NBLK] >= flush_blocks:
        return FULL, k
    return QUEUED, k


@numba.njit(cache=True, nogil=True)
def queue_run(  # pragma: no cover - compiled
    pid: int,
    tid: int,
    hashes: Any,
    parents: Any,
    cols: Any,
    e: int,
    h: int,
    root_s0: Any,
    bs: int,
    max_ebs: int,
    max_entries: int,
    used: int,
    flush_tokens: int,
    flush_blocks: int,
    qev: Any,
    qs0: Any,
    qh: Any,
    qt: Any,
    st: Any,
    rkeys: Any,
    rtags: Any,
    rcount: Any,
    rnb: int,
    rstate: Any,
    rinfo: Any,
) -> tuple[int, int, int]:
    """Events e.. of a run (per event a row of `cols`: whether it has a parent, `parents[e]`; blocks, tokens,
    engine block size: the compiled scan's layout; hashes from `h` on): queued in order until one stops it.
    Returns (QUEUED when all are, else what stopped it; the event it stopped at, or after for FULL; its
    first hash's offset)."""
    ne = cols.shape[0]
    while e < ne:
        n = cols[e, 1]
        code, _ = _queue_one(
            pid, tid, hashes, h, parents[e], cols[e, 0] != 0, n, cols[e, 2], cols[e, 3], root_s0, bs, max_ebs,
            max_entries, used, flush_tokens, flush_blocks, qev, qs0, qh, qt, st, rkeys, rtags,
            rcount, rnb, rstate, rinfo,
        )  # fmt: skip
        if code in (QUEUED, FULL):
            e += 1
            h += n
            if code == FULL:
                return FULL, e, h
            continue
        return code, e, h
    return QUEUED, e, h


@numba.njit(cache=True, nogil=True)
def queue_one(  # pragma: no cover - compiled
    pid: int,
    tid: int,
    hashes: Any,
    parent: Any,
    has_parent: bool,
    ntok: int,
    ebs: int,
    root_s0: Any,
    bs: int,
    max_ebs: int,
    max_entries: int,
    used: int,
    flush_tokens: int,
    flush_blocks: int,
    qev: Any,
    qs0: Any,
    qh: Any,
    qt: Any,
    st: Any,
    rkeys: Any,
    rtags: Any,
    rcount: Any,
    rnb: int,
    rstate: Any,
    rinfo: Any,
) -> tuple[int, int]:
    """One BlockStored of all of `hashes`: (what `_queue_one` says, index blocks it completes). `parent` and
    `root_s0` may come as the int64 of their bits."""
    p, r = numba.uint64(parent), numba.uint64(root_s0)
    code, k = _queue_one(
        pid, tid, hashes, 0, p, has_parent, hashes.shape[0], ntok, ebs, r, bs, max_ebs,
        max_entries, used, flush_tokens, flush_blocks, qev, qs0, qh, qt, st, rkeys, rtags, rcount,
        rnb, rstate, rinfo,
    )  # fmt: skip
    return code, k


@numba.njit(cache=True, nogil=True)
def any_queued(qt: Any, st: Any, pid: int, hashes: Any) -> bool:
    """Whether a store of one of (pid, hashes) is queued."""  # pragma: no cover - compiled
    if st[NBLK] == 0:
        return False
    for j in range(hashes.shape[0]):  # noqa: SIM110  (numba compiles no generator)
        if qt_find(qt, st[EPOCH], hashes[j], pid) >= 0:
            return True
    return False


@numba.njit(cache=True, nogil=True)
def add_discards(qt: Any, st: Any, pid: int, hashes: Any) -> bool:
    """Mark (pid, hashes) as discarded in the queue; False (nothing changed) when a store of one of them is
    queued (the caller flushes first)."""  # pragma: no cover - compiled
    if any_queued(qt, st, pid, hashes):
        return False
    for j in range(hashes.shape[0]):
        if not qt_put(qt, st[EPOCH], hashes[j], pid + DISCARD, 0):
            st[QCOUNT] += 1
    return True


@numba.njit(cache=True, nogil=True)
def set_left(qt: Any, st: Any, pid: int, hashes: Any, tiers: Any) -> None:  # pragma: no cover - compiled
    """Record the tiers left to (pid, hashes) after the queued removals."""
    for j in range(hashes.shape[0]):
        if not qt_put(qt, st[EPOCH], hashes[j], pid + LEFT, tiers[j]):
            st[QCOUNT] += 1


def warm_up() -> None:
    """Compile (or load the cached machine code of) the loops for the types the queue passes."""
    from epp.kvindex.index import BlockIndex  # (the index calls every loop with its own arrays)

    index = BlockIndex(block_size=16, max_entries=1000)
    index.store("warm-up", [1, 2], None, list(range(32)), 16, "gpu", 7)
    index.store_run(
        "warm-up", "gpu", 7, [3, 4], [2, 3], [1, 1], np.arange(32, dtype=np.int64), [16, 16], [16, 16],
        np.array([3, 4], dtype=np.uint64),
    )  # fmt: skip
    index.discard("warm-up", [1], "gpu")
    index.remove("warm-up", [2], "gpu")
    index.flush()
