"""The KV block index: memory per entry, lookup latency, store() throughput, block_keys time.

Each part runs in a fresh subprocess (so the RSS delta is the index's own):

- keys: `block_keys` of a 32K-token prompt (int32 array as the tokenizer gives it, and a list), p50;
- store: block events/s for BlockStored events of 16 blocks x 16 tokens, 32 pods, chains of 8 events:
  from empty (the tables grow), at the memory bound (every store evicts), and with a BlockRemoved per
  block as well (steady state of a live engine; `remove` and `discard`); store() alone, event decoding
  not included;
- memory + lookup: 10 M (block, pod) entries built with store() itself (no bulk load), bytes per entry
  as the RSS delta (/proc/self/status), then `lookup` of a 2,048-block prompt against 32 pods: 4 pods
  hold all of it, 28 a random prefix; and the worst case, all 32 pods hold all of it.

  python benchmarks/kv_index.py [--entries 10000000] [--pods 32]
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's packages first

from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import block_keys, root_key

BS = 16
BLOCKS_PER_EVENT = 16
CHAIN = 8  # events per chain (a 2,048-token prefix)


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return sorted(out)


def pct(samples: list[float], p: float) -> float:
    return samples[min(len(samples) - 1, int(p * len(samples)))]


class Workload:
    """BlockStored events of 16 x 16 tokens over `pods` pods, in chains of CHAIN events, each chain
    with its own root (so keys never repeat although the token pool is small)."""

    def __init__(self, pods: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.pods = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(pods)]
        self.pool = [tuple(t) for t in rng.integers(0, 150_000, size=(512, BS * BLOCKS_PER_EVENT)).tolist()]
        self.event = 0

    def chunk(self, events: int) -> list[tuple[str, tuple[int, ...], int | None, tuple[int, ...], int]]:
        """The next `events` events as store() arguments (pod, hashes, parent, tokens, root)."""
        hashes = self.rng.integers(0, 2**64 - 1, size=(events, BLOCKS_PER_EVENT), dtype=np.uint64).tolist()
        out = []
        parent: int | None = None
        root = 0
        for i in range(events):
            e = self.event + i
            chain, pos = divmod(e, CHAIN)
            if pos == 0:
                parent, root = None, root_key("model", str(chain))
            hs = tuple(hashes[i])
            out.append((self.pods[chain % len(self.pods)], hs, parent, self.pool[e % len(self.pool)], root))
            parent = hs[-1]
        self.event += events
        return out


def store_all(
    index: BlockIndex, events: list[tuple[str, tuple[int, ...], int | None, tuple[int, ...], int]]
) -> float:
    t0 = time.perf_counter()
    for pod, hs, parent, toks, root in events:
        index.store(pod, hs, parent, toks, BS, "gpu", root)
    index.flush()
    return time.perf_counter() - t0


# -- parts (each in its own process) -----------------------------------------------------------
def part_keys() -> None:
    tokens = np.random.default_rng(1).integers(0, 150_000, size=32_768).astype(np.int32)
    as_list = tokens.tolist()
    root = root_key("model")
    arr = timed(lambda: block_keys(tokens, BS, root), 200)
    lst = timed(lambda: block_keys(as_list, BS, root), 50)
    print(
        f"block_keys, 32,768 tokens (2,048 blocks): p50 {pct(arr, 0.5) * 1e6:.0f} us (int32 array), "
        f"{pct(lst, 0.5) * 1e6:.0f} us (list of ints)"
    )


def rate(events: int, seconds: float) -> str:
    per_s = events * BLOCKS_PER_EVENT / seconds
    return f"{per_s / 1e6:.2f} M block events/s ({seconds / events * 1e6:.1f} us per 16-block event)"


def part_store(pods: int) -> None:
    w = Workload(pods)
    n = 100_000  # events: 1.6 M blocks

    def grown(max_entries: int = 50_000_000) -> BlockIndex:
        """An index whose tables have grown (filled, then every pod cleared: capacity stays)."""
        index = BlockIndex(BS, max_entries=max_entries)
        store_all(index, w.chunk(n))
        for pod in w.pods:
            index.clear_pod(pod)
        return index

    index = BlockIndex(BS, max_entries=50_000_000)
    s = store_all(index, w.chunk(n))
    print(f"store(), 16x16 events, {pods} pods, from empty to {n * 16 / 1e6:.1f} M entries: {rate(n, s)}")
    s = store_all(grown(), w.chunk(n))
    print(f"  same, the tables already grown: {rate(n, s)}")
    bounded = BlockIndex(BS, max_entries=n * BLOCKS_PER_EVENT)
    store_all(bounded, w.chunk(n))
    s = store_all(bounded, w.chunk(n))
    print(f"  at the memory bound ({n * BLOCKS_PER_EVENT / 1e6:.1f} M entries, evicting): {rate(n, s)}")
    # steady state of live engines: every stored block is removed later (one BlockRemoved per block),
    # with `remove` (counts what it released) and with `discard` (what KvIngest uses)
    for how in ("remove", "discard"):
        steady = grown()
        lag = n // 4
        events = w.chunk(n)
        store_all(steady, events[:lag])
        drop = getattr(steady, how)
        t0 = time.perf_counter()
        for i in range(lag, n):
            pod, hs, parent, toks, root = events[i]
            steady.store(pod, hs, parent, toks, BS, "gpu", root)
            gone_pod, gone = events[i - lag][:2]
            for h in gone:
                drop(gone_pod, (h,), "gpu")
        steady.flush()
        s = time.perf_counter() - t0
        print(f"  with one BlockRemoved per stored block ({how}): {rate(n - lag, s)} stored, as many removed")


def part_memory_lookup(entries: int, pods: int) -> None:
    w = Workload(pods)
    gc.collect()
    rss0 = status("VmRSS")
    index = BlockIndex(BS, max_entries=2 * entries)  # the bound is not what is measured here
    n = entries // BLOCKS_PER_EVENT
    t0 = time.perf_counter()
    spent = 0.0
    done = 0
    while done < n:
        events = w.chunk(min(8192, n - done))
        spent += store_all(index, events)
        done += len(events)
        del events
    build = time.perf_counter() - t0
    gc.collect()
    st = index.stats()
    rss = status("VmRSS") - rss0
    hwm = status("VmHWM") - rss0
    print(
        f"memory: {st.entries:,} (block, pod) entries, built with store() in {build:.1f} s "
        f"({st.entries / spent / 1e6:.2f} M block events/s in store(), tables growing): "
        f"{rss / st.entries:.1f} bytes/entry (RSS delta; peak {hwm / st.entries:.0f}), "
        f"index arrays {st.nbytes / st.entries:.1f} bytes/entry"
    )
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 150_000, size=2048 * BS)
    root = root_key("model")
    keys = block_keys(prompt, BS, root)

    def hold(pod: str, blocks: int) -> None:
        parent = None
        for b in range(0, blocks, BLOCKS_PER_EVENT):
            nb = min(BLOCKS_PER_EVENT, blocks - b)
            hs = tuple(int(x) for x in rng.integers(0, 2**63, size=nb))
            index.store(pod, hs, parent, prompt[b * BS : (b + nb) * BS].tolist(), BS, "gpu", root)
            parent = hs[-1]

    lens = [2048] * 4 + rng.integers(0, 2048, size=len(w.pods) - 4).tolist()
    for pod, blocks in zip(w.pods, lens, strict=True):
        hold(pod, blocks)
    got = index.lookup(keys, w.pods)
    assert [got[p].get("any", 0) for p in w.pods] == lens, "lookup disagrees with what was stored"
    runs = timed(lambda: index.lookup(keys, w.pods), 400)
    weighted = timed(lambda: index.lookup_weighted(keys, w.pods, {"gpu": 1.0, "cpu": 0.8}), 400)
    print(
        f"lookup, 2,048-block prompt x {len(w.pods)} pods at {index.stats().entries / 1e6:.1f} M entries "
        f"(4 pods hold it all, {len(w.pods) - 4} a random prefix): p50 {pct(runs, 0.5) * 1e3:.3f} ms, "
        f"p99 {pct(runs, 0.99) * 1e3:.3f} ms; lookup_weighted p50 {pct(weighted, 0.5) * 1e3:.3f} ms"
    )
    for pod, blocks in zip(w.pods, lens, strict=True):
        if blocks < 2048:
            hold(pod, 2048)
    runs = timed(lambda: index.lookup(keys, w.pods), 400)
    print(
        f"  worst case, all {len(w.pods)} pods hold all 2,048 blocks: p50 {pct(runs, 0.5) * 1e3:.3f} ms, "
        f"p99 {pct(runs, 0.99) * 1e3:.3f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=10_000_000)
    ap.add_argument("--pods", type=int, default=32)
    ap.add_argument("--part", choices=["keys", "store", "memory"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part == "keys":
        part_keys()
    elif args.part == "store":
        part_store(args.pods)
    elif args.part == "memory":
        part_memory_lookup(args.entries, args.pods)
    else:
        t0 = time.perf_counter()
        for part in ("keys", "store", "memory"):
            cmd = [
                sys.executable,
                __file__,
                "--part",
                part,
                "--entries",
                str(args.entries),
                "--pods",
                str(args.pods),
            ]
            subprocess.run(cmd, check=True)
        print(f"(kv_index benchmark: {time.perf_counter() - t0:.0f} s, one core)")


if __name__ == "__main__":
    main()
