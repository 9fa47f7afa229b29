"""`dynamo-kv-scorer`: NVIDIA Dynamo's KV router cost, as a score.

    cost = prefillLoadScale * max(active_prefill_blocks + prompt_blocks - overlap_credit, 0)
           + active_decode_blocks

with overlap credit = device blocks x 1.0 + host blocks x 0.75 + disk blocks x 0.25 (the prompt's
consecutive prefix on GPU, then what the CPU and storage tiers add; weights configurable), active
prefill blocks = the uncached prompt tokens of requests this EPP routed there that have no first
token yet, active decode blocks = the prompt tokens of every request it routed there that has not
finished (both / block size: Dynamo tracks load from its own routing, not from engine metrics).
The score is the cost min-max normalised and inverted (lowest cost scores 1), so the max-score
picker takes Dynamo's argmin (temperature 0; ties at random). Stale pods get no overlap credit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from epp.kvindex.service import SERVICE_KEY, KvIndexService
from epp.scheduling.framework import CycleState, PluginHandle
from epp.scheduling.plugins.cache_mode import creditable, load_only
from epp.scheduling.plugins.prompt_keys import prompt_info
from epp.scheduling.registry import Params, PluginParamsError, PluginSpec
from epp.types import Endpoint, InferenceRequest

TIERS = ("gpu", "cpu", "storage")


class DynamoParams(Params):
    prefill_load_scale: float = 1.0
    device_weight: float = 1.0
    host_weight: float = 0.75
    disk_weight: float = 0.25


class DynamoKvScorer:
    def __init__(self, name: str, service: KvIndexService, scale: float, weights: tuple[float, ...]) -> None:
        self._name = name
        self.service = service
        self.scale = scale
        self.weights = np.array(weights)

    @property
    def name(self) -> str:
        return self._name

    def costs(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> np.ndarray:
        kv = self.service
        bs = kv.block_size
        tokens, keys = prompt_info(state, request, kv)
        n_tokens = request.prompt_tokens_estimate if tokens is None else tokens + request.batch_tokens
        credit = np.zeros(len(endpoints))
        if keys is None:
            load_only(state)
        else:
            pods = set(creditable(state, kv, endpoints))
            if pods and len(keys):
                runs = kv.index.lookup_tier_runs(keys, [e.id for e in endpoints], TIERS).astype(np.float64)
                per_tier = np.diff(runs, axis=0, prepend=0.0)  # device, host, disk blocks
                credit = self.weights @ per_tier
                credit[[e.id not in pods for e in endpoints]] = 0.0
        prompt_blocks = -(-n_tokens // bs)
        prefill = np.array([e.prefill_backlog.tokens / bs for e in endpoints])
        decode = np.array([e.in_flight_prompt_tokens / bs for e in endpoints])
        cost: np.ndarray = self.scale * np.maximum(prefill + prompt_blocks - credit, 0.0) + decode
        return cost

    def score(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[float]:
        cost = self.costs(state, request, endpoints)
        lo, hi = float(cost.min()), float(cost.max())
        if hi <= lo:
            return [1.0] * len(endpoints)
        scores: list[float] = ((hi - cost) / (hi - lo)).tolist()
        return scores


def _build(name: str, params: DynamoParams, handle: PluginHandle) -> DynamoKvScorer:
    values = {
        "prefillLoadScale": params.prefill_load_scale,
        "deviceWeight": params.device_weight,
        "hostWeight": params.host_weight,
        "diskWeight": params.disk_weight,
    }
    for field, value in values.items():
        if not 0.0 <= value < float("inf"):
            raise PluginParamsError(field, f"must be a finite number >= 0, got {value}")
    service = handle.services.get(SERVICE_KEY)
    if not isinstance(service, KvIndexService):
        raise PluginParamsError("type", "needs the KV index (this EPP was built without one)")
    weights = (params.device_weight, params.host_weight, params.disk_weight)
    service.prompt_readers.add(name)
    return DynamoKvScorer(name, service, params.prefill_load_scale, weights)


SPEC = PluginSpec(
    "dynamo-kv-scorer",
    "scorer",
    DynamoParams,
    _build,
    "NVIDIA Dynamo's KV router cost (prefill load - tiered overlap credit + decode blocks), lowest scores 1.",
)
