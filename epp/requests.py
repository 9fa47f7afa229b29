"""Turn an OpenAI-style HTTP request (headers + JSON body) into an `InferenceRequest`. Pure.

Errors are `RequestError`s carrying the HTTP status the gateway should answer with. A `/v1/responses` body
becomes the chat vLLM renders from it (`responses_api.py`).

A chat that brings its own chat template (`chat_template`, or `chat_template_kwargs.chat_template`, not
null) is routed unkeyed ("request_chat_template"), not refused: vLLM answers it with a 400 unless it runs
with `--trust-request-chat-template`, and then renders with that template, which the EPP does not; which
of the two the engine does is its flag's, so the engine answers. A `chat_template` that is not a string
is a 400, as vLLM's request model has it.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Collection, Mapping
from typing import Any

import msgspec

from epp.kvindex.chat_inputs import lax_bool, request_template
from epp.responses_api import InvalidResponsesBody, responses_chat, template_kwargs
from epp.types import ApiKind, ChatOptions, InferenceRequest, PromptTokens

# The request's control headers under llm-d's current names, each with the Gateway API Inference
# Extension's name as an alias (llm-d/llm-d-router pkg/epp/metadata/consts.go: `ObjectiveKey`,
# `FlowFairnessIDKey`, `ModelNameRewriteKey` and their `Old...` aliases; kubernetes-sigs/
# gateway-api-inference-extension pkg/epp/metadata/consts.go has the `x-gateway-*` names only). When both
# are sent, llm-d's name wins, even with an empty value, as the reference's `GetLowerCaseHeaderValue` reads
# them (llm-d/llm-d-router pkg/epp/handlers/request.go). The fairness id is kept with the request, not
# acted on (there is no flow control here).
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
GIE_OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
GIE_FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
MODEL_REWRITE_HEADER = "x-llm-d-model-name-rewrite"
GIE_MODEL_REWRITE_HEADER = "x-gateway-model-name-rewrite"

HEADERS_OF_INTEREST = (
    "x-request-id",
    OBJECTIVE_HEADER,
    GIE_OBJECTIVE_HEADER,
    FAIRNESS_HEADER,
    GIE_FAIRNESS_HEADER,
    MODEL_REWRITE_HEADER,
    GIE_MODEL_REWRITE_HEADER,
    "content-type",
)

_PATH_KINDS = (
    ("/chat/completions", ApiKind.CHAT_COMPLETIONS),
    ("/completions", ApiKind.COMPLETIONS),
    ("/embeddings", ApiKind.EMBEDDINGS),
    ("/responses", ApiKind.RESPONSES),
)
CHARS_PER_TOKEN = 4
_MAX_TOKEN_ID = 2**31 - 1  # engines' token ids are int32 (and so are the tokenizer's)
_decoder = msgspec.json.Decoder()


class RequestError(ValueError):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def bad_request(message: str) -> RequestError:
    return RequestError(400, "BadRequest", message)


def api_kind_of(path: str) -> ApiKind:
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, kind in _PATH_KINDS:
        if path.endswith(suffix):
            return kind
    return ApiKind.OTHER


def _text_tokens(text: str) -> int:
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def _is_token(t: Any) -> bool:
    return type(t) is int and 0 <= t <= _MAX_TOKEN_ID


def _check_prompt(prompt: Any, name: str = "prompt") -> tuple[str | list[int], int]:
    """Validate a completions `prompt` (or an embeddings `input`); returns (the prompt to key, estimated
    prompt tokens of the whole request).

    A list of ints is one token-id prompt. A list of strings or of token-id lists is a batch: vLLM 0.32
    runs each item as its own engine request (`prompt_to_seq` in vllm-project/vllm
    vllm/renderers/inputs/preprocess.py; `{request_id}-{i}`, added in list order, in
    vllm/entrypoints/openai/completion/serving.py), and SGLang as a batch of `text` / `input_ids`
    (sgl-project/sglang python/sglang/srt/entrypoints/openai/serving_completions.py). Each item is cached
    on its own, from the same root: the items are never joined. The first item is keyed (the engine's
    first request of the batch; the others get no cache credit), and the estimate counts every item (all
    of them are prefilled on the pod picked). An empty list is a 400 (vLLM: "You must pass at least one
    prompt", `render_prompts` in vllm/renderers/base.py; SGLang: "Prompt cannot be empty",
    `_validate_request` in serving_completions.py), and so is a batch whose items are all empty (SGLang's
    same check), and any other shape (mixed items, deeper nesting: vLLM's `CompletionRequest.prompt`,
    vllm/entrypoints/openai/completion/protocol.py, accepts none of them)."""
    if isinstance(prompt, str):
        return prompt, _text_tokens(prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request(f"'{name}' must not be an empty list: the engine needs at least one prompt")
        if all(map(_is_token, prompt)):
            return prompt, len(prompt)
        texts = all(isinstance(p, str) for p in prompt)
        if texts or all(isinstance(p, list) and all(map(_is_token, p)) for p in prompt):
            if not any(prompt):
                raise bad_request(f"'{name}' has only empty prompts: the engine needs a non-empty one")
            return prompt[0], sum(map(_text_tokens, prompt)) if texts else sum(map(len, prompt))
    raise bad_request(
        f"'{name}' must be a string, a list of strings, a list of token ids (ints in 0..2147483647), "
        "or a list of token-id lists"
    )


def _batch_rest(prompt: Any, tokens: int) -> int:
    """Of a checked prompt's estimate `tokens`, what a batch's items after the first take (0 unless a batch):
    the engine prefills them too, on the same pod, with no cache credit."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        first = prompt[0]
        return tokens - (_text_tokens(first) if isinstance(first, str) else len(first))
    return 0


def _check_messages(
    messages: Any, name: str = "messages", *, may_be_empty: bool = False
) -> tuple[list[dict[str, Any]], int]:
    if not isinstance(messages, list) or not (messages or may_be_empty):
        raise bad_request(f"'{name}' must be a non-empty list")
    chars = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"'{name}[{i}]' must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    chars += len(part["text"])
        elif content is not None:
            raise bad_request(f"'{name}[{i}].content' must be a string, a list of parts, or null")
    return messages, (chars + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def parse_body(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    if not body:
        raise bad_request("request body is empty; expected a JSON object")
    try:
        doc = _decoder.decode(body)
    except msgspec.DecodeError as err:
        raise bad_request(f"request body is not valid JSON: {err}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(doc, dict):
        raise bad_request("request body must be a JSON object")
    return doc


_DEFAULT_CHAT = ChatOptions()
_EMBEDDINGS_CHAT = ChatOptions(add_generation_prompt=False)


def _flag(body: Mapping[str, Any], name: str, default: bool, *, nullable: bool = False) -> bool:
    """A boolean field as vLLM's pydantic request models read it (`lax_bool`: true/false, 0/1, "true",
    "no", "on", ...); absent: `default`. null is `default` for a field vLLM declares `bool | None`
    (`nullable`: `stream`), else a 400, as pydantic gives for a plain `bool` field."""
    value = body.get(name)
    if value is None and (nullable or name not in body):
        return default
    try:
        return lax_bool(value)
    except ValueError:
        raise bad_request(
            f"'{name}' must be a boolean (true or false; vLLM also reads 0/1 and strings such as "
            '"true", "no", "on")'
        ) from None


def _chat_options(body: Mapping[str, Any], kind: ApiKind) -> ChatOptions | None:
    """The fields of a chat request that change the rendered prompt, checked as vLLM checks them; None
    when none is set (a chat completion's defaults). `reasoning_effort` reaches the template as vLLM's
    `build_chat_params` passes it: as `reasoning_effort`, and as `enable_thinking` (effort != "none")
    unless `chat_template_kwargs` sets it. An empty `tools` or `documents` list is kept: vLLM hands the
    template `[]`, not nothing.

    An embeddings chat is vLLM's `EmbeddingChatRequest` (`ChatRequestMixin`,
    vllm/entrypoints/pooling/base/protocol.py): `add_generation_prompt` defaults to false there, and it has
    no `tools`, `documents` or `reasoning_effort` (pydantic ignores them: so does the EPP).

    vLLM refuses both `continue_final_message` and `add_generation_prompt` when the values sent are both
    truthy as Python reads them before validation (`check_generation_prompt`: "false", a non-empty string,
    is truthy there), and transformers refuses them both true after it (the chat completion's default
    `add_generation_prompt` is true): either is a 400."""
    embeddings = kind is ApiKind.EMBEDDINGS
    generation = _flag(body, "add_generation_prompt", not embeddings)
    continued = _flag(body, "continue_final_message", False)
    if (generation and continued) or (
        body.get("continue_final_message") and body.get("add_generation_prompt")
    ):
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object")
    if embeddings:
        return ChatOptions(
            add_generation_prompt=generation,
            continue_final_message=continued,
            chat_template_kwargs=template_kwargs(kwargs, None),
        )
    lists = {}
    for name in ("tools", "documents"):
        value = body.get(name)
        if value is not None and (not isinstance(value, list) or not all(isinstance(x, dict) for x in value)):
            raise bad_request(f"'{name}' must be a list of objects")
        lists[name] = value
    # vLLM's `check_tool_usage`: tool_choice defaults to "auto" when tools are sent, else "none"; "required"
    # with an empty tools list is "none" without tools
    choice = body["tool_choice"] if "tool_choice" in body else ("auto" if lists["tools"] else "none")
    if choice == "required" and lists["tools"] == []:
        choice, lists["tools"] = "none", None
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request("'reasoning_effort' must be a string")
    options = ChatOptions(
        add_generation_prompt=generation,
        continue_final_message=continued,
        tools=lists["tools"],
        documents=lists["documents"],
        chat_template_kwargs=template_kwargs(kwargs, effort),
        tool_choice_none=lists["tools"] is not None and choice == "none",
    )
    return None if options == _DEFAULT_CHAT else options


def _add_special_tokens(body: Mapping[str, Any]) -> bool | None:
    """The request's `add_special_tokens` (vLLM honours it: `build_tok_params`; a plain `bool` field, so
    null is a 400); None when not sent: the API's default."""
    return _flag(body, "add_special_tokens", False) if "add_special_tokens" in body else None


_STORED_HISTORY = PromptTokens(None, "stored_history")
_PROMPT_EMBEDS = PromptTokens(None, "prompt_embeds")
_OWN_TEMPLATE = PromptTokens(None, "request_chat_template")


def _own_template(body: Mapping[str, Any], kind: ApiKind) -> bool:
    """Whether a chat brings its own chat template (vLLM's `validate_chat_template`: the request's
    `chat_template`, a field the Responses API does not have, or its kwargs' `chat_template`, not null)."""
    template = None if kind is ApiKind.RESPONSES else body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise bad_request("'chat_template' must be a string")
    kwargs = body.get("chat_template_kwargs")
    return template is not None or (isinstance(kwargs, dict) and request_template(kwargs))


def _prompt_embeds(value: Any) -> PromptTokens:
    """A completion given as `prompt_embeds` only (vLLM: base64 tensors, one or a list): accepted, as vLLM
    accepts it, but its tokens are unknown here (vLLM hashes the embeddings): routed by load, unkeyed."""
    if not (isinstance(value, str) and value) and not (
        isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)
    ):
        raise bad_request("'prompt_embeds' must be a non-empty base64 string or a list of them")
    return _PROMPT_EMBEDS


def _responses(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], int, ChatOptions, PromptTokens | None]:
    """A Responses body's chat, as vLLM builds it (`epp/responses_api.py`): (messages, estimated prompt
    tokens, options, `stored_history` when the prompt starts with a conversation only vLLM holds)."""
    try:
        chat = responses_chat(body)
    except InvalidResponsesBody as err:
        raise bad_request(str(err)) from None
    messages, tokens = _check_messages(chat.messages, "input", may_be_empty=True)
    options = ChatOptions(
        add_generation_prompt=not chat.continue_final_message,
        continue_final_message=chat.continue_final_message,
        tools=chat.tools,
        chat_template_kwargs=chat.chat_template_kwargs,
        tool_choice_none=chat.tools is not None and chat.tool_choice_none,
    )
    return messages, tokens, options, _STORED_HISTORY if chat.stored_history else None


_INT64_MAX = 2**63 - 1
_LAX_INT = re.compile(
    r"[+-]?\d+(?:_\d+)*(?:\.0+)?"
)  # pydantic's integer strings ("5", " 5 ", "5.0", "1_000")
_SIDES = ("left", "right")
_TRUNCATING = (ApiKind.COMPLETIONS, ApiKind.CHAT_COMPLETIONS, ApiKind.EMBEDDINGS)


def _lax_int(value: Any) -> int | None:
    """An integer field's value as vLLM's pydantic models read it (lax mode: true/false, integral floats,
    integer strings), or None when it is not one."""
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _LAX_INT.fullmatch(value.strip()):
        return int(value.strip().split(".")[0])
    return None


def _truncation(body: Mapping[str, Any], kind: ApiKind) -> tuple[int | None, str | None]:
    """vLLM's `truncate_prompt_tokens` (an integer >= -1, or null) and `truncation_side` ("left", "right" or
    null) of a completion, chat completion or embeddings request (`CompletionRequest`,
    `ChatCompletionRequest`, `PoolingBasicRequestMixin`), checked as vLLM checks them. A Responses request
    has neither; its `truncation` ("auto" or "disabled", vLLM's `ResponsesRequest`) is checked, and changes
    nothing the EPP keys: vLLM's "auto" drops the oldest messages only from a conversation longer than the
    model's context (`vllm/renderers/response_truncation.py`), which "disabled" refuses with a 400."""
    if kind is ApiKind.RESPONSES:
        if body.get("truncation") not in (None, "auto", "disabled"):
            raise bad_request('\'truncation\' must be "auto" or "disabled"')
        return None, None
    if kind not in _TRUNCATING:
        return None, None
    value = body.get("truncate_prompt_tokens")
    count = None if value is None else _lax_int(value)
    if value is not None and (count is None or not -1 <= count <= _INT64_MAX):
        raise bad_request(
            "'truncate_prompt_tokens' must be an integer >= -1 (-1: the model's length less the output)"
        )
    side = body.get("truncation_side")
    if side is not None and side not in _SIDES:
        raise bad_request('\'truncation_side\' must be "left" or "right"')
    return count, side


def sglang_adapter(model: str, served_models: Collection[str]) -> str | None:
    """The LoRA adapter a `model` of the form `<base model>:<adapter>` names, as SGLang reads it, else None.

    SGLang (since sgl-project/sglang PR #11570, October 2025) splits a request's `model` at its first
    ':' and strips both parts (`_parse_model_parameter`), and runs the request with the adapter part as
    its `lora_path` (`_resolve_lora_path`, which wins over the body's `lora_path`), both in
    python/sglang/srt/entrypoints/openai/serving_base.py; serving_completions.py passes it on as
    `GenerateReqInput.lora_path`. The adapter's name is then the request's cache namespace (the
    `lora_name` of its KV events). vLLM reads no such syntax: its served model names may contain ':'
    (`--served-model-name gpt-oss:120b`, which SGLang itself misreads as an adapter: sgl-project/sglang
    issue #12745). So the name is split only when its base part is a model served here
    (`served_models`) and the whole name is not one."""
    if ":" not in model or model in served_models:
        return None
    base, adapter = (part.strip() for part in model.split(":", 1))
    return adapter if adapter and base in served_models else None


def build_request(
    headers: Mapping[str, str],
    body: dict[str, Any] | None,
    objectives: Mapping[str, int],
    body_bytes: int = 0,
    *,
    served_models: Collection[str] = (),
) -> InferenceRequest:
    """Validate and build the request. `headers` keys are lower-case. `served_models`: the base models
    served here; a `model` of the form `<one of them>:<adapter>` is SGLang's adapter syntax, and the
    request's model is then the adapter's name (`sglang_adapter`), as for a vLLM adapter request."""
    path = headers.get(":path", "")
    kind = api_kind_of(path)
    request_id = headers.get("x-request-id") or str(uuid.uuid4())
    objective = headers.get(OBJECTIVE_HEADER)
    if objective is None:  # llm-d's name, when present (even empty), wins
        objective = headers.get(GIE_OBJECTIVE_HEADER)
    objective = objective or None
    priority = objectives.get(objective, 0) if objective else 0
    kept = {k: headers[k] for k in HEADERS_OF_INTEREST if k in headers}
    if body is None:
        return InferenceRequest(request_id, kind, "", headers=kept, objective=objective, priority=priority)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is missing or not a non-empty string")
    model = sglang_adapter(model, served_models) or model
    batch = 0  # a batch's tokens beyond its first item
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tokens = 0
    chat: ChatOptions | None = None
    known: PromptTokens | None = None
    if kind is ApiKind.RESPONSES:
        messages, tokens, chat, known = _responses(body)
    elif kind is ApiKind.COMPLETIONS:  # a stray `messages` is ignored, as vLLM's CompletionRequest ignores it
        if body.get("prompt") is not None and body["prompt"] != "":
            prompt, tokens = _check_prompt(body["prompt"])
            batch = _batch_rest(body["prompt"], tokens)
        elif body.get("prompt_embeds") is not None:
            known = _prompt_embeds(body["prompt_embeds"])
        else:  # vLLM's `validate_prompt_and_prompt_embeds`
            raise bad_request("a completion needs a non-empty 'prompt' (or 'prompt_embeds')")
    elif "messages" in body or kind is ApiKind.CHAT_COMPLETIONS:  # a chat's stray `prompt` is ignored too
        messages, tokens = _check_messages(body.get("messages"))
        chat = _chat_options(body, kind)
    elif "prompt" in body:
        prompt, tokens = _check_prompt(body["prompt"])
        batch = _batch_rest(body["prompt"], tokens)
    elif kind is ApiKind.EMBEDDINGS and "input" in body:
        inp = body["input"]
        if isinstance(inp, list) and inp and all(isinstance(m, dict) for m in inp):
            messages, tokens = _check_messages(inp, "input")
            chat = _EMBEDDINGS_CHAT
        else:
            prompt, tokens = _check_prompt(inp, "input")
            batch = _batch_rest(inp, tokens)
    else:
        raise bad_request("request needs 'prompt' or 'messages' (or 'input' for embeddings)")
    if messages is not None and _own_template(body, kind) and known is None:
        known = _OWN_TEMPLATE
    # a Responses request has no such field (vLLM ignores one sent): its chat is encoded with special tokens
    add_special_tokens = True if kind is ApiKind.RESPONSES else _add_special_tokens(body)
    # `stream` is `bool | None` in vLLM's models (null: not streamed); embeddings have none (ignored)
    stream = kind is not ApiKind.EMBEDDINGS and _flag(body, "stream", False, nullable=True)
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise bad_request("'cache_salt' must be a non-empty string")
    if kind is ApiKind.RESPONSES:
        limit = "max_output_tokens"
    else:
        limit = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(limit)
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 0):
        raise bad_request(f"'{limit}' must be a non-negative integer")
    truncate, side = _truncation(body, kind)
    return InferenceRequest(
        request_id=request_id,
        api_kind=kind,
        model=model,
        prompt=prompt,
        messages=messages,
        stream=stream,
        max_tokens=max_tokens,
        headers=kept,
        objective=objective,
        priority=priority,
        body_bytes=body_bytes,
        prompt_tokens_estimate=tokens,
        batch_tokens=batch,
        cache_salt=cache_salt,
        chat=chat,
        tokens=known,
        add_special_tokens=add_special_tokens,
        truncate_prompt_tokens=truncate,
        truncation_side=side,
    )
