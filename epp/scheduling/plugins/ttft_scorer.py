"""`ttft-scorer`: score each pod by the cost model's estimated time to first token on it.

For every candidate: estimated TTFT = queue wait + prefill of the uncached part + reload of
blocks held only on slower tiers (or their recomputation, whichever is cheaper) + decode
interference (`epp.costmodel.estimate`). The score is `best / ttft` (1.0 for the fastest);
candidates within the tie band of the fastest (`tieBand` x best, at least `tieBandSeconds`)
are near-ties and score above every other pod. Among near-ties, the pods holding the most of the
prompt win (they add less prefill work and copy no prefix into another pod's KV); then, with
`tieBreak: kv-usage` (the default), the pod with the lowest KV usage, as the reference EPP's
kv-cache-utilization scorer balances KV; near-ties equal in both are picked at random (seeded), so
a burst is not herded onto one pod (`tieBreak: random`: every near-tie alike).

Prefix copies (`copyWeight`, default 2; 0 turns it off). A pod that would have to compute a prefix
another candidate already holds copies it into its KV, and every copy is KV that later requests
cannot use. That costs little while KV is plentiful and a great deal when the cluster's KV is
nearly full (requests then wait for blocks to free, for as long as decodes take). So for scoring
only, such a pod is charged the prefill the copy adds x `copyWeight` x min(u / (1 - u), 2), u that
pod's KV usage: nothing for an empty pod, the copy's prefill once at u = 1/3 (with the default
weight), 4x from u = 2/3 on. The estimates themselves (explanations, admission, the fastest
estimate) stay the request's own TTFT.

Cache credit comes from the KV index when this EPP has one, for pods whose index is not
stale, the way an engine uses its tiers: the consecutive prefix of the prompt on GPU, then the
blocks a slower tier (fastest first) adds to that prefix; without it (no index, a prompt that
cannot be tokenized, every pod stale, or `cacheCredit: false`) the estimate is purely load-aware.

Speculative entries (`speculativeTtl`, 2 s; 0 turns them off): a routed prompt's blocks count as
the chosen pod's GPU prefix for that long (`kvindex/speculative.py`, apart from the exact index),
so that a request right behind it, routed before the engine's events for the first one arrive,
is estimated as the engine will serve it there: queued behind the first one's prefill (in the
pod's backlog), then hitting its blocks. Without them a burst sharing a long prefix looks
uncached everywhere and spreads, duplicating the prefix on several pods.

The estimates, the fastest one and the pick mode go into the cycle state for admission,
explanations and calibration.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from epp.costmodel.estimate import F64, EstimateTable
from epp.costmodel.service import SERVICE_KEY as COST_KEY
from epp.costmodel.service import CostModel
from epp.kvindex.service import SERVICE_KEY as KV_KEY
from epp.kvindex.service import KvIndexService
from epp.kvindex.speculative import SpeculativeBlocks
from epp.scheduling.framework import ESTIMATES, FASTEST, RANKING, CycleState, PluginHandle
from epp.scheduling.plugins.cache_mode import creditable, load_only
from epp.scheduling.plugins.prompt_keys import prompt_info, prompt_key_list
from epp.scheduling.plugins.speculation import remember, speculative_blocks
from epp.scheduling.registry import Params, PluginParamsError, PluginSpec
from epp.types import Endpoint, EndpointId, InferenceRequest, RankTerms

_TIE_STEP = 0.01  # near-ties' scores step down by this x KV usage: they stay above the band's others
_MAX_PRESSURE = 2.0  # u / (1 - u) reaches it at u = 2/3: past that, every copy costs the same
_FULL_PRESSURE_AT = _MAX_PRESSURE / (1.0 + _MAX_PRESSURE)


class TtftParams(Params):
    tie_band: float = 0.05
    tie_band_seconds: float = 0.002
    cache_credit: bool = True
    speculative_ttl: str | float = "2s"  # 0: off
    tie_break: str = "kv-usage"  # or "random"
    copy_weight: float = 2.0  # 0: off


class TtftScorer:
    def __init__(
        self,
        name: str,
        cost: CostModel,
        kv: KvIndexService | None,
        band: float,
        band_s: float,
        speculative: SpeculativeBlocks | None = None,
        copy_weight: float = 0.0,
        kv_tie_break: bool = False,
    ) -> None:
        self._name = name
        self.copy_weight = copy_weight
        self.kv_tie_break = kv_tie_break
        self.cost = cost
        self.kv = kv
        self.band = band
        self.band_s = band_s
        self.speculative = speculative

    @property
    def name(self) -> str:
        return self._name

    def _held(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> tuple[int, dict[str, F64]]:
        """(prompt tokens, tier -> tokens each candidate can take from that tier: its GPU prefix, then
        what the next tier completes, ...; arrays aligned with `endpoints`). No tiers when no candidate
        gets cache credit; stale candidates get none."""
        kv = self.kv
        if kv is None:
            load_only(state)
            return request.prompt_tokens_estimate, {}
        tokens, keys = prompt_info(state, request, kv)
        if tokens is None or keys is None:
            load_only(state)
            return request.prompt_tokens_estimate, {}
        first = tokens  # (a batch's first item, the prompt keyed)
        tokens += request.batch_tokens  # a batch's other items: prefilled too, never credited
        pods = creditable(state, kv, endpoints)
        if not pods or len(keys) == 0:
            return tokens, {}
        order = ["gpu", *self.cost.tier_order(request.model)]
        at: dict[str, int] | None = None  # endpoint id -> its column (made when needed)
        if len(pods) == len(endpoints):
            runs = kv.index.lookup_tier_runs(keys, pods, order)  # (pods: every candidate, in order)
        else:  # stale candidates: no credit
            at = {e.id: i for i, e in enumerate(endpoints)}
            runs = np.zeros((len(order), len(endpoints)), dtype=np.int64)
            runs[:, [at[p] for p in pods]] = kv.index.lookup_tier_runs(keys, pods, order)
        if self.speculative is not None:  # (each row is a union of tiers that includes the GPU)
            held = self.speculative.prefix(prompt_key_list(state, keys), pods, state.now)
            if held:
                if at is None:
                    at = {e.id: i for i, e in enumerate(endpoints)}
                for pod, blocks in held.items():
                    column = runs[:, at[pod]]
                    np.maximum(column, blocks, out=column)
        bs = kv.block_size
        if request.batch_tokens:  # the estimate's cap (the last prompt token computed) is the first item's
            np.minimum(runs, max(first - 1, 0) // bs, out=runs)
        out: dict[str, F64] = {}
        previous = np.zeros(len(endpoints), dtype=np.int64)
        for tier, run in zip(order, runs, strict=True):
            if (run > previous).any():
                out[tier] = ((run - previous) * bs).astype(np.float64)
            previous = run
        return tokens, out

    def picked(self, state: CycleState, request: InferenceRequest, endpoint: EndpointId) -> None:
        """With `speculativeTtl`: the routed prompt's blocks count as the chosen pod's, for that long."""
        remember(self.speculative, self.kv, state, request, endpoint)

    def score(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[float]:
        tokens, held = self._held(state, request, endpoints)
        bs = self.kv.block_size if self.kv is not None else 1
        table = self.cost.estimate_all(request.model, endpoints, tokens, held, bs)
        state.data[ESTIMATES] = table
        times = table.ttft
        if not np.isfinite(times).all():  # an endpoint's absurd metrics: it loses, it cannot spoil the others
            times = np.where(np.isnan(times), np.inf, times)
        best = float(times.min())
        state.data[FASTEST] = best
        cached = table.cached
        usage: F64 | None = None  # each candidate's KV usage, -1 without metrics (read once, if needed)
        copy: F64 | None = None
        if self.copy_weight > 0 and len(endpoints) > 1 and cached.max() > 0:
            usage = _kv_usage(endpoints)
            copy = self._copy_cost(table, usage)
            if copy is not None:
                times = times + copy
                best = float(times.min())
        if not np.isfinite(best):  # no finite estimate anywhere: nothing to rank by
            state.data[RANKING] = RankTerms(table.ids, copy, np.ones(len(endpoints), dtype=bool))
            return [1.0] * len(endpoints)
        cut = best + max(best * self.band, self.band_s)
        tied = times <= cut
        state.data[RANKING] = RankTerms(table.ids, copy, tied)
        plain = best / times
        top: float | F64 = 1.0
        if tied.sum() > 1:
            outside = float(plain[~tied].max(initial=0.0))  # the best score outside the band (< 1)
            step = min(_TIE_STEP, (1.0 - outside) / 4.0)  # so that near-ties stay above it (narrow bands)
            most = float(cached[tied].max())
            if most > float(cached[tied].min()):
                # Near-ties holding less of the prompt than the others: above every pod outside the band,
                # below the ones holding the most (they add less prefill and copy no prefix).
                top = np.where(cached >= most, 1.0, (1.0 + outside) / 2.0)
            if self.kv_tie_break:  # then the one with the most free KV (equal usage: still a random pick)
                usage = _kv_usage(endpoints) if usage is None else usage
                top = top - step * np.maximum(usage, 0.0)
        scores: list[float] = np.where(tied, top, plain).tolist()
        return scores

    def _copy_cost(self, table: EstimateTable, usage: F64) -> F64 | None:
        """Seconds charged to candidates that would copy into their KV a prefix another candidate holds:
        the prefill the copy adds (the profile's, not calibrated: docs/ttft-picker.md) x `copyWeight` x
        min(u / (1 - u), 2), u the KV usage of the pod the copy would go to (0 without metrics); None
        (nothing) while no candidate's KV is in use."""
        own = np.minimum(np.maximum(usage, 0.0), _FULL_PRESSURE_AT)  # (np.clip's, without its overhead)
        if not own.any():
            return None
        nominal = table.prefill_nominal
        extra = np.maximum(nominal - nominal[int(np.argmax(table.cached))], 0.0)
        return extra * (self.copy_weight * own / (1.0 - own))  # type: ignore[no-any-return]


def _kv_usage(endpoints: Sequence[Endpoint]) -> F64:
    """Each candidate's KV cache usage from its last scrape; -1 without metrics."""
    return np.array([e.metrics.kv_usage if e.metrics is not None else -1.0 for e in endpoints])


def _build(name: str, params: TtftParams, handle: PluginHandle) -> TtftScorer:
    if not 0.0 <= params.tie_band <= 1.0:
        raise PluginParamsError("tieBand", f"must be in [0, 1], got {params.tie_band}")
    if not 0.0 <= params.tie_band_seconds <= 10.0:
        raise PluginParamsError("tieBandSeconds", f"must be in [0, 10], got {params.tie_band_seconds}")
    if params.tie_break not in ("kv-usage", "random"):
        raise PluginParamsError("tieBreak", f"must be 'kv-usage' or 'random', got {params.tie_break!r}")
    if not 0.0 <= params.copy_weight <= 100.0:
        raise PluginParamsError("copyWeight", f"must be in [0, 100], got {params.copy_weight}")
    cost = handle.services.get(COST_KEY)
    if cost is None:
        cost = CostModel()
    if not isinstance(cost, CostModel):
        raise PluginParamsError("type", "the cost model service is not a CostModel")
    kv = handle.services.get(KV_KEY) if params.cache_credit else None
    if kv is not None and not isinstance(kv, KvIndexService):
        raise PluginParamsError("type", "the KV index service is not a KvIndexService")
    speculative = speculative_blocks(params.speculative_ttl, name, kv)  # (checked even without the index)
    if kv is not None:
        kv.prompt_readers.add(name)
    return TtftScorer(
        name,
        cost,
        kv,
        params.tie_band,
        params.tie_band_seconds,
        speculative,
        params.copy_weight,
        params.tie_break == "kv-usage",
    )


SPEC = PluginSpec(
    "ttft-scorer",
    "scorer",
    TtftParams,
    _build,
    "Estimated time to first token (queue + uncached prefill + tier reload + decode interference); "
    "near-ties score alike.",
)
