"""End to end: engine KV events published for a prompt's tokens make the EPP route that prompt, through
the real Envoy, to the pod that holds it."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from epp.kvindex.keys import block_keys, root_key
from epp.kvindex.prompt import PromptTokenizer
from epp.server.tokenizing import OFFLOAD_CHARS
from epp.testing.kv_publisher import KvEventPublisher, stored
from epp.testing.tokenizer import build_tiny_tokenizer, generated_text

from .stack import BS, MODEL, eventually, kv_cluster


async def post(c: dict[str, Any], path: str, body: dict[str, Any]) -> str:
    async with c["session"].post(f"{c['envoy'].url}{path}", json=body) as r:
        assert r.status == 200, await r.text()
        return str(r.headers["x-served-by"])


async def publish_prompt(pub: KvEventPublisher, token_ids: list[int], first_hash: int) -> int:
    n = len(token_ids) // BS
    hashes = list(range(first_hash, first_hash + n))
    await pub.publish([stored(hashes, None, token_ids[: n * BS], BS)])
    return n


async def test_token_id_prompt_goes_to_the_pod_holding_its_prefix() -> None:
    async with kv_cluster() as c:
        epp = c["epp"]
        prompt = [(7 * i) % 5000 for i in range(40 * BS)]
        holder = c["backends"][1]
        await publish_prompt(c["pubs"][1], prompt, 1000)
        await eventually(lambda: epp.kv_index.pod_counts(holder.address).get("gpu") == 40, "blocks indexed")
        served = [
            await post(c, "/v1/completions", {"model": MODEL, "prompt": [*prompt, 1, 2, 3]}) for _ in range(4)
        ]
        assert served == ["pod-1"] * 4
        # A prompt sharing nothing with the indexed one is not drawn to pod-1 by the cache.
        other = [9000 + i for i in range(40 * BS)]
        pod0 = c["backends"][0]
        await publish_prompt(c["pubs"][0], other, 5000)
        await eventually(lambda: epp.kv_index.pod_counts(pod0.address).get("gpu") == 40, "other indexed")
        assert await post(c, "/v1/completions", {"model": MODEL, "prompt": other}) == "pod-0"


async def test_chat_prompt_is_tokenized_with_the_models_template(tmp_path: pathlib.Path) -> None:
    tok_dir = build_tiny_tokenizer(tmp_path / "tok")
    tokenizer = PromptTokenizer.from_dir(tok_dir)
    messages = [
        {"role": "system", "content": "You are a careful assistant. " * 40},
        {"role": "user", "content": "Which pod holds this conversation?"},
    ]
    ids = [int(t) for t in tokenizer.encode_chat(messages)]
    assert len(ids) >= 4 * BS
    async with kv_cluster(str(tok_dir)) as c:
        epp = c["epp"]
        holder = c["backends"][2]
        n = await publish_prompt(c["pubs"][2], ids, 77)
        await eventually(
            lambda: epp.kv_index.pod_counts(holder.address).get("gpu") == n, "chat blocks indexed"
        )
        # The EPP computes the same keys the events produced.
        keys = block_keys(ids, BS, root_key(MODEL, None))
        assert epp.kv_index.lookup(keys, [holder.address])[holder.address]["gpu"] == n
        body = {"model": MODEL, "messages": messages}
        assert [await post(c, "/v1/chat/completions", body) for _ in range(3)] == ["pod-2"] * 3
        # Without the right tokenizer the prompt cannot be keyed, and /debug/index says so.
        async with c["session"].get(f"http://127.0.0.1:{epp.metrics_port}/debug/index") as r:
            report = json.loads(await r.text())
        assert report["tokenizers"] == {MODEL: True}
        assert report["models_without_tokenizer"] == []
        assert report["pods"][holder.address]["blocks"] == {"gpu": n}
        assert report["pods"][holder.address]["freshness"] in ("fresh", "degraded")
        assert "careful assistant" not in json.dumps(report)  # no prompt content in debug output


async def test_stale_pods_get_no_cache_credit() -> None:
    async with kv_cluster() as c:
        epp = c["epp"]
        prompt = [(11 * i) % 3000 for i in range(40 * BS)]
        holder = c["backends"][1]
        await publish_prompt(c["pubs"][1], prompt, 1)
        await eventually(lambda: epp.kv_index.pod_counts(holder.address).get("gpu") == 40, "indexed")
        assert await post(c, "/v1/completions", {"model": MODEL, "prompt": prompt}) == "pod-1"
        # pod-1's publisher goes away: the pod is stale and its blocks earn nothing; load decides.
        await c["pubs"][1].stop()
        c["pubs"][1] = await KvEventPublisher("tcp://127.0.0.1:*").start()  # placeholder for cleanup
        await eventually(
            lambda: epp.freshness.state(holder.address, epp.clock.now()).reason == "publisher_unreachable",
            "stale",
        )
        holder.waiting = 3  # now the busiest pod
        await eventually(
            lambda: epp.datastore.get(holder.address).metrics.waiting == 3,  # type: ignore[union-attr]
            "load scraped",
        )
        served = {await post(c, "/v1/completions", {"model": MODEL, "prompt": prompt}) for _ in range(4)}
        assert "pod-1" not in served


async def test_a_long_chat_prompt_is_tokenized_off_the_event_loop_and_routed_to_its_holder(
    tmp_path: pathlib.Path,
) -> None:
    """A prompt of tens of KB takes tens of ms to tokenize cold: the EPP does it in its worker thread
    (the event loop serves other streams meanwhile) and routes with the ids it got there."""
    tok_dir = build_tiny_tokenizer(tmp_path / "tok")
    messages = [
        {"role": "system", "content": generated_text(3 * OFFLOAD_CHARS)},
        {"role": "user", "content": "Which pod holds this long conversation?"},
    ]
    ids = [int(t) for t in PromptTokenizer.from_dir(tok_dir).encode_chat(messages)]
    async with kv_cluster(str(tok_dir)) as c:
        epp = c["epp"]
        holder = c["backends"][1]
        n = await publish_prompt(c["pubs"][1], ids, 500)
        await eventually(lambda: epp.kv_index.pod_counts(holder.address).get("gpu") == n, "blocks indexed")
        body = {"model": MODEL, "messages": messages}
        assert [await post(c, "/v1/chat/completions", body) for _ in range(3)] == ["pod-1"] * 3
        assert epp.tokenizing is not None and epp.tokenizing.offloaded == 3
        # A short prompt is still tokenized on the loop.
        short = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
        await post(c, "/v1/chat/completions", short)
        assert epp.tokenizing.offloaded == 3
        async with c["session"].get(f"http://127.0.0.1:{epp.metrics_port}/metrics") as r:
            text = await r.text()
        assert "epp_prompts_tokenized_in_worker_total 3.0" in text
        assert "epp_tokenizer_queued_chars 0.0" in text
