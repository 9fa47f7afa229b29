"""`metrics-staleness-filter`: drops endpoints whose scraped metrics are older than `maxAge`
(or that were never scraped)."""

from __future__ import annotations

from collections.abc import Sequence

from epp.durations import parse_duration
from epp.scheduling.framework import CycleState, PluginHandle
from epp.scheduling.registry import Params, PluginParamsError, PluginSpec
from epp.types import Endpoint, InferenceRequest


class StalenessParams(Params):
    max_age: str | float = "2s"


class MetricsStalenessFilter:
    def __init__(self, name: str, max_age: float) -> None:
        self._name = name
        self.max_age = max_age

    @property
    def name(self) -> str:
        return self._name

    def filter(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[Endpoint]:
        now = state.now
        return [e for e in endpoints if e.metrics_age(now) <= self.max_age]


def _build(name: str, params: StalenessParams, handle: PluginHandle) -> MetricsStalenessFilter:
    try:
        max_age = parse_duration(params.max_age)
    except ValueError as err:
        raise PluginParamsError("maxAge", str(err)) from None
    return MetricsStalenessFilter(name, max_age)


SPEC = PluginSpec(
    "metrics-staleness-filter",
    "filter",
    StalenessParams,
    _build,
    "Drops endpoints whose metrics are older than maxAge (default 2s).",
)
