"""Prompt -> token ids with the prefix cache (issue: precise prefix scoring).

Builds the tiny byte-level BPE tokenizer (`epp.testing.tokenizer`) in a temporary directory and times
`PromptTokenizer.encode_chat` for chat prompts of ~4 KB and ~220 KB: a long system prompt shared by
every request and a short user question that changes each time.

- cold: the cache is empty (first sight of the system prompt);
- warm: the system prompt was seen before (with another question); the question is new;
- uncached: render + one tokenizer call on the whole text (what the engine does), for reference.

Prints p50 / p90 in milliseconds and the targets (warm: <= 1 ms at 4 KB, <= 10 ms at 220 KB).
Each warm result is checked against the uncached ids.

Then the event loop while a cold 220 KB chat is tokenized: on the loop (as the scorers do for short
prompts) against in the server's worker thread (`epp/server/tokenizing.py`, what it does for prompts of
16 KiB or more). A ticker on the loop sleeps 1 ms at a time; printed: the longest the loop went without
running it (median over samples) and the tokenization's own time, both ways.

  python benchmarks/kv_prompt.py [--samples 40] [--chunk-chars 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's packages first

from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.prompt import PromptTokenizer, TokenizerRegistry
from epp.kvindex.service import KvIndexService
from epp.server.tokenizing import PromptTokenizing
from epp.testing.tokenizer import build_tiny_tokenizer, generated_text
from epp.types import ApiKind, InferenceRequest

TARGETS_MS = {4_000: 1.0, 220_000: 10.0}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def chat(system: str, question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def uncached(tok: PromptTokenizer, msgs: list[dict[str, Any]]) -> list[int]:
    return tok.encode_uncached(tok.render_chat(msgs), add_special_tokens=False)


def run(tok: PromptTokenizer, size: int, samples: int) -> dict[str, list[float]]:
    questions = [
        f"Question {i}: what does {generated_text(60, seed=1000 + i)} mean?" for i in range(samples + 1)
    ]
    systems = [generated_text(size - 100, seed=10 + i) for i in range(samples)]
    out: dict[str, list[float]] = {"cold": [], "warm": [], "uncached": []}
    for i in range(samples):
        tok.clear_cache()
        first, msgs = chat(systems[i], questions[i]), chat(systems[i], questions[i + 1])
        out["cold"].append(timed(partial(tok.encode_chat, first)))
        out["warm"].append(timed(partial(tok.encode_chat, msgs)))
        out["uncached"].append(timed(partial(uncached, tok, msgs)))
        expected = tok.encode_uncached(tok.render_chat(msgs), add_special_tokens=False)
        assert list(tok.encode_chat(msgs)) == expected, "cached ids differ from the tokenizer's"
    return out


async def stalls(kv: KvIndexService, request: InferenceRequest, worker: bool) -> tuple[float, float]:
    """(longest gap between ticks of a 1 ms ticker, tokenization time), in ms, with a cold cache."""
    tok = kv.tokenizers.get(request.model)
    assert tok is not None
    tok.clear_cache()
    tokenizing = PromptTokenizing(kv)
    gaps: list[float] = []
    running = True

    async def ticker() -> None:
        last = time.perf_counter()
        while running:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.005)
    t = time.perf_counter()
    if worker:
        done = await tokenizing.tokenize(request)
        assert done.tokens is not None and done.tokens.ids is not None
    else:
        assert kv.prompt_tokens(request) is not None
    took = time.perf_counter() - t
    await asyncio.sleep(0.005)
    running = False
    await task
    tokenizing.close()
    return max(gaps) * 1e3, took * 1e3


def loop_stalls(directory: str, samples: int) -> None:
    index = BlockIndex(block_size=16, max_entries=1000)
    kv = KvIndexService(index, FreshnessTracker(), TokenizerRegistry({"m": directory}), 16)
    print("event loop while a cold 220 KB chat is tokenized (medians):")
    print(f"{'where':>14} {'longest loop stall ms':>22} {'tokenization ms':>16}")
    for worker in (False, True):
        res = []
        for i in range(samples):
            msgs = chat(generated_text(220_000, seed=500 + i), "what is this?")
            body = sum(len(m["content"]) for m in msgs)
            request = InferenceRequest("r", ApiKind.CHAT_COMPLETIONS, "m", messages=msgs, body_bytes=body)
            res.append(asyncio.run(stalls(kv, request, worker)))
        stall = statistics.median(r[0] for r in res)
        took = statistics.median(r[1] for r in res)
        print(f"{'worker thread' if worker else 'event loop':>14} {stall:>22.1f} {took:>16.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--chunk-chars", type=int, default=1024)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        build_tiny_tokenizer(d)
        built = time.perf_counter() - t
        tok = PromptTokenizer.from_dir(d, chunk_chars=args.chunk_chars)
        notes = tok.chunking_notes
        print(f"tiny tokenizer built in {built:.2f} s; chunk_chars={args.chunk_chars}; notes={notes}")
        loop_stalls(d, max(5, args.samples // 4))
    print(f"{'prompt':>8} {'case':>9} {'p50 ms':>9} {'p90 ms':>9} {'target':>10}")
    for size, target in TARGETS_MS.items():
        samples = args.samples if size < 100_000 else max(5, args.samples // 4)
        res = run(tok, size, samples)
        for case, values in res.items():
            goal = f"<= {target:g} ms" if case == "warm" else ""
            p50 = statistics.median(values)
            print(f"{size // 1000:>6}KB {case:>9} {p50:>9.3f} {pct(values, 0.9):>9.3f} {goal:>10}")
    print("cache:", tok.cache_stats())


if __name__ == "__main__":
    main()
