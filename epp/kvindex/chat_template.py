"""Chat templates rendered as the engine renders them (Hugging Face `apply_chat_template`, as vLLM calls it).

Pure: no I/O, no clock (a template's `strftime_now` reads a wall clock only if one is injected).

- The environment is the one transformers builds: `ImmutableSandboxedEnvironment(trim_blocks=True,
  lstrip_blocks=True)` with `loopcontrols` and the `{% generation %}` tag, the non-escaping `tojson`
  filter (`ensure_ascii=False`, `indent`, `separators`, `sort_keys`), and the `raise_exception` and
  `strftime_now` globals. Render variables: `messages`, `tools`, `documents`, `add_generation_prompt`,
  the special tokens (`bos_token`, `eos_token`, ...) and any extra template kwargs.
- Messages are first normalised as vLLM does (`parse_chat_messages`): the content format ("string" or
  "openai") is detected from the template's AST (does it loop over a message's `content`?); text parts
  are joined with "\\n" for "string" templates and become `{"type": "text", "text": ...}` parts for
  "openai" ones; `tool` messages with text-only parts get a joined string; only role, content, name,
  tool_calls (assistant), tool_call_id (tool), reasoning and task are kept; tool-call `arguments` strings
  are parsed to objects; `developer` messages become `system` when the template does not know the role.
- Parts that are not text (images, audio, ...) cannot be reproduced here (the engine expands them into
  model-specific placeholder tokens): they raise `ChatTemplateError`.
- `continue_final_message` follows transformers: the rendered text stops where the final message ends.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

_TEXT_PART_TYPES = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The template does not compile, raised while rendering, or the messages cannot be rendered."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tracking): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# --- content format detection (the loop-over-content test vLLM applies to the template AST) ---


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_access(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node is not None and _is_access(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_access(node.node, name, key)
    if key is None:
        return _is_var(node, name)
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _aliases(root: jinja2.nodes.Template, name: str) -> Iterator[str]:
    yield name
    seen, todo = {name}, deque([name])
    while todo:
        current = todo.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if isinstance(assign.target, jinja2.nodes.Name) and _is_access(assign.node, current):
                alias = assign.target.name
                yield alias
                if alias not in seen:
                    seen.add(alias)
                    todo.append(alias)


def _loop_targets(root: jinja2.nodes.Template, iterables: Sequence[str], key: str | None) -> Iterator[str]:
    for loop in root.find_all(jinja2.nodes.For):
        if not isinstance(loop.target, jinja2.nodes.Name):
            continue
        if any(_is_access(loop.iter, name, key) for name in iterables) or (
            key == "content" and _is_var(loop.iter, "content")
        ):
            yield loop.target.name


def detect_content_format(env: jinja2.Environment, source: str) -> str:
    """ "openai" if the template iterates over a message's content parts, else "string"."""
    root = env.parse(source)
    message_vars = list(_loop_targets(root, list(_aliases(root, "messages")), None))
    return "openai" if next(_loop_targets(root, message_vars, "content"), None) is not None else "string"


# --- message normalisation (vLLM's parse_chat_messages, text only) ---


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
        if kind in _TEXT_PART_TYPES:
            text = part.get(_TEXT_PART_TYPES[kind])
            if text is not None:
                out.append(text)
        elif kind == "thinking" and part.get("thinking") is not None:
            out.append(part["thinking"])
        elif kind == "tool_reference":
            out.append({"type": "tool_reference", "name": part.get("name")})
        else:
            raise ChatTemplateError(
                f"content part of type {kind!r} in a {role} message: only text parts can be tokenized here"
            )
    return out


def _normalise(message: Mapping[str, Any], content_format: str) -> dict[str, Any]:
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
        content = "\n".join(p if isinstance(p, str) else str(p.get("name")) for p in parts)
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        calls = message.get("tool_calls")
        if isinstance(calls, Sequence) and not isinstance(calls, str) and calls:
            out["tool_calls"] = [_parsed_call(c) for c in calls]
        if message.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = message["reasoning"]
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    elif role == "developer":
        out["tools"] = message.get("tools")
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _parsed_call(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            function["arguments"] = {}
    elif not isinstance(arguments, dict | list):
        function["arguments"] = {}
    return {**call, "function": function}


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


class ChatTemplate:
    """One compiled chat template. `render` gives the exact prompt text the engine tokenizes."""

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Mapping[str, Any] | None = None,
        now: Callable[[], datetime] | None = None,
    ) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        if now is not None:
            clock = now
            env.globals["strftime_now"] = lambda fmt: clock().strftime(fmt)
        try:
            self._template = env.from_string(source)
            self.content_format = detect_content_format(env, source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"syntax error on line {e.lineno}: {e.message}") from e
        self.source = source
        self.knows_developer_role = "'developer'" in source or '"developer"' in source
        self._special_tokens = dict(special_tokens or {})

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Any = None,
        documents: Any = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
            raise ChatTemplateError("messages must be a list of message objects")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
        try:
            chat = [_normalise(m if isinstance(m, Mapping) else {}, self.content_format) for m in messages]
            if not self.knows_developer_role and any(m["role"] == "developer" for m in chat):
                chat = _developer_as_system(chat)
        except (TypeError, AttributeError) as e:  # e.g. a text part whose text is not a string
            raise ChatTemplateError(f"malformed messages: {e}") from e
        final_text: str | None = None
        if continue_final_message:
            final_text = self._tag_final_message(chat)
        variables = {**self._special_tokens, **(template_kwargs or {})}
        variables.update(
            messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt
        )
        try:
            rendered = self._template.render(**variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the template raised: {e.message or e}") from e
        except Exception as e:  # a template may fail in any way (TypeError, KeyError, ...)
            raise ChatTemplateError(f"the template failed: {type(e).__name__}: {e}") from e
        if final_text is not None:
            rendered = self._cut_after_final_message(rendered, final_text)
        return rendered

    @staticmethod
    def _tag_final_message(chat: list[dict[str, Any]]) -> str:
        if not chat:
            raise ChatTemplateError("continue_final_message needs at least one message")
        last = chat[-1]
        content = last["content"]
        if isinstance(content, list):
            for i in range(len(content) - 1, -1, -1):
                if isinstance(content[i], Mapping) and "text" in content[i]:
                    text = str(content[i]["text"])
                    content = list(content)
                    content[i] = {**content[i], "text": text + _CONTINUE_TAG}
                    chat[-1] = {**last, "content": content}
                    return text
            raise ChatTemplateError("continue_final_message: the final message has no text to continue")
        text = "" if content is None else str(content)
        chat[-1] = {**last, "content": text + _CONTINUE_TAG}
        return text

    @staticmethod
    def _cut_after_final_message(rendered: str, final_text: str) -> str:
        tag = _CONTINUE_TAG.strip()
        if final_text.strip() not in rendered or tag not in rendered:
            raise ChatTemplateError("continue_final_message: the template dropped part of the final message")
        at = rendered.rindex(tag)
        if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:at]
        return rendered[:at].rstrip()
