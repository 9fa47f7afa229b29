"""A model's vLLM server-side chat settings, as the EPP config mirrors them. Pure.

vLLM renders every chat with what its server was started with as well as what the request sends: the
settings here (`--default-chat-template-kwargs`, `--chat-template`, `--chat-template-content-format`) are
given per model in the config (`tokenizers: {model: {path, ...}}`) and applied where vLLM applies them
(`chat_inputs.template_inputs`, `chat_template.py`, `prompt.py`). This module holds their types and the
config-time checks of the default kwargs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from epp.kvindex.chat_inputs import ChatTemplateError, check_depth

CONTENT_FORMATS = ("auto", "string", "openai")
"""vLLM's `ChatTemplateContentFormatOption` (`--chat-template-content-format`): "auto" detects the format
from the template's AST (`chat_template.detect_content_format`), the others force it."""

TOKENIZER_MODES = ("auto", "hf", "mistral")
"""The `--tokenizer-mode` values mirrored: "auto" is Mistral's tokenizer when the directory has Mistral's
files (`tokenizer_files.mistral_files`), else Hugging Face's; "hf" always Hugging Face's (the one the EPP
reproduces); "mistral" always `mistral_common`'s (not reproduced: text and chat prompts are unkeyed). vLLM's
other modes (`slow`, `deepseek_v32`, `custom`, ...) load tokenizers the EPP does not reproduce either."""


@dataclass(frozen=True, slots=True)
class ServerChatSettings:
    """What one model's vLLM server was started with that changes every chat prompt, as the EPP config
    mirrors it (`tokenizers: {model: {path, defaultChatTemplateKwargs, chatTemplate,
    chatTemplateContentFormat}}`). vLLM 0.32's flags (`vllm/entrypoints/openai/cli_args.py`,
    `BaseFrontendArgs`): `--default-chat-template-kwargs` (a JSON object, "merged with request-level
    chat_template_kwargs, with request values taking precedence"), `--chat-template` (a file path, else the
    template itself: `vllm/renderers/chat_utils/chat_template.py`, `load_chat_template`), and
    `--chat-template-content-format` (`auto`, `string`, `openai`), `--exclude-tools-when-tool-choice-none`
    (off by default: a request's `tools` reach the template even with `tool_choice: "none"`; on, they do not:
    `OnlineRenderer.render_chat` in `vllm/renderers/online_renderer.py`, `construct_tool_dicts` for the
    Responses API); and vLLM's engine flag `--tokenizer-mode` (`vllm/config/model.py`, `TOKENIZER_MODES`),
    which decides whose tokenizer and renderer run."""

    default_kwargs: Mapping[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # the config's value: a file path or the template itself
    content_format: str = "auto"
    tokenizer_mode: str = "auto"
    exclude_tools_when_tool_choice_none: bool = False

    @property
    def is_default(self) -> bool:
        """Whether these are vLLM's defaults (nothing to mirror)."""
        return (
            not self.default_kwargs
            and self.chat_template is None
            and self.content_format == "auto"
            and self.tokenizer_mode == "auto"
            and not self.exclude_tools_when_tool_choice_none
        )


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """A `tokenizers` entry with server-side chat settings: the tokenizer directory and the settings."""

    path: str
    chat: ServerChatSettings = field(default_factory=ServerChatSettings)


# keys of --default-chat-template-kwargs that make vLLM fail every chat request (or, `chat_template`, that
# would replace the template by a path the EPP does not reproduce): refused when the config is loaded
_REFUSED_DEFAULTS = {
    "chat_template": "give the server's template as chatTemplate (vLLM's --chat-template)",
    "return_assistant_tokens_mask": "vLLM refuses a chat with it",
    **dict.fromkeys(
        ("conversation", "self", "model_config", "tokenizer"),
        "vLLM fails every chat with it (the call already has that argument)",
    ),
}


def _json_problem(value: Any, where: str) -> str | None:
    """Where `value` holds something that JSON (vLLM's `json.loads` of the flag) cannot: a date, a set,
    a non-string key..."""
    if value is None or isinstance(value, bool | int | float | str):
        return None
    if isinstance(value, list):
        return next((p for i, v in enumerate(value) if (p := _json_problem(v, f"{where}[{i}]"))), None)
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{where}: key {k!r} is not a string"
            if (p := _json_problem(v, f"{where}.{k}")) is not None:
                return p
        return None
    return f"{where}: {type(value).__name__} is not a JSON value"


def default_kwargs_problem(kwargs: Mapping[str, Any]) -> str | None:
    """Why `kwargs` cannot be a server's --default-chat-template-kwargs, or None."""
    for key, why in _REFUSED_DEFAULTS.items():
        if key in kwargs and (key != "return_assistant_tokens_mask" or kwargs[key]):
            return f"key {key!r}: {why}"
    for key, value in kwargs.items():
        if not isinstance(key, str):
            return f"key {key!r} is not a string"
        problem = _json_problem(value, f"key {key!r}")
        if problem is None:
            try:
                check_depth(value, f"key {key!r}")
            except ChatTemplateError as e:
                problem = str(e)
        if problem is not None:
            return problem
    return None
