"""A client's `chat_template_kwargs` as vLLM 0.32 applies them: which keys reach the template, which change
how the prompt is tokenized, which make vLLM refuse the request, and how their `tools` / `documents` meet the
request's own.

vLLM's path (0.32): `OnlineRenderer.validate_chat_template` refuses a request's own template (400) unless the
server runs with --trust-request-chat-template; `preprocess_chat` puts the request's tools (and `tokenize`
False) in as defaults that the client's kwargs override (`ChatParams.with_defaults` -> `merge_kwargs`, which
drops a value None or "auto"), while `build_chat_params` sets the request's `documents` (and the generation
flags) over the client's; `safe_apply_chat_template` takes `tools`, `chat_template` and `tokenize` as its
own parameters (so `resolve_chat_template_kwargs`' refusal of those two never fires) and hands the rest to
transformers' `apply_chat_template`, whose own parameters are not template variables.

Every expected text and id below was computed once, outside the tests, by that code of vLLM 0.32 with
transformers 5.19 on these very tokenizer files; the literals are that output.
"""

from __future__ import annotations

from typing import Any

import pytest

from epp.kvindex.chat_template import ChatTemplate, ChatTemplateError
from epp.kvindex.service import KvIndexService
from epp.requests import RequestError, build_request
from epp.types import ChatOptions
from tests.support.chat_services import ids, template_service

CHAT = {":path": "/v1/chat/completions"}
RESP = {":path": "/v1/responses"}
EMBED = {":path": "/v1/embeddings"}
USER = [{"role": "user", "content": "Hi"}]
KWARGS = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}|tokenize={{ tokenize is defined }}"
    "|padding={{ padding is defined }}|cfm={{ continue_final_message is defined }}"
    "|x={{ x if x is defined else '-' }}|y={{ y if y is defined else '-' }}"
    "|z={{ z if z is defined else '-' }}"
)
TOOLS_DOCS = (
    "T={{ tools|tojson }}|D={{ documents|tojson }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"
)
NAMED = [
    {"name": "default", "template": "D{{ messages|length }}"},
    {"name": "tool_use", "template": "T{{ tools|length }}"},
]
REQUEST_TOOL = {"type": "function", "function": {"name": "req"}}
# the tiny Llama-like template on [user "Hi"] with a generation prompt
HI = [0, 2, 445, 300, 3, 203, 203, 44, 77, 4, 2, 363, 87, 77, 297, 313, 88, 3, 203, 203]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> KvIndexService:
    return template_service(tmp_path_factory, {"kw": KWARGS, "td": TOOLS_DOCS, "named": NAMED})


def unkeyed(service: KvIndexService, headers: dict[str, str], body: dict[str, Any]) -> str | None:
    request = build_request(headers, body, {})
    tokens = request.tokens if request.tokens is not None else service.tokenize(request)
    assert tokens.ids is None, "keyed"
    return tokens.unkeyed


# --- 2. keys that are apply_chat_template's parameters: chat_template, tokenize, ... ---


@pytest.mark.parametrize(
    "headers, body",
    [
        (CHAT, {"messages": USER, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}),
        (CHAT, {"messages": USER, "chat_template_kwargs": {"chat_template": "auto"}}),
        (CHAT, {"messages": USER, "chat_template": "{{ 'x' }}"}),
        (RESP, {"input": "Hi", "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}),
        (EMBED, {"input": USER, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}),
    ],
    ids=["kwargs", "kwargs-auto", "field", "responses", "embeddings-chat"],
)
def test_a_request_bringing_its_own_template_is_routed_unkeyed(
    service: KvIndexService, headers: dict[str, str], body: dict[str, Any]
) -> None:
    """vLLM answers 400 ("Chat template is passed with request, but --trust-request-chat-template is not
    set"), or, trusting it, renders that template instead of the model's: neither is the model's prompt.
    Which one is the engine's flag's to say, so the request is routed (by load), not refused here."""
    before = service.unkeyed[("m", "request_chat_template")]
    request = build_request(headers, {"model": "m", **body}, {})
    assert service.prompt_tokens(request) is None
    assert service.unkeyed[("m", "request_chat_template")] == before + 1


def test_a_null_chat_template_is_no_template(service: KvIndexService) -> None:
    body = {
        "model": "m",
        "messages": USER,
        "chat_template": None,
        "chat_template_kwargs": {"chat_template": None},
    }
    assert ids(service, CHAT, body) == HI


@pytest.mark.parametrize("value", [5, [], {}, True])
def test_a_chat_template_field_that_is_not_a_string_is_a_400(value: Any) -> None:
    with pytest.raises(RequestError) as err:
        build_request(CHAT, {"model": "m", "messages": USER, "chat_template": value}, {})
    assert err.value.status == 400 and "'chat_template' must be a string" in err.value.message


# KWARGS rendered on [user "Hi"] then encoded: "Hi|tokenize=False|padding=False|cfm=False|x=", then
# ..."1|y=-|z=-"
KW_X_1 = [
    44, 77, 96, 359, 79, 267, 77, 305, 33, 42, 69, 80, 87, 73, 96, 84, 69, 72, 72, 322, 33, 42, 69, 80,
    87, 73, 96, 71, 74, 81, 33, 42, 69, 80, 87, 73, 96, 92, 33, 21, 96, 93, 33, 17, 96, 94, 33, 17,
]  # fmt: skip
# ..."-|y=0|z=-"
KW_Y_0 = [
    44, 77, 96, 359, 79, 267, 77, 305, 33, 42, 69, 80, 87, 73, 96, 84, 69, 72, 72, 322, 33, 42, 69, 80,
    87, 73, 96, 71, 74, 81, 33, 42, 69, 80, 87, 73, 96, 92, 33, 17, 96, 93, 33, 20, 96, 94, 33, 17,
]  # fmt: skip
# ..."-|y=-|z=-"
KW_NONE = [
    44, 77, 96, 359, 79, 267, 77, 305, 33, 42, 69, 80, 87, 73, 96, 84, 69, 72, 72, 322, 33, 42, 69, 80,
    87, 73, 96, 71, 74, 81, 33, 42, 69, 80, 87, 73, 96, 92, 33, 17, 96, 93, 33, 17, 96, 94, 33, 17,
]  # fmt: skip
TOKENIZE_TRUE = {
    "tokenize": True,
    "padding": False,
    "x": 1,
    "continue_final_message": True,
    "return_dict": True,
    "y": None,
    "z": "auto",
    "max_length": None,
}


@pytest.mark.parametrize(
    "kwargs, add_special_tokens, expected",
    [
        (TOKENIZE_TRUE, True, KW_X_1),  # no bos although add_special_tokens is true
        ({"tokenize": False, "padding": "longest", "x": "auto", "y": 0}, True, [0, *KW_Y_0]),
        ({"tokenize": "no"}, True, KW_NONE),  # a non-empty string is true
        ({"tokenize": 0, "return_tensors": "np", "truncation": True}, False, KW_NONE),
    ],
    ids=["tokenize-true", "tokenize-false", "tokenize-truthy-string", "tokenize-zero"],
)
def test_call_parameters_are_not_template_variables_and_tokenize_drops_special_tokens(
    service: KvIndexService, kwargs: dict[str, Any], add_special_tokens: bool, expected: list[int]
) -> None:
    """`tokenize`, `padding`, `continue_final_message`, `return_dict`... are taken by the call, never
    template variables; a value None or "auto" is dropped (`x`, `y`, `z` undefined then). A truthy
    `tokenize` has transformers encode the text itself without special tokens, so the request's
    `add_special_tokens: true` adds no bos (the first case's ids start without the 0 the second's has)."""
    body = {
        "model": "kw",
        "messages": USER,
        "chat_template_kwargs": kwargs,
        "add_special_tokens": add_special_tokens,
    }
    assert ids(service, CHAT, body) == expected


def test_a_template_kwarg_of_a_call_parameters_name_does_not_reach_the_template() -> None:
    kwargs = {"tokenize": False, "padding": "longest", "x": "auto", "y": 0, "continue_final_message": True}
    assert ChatTemplate(KWARGS).render(USER, template_kwargs=kwargs) == (
        "Hi|tokenize=False|padding=False|cfm=False|x=-|y=0|z=-"
    )


def test_tokenize_in_a_responses_request_drops_its_special_tokens(service: KvIndexService) -> None:
    """A Responses request is encoded with special tokens (a second bos with this tokenizer); with
    `tokenize` true, transformers encodes the text without them."""
    body = {"model": "m", "input": "Hi"}
    assert ids(service, RESP, body) == [0, *HI]
    assert ids(service, RESP, body | {"chat_template_kwargs": {"tokenize": True}}) == HI


@pytest.mark.parametrize(
    "kwargs",
    [
        {"return_assistant_tokens_mask": True},  # "requires return_dict=True and tokenize=True"
        {"messages": []},  # render() got multiple values for keyword argument 'messages'
        {"conversation": 1},  # safe_apply_chat_template() got multiple values for argument 'conversation'
        {"self": 1},  # apply_chat_template() got multiple values for argument 'self'
        {"tokenizer": 1},
        {"model_config": 1},
        {"tokenize": True, "truncation": True, "max_length": 5},  # vLLM: [0, 2, 445, 300, 3], not reproduced
        {"tokenize": True, "padding": []},  # "[] is not a valid PaddingStrategy"
        {"tokenize": True, "tokenizer_kwargs": {"add_special_tokens": True}},  # vLLM: multiple values
    ],
    ids=[
        "assistant-mask",
        "messages",
        "conversation",
        "self",
        "tokenizer",
        "model-config",
        "tokenize-truncate",
        "tokenize-bad-padding",
        "tokenize-tokenizer-kwargs",
    ],
)
def test_kwargs_vllm_fails_on_or_that_are_not_reproduced_are_unkeyed(
    service: KvIndexService, kwargs: dict[str, Any]
) -> None:
    assert unkeyed(service, CHAT, {"model": "m", "messages": USER, "chat_template_kwargs": kwargs}) == (
        "tokenizer_error"
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"return_assistant_tokens_mask": False},
        {"conversations": 1},  # dropped by vLLM: the template does not read it
        {"messages": None, "conversation": "auto"},  # dropped before the call
    ],
)
def test_harmless_kwargs_of_those_names_change_nothing(
    service: KvIndexService, kwargs: dict[str, Any]
) -> None:
    assert ids(service, CHAT, {"model": "m", "messages": USER, "chat_template_kwargs": kwargs}) == HI


# --- 3. tools and documents: the client's kwargs against the request's fields ---

NO_TOOLS = [56, 33, 63, 65, 96, 40, 33, 82, 89, 80, 80, 96, 44, 77]  # "T=[]|D=null|Hi"

TOOLS_DOCS_CASES: list[tuple[dict[str, Any], list[int] | None]] = [
    (
        {"tools": [REQUEST_TOOL]},
        [
            56, 33, 63, 95, 6, 88, 93, 84, 73, 6, 30, 225, 6, 74, 89, 82, 71, 324, 6, 16, 225, 6, 74, 89,
            82, 71, 324, 6, 30, 225, 95, 6, 82, 69, 81, 73, 6, 30, 225, 6, 268, 85, 6, 16, 225, 6, 306, 87,
            71, 316, 84, 324, 6, 30, 225, 82, 89, 80, 80, 16, 225, 6, 84, 69, 86, 69, 81, 73, 88, 300, 87, 6,
            30, 225, 82, 89, 80, 80, 97, 97, 65, 96, 40, 33, 82, 89, 80, 80, 96, 44, 77,
        ],
    ),
    (
        {"tools": [REQUEST_TOOL], "chat_template_kwargs": {"tools": [{"name": "raw", "x": 1}]}},
        [
            56, 33, 63, 95, 6, 82, 69, 81, 73, 6, 30, 225, 6, 86, 69, 91, 6, 16, 225, 6, 92, 6, 30, 225, 21,
            97, 65, 96, 40, 33, 82, 89, 80, 80, 96, 44, 77,
        ],
    ),
    ({"tools": [REQUEST_TOOL], "chat_template_kwargs": {"tools": []}}, NO_TOOLS),
    ({"chat_template_kwargs": {"tools": {}}}, NO_TOOLS),
    ({"chat_template_kwargs": {"tools": ""}}, NO_TOOLS),
    (
        {"documents": [{"title": "t"}], "chat_template_kwargs": {"documents": [{"k": "v"}]}},
        [
            56, 33, 82, 89, 80, 80, 96, 40, 33, 63, 95, 6, 88, 362, 308, 6, 30, 225, 6, 88, 6, 97, 65, 96, 44,
            77,
        ],
    ),
    (
        {"chat_template_kwargs": {"documents": [{"k": 1}]}},
        [56, 33, 82, 89, 80, 80, 96, 40, 33, 63, 95, 6, 79, 6, 30, 225, 21, 97, 65, 96, 44, 77],
    ),
    ({"chat_template_kwargs": {"documents": ""}}, [56, 33, 82, 89, 80, 80, 96, 40, 33, 6, 6, 96, 44, 77]),
    ({"chat_template_kwargs": {"documents": {}}}, [56, 33, 82, 89, 80, 80, 96, 40, 33, 95, 97, 96, 44, 77]),
    (
        {"chat_template_kwargs": {"documents": "auto"}},
        [56, 33, 82, 89, 80, 80, 96, 40, 33, 82, 89, 80, 80, 96, 44, 77],
    ),
]  # fmt: skip
# None/"auto" tools leave the request's: the first case's ids
TOOLS_DOCS_CASES += [
    ({"tools": [REQUEST_TOOL], "chat_template_kwargs": {"tools": unset}}, TOOLS_DOCS_CASES[0][1])
    for unset in (None, "auto")
]


@pytest.mark.parametrize("fields, expected", TOOLS_DOCS_CASES)
def test_tools_and_documents_meet_the_clients_kwargs_as_in_vllm(
    service: KvIndexService, fields: dict[str, Any], expected: list[int]
) -> None:
    """The client's `tools` (unless None or "auto") replace the request's and reach the template as given
    (transformers walks them into a list: `{}` and "" give []); the request's `documents` replace the
    client's, whose own reach the template as given (transformers only checks each item is an object)."""
    assert ids(service, CHAT, {"model": "td", "messages": USER, **fields}) == expected


def test_the_clients_tools_pick_the_tool_use_template(service: KvIndexService) -> None:
    chat = {"model": "named", "messages": USER}
    assert ids(service, CHAT, chat | {"chat_template_kwargs": {"tools": []}}) == [56, 20]  # "T0"
    assert ids(service, CHAT, chat | {"chat_template_kwargs": {"tools": None}}) == [40, 21]  # "D1"
    overriding = {"tools": [REQUEST_TOOL], "chat_template_kwargs": {"tools": [{}, {}, {}]}}
    assert ids(service, CHAT, chat | overriding) == [56, 23]  # "T3"


def test_the_clients_tools_are_rendered_by_a_real_template(service: KvIndexService) -> None:
    body = {
        "model": "m",
        "messages": USER,
        "tools": [REQUEST_TOOL],
        "chat_template_kwargs": {"tools": [{"name": "raw"}]},
    }
    assert ids(service, CHAT, body) == [
        0, 2, 87, 93, 297, 73, 81, 3, 203, 203, 61, 266, 225, 71, 313, 225, 71, 69, 80, 80, 285, 87, 73, 225,
        74, 89, 82, 71, 324, 87, 18, 459, 87, 91, 300, 287, 225, 46, 55, 51, 50, 225, 95, 6, 82, 69, 81, 73,
        6, 30, 225, 354, 16, 225, 6, 69, 86, 75, 89, 299, 87, 6, 30, 225, 354, 97, 18, 203, 95, 203, 225, 225,
        6, 82, 69, 81, 73, 6, 30, 225, 6, 86, 69, 91, 6, 203, 97, 203, 4, 2, 445, 300, 3, 203, 203, 44, 77, 4,
        2, 363, 87, 77, 297, 313, 88, 3, 203, 203,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"chat_template_kwargs": {"tools": {"a": 1}}}, r"chat_template_kwargs\['tools'\]\[0\]"),
        ({"chat_template_kwargs": {"tools": ["s"]}}, r"chat_template_kwargs\['tools'\]\[0\]"),
        ({"chat_template_kwargs": {"tools": 5}}, r"chat_template_kwargs\['tools'\]: .*\(got int\)"),
        ({"chat_template_kwargs": {"documents": "ab"}}, r"chat_template_kwargs\['documents'\]\[0\]"),
        ({"chat_template_kwargs": {"documents": 3}}, r"chat_template_kwargs\['documents'\]: .*\(got int\)"),
        # the request's own tools are validated even when the kwargs replace them (vLLM's request model)
        (
            {"tools": [{"type": "function", "function": {"name": 5}}], "chat_template_kwargs": {"tools": []}},
            r"tools\[0\].function needs a string 'name'",
        ),
    ],
)
def test_tools_and_documents_vllm_refuses_are_not_rendered(
    service: KvIndexService, fields: dict[str, Any], message: str
) -> None:
    """vLLM answers these with a 400 (transformers' "Tools should either be a JSON schema...", "Documents
    should be a list of dicts...", "'int' object is not iterable", or the request model's validation error):
    no prompt, the request is routed unkeyed."""
    tools, kwargs = fields.get("tools"), fields.get("chat_template_kwargs")
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(TOOLS_DOCS).render(USER, tools=tools, template_kwargs=kwargs)
    assert unkeyed(service, CHAT, {"model": "td", "messages": USER, **fields}) == "tokenizer_error"


def test_the_clients_tools_are_bounded_like_the_requests() -> None:
    deep: Any = {}
    for _ in range(40):
        deep = {"a": deep}
    with pytest.raises(ChatTemplateError, match=r"chat_template_kwargs\['tools'\].*nested deeper than"):
        ChatTemplate(TOOLS_DOCS).render(USER, template_kwargs={"tools": [deep]})


def test_the_parsed_options_keep_the_clients_kwargs_as_sent() -> None:
    """The precedence is applied where the template is rendered; the parsed request keeps what was sent."""
    body = {"model": "m", "messages": USER, "tools": [REQUEST_TOOL], "chat_template_kwargs": {"tools": []}}
    assert build_request(CHAT, body, {}).chat == ChatOptions(
        tools=[REQUEST_TOOL], chat_template_kwargs={"tools": []}
    )


# --- a Responses request: its kwargs are merged in twice, the first time as defaults ---

RESPONSES_TOOL = {"type": "function", "name": "req"}
NOTHING = [56, 33, 82, 89, 80, 80, 96, 40, 33, 82, 89, 80, 80, 96, 44, 77]  # "T=null|D=null|Hi"


def test_a_responses_requests_none_and_auto_kwargs_reach_the_template(service: KvIndexService) -> None:
    """`render_responses` passes `effective_chat_template_kwargs` to `preprocess_chat` as defaults, and
    `merge_kwargs` filters None and "auto" from overrides only: they stay (where a chat completion drops
    them), but for `tokenize` and the call's other parameters, which are not template variables anyway."""
    body = {"model": "kw", "input": "Hi", "chat_template_kwargs": {"x": None, "y": "auto", "z": 0}}
    assert ids(service, RESP, body) == [
        0, 44, 77, 96, 359, 79, 267, 77, 305, 33, 42, 69, 80, 87, 73, 96, 84, 69, 72, 72, 322, 33, 42, 69,
        80, 87, 73, 96, 71, 74, 81, 33, 42, 69, 80, 87, 73, 96, 92, 33, 50, 479, 96, 93, 33, 69, 89, 359, 96,
        94, 33, 20,
    ]  # fmt: skip  # "Hi|tokenize=False|padding=False|cfm=False|x=None|y=auto|z=0" with a bos
    body = {"model": "kw", "input": "Hi", "chat_template_kwargs": {"tokenize": None, "padding": None}}
    assert ids(service, RESP, body) == [0, *KW_NONE]


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"chat_template_kwargs": {"tools": None}}, [0, *NOTHING]),
        ({"chat_template_kwargs": {"documents": None}}, [0, *NOTHING]),
        (
            {"tools": [RESPONSES_TOOL], "chat_template_kwargs": {"tools": "auto"}},  # the request's tools win
            [0, *TOOLS_DOCS_CASES[0][1]],  # "T=[{...req...}]|D=null|Hi"
        ),
        (
            {"tools": [RESPONSES_TOOL], "chat_template_kwargs": {"tools": [{"name": "raw"}]}},
            [
                0, 56, 33, 63, 95, 6, 82, 69, 81, 73, 6, 30, 225, 6, 86, 69, 91, 6, 97, 65, 96, 40, 33, 82,
                89, 80, 80, 96, 44, 77,
            ],
        ),
        ({"chat_template_kwargs": {"tokenize": True}}, NOTHING),  # no bos
        ({"chat_template_kwargs": {"tools": "auto"}}, None),  # transformers walks "auto": not objects
        ({"chat_template_kwargs": {"documents": "auto"}}, None),
        ({"chat_template_kwargs": {"conversation": None}}, None),  # got multiple values for 'conversation'
        ({"chat_template_kwargs": {"tokenize": True, "padding": None}}, None),  # not a valid PaddingStrategy
    ],
)  # fmt: skip
def test_a_responses_requests_tools_and_documents_kwargs_as_vllm_renders_them(
    service: KvIndexService, fields: dict[str, Any], expected: list[int] | None
) -> None:
    body = {"model": "td", "input": "Hi", **fields}
    if expected is None:
        assert unkeyed(service, RESP, body) == "tokenizer_error"
    else:
        assert ids(service, RESP, body) == expected
