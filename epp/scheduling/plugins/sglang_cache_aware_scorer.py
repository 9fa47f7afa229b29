"""`sglang-cache-aware-scorer`: the SGLang router's cache-aware policy, as a score.

If the load is imbalanced — the most and least loaded candidates differ by more than
`balanceAbsThreshold` requests and the most loaded has more than `balanceRelThreshold` times
the least — the least loaded candidates score 1 (the rest 0). Otherwise the candidate whose
routing history shares the longest prefix with the prompt scores 1, if that match covers more
than `cacheThreshold` of the prompt; else the least loaded do. Load is the requests this EPP
has in flight on each candidate. The router's character-level radix tree is approximated by
the routing-history index of `prefix-cache-scorer` with `blockSizeChars` (16) characters per
block. Defaults are the Rust router's (32, 1.1, 0.5); its Python launcher uses 64, 1.5, 0.3.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.scheduling.framework import CycleState, PluginHandle
from epp.scheduling.plugins.approx_prefix_scorer import ApproxPrefixIndex, prompt_hashes
from epp.scheduling.registry import Params, PluginParamsError, PluginSpec
from epp.types import Endpoint, EndpointId, InferenceRequest


class SglangParams(Params):
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.1
    cache_threshold: float = 0.5
    block_size_chars: int = 16
    max_prefix_blocks: int = 4096
    lru_capacity_per_server: int = 500_000


class SglangCacheAwareScorer:
    def __init__(self, name: str, params: SglangParams) -> None:
        self._name = name
        self.p = params
        self.index = ApproxPrefixIndex(params.lru_capacity_per_server)
        self._key = f"sglang_hashes:{name}"

    @property
    def name(self) -> str:
        return self._name

    def _hashes(self, state: CycleState, request: InferenceRequest) -> list[int]:
        got: list[int] | None = state.data.get(self._key)
        if got is None:
            got = state.data[self._key] = prompt_hashes(
                request, self.p.block_size_chars, self.p.max_prefix_blocks
            )
        return got

    def score(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[float]:
        loads = [e.in_flight_requests for e in endpoints]
        lo, hi = min(loads), max(loads)
        least = [1.0 if x == lo else 0.0 for x in loads]
        if hi - lo > self.p.balance_abs_threshold and hi > self.p.balance_rel_threshold * lo:
            return least
        hashes = self._hashes(state, request)
        if not hashes:
            return least
        matched = self.index.matched(hashes, [e.id for e in endpoints])
        best = max(matched.values())
        if best / len(hashes) <= self.p.cache_threshold:
            return least
        return [1.0 if matched[e.id] == best else 0.0 for e in endpoints]

    def picked(self, state: CycleState, request: InferenceRequest, endpoint: EndpointId) -> None:
        self.index.record(endpoint, self._hashes(state, request))


def _build(name: str, params: SglangParams, handle: PluginHandle) -> SglangCacheAwareScorer:
    if params.balance_abs_threshold < 0:
        raise PluginParamsError("balanceAbsThreshold", "must be >= 0")
    if not params.balance_rel_threshold >= 1.0:
        raise PluginParamsError("balanceRelThreshold", "must be >= 1")
    if not 0.0 <= params.cache_threshold <= 1.0:
        raise PluginParamsError("cacheThreshold", "must be in [0, 1]")
    for field, value in (
        ("blockSizeChars", params.block_size_chars),
        ("maxPrefixBlocks", params.max_prefix_blocks),
        ("lruCapacityPerServer", params.lru_capacity_per_server),
    ):
        if value < 1:
            raise PluginParamsError(field, "must be >= 1")
    return SglangCacheAwareScorer(name, params)


SPEC = PluginSpec(
    "sglang-cache-aware-scorer",
    "scorer",
    SglangParams,
    _build,
    "The SGLang router's cache-aware policy: least load when imbalanced or no good prefix match.",
)
