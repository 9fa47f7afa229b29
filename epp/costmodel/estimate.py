"""Estimated time to first token on each candidate pod, term by term, for all candidates at once. Pure.

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

vLLM always computes at least the prompt's last token and hits whole blocks, so at most
`floor((prompt_tokens - 1) / block_size) * block_size` tokens count as cached. The arithmetic
runs on numpy arrays over the candidates (one pass of a few dozen vector operations instead of
a Python loop per pod); `EstimateTable` keeps the arrays and builds a `TtftEstimate` only for
the endpoints someone asks about.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from epp.costmodel.profile import ModelProfile
from epp.types import Endpoint, EndpointId, PrefillWork, TtftEstimate

F64 = npt.NDArray[np.float64]
_INF = float("inf")


def tier_order(profile: ModelProfile) -> list[str]:
    """Slower tiers from fastest to slowest reload (by bandwidth)."""
    return sorted(profile.tiers, key=lambda t: -profile.tiers[t].bandwidth_bytes_per_s)


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


class EstimateTable(Mapping[EndpointId, TtftEstimate]):
    """Every candidate's estimate as arrays; a read-only mapping endpoint id -> TtftEstimate."""

    __slots__ = (
        "_at",
        "cached",
        "decode",
        "ids",
        "prefill",
        "prefill_nominal",
        "prompt_tokens",
        "queue",
        "queue_nominal",
        "reload",
        "reloaded",
        "ttft",
    )

    def __init__(
        self,
        ids: Sequence[EndpointId],
        prompt_tokens: int,
        columns: tuple[F64, F64, F64, F64, F64, F64, F64, F64],
    ) -> None:
        self.ids = ids
        self.prompt_tokens = prompt_tokens
        (
            self.queue,
            self.prefill,
            self.reload,
            self.decode,
            self.cached,
            self.reloaded,
            self.queue_nominal,
            self.prefill_nominal,
        ) = columns
        self.ttft: F64 = self.queue + self.prefill + self.reload + self.decode
        self._at: dict[EndpointId, int] | None = None

    def row(self, i: int) -> TtftEstimate:
        n = self.prompt_tokens
        cached = int(self.cached[i])
        uncached = n - cached
        work = (
            PrefillWork(1, uncached, uncached * (cached + uncached / 2.0)) if uncached > 0 else PrefillWork(1)
        )
        return TtftEstimate(
            queue_s=float(self.queue[i]),
            prefill_s=float(self.prefill[i]),
            reload_s=float(self.reload[i]),
            decode_s=float(self.decode[i]),
            prompt_tokens=n,
            cached_tokens=cached,
            reloaded_tokens=int(self.reloaded[i]),
            work=work,
            queue_nominal_s=float(self.queue_nominal[i]),
            prefill_nominal_s=float(self.prefill_nominal[i]),
        )

    def __getitem__(self, key: EndpointId) -> TtftEstimate:
        if self._at is None:
            self._at = {e: i for i, e in enumerate(self.ids)}
        return self.row(self._at[key])

    def __iter__(self) -> Iterator[EndpointId]:
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


def estimate_all(
    profile: ModelProfile,
    endpoints: Sequence[Endpoint],
    prompt_tokens: int,
    held_tokens: Mapping[str, F64] | None = None,
    prefill_scale: float = 1.0,
    queue_scale: float = 1.0,
    order: Sequence[str] | None = None,
    block_size: int = 1,
) -> EstimateTable:
    """Estimates for every endpoint. `held_tokens`: tier -> tokens each endpoint can take from that
    tier (its GPU prefix of the prompt, then what each slower tier adds; arrays aligned with
    `endpoints`); None or {} for no cache credit. Hits count in whole engine blocks (the endpoint's
    `block_size` from its metrics, else `block_size`), at most `floor((n - 1) / block) * block`
    tokens: vLLM always computes at least the prompt's last token."""
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
    short = uncached + own_tok > free
    if short.any():
        step = p.decode_fixed_s + p.decode_per_sequence_s * seqs + p.decode_per_context_token_s * context
        queue_nominal = queue_nominal + np.where(short, p.kv_wait_steps * step, 0.0)
    steps = np.maximum(np.ceil((own_tok + unknown_waiting * unk + uncached) / p.max_batched_tokens), 1.0)
    decode = steps * (p.decode_per_sequence_s * seqs + p.decode_per_context_token_s * context)
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


def estimate_ttft(
    profile: ModelProfile,
    endpoint: Endpoint,
    prompt_tokens: int,
    held_tokens: Mapping[str, int] | None = None,
    prefill_scale: float = 1.0,
    queue_scale: float = 1.0,
    order: Sequence[str] | None = None,
    block_size: int = 1,
) -> TtftEstimate:
    """One endpoint's estimate; `held_tokens`: tier -> tokens it can take from that tier."""
    held = {t: np.array([float(v)]) for t, v in (held_tokens or {}).items()}
    table = estimate_all(
        profile, [endpoint], prompt_tokens, held, prefill_scale, queue_scale, order, block_size
    )
    return table.row(0)
