"""`precise-prefix-cache-scorer`: how much of the prompt each pod already holds, from engine KV events.

Score = the longest consecutive run of the prompt's blocks from block 0 that the pod holds,
each block weighted by the best tier it sits on there (default gpu 1.0, cpu 0.8, storage
0.5, unknown tiers 0), divided by the prompt's block count. Pods whose index is stale get 0.
Without keys for the prompt (no tokenizer for a text prompt's model) every pod scores 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from epp.kvindex.freshness import Freshness
from epp.kvindex.service import SERVICE_KEY, KvIndexService
from epp.scheduling.framework import CycleState, PluginHandle
from epp.scheduling.registry import Params, PluginParamsError, PluginSpec
from epp.types import Endpoint, InferenceRequest

KEYS = "prompt_block_keys"
"""CycleState key: the prompt's block keys, computed once per cycle for every plugin."""


DEFAULT_TIER_WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "storage": 0.5}


class PrecisePrefixParams(Params):
    tier_weights: dict[str, float] = msgspec.field(default_factory=dict)  # merged over DEFAULT_TIER_WEIGHTS
    unknown_tier_weight: float = 0.0


def prompt_keys(state: CycleState, request: InferenceRequest, service: KvIndexService) -> np.ndarray | None:
    """The prompt's block keys, computed once per scheduling cycle and shared by plugins."""
    if KEYS not in state.data:
        state.data[KEYS] = service.prompt_keys(request)
    keys: np.ndarray | None = state.data[KEYS]
    return keys


class PrecisePrefixCacheScorer:
    def __init__(self, name: str, service: KvIndexService, weights: dict[str, float], unknown: float) -> None:
        self._name = name
        self.service = service
        self.weights = weights
        self.unknown = unknown

    @property
    def name(self) -> str:
        return self._name

    def score(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[float]:
        keys = prompt_keys(state, request, self.service)
        n = 0 if keys is None else len(keys)
        if n == 0:
            return [0.0] * len(endpoints)
        fresh = self.service.freshness
        pods = [e.id for e in endpoints if fresh.state(e.id, state.now).state is not Freshness.STALE]
        if not pods:
            return [0.0] * len(endpoints)
        assert keys is not None
        held = self.service.index.lookup_weighted(keys, pods, self.weights, self.unknown)
        return [held.get(e.id, 0.0) / n for e in endpoints]


def _build(name: str, params: PrecisePrefixParams, handle: PluginHandle) -> PrecisePrefixCacheScorer:
    for tier, w in params.tier_weights.items():
        if not 0.0 <= w <= 1.0:
            raise PluginParamsError(f"tierWeights.{tier}", f"tier weight must be in [0, 1], got {w}")
    if not 0.0 <= params.unknown_tier_weight <= 1.0:
        raise PluginParamsError("unknownTierWeight", "must be in [0, 1]")
    service = handle.services.get(SERVICE_KEY)
    if not isinstance(service, KvIndexService):
        raise PluginParamsError("type", "needs the KV index (this EPP was built without one)")
    weights = DEFAULT_TIER_WEIGHTS | {k.lower(): float(v) for k, v in params.tier_weights.items()}
    return PrecisePrefixCacheScorer(name, service, weights, params.unknown_tier_weight)


SPEC = PluginSpec(
    "precise-prefix-cache-scorer",
    "scorer",
    PrecisePrefixParams,
    _build,
    "Weighted longest prefix of the prompt each pod holds, from engine KV events.",
)
