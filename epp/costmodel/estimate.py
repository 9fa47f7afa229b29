"""Estimated time to first token on one pod, term by term. Pure.

    ttft = queue + prefill + reload + decode

- **queue**: prefill work ahead of the request on that pod: the prefill backlog of requests
  this EPP routed there that have no first token yet (their uncached tokens and attention
  pairs, summed), plus the engine's reported waiting requests beyond those (load the EPP did
  not route: other replicas, direct traffic), each assumed to bring
  `unknown_request_tokens` uncached tokens; plus, when the pod's free KV blocks cannot hold
  the request's uncached tokens, `kv_wait_steps` decode steps for running requests to free
  some. Scaled by the calibrated queue coefficient.
- **prefill**: the uncached part of the prompt after the cached context. Scaled by the
  calibrated prefill coefficient.
- **reload**: blocks held only on a slower tier (CPU, storage) are brought back at the
  tier's bandwidth, or recomputed, whichever is cheaper: the estimate tries "reload nothing",
  "reload the next tier's blocks", ... in tier order and keeps the smallest total.
- **decode**: interference from requests decoding on the pod, for each engine step the
  queued and own prefill spans (`max_batched_tokens` per step, chunked prefill).

vLLM always recomputes at least the prompt's last token, so at most `prompt_tokens - 1`
tokens count as cached.
"""

from __future__ import annotations

from collections.abc import Mapping

from epp.costmodel.profile import ModelProfile
from epp.types import NO_WORK, Endpoint, PrefillWork, TtftEstimate


def tier_order(profile: ModelProfile) -> list[str]:
    """Slower tiers from fastest to slowest reload (by bandwidth)."""
    return sorted(profile.tiers, key=lambda t: -profile.tiers[t].bandwidth_bytes_per_s)


def estimate_ttft(
    profile: ModelProfile,
    endpoint: Endpoint,
    prompt_tokens: int,
    held_tokens: Mapping[str, int] | None = None,
    prefill_scale: float = 1.0,
    queue_scale: float = 1.0,
    order: list[str] | None = None,
) -> TtftEstimate:
    """`held_tokens`: tokens of the prompt's consecutive cached prefix on the pod, by the best tier
    holding each block (GPU first, then slower tiers); None or {} for no cache credit."""
    n = max(prompt_tokens, 1)
    cap = n - 1
    gpu = min(held_tokens.get("gpu", 0), cap) if held_tokens else 0
    # Options: keep the GPU prefix only, or also reload the next tier(s) in order.
    best_cost = profile.prefill_s(n - gpu, gpu) * prefill_scale
    best = (gpu, 0, 0.0, best_cost)  # cached, reloaded, reload_s, prefill_s
    if held_tokens and len(held_tokens) > (1 if "gpu" in held_tokens else 0):
        cached, reload_total = gpu, 0.0
        for tier in order if order is not None else tier_order(profile):
            t = held_tokens.get(tier, 0)
            if not t or cached >= cap:
                continue
            take = min(t, cap - cached)
            cost = profile.reload_s(tier, take)
            if cost is None:
                break
            cached += take
            reload_total += cost
            prefill = profile.prefill_s(n - cached, cached) * prefill_scale
            if prefill + reload_total < best[2] + best[3]:
                best = (cached, cached - gpu, reload_total, prefill)
    cached, reloaded, reload_s, prefill_s = best
    uncached = n - cached
    work = profile.work(uncached, cached)

    own: PrefillWork = endpoint.prefill_backlog
    m = endpoint.metrics
    unknown_waiting = max(0, m.waiting - own.requests) if m is not None else 0
    unknown_running = max(0, m.running - endpoint.decoding_requests) if m is not None else 0
    unk = profile.unknown_request_tokens
    queue_nominal = profile.work_s(own) + unknown_waiting * profile.prefill_s(unk, 0)
    decoding = endpoint.decoding_requests + unknown_running
    context = endpoint.decoding_tokens + unknown_running * unk
    if m is not None and m.num_gpu_blocks and m.block_size:
        free_tokens = (1.0 - m.kv_usage) * m.num_gpu_blocks * m.block_size
        if uncached + own.tokens > free_tokens:
            queue_nominal += profile.kv_wait_steps * profile.decode_step_s(decoding, context)
    steps = -(-(own.tokens + unknown_waiting * unk + uncached) // profile.max_batched_tokens)
    decode_s = max(steps, 1) * (
        profile.decode_per_sequence_s * decoding + profile.decode_per_context_token_s * context
    )
    prefill_nominal = prefill_s / prefill_scale if prefill_scale else prefill_s
    return TtftEstimate(
        queue_s=queue_nominal * queue_scale,
        prefill_s=prefill_s,
        reload_s=reload_s,
        decode_s=decode_s if decoding else 0.0,
        prompt_tokens=n,
        cached_tokens=cached,
        reloaded_tokens=reloaded,
        work=work,
        queue_nominal_s=queue_nominal,
        prefill_nominal_s=prefill_nominal,
    )


__all__ = ["NO_WORK", "estimate_ttft", "tier_order"]
