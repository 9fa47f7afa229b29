"""`round-robin-picker`: endpoints in turn (by sorted address), ignoring scores.

The turn advances once per pick over the candidates the picker is given, so a filtered
endpoint is skipped rather than stalling the rotation.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from epp.scheduling.framework import CycleState, PluginHandle, ScoredEndpoint
from epp.scheduling.plugins.max_score_picker import PickerParams, check_max
from epp.scheduling.registry import PluginSpec
from epp.types import EndpointId, InferenceRequest


class RoundRobinPicker:
    def __init__(self, name: str, max_endpoints: int) -> None:
        self._name = name
        self.max_endpoints = max_endpoints
        self._last: EndpointId | None = None

    @property
    def name(self) -> str:
        return self._name

    def pick(
        self, state: CycleState, request: InferenceRequest, scored: Sequence[ScoredEndpoint]
    ) -> list[EndpointId]:
        ids = sorted(s.endpoint.id for s in scored)
        start = 0 if self._last is None else bisect.bisect_right(ids, self._last) % len(ids)
        k = min(self.max_endpoints, len(ids))
        chosen = [ids[(start + i) % len(ids)] for i in range(k)]
        self._last = chosen[0]
        return chosen


def _build(name: str, params: PickerParams, handle: PluginHandle) -> RoundRobinPicker:
    return RoundRobinPicker(name, check_max(params))


SPEC = PluginSpec("round-robin-picker", "picker", PickerParams, _build, "Endpoints in turn.")
