"""A request's prompt -> the token ids the engine computes, from a local Hugging Face tokenizer directory.

Pure apart from reading the tokenizer files once at load time (no network, no clock, no global random).

What "as the engine would" means here (vLLM 0.32 with a fast Hugging Face tokenizer; vLLM pins transformers
>= 5.16.1, < 5.20, so the tokenizer is set up by transformers 5.19's rules: `tokenizer_files.py`):

- Completions: a token-id prompt is used as given; a text prompt is `encode(text, add_special_tokens=...)`
  with the request's `add_special_tokens` (default True).
- Chat: the messages are rendered with the model's chat template (`chat_template.py`), then encoded with the
  request's `add_special_tokens` (default False: the template writes the bos token itself). A Responses
  request is a chat encoded with True (`epp/responses_api.py`). A truthy `tokenize` in the client's
  `chat_template_kwargs` has vLLM's transformers call encode the text itself, without special tokens.
- Loading (`tokenizer_files.py`): `tokenizer.json`, rebuilt in code for the classes transformers rebuilds
  (Llama, Gemma, Qwen2, GPT-2, ...: their normalizer and pre-tokenizer; the class comes from
  `tokenizer_config.json` and `config.json`'s model type); `tokenizer_config.json` (and, without an
  `added_tokens_decoder`, `special_tokens_map.json`) for the named special tokens (`bos_token`, ...: the
  template's variables; those missing from the vocabulary are added as special tokens) and the added
  tokens; tokenizer.json's post-processor (`add_bos_token` / `add_eos_token` are ignored); the chat
  templates (`chat_template.jinja` and `additional_chat_templates/` win; a multimodal processor's
  `chat_template.json` serves chats without tools). `split_special_tokens` is honoured; truncation and
  padding from the file are switched off. A prompt the tokenizer cannot encode is a TokenizerError.
- A server's own chat settings (`ServerChatSettings`: vLLM's `--chat-template`,
  `--default-chat-template-kwargs`, `--chat-template-content-format`, mirrored per model in the config):
  the server's template replaces the tokenizer's for every chat (vLLM's `resolve_chat_template`,
  `vllm/renderers/hf.py`: the given template comes first, with or without tools), its format replaces
  the detected one, its kwargs are merged under the request's (`chat_inputs.template_inputs`).
- A rendered chat longer than `max_chars` is not encoded (`PromptTooLong`): a template can render a small
  body to megabytes (tool schemas under `tojson(indent=4)`).
- What vLLM computes another way is not guessed at, and `truncate_prompt_tokens` is applied as vLLM
  applies it: `prompt_rules.py`.

Speed: repeated long prefixes are not tokenized again. `prefix_cache.py` keeps the ids of text chunks
cut at stable boundaries (which cuts are stable for which pipelines, checked at load time:
`stable_cuts.py`), each verified once on insert; the result is always exactly `encode(full text)`. When
no kind of cut is stable for a tokenizer, the cache is bypassed: the ids are still exact, just not faster.
`add_special_tokens=True` adds the post-processor's prefix/suffix ids around the cached body when the
probes show that this is all it does (else that call is not cached).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from epp.kvindex.chat_inputs import NotTextContent, template_tokenizes, uses_tools
from epp.kvindex.chat_template import ChatTemplate, ChatTemplateError
from epp.kvindex.prefix_cache import TOKEN_DTYPE, Chunker, PrefixCache, TokenIds
from epp.kvindex.prompt_rules import (
    HARMONY,
    MISTRAL_TOKENIZER,
    PROMPT_TRUNCATION,
    NotReproduced,
    mistral_tokenizer_reason,
    truncate_encoded,
    truncated,
    unkeyed_reason,
)
from epp.kvindex.server_chat import ServerChatSettings, TokenizerSpec
from epp.kvindex.stable_cuts import special_affixes, stable_chunker
from epp.kvindex.tokenizer_files import (
    TokenizerError,
    configure,
    processor_template,
    read_config,
    read_json,
    read_model_config,
    server_template,
    template_sources,
)
from epp.types import ApiKind, ChatOptions, InferenceRequest

__all__ = [
    "HARMONY",
    "MISTRAL_TOKENIZER",
    "PROMPT_TRUNCATION",
    "MultimodalPrompt",
    "NotReproduced",
    "PromptTokenizer",
    "PromptTooLong",
    "ServerChatSettings",
    "TokenizerError",
    "TokenizerRegistry",
    "TokenizerSpec",
    "truncated",
]

DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
DEFAULT_CHUNK_CHARS = 1024
_PARALLEL_CHARS = 32 * 1024
_GIL_FREE_CHARS = 8 * 1024  # a text this long is encoded by the batch call, without the GIL (`_ids`)
_DEFAULT_CHAT = ChatOptions()
_PROCESSOR = " processor"  # the multimodal processor's template, beside the tokenizer's named ones
_SERVER = " server"  # the server's --chat-template: the only one then
_NO_SETTINGS = ServerChatSettings()


class PromptTooLong(TokenizerError):
    """The rendered prompt is longer than the caller's limit (`max_chars`): it was not encoded."""


class MultimodalPrompt(TokenizerError):
    """A message has a part that is not text (an image, audio...): the prompt's ids cannot be known here."""


class PromptTokenizer:
    """One model's tokenizer and chat template, with a bounded prefix cache. See the module docstring.

    It takes over the `tokenizers.Tokenizer` it is given (switches truncation and padding off, may add
    special tokens). Thread-safe: calls that use the prefix cache take turns (the server tokenizes long
    prompts in a worker thread, short ones on its event loop). Ids come back as int32 arrays.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        name: str,
        config: Mapping[str, Any] | None = None,
        spec: Mapping[str, Any] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
        now: Callable[[], datetime] | None = None,
        template_origin: str = "",
        model_config: Mapping[str, Any] | None = None,
        processor_chat_template: tuple[str, str] | None = None,
        server_chat_template: tuple[str, str] | None = None,
        server: ServerChatSettings = _NO_SETTINGS,
        mistral_tokenizer: str | None = None,
    ) -> None:
        """`config`: tokenizer_config.json's (`read_config`); `model_config`: config.json's
        (`read_model_config`); `spec`: the parsed tokenizer.json (to decide which cuts are stable);
        `template_origin`: the file the chat templates came from (for error messages);
        `processor_chat_template`: a multimodal processor's template and its file (`processor_template`);
        `server_chat_template`: the server's --chat-template and where it came from (`server_template`),
        which replaces the others; `server`: the server's kwargs and content format (its `chat_template`
        is read by `from_dir`); `mistral_tokenizer`: why vLLM runs Mistral's tokenizer for this model (the
        files found or the mode, `from_dir`), None when it runs Transformers'."""
        self.name = name
        self.server = server
        self.mistral_tokenizer = mistral_tokenizer
        # vLLM's `use_harmony`: the model's config.json says gpt_oss (the EPP reads the tokenizer directory's)
        self.harmony = (model_config or {}).get("model_type") == "gpt_oss"
        try:
            self._tok, self.special_tokens, changed = configure(tokenizer, config or {}, model_config, spec)
        except TokenizerError as e:
            raise TokenizerError(f"{name}: {e}") from e
        self._tok.no_truncation()
        self._tok.no_padding()
        if changed or spec is None:  # describe the tokenizer as it now is, not as tokenizer.json has it
            spec = json.loads(self._tok.to_str())
        self._templates: dict[str, ChatTemplate] = {}
        sources = [(n, s, template_origin) for n, s in (chat_templates or {}).items()]
        if processor_chat_template is not None:
            sources.append((_PROCESSOR, *processor_chat_template))
        if server_chat_template is not None:  # vLLM never reads the tokenizer's then
            sources = [(_SERVER, *server_chat_template)]
        for template_name, source, origin in sources:
            try:
                self._templates[template_name] = ChatTemplate(
                    source, special_tokens=self.special_tokens, now=now, content_format=server.content_format
                )
            except ChatTemplateError as e:
                where = f" in {origin}" if origin else ""
                if template_name == _SERVER:
                    raise TokenizerError(f"{name}: chatTemplate (vLLM's --chat-template){where}: {e}") from e
                raise TokenizerError(f"{name}: chat template {template_name!r}{where}: {e}") from e
        try:
            chunker, self.chunking_notes = stable_chunker(self._tok, spec, chunk_chars)
            self._affixes = special_affixes(self._tok)
        except Exception as e:  # the Rust side raises plain Exception (a character it has no token for, ...)
            chunker, self._affixes = Chunker(chunk_chars, split_before_space=False), None
            self.chunking_notes = [f"prefix cache off: the probe texts cannot be encoded ({e})"]
        self._cache = PrefixCache(self._encode_body, self._encode_bodies, chunker, max_bytes=cache_bytes)
        self._lock = threading.Lock()  # the prefix cache's
        if self._affixes is None:
            self.chunking_notes.append("add_special_tokens=True is not a fixed prefix/suffix: not cached")

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
        now: Callable[[], datetime] | None = None,
        name: str | None = None,
        server: ServerChatSettings = _NO_SETTINGS,
    ) -> PromptTokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, chat template files) from a local directory.

        `now` gives templates a wall clock (`strftime_now`, e.g. Llama 3.1's "Today Date"); without one,
        templates see `strftime_now` undefined (most fall back to a fixed date; others raise).
        `server`: the model's server-side chat settings (its `chat_template` file is read here).
        """
        root = Path(path)
        label = name or str(root)
        server_chat_template = None
        if server.chat_template is not None:
            try:
                server_chat_template = server_template(server.chat_template)
            except TokenizerError as e:
                raise TokenizerError(f"{label}: chatTemplate (vLLM's --chat-template): {e}") from e
        if not root.is_dir():
            raise TokenizerError(f"{label}: tokenizer directory {root} does not exist")
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{label}: {tokenizer_file} is missing (only fast tokenizers are supported)")
        spec = read_json(tokenizer_file)
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises plain Exception
            raise TokenizerError(f"{tokenizer_file}: not a tokenizers file: {e}") from e
        config = read_config(root)
        templates, origin = template_sources(root, config)
        processor, processor_origin = processor_template(root)
        return cls(
            tokenizer,
            name=label,
            config=config,
            spec=spec,
            chat_templates=templates,
            cache_bytes=cache_bytes,
            chunk_chars=chunk_chars,
            now=now,
            template_origin=origin,
            model_config=read_model_config(root),
            processor_chat_template=None if processor is None else (processor, processor_origin),
            server_chat_template=server_chat_template,
            server=server,
            mistral_tokenizer=mistral_tokenizer_reason(root, server.tokenizer_mode),
        )

    def _encode_body(self, text: str) -> list[int]:
        return self._ids(text, add_special_tokens=False)

    def _ids(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """One text's ids. A long one goes through the batch call, which lets go of the GIL while it works
        (`encode` keeps it: a worker thread tokenizing with it would stop the event loop) and, without
        offsets, is faster too; the ids are the same."""
        try:
            if len(text) < _GIL_FREE_CHARS:
                short: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
                return short
            batch = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)
            long: list[int] = batch[0].ids
            return long
        except Exception as e:  # the Rust side raises plain Exception; the engine fails such a prompt too
            raise TokenizerError(f"{self.name}: cannot encode the prompt: {e}") from e

    def _encode_bodies(self, texts: list[str]) -> list[list[int]]:
        try:
            if sum(map(len, texts)) < _PARALLEL_CHARS:  # a thread-pool batch costs ~0.1 ms before any work
                return [self._tok.encode(t, add_special_tokens=False).ids for t in texts]
            return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]
        except Exception as e:  # as in `_ids`
            raise TokenizerError(f"{self.name}: cannot encode the prompt: {e}") from e

    # --- public API ---

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    @property
    def chunker(self) -> Chunker:
        """Where prompts are cut for the prefix cache (see `chunking_notes` for the kinds turned off)."""
        return self._cache.chunker

    def encode_prompt(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True) -> TokenIds:
        """A completions prompt: token ids are used as given; text is encoded with special tokens added."""
        if isinstance(prompt, str):
            return self.encode_text(prompt, add_special_tokens=add_special_tokens)
        try:
            ids = np.asarray(prompt, dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as e:
            raise TokenizerError(f"{self.name}: prompt is neither text nor a list of token ids") from e
        if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() > np.iinfo(TOKEN_DTYPE).max)):
            raise TokenizerError(f"{self.name}: prompt token ids must be a flat list of non-negative ids")
        return ids.astype(TOKEN_DTYPE)

    def encode_text(self, text: str, *, add_special_tokens: bool) -> TokenIds:
        """`encode(text, add_special_tokens=...)`, using the prefix cache."""
        if add_special_tokens:
            if self._affixes is None:
                return np.asarray(self._ids(text, add_special_tokens=True), dtype=TOKEN_DTYPE)
            prefix, suffix = self._affixes
            with self._lock:
                body = self._cache.encode(text)
            if not prefix and not suffix:
                return body
            return np.concatenate(
                [np.asarray(prefix, dtype=TOKEN_DTYPE), body, np.asarray(suffix, dtype=TOKEN_DTYPE)]
            )
        with self._lock:
            return self._cache.encode(text)

    def encode_uncached(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """The reference: the whole text in one tokenizer call (no cache)."""
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Any = None,
        documents: Any = None,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        keep_unset_kwargs: bool = False,
    ) -> str:
        """The prompt text the engine builds from these messages with the model's chat template
        (`keep_unset_kwargs`: a Responses request's, see `ChatTemplate.render`)."""
        # as vLLM picks: a processor's template for a chat without tools, else transformers' pick by the tools
        # the template gets (the client's chat_template_kwargs' win): tool_use, else default
        defaults = self.server.default_kwargs
        with_tools = uses_tools(tools, chat_template_kwargs, defaults)
        template = self._templates.get(_SERVER)  # the server's own comes first (vLLM's resolve_chat_template)
        template = template or (None if with_tools else self._templates.get(_PROCESSOR))
        template = template or (self._templates.get("tool_use") if with_tools else None)
        template = template or self._templates.get("default")
        if template is None:  # transformers raises (vLLM then has no template either)
            named = ", ".join(sorted(n for n in self._templates if n != _PROCESSOR))
            missing = f"a default chat_template (only {named})" if named else "chat_template"
            raise TokenizerError(f"{self.name}: the tokenizer has no {missing}")
        try:
            return template.render(
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=documents,
                continue_final_message=continue_final_message,
                template_kwargs=chat_template_kwargs,
                keep_unset_kwargs=keep_unset_kwargs,
                default_kwargs=defaults,
            )
        except NotTextContent as e:
            raise MultimodalPrompt(f"{self.name}: chat template: {e}") from e
        except ChatTemplateError as e:
            raise TokenizerError(f"{self.name}: chat template: {e}") from e

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Any = None,
        documents: Any = None,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
        max_chars: int | None = None,
        keep_unset_kwargs: bool = False,
    ) -> TokenIds:
        """Render with the chat template, then encode (by default without adding special tokens, as vLLM's
        chat completions; never when the client's kwargs ask for `tokenize`: transformers then encodes the
        text itself, without them). A rendered text longer than `max_chars` raises PromptTooLong."""
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            keep_unset_kwargs=keep_unset_kwargs,
        )
        if max_chars is not None and len(text) > max_chars:
            raise PromptTooLong(
                f"{self.name}: the rendered chat has {len(text)} characters (limit {max_chars})"
            )
        add = add_special_tokens and not template_tokenizes(chat_template_kwargs)
        return self.encode_text(text, add_special_tokens=add)

    def unkeyed_reason(self, request: InferenceRequest) -> str | None:
        """Why vLLM's prompt ids for this request cannot be computed here, or None (`prompt_rules`)."""
        return unkeyed_reason(request, mistral=self.mistral_tokenizer is not None, harmony=self.harmony)

    def _truncate(self, ids: TokenIds, request: InferenceRequest, *, special: bool) -> TokenIds:
        """The ids vLLM keeps of this text or chat prompt (`prompt_rules.truncate_encoded`)."""
        return truncate_encoded(ids, request, self._affixes, self.name, special=special)

    def encode_request(self, request: InferenceRequest, *, max_chars: int | None = None) -> TokenIds | None:
        """The prompt ids of a parsed request (chat messages with its chat options, else the completions
        prompt), with its `add_special_tokens` (default: False for chat, True for a text prompt), or None.
        `max_chars` bounds the rendered chat (PromptTooLong). A request whose ids vLLM computes another way
        (`unkeyed_reason`) raises NotReproduced."""
        reason = self.unkeyed_reason(request)
        if reason is not None:
            raise NotReproduced(reason, f"{self.name}: vLLM computes these prompt ids another way ({reason})")
        add = request.add_special_tokens
        if request.messages is not None:
            c = request.chat or _DEFAULT_CHAT
            # vLLM's --exclude-tools-when-tool-choice-none: no tools for a tool_choice "none"
            excluded = c.tool_choice_none and self.server.exclude_tools_when_tool_choice_none
            ids = self.encode_chat(
                request.messages,
                add_generation_prompt=c.add_generation_prompt,
                continue_final_message=c.continue_final_message,
                tools=None if excluded else c.tools,
                documents=c.documents,
                chat_template_kwargs=c.chat_template_kwargs,
                add_special_tokens=bool(add),
                max_chars=max_chars,
                keep_unset_kwargs=request.api_kind is ApiKind.RESPONSES,
            )
            special = bool(add) and not template_tokenizes(c.chat_template_kwargs)
            return self._truncate(ids, request, special=special)
        if request.prompt is not None:
            ids = self.encode_prompt(request.prompt, add_special_tokens=add is not False)
            text = isinstance(request.prompt, str)  # token ids are only cut (`_token_truncation`)
            return self._truncate(ids, request, special=text and add is not False)
        return None

    def cache_stats(self) -> dict[str, int]:
        """hits / misses (chunks), bytes, entries, evictions, unstable (chunks that failed verification),
        tokenized_chars (characters given to the tokenizer through the cache)."""
        with self._lock:
            return self._cache.stats()

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()


class TokenizerRegistry:
    """model name -> PromptTokenizer, `{model: path}` (or a `TokenizerSpec`: the path and the model's
    server-side chat settings); unknown model -> None (precise scoring off)."""

    def __init__(
        self,
        paths: Mapping[str, str | Path | TokenizerSpec],
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
        now: Callable[[], datetime] | None = None,
    ) -> None:
        """Loads every tokenizer now; a bad one raises TokenizerError naming the model."""
        self._by_model: dict[str, PromptTokenizer] = {}
        for model, entry in paths.items():
            path, server = (
                (entry.path, entry.chat) if isinstance(entry, TokenizerSpec) else (entry, _NO_SETTINGS)
            )
            try:
                self._by_model[model] = PromptTokenizer.from_dir(
                    path, cache_bytes=cache_bytes, chunk_chars=chunk_chars, now=now, name=model, server=server
                )
            except TokenizerError as e:
                raise TokenizerError(f"model {model!r} (tokenizer at {path}): {e}") from e

    def get(self, model: str) -> PromptTokenizer | None:
        return self._by_model.get(model)

    def mistral_models(self) -> dict[str, str]:
        """The models whose text and chat prompts are unkeyed (`MISTRAL_TOKENIZER`), with why: the server
        logs them once at load time."""
        return {m: t.mistral_tokenizer for m, t in self._by_model.items() if t.mistral_tokenizer is not None}

    def models(self) -> list[str]:
        return list(self._by_model)
