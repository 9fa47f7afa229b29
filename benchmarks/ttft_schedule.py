"""Scheduling cost of the TTFT profile: 64 candidates, a 2,048-block (32K-token) prompt.

The index holds the prompt on many of the 64 pods in different ways (8 pods all of it on GPU, 8 all
of it on CPU only, 16 a random prefix on GPU, the rest nothing) among `--background` other entries.
Every pod is fresh and has scraped load and a prefill backlog. Reported, each as p50/p90/p99 over
`--runs` cycles after a warm-up:

- profile: the default profile's `run` (staleness filter -> ttft-scorer -> max-score picker) with the
  prompt's block keys already in the cycle state: index lookup + 64 estimates + pick. The target
  (issue: pick by estimated TTFT) is p50 <= 0.3 ms for this.
- lookup: `BlockIndex.lookup_tier_runs` alone (GPU prefix, then what each slower tier adds);
  estimates: `CostModel.estimate_all` for the 64 candidates alone;
- keys: `block_keys` of the 32K token ids; schedule: `Scheduler.schedule` of a token-id request, keys
  included (what a request costs end to end in the core).

  python benchmarks/ttft_schedule.py [--runs 2000] [--background 1000000]
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's packages first

from epp.config import build_scheduler, default_config
from epp.costmodel.service import SERVICE_KEY as COST_KEY
from epp.costmodel.service import CostModel
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import block_keys, root_key
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.service import SERVICE_KEY as KV_KEY
from epp.kvindex.service import KvIndexService
from epp.scheduling.builtin import default_registry
from epp.scheduling.framework import CycleState
from epp.scheduling.plugins.prompt_keys import KEYS, TOKENS
from epp.testing.fakes import FakeClock, endpoint, token_request
from epp.types import PrefillWork

BS = 16
BLOCKS = 2048
PODS = 64
MODEL = "m"
NOW = 1000.0


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    for _ in range(max(20, runs // 20)):
        fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return sorted(out)


def line(name: str, samples: list[float]) -> str:
    def p(q: float) -> float:
        return samples[min(len(samples) - 1, int(q * len(samples)))] * 1e3

    return f"{name:<34} p50 {p(0.5):7.3f} ms   p90 {p(0.9):7.3f} ms   p99 {p(0.99):7.3f} ms"


def build(background: int, seed: int = 0) -> tuple[KvIndexService, list[int], list[str]]:
    """The index of `build_index`, every pod fresh, as the service the scorers read."""
    index, tokens, pods = build_index(background, seed)
    fresh = FreshnessTracker()
    for pod in pods:
        fresh.connected(pod, 0.0)
        fresh.message(pod, NOW)
    return KvIndexService(index, fresh, TokenizerRegistry({}), BS), tokens, pods


def build_index(background: int, seed: int = 0) -> tuple[BlockIndex, list[int], list[str]]:
    """The prompt held by 32 of 64 pods in different ways, among `background` other entries (pods
    32..63 make the second 32-pod chunk); the prompt's tokens; the pods."""
    rng = np.random.default_rng(seed)
    index = BlockIndex(BS, max_entries=max(10_000_000, 4 * background))
    pods = [f"10.1.{i // 250}.{i % 250}:8000" for i in range(PODS)]
    tokens = rng.integers(1, 150_000, size=BLOCKS * BS).tolist()
    root = root_key(MODEL, None)
    hashes = rng.integers(0, 2**63, size=BLOCKS).tolist()
    for i, pod in enumerate(pods):
        if i < 8:
            n, tier = BLOCKS, "gpu"
        elif i < 16:
            n, tier = BLOCKS, "cpu"
        elif i < 32:
            n, tier = int(rng.integers(1, BLOCKS)), "gpu"
        else:
            continue
        for start in range(0, n, 16):  # BlockStored events of 16 blocks, chained
            end = min(n, start + 16)
            parent = hashes[start - 1] if start else None
            index.store(pod, hashes[start:end], parent, tokens[start * BS : end * BS], BS, tier, root)
    # Background: other prompts' chains spread over every pod.
    other = rng.integers(1, 150_000, size=(64, 16 * BS)).tolist()
    done = 0
    chain = 0
    while done < background:
        pod = pods[chain % PODS]
        r = root_key(MODEL, f"bg-{chain}")
        parent = None
        for j in range(8):
            hs = rng.integers(0, 2**63, size=16).tolist()
            index.store(pod, hs, parent, other[(chain + j) % 64], BS, "gpu", r)
            parent = hs[-1]
        done += 8 * 16
        chain += 1
    index.flush()
    return index, tokens, pods


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--background", type=int, default=1_000_000, help="other (block, pod) entries")
    args = ap.parse_args()

    kv, tokens, pods = build(args.background)
    rnd = random.Random(0)
    endpoints = [
        endpoint(
            pod,
            waiting=rnd.randrange(0, 4),
            running=rnd.randrange(0, 32),
            backlog=PrefillWork(n := rnd.randrange(0, 3), n * 2000, n * 2e6),
            decoding=rnd.randrange(0, 16),
            decoding_tokens=rnd.randrange(0, 50_000),
            observed_at=NOW,
            model=MODEL,
        )
        for pod in pods
    ]
    cost = CostModel()
    clock = FakeClock(NOW)
    sched = build_scheduler(
        default_config(), default_registry(), clock, random.Random(1), services={KV_KEY: kv, COST_KEY: cost}
    )
    profile = sched.profiles["default"]
    request = token_request(tokens, model=MODEL)
    keys = block_keys(tokens, BS, root_key(MODEL, None))
    arr = np.asarray(tokens, dtype=np.int32)

    def run_profile() -> None:
        state = CycleState(now=NOW, rng=sched.rng, data={KEYS: keys, TOKENS: len(tokens)})
        profile.run(state, request, endpoints)

    order = ["gpu", *cost.tier_order(MODEL)]
    runs = kv.index.lookup_tier_runs(keys, pods, order)
    held_tokens = {"gpu": runs[0] * 16.0, "cpu": (runs[1] - runs[0]) * 16.0}

    def run_estimates() -> None:
        cost.estimate_all(MODEL, endpoints, len(tokens), held_tokens)

    stats = kv.index.stats()
    print(
        f"TTFT profile, {PODS} candidates, a {BLOCKS}-block prompt ({len(tokens)} tokens), "
        f"index of {stats.entries:,} entries; {args.runs} runs each"
    )
    results = {
        "profile": timed(run_profile, args.runs),
        "lookup": timed(lambda: kv.index.lookup_tier_runs(keys, pods, order), args.runs),
        "estimates": timed(run_estimates, args.runs),
        "keys": timed(lambda: block_keys(arr, BS, root_key(MODEL, None)), args.runs),
        "schedule": timed(lambda: sched.schedule(request, endpoints), max(200, args.runs // 4)),
    }
    labels = {
        "profile": "profile (lookup + estimates + pick)",
        "lookup": "  index lookup alone",
        "estimates": "  64 estimates alone",
        "keys": "block keys of 32K tokens (int32)",
        "schedule": "schedule() incl. keys (list prompt)",
    }
    for k, v in results.items():
        print(line(labels[k], v))
    p50 = statistics.median(results["profile"]) * 1e3
    print(f"target: profile p50 <= 0.300 ms -> {'met' if p50 <= 0.3 else 'NOT met'} ({p50:.3f} ms)")


if __name__ == "__main__":
    main()
