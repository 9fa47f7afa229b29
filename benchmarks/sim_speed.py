"""Simulator speed and the policy comparison on llm-d's shared-prefix workload.

1. Speed: requests simulated per wall-clock second, the conversation-like synthetic workload
   (multi-turn chat sessions) on 16 pods with the `ttft` policy (target >= 2,000 requests/s on one
   core: a 12,000-request trace in under 10 s).
2. Comparison: every policy on the shared-prefix workload of `routing-policies.md` (150 groups x 5
   prompts, 6,000-token system prompt, 1,200-token question, 1,000 output tokens, 8 pods) at three
   request rates: TTFT mean/p90/p99, token hit rate, output tokens/s.
3. Seeds: the same workload at the highest rate, where the cluster's KV runs at its limit and one
   seed's table can flatter or wrong a policy, for `--seeds` seeds (trace and cluster) and the
   policies of `--seed-policies`: TTFT mean and p99 and the requests that waited over 3 s, per seed.
4. Agentic: growing tool loops on tight KV (200 loops of 8 steps, 2,000-token system prompt, 500-token
   task, 300-token tool results, 150-token outputs; 8 pods of 4,096 blocks, 4 loops/s), where one hot
   pod decides the tail: TTFT mean / p99 / hit rate per seed for `--agentic-seeds` seeds and the
   policies of `--agentic-policies`, with the averages over the seeds.

  python benchmarks/sim_speed.py [--requests 12000] [--rates 3,10,30] [--seeds 5] [--skip-comparison]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's packages first

from simulator import policies
from simulator.cluster import Cluster, ClusterConfig
from simulator.engine import EngineConfig
from simulator.replay import replay
from simulator.traces import agentic, multi_turn, shared_prefix


def speed(requests: int) -> None:
    sessions = requests // 6
    trace = multi_turn(
        sessions, 6, system_tokens=1000, user_tokens=200, output_tokens=200, rate=sessions / 600, seed=1
    )
    cluster = ClusterConfig(pods=16, engine=EngineConfig(num_gpu_blocks=8192), seed=1)
    c = Cluster(policies.load("ttft"), cluster)
    t0 = time.process_time()
    w0 = time.perf_counter()
    recs = c.run(trace)
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    print(
        f"speed: {len(recs):,} requests (multi-turn, 16 pods, ttft) in {wall:.2f} s wall / {cpu:.2f} s CPU: "
        f"{len(recs) / cpu:,.0f} requests per CPU second (target >= 2,000) -> "
        f"{'met' if len(recs) / cpu >= 2000 else 'NOT met'}; simulated {c.kernel.now():.0f} s"
    )


def comparison(rates: list[float]) -> None:
    cluster = ClusterConfig(pods=8, engine=EngineConfig(num_gpu_blocks=16384), seed=1)
    names = policies.names()
    print("\nshared-prefix workload (150 groups x 5, 6,000 + 1,200 prompt tokens, 1,000 output), 8 pods")
    print("| rate (req/s) | policy | TTFT mean | TTFT p90 | TTFT p99 | token hit rate | output tok/s |")
    print("|---|---|---|---|---|---|---|")
    for rate in rates:
        trace = shared_prefix(150, 5, 6000, 1200, 1000, rate=rate, seed=1)
        t0 = time.perf_counter()
        result = replay(trace, names, cluster)
        for name in names:
            s = result.summary[name]
            hit, tok = s["token_hit_rate"] * 100, s["output_tokens_per_s"]
            print(
                f"| {rate:g} | {name} | {s['ttft_mean_s']:.3f} s | {s['ttft_p90_s']:.3f} s | "
                f"{s['ttft_p99_s']:.3f} s | {hit:.1f}% | {tok:,.0f} |"
            )
        b = result.bounds
        inf, lru = b["infinite_cache_token_hit_rate"] * 100, b["cluster_lru_token_hit_rate"] * 100
        took = time.perf_counter() - t0
        print(f"| {rate:g} | bounds | | | | infinite {inf:.1f}%, cluster LRU {lru:.1f}% | |  ({took:.0f} s)")


def seed_spread(rate: float, seeds: int, names: list[str]) -> None:
    print(f"\nshared-prefix workload at {rate:g} req/s, seeds 1-{seeds} (trace and cluster)")
    print("| seed | " + " | ".join(f"{n}: TTFT mean / p99 / over 3 s" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for seed in range(1, seeds + 1):
        cluster = ClusterConfig(pods=8, engine=EngineConfig(num_gpu_blocks=16384), seed=seed)
        result = replay(shared_prefix(150, 5, 6000, 1200, 1000, rate=rate, seed=seed), names, cluster)
        cells = []
        for name in names:
            s, slow = result.summary[name], sum(r.ttft_s > 3.0 for r in result.records[name])
            cells.append(f"{s['ttft_mean_s']:.3f} s / {s['ttft_p99_s']:.3f} s / {slow}")
        print(f"| {seed} | " + " | ".join(cells) + " |", flush=True)


def agentic_seeds(seeds: int, names: list[str]) -> None:
    print(f"\nagentic workload (200 loops x 8 steps, 8 pods of 4,096 blocks, 4 loops/s), seeds 1-{seeds}")
    print("| seed | " + " | ".join(f"{n}: TTFT mean / p99 / hit rate" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    sums = {n: [0.0, 0.0] for n in names}
    for seed in range(1, seeds + 1):
        cluster = ClusterConfig(pods=8, engine=EngineConfig(num_gpu_blocks=4096), seed=seed)
        result = replay(agentic(200, 8, 2000, 500, 300, 150, rate=4, seed=seed), names, cluster)
        cells = []
        for name in names:
            s = result.summary[name]
            sums[name][0] += s["ttft_mean_s"] / seeds
            sums[name][1] += s["ttft_p99_s"] / seeds
            mean, p99, hit = s["ttft_mean_s"] * 1e3, s["ttft_p99_s"] * 1e3, s["token_hit_rate"]
            cells.append(f"{mean:.1f} ms / {p99:.0f} ms / {hit:.1%}")
        print(f"| {seed} | " + " | ".join(cells) + " |", flush=True)
    means = " | ".join(f"{m * 1e3:.1f} ms / {p * 1e3:.0f} ms" for m, p in sums.values())
    print(f"| mean of seeds | {means} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12_000)
    ap.add_argument("--rates", default="3,10,30")
    ap.add_argument("--seeds", type=int, default=5, help="seeds of part 3 (0: skip it)")
    ap.add_argument("--seed-policies", default="ttft,gie-default,llm-d-precise")
    ap.add_argument("--agentic-seeds", type=int, default=8, help="seeds of part 4 (0: skip it)")
    ap.add_argument("--agentic-policies", default="ttft,gie-default")
    ap.add_argument("--skip-comparison", action="store_true")
    args = ap.parse_args()
    speed(args.requests)
    if not args.skip_comparison:
        rates = [float(r) for r in args.rates.split(",")]
        comparison(rates)
        if args.seeds > 0:
            seed_spread(max(rates), args.seeds, args.seed_policies.split(","))
        if args.agentic_seeds > 0:
            agentic_seeds(args.agentic_seeds, args.agentic_policies.split(","))


if __name__ == "__main__":
    main()
