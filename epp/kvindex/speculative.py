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

Memory: each entry lives `ttl` seconds; expired `add`s are dropped, oldest first, whenever entries
are added, and at most `max_entries` (key, pod) entries are kept (the oldest `add`s go first).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

Keys = npt.NDArray[np.uint64] | Sequence[int]


class SpeculativeBlocks:
    def __init__(self, ttl: float, max_entries: int = 1_000_000) -> None:
        if not ttl > 0:
            raise ValueError(f"speculative TTL must be > 0 seconds, got {ttl}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.ttl = ttl
        self.max_entries = max_entries
        self._pods: dict[str, dict[int, float]] = {}  # pod -> key -> expiry
        self._adds: deque[tuple[float, str, list[int]]] = deque()  # in expiry order (one TTL)
        self._entries = 0  # sum of the pods' dict sizes

    def size(self) -> int:
        """(key, pod) entries kept, expired ones not yet dropped included."""
        return self._entries

    def add(self, pod: str, keys: Keys, now: float) -> None:
        """`pod` will hold the blocks `keys` (a prompt's chained keys, from block 0), until now + ttl."""
        self._drop(now)
        if len(keys) == 0:
            return
        ks = keys.tolist() if isinstance(keys, np.ndarray) else [int(k) for k in keys]
        if len(ks) > self.max_entries:
            ks = ks[: self.max_entries]  # a prefix stays prefix-closed
        expires = now + self.ttl
        held = self._pods.get(pod)
        if held is None:
            held = self._pods[pod] = {}
        before = len(held)
        held.update(dict.fromkeys(ks, expires))
        self._entries += len(held) - before
        self._adds.append((expires, pod, ks))
        while self._entries > self.max_entries and len(self._adds) > 1:
            self._forget(*self._adds.popleft())

    def prefix(self, keys: Keys, pods: Sequence[str], now: float) -> dict[str, int]:
        """For each of `pods` with entries: how many leading blocks of `keys` it holds speculatively and
        unexpired (pods with none are left out)."""
        out: dict[str, int] = {}
        n = len(keys)
        if n == 0:
            return out
        ks: list[int] | None = None
        for pod in pods:
            held = self._pods.get(pod)
            if not held:
                continue
            if ks is None:
                ks = keys.tolist() if isinstance(keys, np.ndarray) else [int(k) for k in keys]
            lo, hi = 0, n  # invariant: keys[:lo] held, keys[hi:] not
            while lo < hi:
                mid = (lo + hi) // 2
                expires = held.get(ks[mid])
                if expires is not None and expires > now:
                    lo = mid + 1
                else:
                    hi = mid
            if lo:
                out[pod] = lo
        return out

    def _drop(self, now: float) -> None:
        adds = self._adds
        while adds and adds[0][0] <= now:
            self._forget(*adds.popleft())

    def _forget(self, expires: float, pod: str, keys: list[int]) -> None:
        """An `add` leaves: its keys go unless a later `add` refreshed them."""
        held = self._pods.get(pod)
        if held is None:
            return
        before = len(held)
        get = held.get
        for k in keys:
            if get(k) == expires:
                del held[k]
        self._entries -= before - len(held)
        if not held:
            del self._pods[pod]
