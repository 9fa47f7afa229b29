"""The read side of the block index (`index.BlockIndex`): prefix lookups and per-pod counts. Pure.

`IndexReads` is a mixin: `BlockIndex` provides the state it reads and `_flush`, which applies queued
events first, so every read sees the effects of all the calls before it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import cast

import numpy as np
import numpy.typing as npt

from epp.kvindex.holdings import CHUNK_BITS, Holdings


class IndexReads:
    _h: Holdings
    _pod_ids: dict[str, int]
    _pod_names: list[str | None]
    _tier_names: list[str]
    _tier_ids: dict[str, int]

    def _flush(self) -> None:
        raise NotImplementedError

    def lookup(
        self, keys: npt.NDArray[np.uint64] | Sequence[int], pods: Sequence[str]
    ) -> dict[str, dict[str, int]]:
        """For each pod: for each tier on which the pod holds a consecutive prefix of the prompt's blocks
        (from block 0), its length; plus "any": the consecutive prefix held on any tier (a block may sit on
        one tier, the next on another). Pods the index does not know map to {}. One pass: one batched
        probe per (key, 32-pod chunk), then running ANDs of the pod bit masks."""
        out: dict[str, dict[str, int]] = {name: {} for name in pods}
        held = self._held(keys, pods)
        if held is None:
            return out
        known, tiers, chunk_at, masks = held
        runs = np.empty((len(tiers) + 1, *masks.shape[1:]), dtype=np.uint32)
        runs[:-1] = masks
        np.bitwise_or.reduce(masks, axis=0, out=runs[-1])
        lengths = prefix_runs(runs).tolist()  # [tier][chunk][pod bit]: leading run of blocks held
        names = [self._tier_names[t] for t in tiers]
        for name, pid in known:
            ci, q = chunk_at[pid >> CHUNK_BITS], pid & 31
            res = {"any": lengths[-1][ci][q]}
            for ti, tname in enumerate(names):
                length = lengths[ti][ci][q]
                if length:
                    res[tname] = length
            out[name] = res
        return out

    def lookup_weighted(
        self,
        keys: npt.NDArray[np.uint64] | Sequence[int],
        pods: Sequence[str],
        weights: Mapping[str, float],
        unknown: float = 0.0,
    ) -> dict[str, float]:
        """For each pod the index knows: the sum, over the consecutive prefix of the prompt's blocks held on
        any tier ("any" of `lookup`), of the weight of the best tier holding each block there (`weights`
        by tier name, `unknown` for tiers not in it). Pods the index does not know are left out."""
        by_tier = self.lookup_by_best_tier(keys, pods, lambda tier: weights.get(tier, unknown))
        return {pod: sum(n * weights.get(t, unknown) for t, n in c.items()) for pod, c in by_tier.items()}

    def lookup_by_best_tier(
        self,
        keys: npt.NDArray[np.uint64] | Sequence[int],
        pods: Sequence[str],
        rank: Callable[[str], float],
    ) -> dict[str, dict[str, int]]:
        """For each pod the index knows: how many blocks of the consecutive prefix held on any tier ("any"
        of `lookup`) have each tier as their best copy there, best = highest `rank(tier)`. Only tiers
        with a nonzero count appear; pods the index does not know are left out."""
        held = self._held(keys, pods)
        if held is None:
            return {}
        known, tiers, chunk_at, masks = held
        run = np.bitwise_or.reduce(masks, axis=0)
        np.bitwise_and.accumulate(run, axis=1, out=run)
        covered = np.zeros_like(run)
        names = [self._tier_names[t] for t in tiers]
        per_tier: list[tuple[str, list[list[int]]]] = []
        for i in sorted(range(len(tiers)), key=lambda i: -rank(names[i])):
            per_tier.append((names[i], _bit_counts(masks[i] & run & ~covered).tolist()))
            covered |= masks[i]
        out: dict[str, dict[str, int]] = {}
        for name, pid in known:
            ci, q = chunk_at[pid >> CHUNK_BITS], pid & 31
            out[name] = {t: c[ci][q] for t, c in per_tier if c[ci][q]}
        return out

    def lookup_tier_runs(
        self,
        keys: npt.NDArray[np.uint64] | Sequence[int],
        pods: Sequence[str],
        order: Sequence[str],
        window: int = 256,
    ) -> npt.NDArray[np.int64]:
        """(len(order), len(pods)) block counts: row k holds, for each pod, the consecutive prefix of the
        prompt's blocks (from block 0) held on the tiers `order[:k + 1]` taken together. With `order`
        fastest first this is how an engine uses its tiers: the GPU prefix (row 0), then the prefix it
        can complete from the next tier, and so on. Tiers not in `order` count for nothing; pods the
        index does not know get 0. The first `window` keys are probed for every 32-pod chunk, the rest
        only for chunks where some pod's prefix reaches the window's end."""
        self._flush()
        out = np.zeros((len(order), len(pods)), dtype=np.int64)
        n = len(keys)
        units = self._h.units
        ids = self._pod_ids
        cols = [(i, pid) for i, name in enumerate(pods) if (pid := ids.get(name)) is not None and units[pid]]
        if not cols or n == 0:
            return out
        pids = np.array([p for _, p in cols], dtype=np.intp)
        holds = cast(list[bool], self._h.counts[pids].any(axis=0).tolist())
        present = [
            (k, tid) for k, t in enumerate(order) if (tid := self._tier_ids.get(t)) is not None and holds[tid]
        ]
        if not present:
            return out
        tids = [tid for _, tid in present]
        chunks = sorted({p >> CHUNK_BITS for p in pids.tolist()})
        arr = np.asarray(keys, dtype=np.uint64)
        w = min(n, window)
        masks = self._h.masks(arr[:w], chunks, tids)
        if w < n:
            alive = np.flatnonzero(np.bitwise_and.reduce(np.bitwise_or.reduce(masks, axis=0), axis=1))
            full = np.zeros((len(tids), len(chunks), n), dtype=np.uint32)
            full[:, :, :w] = masks
            if alive.size:
                full[:, alive, w:] = self._h.masks(arr[w:], [chunks[c] for c in alive.tolist()], tids)
            masks = full
        for k in range(1, len(tids)):  # row k: held on any of the first k + 1 tiers
            np.bitwise_or(masks[k], masks[k - 1], out=masks[k])
        lengths = prefix_runs(masks)  # (present tiers, chunks, 32)
        row_of = {c: i for i, c in enumerate(chunks)}
        at = np.array([i for i, _ in cols], dtype=np.intp)
        per = lengths[:, [row_of[p >> CHUNK_BITS] for p in pids.tolist()], pids & 31]
        for (k, _), row in zip(present, per, strict=True):
            out[k:, at] = row  # a tier the pods hold nothing on continues the union before it
        return out

    def _held(
        self, keys: npt.NDArray[np.uint64] | Sequence[int], pods: Sequence[str]
    ) -> tuple[list[tuple[str, int]], list[int], dict[int, int], npt.NDArray[np.uint32]] | None:
        """The known pods, the tiers they hold anything on, chunk -> row, and the (tier, chunk, block)
        masks of which pods hold each block; None when no pod is known."""
        self._flush()
        units = self._h.units
        known = [(name, pid) for name in pods if (pid := self._pod_ids.get(name)) is not None and units[pid]]
        if not known:
            return None
        arr = np.asarray(keys, dtype=np.uint64)
        pids = np.array([p for _, p in known], dtype=np.intp)
        tiers = np.flatnonzero(self._h.counts[pids].any(axis=0)).tolist()
        chunks = sorted({p >> CHUNK_BITS for _, p in known})
        masks = self._h.masks(arr, chunks, tiers)
        return known, tiers, {c: i for i, c in enumerate(chunks)}, masks

    def pod_counts(self, pod: str) -> dict[str, int]:
        """Blocks (entries) per tier held by the pod."""
        self._flush()
        pid = self._pod_ids.get(pod)
        if pid is None:
            return {}
        row = self._h.counts[pid].tolist()
        return {self._tier_names[t]: row[t] for t in range(len(self._tier_names)) if row[t]}

    def pods(self) -> list[str]:
        """Pods holding anything (sorted)."""
        self._flush()
        units = self._h.units
        return sorted(n for pid, n in enumerate(self._pod_names) if n is not None and units[pid] > 0)


_DENSE = 256  # more mask changes than this per row: the vectorised running AND is cheaper


def prefix_runs(masks: npt.NDArray[np.uint32]) -> npt.NDArray[np.int64]:
    """(..., n) uint32 masks -> (..., 32): for every bit, how many leading masks have it (the length of
    its run from position 0). Walks only the positions where a row's mask changes (a prompt's masks
    change where some pod's prefix ends: a few times, not n), so the cost is a comparison pass plus
    a short loop; rows that change often fall back to a vectorised running AND."""
    n = masks.shape[-1]
    if n == 0 or masks.size == 0:
        return np.zeros((*masks.shape[:-1], 32), dtype=np.int64)
    flat = masks.reshape(-1, n)
    changes = np.empty(flat.shape, dtype=bool)
    changes[:, 0] = True
    np.not_equal(flat[:, 1:], flat[:, :-1], out=changes[:, 1:])
    rows, cols = np.nonzero(changes)
    if len(rows) > _DENSE * len(flat):
        run = np.bitwise_and.accumulate(flat, axis=1)
        return _bit_counts(run).reshape(*masks.shape[:-1], 32)
    out = [[0] * 32 for _ in range(len(flat))]
    values, row_of, at = flat[rows, cols].tolist(), rows.tolist(), cols.tolist()
    k, total = 0, len(row_of)
    while k < total:
        r, run = row_of[k], values[k]
        lengths = out[r]
        k += 1
        while k < total and row_of[k] == r and run:
            kept = run & values[k]
            lost = run ^ kept
            while lost:
                low = lost & -lost
                lengths[low.bit_length() - 1] = at[k]
                lost ^= low
            run = kept
            k += 1
        while k < total and row_of[k] == r:  # the run is over: the rest of the row cannot matter
            k += 1
        while run:
            low = run & -run
            lengths[low.bit_length() - 1] = n
            run ^= low
    return np.array(out, dtype=np.int64).reshape(*masks.shape[:-1], 32)


def _bit_counts(masks: npt.NDArray[np.uint32]) -> npt.NDArray[np.int64]:
    """(..., n) uint32 masks -> (..., 32): for every bit, the number of the n masks that have it."""
    as_bytes = masks.astype("<u4").view(np.uint8).reshape(*masks.shape, 4)
    bits = np.unpackbits(as_bytes, axis=-1, bitorder="little")  # (..., n, 32)
    counts: npt.NDArray[np.int64] = bits.sum(axis=-2, dtype=np.int64)
    return counts
