"""Speculative prefix entries: what a router believes a pod will hold because it just sent it a prompt.
Pure (the caller passes `now`).

llm-d's precise prefix scorer inserts a routed request's blocks for the chosen pod with a short TTL
(2 s), so that the requests right behind it (a burst sharing a system prompt) see them before the
engine's KV events arrive. `SpeculativeBlocks` keeps those entries apart from the exact index
(`BlockIndex` only ever holds what engines reported; `/debug/index` and its counts stay exact).

Block keys are chained (each one stands for the whole prefix up to its block), so the entries one
`add` makes are prefix-closed: a pod holding key i speculatively holds keys 0..i as well, with an
expiry at least as late (a later `add` of the same key refreshes it, and time only moves forward).
The consecutive prefix of a prompt a pod holds is therefore found by a binary search over the
prompt's keys: O(log n) probes per pod, not a walk.

Memory, in two generations: entries are added to the current one; once `ttl` has passed since the
last turn, the current generation becomes the previous one and the previous one is dropped whole
(everything in it expired: it was added at least `ttl` before). So entries live between `ttl` and
`3 x ttl`, no per-key work is ever spent on expiry, and a lookup reads the current generation, then
the previous one. At most `max_entries` (key, pod) entries are kept: an `add` that would pass it
turns the generations first, then drops the previous one (the oldest entries go early).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

Keys = npt.NDArray[np.uint64] | Sequence[int]
Generation = dict[str, dict[int, float]]  # pod -> key -> expiry


class SpeculativeBlocks:
    def __init__(self, ttl: float, max_entries: int = 1_000_000) -> None:
        if not ttl > 0:
            raise ValueError(f"speculative TTL must be > 0 seconds, got {ttl}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.ttl = ttl
        self.max_entries = max_entries
        self._cur: Generation = {}
        self._prev: Generation = {}
        self._turned = float("-inf")  # when the current generation began
        self._sizes = [0, 0]  # entries in the current and the previous generation

    def size(self) -> int:
        """(key, pod) entries kept, expired ones not yet dropped included."""
        return self._sizes[0] + self._sizes[1]

    def add(self, pod: str, keys: Keys, now: float) -> None:
        """`pod` will hold the blocks `keys` (a prompt's chained keys, from block 0), until now + ttl."""
        self._age(now)
        if len(keys) == 0:
            return
        ks = _as_list(keys)
        if len(ks) > self.max_entries:
            ks = ks[: self.max_entries]  # a prefix stays prefix-closed
        if self.size() + len(ks) > self.max_entries:
            self._turn(now)
            if self.size() + len(ks) > self.max_entries:
                self._prev, self._sizes[1] = {}, 0
        held = self._cur.get(pod)
        if held is None:
            held = self._cur[pod] = {}
        before = len(held)
        held.update(dict.fromkeys(ks, now + self.ttl))
        self._sizes[0] += len(held) - before

    def prefix(self, keys: Keys, pods: Sequence[str], now: float) -> dict[str, int]:
        """For each of `pods` with entries: how many leading blocks of `keys` it holds speculatively and
        unexpired (pods with none are left out)."""
        out: dict[str, int] = {}
        n = len(keys)
        if n == 0:
            return out
        ks: list[int] | None = None
        for pod in pods:
            cur = self._cur.get(pod)
            prev = self._prev.get(pod)
            if not cur and not prev:
                continue
            if ks is None:
                ks = _as_list(keys)
            if not _held(cur, prev, ks[0], now):
                continue  # the common cases first: nothing, or everything
            if _held(cur, prev, ks[-1], now):
                out[pod] = n
                continue
            lo, hi = 1, n - 1  # invariant: keys[:lo] held, keys[hi:] not
            while lo < hi:
                mid = (lo + hi) // 2
                if _held(cur, prev, ks[mid], now):
                    lo = mid + 1
                else:
                    hi = mid
            out[pod] = lo
        return out

    def _age(self, now: float) -> None:
        if now - self._turned >= self.ttl:
            self._turn(now)

    def _turn(self, now: float) -> None:
        """The current generation becomes the previous one (dropped whole too if it is all expired)."""
        if now - self._turned >= 2 * self.ttl:
            self._prev, self._sizes[1] = {}, 0
        else:
            self._prev, self._sizes[1] = self._cur, self._sizes[0]
        self._cur, self._sizes[0] = {}, 0
        self._turned = now


def _held(cur: dict[int, float] | None, prev: dict[int, float] | None, key: int, now: float) -> bool:
    """Whether `key` is held unexpired: the current generation's entry is the latest when it has one."""
    expires = cur.get(key) if cur else None
    if expires is None and prev:
        expires = prev.get(key)
    return expires is not None and expires > now


def _as_list(keys: Keys) -> list[int]:
    """Keys as a list of ints: a list as it is (not copied: it is only read), an array converted."""
    if isinstance(keys, list):
        return keys
    return keys.tolist() if isinstance(keys, np.ndarray) else [int(k) for k in keys]
