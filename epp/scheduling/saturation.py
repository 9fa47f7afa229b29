"""Saturation detector: is the pool too loaded to admit sheddable requests?

Same defaults and comparisons as the reference EPP (its `Detector.IsSaturated`): an endpoint is
saturated when its waiting queue is above 5, its KV usage above 0.8, or its metrics older than
200 ms (or missing). The pool is saturated when every candidate is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.types import Endpoint


@dataclass(frozen=True, slots=True)
class SaturationDetector:
    queue_depth_threshold: int = 5
    kv_cache_util_threshold: float = 0.8
    metrics_staleness_threshold: float = 0.2

    def endpoint_saturated(self, endpoint: Endpoint, now: float) -> bool:
        m = endpoint.metrics
        if m is None or endpoint.metrics_age(now) > self.metrics_staleness_threshold:
            return True
        return m.waiting > self.queue_depth_threshold or m.kv_usage > self.kv_cache_util_threshold

    def pool_saturated(self, endpoints: Sequence[Endpoint], now: float) -> bool:
        return all(self.endpoint_saturated(ep, now) for ep in endpoints)
