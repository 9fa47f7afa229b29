"""Estimated time to first token on each candidate pod, term by term, for all candidates at once. Pure.

    ttft = queue + prefill + reload + decode

- **queue**: prefill work ahead of the request on that pod: the prefill backlog of requests
  this EPP routed there that have no first token yet (their uncached tokens and attention
  pairs, summed), plus the engine's reported waiting requests beyond those (load the EPP did
  not route: other replicas, direct traffic), each assumed to bring
  `unknown_request_tokens` uncached tokens; plus, when the pod's free KV blocks cannot hold
  the request's tokens that are not on its GPU already (uncached and reloaded ones),
  `kv_wait_steps` decode steps for running requests to free some. Scaled by the calibrated
  queue coefficient.
- **prefill**: the uncached part of the prompt after the cached context. Scaled by the
  calibrated prefill coefficient.
- **reload**: blocks held only on a slower tier (CPU, storage) are brought back at the
  tier's bandwidth, or recomputed, whichever is cheaper: the estimate tries "reload nothing",
  "reload the next tier's blocks", ... in tier order and keeps the smallest total.
- **decode**: interference from requests decoding on the pod, for each engine step the
  queued and own prefill spans (`max_batched_tokens` per step, chunked prefill); and, when nothing
  is queued there but requests decode, half of the decode step in progress (`decode_fixed` + the
  batch's per-sequence and per-context-token cost): a pod that decodes is always mid-step, and a
  request arriving at a random moment waits on average half a step before its prefill can start;
  with async scheduling (vLLM's default, the profile's `async_scheduling`) one step more: the engine
  scheduled the next step while this one runs, and the request joins the one after.
  (With a backlog the step in progress is one of the backlog's, counted whole in the queue.)

vLLM always computes at least the prompt's last token and hits whole blocks, so at most
`floor((prompt_tokens - 1) / block_size) * block_size` tokens count as cached. The arithmetic
is one compiled loop over the candidates (`_estimate`, numba: `docs/architecture.md`, "Compiled
loops"), reading each endpoint's numbers from its packed `load_row`; it gives the values the former
vectorised numpy code gave (kept as the tests' reference). `EstimateTable` keeps the arrays and
builds a `TtftEstimate` only for the endpoints someone asks about.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from epp.costmodel.profile import DEFAULT_REFERENCE, REFERENCE_PROFILES, ModelProfile
from epp.types import LOAD_COLUMNS, Endpoint, EndpointId, PrefillWork, TtftEstimate

F64 = npt.NDArray[np.float64]


def tier_order(profile: ModelProfile) -> list[str]:
    """Slower tiers from fastest to slowest reload (by bandwidth)."""
    return sorted(profile.tiers, key=lambda t: -profile.tiers[t].bandwidth_bytes_per_s)


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
    load = np.frombuffer(b"".join([e.load_row for e in endpoints]), dtype=np.float64).reshape(
        k, len(LOAD_COLUMNS)
    )
    held = {t: v for t, v in (held_tokens or {}).items() if v.any()}
    tiers = [t for t in (order if order is not None else tier_order(p)) if t in held]
    rows = np.zeros((len(tiers) + 1, k), dtype=np.float64)
    if "gpu" in held:
        rows[0] = held["gpu"]
    for i, t in enumerate(tiers):
        rows[i + 1] = held[t]
    costs = [p.tiers[t] for t in tiers]
    out = np.empty((8, k), dtype=np.float64)
    _estimate(
        load,
        rows,
        np.array([c.latency_s for c in costs], dtype=np.float64),
        np.array([p.kv_bytes_per_token / c.bandwidth_bytes_per_s for c in costs], dtype=np.float64),
        bool(held),
        "gpu" in held,
        float(n),
        float(max(block_size, 1)),
        np.array(
            [
                prefill_scale,
                queue_scale,
                p.prefill_fixed_s,
                p.prefill_per_token_s,
                p.prefill_per_pair_s,
                float(p.unknown_request_tokens),
                p.kv_wait_steps,
                p.decode_fixed_s,
                p.decode_per_sequence_s,
                p.decode_per_context_token_s,
                p.max_batched_tokens,
                1.5 if p.async_scheduling else 0.5,
            ],
            dtype=np.float64,
        ),
        out,
    )
    return EstimateTable([e.id for e in endpoints], n, tuple(out))  # type: ignore[arg-type]


@numba.njit(cache=True, nogil=True)
def _estimate(
    load: Any,
    rows: Any,
    latency: Any,
    per_token: Any,
    any_held: bool,
    gpu_held: bool,
    n: float,
    default_bs: float,
    c: Any,
    out: Any,
) -> None:  # pragma: no cover - compiled
    """The terms of the module docstring for endpoint i in out[:, i]: queue, prefill, reload, decode,
    cached, reloaded tokens, queue nominal, prefill nominal. `rows`: held tokens per endpoint, GPU
    first, then the slower tiers in reload order; `c`: the profile's coefficients (see the caller).
    Scalar code per endpoint, written so that every value is the one the former vectorised numpy
    arithmetic gave (same operations in the same order)."""
    kp, kq, fixed, per_tok, per_pair, unk, kv_wait_steps, d_fixed, d_seq, d_ctx, max_batched = (
        c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10]
    )  # fmt: skip
    in_progress = c[11]  # steps an arrival waits at a pod that decodes with nothing queued
    for i in range(load.shape[0]):
        own_req, own_tok, own_pairs = load[i, 0], load[i, 1], load[i, 2]
        waiting, running, decoding, dec_tokens = load[i, 3], load[i, 4], load[i, 5], load[i, 6]
        free, engine_bs = load[i, 7], load[i, 8]
        if not any_held:  # no cache credit anywhere (the load-only case): one prefill for every pod
            best_cached = gpu_cached = best_reload = 0.0
            best_prefill = kp * (fixed + per_tok * n + per_pair * n * n / 2.0)
        else:
            bs = engine_bs if engine_bs > 0 else default_bs
            cap = np.floor((n - 1) / bs) * bs
            cached = np.floor(min(rows[0, i], cap) / bs) * bs if gpu_held else 0.0
            gpu_cached = cached
            u = n - cached
            best_prefill = kp * (fixed + per_tok * u + per_pair * u * (cached + u / 2.0))
            best_total = best_prefill
            best_cached, best_reload = cached, 0.0
            reload_total = 0.0
            for t in range(latency.shape[0]):
                take = np.floor(min(cached + rows[t + 1, i], cap) / bs) * bs - cached
                reload_total = reload_total + (latency[t] + take * per_token[t] if take > 0 else 0.0)
                cached = cached + take
                u = n - cached
                pre = kp * (fixed + per_tok * u + per_pair * u * (cached + u / 2.0))
                total = pre + reload_total
                if total < best_total:
                    best_total, best_prefill, best_cached, best_reload = total, pre, cached, reload_total
        uncached = n - best_cached
        unknown_waiting = max(waiting - own_req, 0.0)
        # The engine's `running` also counts this EPP's own requests that are past waiting but still in
        # prefill (they are in the backlog, not decoding): those are not unknown load.
        unknown_running = max(running - decoding - max(own_req - waiting, 0.0), 0.0)
        queue_nominal = fixed * own_req + per_tok * own_tok + per_pair * own_pairs
        queue_nominal = queue_nominal + unknown_waiting * (fixed + per_tok * unk + per_pair * unk * unk / 2.0)
        seqs = decoding + unknown_running
        context = dec_tokens + unknown_running * unk
        # blocks the request needs free on the GPU: everything not already there (reloaded ones too)
        if n - gpu_cached + own_tok > free:
            step = d_fixed + d_seq * seqs + d_ctx * context
            queue_nominal = queue_nominal + kv_wait_steps * step
        steps = max(np.ceil((own_tok + unknown_waiting * unk + uncached) / max_batched), 1.0)
        out[0, i] = queue_nominal * kq
        out[1, i] = best_prefill
        out[2, i] = best_reload
        out[3, i] = steps * (d_seq * seqs + d_ctx * context)
        if seqs > 0 and own_tok == 0 and unknown_waiting == 0:  # half the step in progress (+ the next)
            out[3, i] = out[3, i] + in_progress * (d_fixed + d_seq * seqs + d_ctx * context)
        out[4, i] = best_cached
        out[5, i] = best_cached - min(gpu_cached, best_cached)
        out[6, i] = queue_nominal
        out[7, i] = best_prefill / kp if kp else best_prefill


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


def warm_up() -> None:
    """Compile (or load from the cache) `_estimate`, so that no request pays for it."""
    estimate_all(REFERENCE_PROFILES[DEFAULT_REFERENCE], [Endpoint("warm-up:0")], 100, {"gpu": np.ones(1)})
