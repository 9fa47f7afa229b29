"""Scrape settings that defeat a staleness threshold, refused before anything runs. Pure.

Under them the profile's `metrics-staleness-filter` (or the saturation detector) would count every
endpoint stale most of the time, so requests are refused with no other sign: scraping disabled with the
filter in a profile, or a staleness threshold below the scrape interval. The server checks its
`--refresh-metrics-interval` at startup (`epp.server.app`); the simulator checks its `--scrape-interval`
before a replay (`simulator.replay.resolve`). `flag` names the setting as its user gives it, `answer`
what a refused request gets there (the server's 429, the simulator's `rejected`).
"""

from __future__ import annotations

from epp.config_sections import ConfigError
from epp.scheduling.plugins.staleness_filter import MetricsStalenessFilter
from epp.scheduling.scheduler import Scheduler

INTERVAL_FLAG = "--refresh-metrics-interval"
ANSWER = "429"


def _seconds(value: float) -> str:
    return f"{value * 1000:g}ms" if value < 1 else f"{value:g}s"


def check_staleness_filters(
    source: str, scheduler: Scheduler, interval: float, flag: str = INTERVAL_FLAG, answer: str = ANSWER
) -> None:
    """Raise ConfigError (naming the profile, the plugin and both settings) when a profile's
    metrics-staleness-filter would drop endpoints for most of each scrape interval. `interval` <= 0:
    scraping is disabled."""
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
                    f"{flag} 0 disables metrics scraping, but {named.type_name} drops endpoints "
                    f"without fresh metrics: every request would get {answer}. Enable scraping or remove the "
                    "filter from the profile",
                )
            if plugin.max_age <= interval:  # equal: just before each scrape lands, the last one is older
                raise ConfigError(
                    source,
                    where,
                    "parameters.maxAge",
                    f"maxAge {_seconds(plugin.max_age)} is not above {flag} {_seconds(interval)}: "
                    "endpoints' metrics would be older than maxAge for part of each interval (a scrape "
                    f"lands an interval after the last one, plus its own time), so the filter drops them "
                    f"and requests get {answer}. Make maxAge more than the interval (a few intervals is "
                    "safer) or scrape more often",
                )


def check_saturation_threshold(
    source: str, scheduler: Scheduler, interval: float, flag: str = INTERVAL_FLAG, answer: str = ANSWER
) -> None:
    """Raise ConfigError (naming both settings) when the saturation detector would count endpoints
    saturated (stale metrics) for most of each scrape interval: sheddable requests would be refused."""
    threshold = scheduler.saturation.metrics_staleness_threshold
    if interval > 0 and threshold <= interval:
        raise ConfigError(
            source,
            "saturationDetector",
            "metricsStalenessThreshold",
            f"{_seconds(threshold)} is not above {flag} {_seconds(interval)}: endpoints would count as "
            f"saturated (stale metrics) for part of each interval, so sheddable requests get {answer}. Make "
            "metricsStalenessThreshold more than the interval or scrape more often",
        )


def check_scrape_settings(
    source: str, scheduler: Scheduler, interval: float, flag: str = INTERVAL_FLAG, answer: str = ANSWER
) -> None:
    """Both checks: raise ConfigError (naming both settings) when the scrape interval defeats a staleness
    threshold. `interval` <= 0: scraping is disabled."""
    check_staleness_filters(source, scheduler, interval, flag, answer)
    check_saturation_threshold(source, scheduler, interval, flag, answer)
