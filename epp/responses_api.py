"""A `/v1/responses` body -> the chat that vLLM renders its prompt from. Pure.

vLLM renders a Responses request with the model's chat template, as a chat completion
(`entrypoints/openai/responses`: `construct_input_messages`, `construct_tool_dicts`,
`ResponsesRequest.input_item_parsing`, `build_chat_params`, `build_tok_params`); this module builds the
same messages, tools and template flags:

- `instructions` (a non-empty string) is a leading system message; `input` as a string is one user
  message; a list of items becomes messages, in order:
  - `function_call`: a tool call `{"id": call_id, "function": {"name", "arguments"}, "type": "function"}`
    (a `namespace` names it `namespace__name`);
  - `function_call_output`: a tool message (`content` = output, `tool_call_id` = call_id);
  - `reasoning`: an assistant message's `reasoning` (its first content text, else its first summary text);
  - an assistant message: `{"role": "assistant", "content": text}`, the text being a string content or
    the first part's `text` (other keys are dropped);
  - any other item with a string `role` (user, system, developer messages) as it is: the chat template
    module turns its `input_text` parts into text parts;
  - a function call, reasoning or assistant text right after an assistant message fills that message's
    empty slot (`tool_calls`, `reasoning`, `content`) instead of starting a new one: one assistant turn
    often spans several items.
  An item that is none of these (no role: an `item_reference`, a built-in tool call...) is refused, as
  vLLM cannot render it either.
- `tools`: function tools (and a namespace's function tools, named `namespace__name`) become chat tools
  `{"type": "function", "function": {"name", "description", "parameters"[, "strict"][, "defer_loading"]}}`
  (as vLLM's `FunctionDefinition` dumps them: description and parameters null when absent, the flags
  only when set); other tool types are not rendered; no function tool at all is an empty list. With
  `tool_choice: "none"` and a server run with `--exclude-tools-when-tool-choice-none` (the model's
  `excludeToolsWhenToolChoiceNone`), no tools reach the template (`construct_tool_dicts`).
- A final message or reasoning item whose status is "in_progress" or "incomplete" is continued
  (`continue_final_message`, no generation prompt).
- `reasoning.effort` is the template's `reasoning_effort`, and sets `enable_thinking` (effort != "none")
  unless `chat_template_kwargs` (vLLM's extension of the API) sets it.
- The rendered text is tokenized with `add_special_tokens=True`: vLLM's `ResponsesRequest.build_tok_params`
  leaves `TokenizeParams`' default (a chat completion's is False), so a template that writes the bos token
  gets a second one from a tokenizer whose post-processor adds it, in vLLM and here alike.

Not reproduced: `previous_response_id` / `previous_response` (vLLM puts the stored conversation first, and
the EPP does not hold it): such a request's prompt is unknown (unkeyed, "stored_history"); and gpt-oss
models, which vLLM renders with Harmony instead of a chat template (unkeyed, "harmony": `prompt.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epp.kvindex.chat_inputs import lax_bool

_CONTINUED = ("in_progress", "incomplete")


class InvalidResponsesBody(ValueError):
    """A Responses body vLLM would refuse (the message names the field)."""


@dataclass(frozen=True, slots=True)
class ResponsesChat:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    continue_final_message: bool
    chat_template_kwargs: dict[str, Any] | None
    stored_history: bool  # the prompt starts with a conversation vLLM stored (`previous_response_id`)
    tool_choice_none: bool = False  # `tool_choice: "none"` (the default is "auto")


def responses_chat(body: Mapping[str, Any]) -> ResponsesChat:
    """The chat vLLM renders for this Responses body; InvalidResponsesBody names what it refuses."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidResponsesBody("'instructions' must be a string")
    if "input" not in body:
        raise InvalidResponsesBody("'input' is missing (a string or a list of items)")
    items = body["input"]
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        messages += _input_messages(items)
    else:
        raise InvalidResponsesBody("'input' must be a string or a list of items")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidResponsesBody("'chat_template_kwargs' must be an object")
    return ResponsesChat(
        messages=messages,
        tools=_tools(body.get("tools")),
        continue_final_message=_continues(items),
        chat_template_kwargs=template_kwargs(kwargs, _effort(body.get("reasoning"))),
        stored_history=any(body.get(k) is not None for k in ("previous_response_id", "previous_response")),
        tool_choice_none=body.get("tool_choice", "auto") == "none",
    )


def template_kwargs(user: Mapping[str, Any] | None, effort: str | None) -> dict[str, Any] | None:
    """vLLM's `build_chat_params` merge: the request's `reasoning_effort` (when set) over the client's
    `chat_template_kwargs`, and `enable_thinking` = effort != "none" unless the client set it."""
    merged = dict(user or {})
    if effort is not None and effort != "auto":  # `merge_kwargs` leaves None and "auto" unset
        merged["reasoning_effort"] = effort
    if effort is not None and "enable_thinking" not in (user or {}):
        merged["enable_thinking"] = effort != "none"
    return merged or None


def _effort(reasoning: Any) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise InvalidResponsesBody("'reasoning' must be an object")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise InvalidResponsesBody("'reasoning.effort' must be a string")
    return effort


def _continues(items: Any) -> bool:
    """vLLM's `should_continue_final_message`: the final item is a partial message or reasoning item."""
    if not isinstance(items, list) or not items:
        return False
    last = items[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in _CONTINUED


def _input_messages(items: Sequence[Any]) -> list[dict[str, Any]]:
    """vLLM's `construct_chat_messages_with_tool_call`."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidResponsesBody(f"'input[{i}]' must be an object")
        prev = out[-1] if out and out[-1].get("role") == "assistant" else None
        message = _message(item, f"input[{i}]", prev)
        if message is not None:
            out.append(message)
    return out


def _message(item: dict[str, Any], name: str, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """One item as a message, or None when it filled a slot of `prev` (the assistant message before it)."""
    kind = item.get("type")
    if kind == "function_call":
        call = _tool_call(item, name)
        if prev is not None and prev.get("tool_calls") is None:
            prev["tool_calls"] = [call]
            return None
        if prev is not None and isinstance(prev["tool_calls"], list):
            prev["tool_calls"].append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "function_call_output":
        output, call_id = item.get("output"), item.get("call_id")
        if not isinstance(call_id, str) or not isinstance(output, str | list):
            raise InvalidResponsesBody(
                f"'{name}' (function_call_output) needs a string 'call_id' and an 'output'"
            )
        return {"role": "tool", "content": output, "tool_call_id": call_id}
    if kind == "reasoning":
        return _fill(prev, "reasoning", _reasoning_text(item, name))
    role = item.get("role")
    if role == "assistant":
        return _fill(prev, "content", _assistant_text(item.get("content"), name))
    if not isinstance(role, str):
        raise InvalidResponsesBody(
            f"'{name}' must be a message with a string 'role' or an item of a known 'type'"
        )
    if not isinstance(item.get("content"), str | list | None):
        raise InvalidResponsesBody(f"'{name}.content' must be a string, a list of parts, or null")
    return item


def _fill(prev: dict[str, Any] | None, slot: str, text: str) -> dict[str, Any] | None:
    if prev is not None and prev.get(slot) is None:
        prev[slot] = text
        return None
    return {"role": "assistant", slot: text}


def _tool_call(item: Mapping[str, Any], name: str) -> dict[str, Any]:
    fields = [item.get(k) for k in ("call_id", "name", "arguments")]
    namespace = item.get("namespace")
    if not all(isinstance(f, str) for f in fields) or not isinstance(namespace, str | None):
        raise InvalidResponsesBody(f"'{name}' (function_call) needs string 'call_id', 'name' and 'arguments'")
    call_id, function, arguments = fields
    if namespace:
        function = f"{namespace}__{function}"
    return {"id": call_id, "function": {"name": function, "arguments": arguments}, "type": "function"}


def _reasoning_text(item: Mapping[str, Any], name: str) -> str:
    for key in ("content", "summary"):  # the first content part's text, else the first summary part's
        parts = item.get(key)
        if parts is not None and not isinstance(parts, list):
            raise InvalidResponsesBody(f"'{name}.{key}' must be a list of parts")
        if parts:
            text = parts[0].get("text") if isinstance(parts[0], dict) else parts[0]
            if not isinstance(text, str):
                raise InvalidResponsesBody(f"'{name}.{key}[0]' needs a string 'text'")
            return text
    return ""


def _assistant_text(content: Any, name: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:  # only the first part counts (vLLM's `content[0].text`)
        first = content[0]
        text = first.get("text", "") if isinstance(first, dict) else first
        if not isinstance(text, str):
            raise InvalidResponsesBody(f"'{name}.content[0].text' must be a string")
        return text
    if content is not None and not isinstance(content, list):
        raise InvalidResponsesBody(f"'{name}.content' must be a string or a list of parts")
    return ""


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """vLLM's `construct_tool_dicts`: the function tools as chat-completions tools, dumped by pydantic."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidResponsesBody("'tools' must be a list of objects")
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if tool.get("type") == "function":
            out.append(_function_tool(tool, tool.get("name"), f"tools[{i}]"))
        elif tool.get("type") == "namespace":
            namespace, members = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not isinstance(members, list):
                raise InvalidResponsesBody(
                    f"'tools[{i}]' (namespace) needs a string 'name' and a list 'tools'"
                )
            for j, member in enumerate(members):
                if isinstance(member, dict) and member.get("type") == "function":
                    flat = f"{namespace}__{member.get('name')}"
                    out.append(_function_tool(member, flat, f"tools[{i}].tools[{j}]"))
    return out


def _function_tool(tool: Mapping[str, Any], name: Any, where: str) -> dict[str, Any]:
    """`FunctionTool.model_dump()` minus `type`, through vLLM's `FunctionDefinition`: its fields only,
    `strict` and `defer_loading` only when set."""
    description, parameters = tool.get("description"), tool.get("parameters")
    if not isinstance(tool.get("name"), str) or not isinstance(name, str):
        raise InvalidResponsesBody(f"'{where}' (function) needs a string 'name'")
    if not isinstance(description, str | None) or not isinstance(parameters, dict | None):
        raise InvalidResponsesBody(f"'{where}': 'description' must be a string and 'parameters' an object")
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    for flag in ("strict", "defer_loading"):
        value = tool.get(flag)
        if value is not None:  # pydantic's lax booleans, as for every boolean field (`lax_bool`)
            try:
                function[flag] = lax_bool(value)
            except ValueError:
                raise InvalidResponsesBody(f"'{where}.{flag}' must be a boolean") from None
    return {"type": "function", "function": function}
