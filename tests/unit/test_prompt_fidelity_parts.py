"""Message content as vLLM 0.32 gives it to a chat template: the keys a text part keeps, and the Claude Code
billing line it cuts from system messages.

Every expected text and id below was computed once, outside the tests, by vLLM 0.32's own code for the
step (its `ChatCompletionRequest` / `ResponsesRequest` message validation with pydantic,
`_parse_chat_message_content` and `_postprocess_messages`, `_detect_content_format`,
`safe_apply_chat_template`) with transformers 5.19's `apply_chat_template` on these very tokenizer files;
the literals are that output.
"""

from __future__ import annotations

from typing import Any

import pytest

from epp.kvindex.chat_template import ChatTemplate
from epp.kvindex.service import KvIndexService
from tests.support.chat_services import ids, template_service

CHAT = {":path": "/v1/chat/completions"}
RESP = {":path": "/v1/responses"}
# "openai" format (it loops over a message's content): each part printed whole, as a template that walks a
# part's keys would see it
PARTS = (
    "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{{ p | tojson }}{% endfor %}{% endif %}{% endfor %}"
)
STRING = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
EPHEMERAL = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> KvIndexService:
    return template_service(tmp_path_factory, {"parts": PARTS})


# --- extra keys on text parts ---

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief.", "cache_control": EPHEMERAL}]},
    {
        "role": "user",
        "content": [
            {"cache_control": EPHEMERAL, "type": "text", "zz": None, "text": "Hi"},
            "plain",
            {"type": "input_text", "text": "it", "x": 2},
            {"type": "refusal", "refusal": "no", "cache_control": EPHEMERAL},
            {"type": "thinking", "thinking": "th", "closed": True, "k": 1},
            {
                "type": "text",
                "text": "known",
                "name": "n",
                "uuid": None,
                "prompt_cache_breakpoint": {"mode": "explicit"},
                "file": 1,
                "data": "d",
            },
            {"type": "output_text", "text": "o", "annotations": []},
            {"type": "text", "text": "", "k": [1, {"b": 2}]},
        ],
    },
    {
        "role": "tool",
        "tool_call_id": "c1",
        "content": [{"type": "text", "text": "r1", "cache_control": EPHEMERAL}],
    },
    {
        "role": "tool",
        "tool_call_id": "c2",
        "content": [
            {"type": "text", "text": "r2", "cache_control": EPHEMERAL},
            {"type": "tool_reference", "name": "f", "cache_control": EPHEMERAL},
        ],
    },
    {"role": "user", "content": "plain string"},
]


def test_openai_templates_see_a_text_parts_own_keys_as_vllm_passes_them() -> None:
    """vLLM builds `{"type": "text", "text": ...}` and adds the part's keys that no content-part type it knows
    declares (`_collect_extra_fields`), in the part's order: `cache_control` and the like reach the template.
    Declared keys (`name`, `uuid`, `closed`, `prompt_cache_breakpoint`, `file`, `data`, ...) do not; a plain
    string part, string content and a tool reference get none; a tool message of text parts only is joined
    (its keys go), one with a tool reference keeps its parts."""
    assert ChatTemplate(PARTS).render(MESSAGES, add_generation_prompt=False) == (
        '<system>{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}'
        '<user>{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}, "zz": null}'
        '{"type": "text", "text": "plain"}{"type": "text", "text": "it", "x": 2}'
        '{"type": "text", "text": "no", "cache_control": {"type": "ephemeral"}}'
        '{"type": "text", "text": "th", "k": 1}{"type": "text", "text": "known"}'
        '{"type": "text", "text": "o", "annotations": []}{"type": "text", "text": "", "k": [1, {"b": 2}]}'
        '<tool>r1<tool>{"type": "text", "text": "r2", "cache_control": {"type": "ephemeral"}}'
        '{"type": "tool_reference", "name": "f"}<user>{"type": "text", "text": "plain string"}'
    )


def test_string_templates_are_unchanged_by_a_parts_keys() -> None:
    assert ChatTemplate(STRING).render(MESSAGES, add_generation_prompt=False) == (
        "[system]Be brief.[user]Hi\nplain\nit\nno\nth\nknown\no[tool]r1[tool]r2\nf[user]plain string"
    )


def test_a_template_reading_only_the_text_is_unchanged(service: KvIndexService) -> None:
    """The tiny Llama-like template is "openai" but prints `part['text']` only: the same ids as before."""
    assert ids(service, CHAT, {"model": "m", "messages": MESSAGES[:2]}) == [
        0, 2, 87, 93, 297, 73, 81, 3, 203, 203, 38, 73, 225, 70, 316, 73, 74, 18, 4, 2, 445, 300, 3, 203, 203,
        44, 77, 84, 80, 69, 272, 362, 82, 83, 261, 79, 82, 83, 91, 82, 83, 4, 2, 363, 87, 77, 297, 313, 88, 3,
        203, 203,
    ]  # fmt: skip


def test_a_responses_input_text_part_keeps_its_cache_control(service: KvIndexService) -> None:
    """vLLM's Responses path validates the item (its `extra="allow"` reaches the part), hands the message on
    as it is, and parses it as a chat message: the key reaches the template, tokenized with special tokens."""
    part = {"type": "input_text", "text": "Hi", "cache_control": EPHEMERAL}
    body = {"model": "parts", "input": [{"type": "message", "role": "user", "content": [part]}]}
    assert ids(service, RESP, body) == [
        0, 32, 445, 300, 34, 95, 6, 88, 93, 84, 73, 6, 30, 225, 6, 88, 307, 88, 6, 16, 225, 6, 88, 307, 88,
        6, 30, 225, 6, 44, 77, 6, 16, 225, 6, 71, 69, 295, 73, 67, 296, 88, 86, 83, 80, 6, 30, 225, 95, 6, 88,
        93, 84, 73, 6, 30, 225, 6, 73, 84, 76, 73, 81, 300, 69, 80, 6, 97, 97,
    ]  # fmt: skip


def test_continue_final_message_keeps_the_final_parts_keys() -> None:
    """transformers tags the final part's text for `continue_final_message`; the part keeps its keys."""
    template = (
        "{% for m in messages %}{% for p in m.content %}{{ p.cache_control | tojson }}:{{ p.text }}"
        "{% endfor %}{% endfor %}"
    )
    message = {"role": "assistant", "content": [{"type": "text", "text": "Par", "cache_control": EPHEMERAL}]}
    rendered = ChatTemplate(template).render(
        [message], add_generation_prompt=False, continue_final_message=True
    )
    assert rendered == '{"type": "ephemeral"}:Par'


# --- Claude Code's billing header line in system messages ---

HEADER = "x-anthropic-billing-header: cc_version=2.1.3; cch=9f2e1;"
BILLED: list[dict[str, Any]] = [
    {"role": "system", "content": HEADER + "\nYou are Claude Code."},
    {
        "role": "system",
        "content": [
            {"type": "text", "text": HEADER},
            {"type": "text", "text": HEADER + "\nKeep it short.", "cache_control": EPHEMERAL},
            {"type": "input_text", "text": HEADER + "\nkept"},
            HEADER + "\nplain",
        ],
    },
    {"role": "user", "content": HEADER + "\nuser text is kept"},
]


def test_the_billing_line_is_cut_from_system_text_as_vllm_cuts_it() -> None:
    """`_strip_claude_code_billing_header`: a system message's string content, string parts and `text` parts
    lose a leading billing line (its `cch` changes on every request); a part that is nothing else goes. An
    `input_text` part and other roles keep it."""
    assert ChatTemplate(STRING).render(BILLED, add_generation_prompt=False) == (
        "[system]You are Claude Code.[system]Keep it short.\n"
        + HEADER
        + "\nkept\nplain[user]"
        + HEADER
        + "\nuser text is kept"
    )
    assert ChatTemplate(PARTS).render(BILLED, add_generation_prompt=False) == (
        '<system>{"type": "text", "text": "You are Claude Code."}'
        '<system>{"type": "text", "text": "Keep it short.", "cache_control": {"type": "ephemeral"}}'
        '{"type": "text", "text": "' + HEADER + '\\nkept"}{"type": "text", "text": "plain"}'
        '<user>{"type": "text", "text": "' + HEADER + '\\nuser text is kept"}'
    )
    only = [{"role": "system", "content": HEADER}, {"role": "user", "content": "Hi"}]
    assert ChatTemplate(STRING).render(only, add_generation_prompt=False) == "[system][user]Hi"


def test_requests_differing_only_in_the_billing_line_share_their_keys(service: KvIndexService) -> None:
    """The point of vLLM's cut: the engine's blocks are the same whatever the `cch` value, so must ours be."""
    expected = [
        0, 2, 87, 93, 297, 73, 81, 3, 203, 203, 61, 266, 264, 268, 404, 80, 69, 89, 306, 404, 83, 306, 18, 4,
        2, 445, 300, 3, 203, 203, 44, 77, 4, 2, 363, 87, 77, 297, 313, 88, 3, 203, 203,
    ]  # fmt: skip
    for cch in ("9f2e1", "03ab7"):
        system = f"x-anthropic-billing-header: cc_version=2.1.3; cch={cch};\nYou are Claude Code."
        body = {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
        }
        assert ids(service, CHAT, body) == expected
