"""The cost model's vectorised numpy estimate, as it was before the compiled kernel: the reference
`tests/unit/test_estimate_kernel.py` compares `epp.costmodel.estimate.estimate_all` with."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from epp.costmodel.estimate import EstimateTable, tier_order
from epp.costmodel.profile import ModelProfile
from epp.types import Endpoint

F64 = npt.NDArray[np.float64]
_INF = float("inf")


def _load(endpoint: Endpoint) -> tuple[float, ...]:
    b = endpoint.prefill_backlog
    m = endpoint.metrics
    if m is None:
        return (
            b.requests,
            b.tokens,
            b.pairs,
            0,
            0,
            endpoint.decoding_requests,
            endpoint.decoding_tokens,
            _INF,
            0,
        )
    free = _INF
    if m.num_gpu_blocks and m.block_size:
        free = (1.0 - m.kv_usage) * m.num_gpu_blocks * m.block_size
    return (
        b.requests,
        b.tokens,
        b.pairs,
        m.waiting,
        m.running,
        endpoint.decoding_requests,
        endpoint.decoding_tokens,
        free,
        m.block_size or 0,
    )


def reference_estimate_all(
    profile: ModelProfile,
    endpoints: Sequence[Endpoint],
    prompt_tokens: int,
    held_tokens: Mapping[str, F64] | None = None,
    prefill_scale: float = 1.0,
    queue_scale: float = 1.0,
    order: Sequence[str] | None = None,
    block_size: int = 1,
) -> EstimateTable:
    """`estimate_all` as numpy arithmetic over the candidates (same arguments, same table)."""
    p = profile
    k = len(endpoints)
    n = max(prompt_tokens, 1)
    load = np.array([_load(e) for e in endpoints], dtype=np.float64).reshape(k, 9)
    own_req, own_tok, own_pairs, waiting, running, decoding, dec_tokens, free, engine_bs = load.T
    kp = prefill_scale
    fixed, per_tok, per_pair = p.prefill_fixed_s, p.prefill_per_token_s, p.prefill_per_pair_s

    def prefill(cached: F64) -> F64:
        u = n - cached
        return kp * (fixed + per_tok * u + per_pair * u * (cached + u / 2.0))

    zeros = np.zeros(k)
    held = {t: v for t, v in (held_tokens or {}).items() if v.any()}
    if not held:  # no cache credit anywhere (the load-only case): one prefill for every pod
        best_cached = gpu_cached = best_reload = zeros
        best_prefill = np.full(k, kp * (fixed + per_tok * n + per_pair * n * n / 2.0))
    else:
        bs = np.where(engine_bs > 0, engine_bs, float(max(block_size, 1)))
        cap = np.floor((n - 1) / bs) * bs
        gpu = held.get("gpu")
        cached = zeros.copy() if gpu is None else np.floor(np.minimum(gpu, cap) / bs) * bs
        gpu_cached = cached.copy()
        best_prefill = prefill(cached)
        best_total = best_prefill.copy()
        best_cached, best_reload = cached.copy(), zeros.copy()
        reload_total = zeros.copy()
        for tier in order if order is not None else tier_order(p):
            t = held.get(tier)
            if t is None:
                continue
            cost = p.tiers[tier]
            take = np.floor(np.minimum(cached + t, cap) / bs) * bs - cached
            reload_total = reload_total + np.where(
                take > 0, cost.latency_s + take * (p.kv_bytes_per_token / cost.bandwidth_bytes_per_s), 0.0
            )
            cached = cached + take
            pre = prefill(cached)
            total = pre + reload_total
            better = total < best_total
            if better.any():
                best_total = np.where(better, total, best_total)
                best_prefill = np.where(better, pre, best_prefill)
                best_cached = np.where(better, cached, best_cached)
                best_reload = np.where(better, reload_total, best_reload)
    uncached = n - best_cached

    unk = float(p.unknown_request_tokens)
    unknown_waiting = np.maximum(waiting - own_req, 0.0)
    # The engine's `running` also counts this EPP's own requests that are past waiting but still in
    # prefill (they are in the backlog, not decoding): those are not unknown load.
    unknown_running = np.maximum(running - decoding - np.maximum(own_req - waiting, 0.0), 0.0)
    queue_nominal = fixed * own_req + per_tok * own_tok + per_pair * own_pairs
    queue_nominal = queue_nominal + unknown_waiting * (fixed + per_tok * unk + per_pair * unk * unk / 2.0)
    seqs = decoding + unknown_running
    context = dec_tokens + unknown_running * unk
    short = (n - gpu_cached) + own_tok > free
    if short.any():
        step = p.decode_fixed_s + p.decode_per_sequence_s * seqs + p.decode_per_context_token_s * context
        queue_nominal = queue_nominal + np.where(short, p.kv_wait_steps * step, 0.0)
    steps = np.maximum(np.ceil((own_tok + unknown_waiting * unk + uncached) / p.max_batched_tokens), 1.0)
    decode = steps * (p.decode_per_sequence_s * seqs + p.decode_per_context_token_s * context)
    idle_queue = (seqs > 0) & (own_tok == 0) & (unknown_waiting == 0)
    step_now = p.decode_fixed_s + p.decode_per_sequence_s * seqs + p.decode_per_context_token_s * context
    in_progress = 1.5 if p.async_scheduling else 0.5  # half the step in progress, and the one scheduled ahead
    decode = np.where(idle_queue, decode + in_progress * step_now, decode)
    return EstimateTable(
        [e.id for e in endpoints],
        n,
        (
            queue_nominal * queue_scale,
            best_prefill,
            best_reload,
            decode,
            best_cached,
            best_cached - np.minimum(gpu_cached, best_cached),
            queue_nominal,
            best_prefill / kp if kp else best_prefill,
        ),
    )
