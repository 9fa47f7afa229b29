"""`ttft-scorer`: score each pod by the cost model's estimated time to first token on it.

For every candidate: estimated TTFT = queue wait + prefill of the uncached part + reload of
blocks held only on slower tiers (or their recomputation, whichever is cheaper) + decode
interference (`epp.costmodel.estimate`). The score is `best / ttft` (1.0 for the fastest);
candidates within the tie band of the fastest (`tieBand` x best, at least `tieBandSeconds`)
all score 1.0, so the picker spreads near-ties at random (seeded) instead of herding a burst
onto one pod.

Cache credit comes from the KV index when this EPP has one, for pods whose index is not
stale; without it (no index, a prompt that cannot be tokenized, every pod stale, or
`cacheCredit: false`) the estimate is purely load-aware. The estimates, the fastest one and
the pick mode go into the cycle state for admission, explanations and calibration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from epp.costmodel.profile import ModelProfile
from epp.costmodel.service import SERVICE_KEY as COST_KEY
from epp.costmodel.service import CostModel
from epp.kvindex.service import SERVICE_KEY as KV_KEY
from epp.kvindex.service import KvIndexService
from epp.scheduling.framework import ESTIMATES, FASTEST, CycleState, PluginHandle
from epp.scheduling.plugins.cache_mode import creditable, load_only
from epp.scheduling.plugins.prompt_keys import prompt_info
from epp.scheduling.registry import Params, PluginParamsError, PluginSpec
from epp.types import Endpoint, InferenceRequest, TtftEstimate


class TtftParams(Params):
    tie_band: float = 0.05
    tie_band_seconds: float = 0.002
    cache_credit: bool = True


def _tier_rank(profile: ModelProfile) -> dict[str, float]:
    rank = {t: c.bandwidth_bytes_per_s for t, c in profile.tiers.items()}
    rank["gpu"] = math.inf
    return rank


class TtftScorer:
    def __init__(
        self, name: str, cost: CostModel, kv: KvIndexService | None, band: float, band_s: float
    ) -> None:
        self._name = name
        self.cost = cost
        self.kv = kv
        self.band = band
        self.band_s = band_s
        self._ranks: dict[str, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return self._name

    def _held(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> tuple[int, dict[str, dict[str, int]]]:
        """(prompt tokens, {pod: tokens of its cached prefix by best tier}) for pods given credit."""
        kv = self.kv
        if kv is None:
            load_only(state)
            return request.prompt_tokens_estimate, {}
        tokens, keys = prompt_info(state, request, kv)
        if tokens is None or keys is None:
            load_only(state)
            return request.prompt_tokens_estimate, {}
        pods = creditable(state, kv, endpoints)
        if not pods or len(keys) == 0:
            return tokens, {}
        key = self.cost.profile_key(request.model)
        rank = self._ranks.get(key)
        if rank is None:
            rank = self._ranks[key] = _tier_rank(self.cost.profile(request.model))
        blocks = kv.index.lookup_by_best_tier(keys, pods, lambda t: rank.get(t, -1.0))
        bs = kv.block_size
        return tokens, {pod: {t: n * bs for t, n in by_tier.items()} for pod, by_tier in blocks.items()}

    def score(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[float]:
        tokens, held = self._held(state, request, endpoints)
        estimate = self.cost.estimate
        model = request.model
        ests: list[TtftEstimate] = [estimate(model, e, tokens, held.get(e.id)) for e in endpoints]
        times = [x.ttft_s for x in ests]
        best = min(times)
        state.data[ESTIMATES] = {e.id: x for e, x in zip(endpoints, ests, strict=True)}
        state.data[FASTEST] = best
        cut = best + max(best * self.band, self.band_s)
        return [1.0 if t <= cut else best / t for t in times]


def _build(name: str, params: TtftParams, handle: PluginHandle) -> TtftScorer:
    if not 0.0 <= params.tie_band <= 1.0:
        raise PluginParamsError("tieBand", f"must be in [0, 1], got {params.tie_band}")
    if not 0.0 <= params.tie_band_seconds <= 10.0:
        raise PluginParamsError("tieBandSeconds", f"must be in [0, 10], got {params.tie_band_seconds}")
    cost = handle.services.get(COST_KEY)
    if cost is None:
        cost = CostModel()
    if not isinstance(cost, CostModel):
        raise PluginParamsError("type", "the cost model service is not a CostModel")
    kv = handle.services.get(KV_KEY) if params.cache_credit else None
    if kv is not None and not isinstance(kv, KvIndexService):
        raise PluginParamsError("type", "the KV index service is not a KvIndexService")
    return TtftScorer(name, cost, kv, params.tie_band, params.tie_band_seconds)


SPEC = PluginSpec(
    "ttft-scorer",
    "scorer",
    TtftParams,
    _build,
    "Estimated time to first token (queue + uncached prefill + tier reload + decode interference); "
    "near-ties score alike.",
)
