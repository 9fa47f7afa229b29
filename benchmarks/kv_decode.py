"""Decode-only throughput of engine KV-event batches: the decoder ingestion uses (`batch_reader.decode`: the
compiled scan, `event_scan.py`) and msgspec's typed decode into Python objects (`events.decode_batch`).

Encodes N vLLM-shaped batches (each: 8 BlockStored of 16 blocks x 16 tokens, then 4
BlockRemoved of one block each, as vLLM emits evictions) in the map form (vLLM 0.24+) and
the array form (vLLM 0.9-0.23), then times each decoder over all of them. Prints block
events per second (stored blocks + removed blocks), the median over repeats. This is the
ceiling for any ingestion path built on the decoder.

  python benchmarks/kv_decode.py [--batches 2000] [--repeats 7] [--seed 0]

`make_batches(n_batches, form, seed)` is imported by other benchmarks.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import random
import statistics
import sys
import time
from collections.abc import Callable

import msgspec

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's packages first

from epp.kvindex.batch_reader import decode
from epp.kvindex.events import decode_batch
from epp.testing.kv_publisher import (
    ArrayBlockRemoved,
    ArrayBlockStored,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

STORED_PER_BATCH = 8
BLOCKS_PER_STORED = 16
BLOCK_SIZE = 16
REMOVED_PER_BATCH = 4
BLOCK_EVENTS_PER_BATCH = STORED_PER_BATCH * BLOCKS_PER_STORED + REMOVED_PER_BATCH
FORMS = ("map", "array")


def make_batches(n_batches: int, form: str, seed: int, lora: str | None = None) -> list[bytes]:
    """`n_batches` msgpack payloads as vLLM publishes them; form is "map" or "array".

    Each batch: 8 BlockStored (16 blocks of 16 tokens, chained parents, unsigned 64-bit
    hashes, medium GPU, extra_keys one nil per block, group 0) then 4 BlockRemoved of one block each:
    evictions of blocks the batches before the last one stored, oldest first (as an engine's LRU frees
    them; never a block a later event names as its parent, which is always the previous event's last
    block), so that an index applying them removes blocks it holds. With `lora`
    (map form): a LoRA adapter's events as vLLM 0.18+ sends them, `lora_name` set and the adapter's
    name as every block's extra key."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    stored, removed = (BlockStored, BlockRemoved) if form == "map" else (ArrayBlockStored, ArrayBlockRemoved)
    rng = random.Random(seed)
    encoder = msgspec.msgpack.Encoder()
    out: list[bytes] = []
    parent: int | None = None
    stored_before: collections.deque[int] = collections.deque()  # hashes of batches before the last
    last_batch: list[int] = []
    for n in range(n_batches):
        events: list[object] = []
        this_batch: list[int] = []
        for _ in range(STORED_PER_BATCH):
            hashes = [rng.getrandbits(64) for _ in range(BLOCKS_PER_STORED)]
            tokens = [rng.randrange(150_000) for _ in range(BLOCKS_PER_STORED * BLOCK_SIZE)]
            events.append(
                stored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=BLOCK_SIZE,
                    lora_id=None,
                    medium="GPU",
                    lora_name=lora,
                    extra_keys=[None if lora is None else [lora] for _ in range(BLOCKS_PER_STORED)],
                    group_idx=0,
                )
            )
            parent = None if rng.random() < 0.25 else hashes[-1]
            this_batch.extend(hashes)
        for _ in range(REMOVED_PER_BATCH):
            victim = stored_before.popleft() if stored_before else rng.getrandbits(64)
            events.append(removed(block_hashes=[victim], medium="GPU", group_idx=0))
        stored_before.extend(last_batch)
        last_batch = this_batch
        out.append(
            encoder.encode(EventBatch(ts=1_767_225_600.0 + n * 0.01, events=events, data_parallel_rank=0))
        )
    return out


def held_after(n_batches: int) -> int:
    """Blocks an index holds after applying `make_batches(n_batches, ...)` in order: every stored block,
    less the removals of the batches from the third on (the first two remove blocks never stored)."""
    return n_batches * STORED_PER_BATCH * BLOCKS_PER_STORED - REMOVED_PER_BATCH * max(0, n_batches - 2)


DECODERS: dict[str, Callable[[bytes], object]] = {"scan": decode, "msgspec": decode_batch}


def measure(payloads: list[bytes], repeats: int, decoder: str = "scan") -> float:
    """Median block events per second of decoding all `payloads` with `DECODERS[decoder]`."""
    fn = DECODERS[decoder]
    fn(payloads[0])  # compiled code loaded before timing
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for payload in payloads:
            fn(payload)
        rates.append(len(payloads) * BLOCK_EVENTS_PER_BATCH / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for form in FORMS:
        payloads = make_batches(args.batches, form, args.seed)
        size = sum(map(len, payloads)) / len(payloads)
        for decoder in DECODERS:
            rate = measure(payloads, args.repeats, decoder)
            print(
                f"{form:5s} {decoder:7s}: {rate:12,.0f} block events/s"
                f"  ({rate / BLOCK_EVENTS_PER_BATCH:9,.0f} batches/s,"
                f" {BLOCK_EVENTS_PER_BATCH} block events and {size:,.0f} bytes per batch)"
            )


if __name__ == "__main__":
    main()
