"""What vLLM gives a chat template, checked against vLLM itself.

Every expected text below was computed once, outside the tests, by current vLLM's code for the step
(`ChatCompletionToolsParam.model_dump()`, `ChatCompletionRequest._normalize_messages_before`,
`parse_chat_messages`, `_detect_content_format`) with transformers 4.57's `render_jinja_template`; the
literals are that output. No network, no vLLM, no transformers needed here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from epp.kvindex.chat_inputs import MAX_JSON_DEPTH
from epp.kvindex.chat_template import ChatTemplate, ChatTemplateError
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.service import KvIndexService
from epp.testing.tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer
from epp.types import ApiKind, ChatOptions, InferenceRequest

# Qwen3's chat template (Qwen/Qwen3-*, tokenizer_config.json): it reads `reasoning_content`.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""  # noqa: E501

TOOLS_ONLY = "{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
ARGS_ONLY = (
    "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }};{% endfor %}"
    "{% endfor %}"
)
REASONING = (
    "{% for m in messages %}<{{ m.role }}"
    "|{{ m.reasoning_content if m.reasoning_content is defined else '-' }}"
    "|{{ m.reasoning if m.reasoning is defined else '-' }}>{{ m.content }}{% endfor %}"
)
STRING_FORMAT = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
OPENAI_FORMAT = (
    "{% for m in messages %}[{{ m['role'] }}]{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m['content'] %}({{ p | tojson }}){% endfor %}{% endif %}{% endfor %}"
)
USER = [{"role": "user", "content": "u"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def nested(levels: int) -> Any:
    """An object `levels` deep: nested(1) == {}, nested(2) == {"a": {}}."""
    value: Any = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


# --- 1. tools: `[tool.model_dump() for tool in request.tools]` ---


@pytest.mark.parametrize(
    "tool, rendered",
    [
        (
            WEATHER,
            '{"type": "function", "function": {"name": "get_weather", "description": null, "parameters": '
            '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}',
        ),
        (
            {
                "function": {
                    "strict": True,
                    "x-extra": 1,
                    "parameters": {"type": "object"},
                    "description": "Current weather",
                    "name": "get_weather",
                },
                "cache_control": {"type": "ephemeral"},
                "type": "function",
            },
            '{"type": "function", "function": {"name": "get_weather", "description": "Current weather", '
            '"parameters": {"type": "object"}, "strict": true}}',
        ),
        (
            {"function": {"name": "f"}},
            '{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}',
        ),
        (
            {"type": "function", "function": {"name": "f", "strict": "no", "defer_loading": 1}},
            '{"type": "function", "function": {"name": "f", "description": null, "parameters": null, '
            '"strict": false, "defer_loading": true}}',
        ),
        (
            {"type": "function", "function": {"name": "f"}, "defer_loading": True},
            '{"type": "function", "function": {"name": "f", "description": null, "parameters": null, '
            '"defer_loading": true}, "defer_loading": true}',
        ),
        (
            {"type": "function", "function": {"name": "g", "defer_loading": False}, "defer_loading": "yes"},
            '{"type": "function", "function": {"name": "g", "description": null, "parameters": null, '
            '"defer_loading": false}, "defer_loading": true}',
        ),
        (
            {
                "type": "function",
                "function": {"name": "f", "strict": None, "defer_loading": None, "description": None},
                "defer_loading": None,
            },
            '{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}',
        ),
    ],
    ids=[
        "missing-description-is-null",
        "declared-keys-in-order-extras-dropped",
        "type-defaults-to-function",
        "lax-booleans",
        "tool-defer-loading-copied-to-function",
        "function-defer-loading-kept",
        "unset-optionals-dropped",
    ],
)
def test_tools_reach_the_template_as_vllm_dumps_them(tool: dict[str, Any], rendered: str) -> None:
    assert ChatTemplate(TOOLS_ONLY).render(USER, tools=[tool]) == rendered + "\n"


def test_a_tool_without_description_renders_null_in_a_full_template() -> None:
    """The review's case (Llama-3-like template, `tojson(indent=2)`): the engine's prompt has a
    `"description": null` line; without it every block after the tools differs from the engine's."""
    expected = (
        "<|start_header_id|>system<|end_header_id|>\n\nYou can call these functions. Answer with JSON "
        '{"name": ..., "arguments": ...}.\n{\n  "type": "function",\n  "function": {\n'
        '    "name": "get_weather",\n    "description": null,\n    "parameters": {\n      "type": "object",\n'
        '      "properties": {\n        "city": {\n          "type": "string"\n        }\n      },\n'
        '      "required": [\n        "city"\n      ]\n    }\n  }\n}\n<|eot_id|>'
        "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    assert ChatTemplate(CHAT_TEMPLATE).render(messages, tools=[WEATHER]) == expected


@pytest.mark.parametrize(
    "tools, message",
    [
        ([{"type": "custom", "custom": {"name": "f"}}], r"tools\[0\]: only tools of type 'function'"),
        ([{"type": None, "function": {"name": "f"}}], r"tools\[0\]: only tools of type 'function'"),
        ([{"type": "function"}], r"tools\[0\] needs a 'function' object"),
        ([{"type": "function", "function": {}}], r"tools\[0\].function needs a string 'name'"),
        ([{"function": {"name": 3}}], r"tools\[0\].function needs a string 'name'"),
        (
            [{"function": {"name": "f", "description": 5}}],
            r"tools\[0\].function.description must be a string",
        ),
        (
            [{"function": {"name": "f", "parameters": []}}],
            r"tools\[0\].function.parameters must be an object",
        ),
        (
            [WEATHER, {"function": {"name": "f", "strict": 2}}],
            r"tools\[1\].function.strict must be a boolean",
        ),
        (
            [{"function": {"name": "f"}, "defer_loading": " true "}],
            r"tools\[0\].defer_loading must be a boolean",
        ),
        (["f"], r"tools\[0\] must be an object"),
        ({"function": {"name": "f"}}, "tools must be a list"),
    ],
)
def test_tools_vllm_refuses_are_not_rendered(tools: Any, message: str) -> None:
    """vLLM answers 400 to these (its pydantic validation): no prompt, nothing to key."""
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(TOOLS_ONLY).render(USER, tools=tools)


# --- 2. reasoning_content -> reasoning ---


def test_reasoning_content_is_renamed_as_vllm_does() -> None:
    """`_normalize_messages_before`: a message's `reasoning_content` becomes `reasoning` unless that is set
    (then `reasoning` wins); an assistant message then carries both; other roles carry neither."""
    messages = [
        {"role": "user", "content": "u", "reasoning_content": "ur"},
        {"role": "assistant", "content": "a", "reasoning_content": "RC"},
        {"role": "assistant", "content": "b", "reasoning": "R", "reasoning_content": "RC"},
        {"role": "assistant", "content": "c", "reasoning": None, "reasoning_content": "RC"},
        {"role": "assistant", "content": "d", "reasoning": "R"},
        {"role": "assistant", "content": "e"},
    ]
    assert (
        ChatTemplate(REASONING).render(messages, add_generation_prompt=False)
        == "<user|-|->u<assistant|RC|RC>a<assistant|R|R>b<assistant|RC|RC>c<assistant|R|R>d<assistant|-|->e"
    )


def test_qwen3_renders_the_reasoning_of_a_tool_calling_turn() -> None:
    """The review's reproduction: Qwen3 puts a turn's `reasoning_content` in a <think> block."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    assert ChatTemplate(QWEN3).render(messages) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        "<think>\nI should call the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


# --- tool-call arguments ---


@pytest.mark.parametrize(
    "arguments, rendered",
    [
        ('{"city": "Paris"}', '{"city": "Paris"}'),
        ({"x": 1}, '{"x": 1}'),
        ("{oops", "{}"),
        ("[1, 2]", "{}"),
        ("42", "{}"),
        ("null", "{}"),
        ([1, 2], "{}"),
        ("", "{}"),
        (None, "{}"),
    ],
    ids=[
        "json-object",
        "object",
        "invalid-json",
        "json-array",
        "json-number",
        "json-null",
        "array",
        "empty",
        "none",
    ],
)
def test_tool_call_arguments_become_an_object_as_vllm_makes_them(arguments: Any, rendered: str) -> None:
    """vLLM renders arguments that are not a JSON object (malformed ones too) as {}."""
    messages = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
            ],
        }
    ]
    assert ChatTemplate(ARGS_ONLY).render(messages, add_generation_prompt=False) == rendered + ";"


@pytest.mark.parametrize(
    "call, message",
    [
        ("c1", "tool_calls entries must be objects of type 'function'"),
        ({"type": "custom", "custom": {}}, "tool_calls entries must be objects of type 'function'"),
        ({"type": "function", "function": "f"}, "needs a 'function' object"),
    ],
)
def test_tool_calls_vllm_refuses_are_not_rendered(call: Any, message: str) -> None:
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(ARGS_ONLY).render(messages, add_generation_prompt=False)


# --- 3. hostile nesting ---


def _call(arguments: Any) -> list[dict[str, Any]]:
    function = {"name": "f", "arguments": arguments}
    return [
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": function}]}
    ]


@pytest.mark.parametrize(
    "arguments, message",
    [
        ("[" * 100_000, "tool call 'f': its arguments cannot be parsed .*recursion"),
        ("1" * 5000, "tool call 'f': its arguments cannot be parsed .*digits"),
    ],
    ids=["100k-brackets", "huge-integer"],
)
def test_arguments_json_cannot_escape_as_another_exception(arguments: str, message: str) -> None:
    """`json.loads` raises RecursionError / ValueError (not JSONDecodeError) on these: vLLM fails the request;
    here it is a ChatTemplateError, which the caller turns into an unkeyed request."""
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(ARGS_ONLY).render(_call(arguments), add_generation_prompt=False)


def test_nesting_is_bounded_for_every_value_the_template_receives() -> None:
    template = ChatTemplate(CHAT_TEMPLATE + "{{ deep | tojson if deep is defined }}")
    ok, deep = nested(MAX_JSON_DEPTH - 2), nested(MAX_JSON_DEPTH - 1)  # a tool's parameters are at level 3
    tool = {"type": "function", "function": {"name": "f", "parameters": ok}}
    template.render(USER, tools=[tool])
    with pytest.raises(
        ChatTemplateError, match=r"^tools\[0\].function.parameters\.a[.a]*: nested deeper than 32"
    ):
        template.render(USER, tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}])
    # arguments are at level 5 of their message (message, tool_calls, call, function, arguments)
    template.render(_call(json.dumps(nested(MAX_JSON_DEPTH - 4))), add_generation_prompt=False)
    with pytest.raises(
        ChatTemplateError, match=r"^messages\[0\].tool_calls\[0\].function.arguments\.a[.a]*: nested"
    ):
        template.render(_call(json.dumps(nested(MAX_JSON_DEPTH - 3))), add_generation_prompt=False)
    developer = {"role": "developer", "content": "d", "tools": [nested(MAX_JSON_DEPTH - 1)]}
    with pytest.raises(ChatTemplateError, match=r"^messages\[0\].tools\[0\]\.a[.a]*: nested"):
        template.render([developer, *USER])
    template.render(USER, template_kwargs={"deep": nested(MAX_JSON_DEPTH)})
    with pytest.raises(ChatTemplateError, match=r"^chat_template_kwargs\['deep'\]\.a[.a]*: nested"):
        template.render(USER, template_kwargs={"deep": nested(MAX_JSON_DEPTH + 1)})
    template.render(USER, template_kwargs={"unread": nested(200)})  # vLLM does not pass what is not read
    with pytest.raises(ChatTemplateError, match=r"documents\[0\] must be an object of strings"):
        template.render(USER, documents=[{"title": "t", "text": nested(3)}])  # vLLM: list[dict[str, str]]


def test_a_small_body_cannot_render_to_a_huge_prompt() -> None:
    """The review's amplification: 16 KB of tool schemas nested 200 deep rendered by a `tojson(indent=4)`
    template came to 3.9 M characters; the nesting bound refuses them before rendering."""
    llama_like = "{% for t in tools %}{{ t | tojson(indent=4) }}{% endfor %}{{ messages[0]['content'] }}"
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": nested(200)}} for i in range(10)
    ]
    assert len(json.dumps(tools)) < 16_000
    with pytest.raises(ChatTemplateError, match="nested deeper than"):
        ChatTemplate(llama_like).render(USER, tools=tools)


def test_the_service_keys_such_requests_as_unkeyed_instead_of_failing(tmp_path: Path) -> None:
    service = KvIndexService(
        BlockIndex(block_size=16, max_entries=1000),
        FreshnessTracker(),
        TokenizerRegistry({"m": build_tiny_tokenizer(tmp_path / "tok")}),
        block_size=16,
    )
    hostile = [
        InferenceRequest("r", ApiKind.CHAT_COMPLETIONS, "m", messages=[*USER, *_call("[" * 100_000)]),
        InferenceRequest(
            "r",
            ApiKind.CHAT_COMPLETIONS,
            "m",
            messages=USER,
            chat=ChatOptions(
                tools=[{"type": "function", "function": {"name": "f", "parameters": nested(100)}}]
            ),
        ),
    ]
    for request in hostile:
        result = service.tokenize(request)
        assert result.ids is None and result.unkeyed == "tokenizer_error"


# --- 4. empty text parts ---


PARTS = [
    {"type": "text", "text": ""},
    {"type": "text", "text": "Hello"},
    "",
    {"type": "text", "text": "world"},
    {"type": "input_text"},
    {"type": "thinking", "thinking": ""},
    {"type": "refusal", "refusal": None},
]


def test_string_templates_drop_empty_text_parts_as_vllm_does() -> None:
    """vLLM keeps a parsed part only `if parse_res:`: empty texts (and empty tool references) go."""
    messages = [
        {"role": "user", "content": PARTS},
        {
            "role": "tool",
            "content": [{"type": "tool_reference", "name": "f"}, {"type": "tool_reference", "name": ""}, "t"],
        },
    ]
    template = ChatTemplate(STRING_FORMAT)
    assert template.content_format == "string"
    assert template.render(messages, add_generation_prompt=False) == "[user]Hello\nworld[tool]f\nt"


def test_openai_templates_keep_every_text_part_as_vllm_does() -> None:
    """Parts become dicts there (always truthy); only `text` / `refusal` parts without text are skipped."""
    template = ChatTemplate(OPENAI_FORMAT)
    assert template.content_format == "openai"
    assert template.render([{"role": "user", "content": PARTS}], add_generation_prompt=False) == (
        '[user]({"type": "text", "text": ""})({"type": "text", "text": "Hello"})'
        '({"type": "text", "text": ""})({"type": "text", "text": "world"})'
        '({"type": "text", "text": null})({"type": "text", "text": ""})'
    )


# --- 5. content format detection ---


@pytest.mark.parametrize(
    "source, content_format",
    [
        (
            "{% macro r(content) %}{% for item in content %}{{ item.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ r(m.content) }}{% endfor %}",
            "openai",
        ),
        ("{% for item in content %}{{ item }}{% endfor %}", "openai"),
        (
            "{% macro r(content) %}{% for item in content|list %}{{ item.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ r(m.content) }}{% endfor %}",
            "string",
        ),
        (
            "{% set a = messages[1:] %}{% set b = a|reverse %}{% for m in b %}{% for p in m['content'] %}"
            "{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% set c = m %}{% for p in c['content'] %}{% endfor %}{% endfor %}",
            "string",
        ),
        ("{% for m in messages %}{% for p in m.content if p is mapping %}{% endfor %}{% endfor %}", "openai"),
        (
            "{% set messages = messages|list %}{% for m in messages %}{% for p in m.content %}{% endfor %}"
            "{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        # a target vLLM asserts to be a plain name is not one: its detection fails and answers "string"
        (
            "{% for a, b in content %}{{ a }}{% endfor %}{% for m in messages %}{% for p in m.content %}"
            "{{ p.text }}{% endfor %}{% endfor %}",
            "string",
        ),
        (
            "{% for m in messages %}{% for k, v in m['content'] %}{{ k }}{% endfor %}"
            "{% for p in m['content'] %}{% endfor %}{% endfor %}",
            "string",
        ),
        (
            "{% for i, m in messages %}{% endfor %}"
            "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
            "string",
        ),
        (
            "{% set ns = namespace(m=none) %}{% set ns.m = messages %}{% for m in messages %}"
            "{% for p in m['content'] %}({{ p }}){% endfor %}{% endfor %}",
            "string",
        ),
        (QWEN3, "string"),
        (CHAT_TEMPLATE, "openai"),
    ],
    ids=[
        "content-variable-loop",
        "content-variable-loop-alone",
        "filtered-content-variable",
        "aliases-of-messages",
        "alias-of-the-loop-variable",
        "loop-with-a-test",
        "self-assignment",
        "string",
        "tuple-target-over-content-variable",
        "tuple-target-over-message-content",
        "tuple-target-over-messages",
        "namespace-assignment-of-messages",
        "qwen3",
        "tiny-llama-like",
    ],
)
def test_content_format_detection_matches_vllm(source: str, content_format: str) -> None:
    """vLLM's `_detect_content_format`, including the `{% for item in content %}` loops it counts since its
    PR #42660 (Qwen3.5's templates loop over a macro's `content` argument)."""
    assert ChatTemplate(source).content_format == content_format
