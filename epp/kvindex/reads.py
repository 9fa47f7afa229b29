"""The read side of the block index (`index.BlockIndex`): prefix lookups and per-pod counts. Pure.

`IndexReads` is a mixin: `BlockIndex` provides the state it reads and `_flush`, which applies queued
events first, so every read sees the effects of all the calls before it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from epp.kvindex.holdings import CHUNK_BITS, Holdings


class IndexReads:
    _h: Holdings
    _pod_ids: dict[str, int]
    _pod_names: list[str | None]
    _tier_names: list[str]

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
        np.bitwise_and.accumulate(runs, axis=2, out=runs)
        lengths = _bit_counts(runs).tolist()  # prefix length of pod bit q = blocks whose running AND has q
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


def _bit_counts(masks: npt.NDArray[np.uint32]) -> npt.NDArray[np.int64]:
    """(..., n) uint32 masks -> (..., 32): for every bit, the number of the n masks that have it."""
    as_bytes = masks.astype("<u4").view(np.uint8).reshape(*masks.shape, 4)
    bits = np.unpackbits(as_bytes, axis=-1, bitorder="little")  # (..., n, 32)
    counts: npt.NDArray[np.int64] = bits.sum(axis=-2, dtype=np.int64)
    return counts
