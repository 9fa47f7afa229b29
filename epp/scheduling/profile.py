"""A scheduling profile: filters, then clamped weighted scorers, then a picker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.clock import Clock
from epp.scheduling.errors import AllFilteredError
from epp.scheduling.framework import CycleState, Filter, Picker, PostPick, Scorer, scored_endpoint
from epp.types import Endpoint, EndpointId, InferenceRequest

PluginTiming = tuple[str, str, str, float]
"""(extension point, plugin type, plugin name, seconds)."""


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float
    type_name: str


@dataclass(frozen=True, slots=True)
class NamedFilter:
    filter: Filter
    type_name: str


@dataclass(frozen=True, slots=True)
class ProfileResult:
    endpoints: list[EndpointId]
    scores: dict[EndpointId, float]


class SchedulerProfile:
    def __init__(
        self,
        name: str,
        filters: Sequence[NamedFilter],
        scorers: Sequence[WeightedScorer],
        picker: Picker,
        picker_type: str,
    ) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker
        self.picker_type = picker_type
        plugins = [*(f.filter for f in self.filters), *(s.scorer for s in self.scorers), picker]
        self.post_pick = tuple(p for p in plugins if isinstance(p, PostPick))

    def picked(self, state: CycleState, request: InferenceRequest, endpoint: EndpointId) -> None:
        """Tell the plugins that want to know which endpoint this request was routed to."""
        for plugin in self.post_pick:
            plugin.picked(state, request, endpoint)

    def filter(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> None:
        """Run the filters only: raises AllFilteredError as `run` would."""
        current: Sequence[Endpoint] = endpoints
        for nf in self.filters:
            current = nf.filter.filter(state, request, current)
            if not current:
                raise AllFilteredError(f"no endpoint passed filter {nf.filter.name!r}")

    def run(
        self,
        state: CycleState,
        request: InferenceRequest,
        endpoints: Sequence[Endpoint],
        timer: Clock | None = None,
        timings: list[PluginTiming] | None = None,
    ) -> ProfileResult:
        current: Sequence[Endpoint] = endpoints
        for nf in self.filters:
            t0 = timer.now() if timer else 0.0
            current = nf.filter.filter(state, request, current)
            if timer and timings is not None:
                timings.append(("Filter", nf.type_name, nf.filter.name, timer.now() - t0))
            if not current:
                raise AllFilteredError(f"no endpoint passed filter {nf.filter.name!r}")
        totals = [0.0] * len(current)
        for ws in self.scorers:
            t0 = timer.now() if timer else 0.0
            scores = ws.scorer.score(state, request, current)
            if timer and timings is not None:
                timings.append(("Scorer", ws.type_name, ws.scorer.name, timer.now() - t0))
            if len(scores) != len(current):
                raise RuntimeError(
                    f"scorer {ws.scorer.name!r} returned {len(scores)} scores for {len(current)} endpoints"
                )
            w = ws.weight
            for i, s in enumerate(scores):
                # clamp to [0, 1]; NaN counts as 0 (inlined: this is the hot loop)
                totals[i] += (1.0 if s > 1.0 else s if s >= 0.0 else 0.0) * w
        scored = [scored_endpoint(ep, total) for ep, total in zip(current, totals, strict=True)]
        t0 = timer.now() if timer else 0.0
        picked = self.picker.pick(state, request, scored)
        if timer and timings is not None:
            timings.append(("Picker", self.picker_type, self.picker.name, timer.now() - t0))
        if not picked:
            raise AllFilteredError(f"picker {self.picker.name!r} chose no endpoint")
        return ProfileResult(picked, {s.endpoint.id: s.score for s in scored})
