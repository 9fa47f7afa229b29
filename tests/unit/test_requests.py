"""Parsing OpenAI-style requests: what is accepted, and the 400s for what is not."""

from __future__ import annotations

import json

import pytest

from epp.requests import RequestError, api_kind_of, build_request, parse_body
from epp.types import ApiKind, ChatOptions

CHAT = {":path": "/v1/chat/completions", "x-request-id": "abc"}
COMPL = {":path": "/v1/completions"}
MSG = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]'  # + the rest of a chat body


def req(headers: dict[str, str], body: object, objectives: dict[str, int] | None = None) -> object:
    raw = json.dumps(body).encode()
    return build_request(headers, parse_body(raw), objectives or {}, len(raw))


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/chat/completions", ApiKind.CHAT_COMPLETIONS),
        ("/v1/completions?x=1", ApiKind.COMPLETIONS),
        ("/v1/embeddings", ApiKind.EMBEDDINGS),
        ("/v1/responses/", ApiKind.RESPONSES),
        ("/healthz", ApiKind.OTHER),
    ],
)
def test_api_kind_from_path(path: str, kind: ApiKind) -> None:
    assert api_kind_of(path) is kind


@pytest.mark.parametrize(
    ("headers", "body", "prompt", "tokens"),
    [
        (COMPL, {"model": "m", "prompt": "abcdefgh"}, "abcdefgh", 2),
        (COMPL, {"model": "m", "prompt": [1, 2, 3]}, [1, 2, 3], 3),
        # a batch: each item is its own engine request; the first is keyed, the estimate counts them all
        (COMPL, {"model": "m", "prompt": ["abcd", "efgh"]}, "abcd", 2),
        (COMPL, {"model": "m", "prompt": [[1, 2], [3]]}, [1, 2], 3),
    ],
)
def test_completions_prompts(headers: dict[str, str], body: object, prompt: object, tokens: int) -> None:
    r = req(headers, body)
    assert r.prompt == prompt  # type: ignore[attr-defined]
    assert r.prompt_tokens_estimate == tokens  # type: ignore[attr-defined]


def test_chat_request_fields() -> None:
    r = req(
        {**CHAT, "x-gateway-inference-objective": "batch"},
        {
            "model": "llama",
            "messages": [{"role": "user", "content": "x" * 40}],
            "stream": True,
            "max_tokens": 7,
        },
        {"batch": -2},
    )
    assert r.api_kind is ApiKind.CHAT_COMPLETIONS  # type: ignore[attr-defined]
    assert r.model == "llama" and r.stream and r.max_tokens == 7  # type: ignore[attr-defined]
    assert r.request_id == "abc" and r.priority == -2 and r.sheddable  # type: ignore[attr-defined]
    assert r.prompt_tokens_estimate == 10  # type: ignore[attr-defined]


def test_unknown_objective_has_priority_zero_and_request_id_is_generated() -> None:
    r = req(
        {":path": "/v1/chat/completions", "x-gateway-inference-objective": "nope"},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.priority == 0  # type: ignore[attr-defined]
    assert len(r.request_id) == 36  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("sent", "objective", "priority"),
    [
        ({"x-llm-d-inference-objective": "batch"}, "batch", -2),
        ({"x-llm-d-inference-objective": "batch", "x-gateway-inference-objective": "x"}, "batch", -2),
        ({"x-llm-d-inference-objective": "x", "x-gateway-inference-objective": "batch"}, "x", 0),
        ({"x-llm-d-inference-objective": "", "x-gateway-inference-objective": "batch"}, None, 0),
        ({"x-gateway-inference-objective": "batch"}, "batch", -2),
        ({}, None, 0),
    ],
)
def test_llmds_objective_name_wins_over_the_gie_one(
    sent: dict[str, str], objective: str | None, priority: int
) -> None:
    for doc in ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, None):
        r = build_request({**CHAT, **sent}, doc, {"batch": -2})
        assert (r.objective, r.priority) == (objective, priority)
        assert {k: v for k, v in r.headers.items() if "objective" in k} == sent  # kept as sent


@pytest.mark.parametrize(
    ("headers", "raw", "needle"),
    [
        (CHAT, b"", "empty"),
        (CHAT, b"{not json", "not valid JSON"),
        (CHAT, b"[1,2]", "JSON object"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}]}', "'model'"),
        (CHAT, b'{"model": 5, "messages": []}', "'model'"),
        (CHAT, b'{"model": "m"}', "'messages'"),
        (CHAT, b'{"model": "m", "messages": []}', "'messages'"),
        (CHAT, b'{"model": "m", "messages": [{"content": "x"}]}', "messages[0]"),
        (CHAT, b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        (COMPL, b'{"model": "m"}', "needs a non-empty 'prompt'"),
        (COMPL, b'{"model": "m", "prompt": ""}', "needs a non-empty 'prompt'"),
        (COMPL, b'{"model": "m", "prompt": null}', "needs a non-empty 'prompt'"),
        (
            COMPL,
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}',
            "needs a non-empty 'prompt'",
        ),
        (COMPL, b'{"model": "m", "prompt": 12}', "'prompt'"),
        (COMPL, b'{"model": "m", "prompt": [1, "a"]}', "'prompt'"),
        (COMPL, b'{"model": "m", "prompt": "x", "stream": "maybe"}', "'stream' must be a boolean"),
        (COMPL, b'{"model": "m", "prompt": "x", "stream": 2}', "'stream' must be a boolean"),
        (COMPL, b'{"model": "m", "prompt": "x", "max_tokens": -1}', "'max_tokens'"),
        (COMPL, b'\xff\xfe{"model"', "not valid JSON"),
        (COMPL, b'{"model": "m", "prompt": "x", "cache_salt": 5}', "'cache_salt'"),
        (CHAT, MSG + b', "add_generation_prompt": "sure"}', "'add_generation_prompt' must be a boolean"),
        (CHAT, MSG + b', "add_generation_prompt": null}', "'add_generation_prompt' must be a boolean"),
        (CHAT, MSG + b', "continue_final_message": 2}', "'continue_final_message' must be a boolean"),
        (CHAT, MSG + b', "continue_final_message": " true"}', "'continue_final_message' must be a boolean"),
        (CHAT, MSG + b', "continue_final_message": true}', "cannot both be true"),
        # vLLM's check_generation_prompt reads the raw values: "false" is a truthy string there
        (CHAT, MSG + b', "continue_final_message": true, "add_generation_prompt": "false"}', "cannot both"),
        (CHAT, MSG + b', "tools": {"type": "function"}}', "'tools' must be a list of objects"),
        (CHAT, MSG + b', "documents": ["a"]}', "'documents' must be a list of objects"),
        (CHAT, MSG + b', "chat_template_kwargs": [1]}', "'chat_template_kwargs' must be an object"),
    ],
)
def test_bad_bodies_are_400_with_a_clear_message(headers: dict[str, str], raw: bytes, needle: str) -> None:
    with pytest.raises(RequestError) as err:
        build_request(headers, parse_body(raw), {}, len(raw))
    assert err.value.status == 400
    assert needle in err.value.message


def test_chat_fields_that_change_the_rendered_prompt_are_kept() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": tools,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    r = build_request(CHAT, body, {})
    assert r.chat == ChatOptions(
        add_generation_prompt=False,
        continue_final_message=True,
        tools=tools,
        chat_template_kwargs={"enable_thinking": False},
    )
    plain = build_request(CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, {})
    assert plain.chat is None  # the defaults
    nulls = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": None, "documents": None}
    assert build_request(CHAT, nulls, {}).chat is None


def test_header_only_request_has_no_model() -> None:
    r = build_request({":path": "/v1/models"}, None, {})
    assert r.model == "" and r.api_kind is ApiKind.OTHER


# --- vLLM's request models: which field is the prompt, and pydantic's lax booleans ---


def test_a_completion_keys_its_prompt_and_ignores_a_stray_messages_field() -> None:
    """vLLM's CompletionRequest has no `messages` (pydantic ignores it): the prompt is `prompt`."""
    stray = [{"role": "user", "content": "not this"}]
    r = build_request(COMPL, {"model": "m", "prompt": "this one", "messages": stray}, {})
    assert r.prompt == "this one" and r.messages is None and r.chat is None
    r = build_request(COMPL, {"model": "m", "prompt": [5, 6, 7], "messages": stray}, {})
    assert r.prompt == [5, 6, 7] and r.messages is None


def test_a_chat_keys_its_messages_and_ignores_a_stray_prompt_field() -> None:
    r = build_request(
        CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "no"}, {}
    )
    assert r.prompt is None and r.messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("sent", "value"),
    [
        (True, True), (False, False), (1, True), (0, False), (1.0, True), (0.0, False),
        ("true", True), ("FALSE", False), ("Yes", True), ("no", False), ("on", True), ("off", False),
        ("1", True), ("0", False), ("t", True), ("F", False), ("y", True), ("n", False),
    ],
)  # fmt: skip
def test_boolean_fields_are_read_as_vllms_pydantic_models_read_them(sent: object, value: bool) -> None:
    """pydantic's lax booleans (vLLM's request models are not strict): what the engine runs with."""
    msgs = [{"role": "user", "content": "hi"}]
    r = build_request(CHAT, {"model": "m", "messages": msgs, "add_generation_prompt": sent}, {})
    assert (r.chat or ChatOptions()).add_generation_prompt is value
    r = build_request(
        CHAT,
        {"model": "m", "messages": msgs, "add_generation_prompt": False, "continue_final_message": sent},
        {},
    )
    assert r.chat is not None and r.chat.continue_final_message is value
    r = build_request(COMPL, {"model": "m", "prompt": "x", "add_special_tokens": sent, "stream": sent}, {})
    assert r.add_special_tokens is value and r.stream is value


def test_a_null_stream_is_not_streamed_and_embeddings_ignore_stream() -> None:
    """`stream` is `bool | None` in vLLM's models; an embeddings request has no such field."""
    assert build_request(COMPL, {"model": "m", "prompt": "x", "stream": None}, {}).stream is False
    emb = {"model": "m", "input": "x", "stream": "whatever"}
    assert build_request({":path": "/v1/embeddings"}, emb, {}).stream is False


def test_an_embeddings_chat_has_vllms_pooling_defaults() -> None:
    """vLLM's EmbeddingChatRequest: add_generation_prompt defaults to false, and it has no tools,
    documents or reasoning_effort (ignored), so continue_final_message alone is fine."""
    emb = {":path": "/v1/embeddings"}
    msgs = [{"role": "user", "content": "hi"}]
    r = build_request(emb, {"model": "m", "messages": msgs}, {})
    assert r.chat == ChatOptions(add_generation_prompt=False)
    tools = [{"type": "function", "function": {"name": "f"}}]
    extra = {"tools": tools, "documents": [{"text": "d"}], "reasoning_effort": "high"}
    r = build_request(emb, {"model": "m", "messages": msgs, **extra}, {})
    assert r.chat == ChatOptions(add_generation_prompt=False)
    r = build_request(emb, {"model": "m", "messages": msgs, "continue_final_message": True}, {})
    assert r.chat == ChatOptions(add_generation_prompt=False, continue_final_message=True)
    r = build_request(emb, {"model": "m", "messages": msgs, "add_generation_prompt": "yes"}, {})
    assert r.chat == ChatOptions(add_generation_prompt=True)
    r = build_request(emb, {"model": "m", "input": msgs}, {})
    assert r.chat == ChatOptions(add_generation_prompt=False)
