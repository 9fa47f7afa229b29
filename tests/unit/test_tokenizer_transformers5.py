"""Tokenizer directories read as vLLM 0.32's transformers (5.19) reads them (`kvindex/tokenizer_files.py`):
the class transformers picks (tokenizer_config.json, config.json's model type), the classes that rebuild
the tokenizer in code, the post-processor (add_bos_token / add_eos_token ignored), special and added tokens,
chat template files, `fix_mistral_regex`, prompts the rebuilt tokenizer cannot encode.

The expected ids are what transformers 5.19 computes on these very files, loaded as vLLM 0.32's tokenizer
loader loads them (`AutoTokenizer.from_pretrained(dir, config=AutoConfig.from_pretrained(dir) when there is
a config.json, trust_remote_code=False, revision=None, truncation_side="left", mistral_format=False)`, or
`TokenizersBackend.from_pretrained(dir, ...)` for the model types vLLM loads so), then
`tok(text, add_special_tokens=...)["input_ids"]` and, for the chat,
`tok(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False), add_special_tokens=False)`,
written down as literals (a scratch script building each variant with `_variant` below, in a virtualenv with
transformers 5.19.0 and tokenizers 0.23.3).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from epp.kvindex.prompt import PromptTokenizer, TokenizerError
from epp.testing.tokenizer import (
    LLAMA3_PATTERN,
    build_tiny_spm_tokenizer,
    build_tiny_tokenizer,
    generated_text,
)

TEXT = " Hello  world"
SPECIAL_TEXT = {
    "byte": "<|begin_of_text|>Hi<|eot_id|> there 12345 e\u0301 <|img|><|zz|>",
    "spm": "Hi <s>[INST] Hi [/INST] ok</s>  x <mask>▁<MID>",
}
CHAT = [{"role": "user", "content": "Hi there"}]
TOOLS = [
    {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
]
EOT = {"content": "<|eot_id|>", "lstrip": True, "rstrip": True, "normalized": False}
EOT |= {"single_word": False, "special": True}
PREPROCESSOR: dict[str, Any] = {
    "processor_class": "LlavaProcessor",
    "image_processor_type": "CLIPImageProcessor",
}
PREPROCESSOR |= {"crop_size": {"height": 336, "width": 336}, "size": {"shortest_edge": 336}}
LLAVA = {"model_type": "llava", "text_config": {"model_type": "llama"}}
LLAVA |= {"vision_config": {"model_type": "clip_vision_model"}}

# name -> base ("byte": build_tiny_tokenizer, Llama 3 shaped; "spm": build_tiny_spm_tokenizer, Llama 2
# shaped), config (over the base's tokenizer_config.json; None drops a key), files (written beside), model
# (config.json), pre_tokenizer / post_processor (replace tokenizer.json's; None removes it)
VARIANTS: dict[str, dict[str, Any]] = {
    # LlamaTokenizer rebuilds the tokenizer: Metaspace, prepend_scheme "first" (legacy unset) ...
    "spm": {"base": "spm"},
    # ... "always" with legacy: true, "never" with add_prefix_space: false
    "spm_legacy": {"base": "spm", "config": {"legacy": True}},
    "spm_no_prefix_space": {"base": "spm", "config": {"add_prefix_space": False}},
    # add_bos_token / add_eos_token are ignored: tokenizer.json's post-processor decides
    "spm_add_eos": {"base": "spm", "config": {"add_eos_token": True}},
    "spm_no_bos": {"base": "spm", "config": {"add_bos_token": False}},
    "spm_no_post_processor": {"base": "spm", "post_processor": None},
    # config.json's model type registered to the generic backend: tokenizer.json as it is
    "spm_mistral": {"base": "spm", "model": {"model_type": "mistral"}},
    # CodeLlama always adds its bos token, and its infilling tokens are special tokens
    "spm_code_llama": {
        "base": "spm",
        "config": {"tokenizer_class": "CodeLlamaTokenizer"},
        "post_processor": None,
    },
    # Gemma: add_eos_token ignored, its default pad and mask tokens added
    "spm_gemma": {"base": "spm", "config": {"tokenizer_class": "GemmaTokenizer", "add_eos_token": True}},
    # a byte-level tokenizer.json labelled LlamaTokenizerFast (DeepSeek-R1-Distill-Llama) is rebuilt too ...
    "byte_llama_class": {"base": "byte", "config": {"tokenizer_class": "LlamaTokenizerFast"}},
    # ... unless config.json's model type is registered to the generic backend
    "byte_deepseek_v3": {
        "base": "byte",
        "config": {"tokenizer_class": "LlamaTokenizerFast"},
        "model": {"model_type": "deepseek_v3"},
    },
    # ... or one vLLM loads with the generic backend itself (TokenizersBackend.from_pretrained)
    "byte_vllm_generic": {
        "base": "byte",
        "config": {"tokenizer_class": "LlamaTokenizerFast"},
        "model": {"model_type": "step3p7"},
    },
    # the generic class keeps tokenizer.json's add_prefix_space (4.57 reset it to the config's, False)
    "byte_prefix_space": {
        "base": "byte",
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
    },
    # GPT-NeoX: NFC, the GPT-2 pre-tokenizer, nothing added by add_special_tokens, <|padding|> by default
    "byte_neox": {"base": "byte", "config": {"tokenizer_class": "GPTNeoXTokenizer"}},
    # GPT-2: its pre-tokenizer replaces tokenizer.json's
    "byte_gpt2": {"base": "byte", "config": {"tokenizer_class": "GPT2Tokenizer"}},
    # Qwen2 (the registered class of the mislabelled qwen2 type): one digit per token, NFC ...
    "byte_qwen2": {
        "base": "byte",
        "config": {"tokenizer_class": "PreTrainedTokenizerFast"},
        "model": {"model_type": "qwen2"},
    },
    # ... and its add_prefix_space, inside the Sequence
    "byte_qwen2_prefix_space": {
        "base": "byte",
        "config": {"tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": True},
    },
    # Cohere keeps tokenizer.json's post-processor (4.57 rebuilt it to add the bos token)
    "byte_cohere": {"base": "byte", "config": {"tokenizer_class": "CohereTokenizer"}},
    # a model-specific `*_token` key is a special token (added) and a template variable
    "byte_model_token": {"base": "byte", "config": {"image_token": "<|img|>"}},
    # the config's added_tokens_decoder: tokens missing from tokenizer.json are added, its flags win
    "byte_added_tokens": {"base": "byte", "config": {"added_tokens_decoder": "+<|zz|>"}},
    "byte_added_token_flags": {"base": "byte", "config": {"added_tokens_decoder": "<|eot_id|>"}},
    # special_tokens_map.json's additional_special_tokens: used when the config's extra tokens are a dict ...
    "byte_map_additional": {
        "base": "byte",
        "config": {"extra_special_tokens": {"zz_token": "<|zz|>"}},
        "files": {"special_tokens_map.json": {"additional_special_tokens": ["<|img|>"]}},
    },
    # ... not beside the config's own list
    "byte_map_additional_ignored": {
        "base": "byte",
        "config": {"additional_special_tokens": ["<|zz|>"]},
        "files": {"special_tokens_map.json": {"additional_special_tokens": ["<|img|>"]}},
    },
    # chat templates: additional_chat_templates/ is read; chat_template.json only beside a processor config
    "byte_template_dir": {
        "base": "byte",
        "files": {
            "chat_template.jinja": "J{{ messages|length }}",
            "additional_chat_templates/tool_use.jinja": "T",
        },
    },
    "byte_template_no_default": {"base": "byte", "files": {"additional_chat_templates/tool_use.jinja": "T"}},
    "byte_template_json": {"base": "byte", "files": {"chat_template.json": {"chat_template": "P"}}},
    "byte_template_processor": {
        "base": "byte",
        "files": {"chat_template.json": {"chat_template": "P"}, "preprocessor_config.json": PREPROCESSOR},
        "model": LLAVA,
    },
}

# name -> the ids (space-separated) of TEXT with special tokens, without, SPECIAL_TEXT[base] without, and
# CHAT: transformers 5.19's
EXPECTED: dict[str, tuple[str, str, str, str]] = {
    "spm": (
        "1 334 75 307 313 392 334 334 324 356 313 306",
        "334 75 307 313 392 334 334 324 356 313 306",
        (
            "334 75 311 334 1 94 289 293 298 299 96 334 75 311 334 94 269 289 293 298 299 96 334 316 312 2 "
            "334 334 325 334 63 314 303 320 312 65 334 63 292 289 287 65"
        ),
        "1 94 289 293 298 299 96 334 75 311 365 352 334 94 269 289 293 298 299 96",
    ),
    "spm_legacy": (
        "1 334 75 307 313 392 334 334 324 356 313 306",
        "334 75 307 313 392 334 334 324 356 313 306",
        (
            "334 75 311 334 1 334 94 289 293 298 299 96 334 75 311 334 94 269 289 293 298 299 96 334 316 312 "
            "2 334 334 325 334 63 314 303 320 312 65 334 63 292 289 287 65"
        ),
        "1 334 94 289 293 298 299 96 334 75 311 365 352 334 94 269 289 293 298 299 96",
    ),
    "spm_no_prefix_space": (
        "1 334 75 307 313 392 334 334 324 356 313 306",
        "334 75 307 313 392 334 334 324 356 313 306",
        (
            "75 311 334 1 94 289 293 298 299 96 334 75 311 334 94 269 289 293 298 299 96 334 316 312 2 334 "
            "334 325 334 63 314 303 320 312 65 334 63 292 289 287 65"
        ),
        "1 94 289 293 298 299 96 334 75 311 365 352 334 94 269 289 293 298 299 96",
    ),
    "spm_add_eos": (
        "1 334 75 307 313 392 334 334 324 356 313 306",
        "334 75 307 313 392 334 334 324 356 313 306",
        (
            "334 75 311 334 1 94 289 293 298 299 96 334 75 311 334 94 269 289 293 298 299 96 334 316 312 2 "
            "334 334 325 334 63 314 303 320 312 65 334 63 292 289 287 65"
        ),
        "1 94 289 293 298 299 96 334 75 311 365 352 334 94 269 289 293 298 299 96",
    ),
    "spm_no_bos": (
        "1 334 75 307 313 392 334 334 324 356 313 306",
        "334 75 307 313 392 334 334 324 356 313 306",
        (
            "334 75 311 334 1 94 289 293 298 299 96 334 75 311 334 94 269 289 293 298 299 96 334 316 312 2 "
            "334 334 325 334 63 314 303 320 312 65 334 63 292 289 287 65"
        ),
        "1 94 289 293 298 299 96 334 75 311 365 352 334 94 269 289 293 298 299 96",
    ),
    "spm_no_post_processor": (
        "334 75 307 313 392 334 334 324 356 313 306",
        "334 75 307 313 392 334 334 324 356 313 306",
        (
            "334 75 311 334 1 94 289 293 298 299 96 334 75 311 334 94 269 289 293 298 299 96 334 316 312 2 "
            "334 334 325 334 63 314 303 320 312 65 334 63 292 289 287 65"
        ),
        "1 94 289 293 298 299 96 334 75 311 365 352 334 94 269 289 293 298 299 96",
    ),
    "spm_mistral": (
        "1 334 334 75 307 313 392 334 334 324 356 313 306",
        "334 334 75 307 313 392 334 334 324 356 313 306",
        (
            "334 75 311 334 1 334 94 289 293 298 299 96 334 75 311 334 94 269 289 293 298 299 96 334 316 312 "
            "2 334 334 334 325 334 63 314 303 320 312 65 334 63 292 289 287 65"
        ),
        "1 334 94 289 293 298 299 96 334 75 311 365 352 334 94 269 289 293 298 299 96",
    ),
    "spm_code_llama": (
        "1 334 75 307 313 392 334 334 324 356 313 306",
        "334 75 307 313 392 334 334 324 356 313 306",
        (
            "334 75 311 334 1 94 289 293 298 299 96 334 75 311 334 94 269 289 293 298 299 96 334 316 312 2 "
            "334 334 325 334 63 314 303 320 312 65 701"
        ),
        "1 94 289 293 298 299 96 334 75 311 365 352 334 94 269 289 293 298 299 96",
    ),
    "spm_gemma": (
        "1 334 75 307 313 392 334 334 324 356 313 306",
        "334 75 307 313 392 334 334 324 356 313 306",
        (
            "75 311 334 1 94 289 293 298 299 96 334 75 311 334 94 269 289 293 298 299 96 334 316 312 2 334 "
            "334 325 334 701 334 63 292 289 287 65"
        ),
        "1 94 289 293 298 299 96 334 75 311 365 352 334 94 269 289 293 298 299 96",
    ),
    "byte_llama_class": (
        "0 44 73 80 310 91 274 80 72",
        "44 73 80 310 91 274 80 72",
        "0 44 77 4 357 268 21 22 473 25 73 32 96 77 81 75 96 34 32 96 94 94 96 34",
        "0 2 445 300 3 44 276 73 268 4 2 363 87 77 297 313 88 3",
    ),
    "byte_deepseek_v3": (
        "0 225 44 73 80 310 225 225 91 274 80 72",
        "225 44 73 80 310 225 225 91 274 80 72",
        "0 44 77 4 285 268 225 21 22 23 492 225 73 141 228 225 32 96 77 81 75 96 34 32 96 94 94 96 34",
        "0 2 445 300 3 203 203 44 77 285 268 4 2 363 87 77 297 313 88 3 203 203",
    ),
    "byte_vllm_generic": (
        "0 225 44 73 80 310 225 225 91 274 80 72",
        "225 44 73 80 310 225 225 91 274 80 72",
        "0 44 77 4 285 268 225 21 22 23 492 225 73 141 228 225 32 96 77 81 75 96 34 32 96 94 94 96 34",
        "0 2 445 300 3 203 203 44 77 285 268 4 2 363 87 77 297 313 88 3 203 203",
    ),
    "byte_prefix_space": (
        "0 225 44 73 80 310 225 225 91 274 80 72",
        "225 44 73 80 310 225 225 91 274 80 72",
        "0 225 44 77 4 285 268 225 21 22 473 25 225 73 141 228 225 32 96 77 81 75 96 34 32 96 94 94 96 34",
        "0 2 225 445 300 3 225 203 203 44 77 285 268 4 2 293 87 77 297 313 88 3 225 203 203",
    ),
    "byte_neox": (
        "225 44 73 80 310 225 225 91 274 80 72",
        "225 44 73 80 310 225 225 91 274 80 72",
        "0 44 77 4 285 268 225 21 22 473 25 395 225 32 96 77 81 75 96 34 32 96 94 94 96 34",
        "0 2 445 300 3 203 203 44 77 285 268 4 2 363 87 77 297 313 88 3 203 203",
    ),
    "byte_gpt2": (
        "0 225 44 73 80 310 225 225 91 274 80 72",
        "225 44 73 80 310 225 225 91 274 80 72",
        "0 44 77 4 285 268 225 21 22 473 25 225 73 141 228 225 32 96 77 81 75 96 34 32 96 94 94 96 34",
        "0 2 445 300 3 203 203 44 77 285 268 4 2 363 87 77 297 313 88 3 203 203",
    ),
    "byte_qwen2": (
        "0 225 44 73 80 310 225 225 91 274 80 72",
        "225 44 73 80 310 225 225 91 274 80 72",
        "0 44 77 4 285 268 225 21 22 23 24 25 395 225 32 96 77 81 75 96 34 32 96 94 94 96 34",
        "0 2 445 300 3 203 203 44 77 285 268 4 2 363 87 77 297 313 88 3 203 203",
    ),
    "byte_qwen2_prefix_space": (
        "0 225 44 73 80 310 225 225 91 274 80 72",
        "225 44 73 80 310 225 225 91 274 80 72",
        (
            "0 225 44 77 4 285 268 225 225 21 225 22 225 23 225 24 225 25 395 225 32 96 263 81 75 225 96 34 "
            "32 96 225 94 94 225 96 34"
        ),
        "0 2 225 445 300 3 225 203 203 225 44 77 285 268 4 2 293 87 77 297 313 88 3 225 203 203",
    ),
    "byte_cohere": (
        "0 225 44 73 80 310 225 225 91 274 80 72",
        "225 44 73 80 310 225 225 91 274 80 72",
        "0 44 77 4 285 268 225 21 22 23 24 25 395 225 32 96 77 81 75 96 34 32 96 94 94 96 34",
        "0 2 445 300 3 203 203 44 77 285 268 4 2 363 87 77 297 313 88 3 203 203",
    ),
    "byte_model_token": (
        "0 225 44 73 80 310 225 225 91 274 80 72",
        "225 44 73 80 310 225 225 91 274 80 72",
        "0 44 77 4 285 268 225 21 22 23 492 225 73 141 228 225 512 32 96 94 94 96 34",
        "0 2 445 300 3 203 203 44 77 285 268 4 2 363 87 77 297 313 88 3 203 203",
    ),
    "byte_added_tokens": (
        "0 225 44 73 80 310 225 225 91 274 80 72",
        "225 44 73 80 310 225 225 91 274 80 72",
        "0 44 77 4 285 268 225 21 22 23 492 225 73 141 228 225 32 96 77 81 75 96 34 512",
        "0 2 445 300 3 203 203 44 77 285 268 4 2 363 87 77 297 313 88 3 203 203",
    ),
    "byte_added_token_flags": (
        "0 225 44 73 80 310 225 225 91 274 80 72",
        "225 44 73 80 310 225 225 91 274 80 72",
        "0 44 77 4 357 268 225 21 22 23 492 225 73 141 228 225 32 96 77 81 75 96 34 32 96 94 94 96 34",
        "0 2 445 300 3 203 203 44 77 285 268 4 2 363 87 77 297 313 88 3 203 203",
    ),
    "byte_map_additional": (
        "0 225 44 73 80 310 225 225 91 274 80 72",
        "225 44 73 80 310 225 225 91 274 80 72",
        "0 44 77 4 285 268 225 21 22 23 492 225 73 141 228 225 513 512",
        "0 2 445 300 3 203 203 44 77 285 268 4 2 363 87 77 297 313 88 3 203 203",
    ),
    "byte_map_additional_ignored": (
        "0 225 44 73 80 310 225 225 91 274 80 72",
        "225 44 73 80 310 225 225 91 274 80 72",
        "0 44 77 4 285 268 225 21 22 23 492 225 73 141 228 225 32 96 77 81 75 96 34 512",
        "0 2 445 300 3 203 203 44 77 285 268 4 2 363 87 77 297 313 88 3 203 203",
    ),
}

# name -> the rendered CHAT without and with TOOLS (None: transformers raises; BASE: the base directory's own
# template, which transformers 5.19 rendered here too): transformers 5.19's
BASE = "the base's template"
TEMPLATES: dict[str, tuple[str | None, str | None]] = {
    "byte_template_dir": ("J1", "T"),
    "byte_template_no_default": (None, "T"),
    "byte_template_json": (BASE, BASE),
    "byte_template_processor": ("P", BASE),
}


def _variant(base: Path, dst: Path, spec: dict[str, Any]) -> Path:
    dst.mkdir(parents=True)
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    for key in ("pre_tokenizer", "post_processor"):
        if key in spec:
            tokenizer[key] = spec[key]
    (dst / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((base / "tokenizer_config.json").read_text())
    for key, value in (spec.get("config") or {}).items():
        if isinstance(value, str) and key == "added_tokens_decoder":
            value = _added_tokens_decoder(tokenizer, value)
        config[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    for name, content in (spec.get("files") or {}).items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_text(content if isinstance(content, str) else json.dumps(content))
    if "model" in spec:
        (dst / "config.json").write_text(json.dumps(spec["model"]))
    return dst


def _added_tokens_decoder(tokenizer: dict[str, Any], change: str) -> dict[str, Any]:
    """tokenizer.json's added tokens; "+<tok>": and a new one; "<tok>": that one with lstrip and rstrip."""
    decoder = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tokenizer["added_tokens"]}
    if change.startswith("+"):
        decoder["9999"] = {**decoder["0"], "content": change[1:]}
    else:
        decoder = {i: EOT if t["content"] == change else t for i, t in decoder.items()}
    return decoder


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "byte": build_tiny_tokenizer(tmp_path_factory.mktemp("byte")),
        "spm": build_tiny_spm_tokenizer(tmp_path_factory.mktemp("spm")),
    }


def _load(bases: dict[str, Path], tmp_path: Path, name: str) -> PromptTokenizer:
    spec = VARIANTS[name]
    return PromptTokenizer.from_dir(_variant(bases[spec["base"]], tmp_path / name, spec))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_ids_are_transformers_5s(bases: dict[str, Path], tmp_path: Path, name: str) -> None:
    tok = _load(bases, tmp_path, name)
    special = SPECIAL_TEXT[VARIANTS[name]["base"]]
    with_special, plain, special_ids, chat = ([int(i) for i in ids.split()] for ids in EXPECTED[name])
    for text, add, want in ((TEXT, True, with_special), (TEXT, False, plain), (special, False, special_ids)):
        assert tok.encode_prompt(text, add_special_tokens=add).tolist() == want, (text, add)
        assert tok.encode_uncached(text, add_special_tokens=add) == want, (text, add)
    assert tok.encode_chat(CHAT).tolist() == chat


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_templates_are_transformers_5s(bases: dict[str, Path], tmp_path: Path, name: str) -> None:
    tok, base = _load(bases, tmp_path, name), PromptTokenizer.from_dir(bases["byte"])
    for tools, want in zip((None, TOOLS), TEMPLATES[name], strict=True):
        if want is None:
            with pytest.raises(TokenizerError):
                tok.render_chat(CHAT, tools=tools)
        else:
            expected = base.render_chat(CHAT, tools=tools) if want is BASE else want
            assert tok.render_chat(CHAT, tools=tools) == expected


def test_a_prompt_the_rebuilt_tokenizer_cannot_encode_is_a_tokenizer_error(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    """A byte-level tokenizer.json labelled CodeLlamaTokenizer: transformers 5.19 rebuilds it with an unk
    token the vocabulary lacks, loads it, then raises "Unk token `<unk>` not found in the vocabulary" for
    "Hello world" (and gives [0, 0] for "<|begin_of_text|>"); so does vLLM's request. Here: unkeyed."""
    d = _variant(bases["byte"], tmp_path / "x", {"config": {"tokenizer_class": "CodeLlamaTokenizer"}})
    tok = PromptTokenizer.from_dir(d)
    assert tok.encode_prompt("<|begin_of_text|>").tolist() == [0, 0]
    with pytest.raises(TokenizerError, match="Unk token"):
        tok.encode_prompt("Hello world")
    assert any("cannot be encoded" in note for note in tok.chunking_notes)


@pytest.mark.parametrize("name", ["spm", "spm_legacy", "spm_gemma", "byte_qwen2_prefix_space", "byte_neox"])
def test_the_prefix_cache_gives_the_rebuilt_tokenizers_ids(
    bases: dict[str, Path], tmp_path: Path, name: str
) -> None:
    """Long prompts cut into cached chunks give the ids of the whole with the rebuilt pipelines too (Metaspace
    "first" prepends "▁" at the text's start only, Qwen2's add_prefix_space "Ġ" at every piece's)."""
    spec = VARIANTS[name]
    tok = PromptTokenizer.from_dir(_variant(bases[spec["base"]], tmp_path / name, spec), chunk_chars=64)
    special = SPECIAL_TEXT[spec["base"]]
    text = " ".join(f"{special} {i} {TEXT} {generated_text(300, seed=i)}" for i in range(12))
    for _ in range(2):  # cold, then from the cache
        for add in (False, True):
            assert tok.encode_prompt(text, add_special_tokens=add).tolist() == tok.encode_uncached(
                text, add_special_tokens=add
            )


def _mistral_sized(directory: Path, config: dict[str, Any], model: dict[str, Any]) -> Path:
    """A byte-level tokenizer with a vocabulary over 100,000 (fillers) and one merge, "o" + "W"."""
    directory.mkdir()
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {"oW": len(vocab)} | {f"<f{i}>": len(vocab) + 1 + i for i in range(100_000)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("o", "W")]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"} | config)
    )
    (directory / "config.json").write_text(json.dumps(model))
    return directory


# config.json -> the ids of "helloWORLD fooBAR" with `fix_mistral_regex` false, then true: transformers
# 5.19's (loaded as above, with the config.json)
MISTRAL_REGEX: dict[str, tuple[list[int], list[int]]] = {
    "mistral, no version": (
        [71, 68, 75, 75, 256, 46, 49, 43, 35, 220, 69, 78, 78, 33, 32, 49],
        [71, 68, 75, 75, 78, 54, 46, 49, 43, 35, 220, 69, 78, 78, 33, 32, 49],
    ),
    "mistral, saved by 4.57": (
        [71, 68, 75, 75, 256, 46, 49, 43, 35, 220, 69, 78, 78, 33, 32, 49],
        [71, 68, 75, 75, 78, 54, 46, 49, 43, 35, 220, 69, 78, 78, 33, 32, 49],
    ),
    "mistral, saved by 5.1": (
        [71, 68, 75, 75, 256, 46, 49, 43, 35, 220, 69, 78, 78, 33, 32, 49],
        [71, 68, 75, 75, 256, 46, 49, 43, 35, 220, 69, 78, 78, 33, 32, 49],
    ),
    "llama, saved by 4.57": (
        [71, 68, 75, 75, 256, 46, 49, 43, 35, 220, 69, 78, 78, 33, 32, 49],
        [71, 68, 75, 75, 256, 46, 49, 43, 35, 220, 69, 78, 78, 33, 32, 49],
    ),
}
MISTRAL_MODELS: dict[str, dict[str, Any]] = {
    "mistral, no version": {"model_type": "mistral"},
    "mistral, saved by 4.57": {"model_type": "mistral", "transformers_version": "4.57.1"},
    "mistral, saved by 5.1": {"model_type": "mistral", "transformers_version": "5.1.0"},
    "llama, saved by 4.57": {"model_type": "llama", "transformers_version": "4.57.1"},
}


@pytest.mark.parametrize("name", sorted(MISTRAL_MODELS))
def test_fix_mistral_regex_is_applied_as_transformers_5_applies_it(tmp_path: Path, name: str) -> None:
    """`fix_mistral_regex: true` in tokenizer_config.json replaces the pre-tokenizer's regex (which kept
    "helloWORLD" in one piece, so "o" + "W" merged) for the Mistral checkpoints transformers 5 suspects."""
    text = "helloWORLD fooBAR"
    for fix, want in zip((False, True), MISTRAL_REGEX[name], strict=True):
        d = _mistral_sized(tmp_path / str(fix), {"fix_mistral_regex": fix}, MISTRAL_MODELS[name])
        assert PromptTokenizer.from_dir(d).encode_prompt(text).tolist() == want, fix
