"""Frozen value types shared by the core and the edges."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

EndpointId = str
"""An endpoint is named by its `ip:port`, exactly as Envoy receives it."""


class ApiKind(enum.Enum):
    """OpenAI-style API, from the `:path` suffix."""

    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat_completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """What one scrape of a model server's `/metrics` said, and when (`observed_at`, Clock seconds)."""

    observed_at: float
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    models: frozenset[str] = frozenset()
    running_lora_adapters: frozenset[str] = frozenset()
    waiting_lora_adapters: frozenset[str] = frozenset()
    max_lora: int | None = None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A candidate as the scheduler sees it: an immutable view taken per scheduling cycle."""

    id: EndpointId
    metrics: MetricsSnapshot | None = None
    healthy: bool = True
    in_flight_requests: int = 0
    in_flight_prompt_tokens: int = 0
    model: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    def metrics_age(self, now: float) -> float:
        """Seconds since the last scrape; infinity if there never was one."""
        if self.metrics is None:
            return float("inf")
        return max(0.0, now - self.metrics.observed_at)


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One OpenAI-style request, parsed once at the edge."""

    request_id: str
    api_kind: ApiKind
    model: str
    prompt: str | Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    stream: bool = False
    max_tokens: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    objective: str | None = None
    priority: int = 0
    body_bytes: int = 0
    prompt_tokens_estimate: int = 0
    cache_salt: str | None = None

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of a scheduling cycle: endpoints in order (first is primary)."""

    endpoints: tuple[EndpointId, ...]
    profile: str
    reason: str
    scores: Mapping[EndpointId, float] = field(default_factory=dict)

    @property
    def primary(self) -> EndpointId:
        return self.endpoints[0]
