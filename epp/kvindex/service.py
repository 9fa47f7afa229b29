"""What the prefix-cache scorers share: the index, freshness verdicts and tokenizers. Pure.

The server builds one `KvIndexService` and hands it to plugins through `PluginHandle.services`
(key `SERVICE_KEY`); the simulator builds the same object.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from epp.kvindex.chat_inputs import NotTextContent
from epp.kvindex.chat_template import ChatTemplateError
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import block_keys, root_key
from epp.kvindex.prompt import (
    PROMPT_TRUNCATION,
    MultimodalPrompt,
    NotReproduced,
    PromptTooLong,
    TokenizerError,
    TokenizerRegistry,
    truncated,
)
from epp.kvindex.speculative import SpeculativeBlocks
from epp.requests import CHARS_PER_TOKEN
from epp.types import InferenceRequest, PromptTokens

_NO_TOKENIZER = PromptTokens(None, "no_tokenizer")
_TOO_LONG = PromptTokens(None, "too_long")
_TOKENIZER_ERROR = PromptTokens(None, "tokenizer_error")
_MULTIMODAL = PromptTokens(None, "multimodal")
_TRUNCATED = PromptTokens(None, PROMPT_TRUNCATION)
_NO_PROMPT = PromptTokens(None)

SERVICE_KEY = "kv_index"
_EMPTY = np.zeros(0, dtype=np.uint64)
MAX_UNKEYED_MODELS = 256  # models counted by name in `unkeyed`; further ones (or long names) as "other"
_MAX_MODEL_CHARS = 256


@dataclass
class KvIndexService:
    index: BlockIndex
    freshness: FreshnessTracker
    tokenizers: TokenizerRegistry
    block_size: int
    # model -> requests that could not be keyed, by reason ("no_tokenizer", "too_long", "tokenizer_error",
    # "multimodal", "tokenizer_busy", "stored_history", "harmony", "prompt_truncation", ...:
    # `PromptTokens.unkeyed`)
    unkeyed: Counter[tuple[str, str]] = field(default_factory=Counter)
    # the plugins that read prompts' tokens (they register when built): without any, the server does
    # not tokenize ahead of scheduling
    prompt_readers: set[str] = field(default_factory=set)
    # scorer plugin name -> its speculative entries (`speculativeTtl`), kept apart from the exact index;
    # listed here so that /debug/index and the metrics report their size
    speculative: dict[str, SpeculativeBlocks] = field(default_factory=dict)
    # text and chat prompts longer than this (characters) are not tokenized (~1 s a MB, and the server
    # tokenizes long prompts one at a time in a worker thread): they get no cache credit and count as
    # unkeyed ("too_long"). A chat is checked twice: its body's size before rendering, and the rendered
    # text (a template may render a small body to megabytes) before encoding
    max_keyed_prompt_chars: int = 524_288

    def prompt_tokens(self, request: InferenceRequest) -> list[int] | np.ndarray | None:
        """The prompt's token ids as the engine sees them, or None when they cannot be known (counted in
        `unkeyed`). Ids computed ahead (`request.tokens`) are used as they are."""
        result = request.tokens if request.tokens is not None else self.tokenize(request)
        if result.unkeyed is not None:
            self._unkeyed(request.model, result.unkeyed)
        ids = result.ids
        return ids if ids is None or isinstance(ids, (list, np.ndarray)) else list(ids)

    def tokenizing_chars(self, request: InferenceRequest) -> int:
        """About how many characters `tokenize` reads for this request: 0 when it reads none (token ids
        given, no tokenizer for the model, too long, no prompt). The server tokenizes long ones in a
        worker thread (`epp/server/tokenizing.py`)."""
        if request.prompt is not None and not isinstance(request.prompt, str):
            return 0
        if (request.messages is None and request.prompt is None) or request.truncate_prompt_tokens == -1:
            return 0
        tok = self.tokenizers.get(request.model)
        if tok is None or tok.unkeyed_reason(request) is not None:
            return 0
        chars = self._prompt_chars(request)
        return max(chars, 1) if chars <= self.max_keyed_prompt_chars else 0  # ("" is tokenized too)

    def tokenize(self, request: InferenceRequest) -> PromptTokens:
        """The prompt's token ids, or why they cannot be known; counts nothing (the caller does), so a
        worker thread may call it (the tokenizer serialises its own calls)."""
        prompt = request.prompt
        if prompt is not None and not isinstance(prompt, str):  # token ids: used as given, then truncated
            given = prompt if isinstance(prompt, np.ndarray) else list(prompt)  # (an array: the simulator's)
            count = request.truncate_prompt_tokens
            if count == -1:  # vLLM's max_model_len less the output tokens: unknown here
                return _TRUNCATED
            return PromptTokens(given if count is None else truncated(given, count, request.kept_side))
        tok = self.tokenizers.get(request.model)
        if tok is None:
            return _NO_TOKENIZER
        reason = tok.unkeyed_reason(request)  # (whatever the prompt's size: the true reason)
        if reason is not None:
            return PromptTokens(None, reason)
        if self._prompt_chars(request) > self.max_keyed_prompt_chars:
            return _TOO_LONG
        try:
            ids = tok.encode_request(request, max_chars=self.max_keyed_prompt_chars)
        except NotReproduced as e:
            return PromptTokens(None, e.reason)
        except PromptTooLong:
            return _TOO_LONG
        except (MultimodalPrompt, NotTextContent):
            return _MULTIMODAL
        except (TokenizerError, ChatTemplateError, RecursionError):  # a template that cannot render these
            return _TOKENIZER_ERROR
        return _NO_PROMPT if ids is None else PromptTokens(ids)

    @staticmethod
    def _prompt_chars(request: InferenceRequest) -> int:
        """A text prompt's length; a chat renders its messages and its tools, documents...: the body's size
        bounds all of it."""
        if isinstance(request.prompt, str):
            return len(request.prompt)
        return max(request.body_bytes, request.prompt_tokens_estimate * CHARS_PER_TOKEN)

    def _unkeyed(self, model: str, reason: str) -> None:
        """Count a request that could not be keyed; the model names are clients' to choose: bounded."""
        key = (model, reason)
        if key not in self.unkeyed:
            models = {m for m, _ in self.unkeyed}
            if len(model) > _MAX_MODEL_CHARS or (model not in models and len(models) >= MAX_UNKEYED_MODELS):
                key = ("other", reason)
        self.unkeyed[key] += 1

    def prompt_keys(self, request: InferenceRequest) -> np.ndarray | None:
        """Our block keys of the prompt's full blocks (the root carries model and cache salt)."""
        return self.prompt_tokens_and_keys(request)[1]

    def prompt_tokens_and_keys(self, request: InferenceRequest) -> tuple[int | None, np.ndarray | None]:
        """(prompt token count, block keys), both None when the prompt cannot be tokenized."""
        tokens = self.prompt_tokens(request)
        if tokens is None:
            return None, None
        if len(tokens) < self.block_size:
            return len(tokens), _EMPTY
        return len(tokens), block_keys(tokens, self.block_size, root_key(request.model, request.cache_salt))
