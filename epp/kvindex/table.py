"""A bucketized cuckoo hash table over numpy arrays: (uint64 key, small tag) -> slot. Pure.

Every item has two candidate buckets of `BUCKET` slots, both derived from one 64-bit mix of key and tag.
A lookup reads at most two buckets (two contiguous runs of slots); the table runs at up to 92 % load
(memory is the point). The occupied slots of a bucket are always its first `count[b]`: a deletion
compacts the bucket. Payload columns (named 1-D arrays) move with their items, so a slot number is only
valid until the next insert or delete of the same table.

Tags are unsigned ints of a fixed dtype; the dtype's maximum marks an empty slot and is never a valid
tag. Inserting, finding and deleting are compiled loops (`cuckoo.py`): an item goes to the emptier of
its two buckets; the few whose buckets are both full take a vectorised cuckoo step and then the classic
walk, one at a time, and a walk that fails grows the table (`table_growth.py`). The batched read probe
for many items at once is `probe.py`.

Growth. A large table runs at up to `max_load` and grows by `growth` (memory is the point). One holding
fewer than `roomy_until` items runs at up to `roomy_load` and doubles: inserts rarely meet a full bucket,
and doubling needs no rehash (`table_growth.split`), so growing from empty costs one move per item, not
1 / (growth - 1).
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from epp.kvindex import cuckoo, probe, table_growth
from epp.kvindex.keys import MASK64, fmix_array
from epp.kvindex.probe import _LOW32, _TAG_MUL, _U32, _U_TAG_MUL, BUCKET, Array, Bools, Index

_SLOTS: Final = np.arange(BUCKET)

_MMAP_BYTES: Final = 1 << 20
_HUGE_PAGE: Final = 1 << 21  # x86-64's transparent huge page (the kernel's hpage_pmd_size)
_TWO64: Final = 1 << 64
_KICK_ITEMS: Final = 16  # items set aside that `_settle` places one by one
_I64MAX: Final = (1 << 63) - 1


def filled(n: int, dtype: type[np.generic], value: int) -> Array:
    """An array of n `value`s. Large ones live in their own anonymous memory mapping, so that the
    memory returns to the OS as soon as the array is dropped (a table that grows frees its old arrays;
    from malloc's heap they would stay resident as fragments).

    Such an array starts on a 2 MB boundary of a private mapping advised for transparent huge pages,
    and the mapping holds its last 2 MB page whole: the kernel backs only aligned 2 MB ranges inside a
    mapping with huge pages, and mmap's 4 KB alignment (or a shared mapping, which is shmem) left the
    advice without effect. Where a page fault is dear (a VM: 32 MB take ~23 ms in 4 KB faults and
    ~2.5 ms in 2 MB ones) that makes a table's growth about half as costly (`benchmarks/kv_ingest.py`:
    16,700 page faults -> ~1,500 for the 528,000 block events). The padding in front is address space
    only; the rest of the last huge page is resident with the array (under 2 MB per array)."""
    size = n * np.dtype(dtype).itemsize
    if size < _MMAP_BYTES:
        return np.full(n, value, dtype=dtype)
    huge = hasattr(mmap, "MADV_HUGEPAGE")
    span = -(-size // _HUGE_PAGE) * _HUGE_PAGE + _HUGE_PAGE - mmap.PAGESIZE if huge else size
    # private: a shared anonymous mapping is shmem, which takes no huge pages
    mem = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = 0
    if huge:
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KB pages
            mem.madvise(mmap.MADV_HUGEPAGE)
        offset = -np.frombuffer(mem, dtype=np.uint8, count=1).ctypes.data % _HUGE_PAGE
    arr: Array = np.frombuffer(mem, dtype=dtype, count=n, offset=offset)
    if value:
        arr.fill(value)
    return arr


class HashTable:
    def __init__(
        self,
        tag_dtype: type[np.unsignedinteger[Any]],
        columns: Mapping[str, tuple[type[np.generic], int]],
        *,
        buckets: int = 16,
        max_load: float = 0.92,
        growth: float = 1.3,
        roomy_until: int = 0,
        roomy_load: float = 0.75,
    ) -> None:
        """`columns`: name -> (dtype, value of an empty slot). `roomy_until`, `roomy_load`: see Growth."""
        self.tag_dtype = np.dtype(tag_dtype)
        self.empty_tag = int(np.iinfo(self.tag_dtype).max)
        self.max_load = max_load
        self.growth = growth
        self.roomy_until = roomy_until
        self.roomy_load = roomy_load
        self.specs: dict[str, tuple[type[np.generic], int]] = dict(columns)
        self.size = 0
        self._alloc(max(2, buckets))

    def _alloc(self, buckets: int) -> None:
        self.nb = buckets
        cap = buckets * BUCKET
        self.keys: npt.NDArray[np.uint64] = filled(cap, np.uint64, 0)
        self.tags: Array = filled(cap, self.tag_dtype.type, self.empty_tag)
        self.count: npt.NDArray[np.uint8] = filled(buckets, np.uint8, 0)
        self.cols: dict[str, Array] = {n: filled(cap, t, d) for n, (t, d) in self.specs.items()}
        self._scratch: npt.NDArray[np.int32] = filled(buckets, np.int32, 0)  # one winner per bucket
        self.size = 0

    @property
    def capacity(self) -> int:
        return self.nb * BUCKET

    def nbytes(self) -> int:
        return int(
            self.keys.nbytes
            + self.tags.nbytes
            + self.count.nbytes
            + sum(c.nbytes for c in self.cols.values())
        )

    def room(self) -> int:
        """Inserts left before the table reaches its load limit (see Growth)."""
        load = self.roomy_load if self.size + 1 < self.roomy_until else self.max_load
        return int(load * self.capacity) - self.size

    def reserve(self, n: int) -> bool:
        """Grow, if need be, so that `n` more items fit under the load limit; whether it grew (then items
        moved)."""
        after = self.size + n
        if after <= (self.roomy_load if after < self.roomy_until else self.max_load) * self.capacity:
            return False
        table_growth.grow(self, after)
        return True

    def add_column(self, name: str, dtype: type[np.generic], empty: int) -> None:
        self.specs[name] = (dtype, empty)
        self.cols[name] = filled(self.capacity, dtype, empty)

    # -- hashing -----------------------------------------------------------------------
    def _pairs(self, keys: npt.NDArray[np.uint64], tags: Array) -> tuple[Index, Index]:
        h = fmix_array(keys ^ (tags.astype(np.uint64) * _U_TAG_MUL))
        nb = np.uint64(self.nb)
        b1 = (((h >> _U32) * nb) >> _U32).astype(np.intp)
        b2 = (((h & _LOW32) * nb) >> _U32).astype(np.intp)
        same = b1 == b2
        b2[same] = (b1[same] + 1) % self.nb
        return b1, b2

    def _pair(self, key: int, tag: int) -> tuple[int, int]:
        x = key ^ ((tag * _TAG_MUL) & MASK64)  # fmix, inlined
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & MASK64
        x ^= x >> 33
        x = (x * 0xC4CEB9FE1A85EC53) & MASK64
        x ^= x >> 33
        nb = self.nb
        b1 = ((x >> 32) * nb) >> 32
        b2 = ((x & 0xFFFFFFFF) * nb) >> 32
        return b1, (b1 + 1) % nb if b2 == b1 else b2

    # -- lookup --------------------------------------------------------------------------
    def find(self, keys: npt.NDArray[np.uint64], tags: Array) -> Index:
        """Slot of each (key, tag), -1 where absent."""
        out = np.empty(len(keys), dtype=np.intp)
        if len(keys):
            keys, tags = self._typed(keys, tags)
            cuckoo.find_run(self.keys, self.tags, self.count, self.nb, keys, tags, out)
        return out

    def _typed(self, keys: npt.NDArray[np.uint64], tags: Array) -> tuple[npt.NDArray[np.uint64], Array]:
        """Keys and tags in the table's dtypes (the compiled loops are typed by them)."""
        return keys.astype(np.uint64, copy=False), np.asarray(tags).astype(self.tag_dtype, copy=False)

    def locate(self, keys: npt.NDArray[np.uint64], tags: Array | Sequence[int]) -> tuple[Index, Bools]:
        """The batched read probe. With `tags` an array (one tag per key), item i is (keys[i], tags[i]);
        with a list of S tags, item s * len(keys) + i is (keys[i], tags[s]): every key under every tag,
        without tiled copies of `keys`. Returns the slot of every item, a valid index even where absent
        (so that columns can be gathered without a filter first), and whether the item is present."""
        slot, found, _ = probe.locate(self, keys, tags)
        return slot, found

    def find_one(self, key: int, tag: int) -> int:
        """Slot of (key, tag) or -1, for one item (cheaper than a batch of one): the compiled probe, the key
        passed as the signed int of its bits."""
        if self.size == 0:
            return -1
        signed = key - _TWO64 if key > _I64MAX else key
        return int(cuckoo.find_scalar(self.keys, self.tags, self.count, self.nb, signed, tag))

    def occupied(self) -> Index:
        return np.flatnonzero(_SLOTS[None, :] < self.count[:, None])

    # -- insert --------------------------------------------------------------------------
    def upsert(
        self, keys: npt.NDArray[np.uint64], tags: Array, values: Mapping[str, Array]
    ) -> tuple[Index, npt.NDArray[np.bool_]]:
        """Slot of every (key, tag), inserting the absent ones with their column values (an item present
        several times in the batch is inserted once, with the values of its first occurrence). Returns
        the slots and which items were inserted (one per distinct new item).

        Items are placed in order by the compiled loop (`cuckoo.upsert_run`); one whose two buckets are
        both full goes through `_insert` (relocation, the cuckoo walk, growth), and the table grows, as
        `_insert` would, when the absent items left would take it past its load limit."""
        slots, new, _ = self._upsert(keys, tags, values)
        return slots, new

    def _upsert(
        self, keys: npt.NDArray[np.uint64], tags: Array, values: Mapping[str, Array]
    ) -> tuple[Index, npt.NDArray[np.bool_], bool]:
        """`upsert`, and whether items already in the table moved."""
        n = len(keys)
        slots = np.full(n, -1, dtype=np.intp)
        new = np.zeros(n, dtype=bool)
        if n == 0:
            return slots, new, False
        keys, tags = self._typed(keys, tags)
        moved = False
        stuck = np.empty(n, dtype=np.intp)
        nstuck = 0
        i = 0
        while True:
            room = self.room()
            j, code, nstuck = cuckoo.upsert_run(
                self.keys, self.tags, self.count, self.nb, keys, tags, i, room, slots, new, stuck, nstuck
            )
            placed = i + np.flatnonzero(new[i:j])
            if placed.size:
                self.size += len(placed)
                self._write_columns(slots[placed], values, placed)  # the loop wrote keys and tags
            if code == cuckoo.NO_ROOM:  # grow for every absent item left, as `_insert` does for a batch
                absent = nstuck + int(np.count_nonzero(self.find(keys[j:], tags[j:]) < 0))
                table_growth.grow(self, self.size + absent)
                moved = True
            if nstuck:  # set aside (both buckets full): placed before any later item, which may repeat one
                moved |= self._settle(stuck[:nstuck], keys, tags, values, slots, new)
                nstuck = 0
            if code == cuckoo.DONE:
                break
            i = j
        if moved:
            slots = self.find(keys, tags)
        return slots, new, moved

    def _settle(
        self,
        items: Index,
        keys: npt.NDArray[np.uint64],
        tags: Array,
        values: Mapping[str, Array],
        slots: Index,
        new: npt.NDArray[np.bool_],
    ) -> bool:
        """Place absent `items` of an upsert (relocation, the cuckoo walk, growth: `_insert`); a later
        copy of one of them is not placed again. Returns whether other items moved (then `slots` are
        stale). A few (what one small flush meets now and then) take one compiled cuckoo step each
        (`cuckoo.kick_place`); `_insert`'s vectorised relocation costs ~40 numpy calls."""
        moved = False
        if len(items) <= _KICK_ITEMS:
            rest: list[int] = []
            for i in items.tolist():
                at = self.find_one(int(keys[i]), int(tags[i]))  # a copy of an item placed just before
                # Once one goes to `_insert`, so do all after it: the first copy of an item is the one
                # placed (and `new`), and `_insert` places its items in order.
                if at < 0 and not rest and self.room() > 0:
                    at, src, dest = cuckoo.kick_place(
                        self.keys, self.tags, self.count, self.nb, keys[i], tags[i]
                    )
                    if at >= 0:
                        for name, col in self.cols.items():
                            if src >= 0:  # (an occupant moved out of the item's slot)
                                col[dest] = col[src]
                            col[at] = values[name][i] if name in values else self.specs[name][1]
                        self.size += 1
                        new[i] = True
                        moved = True
                if at < 0:
                    rest.append(i)
                else:
                    slots[i] = at
            if not rest:
                return moved
            items = np.array(rest, dtype=np.intp)
        slot_of, placed, more = self._insert(items, keys, tags, values, dedupe=True)
        moved |= more
        new[placed] = True
        slots[placed] = slot_of[placed]
        if not moved:
            left = items[slots[items] < 0]  # later copies of a placed item
            slots[left] = self.find(keys[left], tags[left])
        return moved

    def insert(
        self, keys: npt.NDArray[np.uint64], tags: Array, values: Mapping[str, Array]
    ) -> tuple[Index, bool]:
        """Insert new, distinct (key, tag) items with their column values. Returns their slots, and
        whether items already in the table moved (then earlier slot numbers are stale)."""
        if len(keys) == 0:
            return np.zeros(0, dtype=np.intp), False
        slots, _, moved = self._upsert(keys, tags, values)
        return slots, moved

    def _insert(
        self,
        items: Index,
        keys: npt.NDArray[np.uint64],
        tags: Array,
        values: Mapping[str, Array],
        *,
        dedupe: bool,
        pairs: tuple[Index, Index] | None = None,
    ) -> tuple[Index, Index, bool]:
        """Place `items` (indices into keys / tags / values). Returns the slot of each placed item (by
        index; valid unless items moved), the items placed (with `dedupe`, a later copy of an item is
        not placed) and whether other items moved."""
        moved = self.reserve(len(items))
        if moved:
            pairs = None
        b1, b2 = pairs if pairs is not None else self._pairs(keys[items], tags[items])
        pos = np.full(len(keys), -1, dtype=np.intp)
        pos[items] = np.arange(len(items))
        slot_of = np.full(len(keys), -1, dtype=np.intp)
        placed: list[Index] = []
        todo = items
        while todo.size:
            p = pos[todo]
            c1, c2 = b1[p], b2[p]
            tgt = np.where(self.count[c2] < self.count[c1], c2, c1)
            room = self.count[tgt] < BUCKET
            stuck = todo[~room]
            todo, tgt = todo[room], tgt[room]
            self._scratch[tgt[::-1]] = todo[::-1]  # the first item aiming at a bucket wins it this round
            win = self._scratch[tgt] == todo
            w, wt = todo[win], tgt[win]
            at = wt * BUCKET + self.count[wt]
            self._write(at, keys[w], tags[w], values, w)
            slot_of[w] = at
            self.count[wt] += 1
            self.size += len(w)
            placed.append(w)
            todo = todo[~win]
            if dedupe and todo.size:  # a copy of an item placed this round is no longer absent
                todo = todo[self.find(keys[todo], tags[todo]) < 0]
            if stuck.size:
                if dedupe:
                    stuck = stuck[self.find(keys[stuck], tags[stuck]) < 0]
                    h = fmix_array(keys[stuck] ^ (tags[stuck].astype(np.uint64) * _U_TAG_MUL))
                    _, first = np.unique(h, return_index=True)
                    stuck = stuck[np.sort(first)]
                for _ in range(table_growth.RELOCATE_ROUNDS):
                    if stuck.size == 0:
                        break
                    ok = table_growth.relocate(self, stuck, keys, tags, values)
                    if not ok.any():
                        break
                    moved = True
                    placed.append(stuck[ok])
                    stuck = stuck[~ok]
                for i in stuck.tolist():
                    row = {name: values[name][i] for name in values}
                    moved |= table_growth.cuckoo(self, int(keys[i]), int(tags[i]), row)
                placed.append(stuck)
                if moved and todo.size:  # bucket numbers may have changed (rehash)
                    b1, b2 = self._pairs(keys[items], tags[items])
        return slot_of, np.concatenate([np.zeros(0, dtype=np.intp), *placed]), moved

    def _write(
        self,
        at: Index,
        keys: npt.NDArray[np.uint64],
        tags: Array,
        values: Mapping[str, Array],
        src: Index,
        *,
        empty: bool = True,
    ) -> None:
        """Write items to slots; `empty`: the slots are free (past their bucket's count), and free slots
        hold every column's empty value, so columns without values need no write."""
        self.keys[at] = keys
        self.tags[at] = tags
        self._write_columns(at, values, src)
        if not empty:
            for name, col in self.cols.items():
                if name not in values:
                    col[at] = self.specs[name][1]

    def _write_columns(self, at: Index, values: Mapping[str, Array], src: Index) -> None:
        """The given columns of items at slots whose keys and tags are written (`_write`, or the loop)."""
        for name, v in values.items():
            self.cols[name][at] = v[src]

    # -- delete --------------------------------------------------------------------------
    def delete(self, slots: Index) -> None:
        """Delete the items at `slots` (occupied; duplicates allowed); compacts their buckets
        (`cuckoo.delete_run`, which moves keys and tags; the columns follow here)."""
        n = len(slots)
        if n == 0:
            return
        room = min(n * BUCKET, self.capacity)  # a bucket frees or moves at most BUCKET slots
        src = np.empty(room, dtype=np.intp)
        dest = np.empty(room, dtype=np.intp)
        tail = np.empty(room, dtype=np.intp)
        moves, freed = cuckoo.delete_run(
            self.keys,
            self.tags,
            self.count,
            self.empty_tag,
            slots.astype(np.intp, copy=False),
            src,
            dest,
            tail,
        )
        src, dest, tail = src[:moves], dest[:moves], tail[:freed]
        for name, col in self.cols.items():
            if moves:
                col[dest] = col[src]
            col[tail] = self.specs[name][1]
        self.size -= freed
