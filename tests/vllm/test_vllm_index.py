"""The EPP's KV index against a real vLLM engine (CPU build, tiny random-weight model).

What is checked, with the EPP's production code in-process (`EppServer`, per-pod KV events
with replay, the model's tokenizer, index block size 16) and vLLM 0.32 serving with block size 32:

1. After a request, the index holds exactly the full blocks vLLM reported: every engine block
   (32 tokens) is two index blocks, `2 * floor(prompt_tokens / 32)` of them for a fresh prompt,
   and the raw `BlockStored` events (decoded here with msgspec alone) carry exactly the prompt's
   first `32 * floor(prompt_tokens / 32)` token ids. A non-full tail block is never reported.
   In general a request makes vLLM store `floor((prompt + generated - 1) / 32) - cached / 32`
   blocks (decoding that fills a block publishes it; a request that fills none publishes nothing).
2. Before each follow-up request, the index predicts vLLM's `cached_tokens`: the longest run of
   the prompt's index blocks held on the GPU tier, times 16, rounded down to whole engine blocks,
   and capped at `floor((prompt_tokens - 1) / 32)` engine blocks (vLLM always computes at least
   the last prompt token). The prediction must equal `usage.prompt_tokens_details.cached_tokens`.
3. The EPP's own tokenization of a text prompt equals vLLM's `prompt_token_ids`.
4. An EPP that joins after the engine has published replays from seq 0 and ends up with the same
   blocks. The pod is `fresh` in /debug/index, with no orphans, gaps or drops.

Follow-up prompts are token-id lists (vLLM takes `prompt` as ids) so no tokenizer sits between
the prefix we build and what the engine caches.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

import aiohttp
import numpy as np
import pytest

from epp.config import IndexConfig, KvEventsConfig, StaticEndpoint, default_config
from epp.kvindex.keys import block_keys, root_key
from epp.server.app import EppServer, ServerSettings
from epp.testing.wait import eventually as wait_until
from epp.types import ApiKind, InferenceRequest
from tests.vllm.conftest import ENGINE_BLOCK_SIZE, MODEL_NAME, VllmEngine

INDEX_BLOCK_SIZE = 16
PER_ENGINE_BLOCK = ENGINE_BLOCK_SIZE // INDEX_BLOCK_SIZE
WAIT = 20.0  # seconds: every wait below is for a condition, polled

_WORDS = (
    "prefix", "cache", "block", "token", "engine", "request", "model", "server", "router", "gateway",
    "index", "event", "prompt", "reply", "queue", "memory", "layer", "batch", "stream", "score",
    "endpoint", "fresh", "replay", "publisher", "decode", "hash", "chain", "store",
)  # fmt: skip


def text_of(tag: str, words: int) -> str:
    """Deterministic prose that starts with `tag` (so tests never share a prefix)."""
    return tag + ": " + " ".join(_WORDS[(i * 7 + len(tag)) % len(_WORDS)] for i in range(words)) + "."


async def eventually(check: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    await wait_until(check, what, timeout, interval=0.02)


def epp_server(engine: VllmEngine) -> EppServer:
    cfg = default_config()
    cfg = replace(
        cfg,
        kv_events=KvEventsConfig(
            mode="per-pod",
            port=engine.event_port,
            replay_port=engine.replay_port,
            topic_filters=("kv@",),
            replay_timeout=5.0,
        ),
        tokenizers={MODEL_NAME: str(engine.model)},
        index=IndexConfig(block_size=INDEX_BLOCK_SIZE),
    )
    settings = ServerSettings.loopback(
        refresh_metrics_interval=0.1,  # under the default saturation detector's 200 ms staleness threshold
        seed=0,
    )
    return EppServer(settings, cfg, [StaticEndpoint(engine.address, model=MODEL_NAME)])


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        yield s


@pytest.fixture
async def epp(vllm_engine: VllmEngine) -> AsyncIterator[EppServer]:
    server = epp_server(vllm_engine)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)


# -- helpers -----------------------------------------------------------------------------------------
async def complete(
    session: aiohttp.ClientSession, engine: VllmEngine, prompt: str | Sequence[int], max_tokens: int = 1
) -> dict[str, Any]:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with session.post(f"{engine.url}/v1/completions", json=body) as resp:
        text = await resp.text()
        assert resp.status == 200, f"vLLM answered {resp.status}: {text[:500]}"
        reply: dict[str, Any] = json.loads(text)
        return reply


def cached_tokens(reply: dict[str, Any]) -> int:
    details = reply["usage"].get("prompt_tokens_details")
    assert details is not None, "no prompt_tokens_details: is --enable-prompt-tokens-details set?"
    return int(details.get("cached_tokens") or 0)


async def debug_index(session: aiohttp.ClientSession, server: EppServer) -> dict[str, Any]:
    async with session.get(f"http://127.0.0.1:{server.metrics_port}/debug/index") as resp:
        assert resp.status == 200
        report: dict[str, Any] = await resp.json()
        return report


def index_blocks(server: EppServer, pod: str) -> dict[str, int]:
    return {str(t).lower(): int(n) for t, n in server.kv_index.pod_counts(pod).items() if n}


def gpu_prefix(server: EppServer, pod: str, keys: np.ndarray) -> int:
    """How many of `keys`, from the first, the index says the pod holds on the GPU tier."""
    held = server.kv_index.lookup(keys, [pod]).get(pod, {})
    return int(held.get("gpu", 0))


def predicted_cached(index_prefix_blocks: int, prompt_len: int) -> int:
    """vLLM's hit from the index: whole engine blocks only, and never the last prompt token."""
    engine_blocks = (index_prefix_blocks * INDEX_BLOCK_SIZE) // ENGINE_BLOCK_SIZE
    cap = (prompt_len - 1) // ENGINE_BLOCK_SIZE
    return min(engine_blocks, cap) * ENGINE_BLOCK_SIZE


def ids_request(ids: Sequence[int]) -> InferenceRequest:
    return InferenceRequest("vllm-test", ApiKind.COMPLETIONS, MODEL_NAME, prompt=[int(t) for t in ids])


def text_request(text: str) -> InferenceRequest:
    return InferenceRequest("vllm-test", ApiKind.COMPLETIONS, MODEL_NAME, prompt=text)


async def wait_connected(server: EppServer, pod: str) -> None:
    """The EPP's SUB socket reached the engine's publisher (the pod is no longer stale)."""
    await eventually(
        lambda: server.freshness.state(pod, server.clock.now()).state.value != "stale",
        f"the EPP to connect to {pod}'s KV-event publisher",
    )
    # The subscription travels after the TCP connect; give it a moment so the next event is not lost
    # to the slow-joiner effect (replay would heal it, but only once a later event arrives).
    await asyncio.sleep(0.5)


def new_engine_blocks(prompt_len: int, max_tokens: int, cached: int) -> int:
    """Blocks a request makes vLLM store: every full block of what it computed (the prompt and all
    generated tokens but the last, whose KV is never computed), minus the blocks it hit. A repeated
    block-aligned prompt re-stores its last block (the hit cap), under the same hash."""
    return (prompt_len + max_tokens - 1) // ENGINE_BLOCK_SIZE - cached // ENGINE_BLOCK_SIZE


async def settle(
    server: EppServer, engine: VllmEngine, pod: str, batches_before: int, expect_blocks: int
) -> int:
    """Wait until vLLM has published the `expect_blocks` blocks a request stored (and nothing else),
    and the EPP has applied everything published so far. Returns how many distinct blocks vLLM holds."""
    rec = engine.events()

    def published() -> int:
        return sum(len(s.hashes) for s in rec.stored_events(batches_before))

    await eventually(lambda: published() >= expect_blocks, f"vLLM to publish {expect_blocks} stored blocks")
    await asyncio.sleep(0.3)  # anything more would show up now
    assert published() == expect_blocks, f"vLLM stored {published()} blocks, expected {expect_blocks}"
    batches, _ = rec.snapshot()
    if batches:
        last_seq = batches[-1].seq
        await eventually(
            lambda: server.ingest.last_seq.get(pod) == last_seq, f"the EPP to apply seq {last_seq} from {pod}"
        )
    return rec.distinct_index_blocks(INDEX_BLOCK_SIZE, root_key(MODEL_NAME, None))


def expect_index_matches_engine(server: EppServer, pod: str, index_blocks_expected: int) -> None:
    """`index_blocks_expected`: the distinct index blocks recomputed from the blocks vLLM holds (see
    EventRecorder.distinct_index_blocks)."""
    counts = index_blocks(server, pod)
    assert set(counts) <= {"gpu"}, f"unexpected tiers in the index: {counts}"
    assert counts.get("gpu", 0) == index_blocks_expected, (
        f"index holds {counts} for {pod}; vLLM's live blocks make {index_blocks_expected} distinct "
        f"{INDEX_BLOCK_SIZE}-token index blocks"
    )


def expect_healthy(report: dict[str, Any], pod: str) -> None:
    entry = report["pods"][pod]
    assert entry["freshness"] == "fresh", f"pod not fresh in /debug/index: {entry}"
    assert entry["orphans"] == 0 and entry["gaps"] == 0 and entry["restarts"] == 0, entry
    assert entry["drops"] == {} and entry["unknown_tiers"] == {}, entry
    assert report["block_size"] == INDEX_BLOCK_SIZE


async def predict_then_send(
    session: aiohttp.ClientSession,
    server: EppServer,
    engine: VllmEngine,
    pod: str,
    label: str,
    ids: list[int],
    max_tokens: int = 1,
) -> tuple[dict[str, Any], int]:
    """Predict `cached_tokens` from the index, send the ids to vLLM, compare. Returns (reply, blocks)."""
    keys = block_keys(ids, INDEX_BLOCK_SIZE, root_key(MODEL_NAME, None))
    service_keys = server.kv.prompt_keys(ids_request(ids))
    assert service_keys is not None and np.array_equal(np.asarray(service_keys), np.asarray(keys))
    n = gpu_prefix(server, pod, keys)
    predicted = predicted_cached(n, len(ids))
    before = len(engine.events().snapshot()[0])
    reply = await complete(session, engine, ids, max_tokens)
    assert reply["usage"]["prompt_tokens"] == len(ids)
    got = cached_tokens(reply)
    print(
        f"[{label}] prompt {len(ids)} tokens, {len(keys)} index keys, index GPU prefix {n} blocks "
        f"-> predicted cached {predicted}, vLLM cached_tokens {got}"
    )
    assert got == predicted, (
        f"[{label}] vLLM served {got} cached tokens; the index predicted {predicted} "
        f"({n} index blocks of {INDEX_BLOCK_SIZE} held, prompt {len(ids)} tokens)"
    )
    blocks = await settle(server, engine, pod, before, new_engine_blocks(len(ids), max_tokens, got))
    return reply, blocks


# -- tests ---------------------------------------------------------------------------------------------
async def test_index_matches_vllm_and_predicts_cached_tokens(
    vllm_engine: VllmEngine, epp: EppServer, session: aiohttp.ClientSession
) -> None:
    engine, server, pod = vllm_engine, epp, vllm_engine.address
    rec = engine.events()
    await wait_connected(server, pod)

    # Request A: ~300 tokens of text, sent straight to vLLM.
    text_a = text_of("request A", 48)
    keys_a_before = server.kv.prompt_keys(text_request(text_a))
    assert keys_a_before is not None, "the EPP could not tokenize the prompt (tokenizer not loaded?)"
    assert gpu_prefix(server, pod, keys_a_before) == 0
    batches_before = len(rec.snapshot()[0])
    reply_a = await complete(session, engine, text_a)
    ids_a: list[int] = reply_a["choices"][0]["prompt_token_ids"]
    n_a = reply_a["usage"]["prompt_tokens"]
    assert len(ids_a) == n_a and n_a >= 9 * ENGINE_BLOCK_SIZE, f"prompt A has {n_a} tokens"
    assert cached_tokens(reply_a) == 0

    # The EPP tokenizes the text exactly as vLLM did (bos included).
    epp_ids = server.kv.prompt_tokens(text_request(text_a))
    assert epp_ids is not None and [int(t) for t in epp_ids] == ids_a

    engine_blocks = await settle(server, engine, pod, batches_before, new_engine_blocks(n_a, 1, 0))
    stored = engine.events().stored_events(batches_before)
    full = n_a // ENGINE_BLOCK_SIZE
    print(
        f"[A] prompt {n_a} tokens; vLLM published {len(stored)} BlockStored with "
        f"{[len(s.hashes) for s in stored]} blocks, block_size {[s.block_size for s in stored]}, "
        f"medium {[s.medium for s in stored]}"
    )
    first = next(b for b in engine.events().snapshot()[0][batches_before:] if b.events)
    ev0 = first.events[0]
    shape = f"map {sorted(ev0)}" if isinstance(ev0, dict) else f"array of {len(ev0)}"
    print(f"[A] batch: seq {first.seq}, topic {first.topic!r}, dp rank {first.rank!r}; event {shape}")
    # What vLLM reported: exactly the prompt's full blocks, in order, from the root.
    assert sum(len(s.hashes) for s in stored) == full
    assert all(s.block_size == ENGINE_BLOCK_SIZE for s in stored)
    assert stored[0].parent is None
    assert [t for s in stored for t in s.token_ids] == ids_a[: full * ENGINE_BLOCK_SIZE]
    # What the index holds: the same blocks, two index blocks per engine block, nothing more.
    expect_index_matches_engine(server, pod, engine_blocks)
    keys_a = server.kv.prompt_keys(text_request(text_a))
    assert keys_a is not None and len(keys_a) == n_a // INDEX_BLOCK_SIZE
    assert gpu_prefix(server, pod, keys_a) == full * PER_ENGINE_BLOCK

    # Follow-ups sharing a prefix with A, each predicted from the index before it is sent.
    def diverge(at: int, length: int) -> list[int]:
        tail = [(ids_a[at] + 1 + i) % 256 + 100 for i in range(length - at)]
        assert tail[0] != ids_a[at]
        return ids_a[:at] + tail

    cases: list[tuple[str, list[int]]] = [
        # 13 shared index blocks = 6.5 engine blocks: vLLM can reuse only 6 (192 tokens).
        ("B: diverges at 208", diverge(208, 270)),
        # Diverges inside an index block: 12 index blocks shared.
        ("B: diverges at 200", diverge(200, 250)),
        # Block-aligned prefix of A, all cached: the last block is recomputed anyway (224, not 256).
        ("B: A[:256] exactly", ids_a[:256]),
        # All of A's full blocks, then new tokens.
        ("B: A + 40 new tokens", ids_a + [101 + (i % 50) for i in range(40)]),
    ]
    for label, ids in cases:
        _, engine_blocks = await predict_then_send(session, server, engine, pod, label, ids)
        expect_index_matches_engine(server, pod, engine_blocks)

    # Decoding fills blocks too: vLLM stores them, so a follow-up that includes the output hits them.
    prompt_c = diverge(150, 300)
    reply_c, engine_blocks = await predict_then_send(
        session, server, engine, pod, "C: 300 + 60 decoded", prompt_c, max_tokens=60
    )
    expect_index_matches_engine(server, pod, engine_blocks)
    output_c: list[int] = reply_c["choices"][0]["token_ids"]
    assert len(output_c) == 60
    _, engine_blocks = await predict_then_send(
        session, server, engine, pod, "D: C's prompt + output + 5", prompt_c + output_c + [7, 8, 9, 10, 11]
    )
    expect_index_matches_engine(server, pod, engine_blocks)

    report = await debug_index(session, server)
    expect_healthy(report, pod)
    print(f"[index] /debug/index pod entry: {report['pods'][pod]}")


async def test_late_joining_epp_replays_what_vllm_published(
    vllm_engine: VllmEngine, session: aiohttp.ClientSession
) -> None:
    engine, pod = vllm_engine, vllm_engine.address
    rec = engine.events()
    # The engine publishes before any EPP listens.
    before = len(rec.snapshot()[0])
    reply = await complete(session, engine, text_of("late joiner", 40))
    ids_early: list[int] = reply["choices"][0]["prompt_token_ids"]
    await eventually(lambda: len(rec.snapshot()[0]) > before, "vLLM to publish KV events")

    server = epp_server(engine)
    await server.start()
    try:
        await wait_connected(server, pod)
        # The next live batch has seq > 0: the EPP replays from 0 over the engine's ROUTER socket. Until
        # that batch arrives the EPP cannot know what it missed, so this trigger shares nothing.
        before = len(rec.snapshot()[0])
        trigger = await complete(session, engine, text_of("late trigger", 15))
        expect = new_engine_blocks(trigger["usage"]["prompt_tokens"], 1, 0)
        engine_blocks = await settle(server, engine, pod, before, expect)
        expect_index_matches_engine(server, pod, engine_blocks)
        report = await debug_index(session, server)
        entry = report["pods"][pod]
        assert entry["replays"] == {"complete": 1}, entry
        expect_healthy(report, pod)
        # The replayed blocks predict the engine's hits like live ones.
        ids_again = ids_early + [200 + (i % 33) for i in range(50)]
        _, engine_blocks = await predict_then_send(session, server, engine, pod, "late: replayed", ids_again)
        expect_index_matches_engine(server, pod, engine_blocks)
    finally:
        await server.stop(0)
