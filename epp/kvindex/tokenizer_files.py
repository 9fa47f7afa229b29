"""A Hugging Face tokenizer directory -> the tokenizer transformers 4.57 builds from it. Pure apart from
reading the files (at load time).

vLLM loads its tokenizer with `AutoTokenizer.from_pretrained` and pins transformers >= 4.56, < 5, so these are
transformers 4.57's rules (`PreTrainedTokenizerBase._from_pretrained`, `PreTrainedTokenizerFast.__init__`, the
classes' `__init__` and `update_post_processor`), not 5's, where they differ:

- `tokenizer.json` is the backend (only fast tokenizers are supported).
- `tokenizer_config.json` names the special tokens (`bos_token`, ..., `additional_special_tokens`,
  `extra_special_tokens`) and holds `split_special_tokens`, `add_bos_token` / `add_eos_token`,
  `add_prefix_space` and the chat template (`chat_template.jinja` or `chat_template.json` beside it win).
- `special_tokens_map.json` is read only when the config has no `added_tokens_decoder` (4.57's legacy path;
  configs saved by transformers >= 4.34 have one), and then its tokens win over the config's.
- The config's `tokenizer_class` (the fast one: `LlamaTokenizer` loads as `LlamaTokenizerFast`) brings the
  class's default special tokens for those the files do not name (`LlamaTokenizerFast`: `<s>`, `</s>`,
  `<unk>`; `GPT2TokenizerFast`: `<|endoftext|>`; ...). Named special tokens missing from the vocabulary are
  added to it as special tokens.
- The classes that rebuild their post-processor (`LlamaTokenizerFast`, `CodeLlamaTokenizerFast`,
  `GemmaTokenizerFast`, `CohereTokenizerFast`, `GPTNeoXTokenizerFast`) replace tokenizer.json's with
  `[bos] $A [eos]` per `add_bos_token` / `add_eos_token` (the config's, else the class's default): that,
  not tokenizer.json, decides what `add_special_tokens=True` adds.
- A top-level `ByteLevel` pre-tokenizer gets the config's `add_prefix_space` (False when unset) whatever
  tokenizer.json says, except for `LlamaTokenizerFast` (whose default, None, leaves it as it is); a
  `Sequence` of pre-tokenizers is left as it is.
- Unknown classes, a missing `tokenizer_class` and `PreTrainedTokenizerFast` follow the base class: no
  default tokens, tokenizer.json's post-processor. Not reproduced: a `LlamaTokenizerFast` config with an
  `add_prefix_space` (transformers converts the slow sentencepiece tokenizer instead), `CohereTokenizerFast`'s
  `add_prefix_space: true` inside a `Sequence`, and the tokens of `added_tokens_decoder` missing from
  tokenizer.json.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, pre_tokenizers, processors

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A tokenizer directory or template is unusable, or a prompt cannot be tokenized as the engine would."""


@dataclass(frozen=True)
class _HfClass:
    """What a transformers 4.57 fast tokenizer class adds to the files."""

    defaults: Mapping[str, str] = field(default_factory=dict)  # special tokens the files may leave unnamed
    post_processor: tuple[bool, bool] | None = None  # `update_post_processor`: default add_bos, add_eos
    keeps_prefix_space: bool = False  # `add_prefix_space=None` by default: the pre-tokenizer is kept


_LLAMA = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
_ENDOFTEXT = "<|endoftext|>"
_CLASSES = {
    "LlamaTokenizerFast": _HfClass(_LLAMA, (True, False), keeps_prefix_space=True),
    "CodeLlamaTokenizerFast": _HfClass(_LLAMA, (True, False)),
    "GemmaTokenizerFast": _HfClass(
        {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"},
        (True, False),
    ),
    "CohereTokenizerFast": _HfClass(
        {"bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>", "unk_token": "<UNK>"},
        (True, False),
    ),
    "GPTNeoXTokenizerFast": _HfClass(
        dict.fromkeys(("bos_token", "eos_token", "unk_token"), _ENDOFTEXT), (False, False)
    ),
    "GPT2TokenizerFast": _HfClass(dict.fromkeys(("bos_token", "eos_token", "unk_token"), _ENDOFTEXT)),
    "Qwen2TokenizerFast": _HfClass(dict.fromkeys(("eos_token", "unk_token", "pad_token"), _ENDOFTEXT)),
}
_BASE = _HfClass()


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e.strerror or e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON: {e}") from e


def token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def read_config(root: Path) -> dict[str, Any]:
    """tokenizer_config.json, with special_tokens_map.json's tokens over it on 4.57's legacy path."""
    config_file = root / "tokenizer_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    if not isinstance(config, dict):
        raise TokenizerError(f"{config_file}: expected a JSON object")
    map_file = root / "special_tokens_map.json"
    if "added_tokens_decoder" in config or not map_file.is_file():
        return config
    special = read_json(map_file)
    if not isinstance(special, dict):
        raise TokenizerError(f"{map_file}: expected a JSON object")
    config = dict(config)
    for key, value in special.items():
        if key == "additional_special_tokens" and isinstance(value, list):
            known = list(config.get("additional_special_tokens") or [])
            value = known + [t for t in value if t not in known]
        config[key] = value
    return config


def template_sources(root: Path, config: Mapping[str, Any]) -> tuple[dict[str, str], str]:
    """The chat templates by name, and the file they came from."""
    jinja_file, json_file = root / "chat_template.jinja", root / "chat_template.json"
    if jinja_file.is_file():
        try:
            return {"default": jinja_file.read_text(encoding="utf-8")}, str(jinja_file)
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{jinja_file}: cannot read: {e}") from e
    where, value = root / "tokenizer_config.json", config.get("chat_template")
    if json_file.is_file():
        where, value = json_file, read_json(json_file)
        value = value.get("chat_template") if isinstance(value, dict) else None
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


def hf_class(config: Mapping[str, Any]) -> _HfClass:
    name = config.get("tokenizer_class")
    if not isinstance(name, str):
        return _BASE
    return _CLASSES.get(name.removesuffix("Fast") + "Fast", _BASE)


def configure(tok: Tokenizer, config: Mapping[str, Any]) -> tuple[dict[str, str], bool]:
    """Set `tok` up as transformers 4.57 does from this config: (the named special tokens, whether the
    tokenizer now differs from its tokenizer.json)."""
    cls = hf_class(config)
    if config.get("split_special_tokens"):
        tok.encode_special_tokens = True
    named = {k: config[k] if k in config else cls.defaults.get(k) for k in SPECIAL_KEYS}
    special, changed = _add_named_special_tokens(tok, named, config)
    changed = _reset_prefix_space(tok, config, cls) or changed
    if cls.post_processor is not None:
        _update_post_processor(tok, config, cls.post_processor, special)
        changed = True
    return special, changed


def _add_named_special_tokens(
    tok: Tokenizer, named: Mapping[str, Any], config: Mapping[str, Any]
) -> tuple[dict[str, str], bool]:
    """The named special tokens; those the vocabulary lacks are added (as transformers does)."""
    values: list[Any] = list(named.values())
    special = {k: t for k, v in named.items() if (t := token_text(v))}
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    if isinstance(extra, Mapping):  # model-specific named tokens (image_token, ...)
        special.update((str(k), t) for k, v in extra.items() if (t := token_text(v)))
        values += list(extra.values())
    elif isinstance(extra, list):
        values += extra
    present = {t.content for t in tok.get_added_tokens_decoder().values()}
    missing: dict[str, AddedToken] = {}
    for value in values:
        content = token_text(value)
        if content and content not in present and content not in missing:
            flags = value if isinstance(value, Mapping) else {}
            missing[content] = AddedToken(
                content,
                single_word=bool(flags.get("single_word", False)),
                lstrip=bool(flags.get("lstrip", False)),
                rstrip=bool(flags.get("rstrip", False)),
                normalized=bool(flags.get("normalized", False)),
                special=True,
            )
    if missing:
        tok.add_special_tokens(list(missing.values()))
    return special, bool(missing)


def _reset_prefix_space(tok: Tokenizer, config: Mapping[str, Any], cls: _HfClass) -> bool:
    """`PreTrainedTokenizerFast.__init__`: a top-level pre-tokenizer whose state has an `add_prefix_space`
    that differs from the tokenizer's (the config's, else False) is rebuilt with it."""
    wanted = config.get("add_prefix_space", False)
    if cls.keeps_prefix_space or not isinstance(wanted, bool) or tok.pre_tokenizer is None:
        return False  # None (or a non-boolean) cannot rebuild it: transformers leaves it as it is
    state = json.loads(tok.pre_tokenizer.__getstate__())
    if state.get("type") != "ByteLevel" or state.get("add_prefix_space", wanted) == wanted:
        return False
    state.pop("type")
    state["add_prefix_space"] = wanted
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(**state)
    return True


def _update_post_processor(
    tok: Tokenizer, config: Mapping[str, Any], defaults: tuple[bool, bool], special: Mapping[str, str]
) -> None:
    """`update_post_processor` (Llama, CodeLlama, Gemma, Cohere, GPTNeoX): `[bos] $A [eos]`."""
    add_bos = bool(config.get("add_bos_token", defaults[0]))
    add_eos = bool(config.get("add_eos_token", defaults[1]))
    ends: list[tuple[str, int]] = []
    for add, key in ((add_bos, "bos_token"), (add_eos, "eos_token")):
        token = special.get(key)
        token_id = None if token is None else tok.token_to_id(token)
        if not add:
            continue
        if token is None or token_id is None:
            raise TokenizerError(f"add_{key} is true but the {key} is not set or not in the vocabulary")
        ends.append((token, token_id))
    bos = f"{special['bos_token']}:0 " if add_bos else ""
    eos = f" {special['eos_token']}:0" if add_eos else ""
    bos1 = f" {special['bos_token']}:1" if add_bos else ""
    eos1 = f" {special['eos_token']}:1" if add_eos else ""
    single = f"{bos}$A:0{eos}"
    try:
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single}{bos1} $B:1{eos1}", special_tokens=ends
        )
    except Exception as e:  # the Rust side raises plain Exception (a token with a space, ...)
        raise TokenizerError(f"cannot build the post-processor {single!r}: {e}") from e
