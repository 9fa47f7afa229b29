"""The read side of the block index (`index.BlockIndex`): prefix lookups and per-pod counts. Pure.

`IndexReads` is a mixin: `BlockIndex` provides the state it reads and `_flush`, which applies queued
events first, so every read sees the effects of all the calls before it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from epp.kvindex.holdings import CHUNK_BITS, Holdings
from epp.kvindex.prefix_walk import place_runs, walk_runs


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
        one tier, the next on another). Pods the index does not know map to {}. One compiled walk
        (`prefix_walk`) per 32-pod chunk, as far as the longest prefix any of its pods holds."""
        out: dict[str, dict[str, int]] = {name: {} for name in pods}
        known = self._known(pods)
        if not known:
            return out
        pids = [pid for _, pid in known]
        tiers = np.flatnonzero(self._h.counts[pids].any(axis=0)).tolist()
        chunks = sorted({p >> CHUNK_BITS for p in pids})
        rows = [1 << i for i in range(len(tiers))] + [(1 << len(tiers)) - 1]  # each tier, then any tier
        cols = [self._h.blocks.cols[f"m{t}"] for t in tiers]
        lengths = walk_runs(self._h.blocks, cols, rows, np.asarray(keys, dtype=np.uint64), chunks).tolist()
        chunk_at = {c: i for i, c in enumerate(chunks)}
        names = [self._tier_names[t] for t in tiers]
        for i, pid in known:
            ci, q = chunk_at[pid >> CHUNK_BITS], pid & 31
            res = {"any": lengths[-1][ci][q]}
            for ti, tname in enumerate(names):
                length = lengths[ti][ci][q]
                if length:
                    res[tname] = length
            out[pods[i]] = res
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
    ) -> npt.NDArray[np.int64]:
        """(len(order), len(pods)) block counts: row k holds, for each pod, the consecutive prefix of the
        prompt's blocks (from block 0) held on the tiers `order[:k + 1]` taken together. With `order`
        fastest first this is how an engine uses its tiers: the GPU prefix (row 0), then the prefix it
        can complete from the next tier, and so on. Tiers not in `order` count for nothing; pods the
        index does not know get 0. One compiled walk (`prefix_walk`) per 32-pod chunk, as far as the
        longest prefix any of its pods holds."""
        out = np.zeros((len(order), len(pods)), dtype=np.int64)
        known = self._known(pods)
        if not known or len(keys) == 0:
            return out
        tiers = [(k, tid) for k, t in enumerate(order) if (tid := self._tier_ids.get(t)) is not None]
        if not tiers:
            return out
        chunks = sorted({pid >> CHUNK_BITS for _, pid in known})
        cols = [self._h.blocks.cols[f"m{tid}"] for _, tid in tiers]
        rows = [(2 << r) - 1 for r in range(len(tiers))]  # row r: held on any of the first r + 1 tiers
        lengths = walk_runs(self._h.blocks, cols, rows, np.asarray(keys, dtype=np.uint64), chunks)
        row_of = {c: i for i, c in enumerate(chunks)}
        where = [-1] * (2 * len(pods))  # each pod's chunk row, then each pod's bit; -1: unknown
        for i, pid in known:
            where[i], where[len(pods) + i] = row_of[pid >> CHUNK_BITS], pid & 31
        first = np.array([k for k, _ in tiers], dtype=np.int64)
        place_runs(lengths, first, np.array(where, dtype=np.int64).reshape(2, len(pods)), out)
        return out

    def _known(self, pods: Sequence[str]) -> list[tuple[int, int]]:
        """(position in `pods`, pod id) of the pods the index holds anything for; applies the queued
        events first."""
        self._flush()
        units = self._h.units
        ids = self._pod_ids
        return [(i, pid) for i, name in enumerate(pods) if (pid := ids.get(name)) is not None and units[pid]]

    def _held(
        self, keys: npt.NDArray[np.uint64] | Sequence[int], pods: Sequence[str]
    ) -> tuple[list[tuple[str, int]], list[int], dict[int, int], npt.NDArray[np.uint32]] | None:
        """The known pods, the tiers they hold anything on, chunk -> row, and the (tier, chunk, block)
        masks of which pods hold each block; None when no pod is known."""
        known = [(pods[i], pid) for i, pid in self._known(pods)]
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


def _bit_counts(masks: npt.NDArray[np.uint32]) -> npt.NDArray[np.int64]:
    """(..., n) uint32 masks -> (..., 32): for every bit, the number of the n masks that have it."""
    as_bytes = masks.astype("<u4").view(np.uint8).reshape(*masks.shape, 4)
    bits = np.unpackbits(as_bytes, axis=-1, bitorder="little")  # (..., n, 32)
    counts: npt.NDArray[np.int64] = bits.sum(axis=-2, dtype=np.int64)
    return counts
