"""A model's vLLM server-side chat settings mirrored in the config (`tokenizers: {model: {path, ...}}`).

vLLM 0.32's rules (read in its source, no vLLM needed here):
- `--default-chat-template-kwargs` (`vllm/entrypoints/openai/cli_args.py`): `OnlineRenderer.preprocess_chat`
  (`vllm/renderers/online_renderer.py`) merges `{tools: <the request's>, tokenize: False}` over them
  (`merge_kwargs`, `vllm/renderers/params.py`, skips None and "auto" overrides), then
  `ChatParams.with_defaults` merges the request's kwargs over that (`build_chat_params` has already put the
  request's documents, generation flags and `reasoning_effort` / `enable_thinking` over the client's). A
  Responses request's kwargs are merged in first by `render_responses` with the same `with_defaults`, which
  with server defaults filters None and "auto" (without them it returns the kwargs untouched).
- `--chat-template` (`load_chat_template`, `vllm/renderers/chat_utils/chat_template.py`): a readable file,
  else the value itself when it has `{`, `}` or a newline, else vLLM refuses to start; `resolve_chat_template`
  (`vllm/renderers/hf.py`) uses it before any of the tokenizer's templates, with or without tools.
- `--chat-template-content-format` (`resolve_chat_template_content_format`, `vllm/renderers/hf.py`): a
  format other than "auto" is used as given.

The expected texts below follow those rules by hand; the expected keys are those texts' ids, chained.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from epp.cli import _load, main
from epp.config import ConfigError, parse_config
from epp.kvindex.chat_inputs import ChatTemplateError
from epp.kvindex.chat_template import ChatTemplate
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import block_keys, root_key
from epp.kvindex.prompt import TokenizerError, TokenizerRegistry
from epp.kvindex.server_chat import ServerChatSettings, TokenizerSpec
from epp.kvindex.service import KvIndexService
from epp.requests import build_request
from epp.testing.tokenizer import build_tiny_tokenizer
from epp.types import ChatOptions
from tests.support.chat_services import with_template
from tests.unit.test_chat_template_vllm import QWEN3

HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
CHAT = {":path": "/v1/chat/completions"}
RESP = {":path": "/v1/responses"}
USER = [{"role": "user", "content": "Hi"}]
BLOCK = 4
VARS = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "|x={{ x if x is defined else '-' }}|y={{ y if y is defined else '-' }}"
    "|z={{ z if z is defined else '-' }}"
    "|T={{ tools|tojson }}|D={{ documents|tojson }}"
)
SERVER_KWARGS = {
    "x": "s",
    "y": "s",
    "tools": [{"name": "srv"}],
    "documents": [{"t": "srv"}],
    "tokenize": True,
}
REQUEST_TOOL = {"type": "function", "function": {"name": "req"}}
THINK_OFF = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
THINK_ON = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny"))


def service(paths: dict[str, str | Path | TokenizerSpec]) -> KvIndexService:
    return KvIndexService(BlockIndex(BLOCK, 1000), FreshnessTracker(), TokenizerRegistry(paths), BLOCK)


def variant(tiny: Path, tmp_path: Path, name: str, template: Any) -> Path:
    return with_template(tiny, tmp_path / name, template)


def keys_of(svc: KvIndexService, headers: dict[str, str], body: dict[str, Any]) -> list[int] | None:
    keys = svc.prompt_keys(build_request(headers, body, {}))
    return None if keys is None else [int(k) for k in keys]


def expected_keys(svc: KvIndexService, model: str, text: str, *, special: bool = False) -> list[int]:
    """The keys of the prompt vLLM renders as `text` (a chat completion encodes it without special tokens)."""
    tok = svc.tokenizers.get(model)
    assert tok is not None
    ids = tok.encode_uncached(text, add_special_tokens=special)
    return [int(k) for k in block_keys(ids, BLOCK, root_key(model, None))]


def rendered(svc: KvIndexService, model: str, body: dict[str, Any], headers: dict[str, str] = CHAT) -> str:
    tok = svc.tokenizers.get(model)
    request = build_request(headers, {"model": model, **body}, {})
    assert tok is not None and request.messages is not None
    chat = request.chat or ChatOptions()
    return tok.render_chat(
        request.messages,
        tools=chat.tools,
        documents=chat.documents,
        chat_template_kwargs=chat.chat_template_kwargs,
        keep_unset_kwargs=headers is RESP,
    )


# --- --default-chat-template-kwargs ---


@pytest.fixture(scope="module")
def qwen(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> KvIndexService:
    root = tmp_path_factory.mktemp("qwen")
    directory = variant(tiny, root, "qwen3", QWEN3)
    chat = ServerChatSettings({"enable_thinking": False})
    return service({"served": TokenizerSpec(str(directory), chat), "plain": directory})


@pytest.mark.parametrize(
    "fields, text",
    [
        ({}, THINK_OFF),  # the server's default
        ({"chat_template_kwargs": {"enable_thinking": True}}, THINK_ON),  # the request's win
        ({"chat_template_kwargs": {"enable_thinking": None}}, THINK_OFF),  # merge_kwargs drops a None
        ({"chat_template_kwargs": {"enable_thinking": "auto"}}, THINK_OFF),  # ... and an "auto"
        ({"reasoning_effort": "high"}, THINK_ON),  # build_chat_params' enable_thinking wins too
        ({"reasoning_effort": "none"}, THINK_OFF),
    ],
)
def test_qwen3_with_thinking_off_on_the_server_is_keyed_as_vllm_renders_it(
    qwen: KvIndexService, fields: dict[str, Any], text: str
) -> None:
    body = {"model": "served", "messages": USER, **fields}
    assert rendered(qwen, "served", body) == text
    assert keys_of(qwen, CHAT, body) == expected_keys(qwen, "served", text)


def test_server_defaults_key_a_chat_as_the_same_kwargs_sent_by_the_client(qwen: KvIndexService) -> None:
    """vLLM with `--default-chat-template-kwargs '{"enable_thinking": false}'` renders a bare request as a
    server without it renders the request that sends those kwargs: the same ids, the same keys."""
    served = qwen.prompt_tokens(build_request(CHAT, {"model": "served", "messages": USER}, {}))
    sent = {"model": "plain", "messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    plain = qwen.prompt_tokens(build_request(CHAT, sent, {}))
    assert served is not None and plain is not None and list(served) == list(plain)


def test_a_model_without_server_settings_is_rendered_as_before(qwen: KvIndexService) -> None:
    assert rendered(qwen, "plain", {"messages": USER}) == THINK_ON
    body = {"model": "plain", "messages": USER}
    assert keys_of(qwen, CHAT, body) == expected_keys(qwen, "plain", THINK_ON)


def test_a_responses_request_gets_the_server_defaults_too(qwen: KvIndexService) -> None:
    body = {"model": "served", "input": "Hi"}
    assert rendered(qwen, "served", body, RESP) == THINK_OFF
    # a Responses request is encoded with add_special_tokens=True (vLLM's ResponsesRequest.build_tok_params)
    assert keys_of(qwen, RESP, body) == expected_keys(qwen, "served", THINK_OFF, special=True)
    body = {"model": "served", "input": "Hi", "reasoning": {"effort": "low"}}
    assert rendered(qwen, "served", body, RESP) == THINK_ON


@pytest.fixture(scope="module")
def layered(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> KvIndexService:
    root = tmp_path_factory.mktemp("layered")
    directory = variant(tiny, root, "vars", VARS)
    spec = TokenizerSpec(str(directory), ServerChatSettings(SERVER_KWARGS))
    return service({"served": spec, "plain": directory})


SRV_T = '[{"name": "srv"}]'
SRV_D = '[{"t": "srv"}]'
REQ_T = '[{"type": "function", "function": {"name": "req", "description": null, "parameters": null}}]'


@pytest.mark.parametrize(
    "fields, text",
    [
        ({}, f"Hi|x=s|y=s|z=-|T={SRV_T}|D={SRV_D}"),
        ({"chat_template_kwargs": {"y": "c", "z": "c"}}, f"Hi|x=s|y=c|z=c|T={SRV_T}|D={SRV_D}"),
        ({"chat_template_kwargs": {"x": None, "y": "auto"}}, f"Hi|x=s|y=s|z=-|T={SRV_T}|D={SRV_D}"),
        ({"tools": [REQUEST_TOOL]}, f"Hi|x=s|y=s|z=-|T={REQ_T}|D={SRV_D}"),  # the request's tools win
        (
            {"tools": [REQUEST_TOOL], "chat_template_kwargs": {"tools": [{"name": "cli"}]}},
            f'Hi|x=s|y=s|z=-|T=[{{"name": "cli"}}]|D={SRV_D}',  # ... and the client's over those
        ),
        ({"chat_template_kwargs": {"tools": None}}, f"Hi|x=s|y=s|z=-|T={SRV_T}|D={SRV_D}"),
        (
            {"chat_template_kwargs": {"documents": [{"t": "cli"}]}},
            f'Hi|x=s|y=s|z=-|T={SRV_T}|D=[{{"t": "cli"}}]',
        ),
        (
            {"documents": [{"t": "req"}], "chat_template_kwargs": {"documents": [{"t": "cli"}]}},
            f'Hi|x=s|y=s|z=-|T={SRV_T}|D=[{{"t": "req"}}]',  # the request's documents over everything
        ),
    ],
)
def test_the_merge_order_is_vllms(layered: KvIndexService, fields: dict[str, Any], text: str) -> None:
    body = {"model": "served", "messages": USER, **fields}
    assert rendered(layered, "served", body) == text
    assert keys_of(layered, CHAT, body) == expected_keys(layered, "served", text)


def test_the_servers_tokenize_never_counts(layered: KvIndexService) -> None:
    """`preprocess_chat` sets `tokenize` False over the server's: the request's add_special_tokens holds."""
    body = {"model": "served", "messages": USER, "add_special_tokens": True}
    text = f"Hi|x=s|y=s|z=-|T={SRV_T}|D={SRV_D}"
    assert keys_of(layered, CHAT, body) == expected_keys(layered, "served", text, special=True)
    assert expected_keys(layered, "served", text, special=True) != expected_keys(layered, "served", text)


def test_a_responses_requests_unset_kwargs_are_dropped_once_the_server_has_defaults(
    layered: KvIndexService,
) -> None:
    """`render_responses` merges the client's kwargs over the server's with `with_defaults`, which filters
    None and "auto" when there are defaults (and hands them on untouched when there are none)."""
    body = {"input": "Hi", "chat_template_kwargs": {"x": None, "z": "auto"}}
    assert rendered(layered, "served", body, RESP) == f"Hi|x=s|y=s|z=-|T={SRV_T}|D={SRV_D}"
    assert rendered(layered, "plain", body, RESP) == "Hi|x=None|y=-|z=auto|T=null|D=null"


def test_a_server_default_vllm_cannot_render_leaves_that_request_unkeyed_and_no_other(
    tiny: Path, tmp_path: Path
) -> None:
    """Server tools "auto" reach transformers, which fails on them (each item must be an object) for every
    request without tools of its own; requests with tools, and other models, are keyed as usual."""
    directory = variant(tiny, tmp_path, "vars", VARS)
    svc = service(
        {"bad": TokenizerSpec(str(directory), ServerChatSettings({"tools": "auto"})), "ok": directory}
    )
    assert keys_of(svc, CHAT, {"model": "bad", "messages": USER}) is None
    assert svc.unkeyed[("bad", "tokenizer_error")] == 1
    text = f"Hi|x=-|y=-|z=-|T={REQ_T}|D=null"
    assert keys_of(svc, CHAT, {"model": "bad", "messages": USER, "tools": [REQUEST_TOOL]}) == expected_keys(
        svc, "bad", text
    )
    assert keys_of(svc, CHAT, {"model": "ok", "messages": USER}) == expected_keys(
        svc, "ok", "Hi|x=-|y=-|z=-|T=null|D=null"
    )


# --- --chat-template and --chat-template-content-format ---

NAMED = [
    {"name": "default", "template": "D{{ messages|length }}"},
    {"name": "tool_use", "template": "T{{ tools|length }}"},
]
SERVER_TEMPLATE = "S:{% for m in messages %}{{ m['content'] }}{% endfor %}:{{ tools|length if tools else 0 }}"
PARTS = "{% for m in messages %}{% for p in m['content'] %}[{{ p }}]{% endfor %}{% endfor %}"


@pytest.mark.parametrize("inline", [False, True])
def test_the_servers_template_replaces_the_tokenizers_for_every_chat(
    tiny: Path, tmp_path: Path, inline: bool
) -> None:
    directory = variant(tiny, tmp_path, "named", NAMED)
    file = tmp_path / "server.jinja"
    file.write_text(SERVER_TEMPLATE)
    value = SERVER_TEMPLATE if inline else str(file)
    svc = service(
        {"served": TokenizerSpec(str(directory), ServerChatSettings(chat_template=value)), "plain": directory}
    )
    assert rendered(svc, "served", {"messages": USER}) == "S:Hi:0"
    assert rendered(svc, "served", {"messages": USER, "tools": [REQUEST_TOOL]}) == "S:Hi:1"
    assert keys_of(svc, CHAT, {"model": "served", "messages": USER}) == expected_keys(svc, "served", "S:Hi:0")
    # without the setting, the tokenizer's own pick (vLLM's too): default without tools, tool_use with
    assert rendered(svc, "plain", {"messages": USER}) == "D1"
    assert rendered(svc, "plain", {"messages": USER, "tools": [REQUEST_TOOL]}) == "T1"


def test_a_tokenizer_without_a_template_is_served_with_the_servers(tiny: Path, tmp_path: Path) -> None:
    directory = tmp_path / "bare"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((tiny / "tokenizer.json").read_bytes())
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    svc = service(
        {"served": TokenizerSpec(str(directory), ServerChatSettings(chat_template=SERVER_TEMPLATE))}
    )
    assert svc.tokenizers.get("served") is not None and svc.tokenizers.get("served").has_chat_template  # type: ignore[union-attr]
    assert rendered(svc, "served", {"messages": USER}) == "S:Hi:0"


@pytest.mark.parametrize(
    "template, given, text",
    [
        (PARTS, "auto", "[{'type': 'text', 'text': 'Hi'}]"),  # detected: openai
        (PARTS, "string", "[H][i]"),  # forced: the content is a string
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "auto", "Hi"),
        (
            "{% for m in messages %}{{ m['content'] }}{% endfor %}",
            "openai",
            "[{'type': 'text', 'text': 'Hi'}]",
        ),
    ],
)
def test_a_given_content_format_replaces_the_detected_one(
    tiny: Path, tmp_path: Path, template: str, given: str, text: str
) -> None:
    directory = variant(tiny, tmp_path, "fmt", template)
    svc = service({"m": TokenizerSpec(str(directory), ServerChatSettings(content_format=given))})
    assert rendered(svc, "m", {"messages": USER}) == text
    assert keys_of(svc, CHAT, {"model": "m", "messages": USER}) == expected_keys(svc, "m", text)


def test_an_unknown_content_format_is_refused_by_the_template_too() -> None:
    with pytest.raises(
        ChatTemplateError, match="content format must be one of auto, string, openai, got 'json'"
    ):
        ChatTemplate("x", content_format="json")


# --- the config ---


def test_the_plain_and_the_object_forms_parse(tmp_path: Path) -> None:
    cfg = parse_config(
        HEAD + "tokenizers:\n"
        "  plain: /models/plain\n"
        "  bare: {path: /models/bare}\n"
        "  empty: {path: /models/empty, defaultChatTemplateKwargs: {}, chatTemplateContentFormat: auto}\n"
        "  Qwen/Qwen3-8B:\n"
        "    path: /models/qwen\n"
        "    defaultChatTemplateKwargs: {enable_thinking: false, depth: [1, {a: null}]}\n"
        "    chatTemplate: /etc/epp/qwen.jinja\n"
        "    chatTemplateContentFormat: openai\n",
        "epp.yaml",
    )
    assert cfg.tokenizers == {
        "plain": "/models/plain",  # as before
        "bare": "/models/bare",  # no settings: a directory, as in the plain form
        "empty": "/models/empty",
        "Qwen/Qwen3-8B": TokenizerSpec(
            "/models/qwen",
            ServerChatSettings(
                {"enable_thinking": False, "depth": [1, {"a": None}]}, "/etc/epp/qwen.jinja", "openai"
            ),
        ),
    }


GOOD = (
    "  ok: /models/ok\n  served: {path: /models/qwen, defaultChatTemplateKwargs: {enable_thinking: false}}\n"
)


K = "defaultChatTemplateKwargs"
F = "chatTemplateContentFormat"
BAD_ENTRIES = [
    ("5", "(the entry)", "must be a tokenizer directory or an object with a `path`"),
    ("{chatTemplate: /t.jinja}", "path", "missing required field `path`"),
    ("{path: ''}", "path", "needs a model name and a directory"),
    ("{path: /m, trustRequestChatTemplate: true}", "trustRequestChatTemplate", "unknown field"),
    (f"{{path: /m, {K}: [1]}}", K, "Expected `object | null`, got `array`"),
    (f"{{path: /m, {K}: '{{\"a\": 1}}'}}", K, "Expected `object | null`, got `str`"),  # not a JSON string
    (f"{{path: /m, {K}: {{1: a}}}}", f"{K} (a key)", "Expected `str`, got `int`"),
    (f"{{path: /m, {K}: {{d: 2024-01-01}}}}", K, "key 'd': date is not a JSON value"),
    (f"{{path: /m, {K}: {{conversation: 1}}}}", K, "vLLM fails every chat"),
    (f"{{path: /m, {K}: {{chat_template: x}}}}", K, "give the server's template as chatTemplate"),
    (f"{{path: /m, {K}: {{return_assistant_tokens_mask: true}}}}", K, "vLLM refuses a chat with it"),
    ("{path: /m, chatTemplate: 5}", "chatTemplate", "Expected `str | null`"),
    ("{path: /m, chatTemplate: ' '}", "chatTemplate", "must be a template file or a template"),
    (
        "{path: /m, chatTemplate: '{% if %}'}",
        "chatTemplate",
        "not a valid chat template: syntax error on line 1",
    ),
    (f"{{path: /m, {F}: json}}", F, "must be one of auto, string, openai"),
    (f"{{path: /m, {F}: true}}", F, "Expected `str`, got `bool`"),
]


@pytest.mark.parametrize("entry, field, message", BAD_ENTRIES)
def test_bad_entries_are_config_errors_naming_the_model_and_field(
    entry: str, field: str, message: str
) -> None:
    text = HEAD + "index: {blockSize: 32}\ntokenizers:\n" + GOOD + f"  bad: {entry}\n"
    with pytest.raises(ConfigError) as err:
        parse_config(text, "epp.yaml")
    assert (err.value.source, err.value.where, err.value.field) == ("epp.yaml", "tokenizers 'bad'", field)
    assert message in err.value.message
    # nothing else was lost: without the bad entry, the rest of the file loads as written
    cfg = parse_config(text.replace(f"  bad: {entry}\n", ""), "epp.yaml")
    assert cfg.index.block_size == 32 and set(cfg.tokenizers) == {"ok", "served"}


def test_a_nested_too_deep_default_is_a_config_error() -> None:
    deep = "[" * 40 + "]" * 40
    with pytest.raises(ConfigError) as err:
        parse_config(
            HEAD + f"tokenizers: {{m: {{path: /m, defaultChatTemplateKwargs: {{k: {deep}}}}}}}\n", "e"
        )
    assert err.value.field == "defaultChatTemplateKwargs" and "nested deeper than 32" in err.value.message


# --- loading: the template file (where the EPP runs) ---


def test_the_config_entry_loads_and_keys_as_vllm_renders(tiny: Path, tmp_path: Path) -> None:
    directory = variant(tiny, tmp_path, "qwen3", QWEN3)
    cfg = parse_config(
        HEAD
        + f"tokenizers: {{m: {{path: {directory}, defaultChatTemplateKwargs: {{enable_thinking: false}}}}}}\n"
    )
    svc = service(dict(cfg.tokenizers))
    assert keys_of(svc, CHAT, {"model": "m", "messages": USER}) == expected_keys(svc, "m", THINK_OFF)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: str(d / "missing.jinja"), "looks like a file path, but cannot be read"),
        (lambda d: str(d), "looks like a file path, but cannot be read"),  # a directory
        (lambda d: _write(d / "bad.jinja", "{% for %}"), "syntax error on line 1"),
        (lambda d: _write(d / "bad.jinja", "{{ x }"), "syntax error"),
    ],
)
def test_a_template_file_that_is_missing_or_not_jinja_fails_the_load_naming_it(
    tiny: Path, tmp_path: Path, make: Any, message: str
) -> None:
    value = make(tmp_path)
    spec = TokenizerSpec(str(tiny), ServerChatSettings(chat_template=value))
    with pytest.raises(TokenizerError) as err:
        TokenizerRegistry({"ok": tiny, "m": spec})
    text = str(err.value)
    assert text.startswith("model 'm' (tokenizer at ") and "chatTemplate (vLLM's --chat-template)" in text
    assert value in text and message in text
    # nothing else was lost: the other model, and this one without the setting, load as before
    registry = TokenizerRegistry({"ok": tiny, "m": tiny})
    assert registry.models() == ["ok", "m"]


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_check_config_reads_the_template_file_unless_tokenizers_are_skipped(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The file, like the tokenizer directory, may exist only in the EPP's pod."""
    path = tmp_path / "epp.yaml"
    missing = tmp_path / "nope.jinja"
    path.write_text(HEAD + f"tokenizers: {{m: {{path: {tiny}, chatTemplate: {missing}}}}}\n")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "tokenizer error" in err and "chatTemplate" in err and str(missing) in err
    assert main(["check-config", "--skip-tokenizers", str(path)]) == 0
    assert "ok (tokenizers not loaded)" in capsys.readouterr().out
    missing.write_text(SERVER_TEMPLATE)
    assert main(["check-config", str(path)]) == 0


def test_the_tokenizer_flag_replaces_the_directory_and_keeps_the_settings(tmp_path: Path) -> None:
    config = tmp_path / "epp.yaml"
    config.write_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        "tokenizers:\n  m: {path: /old, defaultChatTemplateKwargs: {enable_thinking: false}}\n  n: /n-old\n"
    )
    args = argparse.Namespace(
        config=str(config), config_text=None, tokenizer=[("m", "/new"), ("n", "/n-new"), ("o", "/o")]
    )
    for name in (
        "kv_events_mode",
        "kv_events_port",
        "kv_events_bind",
        "kv_events_replay_port",
        "kv_events_verify_peer",
        "kv_events_topic",
    ):
        setattr(args, name, None)
    tokenizers = _load(args).tokenizers
    m = tokenizers["m"]
    assert isinstance(m, TokenizerSpec) and m.path == "/new"
    assert m.chat.default_kwargs == {"enable_thinking": False}
    assert tokenizers["n"] == "/n-new" and tokenizers["o"] == "/o"


# --- --exclude-tools-when-tool-choice-none ---

TOOLS_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "|tools={{ tools|tojson if tools is defined and tools is not none else '-' }}"
)
WITH_TOOLS = (
    'Hi|tools=[{"type": "function", "function": {"name": "req", "description": null, "parameters": null}}]'
)
RESP_TOOL = {"type": "function", "name": "req", "description": None, "parameters": None}


@pytest.fixture(scope="module")
def excluding(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> KvIndexService:
    directory = variant(tiny, tmp_path_factory.mktemp("excl"), "tools", TOOLS_TEMPLATE)
    chat = ServerChatSettings(exclude_tools_when_tool_choice_none=True)
    return service({"excluding": TokenizerSpec(str(directory), chat), "plain": directory})


@pytest.mark.parametrize(
    "fields, excluded",
    [
        ({"tool_choice": "none"}, True),
        ({"tool_choice": "auto"}, False),
        ({"tool_choice": None}, False),  # null is not "none"
        ({}, False),  # with tools, vLLM's default tool_choice is "auto" (check_tool_usage)
        ({"tool_choice": {"type": "function", "function": {"name": "req"}}}, False),
    ],
)
def test_a_server_excluding_tools_renders_a_tool_choice_none_chat_without_them(
    excluding: KvIndexService, fields: dict[str, Any], excluded: bool
) -> None:
    """vLLM's --exclude-tools-when-tool-choice-none (OnlineRenderer.render_chat): tool_dicts = None when
    tool_choice is "none"; off (vLLM's default, `plain`), the tools reach the template whatever the choice."""
    body = {"messages": USER, "tools": [REQUEST_TOOL], **fields}
    with_tools = WITH_TOOLS
    text = "Hi|tools=-" if excluded else with_tools
    assert keys_of(excluding, CHAT, {"model": "excluding", **body}) == expected_keys(
        excluding, "excluding", text
    )
    assert keys_of(excluding, CHAT, {"model": "plain", **body}) == expected_keys(
        excluding, "plain", with_tools
    )


def test_a_server_excluding_tools_renders_a_tool_choice_none_responses_request_without_them(
    excluding: KvIndexService,
) -> None:
    """The Responses API's tool_choice defaults to "auto"; "none" with the flag: construct_tool_dicts gives
    None. (A Responses request is encoded with special tokens.)"""
    body = {"input": "Hi", "tools": [RESP_TOOL]}
    with_tools = WITH_TOOLS
    for fields, text in (({}, with_tools), ({"tool_choice": "none"}, "Hi|tools=-")):
        keys = keys_of(excluding, RESP, {"model": "excluding", **body, **fields})
        assert keys == expected_keys(excluding, "excluding", text, special=True)
    plain = keys_of(excluding, RESP, {"model": "plain", **body, "tool_choice": "none"})
    assert plain == expected_keys(excluding, "plain", with_tools, special=True)


def test_required_with_an_empty_tools_list_is_none_without_tools() -> None:
    """vLLM's check_tool_usage turns tool_choice "required" with `tools: []` into "none", dropping them."""
    r = build_request(CHAT, {"model": "m", "messages": USER, "tools": [], "tool_choice": "required"}, {})
    assert r.chat is None  # no tools: nothing reaches the template, as for a chat without them
    r = build_request(CHAT, {"model": "m", "messages": USER, "tools": [], "tool_choice": "auto"}, {})
    assert r.chat == ChatOptions(tools=[])


def test_exclude_tools_when_tool_choice_none_is_read_from_the_config() -> None:
    cfg = parse_config(
        HEAD + "tokenizers: {m: {path: /m, excludeToolsWhenToolChoiceNone: true}, n: {path: /n,"
        " excludeToolsWhenToolChoiceNone: false}}\n",
        "epp.yaml",
    )
    assert cfg.tokenizers == {
        "m": TokenizerSpec("/m", ServerChatSettings(exclude_tools_when_tool_choice_none=True)),
        "n": "/n",  # vLLM's default: nothing to mirror
    }
    with pytest.raises(ConfigError) as err:
        parse_config(HEAD + "tokenizers: {m: {path: /m, excludeToolsWhenToolChoiceNone: sometimes}}\n", "e")
    assert err.value.field == "excludeToolsWhenToolChoiceNone"
