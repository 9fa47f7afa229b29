"""`truncate_prompt_tokens` and `truncation_side`: the ids vLLM keeps, keyed as the engine keys them.

vLLM (vllm/renderers/params.py, `TokenizeParams`; the fields in
vllm/entrypoints/openai/completion/protocol.py, chat_completion/protocol.py and
vllm/entrypoints/pooling/base/protocol.py): a text or chat prompt is encoded
with the tokenizer's truncation (`get_encode_kwargs`: `truncation=True, max_length=N`: the budget leaves room
for the post-processor's special tokens), then every prompt, token ids too, is cut to N ids
(`_token_truncation`): the last N ("left", the tokenizer's side for a generating model) or the first N
("right": a pooling model's, so embeddings'), or the request's `truncation_side`. -1 is the model's length
less the output tokens, which the EPP does not know: unkeyed ("prompt_truncation").
"""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer

from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.prompt import PROMPT_TRUNCATION, PromptTokenizer, TokenizerRegistry
from epp.kvindex.service import KvIndexService
from epp.requests import RequestError, build_request
from epp.testing.tokenizer import build_tiny_tokenizer

CMPL = {":path": "/v1/completions"}
CHAT = {":path": "/v1/chat/completions"}
EMB = {":path": "/v1/embeddings"}
RESP = {":path": "/v1/responses"}
BS = 4
TEXT = "The quick brown fox jumps over the lazy dog, and then the dog wakes up and chases the fox."
MSGS = [{"role": "user", "content": TEXT}]


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> KvIndexService:
    tiny = build_tiny_tokenizer(tmp_path_factory.mktemp("tiny"))
    return KvIndexService(BlockIndex(BS, 1000), FreshnessTracker(), TokenizerRegistry({"m": tiny}), BS)


def _tok(svc: KvIndexService) -> PromptTokenizer:
    tok = svc.tokenizers.get("m")
    assert tok is not None
    return tok


def ids(svc: KvIndexService, headers: dict[str, str], body: dict[str, Any]) -> list[int] | None:
    tokens = svc.tokenize(build_request(headers, {"model": "m", **body}, {}))
    return None if tokens.ids is None else [int(i) for i in tokens.ids]


def hf_truncated(tok: PromptTokenizer, text: str, count: int, side: str, *, special: bool) -> list[int]:
    """What vLLM computes: the tokenizer's own truncation (a copy of the EPP's, with `max_length`), then the
    cut to `count` ids."""
    hf = Tokenizer.from_str(tok._tok.to_str())
    hf.enable_truncation(max_length=count, direction=side)
    encoded: list[int] = hf.encode(text, add_special_tokens=special).ids
    if count >= len(encoded):
        return encoded
    return [] if count == 0 else encoded[-count:] if side == "left" else encoded[:count]


def test_token_id_prompts_keep_the_last_ids_or_the_first_for_embeddings(svc: KvIndexService) -> None:
    prompt = list(range(10, 30))
    assert ids(svc, CMPL, {"prompt": prompt, "truncate_prompt_tokens": 6}) == prompt[-6:]
    assert (
        ids(svc, CMPL, {"prompt": prompt, "truncate_prompt_tokens": 6, "truncation_side": "right"})
        == prompt[:6]
    )
    assert (
        ids(svc, EMB, {"input": prompt, "truncate_prompt_tokens": 6}) == prompt[:6]
    )  # a pooling model's side
    assert (
        ids(svc, EMB, {"input": prompt, "truncate_prompt_tokens": 6, "truncation_side": "left"})
        == prompt[-6:]
    )
    assert ids(svc, CMPL, {"prompt": prompt, "truncate_prompt_tokens": 20}) == prompt
    assert ids(svc, CMPL, {"prompt": prompt, "truncate_prompt_tokens": 99}) == prompt
    assert ids(svc, CMPL, {"prompt": prompt, "truncate_prompt_tokens": 0}) == []
    assert ids(svc, CMPL, {"prompt": prompt, "truncate_prompt_tokens": None}) == prompt


@pytest.mark.parametrize("count", [0, 1, 2, 5, 8, 13, 200])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("special", [True, False])
def test_text_prompts_are_truncated_as_the_tokenizer_truncates_them(
    svc: KvIndexService, count: int, side: str, special: bool
) -> None:
    """With special tokens the bos stays and the text's own tokens are cut (the tokenizer's budget leaves
    room for it); the result is then cut to `count` ids."""
    tok = _tok(svc)
    body = {
        "prompt": TEXT,
        "truncate_prompt_tokens": count,
        "truncation_side": side,
        "add_special_tokens": special,
    }
    expected = hf_truncated(tok, TEXT, count, side, special=special)
    assert ids(svc, CMPL, body) == expected
    full = tok.encode_uncached(TEXT, add_special_tokens=special)
    assert count >= len(full) or expected != full  # (the case truncates)


def test_a_text_prompt_keeps_its_bos_under_left_truncation(svc: KvIndexService) -> None:
    full = _tok(svc).encode_uncached(TEXT, add_special_tokens=True)
    assert ids(svc, CMPL, {"prompt": TEXT, "truncate_prompt_tokens": 7}) == [full[0], *full[-6:]]


@pytest.mark.parametrize("count", [3, 9, 17])
def test_chat_prompts_keep_the_last_ids_of_the_rendered_chat(svc: KvIndexService, count: int) -> None:
    tok = _tok(svc)
    text = tok.render_chat(MSGS)
    assert ids(svc, CHAT, {"messages": MSGS, "truncate_prompt_tokens": count}) == hf_truncated(
        tok, text, count, "left", special=False
    )
    embedded = tok.render_chat(MSGS, add_generation_prompt=False)
    assert ids(svc, EMB, {"messages": MSGS, "truncate_prompt_tokens": count}) == hf_truncated(
        tok, embedded, count, "right", special=False
    )


def test_the_keys_are_those_of_the_kept_ids(svc: KvIndexService) -> None:
    prompt = list(range(100, 140))
    kept = build_request(CMPL, {"model": "m", "prompt": prompt, "truncate_prompt_tokens": 10}, {})
    given = build_request(CMPL, {"model": "m", "prompt": prompt[-10:]}, {})
    count, keys = svc.prompt_tokens_and_keys(kept)
    assert count == 10 and keys is not None
    assert keys.tolist() == svc.prompt_keys(given).tolist()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        (CMPL, {"prompt": TEXT}),
        (CMPL, {"prompt": [1, 2, 3, 4, 5]}),
        (CHAT, {"messages": MSGS}),
        (EMB, {"input": TEXT}),
    ],
)
def test_minus_one_is_the_models_length_so_the_prompt_is_unkeyed(
    svc: KvIndexService, headers: dict[str, str], body: dict[str, Any]
) -> None:
    """-1 keeps max_model_len - max_tokens ids: the EPP does not know the model's length."""
    request = build_request(headers, {"model": "m", **body, "truncate_prompt_tokens": -1}, {})
    before = svc.unkeyed[("m", PROMPT_TRUNCATION)]
    assert svc.tokenize(request).unkeyed == PROMPT_TRUNCATION
    assert svc.prompt_tokens(request) is None
    assert svc.unkeyed[("m", PROMPT_TRUNCATION)] == before + 1
    assert svc.tokenizing_chars(request) == 0  # not tokenized at all


@pytest.mark.parametrize(
    ("value", "kept"),
    [(5, 5), ("5", 5), (" 5 ", 5), (5.0, 5), ("5.0", 5), (True, 1), ("1_0", 10), ("-1", -1)],
)
def test_truncate_prompt_tokens_is_read_as_pydantic_reads_an_integer(value: Any, kept: int) -> None:
    r = build_request(CMPL, {"model": "m", "prompt": "x", "truncate_prompt_tokens": value}, {})
    assert r.truncate_prompt_tokens == kept


@pytest.mark.parametrize("value", [-2, 1.5, "x", "1e3", "", [], {}, 2**63])
@pytest.mark.parametrize("headers", [CMPL, CHAT, EMB])
def test_a_bad_truncate_prompt_tokens_is_a_400(headers: dict[str, str], value: Any) -> None:
    body = {"model": "m", "prompt": "x", "messages": MSGS, "input": "x", "truncate_prompt_tokens": value}
    with pytest.raises(RequestError) as err:
        build_request(headers, body, {})
    assert (
        err.value.status == 400 and "'truncate_prompt_tokens' must be an integer >= -1" in err.value.message
    )


@pytest.mark.parametrize("value", ["LEFT", "middle", 1, True, ""])
def test_a_bad_truncation_side_is_a_400(value: Any) -> None:
    with pytest.raises(RequestError, match='\'truncation_side\' must be "left" or "right"'):
        build_request(CMPL, {"model": "m", "prompt": "x", "truncation_side": value}, {})
    assert (
        build_request(CMPL, {"model": "m", "prompt": "x", "truncation_side": None}, {}).truncation_side
        is None
    )


def test_responses_truncation_is_checked_and_keys_the_whole_conversation(svc: KvIndexService) -> None:
    """vLLM's ResponsesRequest: `truncation` is "auto" or "disabled" (default); "auto" drops the oldest
    messages only from a conversation longer than the model's context, which "disabled" refuses: a request
    that runs at all runs with its whole conversation. It has no truncate_prompt_tokens (ignored)."""
    whole = ids(svc, RESP, {"input": TEXT})
    assert whole is not None and len(whole) > 5
    for extra in ({"truncation": "auto"}, {"truncation": "disabled"}, {"truncation": None}):
        assert ids(svc, RESP, {"input": TEXT, **extra}) == whole
    assert ids(svc, RESP, {"input": TEXT, "truncate_prompt_tokens": 5}) == whole
    with pytest.raises(RequestError, match='\'truncation\' must be "auto" or "disabled"'):
        build_request(RESP, {"model": "m", "input": TEXT, "truncation": "sometimes"}, {})
