"""Chat templates rendered as the engine renders them (Hugging Face `apply_chat_template`, as vLLM calls it).

Pure: no I/O, no clock (a template's `strftime_now` reads a wall clock only if one is injected).

- The environment is the one transformers builds: `ImmutableSandboxedEnvironment(trim_blocks=True,
  lstrip_blocks=True)` with `loopcontrols` and the `{% generation %}` tag, the non-escaping `tojson`
  filter (`ensure_ascii=False`, `indent`, `separators`, `sort_keys`), and the `raise_exception` and
  `strftime_now` globals. Render variables: `messages`, `tools`, `documents`, `add_generation_prompt`,
  the special tokens (`bos_token`, `eos_token`, ...) and any extra template kwargs.
- The content format ("string" or "openai") is detected from the template's AST as vLLM's
  `_detect_content_format` does: "openai" when a loop iterates over a message's `content` (through any
  alias of `messages` and of its loop variable) or over a plain `content` variable, "string" otherwise and
  when a loop or assignment target vLLM expects to be a plain name is not one.
- Messages, tools and documents become what vLLM gives the template (`chat_inputs.py`: reasoning fields,
  text parts and their extra keys, tool-call arguments, tools as vLLM's request model dumps them, the
  client's `chat_template_kwargs` merged as vLLM merges them, a nesting bound).
- `continue_final_message` follows transformers: the rendered text stops where the final message ends.
- A server's `--chat-template-content-format` other than "auto" replaces the detected format
  (`content_format`), and its `--default-chat-template-kwargs` are the bottom layer of the kwargs
  (`render(default_kwargs=...)`): as vLLM 0.32 applies them (`vllm/renderers/hf.py`,
  `resolve_chat_template_content_format`; `server_chat.ServerChatSettings`).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from epp.kvindex.chat_inputs import (
    ChatTemplateError,
    check_depth,
    developer_as_system,
    normalise,
    template_inputs,
)
from epp.kvindex.server_chat import CONTENT_FORMATS

__all__ = ["ChatTemplate", "ChatTemplateError", "detect_content_format"]

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


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


class _UnusualTarget(Exception):
    """A loop or assignment target vLLM's walk asserts to be a plain name is not one: it answers "string"."""


def _target(node: jinja2.nodes.For | jinja2.nodes.Assign) -> str:
    if not isinstance(node.target, jinja2.nodes.Name):
        raise _UnusualTarget
    return node.target.name


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """`name` and every variable assigned from it, breadth first (vLLM's walk, but ending on a cycle)."""
    out, seen, todo = [name], {name}, deque([name])
    while todo:
        current = todo.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_access(assign.node, current):
                alias = _target(assign)
                out.append(alias)
                if alias not in seen:
                    seen.add(alias)
                    todo.append(alias)
    return out


def _content_loop(root: jinja2.nodes.Template, message_vars: Sequence[str]) -> bool:
    """Whether the first loop over a message's content (`message['content']`, or a plain `content` since
    vLLM PR #42660) has a plain name as target; False when there is none."""
    for loop in root.find_all(jinja2.nodes.For):
        over_content = any(_is_access(loop.iter, name, "content") for name in message_vars)
        if over_content or _is_var(loop.iter, "content"):
            _target(loop)
            return True
    return False


def detect_content_format(env: jinja2.Environment, source: str) -> str:
    """ "openai" if the template iterates over a message's content parts, else "string" (vLLM's
    `_detect_content_format`, which also answers "string" when a target it expects to be a name is not)."""
    return _content_format(env.parse(source))


def _content_format(root: jinja2.nodes.Template) -> str:
    try:
        messages = _aliases(root, "messages")
        message_vars = [
            _target(loop)
            for loop in root.find_all(jinja2.nodes.For)
            if any(_is_access(loop.iter, name) for name in messages)
        ]
        return "openai" if _content_loop(root, message_vars) else "string"
    except _UnusualTarget:
        return "string"


class ChatTemplate:
    """One compiled chat template. `render` gives the exact prompt text the engine tokenizes."""

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Mapping[str, Any] | None = None,
        now: Callable[[], datetime] | None = None,
        content_format: str = "auto",
    ) -> None:
        """`content_format`: the server's `--chat-template-content-format`; "auto" detects it (vLLM's
        `resolve_chat_template_content_format` uses a given format as it is)."""
        if content_format not in CONTENT_FORMATS:
            raise ChatTemplateError(
                f"content format must be one of {', '.join(CONTENT_FORMATS)}, got {content_format!r}"
            )
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
            root = env.parse(source)
            self.content_format = _content_format(root) if content_format == "auto" else content_format
            self._variables = jinja2.meta.find_undeclared_variables(root)  # after: it may fold constants
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
        keep_unset_kwargs: bool = False,
        default_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """`keep_unset_kwargs`: the client's kwargs whose value is None or "auto" reach the template (vLLM's
        Responses path); a chat completion's are dropped. `default_kwargs`: the server's
        --default-chat-template-kwargs, under the request's (`chat_inputs.template_inputs`)."""
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
            raise ChatTemplateError("messages must be a list of message objects")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
        try:
            chat = [normalise(m if isinstance(m, Mapping) else {}, self.content_format) for m in messages]
            for i, message in enumerate(chat):
                check_depth(message, f"messages[{i}]")
            if not self.knows_developer_role and any(m["role"] == "developer" for m in chat):
                chat = developer_as_system(chat)
        except (TypeError, AttributeError) as e:  # e.g. a text part whose text is not a string
            raise ChatTemplateError(f"malformed messages: {e}") from e
        inputs = template_inputs(
            tools,
            documents,
            template_kwargs,
            self._variables,
            keep_unset=keep_unset_kwargs,
            defaults=default_kwargs,
        )
        final_text: str | None = None
        if continue_final_message:
            final_text = self._tag_final_message(chat)
        kwargs = inputs.variables
        for key in self._variables.intersection(kwargs):  # vLLM passes only the variables the template reads
            check_depth(kwargs[key], f"chat_template_kwargs[{key!r}]")
        variables = {**self._special_tokens, **kwargs}
        variables.update(
            messages=chat,
            tools=inputs.tools,
            documents=inputs.documents,
            add_generation_prompt=add_generation_prompt,
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
