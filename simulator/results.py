"""Per-request records of a simulated run, the figures they sum up to, and the trace's cache bounds. Pure.

Every figure in `summarize` is named with its unit (`ttft_p99_s`, `token_hit_rate`, ...), as
`summary.json` carries them. Hit rates are the engines' real ones (what their prefix caches
served), not what the router believed. A request the router found no pod for is a record too
(status `rejected`, no pod, no times, the output it asked for), counted apart from the completed
requests' figures.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

COMPLETED = "completed"
REJECTED = "rejected"  # the router found no pod for it (e.g. a filter left none): never served


@dataclass(frozen=True, slots=True)
class RequestRecord:
    index: int  # position in the trace
    arrival_s: float
    pod: str | None  # None when rejected
    prompt_tokens: int
    cached_tokens: int  # served from the engine's GPU prefix cache
    loaded_tokens: int  # reloaded from the engine's CPU tier
    output_tokens: int  # generated; for a rejected request, the output it asked for
    first_token_s: float | None  # absolute simulated times; None when rejected
    finished_s: float | None
    status: str = COMPLETED  # or REJECTED
    estimated_ttft_s: float | None = None  # the router's TTFT estimate for its pod at the pick, if any

    @classmethod
    def rejected(
        cls, index: int, arrival_s: float, prompt_tokens: int, output_tokens: int = 0
    ) -> RequestRecord:
        return cls(index, arrival_s, None, prompt_tokens, 0, 0, output_tokens, None, None, REJECTED)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None without one (a single-token output, as the summary
        leaves such requests out of TPOT, as vLLM's benchmark does)."""
        if self.first_token_s is None or self.finished_s is None:
            return None
        if self.output_tokens <= 1:
            return None
        return (self.finished_s - self.first_token_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, object]:
        doc = asdict(self)
        doc.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s)
        return doc


Figures = dict[str, float | None]
"""A policy's figures by name; None where there is nothing to measure (it completed no request)."""

FIGURES = tuple(
    [f"{m}_{s}_s" for m in ("ttft", "tpot", "e2e") for s in ("mean", "p50", "p90", "p99")]
    + ["throughput_rps", "output_tokens_per_s", "token_hit_rate", "gpu_token_hit_rate"]
    + ["request_hit_rate", "load_imbalance", "makespan_s"]
    + [f"ttft_estimate_ratio_p{q}" for q in (10, 50, 90)]
)
"""The figures of the completed requests (besides `requests`, `rejected_requests`, `rejected_rate`)."""
ESTIMATE_QUANTILES = (10, 50, 90)


def _stats(prefix: str, values: npt.NDArray[np.float64]) -> Figures:
    """Mean and percentiles of `values`; None with no value (nothing to measure)."""
    names = [f"{prefix}_{s}_s" for s in ("mean", "p50", "p90", "p99")]
    if not values.size:
        return dict.fromkeys(names)
    figures: list[float | None] = [
        float(values.mean()),
        *(float(np.percentile(values, q)) for q in (50, 90, 99)),
    ]
    return dict(zip(names, figures, strict=True))


def _estimate_ratios(done: Sequence[RequestRecord]) -> Figures:
    """Percentiles of observed / estimated TTFT over the completed requests the router estimated (a
    policy with a TTFT estimate: `ttft`, `oracle`): how far the router's belief was from what happened
    (1: exact; above 1: it waited longer than the router thought). None without estimates."""
    ratios = np.array(
        [
            cast(float, r.ttft_s) / r.estimated_ttft_s
            for r in done
            if r.estimated_ttft_s is not None and r.estimated_ttft_s > 0
        ],
        dtype=np.float64,
    )
    names = [f"ttft_estimate_ratio_p{q}" for q in ESTIMATE_QUANTILES]
    if not ratios.size:
        return dict.fromkeys(names)
    return {n: float(np.percentile(ratios, q)) for n, q in zip(names, ESTIMATE_QUANTILES, strict=True)}


def summarize(records: Sequence[RequestRecord], pods: Sequence[str]) -> Figures:
    """The figures of one policy's run. `pods`: every pod of the cluster (idle ones count for imbalance).
    `requests` counts the completed requests and every other figure is theirs; the rejected ones count
    in `rejected_requests` and `rejected_rate` (of all requests) only. With none completed, the figures
    of `FIGURES` are None; with no completed request of more than one output token, the `tpot_*_s`."""
    if not records:
        raise ValueError("no requests to summarize")
    done = [r for r in records if r.status == COMPLETED]
    rejected = len(records) - len(done)
    out: Figures = {
        "requests": float(len(done)),
        "rejected_requests": float(rejected),
        "rejected_rate": rejected / len(records),
    }
    if not done:
        out.update(dict.fromkeys(FIGURES))
        return out
    ttft = np.array([r.ttft_s for r in done], dtype=np.float64)
    tpot = np.array([r.tpot_s for r in done if r.output_tokens > 1], dtype=np.float64)  # (one token: no tpot)
    e2e = np.array([r.e2e_s for r in done], dtype=np.float64)
    prompt = sum(r.prompt_tokens for r in done)
    reused = sum(r.cached_tokens + r.loaded_tokens for r in done)
    start = min(r.arrival_s for r in done)
    end = max(cast(float, r.finished_s) for r in done)
    span = max(end - start, 1e-9)
    per_pod = Counter(r.pod for r in done)
    counts = np.array([per_pod.get(p, 0) for p in pods], dtype=np.float64)
    out.update(_estimate_ratios(done))
    out.update(_stats("ttft", ttft))
    out.update(_stats("tpot", tpot))
    out.update(_stats("e2e", e2e))
    out.update(
        {
            "throughput_rps": len(done) / span,
            "output_tokens_per_s": sum(r.output_tokens for r in done) / span,
            "token_hit_rate": reused / prompt if prompt else 0.0,
            "gpu_token_hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
            "request_hit_rate": sum(1 for r in done if r.cached_tokens + r.loaded_tokens > 0) / len(done),
            "load_imbalance": float(counts.max() / counts.mean()) if counts.mean() > 0 else 0.0,
            "makespan_s": span,
        }
    )
    return out


def cache_bounds(
    requests: Iterable[tuple[npt.NDArray[np.integer], npt.NDArray[np.integer]]],
    block_size: int,
    capacity_blocks: int,
) -> dict[str, float]:
    """Token hit rates to read a policy's against: one infinite shared cache (every full block computed
    before is reused), which no router can beat over the same requests, and one LRU cache of the
    cluster's total capacity (`capacity_blocks`), a practical reference but not a bound (an engine keeps
    the blocks of a request while it runs, which this LRU may evict meanwhile, so a policy can beat it).

    `requests`, in arrival order: each one's prompt and the tokens an engine computes KV for when it
    serves it (the prompt, then the generated tokens it feeds back). Each prompt is looked up (full
    blocks of `block_size` from its start, with vLLM's cap of len-1 tokens), then every full block of
    its computed tokens goes into both caches: the blocks its answer completes count from its arrival,
    the earliest an engine could hold them, so a later turn resending the answer hits them here
    whenever it could on an engine."""
    seen: set[bytes] = set()
    lru: OrderedDict[bytes, None] = OrderedDict()
    total = inf_hits = lru_hits = 0
    for prompt, computed in requests:
        n = len(prompt)
        if len(computed) < n or not np.array_equal(computed[:n], prompt):
            raise ValueError("a request's computed tokens must start with its prompt")
        total += n
        full = (n - 1) // block_size if n else 0
        keys = _chain(computed, block_size, len(computed) // block_size)
        inf = lru_run = 0
        inf_open = lru_open = True
        for i, key in enumerate(keys):
            if i < full:
                if inf_open and key in seen:
                    inf += 1
                else:
                    inf_open = False
                if lru_open and key in lru:
                    lru_run += 1
                    lru.move_to_end(key)
                else:
                    lru_open = False
            seen.add(key)
            if key not in lru:
                lru[key] = None
                if len(lru) > capacity_blocks:
                    lru.popitem(last=False)
            else:
                lru.move_to_end(key)
        inf_hits += inf * block_size
        lru_hits += lru_run * block_size
    return {
        "infinite_cache_token_hit_rate": inf_hits / total if total else 0.0,
        "cluster_lru_token_hit_rate": lru_hits / total if total else 0.0,
    }


def _chain(tokens: npt.NDArray[np.integer], block_size: int, blocks: int) -> list[bytes]:
    """Chained identities of the full blocks: block i's identity covers every token up to its end."""
    out = []
    prev = b""
    data = np.ascontiguousarray(tokens[: blocks * block_size], dtype=np.int64).tobytes()
    step = block_size * 8
    for i in range(blocks):
        prev = hashlib.blake2b(prev + data[i * step : (i + 1) * step], digest_size=16).digest()
        out.append(prev)
    return out
