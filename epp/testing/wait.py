"""Bounded waiting for a condition, for tests that must not assert on timing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import aiohttp


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


async def http_ok(
    session: aiohttp.ClientSession,
    url: str,
    what: str,
    *,
    process: asyncio.subprocess.Process | None = None,
    timeout: float = 20.0,
    interval: float = 0.02,
) -> None:
    """Poll GET `url` until it answers 200 (a server becoming ready); AssertionError naming `what` if
    `process` exits first or after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        if process is not None and process.returncode is not None:
            raise AssertionError(f"{what}: the process exited with {process.returncode} before it was ready")
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url) as r:
                if r.status == 200:
                    return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for: {what}")
        await asyncio.sleep(interval)
