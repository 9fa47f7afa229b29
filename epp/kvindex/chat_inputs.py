"""What a chat template is given, built from a request as vLLM builds it (text only).

Pure: no I/O. Follows vLLM's chat path (`ChatCompletionRequest` validation, `parse_chat_messages`,
`OnlineRenderer.render_chat`, the HF renderer's developer-role fallback):

- Messages: a message's `reasoning_content` is renamed `reasoning` (an existing `reasoning` wins), and an
  assistant message with reasoning carries both `reasoning` and `reasoning_content`. Text parts are joined
  with "\\n" for "string" templates, falsy parts (empty text) dropped; they become
  `{"type": "text", "text": ...}` parts for "openai" ones, followed by the part's own keys that no vLLM
  content-part type declares (`cache_control`, as Anthropic-style clients send: `_collect_extra_fields`;
  a plain string part or string content has none, a tool reference keeps only its name); `tool` messages
  with text-only parts get a joined string; only role, content, name, tool_calls (assistant), tool_call_id
  (tool), reasoning and task are kept. A system message's text (a string, or a `text` part) that starts
  with Claude Code's `x-anthropic-billing-header` line loses that line (the part goes if nothing follows).
  Tool calls must be `function` objects; their `arguments` become an object (a JSON string is parsed;
  invalid JSON, or JSON that is not an object, gives `{}`). `developer` messages become `system`
  (all system messages merged into the first) when the template does not know the role.
- Tools: `[tool.model_dump() for tool in request.tools]` of vLLM's `ChatCompletionToolsParam`: `type` is
  "function" (any other type is refused), `function` keeps `name`, `description` and `parameters` (null
  when absent) in that order, then `strict` and `defer_loading` when set; a tool's own `defer_loading` is
  copied to its function's when that is unset; every other key is dropped.
- Documents: objects of strings (vLLM's `list[dict[str, str]]`).
- `chat_template_kwargs` (`template_inputs`), as vLLM merges them (`merge_kwargs`: a value None or "auto" is
  dropped, but for a Responses request's) and transformers' `apply_chat_template` takes them: their `tools`
  win over the request's (given to the template as they are, each an object), the request's `documents` win
  over theirs; keys that are `apply_chat_template` parameters (`tokenize`, `chat_template`, `padding`, ...)
  never reach the template; the few that make vLLM fail (`return_assistant_tokens_mask`, `conversation`,
  `messages` when the template reads it, ...) raise. A true `tokenize` has transformers encode the text
  without special tokens (`template_tokenizes`); a `chat_template` is a template of the request's own
  (`request_template`).
- The server's own settings (`server_chat.ServerChatSettings`, vLLM's `--default-chat-template-kwargs`,
  `--chat-template`, `--chat-template-content-format`), as vLLM 0.32 applies them
  (`vllm/renderers/online_renderer.py`: `OnlineRenderer.preprocess_chat` and `render_responses`;
  `vllm/renderers/params.py`: `merge_kwargs`, `ChatParams.with_defaults`): the server's kwargs are the
  bottom layer, under the request's tools (and `tokenize` False), under the client's kwargs (None and
  "auto" dropped), under the request's documents and generation flags. A Responses request's None and
  "auto" kwargs are dropped too once the server has defaults (`with_defaults` merges them in then,
  filtering; without defaults it hands them on as they are).
- Nesting: no value the template receives (a message after parsing its tool calls' arguments, a tool, a
  chat_template_kwargs value the template reads) may nest objects and arrays more than `MAX_JSON_DEPTH`
  levels: `tojson(indent=...)` output grows with the square of the depth, and Python's JSON and Jinja
  recursion would fail deeper still.
- Parts that are not text (images, audio, ...) cannot be reproduced here (the engine expands them into
  model-specific placeholder tokens): they raise `ChatTemplateError`, as does anything vLLM would refuse.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_JSON_DEPTH = 32
"""Levels of objects and arrays a value may nest (the value itself is level 1). A tool's schema takes about
three levels per nested object (tool, function, parameters, then properties / a property / its items ...),
so 32 leaves room for schemas nested ten objects deep. It turns the quadratic growth of an indented
`tojson` into a bounded factor: with `indent=4`, each element's line carries at most 4 x 32 spaces (about
60 times the body's size for arrays of one-digit numbers)."""

_TEXT_PART_TYPES = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_SKIPPED_WHEN_NONE = {"text", "refusal"}  # vLLM's PART_TYPES_TO_SKIP_NONE_CONTENT
# vLLM's `_KNOWN_CONTENT_PART_FIELDS`: the keys of every content-part type it accepts (with openai-python
# 3.x, which added `prompt_cache_breakpoint`; a vLLM installed beside an openai 2.x keeps that one too).
# A text part's other keys reach an "openai" template after "type" and "text".
_KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url",
        "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid",
        "video_embeds", "video_url",
    }
)  # fmt: skip
_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM's _CLAUDE_CODE_BILLING_HEADER
_TRUE = {"1", "on", "t", "true", "y", "yes"}  # pydantic's lax booleans
_FALSE = {"0", "off", "f", "false", "n", "no"}


class ChatTemplateError(ValueError):
    """The template does not compile, raised while rendering, or the request cannot be rendered."""


class NotTextContent(ChatTemplateError):
    """A message part the EPP cannot tokenize (an image, audio, embeddings): vLLM expands it into tokens
    and hashes only the engine knows."""


# --- nesting ---


def _too_deep(value: Any, levels_left: int) -> str | None:
    """The path to a container nested more than `levels_left` levels inside `value`, or None."""
    if isinstance(value, Mapping):
        items: Any = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    if levels_left <= 1:
        return next((f"[{k}]" if isinstance(k, int) else f".{k}" for k, v in items if _nests(v)), None)
    for key, item in items:
        if _nests(item) and (inner := _too_deep(item, levels_left - 1)) is not None:
            return (f"[{key}]" if isinstance(key, int) else f".{key}") + inner
    return None


def _nests(value: Any) -> bool:
    return isinstance(value, Mapping | list | tuple)


def check_depth(value: Any, field: str) -> None:
    """Raise ChatTemplateError when `value` nests objects and arrays deeper than MAX_JSON_DEPTH levels."""
    path = _too_deep(value, MAX_JSON_DEPTH)
    if path is not None:
        where = field + (path if len(path) <= 80 else path[:80] + "...")
        raise ChatTemplateError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels of objects and arrays")


# --- messages (vLLM's parse_chat_messages, text only) ---


def _without_billing_header(content: Any) -> Any:
    """A system message's content as vLLM's `_strip_claude_code_billing_header` leaves it: Claude Code's
    attribution line (its `cch` value changes on every request) is cut from the text parts it starts."""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        return content
    out: list[Any] = []
    for part in content:
        text = part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else part
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
        elif rest := text.partition("\n")[2]:
            out.append({**part, "text": rest} if isinstance(part, Mapping) else rest)
    return out


def _text_parts(content: Any, role: str) -> list[Any]:
    """The parts vLLM parses out of a message's content: strings (plain string parts), text parts as
    `{"type": "text", "text": ..., **extra keys}`, tool references as `{"type": "tool_reference", "name"}`."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, Sequence):
        raise ChatTemplateError(f"{role} message content must be a string or a list of parts")
    out: list[Any] = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _TEXT_PART_TYPES or kind == "thinking":
            text = part.get(_TEXT_PART_TYPES.get(kind, "thinking"))
            if text is not None or kind not in _SKIPPED_WHEN_NONE:
                extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
                out.append({"type": "text", "text": text, **extra})
        elif kind == "tool_reference":
            out.append({"type": "tool_reference", "name": part.get("name")})
        else:
            raise NotTextContent(
                f"content part of type {kind!r} in a {role} message: only text parts can be tokenized here"
            )
    return out


def _part_text(part: Any) -> Any:
    """A parsed part as a "string" template's content has it (vLLM parses the parts to plain strings)."""
    if isinstance(part, str):
        return part
    return part["name"] if part["type"] == "tool_reference" else part["text"]


def normalise(message: Mapping[str, Any], content_format: str) -> dict[str, Any]:
    """One request message as the template gets it."""
    role = message.get("role")
    if not isinstance(role, str):
        raise ChatTemplateError("every message needs a string 'role'")
    content: Any = message.get("content")
    parts = _text_parts(_without_billing_header(content) if role == "system" else content, role)
    if content_format == "openai":
        content = [p if isinstance(p, Mapping) else {"type": "text", "text": p} for p in parts]
        if role == "tool" and all(p.get("type") == "text" for p in content):
            content = "\n".join(p["text"] for p in content)
    else:
        content = "\n".join(t for t in map(_part_text, parts) if t)
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        calls = message.get("tool_calls")
        if isinstance(calls, Sequence) and not isinstance(calls, str) and calls:
            out["tool_calls"] = [_parsed_call(c) for c in calls]
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    elif role == "developer":
        out["tools"] = message.get("tools")
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _parsed_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(call, Mapping) or call.get("type", "function") != "function":
        raise ChatTemplateError("assistant tool_calls entries must be objects of type 'function'")
    if not isinstance(function, Mapping):
        raise ChatTemplateError("an assistant tool call needs a 'function' object")
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None  # vLLM renders malformed arguments as {}
        except (RecursionError, ValueError) as e:  # too deep, an integer of too many digits...
            name = function.get("name")
            raise ChatTemplateError(f"tool call {name!r}: its arguments cannot be parsed ({e})") from None
    return {**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}}


def developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`developer` messages as `system` ones, every system message merged into the first."""
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
        for m in messages
    ]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    texts = []
    for i in systems:
        content = converted[i]["content"]
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, Mapping) and "text" in p)
        if content:
            texts.append(content)
    merged = {"role": "system", "content": "\n\n".join(texts)}
    return [merged, *(m for m in converted if m["role"] != "system")]


# --- tools and documents (vLLM's request models) ---


def lax_bool(value: Any) -> bool:
    """A boolean field's value as vLLM's pydantic request models read it (lax mode): true/false, the
    numbers 0 and 1 (0.0 and 1.0 too), and the strings 1/0, true/false, t/f, yes/no, y/n, on/off in any
    case (no surrounding spaces). ValueError for anything else, null included (a field that may be null
    is checked for it by the caller)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ValueError("not a boolean")


def _lax_bool(value: Any, field: str) -> bool | None:
    if value is None:
        return None
    try:
        return lax_bool(value)
    except ValueError:
        raise ChatTemplateError(f"{field} must be a boolean") from None


def _optional(function: Mapping[str, Any], key: str, kind: type, field: str) -> Any:
    value = function.get(key)
    if value is not None and not isinstance(value, kind):
        raise ChatTemplateError(f"{field}.{key} must be {'a string' if kind is str else 'an object'}")
    return value


def canonical_tool(tool: Any, i: int) -> dict[str, Any]:
    """`ChatCompletionToolsParam.model_validate(tool).model_dump()` as vLLM computes it."""
    field = f"tools[{i}]"
    if not isinstance(tool, Mapping):
        raise ChatTemplateError(f"{field} must be an object")
    if tool.get("type", "function") != "function":
        raise ChatTemplateError(
            f"{field}: only tools of type 'function' are accepted, got {tool.get('type')!r}"
        )
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ChatTemplateError(f"{field} needs a 'function' object")
    if not isinstance(function.get("name"), str):
        raise ChatTemplateError(f"{field}.function needs a string 'name'")
    tool_defer = _lax_bool(tool.get("defer_loading"), f"{field}.defer_loading")
    strict = _lax_bool(function.get("strict"), f"{field}.function.strict")
    defer = _lax_bool(function.get("defer_loading"), f"{field}.function.defer_loading")
    out_function: dict[str, Any] = {
        "name": function["name"],
        "description": _optional(function, "description", str, f"{field}.function"),
        "parameters": _optional(function, "parameters", Mapping, f"{field}.function"),
    }
    if strict is not None:
        out_function["strict"] = strict
    if defer is None:
        defer = tool_defer
    if defer is not None:
        out_function["defer_loading"] = defer
    out: dict[str, Any] = {"type": "function", "function": out_function}
    if tool_defer is not None:
        out["defer_loading"] = tool_defer
    check_depth(out, field)
    return out


def canonical_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise ChatTemplateError("tools must be a list of tool objects")
    return [canonical_tool(tool, i) for i, tool in enumerate(tools)]


def checked_documents(documents: Any) -> Any:
    if documents is None:
        return None
    if isinstance(documents, str | bytes | Mapping) or not isinstance(documents, Sequence):
        raise ChatTemplateError("documents must be a list of objects")
    for i, document in enumerate(documents):
        if not isinstance(document, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in document.items()
        ):
            raise ChatTemplateError(f"documents[{i}] must be an object of strings")
    return documents


# --- chat_template_kwargs (vLLM's merge_kwargs and resolve_chat_template_kwargs, transformers' call) ---

# `apply_chat_template`'s own parameters: a client's kwarg of that name is taken by the call (vLLM's
# `safe_apply_chat_template`, then transformers), never a template variable; `tools` and `documents` reach
# the template by their own rules (`template_inputs`), `add_generation_prompt` and `continue_final_message`
# are the request's (vLLM sets them over the client's).
_CALL_PARAMS = frozenset(
    {
        "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
        "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip
# the call's encoding options and their defaults: with `tokenize`, any other value (a truncation, a padding,
# an invalid one transformers refuses) is not reproduced here
_ENCODE_DEFAULTS = {"padding": False, "truncation": False, "max_length": None, "return_tensors": None}
# names the call already has (`safe_apply_chat_template(model_config, tokenizer, conversation, ...)`, the
# bound method's `self`): vLLM fails with "got multiple values for argument"
_CLASHING = ("conversation", "self", "model_config", "tokenizer")
# given to the template by transformers itself: a kwarg of that name the template reads (so vLLM passes
# it on) makes the render call fail the same way
_CLASHING_IF_READ = ("messages", "conversations")


def _is_set(value: Any) -> bool:
    """vLLM's `merge_kwargs` drops a client's kwarg whose value is None or "auto" (its `unset_values`)."""
    return value is not None and not (isinstance(value, str) and value == "auto")


def request_template(kwargs: Mapping[str, Any] | None) -> bool:
    """Whether the client's kwargs carry a chat template of its own: vLLM refuses the request (400) unless
    it runs with --trust-request-chat-template, and then renders with that template, not the model's."""
    return kwargs is not None and kwargs.get("chat_template") is not None


def template_tokenizes(kwargs: Mapping[str, Any] | None) -> bool:
    """Whether a client's (truthy) `tokenize` has transformers tokenize the rendered text in the call: its ids
    are then `encode(text, add_special_tokens=False)`, whatever the request's `add_special_tokens`."""
    value = (kwargs or {}).get("tokenize")
    return _is_set(value) and bool(value)


def uses_tools(
    tools: Any, kwargs: Mapping[str, Any] | None, defaults: Mapping[str, Any] | None = None
) -> bool:
    """Whether the template gets tools (transformers then picks a `tool_use` template when there is one):
    the request's, the client's kwargs' (set), or the server's default kwargs' (not None)."""
    return (
        tools is not None or _is_set((kwargs or {}).get("tools")) or (defaults or {}).get("tools") is not None
    )


def _encodes_otherwise(given: Mapping[str, Any]) -> bool:
    """Whether the call's encoding options differ from their defaults (`tokenizer_kwargs`: None or {})."""
    changed = any(k in given and given[k] is not default for k, default in _ENCODE_DEFAULTS.items())
    return changed or given.get("tokenizer_kwargs") not in (None, {})


@dataclass(frozen=True, slots=True)
class TemplateInputs:
    """What the template gets beside messages and add_generation_prompt."""

    tools: list[Any] | None
    documents: Any
    variables: dict[str, Any]  # the client's other kwargs (the reasoning ones included)


def _each_object(value: Any, field: str, message: str) -> list[Any]:
    """transformers' `for item in value: if not isinstance(item, dict): raise`: any iterable (a string's
    characters, an object's keys) is walked; each item must be an object."""
    try:
        items = list(value)
    except TypeError:
        raise ChatTemplateError(f"{field}: {message} (got {type(value).__name__})") from None
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ChatTemplateError(f"{field}[{i}]: {message}")
    check_depth(items, field)
    return items


def template_inputs(
    tools: Any,
    documents: Any,
    kwargs: Mapping[str, Any] | None,
    read: Collection[str] = (),
    *,
    keep_unset: bool = False,
    defaults: Mapping[str, Any] | None = None,
) -> TemplateInputs:
    """The request's tools and documents and the client's `chat_template_kwargs` as vLLM 0.32 hands them to
    the template (`read`: the variables the template reads). The client's `tools` (unless None or "auto")
    replace the request's, untouched: vLLM merges the request's tools in as a default the client's kwargs
    override; the request's `documents`, when given, replace the client's (build_chat_params sets them over).
    `keep_unset`: the client's None and "auto" values stay (a Responses request: vLLM merges its kwargs in
    twice, first as defaults, which `merge_kwargs` does not filter); they yield to the request's tools.
    `defaults`: the server's --default-chat-template-kwargs, the bottom layer (`_with_server_defaults`).
    ChatTemplateError where vLLM fails the request."""
    tools_out = canonical_tools(tools)  # validated even when replaced: vLLM's request model refuses them
    documents_out = checked_documents(documents)
    keep_unset = keep_unset and not defaults
    given = {k: v for k, v in (kwargs or {}).items() if keep_unset or _is_set(v)}
    if defaults:
        given = _with_server_defaults(defaults, tools_out is not None) | given
    if request_template(kwargs):
        raise ChatTemplateError("chat_template_kwargs['chat_template']: a request's own chat template")
    clashing = [k for k in given if k in _CLASHING or (k in _CLASHING_IF_READ and k in read)]
    if clashing:
        raise ChatTemplateError(f"chat_template_kwargs[{clashing[0]!r}]: vLLM fails on this name")
    if given.get("return_assistant_tokens_mask"):
        raise ChatTemplateError("chat_template_kwargs['return_assistant_tokens_mask']: vLLM refuses it")
    if template_tokenizes(given) and _encodes_otherwise(given):
        raise ChatTemplateError("chat_template_kwargs: 'tokenize' with encoding options: not reproduced")
    client_tools = given.get("tools")
    if _is_set(client_tools) or (client_tools is not None and tools_out is None):
        tools_out = _each_object(client_tools, "chat_template_kwargs['tools']", "tools must be objects")
    if documents_out is None and given.get("documents") is not None:
        documents_out = given["documents"]
        _each_object(documents_out, "chat_template_kwargs['documents']", "documents must be objects")
    variables = {k: v for k, v in given.items() if k not in _CALL_PARAMS}
    return TemplateInputs(tools_out, documents_out, variables)


def _with_server_defaults(defaults: Mapping[str, Any], request_tools: bool) -> dict[str, Any]:
    """The server's default kwargs as the layer under the client's. vLLM 0.32's `preprocess_chat` merges
    `{tools: <the request's>, tokenize: False}` over them first (`merge_kwargs` skips the tools when the
    request has none), so the server's `tokenize` never counts and its `tools` only for a request without
    tools; `build_chat_params` then sets the request's documents and generation flags over everything."""
    base = {k: v for k, v in defaults.items() if k != "tokenize"}
    if request_tools:
        base.pop("tools", None)
    return base
