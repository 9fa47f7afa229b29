"""`precise-prefix-cache-scorer`: how much of the prompt each pod already holds, from engine KV events.

Score = the longest consecutive run of the prompt's blocks from block 0 that the pod holds,
each block weighted by the best tier it sits on there (default gpu 1.0, cpu 0.8, storage
0.5, unknown tiers 0), divided by the prompt's block count. Pods whose index is stale get 0.
Without keys for the prompt (no tokenizer for a text prompt's model) every pod scores 0.

`speculativeTtl` (off unless set, e.g. `2s` as llm-d does): when a request is routed, its blocks are
recorded for the chosen pod for that long (`kvindex/speculative.py`, kept apart from the exact
index), so that requests right behind it see them before the engine's KV events confirm them. A
pod then scores the better of its reported prefix (weighted as above) and its speculative one
(each block at the gpu weight).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from epp.kvindex.service import SERVICE_KEY, KvIndexService
from epp.kvindex.speculative import SpeculativeBlocks
from epp.scheduling.framework import CycleState, PluginHandle
from epp.scheduling.plugins.cache_mode import creditable, load_only
from epp.scheduling.plugins.prompt_keys import prompt_key_list, prompt_keys
from epp.scheduling.plugins.speculation import remember, speculative_blocks
from epp.scheduling.registry import Params, PluginParamsError, PluginSpec
from epp.types import Endpoint, EndpointId, InferenceRequest

DEFAULT_TIER_WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "storage": 0.5}


class PrecisePrefixParams(Params):
    tier_weights: dict[str, float] = msgspec.field(default_factory=dict)  # merged over DEFAULT_TIER_WEIGHTS
    unknown_tier_weight: float = 0.0
    speculative_ttl: str | float = 0.0  # 0: no speculative entries


class PrecisePrefixCacheScorer:
    def __init__(
        self,
        name: str,
        service: KvIndexService,
        weights: dict[str, float],
        unknown: float,
        speculative: SpeculativeBlocks | None = None,
    ) -> None:
        self._name = name
        self.service = service
        self.weights = weights
        self.unknown = unknown
        self.speculative = speculative

    @property
    def name(self) -> str:
        return self._name

    def score(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[float]:
        keys = prompt_keys(state, request, self.service)
        n = 0 if keys is None else len(keys)
        if keys is None:
            load_only(state)
            return [0.0] * len(endpoints)
        pods = creditable(state, self.service, endpoints)
        if not pods or n == 0:
            return [0.0] * len(endpoints)
        held = self.service.index.lookup_weighted(keys, pods, self.weights, self.unknown)
        if self.speculative is not None:
            gpu = self.weights.get("gpu", self.unknown)
            for pod, blocks in self.speculative.prefix(prompt_key_list(state, keys), pods, state.now).items():
                if blocks * gpu > held.get(pod, 0.0):
                    held[pod] = blocks * gpu
        return [held.get(e.id, 0.0) / n for e in endpoints]

    def picked(self, state: CycleState, request: InferenceRequest, endpoint: EndpointId) -> None:
        """With `speculativeTtl`: the routed prompt's blocks are the chosen pod's, for that long."""
        remember(self.speculative, self.service, state, request, endpoint)


def _build(name: str, params: PrecisePrefixParams, handle: PluginHandle) -> PrecisePrefixCacheScorer:
    for tier, w in params.tier_weights.items():
        if not 0.0 <= w <= 1.0:
            raise PluginParamsError(f"tierWeights.{tier}", f"tier weight must be in [0, 1], got {w}")
    if not 0.0 <= params.unknown_tier_weight <= 1.0:
        raise PluginParamsError("unknownTierWeight", "must be in [0, 1]")
    service = handle.services.get(SERVICE_KEY)
    if not isinstance(service, KvIndexService):
        speculative_blocks(params.speculative_ttl, name, None)  # (a bad value is named first)
        raise PluginParamsError("type", "needs the KV index (this EPP was built without one)")
    speculative = speculative_blocks(params.speculative_ttl, name, service)
    service.prompt_readers.add(name)
    weights = DEFAULT_TIER_WEIGHTS | {k.lower(): float(v) for k, v in params.tier_weights.items()}
    return PrecisePrefixCacheScorer(name, service, weights, params.unknown_tier_weight, speculative)


SPEC = PluginSpec(
    "precise-prefix-cache-scorer",
    "scorer",
    PrecisePrefixParams,
    _build,
    "Weighted longest prefix of the prompt each pod holds, from engine KV events.",
)
