"""Bounded waiting for a condition, for tests that must not assert on timing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def eventually(
    check: Callable[[], bool], what: str, timeout: float = 10.0, interval: float = 0.01
) -> None:
    """Poll `check` every `interval` seconds until it holds; AssertionError naming `what` after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for: {what}")
        await asyncio.sleep(interval)
