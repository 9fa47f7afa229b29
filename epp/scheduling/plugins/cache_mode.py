"""Which candidates get cache credit, and the pick mode: `cache-aware`, `degraded` or `load-only`."""

from __future__ import annotations

from collections.abc import Sequence

from epp.kvindex.freshness import Freshness
from epp.kvindex.service import KvIndexService
from epp.scheduling.framework import MODE, CycleState
from epp.types import Endpoint


def creditable(state: CycleState, service: KvIndexService, endpoints: Sequence[Endpoint]) -> list[str]:
    """Candidates whose index may be trusted (not stale), and record the pick mode: `cache-aware`
    when every candidate is fresh, `degraded` when some are not (stale ones get no credit),
    `load-only` when none may be trusted."""
    fresh = service.freshness
    now = state.now
    pods: list[str] = []
    all_fresh = True
    for e in endpoints:
        verdict = fresh.state(e.id, now).state
        if verdict is not Freshness.STALE:
            pods.append(e.id)
        if verdict is not Freshness.FRESH:
            all_fresh = False
    state.data[MODE] = "load-only" if not pods else "cache-aware" if all_fresh else "degraded"
    return pods


def load_only(state: CycleState) -> None:
    state.data[MODE] = "load-only"
