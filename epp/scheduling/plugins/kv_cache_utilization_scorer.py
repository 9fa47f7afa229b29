"""`kv-cache-utilization-scorer`: 1 - KV cache usage (scraped); no metrics scores 0."""

from __future__ import annotations

from collections.abc import Sequence

from epp.scheduling.framework import CycleState, PluginHandle
from epp.scheduling.registry import NoParams, PluginSpec
from epp.types import Endpoint, InferenceRequest


class KvCacheUtilizationScorer:
    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def score(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[float]:
        return [1.0 - e.metrics.kv_usage if e.metrics else 0.0 for e in endpoints]


def _build(name: str, params: NoParams, handle: PluginHandle) -> KvCacheUtilizationScorer:
    return KvCacheUtilizationScorer(name)


SPEC = PluginSpec(
    "kv-cache-utilization-scorer", "scorer", NoParams, _build, "1 - KV cache usage of each endpoint."
)
