"""The simulated engine as a real server on loopback: OpenAI API, KV events on real ZeroMQ sockets,
/metrics read by the EPP's parser, bad input, the CLI, and the production EPP routing to it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from epp.config import KvEventsConfig, StaticEndpoint, default_config
from epp.kvindex.events import BlockStored, decode_batch
from epp.kvindex.freshness import FRESH
from epp.kvindex.prompt import PromptTokenizer
from epp.server.app import EppServer, ServerSettings
from epp.sources.metrics_text import parse_metrics
from epp.testing.envoy import EnvoyConfig, EnvoyProcess, free_port
from epp.testing.tokenizer import build_tiny_tokenizer, generated_text
from epp.testing.wait import eventually
from simulator.cli import main as sim_main
from simulator.engine import EngineConfig
from simulator.serving import EngineServerConfig, SimulatedEngineServer
from simulator.serving.output_text import WORDS

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "demo"
BS = 16
END = 0xFFFFFFFFFFFFFFFF


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def cfg(**fields: Any) -> EngineServerConfig:
    base: dict[str, Any] = {"model": MODEL, "engine": EngineConfig(num_gpu_blocks=256, block_size=BS)}
    return EngineServerConfig(**{**base, **fields})


@contextlib.asynccontextmanager
async def serving(**fields: Any) -> AsyncIterator[tuple[SimulatedEngineServer, aiohttp.ClientSession]]:
    async with SimulatedEngineServer(cfg(**fields)) as srv, aiohttp.ClientSession() as session:
        yield srv, session


async def post(
    session: aiohttp.ClientSession, srv: SimulatedEngineServer, path: str, body: Any
) -> tuple[int, dict[str, Any]]:
    kwargs: dict[str, Any] = {"data": body} if isinstance(body, (bytes, str)) else {"json": body}
    async with session.post(f"{srv.url}{path}", **kwargs) as r:
        return r.status, json.loads(await r.text())


def sse_events(text: str) -> list[Any]:
    assert text.endswith("data: [DONE]\n\n")
    out: list[Any] = []
    for block in text.split("\n\n")[:-2]:
        assert block.startswith("data: ")
        out.append(json.loads(block[len("data: ") :]))
    return out


def cached(prompt_len: int) -> int:
    """What the engine (as vLLM) serves from cache for a prompt seen before: its full blocks, but never
    the last prompt token."""
    return (prompt_len - 1) // BS * BS


# -- the OpenAI API ------------------------------------------------------------------------------


async def test_completions_and_chat_non_streaming(tok_dir: pathlib.Path) -> None:
    async with serving(tokenizer=tok_dir) as (srv, session):
        status, doc = await post(
            session, srv, "/v1/completions", {"model": MODEL, "prompt": "Hello there, cache."}
        )
        assert status == 200, doc
        assert doc["object"] == "text_completion" and doc["model"] == MODEL and doc["id"].startswith("cmpl-")
        choice = doc["choices"][0]
        assert choice["finish_reason"] == "length" and isinstance(choice["text"], str) and choice["text"]
        use = doc["usage"]
        assert use["completion_tokens"] == 16  # the default max_tokens
        assert use["total_tokens"] == use["prompt_tokens"] + 16
        assert use["prompt_tokens_details"] == {"cached_tokens": 0}
        chat = {"messages": [{"role": "user", "content": "Tell me about prefix caches."}], "max_tokens": 5}
        status, doc = await post(session, srv, "/v1/chat/completions", chat)
        assert status == 200, doc
        assert doc["object"] == "chat.completion" and doc["id"].startswith("chatcmpl-")
        message = doc["choices"][0]["message"]
        assert message["role"] == "assistant" and message["content"]
        assert doc["usage"]["completion_tokens"] == 5
        async with session.get(f"{srv.url}/v1/models") as r:
            models = await r.json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert models["data"][0]["max_model_len"] == 255 * BS
        async with session.get(f"{srv.url}/health") as r:
            assert r.status == 200


async def test_a_long_chat_is_tokenized_in_the_worker_and_served_as_a_short_one_is(
    tok_dir: pathlib.Path,
) -> None:
    """Bodies of 16 KiB or more are read in a worker thread (the loop runs the engine's steps meanwhile);
    the prompt's ids, hence its length and its cache hits, are the ones the loop would compute."""
    system = generated_text(40_000)
    chat = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "?"}],
        "max_tokens": 3,
    }
    expected = len(PromptTokenizer.from_dir(tok_dir).encode_chat(chat["messages"]))
    async with serving(tokenizer=tok_dir, engine=EngineConfig(num_gpu_blocks=4096, block_size=BS)) as (
        srv,
        session,
    ):
        status, first = await post(session, srv, "/v1/chat/completions", chat)
        assert status == 200, first
        assert first["usage"]["prompt_tokens"] == expected
        status, again = await post(session, srv, "/v1/chat/completions", chat)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == cached(expected)
        assert srv.api is not None and srv.api.tokenizing.completed == 2
        # A short one is read on the loop; a bad long one is a clear 400 from the worker.
        status, _ = await post(
            session, srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 200 and srv.api.tokenizing.completed == 2
        bad = {**chat, "continue_final_message": True}  # with add_generation_prompt: refused
        status, doc = await post(session, srv, "/v1/chat/completions", bad)
        assert status == 400 and "continue_final_message" in doc["error"]["message"], doc
        assert srv.api.tokenizing.completed == 3


async def test_repeated_prompt_reports_the_engines_cached_tokens() -> None:
    prompt = [(31 * i) % 997 for i in range(5 * BS + 7)]
    async with serving() as (srv, session):
        first = (await post(session, srv, "/v1/completions", {"prompt": prompt, "max_tokens": 4}))[1]
        again = (await post(session, srv, "/v1/completions", {"prompt": prompt, "max_tokens": 4}))[1]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == cached(len(prompt)) > 0
        assert again["choices"][0]["text"] == first["choices"][0]["text"]  # same prompt, same answer
        # Block-aligned prompt: the last block is recomputed, so one block less is cached.
        aligned = prompt[: 4 * BS]
        await post(session, srv, "/v1/completions", {"prompt": aligned, "max_tokens": 2})
        doc = (await post(session, srv, "/v1/completions", {"prompt": aligned, "max_tokens": 2}))[1]
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == cached(len(aligned)) == 3 * BS
        # A salted tenant shares nothing with the unsalted prompt, then hits its own blocks.
        salted = {"prompt": prompt, "max_tokens": 2, "cache_salt": "tenant-a"}
        assert (await post(session, srv, "/v1/completions", salted))[1]["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 0
        }
        doc = (await post(session, srv, "/v1/completions", salted))[1]
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == cached(len(prompt))


async def test_reset_prefix_cache_over_http() -> None:
    """`POST /reset_prefix_cache` (vLLM's dev-mode endpoint): 409 while a request runs; once idle, 200
    and afterwards nothing is cached."""
    prompt = [(37 * i) % 991 for i in range(4 * BS + 3)]
    async with serving(time_scale=0.5) as (srv, session):
        await post(session, srv, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        body = {"prompt": list(range(50)), "max_tokens": 200, "stream": True}
        async with session.post(f"{srv.url}/v1/completions", json=body) as running:
            await running.content.readline()  # it is running
            async with session.post(f"{srv.url}/reset_prefix_cache") as r:
                assert r.status == 409 and "in flight" in await r.text()
            running.close()
        await eventually(lambda: (srv.runner.advance(), srv.engine.idle)[1], "idle again (the abort taken)")
        async with session.post(f"{srv.url}/reset_prefix_cache") as r:
            assert r.status == 200
        doc = (await post(session, srv, "/v1/completions", {"prompt": prompt, "max_tokens": 2}))[1]
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("chat", [False, True])
async def test_streaming_follows_the_engine_and_matches_the_full_answer(
    tok_dir: pathlib.Path, chat: bool
) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "Stream me a story about blocks."}]}
        if chat
        else {"prompt": "Stream me a story about blocks."}
    )
    body["max_tokens"] = 24
    async with serving(tokenizer=tok_dir) as (srv, session):
        full = (await post(session, srv, path, body))[1]
        expected = full["choices"][0]["message"]["content"] if chat else full["choices"][0]["text"]
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        loop = asyncio.get_running_loop()
        received = 0
        chunks: list[str] = []
        async with session.post(f"{srv.url}{path}", json=stream) as r:
            assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
            (pending,) = srv.runner.pending  # the request is in the engine before the response starts
            buffer = b""
            async for data in r.content.iter_any():
                buffer += data
                srv.runner.advance()
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    chunks.append(event.decode())
                    if event == b"data: [DONE]":
                        assert pending.finished.done()
                        continue
                    doc = json.loads(event[len(b"data: ") :])
                    if doc["choices"]:
                        received += 1
                        # Never ahead of the engine: the first token only after the engine produced it ...
                        assert pending.first_token.done()
                        assert loop.time() >= srv.runner.driver.wall_time(pending.first_token.result())
        text = "\n\n".join(chunks) + "\n\n"
        events = sse_events(text)
        content = [e for e in events if e["choices"]]
        assert len(content) == received >= 1
        if chat:
            assert content[0]["choices"][0]["delta"]["role"] == "assistant"
            pieces = [e["choices"][0]["delta"]["content"] for e in content]
        else:
            pieces = [e["choices"][0]["text"] for e in content]
        assert "".join(pieces) == expected
        assert [e["choices"][0]["finish_reason"] for e in content] == [None] * (len(content) - 1) + ["length"]
        assert all(e["usage"] is None for e in content)
        final = events[-1]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 24
        assert final["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]
        # The same prompt again: its blocks were cached by the non-streaming request.
        assert final["usage"]["prompt_tokens_details"]["cached_tokens"] == cached(
            full["usage"]["prompt_tokens"]
        )


async def test_stream_interval_groups_tokens_and_tokens_never_run_ahead() -> None:
    """Without a tokenizer every token is one placeholder word, so a chunk's words are its tokens."""
    async with serving(stream_interval=4) as (srv, session):
        body = {"prompt": list(range(40)), "max_tokens": 30, "stream": True}
        counts: list[int] = []
        async with session.post(f"{srv.url}/v1/completions", json=body) as r:
            (pending,) = srv.runner.pending
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                words = json.loads(line[6:])["choices"][0]["text"].split()
                assert all(w in WORDS for w in words)
                counts.append(len(words))
                srv.runner.advance()
                assert sum(counts) <= pending.tokens_out(srv.runner.steps_ended())
        assert sum(counts) == 30
        assert all(n >= 4 for n in counts[1:-1])  # the first token goes alone-or-more, the rest by 4


async def test_a_client_that_goes_away_has_its_request_aborted() -> None:
    """As vLLM's server: a stream whose client hangs up, and a non-streaming request whose client gives up,
    leave the engine before they finish; their blocks are freed and stay cached for the next request."""
    async with serving(time_scale=0.5) as (srv, session):
        body = {"prompt": list(range(50)), "max_tokens": 200, "stream": True}
        async with session.post(f"{srv.url}/v1/completions", json=body) as r:
            await r.content.readline()  # the first token arrived
            (pending,) = srv.runner.pending
            r.close()  # hang up mid-stream
        await eventually(lambda: srv.runner.aborted == 1, "the request is aborted once the writer notices")
        assert srv.api is not None and srv.api.disconnects == 1
        await eventually(lambda: not srv.engine.running, "it leaves the engine before its next step")
        rec = pending.record
        assert rec.aborted_s is not None and rec.finished_s is None and 0 < rec.output_tokens < 200
        assert srv.metrics.finished == 0 and not srv.runner.pending
        # a non-streaming request whose client gives up before the answer
        slow = {"prompt": list(range(50)), "max_tokens": 400}
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(post(session, srv, "/v1/completions", slow), 0.3)
        await eventually(lambda: srv.runner.aborted == 2, "the cancelled handler aborts its request")
        await eventually(lambda: not srv.engine.running, "and it leaves the engine")
        assert srv.metrics.finished == 0 and srv.api.disconnects == 2
        status, doc = await post(
            session, srv, "/v1/completions", {"prompt": list(range(50)), "max_tokens": 3}
        )
        assert status == 200 and doc["usage"]["completion_tokens"] == 3
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == cached(50)
        srv.runner.advance()
        assert srv.engine.pool.num_used == 0


async def test_stopping_the_server_ends_requests_in_flight_with_an_error() -> None:
    srv = SimulatedEngineServer(cfg(time_scale=5.0))
    await srv.start()
    try:
        async with aiohttp.ClientSession() as session:
            body = {"prompt": list(range(20)), "max_tokens": 1000}
            async with session.post(f"{srv.url}/v1/completions", json={**body, "stream": True}) as r:
                await r.content.readline()  # the first token
                waiting = asyncio.create_task(post(session, srv, "/v1/completions", body))
                await eventually(lambda: srv.runner.submitted == 2, "the second request is in the engine")
                stopping = asyncio.create_task(srv.stop())
                rest = (await r.content.read()).decode()
            await stopping
            assert '"code":503' in rest and "stopping" in rest and "[DONE]" not in rest
            outcome = await asyncio.gather(waiting, return_exceptions=True)
            if not isinstance(outcome[0], BaseException):  # else the connection closed before the answer
                assert outcome[0][0] == 503 and "stopping" in outcome[0][1]["error"]["message"]
    finally:
        await srv.stop()  # idempotent
    assert not srv.runner.pending


# -- bad input -----------------------------------------------------------------------------------

BAD: list[tuple[str, str, Any, int, str]] = [
    ("/v1/completions", "wrong model", {"model": "gpt-9", "prompt": [1, 2]}, 404,
     "The model `gpt-9` does not exist."),
    ("/v1/completions", "bad JSON", b"{oops", 400, "not valid JSON"),
    ("/v1/completions", "not an object", b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/completions", "prompt type", {"prompt": {"a": 1}}, 400,
     "'prompt' must be a string or a list of token ids"),
    ("/v1/completions", "max_tokens type", {"prompt": [1], "max_tokens": 1.5}, 400,
     "'max_tokens' must be an integer"),
    ("/v1/completions", "text without tokenizer", {"prompt": "hi"}, 400, "needs a tokenizer"),
    ("/v1/chat/completions", "chat without tokenizer", {"messages": [{"role": "user", "content": "hi"}]}, 400,
     "needs a tokenizer"),
    ("/v1/completions", "too long", {"prompt": list(range(255 * BS)), "max_tokens": 2}, 400,
     "can never fit this engine's KV cache"),
    ("/v1/completions", "batch", {"prompt": [[1, 2], [3]]}, 400, "batch of 2 prompts"),
]  # fmt: skip


async def test_bad_requests_get_clear_errors_and_the_server_keeps_serving() -> None:
    async with serving() as (srv, session):
        for path, case, body, status, words in BAD:
            got, doc = await post(session, srv, path, body)
            assert got == status, (case, doc)
            err = doc["error"]
            assert words in err["message"], (case, err)
            assert err["code"] == status and err["type"] in ("BadRequestError", "NotFoundError")
            # ... and the next request is served as if nothing happened.
            ok, good = await post(session, srv, "/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 2})
            assert ok == 200 and good["usage"]["completion_tokens"] == 2, case
        assert srv.api is not None and srv.api.rejected == len(BAD)
        assert srv.runner.submitted == len(BAD)  # only the good ones reached the engine
        async with session.get(f"{srv.url}/v1/completions") as r:
            assert r.status == 405


# -- KV events -----------------------------------------------------------------------------------


async def synced_sub(srv: SimulatedEngineServer, sub: zmq.asyncio.Socket) -> None:
    """Wait until `sub` receives what the server's PUB sends (ZeroMQ's slow joiner), with probe messages
    that carry no sequence number (the engine's numbering is untouched)."""
    assert srv.kv is not None
    for _ in range(500):
        await srv.kv.publisher.send_raw([b"probe"])
        if await sub.poll(20):
            frames = await sub.recv_multipart()
            assert frames == [b"probe"]
            while await sub.poll(50):  # probes still in flight
                assert await sub.recv_multipart() == [b"probe"]
            return
    raise AssertionError("the SUB socket never received the probes")


async def recv_batches(sub: zmq.asyncio.Socket, n: int) -> list[list[bytes]]:
    out = []
    for _ in range(n):
        assert await sub.poll(10_000), f"expected {n} batches, got {len(out)}"
        out.append(await sub.recv_multipart())
    return out


async def test_kv_events_on_a_real_sub_socket_and_replay_over_a_dealer() -> None:
    ctx = zmq.asyncio.Context()
    fields = {"kv_events_endpoint": "tcp://127.0.0.1:*", "kv_replay_endpoint": "tcp://127.0.0.1:*"}
    try:
        async with serving(**fields) as (srv, session):
            assert srv.kv_events_endpoint is not None and srv.kv_replay_endpoint is not None
            assert srv.kv_events_endpoint.startswith("tcp://127.0.0.1:") and "*" not in srv.kv_events_endpoint
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            assert srv.kv_peers == 0
            sub.connect(srv.kv_events_endpoint)
            await synced_sub(srv, sub)
            await eventually(lambda: srv.kv_peers == 1, "the subscriber counted")
            prompt = list(range(100, 100 + 3 * BS + 5))
            before = time.time()
            await post(session, srv, "/v1/completions", {"prompt": prompt, "max_tokens": 2 * BS})
            await eventually(lambda: srv.kv is not None and srv.kv.published == srv.engine.sink.seq, "sent")
            assert srv.engine.sink is not None
            n = srv.engine.sink.seq
            live = await recv_batches(sub, n)
            assert [int.from_bytes(f[1], "big") for f in live] == list(range(n))  # consecutive from 0
            assert all(len(f) == 3 and f[0] == b"" and len(f[1]) == 8 for f in live)
            batches = [decode_batch(f[2]) for f in live]
            after = time.time()
            # Stamped with the wall clock, as vLLM's are (routers measure event lag with it).
            assert all(before - 0.01 <= b.ts <= after + 0.01 for b in batches)
            stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
            tokens = [t for e in stored for t in e.token_ids]
            assert all(e.block_size == BS and e.tier == "gpu" for e in stored)
            # The prompt's full blocks, then the blocks its answer filled (all but the last output token).
            assert len(tokens) == (len(prompt) + 2 * BS - 1) // BS * BS
            assert tokens[: 3 * BS] == prompt[: 3 * BS]
            assert stored[0].parent_block_hash is None
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(srv.kv_replay_endpoint)
            await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
            replayed: list[list[bytes]] = []
            while True:
                assert await dealer.poll(10_000), "replay answered"
                frames = await dealer.recv_multipart()
                if int.from_bytes(frames[2], "big") == END:
                    assert frames[3] == b""
                    break
                replayed.append(frames)
            assert [f[1:] for f in replayed] == live[1:]  # [b"", topic, seq, payload], from seq 1
            dealer.close(linger=0)
            sub.close(linger=0)
    finally:
        ctx.destroy(linger=0)


async def test_central_mode_connects_to_the_router_with_a_topic() -> None:
    ctx = zmq.asyncio.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.setsockopt(zmq.SUBSCRIBE, b"probe")
        sub.bind("tcp://127.0.0.1:*")
        router = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        async with serving(kv_events_endpoint=router, kv_topic="kv@{address}@{model}") as (srv, session):
            assert srv.kv is not None and not srv.kv.bind  # no "*": vLLM connects
            assert srv.kv_events_endpoint == router
            topic = f"kv@{srv.address}@{MODEL}"
            assert srv.kv_topic == topic
            await synced_sub(srv, sub)
            await post(session, srv, "/v1/completions", {"prompt": list(range(2 * BS + 1)), "max_tokens": 1})
            (frames,) = await recv_batches(sub, 1)
            assert frames[0].decode() == topic and int.from_bytes(frames[1], "big") == 0
            (event,) = decode_batch(frames[2]).events
            assert isinstance(event, BlockStored) and event.token_ids == tuple(range(2 * BS))
    finally:
        ctx.destroy(linger=0)


async def test_a_kv_endpoint_that_cannot_be_bound_fails_start_cleanly() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        srv = SimulatedEngineServer(cfg(kv_events_endpoint=f"tcp://127.0.0.1:{port}", kv_events_mode="bind"))
        with pytest.raises(ValueError, match=f"KV events: cannot bind tcp://127.0.0.1:{port}"):
            await srv.start()
        assert not srv.runner.driver.running
        # Nothing is left behind: a server on the same settings but a free KV port starts and serves.
        async with serving(kv_events_endpoint="tcp://127.0.0.1:*") as (ok, session):
            assert (await post(session, ok, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1}))[0] == 200
    finally:
        taken.close()


# -- /metrics ------------------------------------------------------------------------------------


async def test_metrics_show_an_in_flight_request_to_the_epp_parser() -> None:
    engine = EngineConfig(num_gpu_blocks=256, block_size=BS, max_num_seqs=1)
    async with serving(engine=engine, time_scale=5.0) as (srv, session):

        async def scrape() -> Any:
            async with session.get(f"{srv.url}/metrics") as r:
                assert r.status == 200 and r.headers["content-type"].startswith("text/plain")
                return parse_metrics(await r.text(), observed_at=0.0)

        idle = await scrape()
        assert (idle.running, idle.waiting, idle.kv_usage) == (0, 0, 0.0)
        assert (idle.block_size, idle.num_gpu_blocks, idle.models) == (BS, 256, frozenset({MODEL}))
        body = {"prompt": list(range(3 * BS)), "max_tokens": 500}
        tasks = [asyncio.create_task(post(session, srv, "/v1/completions", body)) for _ in range(2)]
        try:
            await eventually(lambda: srv.runner.submitted == 2, "both requests in the engine")
            # The page shows the end of the engine's last step, as vLLM's: once a step has ended with both
            # in the engine, one runs and one queues (max_num_seqs=1), and the running one was looked up.
            pages: list[Any] = []

            async def both_seen() -> bool:
                pages.append(await scrape())
                return (pages[-1].running, pages[-1].waiting) == (1, 1)

            for _ in range(200):
                if await both_seen():
                    break
                await asyncio.sleep(0.01)
            busy = pages[-1]
            assert (busy.running, busy.waiting) == (1, 1)
            assert busy.kv_usage is not None and busy.kv_usage > 0
            assert busy.prefix_cache_queries == 3 * BS
            assert all(p.waiting <= 1 and p.running <= 1 for p in pages)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


# -- the command line ----------------------------------------------------------------------------


async def test_the_cli_serves_until_sigterm(tmp_path: pathlib.Path, tok_dir: pathlib.Path) -> None:
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "simulator.cli", "serve-engine", "--port", "0",
            "--port-file", str(port_file), "--served-model-name", MODEL, "--tokenizer", str(tok_dir),
            "--num-gpu-blocks", "128", "--kv-events-endpoint", "tcp://127.0.0.1:*",
        ],
        cwd=ROOT, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        await eventually(lambda: port_file.exists() or proc.poll() is not None, "the port file", timeout=60)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        port = int(port_file.read_text())
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert f"model '{MODEL}' on http://127.0.0.1:{port}" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_the_cli_refuses_a_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert sim_main(["serve-engine", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_the_cli_refuses_an_unusable_tokenizer(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sim_main(["serve-engine", "--port", "0", "--tokenizer", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json is missing" in err and str(tmp_path) in err


async def test_an_unusable_tokenizer_fails_start_before_any_socket(tmp_path: pathlib.Path) -> None:
    (tmp_path / "tokenizer.json").write_text("not json")
    port = free_port()
    srv = SimulatedEngineServer(cfg(port=port, tokenizer=tmp_path, kv_events_endpoint="tcp://127.0.0.1:*"))
    with pytest.raises(ValueError, match="not valid JSON"):
        await srv.start()
    assert not srv.runner.driver.running
    with socket.socket() as probe:  # the HTTP port was never taken
        probe.bind(("127.0.0.1", port))


# -- the production EPP in front of two simulated engines ----------------------------------------

HOSTS = ("127.0.0.2", "127.0.0.3")


@contextlib.asynccontextmanager
async def epp_cluster(tok_dir: pathlib.Path, mode: str) -> AsyncIterator[dict[str, Any]]:
    """Two engines on their own loopback addresses, the EPP (KV events per pod or central, the same
    tokenizer), and a real Envoy in front."""
    kv_port, replay_port = free_port(), free_port()
    central = f"tcp://127.0.0.1:{free_port()}" if mode == "central" else None
    engines = []
    for host in HOSTS:
        fields: dict[str, Any] = {"host": host, "port": free_port(), "tokenizer": tok_dir}
        fields["kv_replay_endpoint"] = f"tcp://{host}:{replay_port}"
        if central:  # engines connect to the EPP's bound SUB and name themselves in the topic
            fields.update(kv_events_endpoint=central, kv_topic="kv@{address}@{model}")
        else:  # per pod: every engine binds its own address, on the port the EPP connects to
            fields.update(kv_events_endpoint=f"tcp://{host}:{kv_port}", kv_events_mode="bind")
        engines.append(SimulatedEngineServer(cfg(**fields)))
    kv = KvEventsConfig(mode=mode, port=kv_port, replay_port=replay_port, sync_interval=0.05)
    if central:
        kv = replace(kv, bind=central)
    config = replace(default_config(), kv_events=kv, tokenizers={MODEL: str(tok_dir)})
    settings = ServerSettings.loopback(seed=5)
    addresses = [f"{e.config.host}:{e.config.port}" for e in engines]
    epp = EppServer(settings, config, [StaticEndpoint(a, MODEL) for a in addresses])
    envoy: EnvoyProcess | None = None
    first: list[Any] = list(engines)  # the harder order for central mode: engines connect before the bind
    then: list[Any] = [epp]
    started: list[Any] = []
    try:
        for part in (*first, *then):
            await part.start()
            started.append(part)
        envoy = EnvoyProcess(EnvoyConfig(epp_port=epp.grpc_port))
        await envoy.start()
        async with aiohttp.ClientSession() as session:
            await eventually(lambda: all(r.metrics is not None for r in epp.datastore.records()), "scraped")
            await eventually(
                lambda: all(e.kv_peers == 1 for e in engines), "every engine's PUB reaches the EPP"
            )
            yield {"epp": epp, "envoy": envoy, "engines": engines, "session": session}
    finally:
        if envoy is not None:
            await envoy.stop()
        if epp in started:
            await epp.stop(grace=0.2)
        for e in engines:
            if e in started:
                await e.stop()


@pytest.mark.parametrize("mode", ["per-pod", "central"])
async def test_the_epp_routes_a_repeated_prompt_to_the_engine_holding_it(
    tok_dir: pathlib.Path, mode: str
) -> None:
    async with epp_cluster(tok_dir, mode) as c:
        epp, engines, session = c["epp"], c["engines"], c["session"]
        messages = [
            {"role": "system", "content": "You answer questions about key-value caches, briefly. " * 12},
            {"role": "user", "content": "Which engine holds this conversation?"},
        ]
        body = {"model": MODEL, "messages": messages, "max_tokens": 4}

        async def chat() -> dict[str, Any]:
            async with session.post(f"{c['envoy'].url}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return dict(await r.json())

        first = await chat()
        prompt_tokens = first["usage"]["prompt_tokens"]
        assert prompt_tokens > 4 * BS and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        (holder,) = [e for e in engines if e.runner.submitted == 1]
        (other,) = [e for e in engines if e is not holder]
        blocks = (prompt_tokens + 4 - 1) // BS  # prompt and answer blocks the engine published
        await eventually(
            lambda: epp.kv_index.pod_counts(holder.address).get("gpu", 0) >= blocks,
            "the EPP indexed the blocks",
        )
        for i in range(3):
            doc = await chat()
            assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == cached(prompt_tokens), i
        assert (holder.runner.submitted, other.runner.submitted) == (4, 0)
        # The batches' timestamps are wall-clock epoch seconds, as vLLM's: the EPP sees no lag.
        assert epp.freshness.state(holder.address, epp.clock.now()) == FRESH


async def test_kv_peers_counts_every_subscriber_and_forgets_the_ones_that_leave() -> None:
    ctx = zmq.asyncio.Context()
    try:
        async with serving(kv_events_endpoint="tcp://127.0.0.1:*") as (srv, _):
            assert srv.kv_events_endpoint is not None
            subs = [ctx.socket(zmq.SUB) for _ in range(2)]
            for sub in subs:
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(srv.kv_events_endpoint)
            await eventually(lambda: srv.kv_peers == 2, "both subscribers counted")
            subs[0].close(linger=0)
            await eventually(lambda: srv.kv_peers == 1, "the closed subscriber forgotten")
            subs[1].close(linger=0)
            await eventually(lambda: srv.kv_peers == 0, "no subscriber left")
    finally:
        ctx.term()
