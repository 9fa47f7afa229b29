"""`random-picker`: uniformly random endpoints, ignoring scores (seeded)."""

from __future__ import annotations

from collections.abc import Sequence

from epp.scheduling.framework import CycleState, PluginHandle, ScoredEndpoint
from epp.scheduling.plugins.max_score_picker import PickerParams, check_max
from epp.scheduling.registry import PluginSpec
from epp.types import EndpointId, InferenceRequest


class RandomPicker:
    def __init__(self, name: str, max_endpoints: int) -> None:
        self._name = name
        self.max_endpoints = max_endpoints

    @property
    def name(self) -> str:
        return self._name

    def pick(
        self, state: CycleState, request: InferenceRequest, scored: Sequence[ScoredEndpoint]
    ) -> list[EndpointId]:
        k = min(self.max_endpoints, len(scored))
        return [s.endpoint.id for s in state.rng.sample(list(scored), k)]


def _build(name: str, params: PickerParams, handle: PluginHandle) -> RandomPicker:
    return RandomPicker(name, check_max(params))


SPEC = PluginSpec("random-picker", "picker", PickerParams, _build, "Uniformly random endpoints.")
