"""What a chat template is given, built from a request as vLLM builds it (text only).

Pure: no I/O. Follows vLLM's chat path (`ChatCompletionRequest` validation, `parse_chat_messages`,
`OnlineRenderer.render_chat`, the HF renderer's developer-role fallback):

- Messages: a message's `reasoning_content` is renamed `reasoning` (an existing `reasoning` wins), and an
  assistant message with reasoning carries both `reasoning` and `reasoning_content`. Text parts are joined
  with "\\n" for "string" templates, falsy parts (empty text) dropped; they become
  `{"type": "text", "text": ...}` parts for "openai" ones; `tool` messages with text-only parts get a
  joined string; only role, content, name, tool_calls (assistant), tool_call_id (tool), reasoning and task
  are kept. Tool calls must be `function` objects; their `arguments` become an object (a JSON string is
  parsed; invalid JSON, or JSON that is not an object, gives `{}`). `developer` messages become `system`
  (all system messages merged into the first) when the template does not know the role.
- Tools: `[tool.model_dump() for tool in request.tools]` of vLLM's `ChatCompletionToolsParam`: `type` is
  "function" (any other type is refused), `function` keeps `name`, `description` and `parameters` (null
  when absent) in that order, then `strict` and `defer_loading` when set; a tool's own `defer_loading` is
  copied to its function's when that is unset; every other key is dropped.
- Documents: objects of strings (vLLM's `list[dict[str, str]]`).
- Nesting: no value the template receives (a message after parsing its tool calls' arguments, a tool, a
  chat_template_kwargs value the template reads) may nest objects and arrays more than `MAX_JSON_DEPTH`
  levels: `tojson(indent=...)` output grows with the square of the depth, and Python's JSON and Jinja
  recursion would fail deeper still.
- Parts that are not text (images, audio, ...) cannot be reproduced here (the engine expands them into
  model-specific placeholder tokens): they raise `ChatTemplateError`, as does anything vLLM would refuse.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

MAX_JSON_DEPTH = 32
"""Levels of objects and arrays a value may nest (the value itself is level 1). A tool's schema takes about
three levels per nested object (tool, function, parameters, then properties / a property / its items ...),
so 32 leaves room for schemas nested ten objects deep. It turns the quadratic growth of an indented
`tojson` into a bounded factor: with `indent=4`, each element's line carries at most 4 x 32 spaces (about
60 times the body's size for arrays of one-digit numbers)."""

_TEXT_PART_TYPES = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_SKIPPED_WHEN_NONE = {"text", "refusal"}  # vLLM's PART_TYPES_TO_SKIP_NONE_CONTENT
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


def _text_parts(content: Any, role: str) -> list[Any]:
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
                out.append(text)
        elif kind == "tool_reference":
            out.append({"type": "tool_reference", "name": part.get("name")})
        else:
            raise NotTextContent(
                f"content part of type {kind!r} in a {role} message: only text parts can be tokenized here"
            )
    return out


def normalise(message: Mapping[str, Any], content_format: str) -> dict[str, Any]:
    """One request message as the template gets it."""
    role = message.get("role")
    if not isinstance(role, str):
        raise ChatTemplateError("every message needs a string 'role'")
    parts = _text_parts(message.get("content"), role)
    content: Any
    if content_format == "openai":
        content = [p if isinstance(p, Mapping) else {"type": "text", "text": p} for p in parts]
        if role == "tool" and all(p.get("type") == "text" for p in content):
            content = "\n".join(p["text"] for p in content)
    else:
        texts = (p["name"] if isinstance(p, Mapping) else p for p in parts)
        content = "\n".join(t for t in texts if t)
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


def _lax_bool(value: Any, field: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ChatTemplateError(f"{field} must be a boolean")


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
