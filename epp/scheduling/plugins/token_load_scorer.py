"""`token-load-scorer`: 1 - min(1, prompt tokens the EPP has in flight / threshold)."""

from __future__ import annotations

from collections.abc import Sequence

from epp.scheduling.framework import CycleState, PluginHandle
from epp.scheduling.registry import Params, PluginParamsError, PluginSpec
from epp.types import Endpoint, InferenceRequest


class TokenLoadParams(Params):
    queue_threshold_tokens: int = 16384


class TokenLoadScorer:
    def __init__(self, name: str, threshold: int) -> None:
        self._name = name
        self._threshold = float(threshold)

    @property
    def name(self) -> str:
        return self._name

    def score(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[float]:
        t = self._threshold
        return [1.0 - min(1.0, e.in_flight_prompt_tokens / t) for e in endpoints]


def _build(name: str, params: TokenLoadParams, handle: PluginHandle) -> TokenLoadScorer:
    if params.queue_threshold_tokens <= 0:
        raise PluginParamsError("queueThresholdTokens", "queueThresholdTokens must be > 0")
    return TokenLoadScorer(name, params.queue_threshold_tokens)


SPEC = PluginSpec(
    "token-load-scorer",
    "scorer",
    TokenLoadParams,
    _build,
    "1 - min(1, in-flight prompt tokens / queueThresholdTokens).",
)
