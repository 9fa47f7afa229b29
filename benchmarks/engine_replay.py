"""`epp-sim engine-replay` throughput (target >= 20,000 requests/s).

10,000 requests averaging 2,000 prompt tokens with prefix sharing (200 shared system prompts of
1,000-2,000 tokens, each request adding a unique question so the mean prompt is ~2,000 tokens;
16 output tokens), a 4,096-block cache of 16-token blocks (so prefixes are evicted), deterministic
(seeded). Figures: end to end (`engine_replay`, what the command runs: the file scanned in a second thread
while the engine runs the requests already read, then the results written to an in-memory buffer),
parsing alone (`parse_requests`) and the engine alone (`run` over parsed requests), in requests per
second of wall time (medians of --repeat runs).

  python benchmarks/engine_replay.py [--requests 10000] [--repeat 3] [--events]
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's packages first

from simulator import request_lines
from simulator.engine_replay import engine_replay, parse_requests, run
from simulator.token_text import warm_up

TARGET = 20_000.0
NUM_BLOCKS = 4096
BLOCK_SIZE = 16


def workload(n: int, seed: int = 1) -> bytes:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 50_000, int(rng.integers(1000, 2001))).tolist() for _ in range(200)]
    lines = []
    for _ in range(n):
        sys_ids = systems[int(rng.zipf(1.3)) % len(systems)]
        q = rng.integers(0, 50_000, int(rng.integers(200, 1001))).tolist()
        lines.append(json.dumps({"prompt_token_ids": sys_ids + q, "max_tokens": 16}))
    return ("\n".join(lines) + "\n").encode()


def median_time(f: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--events", action="store_true", help="also collect and write the KV events")
    args = ap.parse_args()
    data = workload(args.requests)
    warm_up()  # the compiled loops are loaded once per process (`epp-sim engine-replay` does the same)
    request_lines.warm_up()
    reqs = parse_requests(data, NUM_BLOCKS, BLOCK_SIZE)
    mean = sum(len(r.prompt) for r in reqs) / len(reqs)
    out = run(reqs, NUM_BLOCKS, BLOCK_SIZE)
    hit = sum(r.cached_tokens for r in out.results) / sum(r.prompt_tokens for r in out.results)
    print(
        f"{len(reqs):,} requests, mean prompt {mean:,.0f} tokens, {len(data) / 1e6:.1f} MB of JSONL, "
        f"{NUM_BLOCKS} blocks x {BLOCK_SIZE} tokens, token hit rate {hit:.1%}"
    )

    def end_to_end() -> None:  # what `epp-sim engine-replay` runs between reading and writing files
        results, events = engine_replay(data, NUM_BLOCKS, BLOCK_SIZE, events=args.events)
        buf = io.StringIO()
        buf.write(results)
        if events is not None:
            buf.write(events)

    figures = {
        "end to end (parse + run + write)": median_time(end_to_end, args.repeat),
        "parse alone": median_time(lambda: parse_requests(data, NUM_BLOCKS, BLOCK_SIZE), args.repeat),
        "engine alone": median_time(
            lambda: run(reqs, NUM_BLOCKS, BLOCK_SIZE, events=args.events), args.repeat
        ),
    }
    for name, secs in figures.items():
        rate = len(reqs) / secs
        verdict = "met" if rate >= TARGET else "NOT met"
        print(f"{name}: {secs:.3f} s, {rate:,.0f} requests/s (target {TARGET:,.0f}: {verdict})")


if __name__ == "__main__":
    main()
