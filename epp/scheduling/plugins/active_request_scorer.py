"""`active-request-scorer`: fewer requests in flight *as tracked by the EPP* score higher.

Unlike the scraped queue this reacts to the EPP's own picks at once, so a burst that
arrives between two scrapes does not herd onto one endpoint. Min-max across candidates.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.scheduling.framework import CycleState, PluginHandle
from epp.scheduling.plugins.normalize import inverse_minmax
from epp.scheduling.registry import NoParams, PluginSpec
from epp.types import Endpoint, InferenceRequest


class ActiveRequestScorer:
    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def score(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[float]:
        return inverse_minmax([float(e.in_flight_requests) for e in endpoints])


def _build(name: str, params: NoParams, handle: PluginHandle) -> ActiveRequestScorer:
    return ActiveRequestScorer(name)


SPEC = PluginSpec(
    "active-request-scorer",
    "scorer",
    NoParams,
    _build,
    "Min-max of the requests the EPP has in flight on each endpoint.",
)
