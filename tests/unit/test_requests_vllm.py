"""Requests whose prompt vLLM builds from more than `messages` / `prompt`: the Responses API (instructions,
input items, tools, partial final messages, reasoning effort), `add_special_tokens`, `reasoning_effort`.

The expected ids are what vLLM computes (its message construction, rendered and tokenized by transformers
4.57 on these very tokenizer files), written down as literals.
"""

from __future__ import annotations

from typing import Any

import pytest

from epp.kvindex.service import KvIndexService
from epp.requests import RequestError, build_request
from epp.types import ChatOptions
from tests.support.chat_services import ids, template_service

RESP = {":path": "/v1/responses"}
CHAT = {":path": "/v1/chat/completions"}
COMPL = {":path": "/v1/completions"}
REASONING_TEMPLATE = (
    "{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ m['content'] }}<|eot_id|>"
    "{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
    "{%- if enable_thinking is defined and not enable_thinking %}<think></think>{%- endif %}{%- endif %}"
    "{%- if reasoning_effort is defined %} effort={{ reasoning_effort }}{%- endif %}"
)
NAMED_TEMPLATES = [
    {"name": "default", "template": "D{{ messages|length }}"},
    {"name": "tool_use", "template": "T{{ tools|length }}"},
]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> KvIndexService:
    return template_service(tmp_path_factory, {"r": REASONING_TEMPLATE, "n": NAMED_TEMPLATES})


# --- /v1/responses ---


def test_responses_instructions_and_string_input_are_a_chat_encoded_with_special_tokens(
    service: KvIndexService,
) -> None:
    """`instructions` is a system message, a string `input` a user message, then the chat template; vLLM's
    ResponsesRequest tokenizes with add_special_tokens=True, so this template's bos token comes twice."""
    body = {"model": "m", "instructions": "You are terse.", "input": "What is the capital of France?"}
    r = build_request(RESP, body, {})
    assert r.messages == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert r.add_special_tokens is True
    assert ids(service, RESP, body) == [
        0, 0, 2, 87, 93, 297, 73, 81, 3, 203, 203, 61, 266, 264, 268, 270, 300, 87, 73, 18, 4, 2, 445, 300, 3,
        203, 203, 59, 76, 281, 292, 285, 225, 71, 69, 84, 77, 323, 80, 282, 225, 42, 86, 313, 71, 73, 35, 4,
        2, 363, 87, 77, 297, 313, 88, 3, 203, 203,
    ]  # fmt: skip


TOOL_ROUND_TRIP: list[dict[str, Any]] = [
    {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Call it."}],
    },
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}],
    },
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks!"}]},
]


def test_responses_items_without_a_role_are_converted_as_vllm_converts_them(service: KvIndexService) -> None:
    """Reasoning, function_call, function_call_output and output_text items (a tool round trip), and a flat
    Responses function tool: accepted, and rendered as vLLM renders them."""
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Current weather",
            "parameters": WEATHER,
            "strict": True,
        },
        {"type": "web_search"},  # a built-in tool: not given to the template
    ]
    body = {"model": "m", "input": TOOL_ROUND_TRIP, "tools": tools}
    r = build_request(RESP, body, {})
    call = {
        "id": "c1",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        "type": "function",
    }
    assert r.messages == [
        TOOL_ROUND_TRIP[0],
        {"role": "assistant", "reasoning": "Call it.", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is sunny."},
        TOOL_ROUND_TRIP[5],
    ]
    function = {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": WEATHER,
        "strict": True,
    }
    assert r.chat == ChatOptions(tools=[{"type": "function", "function": function}])
    assert ids(service, RESP, body) == [
        0, 0, 2, 87, 93, 297, 73, 81, 3, 203, 203, 61, 266, 225, 71, 313, 225, 71, 69, 80, 80, 285, 87, 73,
        225, 74, 89, 82, 71, 324, 87, 18, 459, 87, 91, 300, 287, 225, 46, 55, 51, 50, 225, 95, 6, 82, 69, 81,
        73, 6, 30, 225, 354, 16, 225, 6, 69, 86, 75, 89, 299, 87, 6, 30, 225, 354, 97, 18, 203, 95, 203, 225,
        225, 6, 88, 93, 84, 73, 6, 30, 225, 6, 74, 89, 82, 71, 324, 6, 16, 203, 225, 225, 6, 74, 89, 82, 71,
        324, 6, 30, 225, 95, 203, 319, 225, 6, 82, 69, 81, 73, 6, 30, 225, 6, 75, 73, 88, 67, 91, 73, 69, 261,
        300, 6, 16, 203, 319, 225, 6, 306, 87, 71, 316, 84, 324, 6, 30, 225, 6, 39, 89, 86, 86, 283, 225, 91,
        73, 69, 261, 300, 6, 16, 203, 319, 225, 6, 84, 69, 86, 69, 81, 73, 88, 300, 87, 6, 30, 225, 95, 203,
        405, 225, 6, 88, 93, 84, 73, 6, 30, 225, 6, 83, 70, 78, 73, 71, 88, 6, 16, 203, 405, 225, 6, 84, 86,
        83, 84, 300, 88, 77, 73, 87, 6, 30, 225, 95, 203, 269, 405, 225, 6, 71, 362, 93, 6, 30, 225, 95, 203,
        480, 405, 225, 6, 88, 93, 84, 73, 6, 30, 225, 6, 297, 86, 322, 6, 203, 269, 405, 225, 97, 203, 405,
        225, 97, 203, 319, 225, 97, 16, 203, 319, 225, 6, 297, 316, 71, 88, 6, 30, 270, 86, 89, 73, 203, 225,
        225, 97, 203, 97, 203, 4, 2, 445, 300, 3, 203, 203, 59, 73, 69, 261, 300, 271, 412, 69, 316, 87, 35,
        4, 2, 363, 87, 77, 297, 313, 88, 3, 203, 203, 203, 95, 6, 82, 69, 81, 73, 6, 30, 225, 6, 75, 73, 88,
        67, 91, 73, 69, 261, 300, 6, 16, 225, 6, 69, 86, 75, 89, 299, 87, 6, 30, 225, 95, 6, 71, 362, 93, 6,
        30, 225, 6, 52, 69, 316, 87, 6, 97, 97, 4, 2, 359, 83, 80, 3, 203, 203, 302, 82, 82, 93, 4, 2, 363,
        87, 77, 297, 313, 88, 3, 203, 203, 45, 88, 292, 331, 82, 82, 93, 18, 4, 2, 445, 300, 3, 203, 203, 56,
        76, 313, 79, 87, 5, 4, 2, 363, 87, 77, 297, 313, 88, 3, 203, 203,
    ]  # fmt: skip


def test_responses_partial_final_message_is_continued(service: KvIndexService) -> None:
    """An assistant message item with status "incomplete" last: no generation prompt, the text stops where
    the message does (vLLM's should_continue_final_message)."""
    partial = {
        "type": "message",
        "role": "assistant",
        "status": "incomplete",
        "content": [{"type": "output_text", "text": "Autumn moonlight"}],
    }
    body = {"model": "m", "input": [{"role": "user", "content": "Write a haiku."}, partial]}
    assert build_request(RESP, body, {}).chat == ChatOptions(
        add_generation_prompt=False, continue_final_message=True
    )
    assert ids(service, RESP, body) == [
        0, 0, 2, 445, 300, 3, 203, 203, 59, 316, 88, 73, 264, 225, 76, 69, 77, 79, 89, 18, 4, 2, 363, 87, 77,
        297, 313, 88, 3, 203, 203, 37, 89, 88, 89, 81, 82, 225, 81, 83, 262, 80, 77, 75, 76, 88,
    ]  # fmt: skip


def test_responses_reasoning_effort_reaches_the_template(service: KvIndexService) -> None:
    body = {"model": "r", "input": "Hi", "reasoning": {"effort": "low"}}
    assert build_request(RESP, body, {}).chat == ChatOptions(
        chat_template_kwargs={"reasoning_effort": "low", "enable_thinking": True}
    )
    assert ids(service, RESP, body) == [
        0, 2, 445, 300, 3, 44, 77, 4, 2, 363, 87, 77, 297, 313, 88, 3, 225, 73, 74, 279, 88, 33, 310, 91,
    ]  # fmt: skip


def test_responses_merging_and_namespaces() -> None:
    """Items after an assistant message fill its empty slots; a namespace's tools are flattened."""
    items = [
        {"type": "message", "role": "assistant", "content": "Let me check."},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}", "namespace": "ns"},
        {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "why"}]},
        {"type": "reasoning", "summary": []},
        {"type": "function_call_output", "call_id": "a", "output": [{"type": "input_text", "text": "1"}]},
    ]
    namespace = {
        "type": "namespace",
        "name": "ns",
        "tools": [{"type": "function", "name": "f"}, {"type": "custom"}],
    }
    r = build_request(RESP, {"model": "m", "input": items, "tools": [namespace]}, {})
    calls = [
        {"id": "a", "function": {"name": "ns__f", "arguments": "{}"}, "type": "function"},
        {"id": "b", "function": {"name": "g", "arguments": "{}"}, "type": "function"},
    ]
    assert r.messages == [
        {"role": "assistant", "content": "Let me check.", "tool_calls": calls, "reasoning": "why"},
        {"role": "assistant", "reasoning": ""},
        {"role": "tool", "content": [{"type": "input_text", "text": "1"}], "tool_call_id": "a"},
    ]
    function = {"name": "ns__f", "description": None, "parameters": None}
    assert r.chat is not None and r.chat.tools == [{"type": "function", "function": function}]
    empty = build_request(RESP, {"model": "m", "input": [], "tools": []}, {})
    assert empty.messages == [] and empty.chat == ChatOptions()


def test_a_responses_request_continuing_a_stored_conversation_is_unkeyed(service: KvIndexService) -> None:
    """vLLM puts the conversation it stored first: the EPP cannot know the prompt."""
    r = build_request(RESP, {"model": "m", "input": "and then?", "previous_response_id": "resp_1"}, {})
    before = service.unkeyed[("m", "stored_history")]
    assert service.prompt_tokens(r) is None
    assert service.unkeyed[("m", "stored_history")] == before + 1


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"model": "m"}, "'input' is missing"),
        ({"model": "m", "input": 5}, "'input' must be a string or a list"),
        ({"model": "m", "input": ["hi"]}, "'input[0]' must be an object"),
        ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "'input[0]' must be a message"),
        ({"model": "m", "input": [{"type": "function_call", "call_id": "c"}]}, "'input[0]' (function_call)"),
        (
            {"model": "m", "input": [{"type": "function_call_output", "output": "x"}]},
            "'input[0]' (function_call_output)",
        ),
        ({"model": "m", "input": [{"role": "user", "content": 5}]}, "'input[0].content'"),
        ({"model": "m", "input": "x", "instructions": 5}, "'instructions'"),
        ({"model": "m", "input": "x", "reasoning": {"effort": 1}}, "'reasoning.effort'"),
        ({"model": "m", "input": "x", "tools": [{"type": "function"}]}, "'tools[0]' (function)"),
        ({"model": "m", "input": "x", "chat_template_kwargs": []}, "'chat_template_kwargs'"),
    ],
)
def test_responses_bodies_vllm_refuses_are_400(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(RequestError) as err:
        build_request(RESP, body, {})
    assert err.value.status == 400 and needle in err.value.message


def test_responses_output_limit_is_max_output_tokens() -> None:
    assert build_request(RESP, {"model": "m", "input": "x", "max_output_tokens": 7}, {}).max_tokens == 7
    with pytest.raises(RequestError, match="'max_output_tokens' must be a non-negative integer"):
        build_request(RESP, {"model": "m", "input": "x", "max_output_tokens": "7"}, {})


def test_responses_ignores_a_sent_add_special_tokens() -> None:
    """vLLM's ResponsesRequest has no such field: an extra field, ignored (not a 400)."""
    r = build_request(RESP, {"model": "m", "input": "x", "add_special_tokens": "no"}, {})
    assert r.add_special_tokens is True


# --- add_special_tokens ---


CHAT_TEXT = (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nSummarise this.<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
SUMMARISE = [
    2, 445, 300, 3, 203, 203, 55, 89, 81, 81, 69, 316, 87, 73, 265, 361, 18, 4, 2, 363, 87, 77, 297, 313,
    88, 3, 203, 203
]  # fmt: skip


def test_add_special_tokens_is_honoured(service: KvIndexService) -> None:
    """A client that applied the template itself sends the text with add_special_tokens=false: one bos,
    not two. A chat can ask for them (True: a second bos)."""
    assert ids(service, COMPL, {"model": "m", "prompt": CHAT_TEXT, "add_special_tokens": False}) == [
        0,
        *SUMMARISE,
    ]
    assert ids(service, COMPL, {"model": "m", "prompt": CHAT_TEXT}) == [0, 0, *SUMMARISE]
    chat = {"model": "m", "messages": [{"role": "user", "content": "Summarise this."}]}
    assert ids(service, CHAT, chat | {"add_special_tokens": True}) == [0, 0, *SUMMARISE]
    assert ids(service, CHAT, chat | {"add_special_tokens": "true"}) == [
        0,
        0,
        *SUMMARISE,
    ]  # pydantic's lax bool
    assert ids(service, COMPL, {"model": "m", "prompt": CHAT_TEXT, "add_special_tokens": 0}) == [
        0,
        *SUMMARISE,
    ]


@pytest.mark.parametrize("value", [None, "maybe", 2, -1, 0.5, "", " true", [], {}])
def test_add_special_tokens_must_be_a_boolean(value: Any) -> None:
    """vLLM's `add_special_tokens: bool` (not optional): null is a 400 too."""
    for headers, body in (
        (COMPL, {"model": "m", "prompt": "x"}),
        (CHAT, {"model": "m", "messages": [{"role": "user"}]}),
    ):
        with pytest.raises(RequestError) as err:
            build_request(headers, body | {"add_special_tokens": value}, {})
        assert err.value.status == 400 and "'add_special_tokens' must be a boolean" in err.value.message


# --- reasoning_effort ---


def test_reasoning_effort_sets_the_template_variables_as_vllm_does(service: KvIndexService) -> None:
    """`reasoning_effort` goes to the template, and sets enable_thinking (effort != "none") unless
    chat_template_kwargs sets it (build_chat_params)."""
    chat = {"model": "r", "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "none"}
    r = build_request(CHAT, chat, {})
    assert r.chat is not None
    assert r.chat.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    assert ids(service, CHAT, chat) == [
        2, 445, 300, 3, 44, 77, 4, 2, 363, 87, 77, 297, 313, 88, 3, 32, 261, 272, 79, 34, 32, 19, 261, 272,
        79, 34, 225, 73, 74, 279, 88, 33, 82, 479,
    ]  # fmt: skip
    kept = chat | {"chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": "high"}}
    r = build_request(CHAT, kept, {})
    assert r.chat is not None
    assert r.chat.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": True}
    assert ids(service, CHAT, kept) == [
        2, 445, 300, 3, 44, 77, 4, 2, 363, 87, 77, 297, 313, 88, 3, 225, 73, 74, 279, 88, 33, 82, 479,
    ]  # fmt: skip
    with pytest.raises(RequestError, match="'reasoning_effort' must be a string"):
        build_request(CHAT, chat | {"reasoning_effort": 1}, {})


def test_an_empty_tools_list_reaches_the_template_as_vllm_gives_it(service: KvIndexService) -> None:
    """`tools: []` is not "no tools": transformers picks the `tool_use` template and renders `tools` = []."""
    chat = {"model": "n", "messages": [{"role": "user", "content": "x"}]}
    assert ids(service, CHAT, chat | {"tools": []}) == [56, 20]  # "T0"
    assert ids(service, CHAT, chat) == [40, 21]  # "D1"


def test_a_completion_given_as_prompt_embeds_is_accepted_and_unkeyed(service: KvIndexService) -> None:
    """vLLM accepts a completion whose prompt is `prompt_embeds` (base64 tensors) only; the EPP cannot know
    its tokens (vLLM hashes the embeddings), so it is routed by load, counted as unkeyed, not refused."""
    for embeds in ("AAAAAAAAAAA=", ["AAAA", "BBBB"]):
        r = build_request(COMPL, {"model": "m", "prompt_embeds": embeds, "max_tokens": 3}, {})
        before = service.unkeyed[("m", "prompt_embeds")]
        assert r.prompt is None and r.messages is None and r.max_tokens == 3
        assert service.prompt_tokens(r) is None
        assert service.unkeyed[("m", "prompt_embeds")] == before + 1
    for bad in ("", [], [1], ["ok", ""], {"x": 1}):
        with pytest.raises(RequestError, match="'prompt_embeds' must be a non-empty base64 string"):
            build_request(COMPL, {"model": "m", "prompt_embeds": bad}, {})
    with pytest.raises(RequestError, match="needs a non-empty 'prompt'"):  # nothing to run at all
        build_request(COMPL, {"model": "m", "prompt_embeds": None}, {})


def test_an_embeddings_chat_is_rendered_without_a_generation_prompt(service: KvIndexService) -> None:
    """vLLM's EmbeddingChatRequest defaults add_generation_prompt to false (a chat completion's is true)."""
    emb = {":path": "/v1/embeddings"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "Summarise this."}]}
    assert ids(service, emb, chat) == [0, *SUMMARISE[:-10]]  # no "<|start_header_id|>assistant..."
    assert ids(service, emb, chat) == ids(service, CHAT, chat | {"add_generation_prompt": False})
    assert ids(service, emb, chat | {"add_generation_prompt": True}) == ids(service, CHAT, chat)
    assert ids(service, emb, chat | {"tools": [{"type": "function", "function": {"name": "f"}}]}) == ids(
        service, emb, chat
    )


def test_responses_tool_flags_are_pydantic_lax_booleans() -> None:
    tool = {"type": "function", "name": "f", "strict": "true", "defer_loading": 0}
    r = build_request(RESP, {"model": "m", "input": "hi", "tools": [tool]}, {})
    assert r.chat is not None and r.chat.tools is not None
    assert (
        r.chat.tools[0]["function"]["strict"] is True
        and r.chat.tools[0]["function"]["defer_loading"] is False
    )
    with pytest.raises(RequestError, match=r"'tools\[0\].strict' must be a boolean"):
        build_request(RESP, {"model": "m", "input": "hi", "tools": [tool | {"strict": "maybe"}]}, {})
