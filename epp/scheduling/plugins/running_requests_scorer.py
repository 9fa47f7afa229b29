"""`running-requests-size-scorer`: fewer running requests (scraped) score higher; min-max."""

from __future__ import annotations

from collections.abc import Sequence

from epp.scheduling.framework import CycleState, PluginHandle
from epp.scheduling.plugins.normalize import inverse_minmax
from epp.scheduling.registry import NoParams, PluginSpec
from epp.types import Endpoint, InferenceRequest


class RunningRequestsScorer:
    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def score(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[float]:
        worst = max((e.metrics.running for e in endpoints if e.metrics), default=0)
        return inverse_minmax([float(e.metrics.running if e.metrics else worst) for e in endpoints])


def _build(name: str, params: NoParams, handle: PluginHandle) -> RunningRequestsScorer:
    return RunningRequestsScorer(name)


SPEC = PluginSpec(
    "running-requests-size-scorer",
    "scorer",
    NoParams,
    _build,
    "Min-max of each endpoint's running requests (scraped).",
)
