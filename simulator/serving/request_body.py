"""An OpenAI completions / chat completions body -> what the engine runs (`Generation`), or an `ApiError`.

Prompts are turned into token ids by the EPP's own code (`epp.kvindex.prompt.PromptTokenizer`), the
same calls its scorers make, so the router's block keys and the engine's blocks agree as they do with a
real vLLM: a text prompt is `encode(text, add_special_tokens=True)`, chat messages are rendered with the
model's chat template and encoded without adding special tokens (`add_special_tokens` in the body
overrides either, as in vLLM).

Supported prompt shapes (completions): a string, a list of token ids, or a list holding exactly one of
those. Batches (several prompts in one request), `n` > 1 and `prompt_embeds` are refused with a 400
naming the field. Without a tokenizer only token-id prompts are accepted. Token ids must be integers in
[0, vocabulary size) with a tokenizer (vLLM's check), in [0, 2^31) without one.

Also honoured: `model` (absent means the served model; another one is a 404 as vLLM answers),
`max_tokens` / `max_completion_tokens` (the latter wins for chat), `stream`, `stream_options.
include_usage`, `cache_salt` (salts the engine's blocks), and for chat `add_generation_prompt`,
`continue_final_message`, `tools`, `chat_template_kwargs`. Sampling fields are accepted and ignored
(the engine always generates exactly `max_tokens` tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from epp.kvindex.chat_inputs import lax_bool
from epp.kvindex.prompt import PromptTokenizer, TokenizerError
from epp.requests import RequestError, parse_body

_MAX_ID = 2**31 - 1


class ApiError(Exception):
    """An error answered OpenAI-style: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    @property
    def type(self) -> str:
        return {404: "NotFoundError", 503: "ServiceUnavailableError"}.get(self.status, "BadRequestError")

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        }


@dataclass(frozen=True, slots=True)
class Generation:
    """One request as the engine runs it."""

    chat: bool
    model: str
    prompt_ids: npt.NDArray[np.int64]
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str | None


def decode_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body (the EPP's own parser and messages)."""
    try:
        return parse_body(raw)
    except RequestError as err:
        raise ApiError(err.message) from None


def _flag(doc: Mapping[str, Any], name: str, default: bool) -> bool:
    """A boolean as vLLM's pydantic models read it (`lax_bool`: true/false, 0/1, "true", "no", "on", ...)."""
    value = doc.get(name)
    if value is None:
        return default
    try:
        return lax_bool(value)
    except ValueError:
        raise ApiError(
            f'\'{name}\' must be a boolean (true or false; also 0/1 and strings such as "true", "no"), '
            f"got {value!r}",
            param=name,
        ) from None


def _ids(values: list[Any], param: str, vocab: int | None) -> npt.NDArray[np.int64]:
    limit = vocab if vocab is not None else _MAX_ID + 1
    for i, t in enumerate(values):
        if type(t) is not int:
            raise ApiError(f"'{param}[{i}]' must be an integer token id, got {type(t).__name__}", param=param)
        if not 0 <= t < limit:
            what = f"out of vocabulary (size {vocab})" if vocab is not None else f"not in [0, {limit})"
            raise ApiError(f"token id {t} at '{param}[{i}]' is {what}", param=param)
    return np.asarray(values, dtype=np.int64)


class BodyReader:
    """Validates bodies for one served model; `tokenizer` None accepts token-id prompts only."""

    def __init__(
        self, model: str, tokenizer: PromptTokenizer | None, vocab_size: int | None, default_max_tokens: int
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.default_max_tokens = default_max_tokens

    def read(self, doc: Mapping[str, Any], *, chat: bool) -> Generation:
        model = doc.get("model")
        if model is None:
            model = self.model
        elif not isinstance(model, str):
            raise ApiError(f"'model' must be a string, got {type(model).__name__}", param="model")
        elif model != self.model:
            raise ApiError(f"The model `{model}` does not exist.", status=404, param="model")
        stream = _flag(doc, "stream", False)
        options = doc.get("stream_options")
        include_usage = False
        if options is not None:
            if not stream:
                raise ApiError(
                    "'stream_options' can only be given when 'stream' is true", param="stream_options"
                )
            if not isinstance(options, dict):
                raise ApiError("'stream_options' must be an object", param="stream_options")
            include_usage = _flag(options, "include_usage", False)
        n = doc.get("n")
        if n is not None and (type(n) is not int or n != 1):
            raise ApiError(f"'n' must be 1 (the simulated engine returns one choice), got {n!r}", param="n")
        salt = doc.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ApiError("'cache_salt' must be a non-empty string if provided", param="cache_salt")
        max_tokens = self._max_tokens(doc, chat)
        ids = self._chat_ids(doc) if chat else self._prompt_ids(doc)
        if len(ids) == 0:
            raise ApiError("the prompt is empty (no tokens)", param="messages" if chat else "prompt")
        return Generation(chat, model, ids, max_tokens, stream, include_usage, salt)

    def _max_tokens(self, doc: Mapping[str, Any], chat: bool) -> int:
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        for name in names:
            value = doc.get(name)
            if value is None:
                continue
            if type(value) is not int:
                raise ApiError(f"'{name}' must be an integer, got {type(value).__name__}", param=name)
            if value < 1:
                raise ApiError(f"'{name}' must be at least 1, got {value}", param=name)
            return value
        return self.default_max_tokens

    def _prompt_ids(self, doc: Mapping[str, Any]) -> npt.NDArray[np.int64]:
        if doc.get("prompt_embeds") is not None:
            raise ApiError("'prompt_embeds' is not supported by the simulated engine", param="prompt_embeds")
        if "prompt" not in doc:
            raise ApiError("'prompt' is required", param="prompt")
        prompt = doc["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            if len(prompt) != 1:
                raise ApiError(
                    f"'prompt' is a batch of {len(prompt)} prompts; the simulated engine takes one prompt "
                    "per request (a string, a list of token ids, or a list holding one of those)",
                    param="prompt",
                )
            prompt = prompt[0]
        add_special = _flag(doc, "add_special_tokens", True)
        if isinstance(prompt, str):
            tok = self._need_tokenizer("a text prompt")
            try:
                return np.asarray(tok.encode_prompt(prompt, add_special_tokens=add_special), dtype=np.int64)
            except TokenizerError as err:
                raise ApiError(str(err), param="prompt") from None
        if isinstance(prompt, list):
            return _ids(prompt, "prompt", self.vocab_size)
        raise ApiError(
            f"'prompt' must be a string or a list of token ids, got {type(prompt).__name__}", param="prompt"
        )

    def _chat_ids(self, doc: Mapping[str, Any]) -> npt.NDArray[np.int64]:
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError("'messages' must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(f"'messages[{i}]' must be an object with a string 'role'", param="messages")
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise ApiError(
                    f"'messages[{i}].content' must be a string, a list of parts, or null", param="messages"
                )
        tools = doc.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ApiError("'tools' must be a list", param="tools")
        kwargs = doc.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ApiError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        add_generation_prompt = _flag(doc, "add_generation_prompt", True)
        continue_final = _flag(doc, "continue_final_message", False)
        add_special = _flag(doc, "add_special_tokens", False)
        tok = self._need_tokenizer("chat messages")
        try:
            ids = tok.encode_chat(
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                continue_final_message=continue_final,
                chat_template_kwargs=kwargs,
                add_special_tokens=add_special,
            )
        except TokenizerError as err:
            raise ApiError(str(err), param="messages") from None
        return np.asarray(ids, dtype=np.int64)

    def _need_tokenizer(self, what: str) -> PromptTokenizer:
        if self.tokenizer is None:
            raise ApiError(
                f"{what} needs a tokenizer: start the server with --tokenizer DIR, or send 'prompt' as a "
                "list of token ids to /v1/completions",
                param="messages" if what.startswith("chat") else "prompt",
            )
        return self.tokenizer
