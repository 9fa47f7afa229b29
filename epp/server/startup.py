"""Startup checks and the first-scrape gate of readiness (used by `epp.server.app`).

- `check_scrape_settings` (pure, in `epp.scheduling.scrape_settings`, which the simulator shares):
  refuse scrape settings under which the profile's metrics-staleness-filter (or the saturation
  detector) would count every endpoint stale most of the time, so requests get 429 with no other sign:
  scraping disabled with the filter in a profile, or a staleness threshold below
  `--refresh-metrics-interval`.
- `ScrapeRound`: sits in front of the scrape observer and tells readiness when every endpoint has had
  its first scrape attempt (failed attempts count), so the EPP is not ready while the filter would
  still drop every endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Set

from epp.scheduling.scrape_settings import INTERVAL_FLAG, check_scrape_settings
from epp.sources.metrics_scrape import ScrapeObserver

__all__ = ["INTERVAL_FLAG", "ScrapeRound", "check_scrape_settings"]


class ScrapeRound:
    """A ScrapeObserver in front of another: remembers which endpoints have had a scrape attempt, until
    `finish` (then it only passes calls on, so it holds nothing for the endpoints of later pods)."""

    def __init__(self, inner: ScrapeObserver) -> None:
        self.inner = inner
        self.attempted: set[str] = set()
        self._changed = asyncio.Event()
        self._tracking = True

    def on_scrape(self, endpoint_id: str, ok: bool, error_kind: str | None, seconds: float) -> None:
        if self._tracking:
            self.attempted.add(endpoint_id)
            self._changed.set()
        self.inner.on_scrape(endpoint_id, ok, error_kind, seconds)

    async def wait(self, endpoints: Set[str], timeout: float) -> bool:
        """Until each of `endpoints` has had a scrape attempt, or `timeout` seconds (a scrape ends within
        the scrape timeout, so this bounds the wait); returns whether all were attempted."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while not endpoints <= self.attempted:
                    self._changed.clear()
                    await self._changed.wait()
        return endpoints <= self.attempted

    def begin(self) -> None:
        """Track again from now (a new round: the endpoints of a pool that came back)."""
        self._tracking = True
        self.attempted.clear()

    def finish(self) -> None:
        self._tracking = False
        self.attempted.clear()
