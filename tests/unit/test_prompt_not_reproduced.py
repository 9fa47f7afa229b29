"""Prompts whose ids vLLM computes in a way the EPP does not reproduce are routed unkeyed, with the reason,
instead of being keyed with ids no engine computes.

gpt-oss (vLLM 0.32, `vllm/renderers/online_renderer.py`): `OnlineRenderer.use_harmony` is
`hf_config.model_type == "gpt_oss"`; `render_chat` and `render_responses` then build Harmony messages and
render them with `openai_harmony` (`render_for_completion`), never the chat template; `render_completion`
tokenizes the prompt as for any model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.prompt import HARMONY, NotReproduced, TokenizerRegistry
from epp.kvindex.service import KvIndexService
from epp.requests import build_request
from epp.testing.tokenizer import build_tiny_tokenizer

CHAT = {":path": "/v1/chat/completions"}
RESP = {":path": "/v1/responses"}
CMPL = {":path": "/v1/completions"}
EMB = {":path": "/v1/embeddings"}
MSGS = [{"role": "user", "content": "Which pod holds this prompt's blocks?"}]
BS = 4


def _copy(tiny: Path, dst: Path, config: dict[str, Any] | None) -> Path:
    shutil.copytree(tiny, dst)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> KvIndexService:
    tiny = build_tiny_tokenizer(tmp_path_factory.mktemp("tiny"))
    root = tmp_path_factory.mktemp("models")
    paths = {
        "gpt-oss": _copy(tiny, root / "gpt-oss", {"model_type": "gpt_oss"}),
        "llama": _copy(tiny, root / "llama", {"model_type": "llama"}),
    }
    return KvIndexService(BlockIndex(BS, 1000), FreshnessTracker(), TokenizerRegistry(paths), BS)


def _tokens(svc: KvIndexService, headers: dict[str, str], body: dict[str, Any]) -> tuple[Any, str | None]:
    result = svc.tokenize(build_request(headers, body, {}))
    return result.ids, result.unkeyed


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        (CHAT, {"messages": MSGS}),
        (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}]}),
        (RESP, {"input": "Which pod holds this prompt's blocks?"}),
        (RESP, {"input": MSGS, "instructions": "Be brief."}),
    ],
)
def test_a_gpt_oss_chat_or_responses_request_is_unkeyed_as_harmony(
    svc: KvIndexService, headers: dict[str, str], body: dict[str, Any]
) -> None:
    assert _tokens(svc, headers, {"model": "gpt-oss", **body}) == (None, HARMONY)
    # the same request to a model vLLM renders with its template is keyed
    ids, reason = _tokens(svc, headers, {"model": "llama", **body})
    assert reason is None and ids is not None and len(ids) > 0


def test_a_harmony_chat_is_counted_under_its_reason_and_gets_no_keys(svc: KvIndexService) -> None:
    request = build_request(CHAT, {"model": "gpt-oss", "messages": MSGS}, {})
    before = svc.unkeyed[("gpt-oss", HARMONY)]
    assert svc.prompt_tokens_and_keys(request) == (None, None)
    assert svc.unkeyed[("gpt-oss", HARMONY)] == before + 1


def test_a_harmony_chat_is_not_sent_to_the_tokenizing_worker(svc: KvIndexService) -> None:
    # the worker would render it for nothing
    request = build_request(CHAT, {"model": "gpt-oss", "messages": MSGS}, {})
    assert svc.tokenizing_chars(request) == 0
    assert svc.tokenizing_chars(build_request(CHAT, {"model": "llama", "messages": MSGS}, {})) > 0


def test_a_long_harmony_chat_reports_harmony_not_too_long(svc: KvIndexService) -> None:
    long = [{"role": "user", "content": "x" * (svc.max_keyed_prompt_chars + 1)}]
    assert _tokens(svc, CHAT, {"model": "gpt-oss", "messages": long}) == (None, HARMONY)


def test_a_gpt_oss_completion_is_tokenized_as_usual(svc: KvIndexService) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids, reason = _tokens(svc, CMPL, {"model": "gpt-oss", "prompt": text})
    tok = svc.tokenizers.get("gpt-oss")
    assert tok is not None and reason is None
    assert [int(i) for i in ids] == tok.encode_uncached(text, add_special_tokens=True)


def test_a_gpt_oss_embeddings_chat_is_rendered_with_the_template(svc: KvIndexService) -> None:
    # vLLM's pooling path renders chats with the template: no Harmony there
    ids, reason = _tokens(svc, EMB, {"model": "gpt-oss", "messages": MSGS})
    llama_ids, _ = _tokens(svc, EMB, {"model": "llama", "messages": MSGS})
    assert reason is None and [int(i) for i in ids] == [int(i) for i in llama_ids]


def test_encode_request_refuses_a_harmony_chat_with_its_reason(svc: KvIndexService) -> None:
    tok = svc.tokenizers.get("gpt-oss")
    assert tok is not None
    with pytest.raises(NotReproduced) as err:
        tok.encode_request(build_request(CHAT, {"model": "gpt-oss", "messages": MSGS}, {}))
    assert err.value.reason == HARMONY and "gpt-oss" in str(err.value)
