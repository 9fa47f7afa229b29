"""`max-score-picker`: highest total score first; ties broken with the seeded random source."""

from __future__ import annotations

from collections.abc import Sequence

from epp.scheduling.framework import CycleState, PluginHandle, ScoredEndpoint
from epp.scheduling.registry import Params, PluginParamsError, PluginSpec
from epp.types import EndpointId, InferenceRequest


class PickerParams(Params):
    max_num_of_endpoints: int = 1


def check_max(params: PickerParams) -> int:
    if params.max_num_of_endpoints < 1:
        raise PluginParamsError("maxNumOfEndpoints", "maxNumOfEndpoints must be >= 1")
    return params.max_num_of_endpoints


class MaxScorePicker:
    def __init__(self, name: str, max_endpoints: int) -> None:
        self._name = name
        self.max_endpoints = max_endpoints

    @property
    def name(self) -> str:
        return self._name

    def pick(
        self, state: CycleState, request: InferenceRequest, scored: Sequence[ScoredEndpoint]
    ) -> list[EndpointId]:
        if self.max_endpoints == 1:
            best = max(s.score for s in scored)
            top = [s for s in scored if s.score == best]
            chosen = top[0] if len(top) == 1 else top[state.rng.randrange(len(top))]
            return [chosen.endpoint.id]
        # Shuffle first, then a stable sort: equal scores end up in random order.
        order = list(scored)
        state.rng.shuffle(order)
        order.sort(key=lambda s: s.score, reverse=True)
        return [s.endpoint.id for s in order[: self.max_endpoints]]


def _build(name: str, params: PickerParams, handle: PluginHandle) -> MaxScorePicker:
    return MaxScorePicker(name, check_max(params))


SPEC = PluginSpec(
    "max-score-picker",
    "picker",
    PickerParams,
    _build,
    "Highest score first (maxNumOfEndpoints of them), random among ties.",
)
