"""`softmax-picker`: samples an endpoint with probability proportional to exp(score / temperature).

NVIDIA Dynamo's KV router picks this way when its temperature is above 0: a softmax over its
normalised costs. With `dynamo-kv-scorer` as the only scorer (weight 1) the profile's total is
1 - the normalised cost, so this picker with Dynamo's temperature samples as Dynamo does (the weight
of the scorer divides the temperature). `temperature: 0` is the argmax, ties at random, as
`max-score-picker`. Fallbacks (`maxNumOfEndpoints` > 1) are drawn the same way from the endpoints
not yet drawn. The seeded random source of the cycle draws, so a run is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from epp.scheduling.framework import CycleState, PluginHandle, ScoredEndpoint
from epp.scheduling.plugins.max_score_picker import MaxScorePicker, PickerParams, check_max
from epp.scheduling.registry import PluginParamsError, PluginSpec
from epp.types import EndpointId, InferenceRequest


class SoftmaxParams(PickerParams):
    temperature: float = 0.0


class SoftmaxPicker(MaxScorePicker):
    """`max-score-picker` at temperature 0; above it, draws as the module docstring says."""

    def __init__(self, name: str, temperature: float, max_endpoints: int) -> None:
        super().__init__(name, max_endpoints)
        self.temperature = temperature

    def pick(
        self, state: CycleState, request: InferenceRequest, scored: Sequence[ScoredEndpoint]
    ) -> list[EndpointId]:
        if self.temperature == 0.0:
            return super().pick(state, request, scored)
        left = list(scored)
        out: list[EndpointId] = []
        while left and len(out) < self.max_endpoints:
            top = max(s.score for s in left)
            weights = [math.exp((s.score - top) / self.temperature) for s in left]  # the best weighs 1
            x = state.rng.random() * sum(weights)
            i = 0
            while i < len(left) - 1 and x >= weights[i]:
                x -= weights[i]
                i += 1
            out.append(left.pop(i).endpoint.id)
        return out


def _build(name: str, params: SoftmaxParams, handle: PluginHandle) -> SoftmaxPicker:
    if not 0.0 <= params.temperature < float("inf"):
        raise PluginParamsError("temperature", f"must be a finite number >= 0, got {params.temperature}")
    return SoftmaxPicker(name, params.temperature, check_max(params))


SPEC = PluginSpec(
    "softmax-picker",
    "picker",
    SoftmaxParams,
    _build,
    "Samples endpoints with probability exp(score / temperature), as Dynamo's router; 0: argmax.",
)
