"""Per-request records of a simulated run, the figures they sum up to, and the trace's cache bounds. Pure.

Every figure in `summarize` is named with its unit (`ttft_p99_s`, `token_hit_rate`, ...), as
`summary.json` carries them. Hit rates are the engines' real ones (what their prefix caches
served), not what the router believed.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, slots=True)
class RequestRecord:
    index: int  # position in the trace
    arrival_s: float
    pod: str
    prompt_tokens: int
    cached_tokens: int  # served from the engine's GPU prefix cache
    loaded_tokens: int  # reloaded from the engine's CPU tier
    output_tokens: int
    first_token_s: float  # absolute simulated times
    finished_s: float

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (0 for single-token outputs)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.finished_s - self.first_token_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, object]:
        doc = asdict(self)
        doc.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s)
        return doc


def _pct(values: npt.NDArray[np.float64], q: float) -> float:
    return float(np.percentile(values, q)) if values.size else 0.0


def _stats(prefix: str, values: npt.NDArray[np.float64]) -> dict[str, float]:
    return {
        f"{prefix}_mean_s": float(values.mean()) if values.size else 0.0,
        f"{prefix}_p50_s": _pct(values, 50),
        f"{prefix}_p90_s": _pct(values, 90),
        f"{prefix}_p99_s": _pct(values, 99),
    }


def summarize(records: Sequence[RequestRecord], pods: Sequence[str]) -> dict[str, float]:
    """The figures of one policy's run. `pods`: every pod of the cluster (idle ones count for imbalance)."""
    if not records:
        raise ValueError("no completed requests to summarize")
    ttft = np.array([r.ttft_s for r in records])
    tpot = np.array([r.tpot_s for r in records if r.output_tokens > 1])
    e2e = np.array([r.e2e_s for r in records])
    prompt = sum(r.prompt_tokens for r in records)
    reused = sum(r.cached_tokens + r.loaded_tokens for r in records)
    start = min(r.arrival_s for r in records)
    end = max(r.finished_s for r in records)
    span = max(end - start, 1e-9)
    per_pod = Counter(r.pod for r in records)
    counts = np.array([per_pod.get(p, 0) for p in pods], dtype=np.float64)
    out: dict[str, float] = {"requests": float(len(records))}
    out.update(_stats("ttft", ttft))
    out.update(_stats("tpot", tpot))
    out.update(_stats("e2e", e2e))
    out.update(
        {
            "throughput_rps": len(records) / span,
            "output_tokens_per_s": sum(r.output_tokens for r in records) / span,
            "token_hit_rate": reused / prompt if prompt else 0.0,
            "gpu_token_hit_rate": sum(r.cached_tokens for r in records) / prompt if prompt else 0.0,
            "request_hit_rate": sum(1 for r in records if r.cached_tokens + r.loaded_tokens > 0)
            / len(records),
            "load_imbalance": float(counts.max() / counts.mean()) if counts.mean() > 0 else 0.0,
            "makespan_s": span,
        }
    )
    return out


def cache_bounds(
    prompts: Iterable[npt.NDArray[np.int32]], block_size: int, capacity_blocks: int
) -> dict[str, float]:
    """Token hit rates no router can beat on this trace: one infinite shared cache (every full block seen
    before is reused), and one LRU cache of the cluster's total capacity (`capacity_blocks`), both on
    full blocks of `block_size` from the start of each prompt, with vLLM's cap of len-1 tokens."""
    seen: set[bytes] = set()
    lru: OrderedDict[bytes, None] = OrderedDict()
    total = inf_hits = lru_hits = 0
    for prompt in prompts:
        n = len(prompt)
        total += n
        full = (n - 1) // block_size if n else 0
        keys = _chain(prompt, block_size, n // block_size)
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


def _chain(prompt: npt.NDArray[np.int32], block_size: int, blocks: int) -> list[bytes]:
    """Chained identities of the full blocks: block i's identity covers every token up to its end."""
    out = []
    prev = b""
    data = np.ascontiguousarray(prompt[: blocks * block_size], dtype=np.int32).tobytes()
    step = block_size * 4
    for i in range(blocks):
        prev = hashlib.blake2b(prev + data[i * step : (i + 1) * step], digest_size=16).digest()
        out.append(prev)
    return out
