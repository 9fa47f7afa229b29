"""Admission by estimated time to first token. Pure.

When a profile estimated TTFT for every candidate (the `ttft-scorer`) and even the fastest
is over `ttft_slo_s`, a sheddable request (priority < 0) is refused with 429 and a
`retry-after` of the excess, rounded up and bounded; other requests are still routed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from epp.scheduling.errors import SloExceededError
from epp.types import InferenceRequest


@dataclass(frozen=True, slots=True)
class Admission:
    ttft_slo_s: float | None = None
    min_retry_after_s: int = 1
    max_retry_after_s: int = 60

    def check(self, request: InferenceRequest, fastest_s: float | None) -> None:
        """Raise SloExceededError when a sheddable request cannot meet the SLO anywhere."""
        slo = self.ttft_slo_s
        if slo is None or fastest_s is None or not request.sheddable or fastest_s <= slo:
            return
        # (an estimate that is not finite, from an endpoint's absurd metrics, waits the longest)
        wait = math.ceil(fastest_s - slo) if math.isfinite(fastest_s) else self.max_retry_after_s
        retry = max(self.min_retry_after_s, min(self.max_retry_after_s, wait))
        raise SloExceededError(
            f"estimated time to first token {fastest_s:.3f}s exceeds the {slo:g}s SLO on every endpoint "
            "and the request is sheddable",
            retry,
        )
