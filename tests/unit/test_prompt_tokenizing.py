"""Long prompts are tokenized in a worker thread (`epp/server/tokenizing.py`) and reach the scorers with the
request; the event loop keeps running meanwhile, and the stream answers as it would inline."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.config import DEFAULT_CONFIG_YAML, EppConfig, build_scheduler, parse_config
from epp.costmodel.service import SERVICE_KEY as COST_KEY
from epp.costmodel.service import CostModel
from epp.datastore import Datastore
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import block_keys, root_key
from epp.kvindex.prompt import PromptTokenizer, TokenizerRegistry
from epp.kvindex.service import SERVICE_KEY, KvIndexService
from epp.scheduling.builtin import default_registry
from epp.server.app import EppServer, ServerSettings
from epp.server.body_budget import BodyBudget
from epp.server.director import Director, ParsedRequest
from epp.server.ext_proc import RequestStream
from epp.server.metrics import EppMetrics
from epp.server.tokenizing import BUSY, OFFLOAD_CHARS, PromptTokenizing
from epp.testing.fakes import FakeClock
from epp.testing.tokenizer import build_tiny_tokenizer, generated_text
from epp.types import ApiKind, ChatOptions, InferenceRequest, MetricsSnapshot, PromptTokens

from .test_ext_proc_stream import BUFFERED, DUPLEX, body, destination, headers

BS = 16
PODS = ["10.0.0.0:80", "10.0.0.1:80", "10.0.0.2:80"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def service(tok_dir: Path, max_chars: int = 524_288) -> KvIndexService:
    return KvIndexService(
        BlockIndex(block_size=BS, max_entries=100_000),
        FreshnessTracker(),
        TokenizerRegistry({"m": tok_dir}),
        BS,
        max_keyed_prompt_chars=max_chars,
    )


def chat(content: str) -> InferenceRequest:
    msgs = [{"role": "system", "content": content}, {"role": "user", "content": "which pod?"}]
    return InferenceRequest("r", ApiKind.CHAT_COMPLETIONS, "m", messages=msgs, body_bytes=len(content) + 80)


def text(chars: int, model: str = "m") -> InferenceRequest:
    return InferenceRequest("r", ApiKind.COMPLETIONS, model, prompt=generated_text(chars))


def to_worker(t: PromptTokenizing, request: InferenceRequest) -> bool:
    return t.plan(request) is None


def test_long_text_and_chat_prompts_go_to_the_worker_short_ones_and_token_ids_do_not(tok_dir: Path) -> None:
    t = PromptTokenizing(service(tok_dir, max_chars=200_000))
    try:
        assert to_worker(t, text(OFFLOAD_CHARS + 10))
        assert to_worker(t, chat(generated_text(OFFLOAD_CHARS)))
        assert not to_worker(t, text(OFFLOAD_CHARS // 4))
        assert not to_worker(t, chat("short"))
        ids = InferenceRequest("r", ApiKind.COMPLETIONS, "m", prompt=list(range(OFFLOAD_CHARS)))
        assert not to_worker(t, ids)
        assert not to_worker(t, text(OFFLOAD_CHARS + 10, model="no-tokenizer"))
        assert not to_worker(t, text(200_001))  # over the keying limit: not tokenized at all
        known = InferenceRequest("r", ApiKind.COMPLETIONS, "m", prompt="x" * 20_000, tokens=PromptTokens([1]))
        assert not to_worker(t, known)
    finally:
        t.close()


def test_a_short_chat_with_tools_or_documents_goes_to_the_worker(tok_dir: Path) -> None:
    """A template may render tools' and documents' JSON at many times the body's size (`tojson(indent=4)` of
    nested schemas): such a chat is tokenized in the worker however short its body, not on the loop."""
    t = PromptTokenizing(service(tok_dir))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    try:
        plain = chat("short")
        assert not to_worker(t, plain)
        for options in (ChatOptions(tools=[tool]), ChatOptions(documents=[{"text": "d"}])):
            assert to_worker(t, dataclasses.replace(plain, chat=options))
        assert not to_worker(t, dataclasses.replace(plain, chat=ChatOptions(tools=[])))  # (no JSON to render)
        # the same JSON passed in chat_template_kwargs (templates read `tools` there alike): the worker too
        via_kwargs = ChatOptions(chat_template_kwargs={"tools": [tool]})
        assert to_worker(t, dataclasses.replace(plain, chat=via_kwargs))
        flags = ChatOptions(chat_template_kwargs={"enable_thinking": False})  # scalars: nothing to render
        assert not to_worker(t, dataclasses.replace(plain, chat=flags))
    finally:
        t.close()


async def test_the_worker_gives_the_ids_the_loop_would_and_the_scorers_use_them(tok_dir: Path) -> None:
    svc = service(tok_dir)
    t = PromptTokenizing(svc)
    try:
        request = chat(generated_text(3 * OFFLOAD_CHARS))
        done = await t.tokenize(request)
        assert done.tokens is not None and done.tokens.unkeyed is None
        inline = svc.prompt_tokens(request)
        assert inline is not None and done.tokens.ids is not None and list(done.tokens.ids) == list(inline)
        n, keys = svc.prompt_tokens_and_keys(done)
        assert n == len(inline)
        assert keys is not None and keys.tolist() == block_keys(inline, BS, root_key("m", None)).tolist()
        assert t.offloaded == 1 and not t.busy
    finally:
        t.close()


def test_the_tokenizers_long_calls_give_the_same_ids_as_one_encode_call(tok_dir: Path) -> None:
    """Long texts are encoded by the batch call (it lets go of the GIL); the ids are `encode`'s."""
    tok = PromptTokenizer.from_dir(tok_dir)
    for chars in (100, 9_000, 40_000):
        s = generated_text(chars, seed=chars)
        for add in (False, True):
            assert tok.encode_text(s, add_special_tokens=add).tolist() == tok.encode_uncached(
                s, add_special_tokens=add
            )


class Gate:
    """A service whose tokenize waits until the test opens the gate: proves where it runs."""

    def __init__(self, inner: KvIndexService) -> None:
        self.inner = inner
        self.open = threading.Event()
        self.threads: list[str] = []
        self.fail = False

    def tokenize(self, request: InferenceRequest) -> PromptTokens:
        self.threads.append(threading.current_thread().name)
        if not self.open.wait(10):
            raise AssertionError("the gate was never opened: the event loop was blocked")
        if self.fail:
            raise RuntimeError("tokenizer blew up")
        return self.inner.tokenize(request)

    def tokenizing_chars(self, request: InferenceRequest) -> int:
        return self.inner.tokenizing_chars(request)


async def test_the_loop_runs_while_the_worker_tokenizes_and_short_prompts_queue_behind(tok_dir: Path) -> None:
    gate = Gate(service(tok_dir))
    t = PromptTokenizing(gate)  # type: ignore[arg-type]
    try:
        long = asyncio.ensure_future(t.tokenize(chat(generated_text(2 * OFFLOAD_CHARS))))
        await asyncio.sleep(0)
        assert t.busy
        assert to_worker(t, chat("short"))  # the worker has work: short prompts go behind it
        empty = InferenceRequest("r", ApiKind.COMPLETIONS, "m", prompt="")
        assert to_worker(t, empty)  # ("" goes through the tokenizer, and its lock, too)
        short = asyncio.ensure_future(t.tokenize(chat("short")))
        # The loop opens the gate: it could not if the tokenizing held it.
        asyncio.get_running_loop().call_soon(gate.open.set)
        first, second = await asyncio.gather(long, short)
        assert first.tokens is not None and first.tokens.ids is not None
        assert second.tokens is not None and second.tokens.ids is not None
        assert all(name.startswith("epp-tokenize") for name in gate.threads)
        assert threading.current_thread().name not in gate.threads
        await asyncio.sleep(0)
        assert not t.busy and not to_worker(t, chat("short"))
    finally:
        t.close()


async def test_a_stream_gone_while_its_prompt_is_tokenized_keeps_the_worker_busy_until_it_ends(
    tok_dir: Path,
) -> None:
    gate = Gate(service(tok_dir))
    t = PromptTokenizing(gate)  # type: ignore[arg-type]
    try:
        job = asyncio.ensure_future(t.tokenize(chat(generated_text(2 * OFFLOAD_CHARS))))
        await asyncio.sleep(0)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        # The thread still works on it: the loop must not tokenize beside it.
        assert t.busy and to_worker(t, chat("short"))
        gate.open.set()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not t.busy:
                break
        assert not t.busy
    finally:
        t.close()


def _director(
    tok_dir: Path, tokenizing: bool, svc: Any = None, worker_args: dict[str, int] | None = None
) -> tuple[Director, KvIndexService]:
    """Three pods, a precise prefix scorer behind the metrics-staleness filter (2 s)."""
    clock = FakeClock()
    ds = Datastore(clock)
    for pod in PODS:
        ds.add_endpoint(pod, "m")
        ds.record_metrics(pod, MetricsSnapshot(observed_at=clock.now()))
    kv = service(tok_dir)
    cost = CostModel()
    config = parse_config(
        """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: metrics-staleness-filter
- type: precise-prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: metrics-staleness-filter
  - pluginRef: precise-prefix-cache-scorer
  - pluginRef: max-score-picker
"""
    )
    sched = build_scheduler(
        config, default_registry(), clock, random.Random(0), services={SERVICE_KEY: kv, COST_KEY: cost}
    )
    worker = PromptTokenizing(svc or kv, **(worker_args or {})) if tokenizing else None
    return Director(ds, sched, EppMetrics(), clock, {"batch": -1}, cost=cost, tokenizing=worker), kv


async def drive(stream: RequestStream, msgs: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    """What `ExtProcService.Process` does with a stream's messages."""
    out: list[pb.ProcessingResponse] = []
    for msg in msgs:
        out.extend(stream.on_message(msg))
        if stream.pending is not None:
            out.extend(await stream.resume())
    return out


@pytest.mark.parametrize("mode", [DUPLEX, BUFFERED])
async def test_a_long_chat_prompt_is_routed_to_its_holder_after_the_worker_tokenized_it(
    tok_dir: Path, mode: int
) -> None:
    content = generated_text(3 * OFFLOAD_CHARS)
    messages = [{"role": "system", "content": content}, {"role": "user", "content": "which pod?"}]
    payload = json.dumps({"model": "m", "messages": messages}).encode()
    answers = {}
    for tokenizing in (True, False):
        d, kv = _director(tok_dir, tokenizing)
        ids = PromptTokenizer.from_dir(tok_dir).encode_chat(messages)
        n = len(ids) // BS
        kv.index.store(PODS[2], list(range(1, n + 1)), None, ids[: n * BS], BS, "gpu", root_key("m", None))
        kv.freshness.message(PODS[2], 0.0)
        stream = RequestStream(d, 1 << 24)
        out = await drive(stream, [headers(mode=mode), body(payload, True)])
        answers[tokenizing] = [destination(out[0] if mode == DUPLEX else out[-1])]
        assert answers[tokenizing] == [PODS[2]]
        if mode == DUPLEX:  # the body follows the routing answer, whole
            echoed = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in out[1:])
            assert echoed == payload
        if d.tokenizing is not None:
            assert d.tokenizing.offloaded == 1
            d.tokenizing.close()
    assert answers[True] == answers[False]


async def test_trailers_are_answered_after_the_routing_answer(tok_dir: Path) -> None:
    d, _ = _director(tok_dir, True)
    payload = json.dumps({"model": "m", "prompt": generated_text(2 * OFFLOAD_CHARS)}).encode()
    stream = RequestStream(d, 1 << 24)
    out = await drive(
        stream,
        [
            headers(path=b"/v1/completions"),
            body(payload, False),
            pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
        ],
    )
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds[0] == "request_headers" and kinds[-1] == "request_trailers"
    assert stream.routed is not None
    assert d.tokenizing is not None
    d.tokenizing.close()


async def test_a_tokenizer_failure_in_the_worker_is_a_500_and_the_body_budget_comes_back(
    tok_dir: Path,
) -> None:
    gate = Gate(service(tok_dir))
    gate.fail = True
    gate.open.set()
    d, _ = _director(tok_dir, True, svc=gate)
    budget = BodyBudget(1 << 24)
    payload = json.dumps({"model": "m", "prompt": generated_text(2 * OFFLOAD_CHARS)}).encode()
    stream = RequestStream(d, 1 << 24, budget)
    out = await drive(stream, [headers(path=b"/v1/completions"), body(payload, True)])
    assert [r.immediate_response.status.code for r in out] == [500]
    assert stream.done and stream.routed is None
    assert budget.held == 0
    # The next request is served: nothing was left behind.
    gate.fail = False
    stream = RequestStream(d, 1 << 24, budget)
    out = await drive(stream, [headers(path=b"/v1/completions"), body(payload, True)])
    assert stream.routed is not None
    assert d.tokenizing is not None
    d.tokenizing.close()


async def test_a_prompt_the_worker_cannot_tokenize_is_counted_once_by_the_scorer_and_routed(
    tok_dir: Path,
) -> None:
    svc = service(tok_dir)
    t = PromptTokenizing(svc)
    try:
        msgs = [{"role": "user", "content": generated_text(OFFLOAD_CHARS)}]
        bad = InferenceRequest(  # continue_final_message with add_generation_prompt: the template refuses
            "r", ApiKind.CHAT_COMPLETIONS, "m", messages=msgs,
            chat=ChatOptions(continue_final_message=True), body_bytes=OFFLOAD_CHARS + 50,
        )  # fmt: skip
        assert to_worker(t, bad)
        done = await t.tokenize(bad)
        assert done.tokens == PromptTokens(None, "tokenizer_error")
        assert svc.unkeyed == {}  # counted when a scorer reads them, on the loop
        assert svc.prompt_tokens_and_keys(done) == (None, None)
        assert svc.unkeyed == {("m", "tokenizer_error"): 1}
    finally:
        t.close()


def completions_headers(*extra: tuple[str, str]) -> pb.ProcessingRequest:
    msg = headers(path=b"/v1/completions")
    for key, value in extra:
        msg.request_headers.headers.headers.add(key=key, raw_value=value.encode())
    return msg


async def test_requests_refused_anyway_are_refused_before_their_prompt_is_tokenized(tok_dir: Path) -> None:
    d, _ = _director(tok_dir, True)
    assert d.tokenizing is not None
    for pod in PODS:  # every pod saturated: a sheddable request is refused (429)
        d.datastore.record_metrics(pod, MetricsSnapshot(observed_at=d.clock.now(), waiting=100))
    payload = json.dumps({"model": "m", "prompt": generated_text(4 * OFFLOAD_CHARS)}).encode()
    stream = RequestStream(d, 1 << 24)
    out = await drive(
        stream, [completions_headers(("x-gateway-inference-objective", "batch")), body(payload, True)]
    )
    assert [r.immediate_response.status.code for r in out] == [429]
    subset = headers(path=b"/v1/completions", subset=["10.9.9.9:80"])  # no such endpoint: 503
    out = await drive(RequestStream(d, 1 << 24), [subset, body(payload, True)])
    assert [r.immediate_response.status.code for r in out] == [503]
    for pod in PODS:  # not sheddable, but every pod's metrics too old for the staleness filter: 429
        d.datastore.record_metrics(pod, MetricsSnapshot(observed_at=d.clock.now() - 60))
    out = await drive(RequestStream(d, 1 << 24), [completions_headers(), body(payload, True)])
    assert [r.immediate_response.status.code for r in out] == [429]
    assert d.tokenizing.offloaded == 0 and not d.tokenizing.busy
    for pod in PODS:
        d.datastore.record_metrics(pod, MetricsSnapshot(observed_at=d.clock.now(), waiting=100))
    # The same prompt, not sheddable, is tokenized in the worker and routed.
    stream = RequestStream(d, 1 << 24)
    await drive(stream, [completions_headers(), body(payload, True)])
    assert stream.routed is not None and d.tokenizing.offloaded == 1
    d.tokenizing.close()


async def test_past_the_queue_limit_a_prompt_is_routed_at_once_without_cache_credit(tok_dir: Path) -> None:
    gate = Gate(service(tok_dir))
    limit = 3 * OFFLOAD_CHARS
    d, kv = _director(tok_dir, True, svc=gate, worker_args={"max_queued_chars": limit})
    t = d.tokenizing
    assert t is not None
    first = asyncio.ensure_future(t.tokenize(text(2 * OFFLOAD_CHARS)))
    await asyncio.sleep(0)
    assert to_worker(t, text(OFFLOAD_CHARS // 2))  # fits in the queue
    over = t.plan(text(2 * OFFLOAD_CHARS))  # would pass the limit
    assert over is not None and over.tokens == BUSY
    # Routed by load, at once, and counted as unkeyed once.
    payload = json.dumps({"model": "m", "prompt": generated_text(2 * OFFLOAD_CHARS)}).encode()
    stream = RequestStream(d, 1 << 24)
    out = await drive(stream, [completions_headers(), body(payload, True)])
    assert stream.routed is not None and len(out) >= 2
    assert kv.unkeyed == {("m", "tokenizer_busy"): 1}
    gate.open.set()
    await first
    t.close()


async def test_the_scorers_use_the_workers_ids_and_the_routed_request_does_not_keep_them(
    tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, kv = _director(tok_dir, True)
    assert d.tokenizing is not None
    messages = [
        {"role": "system", "content": generated_text(2 * OFFLOAD_CHARS)},
        {"role": "user", "content": "?"},
    ]
    ids = PromptTokenizer.from_dir(tok_dir).encode_chat(messages)
    n = len(ids) // BS
    kv.index.store(PODS[1], list(range(1, n + 1)), None, ids[: n * BS], BS, "gpu", root_key("m", None))
    kv.freshness.message(PODS[1], 0.0)
    parsed = d.parse(
        {":path": "/v1/chat/completions"}, json.dumps({"model": "m", "messages": messages}).encode()
    )
    request = await d.tokenizing.tokenize(parsed.request)

    def on_the_loop(*args: object, **kwargs: object) -> None:
        raise AssertionError("tokenized again on the event loop")

    monkeypatch.setattr(PromptTokenizer, "encode_chat", on_the_loop)
    monkeypatch.setattr(PromptTokenizer, "encode_text", on_the_loop)
    routed = d.route_parsed(ParsedRequest(request, None))
    assert routed.decision.primary == PODS[1]
    # scheduled: the prompt is not kept for the response's lifetime (the model and counts are)
    assert routed.request.tokens is None and routed.request.messages is None
    assert routed.request.model == "m" and routed.request.prompt_tokens_estimate > 0
    d.tokenizing.close()


class Spy:
    """Forwards to a `tokenizers.Tokenizer`, recording which methods were called."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if callable(attr):

            def call(*args: Any, **kwargs: Any) -> Any:
                self.calls.append(name)
                return attr(*args, **kwargs)

            return call
        return attr


def test_long_texts_are_encoded_by_the_call_that_lets_go_of_the_gil(tok_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(tok_dir)
    spy = Spy(tok._tok)
    tok._tok = spy  # type: ignore[assignment]
    s = generated_text(40_000, seed=3)
    assert (
        tok.encode_uncached(s, add_special_tokens=False) == spy.inner.encode(s, add_special_tokens=False).ids
    )
    spy.calls.clear()
    got = tok.encode_text(s, add_special_tokens=False)
    assert got.tolist() == spy.inner.encode(s, add_special_tokens=False).ids
    assert "encode_batch_fast" in spy.calls and "encode" not in spy.calls, spy.calls


def test_one_tokenizer_used_from_several_threads_gives_each_the_ids_of_one_call(tok_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(tok_dir, chunk_chars=256)
    shared = generated_text(30_000, seed=9)
    texts = [shared + generated_text(3_000, seed=100 + i) for i in range(16)]
    expected = [tok.encode_uncached(x, add_special_tokens=False) for x in texts]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(3):
                got[i] = tok.encode_text(texts[i], add_special_tokens=False).tolist()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(texts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert [got[i] for i in range(len(texts))] == expected
    assert tok.cache_stats()["unstable"] == 0


def config(scorer: str, tokenizers: str = "") -> EppConfig:
    text = (
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        f"plugins: [{{type: {scorer}}}, {{type: max-score-picker}}]\n"
        "schedulingProfiles: [{name: d, plugins: "
        f"[{{pluginRef: {scorer}}}, {{pluginRef: max-score-picker}}]}}]\n"
    )
    return parse_config(text + tokenizers, "test.yaml")


def test_the_server_tokenizes_ahead_only_when_a_plugin_reads_prompts(tok_dir: Path) -> None:
    settings = ServerSettings.loopback(refresh_metrics_interval=0)
    tokenizers = f"tokenizers: {{m: '{tok_dir}'}}\n"
    plain = EppServer(settings, config("queue-scorer", tokenizers))
    assert plain.kv.prompt_readers == set() and plain.tokenizing is None
    reads = EppServer(settings, config("precise-prefix-cache-scorer", tokenizers))
    assert reads.kv.prompt_readers == {"precise-prefix-cache-scorer"} and reads.tokenizing is not None
    reads.tokenizing.close()
    assert EppServer(settings, config("precise-prefix-cache-scorer")).tokenizing is None  # no tokenizer
    default = EppServer(settings, parse_config(DEFAULT_CONFIG_YAML + tokenizers, "default.yaml"))
    assert default.kv.prompt_readers == {"ttft-scorer"} and default.tokenizing is not None
    default.tokenizing.close()


async def test_an_unexpected_error_before_tokenizing_is_a_500_and_the_body_budget_comes_back(
    tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, _ = _director(tok_dir, True)
    assert d.tokenizing is not None

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("saturation detector blew up")

    monkeypatch.setattr(d.scheduler, "precheck", broken)
    budget = BodyBudget(1 << 24)
    payload = json.dumps({"model": "m", "prompt": generated_text(2 * OFFLOAD_CHARS)}).encode()
    stream = RequestStream(d, 1 << 24, budget)
    out = await drive(stream, [completions_headers(), body(payload, True)])
    assert [r.immediate_response.status.code for r in out] == [500]
    assert budget.held == 0 and d.tokenizing.offloaded == 0
    d.tokenizing.close()


async def test_a_job_dropped_before_it_ran_is_not_counted_as_tokenized(tok_dir: Path) -> None:
    gate = Gate(service(tok_dir))
    t = PromptTokenizing(gate)  # type: ignore[arg-type]
    try:
        running = asyncio.ensure_future(t.tokenize(text(2 * OFFLOAD_CHARS)))
        queued = asyncio.ensure_future(t.tokenize(text(2 * OFFLOAD_CHARS)))
        await asyncio.sleep(0)
        assert t.queued_chars > 0
        queued.cancel()  # the client went away while its prompt waited
        with pytest.raises(asyncio.CancelledError):
            await queued
        gate.open.set()
        await running
        await asyncio.sleep(0)
        assert (t.offloaded, t.queued_chars, t.busy) == (1, 0, False)
        assert len(gate.threads) == 1
    finally:
        t.close()


def test_a_reader_no_profile_uses_does_not_make_the_server_tokenize_ahead(tok_dir: Path) -> None:
    text = (
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins: [{type: ttft-scorer}, {type: queue-scorer}, {type: max-score-picker}]\n"
        "schedulingProfiles: [{name: d, plugins: "
        "[{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]}]\n"
        f"tokenizers: {{m: '{tok_dir}'}}\n"
    )
    server = EppServer(ServerSettings.loopback(refresh_metrics_interval=0), parse_config(text, "t.yaml"))
    assert server.kv.prompt_readers == set() and server.tokenizing is None


async def test_after_close_the_worker_refuses_work_and_a_stream_gets_a_500(tok_dir: Path) -> None:
    d, _ = _director(tok_dir, True)
    assert d.tokenizing is not None
    d.tokenizing.close()
    with pytest.raises(RuntimeError):
        await d.tokenizing.tokenize(text(2 * OFFLOAD_CHARS))
    assert not d.tokenizing.busy  # nothing was counted
    budget = BodyBudget(1 << 24)
    payload = json.dumps({"model": "m", "prompt": generated_text(2 * OFFLOAD_CHARS)}).encode()
    out = await drive(RequestStream(d, 1 << 24, budget), [completions_headers(), body(payload, True)])
    assert [r.immediate_response.status.code for r in out] == [500] and budget.held == 0
