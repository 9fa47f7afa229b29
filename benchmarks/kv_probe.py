"""The batched read probe of the block index: `Holdings.masks(keys, chunks, tiers)`, p50.

`masks` is what every scheduling decision pays for the index (`reads.py` calls it once per lookup): one
hash-table probe per (key, 32-pod chunk). The index is built with `BlockIndex.store` as in
`ttft_schedule.py`: a 2,048-block prompt held by 64 pods in different ways (8 pods all of it on GPU, 8 on
CPU only, 16 a random prefix on GPU, the rest nothing; so 2 chunks and 2 tiers), among `--background`
other entries. Reported, each as the median over `--rounds` rounds of the per-call median over `--runs`
calls (the same index and keys for every case; the cases are interleaved round by round):

- 2,048 keys x 2 chunks (the prompt, every pod), 256 keys x 2 chunks (the fixed cost per call),
  2,048 keys x 1 chunk, and 2,048 absent keys x 2 chunks (every probe reads both buckets).

  python benchmarks/kv_probe.py [--background 200000] [--runs 300] [--rounds 7]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's packages first

from epp.kvindex.index import BlockIndex

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttft_schedule import build_index

from epp.kvindex.keys import block_keys, root_key

BS = 16
BLOCKS = 2048
PODS = 64
MODEL = "m"


def build(background: int, seed: int = 0) -> tuple[BlockIndex, list[int]]:
    """The index of `ttft_schedule.build_index` (same layout, same seed), and the prompt's tokens."""
    index, tokens, _ = build_index(background, seed)
    return index, tokens


def per_call(fn: Callable[[], object], runs: int) -> float:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--background", type=int, default=200_000, help="other (block, pod) entries")
    ap.add_argument("--runs", type=int, default=300, help="calls per case and round")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    index, tokens = build(args.background)
    h = index._h  # the probe itself is what is measured
    keys = np.asarray(block_keys(tokens, BS, root_key(MODEL, None)), dtype=np.uint64)
    absent = np.random.default_rng(1).integers(0, 2**64 - 1, size=BLOCKS, dtype=np.uint64)
    tiers = list(range(h.ntiers))
    cases: dict[str, Callable[[], object]] = {
        "2,048 keys x 2 chunks": lambda: h.masks(keys, [0, 1], tiers),
        "  256 keys x 2 chunks": lambda: h.masks(keys[:256], [0, 1], tiers),
        "2,048 keys x 1 chunk": lambda: h.masks(keys, [0], tiers),
        "2,048 absent x 2 chunks": lambda: h.masks(absent, [0, 1], tiers),
    }
    hits = (h.masks(keys, [0, 1], tiers) != 0).any(axis=0).mean()
    print(
        f"masks(): index of {index.stats().entries:,} entries, blocks table {h.blocks.size:,} rows in "
        f"{h.blocks.nb:,} buckets ({h.blocks.size / h.blocks.capacity:.0%} load), {len(tiers)} tiers; "
        f"prompt (key, chunk) hit rate {hits:.0%}"
    )
    for fn in cases.values():  # warm-up
        per_call(fn, max(20, args.runs // 10))
    rounds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            rounds[name].append(per_call(fn, args.runs))
    for name, vals in rounds.items():
        p50 = statistics.median(vals)
        probes = int(name.split()[0].replace(",", "")) * int(name.split()[-2])
        print(
            f"{name:<26} p50 {p50 * 1e6:7.1f} us  ({p50 * 1e9 / probes:5.1f} ns per probe; "
            f"rounds {min(vals) * 1e6:.1f}..{max(vals) * 1e6:.1f} us)"
        )


if __name__ == "__main__":
    main()
