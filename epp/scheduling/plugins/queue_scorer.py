"""`queue-scorer`: fewer waiting requests (scraped) score higher; min-max across candidates."""

from __future__ import annotations

from collections.abc import Sequence

from epp.scheduling.framework import CycleState, PluginHandle
from epp.scheduling.plugins.normalize import inverse_minmax
from epp.scheduling.registry import NoParams, PluginSpec
from epp.types import Endpoint, InferenceRequest


class QueueScorer:
    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def score(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[float]:
        worst = max((e.metrics.waiting for e in endpoints if e.metrics), default=0)
        return inverse_minmax([float(e.metrics.waiting if e.metrics else worst) for e in endpoints])


def _build(name: str, params: NoParams, handle: PluginHandle) -> QueueScorer:
    return QueueScorer(name)


SPEC = PluginSpec(
    "queue-scorer", "scorer", NoParams, _build, "Min-max of each endpoint's waiting queue (scraped)."
)
