"""Plugin contracts. Implementations live one per module in `epp.scheduling.plugins`."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from epp.clock import Clock
from epp.frozen import twin
from epp.types import Endpoint, EndpointId, InferenceRequest

# Well-known CycleState keys the scheduler reads after a profile ran.
MODE = "pick_mode"
"""How far the decision trusted the cache index: one of `epp.types.PICK_MODES`."""
ESTIMATES = "ttft_estimates"
"""{endpoint id: TtftEstimate} of this cycle."""
FASTEST = "ttft_min_s"
"""The smallest estimated time to first token among the candidates (seconds)."""
RANKING = "ttft_ranking"
"""`epp.types.RankTerms` of this cycle: how the ttft-scorer ranked beyond the estimates."""


@dataclass(slots=True)
class CycleState:
    """Per-request scratch space that plugins of one cycle may share (e.g. prompt block keys)."""

    now: float
    rng: random.Random
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PluginHandle:
    """What a plugin factory may use: the clock, a seeded random source, shared services."""

    clock: Clock
    rng: random.Random
    services: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Plugin(Protocol):
    @property
    def name(self) -> str: ...


@runtime_checkable
class Filter(Plugin, Protocol):
    """Drops candidates. Returns the endpoints that remain, in their given order."""

    def filter(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[Endpoint]: ...


@runtime_checkable
class Scorer(Plugin, Protocol):
    """Scores every candidate in [0, 1] (higher is better), aligned with `endpoints`.
    Values outside [0, 1] are clamped by the profile."""

    def score(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> Sequence[float]: ...


@dataclass(frozen=True, slots=True)
class ScoredEndpoint:
    endpoint: Endpoint
    score: float


_ScoredTwin = twin(ScoredEndpoint)


def scored_endpoint(endpoint: Endpoint, score: float) -> ScoredEndpoint:
    """`ScoredEndpoint(endpoint, score)`, built 3x faster (`epp/frozen.py`): one per candidate per request."""
    s = _ScoredTwin(endpoint, score)
    s.__class__ = ScoredEndpoint
    return s  # type: ignore[no-any-return]


@runtime_checkable
class Picker(Plugin, Protocol):
    """Chooses endpoints from scored candidates: first is primary, the rest are fallbacks."""

    def pick(
        self, state: CycleState, request: InferenceRequest, scored: Sequence[ScoredEndpoint]
    ) -> list[EndpointId]: ...


@runtime_checkable
class PostPick(Plugin, Protocol):
    """Told which endpoint a profile picked (e.g. to remember where a prompt was routed). Any filter,
    scorer or picker of the profile may also implement it."""

    def picked(self, state: CycleState, request: InferenceRequest, endpoint: EndpointId) -> None: ...


@runtime_checkable
class ProfileHandler(Plugin, Protocol):
    """Chooses which scheduling profile runs for a request."""

    def select(self, request: InferenceRequest, profiles: Sequence[str]) -> str: ...
