"""Fakes and builders for the pure core: a settable clock, endpoints, requests."""

from __future__ import annotations

from epp.types import NO_WORK, ApiKind, Endpoint, InferenceRequest, MetricsSnapshot, PrefillWork


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self.t += seconds


def endpoint(
    address: str,
    *,
    waiting: int = 0,
    running: int = 0,
    kv_usage: float = 0.0,
    observed_at: float | None = 1000.0,
    in_flight: int = 0,
    in_flight_tokens: int = 0,
    model: str | None = None,
    backlog: PrefillWork = NO_WORK,
    decoding: int = 0,
    decoding_tokens: int = 0,
    num_gpu_blocks: int | None = None,
    block_size: int | None = None,
) -> Endpoint:
    """An endpoint view with scraped metrics (none when observed_at is None)."""
    metrics = (
        None
        if observed_at is None
        else MetricsSnapshot(
            observed_at=observed_at,
            waiting=waiting,
            running=running,
            kv_usage=kv_usage,
            num_gpu_blocks=num_gpu_blocks,
            block_size=block_size,
        )
    )
    return Endpoint(
        id=address,
        metrics=metrics,
        in_flight_requests=in_flight,
        in_flight_prompt_tokens=in_flight_tokens,
        model=model,
        prefill_backlog=backlog,
        decoding_requests=decoding,
        decoding_tokens=decoding_tokens,
    )


def chat_request(
    content: str = "hello", *, model: str = "m", priority: int = 0, request_id: str = "r-1"
) -> InferenceRequest:
    return InferenceRequest(
        request_id=request_id,
        api_kind=ApiKind.CHAT_COMPLETIONS,
        model=model,
        messages=[{"role": "user", "content": content}],
        priority=priority,
        prompt_tokens_estimate=max(1, len(content) // 4),
    )


def token_request(
    tokens: list[int], *, model: str = "m", priority: int = 0, cache_salt: str | None = None
) -> InferenceRequest:
    """A completions request whose prompt is token ids (keyed without a tokenizer)."""
    return InferenceRequest(
        request_id="r-t",
        api_kind=ApiKind.COMPLETIONS,
        model=model,
        prompt=tokens,
        priority=priority,
        prompt_tokens_estimate=len(tokens),
        cache_salt=cache_salt,
    )
