"""Startup checks and the first-scrape gate of readiness (used by `epp.server.app`).

- `check_scrape_settings`: refuse scrape settings under which the profile's metrics-staleness-filter
  (or the saturation detector) would count every endpoint stale most of the time, so requests get 429
  with no other sign: scraping disabled with the filter in a profile, or a staleness threshold below
  `--refresh-metrics-interval`.
- `ScrapeRound`: sits in front of the scrape observer and tells readiness when every endpoint has had
  its first scrape attempt (failed attempts count), so the EPP is not ready while the filter would
  still drop every endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Set

from epp.config_sections import ConfigError
from epp.scheduling.plugins.staleness_filter import MetricsStalenessFilter
from epp.scheduling.scheduler import Scheduler
from epp.sources.metrics_scrape import ScrapeObserver

INTERVAL_FLAG = "--refresh-metrics-interval"


def _seconds(value: float) -> str:
    return f"{value * 1000:g}ms" if value < 1 else f"{value:g}s"


def check_scrape_settings(source: str, scheduler: Scheduler, interval: float) -> None:
    """Raise ConfigError (naming both settings) when the scrape interval defeats a staleness threshold.
    `interval` <= 0: scraping is disabled."""
    for profile in scheduler.profiles.values():
        for named in profile.filters:
            plugin = named.filter
            if not isinstance(plugin, MetricsStalenessFilter):
                continue
            where = f"profile {profile.name!r}: plugin {plugin.name!r}"
            if interval <= 0:
                raise ConfigError(
                    source,
                    where,
                    "",
                    f"{INTERVAL_FLAG} 0 disables metrics scraping, but {named.type_name} drops endpoints "
                    "without fresh metrics: every request would get 429. Enable scraping or remove the "
                    "filter from the profile",
                )
            if plugin.max_age < interval:
                raise ConfigError(
                    source,
                    where,
                    "parameters.maxAge",
                    f"maxAge {_seconds(plugin.max_age)} is below {INTERVAL_FLAG} {_seconds(interval)}: "
                    "endpoints' metrics would be older than maxAge for most of each interval, so the filter "
                    "drops them and requests get 429. Make maxAge at least the interval (a few intervals "
                    "is safer) or scrape more often",
                )
    threshold = scheduler.saturation.metrics_staleness_threshold
    if interval > 0 and threshold < interval:
        raise ConfigError(
            source,
            "saturationDetector",
            "metricsStalenessThreshold",
            f"{_seconds(threshold)} is below {INTERVAL_FLAG} {_seconds(interval)}: endpoints would count as "
            "saturated (stale metrics) for most of each interval, so sheddable requests get 429. Make "
            "metricsStalenessThreshold at least the interval or scrape more often",
        )


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

    def finish(self) -> None:
        self._tracking = False
        self.attempted.clear()
