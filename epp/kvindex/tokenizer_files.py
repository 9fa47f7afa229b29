"""A Hugging Face tokenizer directory -> the tokenizer transformers 5 builds from it. Pure apart from reading
the files (at load time).

vLLM 0.32 loads its tokenizer with `AutoTokenizer.from_pretrained(dir, config=<config.json>, ...)` and pins
transformers >= 5.16.1, < 5.20, so these are transformers 5.19's rules (`AutoTokenizer.from_pretrained`,
`PreTrainedTokenizerBase._from_pretrained`, `TokenizersBackend.convert_to_native_format` / `__init__`, the
classes' `__init__`), checked against it (tests/unit/test_tokenizer_transformers5*.py):

- The class: tokenizer_config.json's `tokenizer_class` (`XFast` is `X`), else config.json's, else the one
  registered for config.json's `model_type`. When both a class and a registered one exist and differ, a
  model type registered to the generic backend (`mistral`, `phi3`, `deepseek_v3`, ...) wins, and so does
  the registered class of the types transformers lists as mislabelled on the Hub (`qwen2`, `qwen3_5`).
- The classes with their own `__init__` reproduced in `tokenizer_classes.py` (Llama, CodeLlama, Gemma,
  Qwen2, Qwen3.5, CodeGen, GPT-2, GPT-NeoX, Cohere) rebuild the tokenizer in code: only the vocabulary,
  the merges and the post-processor come from tokenizer.json; its normalizer and pre-tokenizer are replaced
  by the class's
  (Llama: `Metaspace` with `prepend_scheme` "first", or "always" with `legacy: true`, "never" with
  `add_prefix_space: false`). Any other class (the generic `TokenizersBackend` / `PreTrainedTokenizerFast`,
  unknown names) uses tokenizer.json as it is, `add_prefix_space` included.
- `add_bos_token` / `add_eos_token` from the files are ignored (transformers drops them when there is a
  tokenizer.json): tokenizer.json's post-processor decides what `add_special_tokens=True` adds, except
  that CodeLlama always adds its bos token and GPT-NeoX never adds anything.
- Special tokens: tokenizer_config.json's `bos_token`, ..., model-specific `*_token` keys and
  `extra_special_tokens` (or `additional_special_tokens`); `special_tokens_map.json` is read only when the
  config has no `added_tokens_decoder`, and its tokens win. The class's defaults fill the standard ones the
  files do not name. The config's `added_tokens_decoder` (else tokenizer.json's added tokens) is added
  again in id order (its flags win), then the named and extra tokens the tokenizer lacks.
- `fix_mistral_regex: true` in the config replaces the pre-tokenizer's regex for a vocabulary over 100,000
  when config.json is a Mistral model's saved before transformers 5 (or does not say by which).
- A server's `--chat-template` (`server_template`): a file, else the template itself, as vLLM resolves it.
- Mistral's own format (`mistral_files`): with `--tokenizer-mode auto`, vLLM loads `mistral_common`'s
  tokenizer and renderer instead of transformers' when the repo has `tekken.json` or `tokenizer.model.v*`
  (and, since vLLM PR #33253, `consolidated*.safetensors` weights): not reproduced.
- Chat templates: `chat_template.jinja` and `additional_chat_templates/*.jinja` win over the config's.
  `chat_template.json` is a multimodal processor's template: read only beside a processor config
  (`processor_config.json` / `preprocessor_config.json`), where vLLM uses it for chats without tools.

Not reproduced: remote code (`auto_map`), tokenizers without a tokenizer.json, the other classes that
rebuild the tokenizer in code (BERT, T5, XLM-R, ...: tokenizer.json is used as it is), CodeLlama's
infilling (a prompt with `<FILL_ME>`, after which that tokenizer object also encodes differently),
checkpoints that transformers recognises by their Hub name, `added_tokens.json`, versioned
`fast_tokenizer_files`, and whether vLLM really finds a processor (decided by the config file's presence).
Checked against 5.19 only (vLLM 0.32 allows 5.16.1 to 5.19; the model-type table is 5.19's).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

from epp.kvindex.tokenizer_classes import (
    HfClass,
    fix_mistral_regex,
    fixes_mistral_regex,
    hf_class,
    token_text,
)

SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # read_config's key for that file's content
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class TokenizerError(ValueError):
    """A tokenizer directory or template is unusable, or a prompt cannot be tokenized as the engine would."""


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e.strerror or e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON: {e}") from e


def _read_object(path: Path) -> dict[str, Any]:
    value = read_json(path) if path.is_file() else {}
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return value


def read_config(root: Path) -> dict[str, Any]:
    """tokenizer_config.json; with special_tokens_map.json's content under `SPECIAL_TOKENS_MAP` when the
    config has no `added_tokens_decoder` (transformers 5 reads it then: `_special_tokens`)."""
    config = _read_object(root / "tokenizer_config.json")
    map_file = root / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and map_file.is_file():
        config[SPECIAL_TOKENS_MAP] = _read_object(map_file)
    return config


def read_model_config(root: Path) -> dict[str, Any] | None:
    """config.json's `model_type`, `tokenizer_class` and `transformers_version` (vLLM passes the model's
    config to AutoTokenizer); None without a config.json."""
    if not (root / "config.json").is_file():
        return None
    config = _read_object(root / "config.json")
    keys = ("model_type", "tokenizer_class", "transformers_version")
    return {k: config[k] for k in keys if isinstance(config.get(k), str)}


_MISTRAL_PATTERNS = ("tekken.json", "tokenizer.model.v*")


def mistral_files(root: Path) -> list[str]:
    """The files under `root` that make vLLM's `--tokenizer-mode auto` pick Mistral's tokenizer
    (`resolve_tokenizer_args`, vllm/tokenizers/registry.py: file names anywhere in the repo matching
    `tekken.json` or `tokenizer.model.v*`, by fnmatch on the base name, as `list_filtered_repo_files`).

    vLLM also requires `consolidated*.safetensors` weights (`is_mistral_model_repo`); a tokenizer
    directory seldom holds weights, so that part is not checked: the safe side is to key nothing (a repo
    without those weights runs Transformers' tokenizer in vLLM: the config says so, `tokenizerMode: hf`)."""
    found = (p for p in root.rglob("*") if any(fnmatch.fnmatch(p.name, m) for m in _MISTRAL_PATTERNS))
    return sorted(str(p.relative_to(root)) for p in found if p.is_file())


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read: {e}") from e


def template_sources(root: Path, config: Mapping[str, Any]) -> tuple[dict[str, str], str]:
    """The tokenizer's chat templates by name, and where they came from."""
    jinja_file, extra_dir = root / "chat_template.jinja", root / "additional_chat_templates"
    files = [jinja_file] if jinja_file.is_file() else []
    files += sorted(extra_dir.glob("*.jinja")) if extra_dir.is_dir() else []
    if files:
        named = {("default" if f == jinja_file else f.name.removesuffix(".jinja")): f for f in files}
        return {name: _read_text(f) for name, f in named.items()}, ", ".join(str(f) for f in files)
    where, value = root / "tokenizer_config.json", config.get("chat_template")
    if value is None:
        return {}, ""
    if isinstance(value, str):
        return {"default": value}, str(where)
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        for t in value
    ):
        return {t["name"]: t["template"] for t in value}, str(where)
    raise TokenizerError(f"{where}: chat_template must be a string or a list of {{name, template}}")


_JINJA_CHARS = "{}\n"  # vLLM's JINJA_CHARS: a value with none of them is a path


def server_template(value: str) -> tuple[str, str]:
    """A server's `--chat-template` value -> (the template, where it came from), as vLLM 0.32's
    `load_chat_template` resolves it (`vllm/renderers/chat_utils/chat_template.py`): the file of that path
    (relative to the working directory) when it can be read, else the value itself when it has a Jinja
    character (`{`, `}` or a newline), used as it is. Else TokenizerError: vLLM refuses to start
    (`validate_chat_template`). Not reproduced: the names of vLLM's built-in templates
    (`vllm/transformers_utils/chat_templates/`), which vLLM tries next: give such a template's file."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read(), value
    except OSError as e:
        if any(c in value for c in _JINJA_CHARS):
            return value, "the config"
        raise TokenizerError(
            f"{value!r} looks like a file path, but cannot be read ({e.strerror or e}); vLLM refuses it too"
        ) from e
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{value}: not UTF-8 text: {e}") from e


def processor_template(root: Path) -> tuple[str | None, str]:
    """A multimodal processor's chat template: `chat_template.json` beside a processor config (the processor
    refuses it beside `additional_chat_templates/`). vLLM prefers it to the tokenizer's for chats without
    tools."""
    json_file, extra_dir = root / "chat_template.json", root / "additional_chat_templates"
    processor = any((root / n).is_file() for n in ("processor_config.json", "preprocessor_config.json"))
    if not processor or not json_file.is_file() or (extra_dir.is_dir() and any(extra_dir.glob("*.jinja"))):
        return None, ""
    value = _read_object(json_file).get("chat_template")
    return (value, str(json_file)) if isinstance(value, str) else (None, "")


def configure(
    tok: Tokenizer,
    config: Mapping[str, Any],
    model_config: Mapping[str, Any] | None = None,
    spec: Mapping[str, Any] | None = None,
) -> tuple[Tokenizer, dict[str, str], bool]:
    """The tokenizer transformers 5 builds from tokenizer.json (`tok`, loaded as it is; `spec`, parsed) and
    these configs (`read_config`'s, `read_model_config`'s): (the tokenizer, its named special tokens (the
    template's variables), whether it differs from tokenizer.json). `tok` may be changed or replaced."""
    cls = hf_class(config, model_config)
    if spec is None:
        spec = json.loads(tok.to_str())
    out = tok
    if cls.build is not None:
        vocab, merges = _vocab_and_merges(spec)
        out = cls.build(vocab, merges, config)
        if tok.post_processor is not None:
            out.post_processor = tok.post_processor
    if config.get("split_special_tokens"):
        out.encode_special_tokens = True
    named, extra = _special_tokens(config, cls)
    added = _add_tokens(out, config, named, extra, spec, rebuilt=cls.build is not None)
    if cls.readds_special:
        texts = dict.fromkeys(t for v in (*named.values(), *extra) if (t := token_text(v)))
        out.add_tokens([AddedToken(t, special=True) for t in texts])
    special = {k: t for k, v in named.items() if (t := token_text(v))}
    fix = fixes_mistral_regex(out, config, model_config)
    if fix:
        fix_mistral_regex(out)
    if cls.post_processor != "file" or out.post_processor is None:
        _update_post_processor(out, special, add_bos=cls.post_processor == "bos")
    return out, special, cls.build is not None or added or fix or cls.post_processor != "file"


def _vocab_and_merges(spec: Mapping[str, Any]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """`TokenizersBackend.convert_to_native_format` for a BPE class: tokenizer.json's vocabulary, merges."""
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, list):
        vocab = {(t[0] if isinstance(t, list) else t): i for i, t in enumerate(vocab)}
    if not isinstance(vocab, dict):
        raise TokenizerError("tokenizer.json has no vocabulary to rebuild the tokenizer from")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    if any(len(m) != 2 for m in merges):
        raise TokenizerError("tokenizer.json has a merge that is not a pair")
    return vocab, [(a, b) for a, b in merges]


def _listed(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


def _special_tokens(config: Mapping[str, Any], cls: HfClass) -> tuple[dict[str, Any], list[Any]]:
    """`_from_pretrained` and `PreTrainedTokenizerBase.__init__`: the named special tokens (the standard ones,
    the config's else the class's, then the model-specific ones) and the extra special tokens."""
    init = {k: v for k, v in config.items() if k != SPECIAL_TOKENS_MAP}
    if "additional_special_tokens" in init and not init.get("extra_special_tokens"):
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    specific = {k: init.pop(k) for k in list(init) if _model_specific(k, init[k], typed=False)}
    if isinstance(init.get("extra_special_tokens"), Mapping):
        specific.update(init.pop("extra_special_tokens"))
    for key, value in (config.get(SPECIAL_TOKENS_MAP) or {}).items():  # the legacy path: its tokens win
        if isinstance(value, Mapping) and key != "extra_special_tokens":
            value = {**value, "special": True, "__type": "AddedToken"}
        elif key == "extra_special_tokens" and isinstance(value, list):
            known = _listed(init.get("extra_special_tokens"))
            value = known + [t for t in value if t not in known]
        init[key] = value
    if isinstance(init.get("extra_special_tokens"), Mapping):
        specific.update(init.pop("extra_special_tokens"))
    params = {k: init.get(k, v) for k, v in cls.named.items()}  # CodeLlama's: the config's null drops one
    if params and "extra_special_tokens" not in init:  # CodeLlama lists them as its additional tokens
        listed = _listed(init.pop("additional_special_tokens", None))
        init["extra_special_tokens"] = listed + [v for v in params.values() if v is not None]
    if "additional_special_tokens" in init and "extra_special_tokens" not in init:
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    named: dict[str, Any] = {k: init[k] if k in init else cls.defaults.get(k) for k in SPECIAL_KEYS}
    named.update(params)
    named.update((k, v) for k, v in init.items() if _model_specific(k, v, typed=True))
    named.update((str(k), v) for k, v in specific.items())
    return {k: v for k, v in named.items() if v is not None}, _listed(init.get("extra_special_tokens"))


def _model_specific(key: str, value: Any, *, typed: bool) -> bool:
    """A `*_token` key beside the standard ones whose value is a token: a string, or (`typed`) an AddedToken
    (a `{"__type": "AddedToken", "content": ...}` object)."""
    if not key.endswith("_token") or key in SPECIAL_KEYS:
        return False
    if isinstance(value, str):
        return True
    return typed and isinstance(value, Mapping) and "__type" in value and token_text(value) is not None


def _added_token(value: Any, *, named: bool) -> AddedToken | None:
    """transformers' AddedToken for a config value (a named special token is made special)."""
    content = token_text(value)
    if content is None:
        return None
    if isinstance(value, str):
        return AddedToken(content, special=True)
    token = AddedToken(content, **{k: bool(value[k]) for k in _TOKEN_FLAGS if k in value})
    if named and not token.special:
        token.special = True
    return token


def _add_tokens(
    tok: Tokenizer,
    config: Mapping[str, Any],
    named: Mapping[str, Any],
    extra: list[Any],
    spec: Mapping[str, Any],
    *,
    rebuilt: bool,
) -> bool:
    """`TokenizersBackend.__init__`: the config's `added_tokens_decoder` (else tokenizer.json's added tokens,
    already there unless the tokenizer was rebuilt) added again in id order, its flags winning; then the
    named and extra special tokens the tokenizer does not have yet. Whether anything was added."""
    decoder = config.get("added_tokens_decoder")
    if not isinstance(decoder, Mapping):
        decoder = {str(t.get("id")): t for t in spec.get("added_tokens") or []} if rebuilt else {}
    entries = sorted((int(i), v) for i, v in decoder.items() if str(i).isdigit())
    tokens = [t for _, v in entries if (t := _added_token(v, named=False)) is not None]
    present = {t.content for t in tok.get_added_tokens_decoder().values()} | {t.content for t in tokens}
    wanted = [*((v, True) for v in named.values()), *((v, False) for v in extra)]
    for value, is_named in wanted:
        token = _added_token(value, named=is_named)
        if token is not None and token.content not in present:
            present.add(token.content)
            tokens.append(token)
    if tokens:
        tok.add_tokens(tokens)
    return bool(tokens)


def _update_post_processor(tok: Tokenizer, special: Mapping[str, str], *, add_bos: bool) -> None:
    """`TokenizersBackend.update_post_processor`: `[bos] $A` (CodeLlama) or `$A` (nothing added)."""
    bos = special.get("bos_token") if add_bos else None
    bos_id = None if bos is None else tok.token_to_id(bos)
    if bos is None or bos_id is None:
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
        return
    try:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    except Exception as e:  # the Rust side raises plain Exception (a token with a space, ...)
        raise TokenizerError(f"cannot build the post-processor for the bos token {bos!r}: {e}") from e
