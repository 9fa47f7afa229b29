"""Long prompts are tokenized in a worker thread (`epp/server/tokenizing.py`) and reach the scorers with the
request; the event loop keeps running meanwhile, and the stream answers as it would inline."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.config import build_scheduler, parse_config
from epp.costmodel.service import SERVICE_KEY as COST_KEY
from epp.costmodel.service import CostModel
from epp.datastore import Datastore
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import block_keys, root_key
from epp.kvindex.prompt import PromptTokenizer, TokenizerRegistry
from epp.kvindex.service import SERVICE_KEY, KvIndexService
from epp.scheduling.builtin import default_registry
from epp.server.body_budget import BodyBudget
from epp.server.director import Director
from epp.server.ext_proc import RequestStream
from epp.server.metrics import EppMetrics
from epp.server.tokenizing import OFFLOAD_CHARS, PromptTokenizing
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


def test_long_text_and_chat_prompts_go_to_the_worker_short_ones_and_token_ids_do_not(tok_dir: Path) -> None:
    t = PromptTokenizing(service(tok_dir, max_chars=200_000))
    try:
        assert t.wanted(text(OFFLOAD_CHARS + 10))
        assert t.wanted(chat(generated_text(OFFLOAD_CHARS)))
        assert not t.wanted(text(OFFLOAD_CHARS // 4))
        assert not t.wanted(chat("short"))
        ids = InferenceRequest("r", ApiKind.COMPLETIONS, "m", prompt=list(range(OFFLOAD_CHARS)))
        assert not t.wanted(ids)
        assert not t.wanted(text(OFFLOAD_CHARS + 10, model="no-tokenizer"))
        assert not t.wanted(text(200_001))  # over the keying limit: not tokenized at all
        known = InferenceRequest("r", ApiKind.COMPLETIONS, "m", prompt="x" * 20_000, tokens=PromptTokens([1]))
        assert not t.wanted(known)
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
        assert t.wanted(chat("short"))  # the worker has work: short prompts go behind it
        short = asyncio.ensure_future(t.tokenize(chat("short")))
        # The loop opens the gate: it could not if the tokenizing held it.
        asyncio.get_running_loop().call_soon(gate.open.set)
        first, second = await asyncio.gather(long, short)
        assert first.tokens is not None and first.tokens.ids is not None
        assert second.tokens is not None and second.tokens.ids is not None
        assert all(name.startswith("epp-tokenize") for name in gate.threads)
        assert threading.current_thread().name not in gate.threads
        await asyncio.sleep(0)
        assert not t.busy and not t.wanted(chat("short"))
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
        assert t.busy and t.wanted(chat("short"))
        gate.open.set()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not t.busy:
                break
        assert not t.busy
    finally:
        t.close()


def _director(tok_dir: Path, tokenizing: bool, svc: Any = None) -> tuple[Director, KvIndexService]:
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
- type: precise-prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: precise-prefix-cache-scorer
  - pluginRef: max-score-picker
"""
    )
    sched = build_scheduler(
        config, default_registry(), clock, random.Random(0), services={SERVICE_KEY: kv, COST_KEY: cost}
    )
    worker = PromptTokenizing(svc or kv) if tokenizing else None
    return Director(ds, sched, EppMetrics(), clock, cost=cost, tokenizing=worker), kv


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
        assert t.wanted(bad)
        done = await t.tokenize(bad)
        assert done.tokens == PromptTokens(None, "tokenizer_error")
        assert svc.unkeyed == {}  # counted when a scorer reads them, on the loop
        assert svc.prompt_tokens_and_keys(done) == (None, None)
        assert svc.unkeyed == {("m", "tokenizer_error"): 1}
    finally:
        t.close()
