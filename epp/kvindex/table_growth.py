"""A hash table running out of room: relocation, the cuckoo walk, growth. Pure.

The other half of `table.HashTable` (its layout and the rules are in `table.py`): what happens when
an item's two buckets are both full (`relocate`, one vectorised cuckoo step for many items; `cuckoo`,
the classic walk for one) and when the table grows (`grow`: doubling by `split` while it is roomy,
else `rehash` into `growth` times the buckets; `bulk` places a rehash's items).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from epp.kvindex import cuckoo as loops
from epp.kvindex.probe import BUCKET, Array, Index

if TYPE_CHECKING:
    from epp.kvindex.table import HashTable

_SLOTS: Final = np.arange(BUCKET)
_MAX_KICKS: Final = 256
RELOCATE_ROUNDS: Final = 8  # vectorised cuckoo steps before the walk, one item at a time
_REHASH_ITEMS: Final = 1 << 20
_SPLIT_ITEMS: Final = 1 << 15
"""Old slots a split takes at a time: its index temporaries (~256 KB each) come back from malloc's heap
each time, where larger ones would be fresh mappings, paid again in page faults at every doubling."""


def relocate(
    table: HashTable, todo: Index, keys: npt.NDArray[np.uint64], tags: Array, values: Mapping[str, Array]
) -> npt.NDArray[np.bool_]:
    """One vectorised cuckoo step for items whose buckets are both full: move an occupant of one
    of them to its other bucket when that has room, and take its slot. Returns the items placed."""
    b1, b2 = table._pairs(keys[todo], tags[todo])
    cand = np.concatenate([b1[:, None] * BUCKET + _SLOTS, b2[:, None] * BUCKET + _SLOTS], axis=1)
    flat = cand.ravel()
    o1, o2 = table._pairs(table.keys[flat], table.tags[flat])
    home = flat // BUCKET
    alt = np.where(o1 == home, o2, o1).reshape(cand.shape)
    free = table.count[alt] < BUCKET
    choice = free.argmax(axis=1)
    rows = np.flatnonzero(free[np.arange(len(todo)), choice])
    vslot = cand[rows, choice[rows]]
    valt = alt[rows, choice[rows]]
    _, keep = np.unique(vslot, return_index=True)  # two items may pick the same occupant
    keep.sort()
    rows, vslot, valt = rows[keep], vslot[keep], valt[keep]
    order = np.argsort(valt, kind="stable")
    sv = valt[order]
    start = np.r_[True, sv[1:] != sv[:-1]]
    first_pos = np.maximum.accumulate(np.where(start, np.arange(len(sv)), 0))
    rank = np.empty(len(sv), dtype=np.intp)
    rank[order] = np.arange(len(sv)) - first_pos
    used = table.count[valt].astype(np.intp)
    ok = rank < BUCKET - used
    rows, vslot, valt = rows[ok], vslot[ok], valt[ok]
    dest = valt * BUCKET + used[ok] + rank[ok]
    table.keys[dest] = table.keys[vslot]
    table.tags[dest] = table.tags[vslot]
    for col in table.cols.values():
        col[dest] = col[vslot]
    grp, cnt = np.unique(valt, return_counts=True)
    table.count[grp] += cnt.astype(np.uint8)
    items = todo[rows]
    table._write(vslot, keys[items], tags[items], values, items, empty=False)
    placed = np.zeros(len(todo), dtype=bool)
    placed[rows] = True
    table.size += len(rows)
    return placed


def cuckoo(table: HashTable, key: int, tag: int, row: dict[str, Any]) -> bool:
    """Place one item whose buckets are both full by a cuckoo walk; True when other items moved."""
    for step in range(_MAX_KICKS):
        b1, b2 = table._pair(key, tag)
        for b in (b1, b2):
            if table.count[b] < BUCKET:
                at = b * BUCKET + int(table.count[b])
                table.keys[at], table.tags[at] = key, tag
                for name, col in table.cols.items():
                    col[at] = row.get(name, table.specs[name][1])
                table.count[b] += 1
                table.size += 1
                return step > 0
        b = b1 if step % 2 == 0 else b2
        at = b * BUCKET + (step * 5 + 3) % BUCKET
        old_key, old_tag = int(table.keys[at]), int(table.tags[at])
        old_row = {name: col[at] for name, col in table.cols.items()}
        table.keys[at], table.tags[at] = key, tag
        for name, col in table.cols.items():
            col[at] = row.get(name, table.specs[name][1])
        key, tag, row = old_key, old_tag, old_row
    # The walk failed: grow, rehash, and place the item still in hand.
    grow(table, table.size + 1)
    vals = {name: np.array([v], dtype=table.specs[name][0]) for name, v in row.items()}
    table.insert(np.array([key], dtype=np.uint64), np.array([tag], dtype=table.tag_dtype), vals)
    return True


def grow(table: HashTable, items: int) -> None:
    """Grow so that `items` fit: roomy tables double (see Growth), others grow by `growth` at least (so
    the load right after is max_load / growth)."""
    if items < table.roomy_until:
        if items <= table.roomy_load * 2 * table.capacity:
            split(table)
        else:
            rehash(table, int(items / (table.roomy_load * BUCKET)) + 1)
        return
    rehash(table, max(int(table.nb * table.growth) + 1, int(items / (table.max_load * BUCKET)) + 1))


def split(table: HashTable) -> None:
    """Double the buckets. An item in bucket b (its first or second choice) has the same choice among
    buckets 2b and 2b + 1 of the new table (bucket numbers are (32-bit hash * buckets) >> 32): each old
    bucket splits into two without overflow (`cuckoo.split_run`). Items whose pair was adjusted (equal
    choices) go last."""
    old_keys, old_tags, old_count, old_cols, old_nb = (
        table.keys,
        table.tags,
        table.count,
        table.cols,
        table.nb,
    )
    table._alloc(2 * old_nb)
    step = max(1, _SPLIT_ITEMS // BUCKET)  # old buckets at a time
    room = min(step, old_nb) * BUCKET
    src = np.empty(room, dtype=np.intp)
    dest = np.empty(room, dtype=np.intp)
    left = np.empty(room, dtype=np.intp)
    rest: list[Index] = []
    for lo in range(0, old_nb, step):
        moved, nleft = loops.split_run(
            old_keys, old_tags, old_count, old_nb, lo, min(old_nb, lo + step),
            table.keys, table.tags, table.count, src, dest, left,
        )  # fmt: skip
        for name, col in table.cols.items():
            loops.move_rows(col, old_cols[name], src, dest, moved)
        table.size += moved
        if nleft:
            rest.append(left[:nleft].copy())
    if rest:
        slots = np.concatenate(rest)
        bulk(table, old_keys[slots], old_tags[slots], {name: col[slots] for name, col in old_cols.items()})


def rehash(table: HashTable, buckets: int) -> None:
    """Move everything into a table of `buckets` buckets, a slice of the old one at a time (bounded
    temporaries)."""
    old_keys, old_tags, old_count, old_cols = table.keys, table.tags, table.count, table.cols
    old_nb = table.nb
    table._alloc(buckets)
    step = max(1, _REHASH_ITEMS // BUCKET)
    for lo in range(0, old_nb, step):
        hi = min(old_nb, lo + step)
        occ = lo * BUCKET + np.flatnonzero(_SLOTS[None, :] < old_count[lo:hi, None])
        values = {name: col[occ] for name, col in old_cols.items()}
        bulk(table, old_keys[occ], old_tags[occ], values)


def bulk(table: HashTable, keys: npt.NDArray[np.uint64], tags: Array, values: Mapping[str, Array]) -> None:
    """Place distinct, absent items in a table with room for them (rehash): by sorting on the target
    bucket, first bucket then second, then the cuckoo steps for the rest."""
    b1, b2 = table._pairs(keys, tags)
    todo = np.arange(len(keys))
    for choice in (b1, b2):
        if todo.size == 0:
            break
        tgt = choice[todo]
        order = np.argsort(tgt, kind="stable")
        st = tgt[order]
        start = np.r_[True, st[1:] != st[:-1]]
        rank = np.arange(len(st)) - np.maximum.accumulate(np.where(start, np.arange(len(st)), 0))
        used = table.count[st].astype(np.intp)
        ok = rank < BUCKET - used
        put = todo[order[ok]]
        table._write(st[ok] * BUCKET + used[ok] + rank[ok], keys[put], tags[put], values, put)
        grp = st[ok][start[ok]]
        sizes = np.diff(np.r_[np.flatnonzero(start[ok]), ok.sum()])
        table.count[grp] += sizes.astype(np.uint8)
        table.size += len(put)
        todo = todo[order[~ok]]
    for _ in range(RELOCATE_ROUNDS):
        if todo.size == 0:
            return
        placed = relocate(table, todo, keys, tags, values)
        if not placed.any():
            break
        todo = todo[~placed]
    for i in todo.tolist():
        cuckoo(table, int(keys[i]), int(tags[i]), {name: values[name][i] for name in values})
