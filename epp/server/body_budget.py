"""The bytes of request bodies all ext_proc streams may hold at once.

Each stream buffers its request body until it can route (up to `--max-body-size`); nothing else
bounds how many stream at once, so `max_buffered_body_bytes` caps their sum: a chunk that would take
it past the cap ends its request with 503 (retry shortly) instead of taking the replica's memory.
"""

from __future__ import annotations


class BodyBudget:
    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the buffered body budget must be >= 1 byte, got {limit}")
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        """Reserve `n` bytes; False (nothing reserved) when that would pass the limit."""
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n
