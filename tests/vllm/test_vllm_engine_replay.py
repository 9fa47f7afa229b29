"""`epp-sim engine-replay` against a real vLLM (CPU build, tiny model): the same generated sequential
workload on both, `cached_tokens` compared request by request; it must match exactly.

vLLM runs with prefix caching, `--block-size 32`, `--num-gpu-blocks-override 96` (95 usable blocks,
3,040 tokens: the workload evicts often), `--max-num-seqs 1` and `--enable-prompt-tokens-details`.
The conftest's `running_vllm` starts vLLM with its usual flags plus these.

The workload (seeded): prompts built from a few shared prefixes (block-aligned and not) plus random
suffixes, exact repeats of earlier prompts (so the `len - 1` cap and duplicate copies occur), and
fresh prompts; max_tokens 1-40 (decode fills blocks too). Token ids below the tiny model's vocabulary
(512) and prompt + output within its 2,048 positions.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simulator.cli import main
from tests.vllm.conftest import ENGINE_BLOCK_SIZE, MODEL_NAME, VllmEngine, running_vllm

NUM_BLOCKS = 96
REQUESTS = 300
VOCAB = 512


@pytest.fixture(scope="module")
def small_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    log = tmp_path_factory.mktemp("vllm-replay") / "vllm.engine-replay.log"
    flags = ("--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "1")
    with running_vllm(log, flags) as engine:
        yield engine


def workload(n: int, seed: int = 7) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(2, VOCAB, int(k)).tolist() for k in (64, 100, 256, 320, 500, 640, 777, 1024)]
    out: list[dict[str, Any]] = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.2 and out:  # an exact repeat of a recent prompt
            prompt = list(out[-int(rng.integers(1, min(len(out), 30) + 1))]["prompt_token_ids"])
        elif kind < 0.85:  # a shared prefix and a suffix (sometimes none, sometimes block-aligned)
            p = prefixes[int(rng.integers(0, len(prefixes)))]
            suffix = int(rng.choice([0, 32, 64, int(rng.integers(1, 400))]))
            prompt = p + rng.integers(2, VOCAB, suffix).tolist()
        else:  # fresh
            prompt = rng.integers(2, VOCAB, int(rng.integers(1, 1200))).tolist()
        max_tokens = int(rng.choice([1, 1, 2, int(rng.integers(1, 41))]))
        out.append({"prompt_token_ids": prompt, "max_tokens": max_tokens})
    return out


def complete(engine: VllmEngine, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"{engine.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        reply: dict[str, Any] = json.loads(resp.read())
    return reply


def test_engine_replay_matches_vllm_cached_tokens(small_vllm: VllmEngine, tmp_path: Path) -> None:
    rows = workload(REQUESTS)
    real: list[dict[str, int]] = []
    for i, row in enumerate(rows):  # one at a time: each sent after the previous answered
        usage = complete(small_vllm, row["prompt_token_ids"], row["max_tokens"])["usage"]
        details = usage.get("prompt_tokens_details")
        assert details is not None, "no prompt_tokens_details: is --enable-prompt-tokens-details set?"
        assert usage["completion_tokens"] == row["max_tokens"]
        cached = int(details.get("cached_tokens") or 0)
        real.append({"i": i, "prompt_tokens": int(usage["prompt_tokens"]), "cached_tokens": cached})

    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, ev = tmp_path / "results.jsonl", tmp_path / "events.jsonl"
    argv = ["engine-replay", "--requests", str(path), "--num-blocks", str(NUM_BLOCKS)]
    argv += ["--block-size", str(ENGINE_BLOCK_SIZE), "--out", str(out), "--events", str(ev)]
    assert main(argv) == 0
    sim = [json.loads(x) for x in out.read_text().splitlines()]
    events = [json.loads(x) for x in ev.read_text().splitlines()]

    # The workload exercised what it should: hits, the cap on repeats, and evictions.
    assert sum(r["cached_tokens"] > 0 for r in real) > REQUESTS // 3
    assert sum(e["type"] == "BlockRemoved" for e in events) > 100
    mismatches = [(r, s) for r, s in zip(real, sim, strict=True) if r != s]
    assert not mismatches, f"{len(mismatches)} of {REQUESTS} differ; first: {mismatches[:5]}"
