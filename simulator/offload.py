"""The optional CPU offload tier: an LRU of block hashes with a capacity in blocks. Pure.

A block is put here as it is computed (write-through, vLLM's `OffloadingConnector`) or when the GPU
evicts it (write-back), as `kvcache.py` decides (`EngineConfig.cpu_write_policy`); a later request
whose GPU prefix hit stops at block k can load blocks k, k+1, ... from here instead of recomputing
them, if they are present (it waits for the load, the other requests do not: `cpu_loads.py`). Loading
a block or storing it again refreshes it; when full, the least recently used block is evicted. The
engine reports what this tier stores and evicts as `BlockStored` / `BlockRemoved` events with medium
"CPU", as vLLM's CPU offloading connector does.
"""

from __future__ import annotations

from collections import OrderedDict


class CpuTier:
    __slots__ = ("capacity", "loads", "lru", "stores")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"CPU tier capacity must be >= 1 block, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()  # hash -> None, least recent first
        self.stores = 0
        self.loads = 0

    def __len__(self) -> int:
        return len(self.lru)

    def clear(self) -> None:
        """Forget every block (a prefix-cache reset)."""
        self.lru.clear()

    def __contains__(self, h: int) -> bool:
        return h in self.lru

    def run(self, hashes: list[int], start: int, limit: int) -> int:
        """How many of hashes[start:limit] are held, consecutively from `start`."""
        lru = self.lru
        n = 0
        for h in hashes[start:limit]:
            if h not in lru:
                break
            n += 1
        return n

    def load(self, hashes: list[int]) -> None:
        """Blocks copied back to the GPU: refreshed (they stay here too)."""
        move = self.lru.move_to_end
        for h in hashes:
            move(h)
        self.loads += len(hashes)

    def put(self, h: int) -> tuple[bool, list[int]]:
        """Keep block `h`: (newly stored?, hashes evicted to make room, oldest first)."""
        lru = self.lru
        if h in lru:
            lru.move_to_end(h)
            return False, []
        evicted: list[int] = []
        while len(lru) >= self.capacity:
            evicted.append(lru.popitem(last=False)[0])
        lru[h] = None
        self.stores += 1
        return True, evicted
