"""The tokenizer classes transformers 5 picks and rebuilds in code (for `tokenizer_files.configure`). Pure.

transformers 5.19 (vLLM 0.32's) picks a tokenizer class from tokenizer_config.json's `tokenizer_class`, else
config.json's, else the one registered for config.json's `model_type` (`class_name`: a model type registered
to the generic backend wins over a named class, and so does the registered class of the types the Hub
mislabels). The classes with their own `__init__` reproduced here (`_CLASSES`) rebuild the tokenizer from
tokenizer.json's vocabulary and merges with their own normalizer and pre-tokenizer; any other class uses
tokenizer.json as it is. `fix_mistral_regex` patches the pre-tokenizer of old Mistral checkpoints. The rules,
and what is not reproduced, are in `tokenizer_files.py`'s docstring; the tables are transformers 5.19's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers


def token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


Build = Callable[[dict[str, int], list[tuple[str, str]], Mapping[str, Any]], Tokenizer]


@dataclass(frozen=True)
class HfClass:
    """What a transformers 5 tokenizer class does beyond the files."""

    defaults: Mapping[str, str | None] = field(default_factory=dict)  # its standard special tokens
    build: Build | None = None  # rebuilds the tokenizer in code (None: tokenizer.json as it is)
    post_processor: Literal["file", "bos", "none"] = "file"  # "bos": `[bos] $A`; "none": adds nothing
    named: Mapping[str, str] = field(default_factory=dict)  # model-specific special tokens it adds
    readds_special: bool = False  # Qwen2: every special token is added again (special, default flags)


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], **options: Any) -> Tokenizer:
    return Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, **options))


def _aps(config: Mapping[str, Any], default: bool) -> bool:
    value = config.get("add_prefix_space")
    return default if value is None else bool(value)


def _llama(vocab: dict[str, int], merges: list[tuple[str, str]], config: Mapping[str, Any]) -> Tokenizer:
    tok = _bpe(vocab, merges, fuse_unk=True, byte_fallback=True)
    scheme = ("always" if config.get("legacy", False) else "first") if _aps(config, True) else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    return tok


def _code_llama(vocab: dict[str, int], merges: list[tuple[str, str]], config: Mapping[str, Any]) -> Tokenizer:
    unk = token_text(config.get("unk_token", "<unk>"))
    tok = _bpe(vocab, merges, fuse_unk=True, byte_fallback=True, unk_token=str(unk))
    scheme = "first" if _aps(config, True) else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    return tok


def _gemma(vocab: dict[str, int], merges: list[tuple[str, str]], config: Mapping[str, Any]) -> Tokenizer:
    unk = token_text(config.get("unk_token", "<unk>"))
    tok = _bpe(vocab, merges, fuse_unk=True, byte_fallback=True, unk_token=str(unk))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.normalizer = normalizers.Replace(" ", "▁")
    return tok


def _byte_bpe(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    return _bpe(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)


def _qwen(pattern: str) -> Build:
    def build(vocab: dict[str, int], merges: list[tuple[str, str]], config: Mapping[str, Any]) -> Tokenizer:
        tok = _byte_bpe(vocab, merges)
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=_aps(config, False), use_regex=False),
            ]
        )
        return tok

    return build


def _gpt2(vocab: dict[str, int], merges: list[tuple[str, str]], config: Mapping[str, Any]) -> Tokenizer:
    tok = _byte_bpe(vocab, merges)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=_aps(config, False))
    return tok


def _gpt_neox(vocab: dict[str, int], merges: list[tuple[str, str]], config: Mapping[str, Any]) -> Tokenizer:
    tok = _byte_bpe(vocab, merges)
    tok.normalizer = normalizers.NFC()
    trim = bool(config.get("trim_offsets", True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=_aps(config, False), trim_offsets=trim)
    return tok


def _cohere(vocab: dict[str, int], merges: list[tuple[str, str]], config: Mapping[str, Any]) -> Tokenizer:
    tok = _byte_bpe(vocab, merges)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=_aps(config, False), trim_offsets=True),
        ]
    )
    return tok


_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN3_5_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
_ENDOFTEXT = "<|endoftext|>"
_QWEN = {"unk_token": _ENDOFTEXT, "bos_token": None, "eos_token": _ENDOFTEXT, "pad_token": _ENDOFTEXT}
_CODE_LLAMA_INFILL = {
    "prefix_token": "▁<PRE>",
    "middle_token": "▁<MID>",
    "suffix_token": "▁<SUF>",
    "eot_token": "▁<EOT>",
    "fill_token": "<FILL_ME>",
}
_CLASSES = {
    "LlamaTokenizer": HfClass(_LLAMA, _llama),
    "CodeLlamaTokenizer": HfClass(_LLAMA, _code_llama, "bos", _CODE_LLAMA_INFILL),
    "GemmaTokenizer": HfClass(
        {"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
        | {"mask_token": "<mask>"},
        _gemma,
    ),
    "Qwen2Tokenizer": HfClass(_QWEN, _qwen(_QWEN2_PATTERN), readds_special=True),
    "Qwen3_5Tokenizer": HfClass(_QWEN, _qwen(_QWEN3_5_PATTERN)),
    "GPT2Tokenizer": HfClass(dict.fromkeys(("unk_token", "bos_token", "eos_token"), _ENDOFTEXT), _gpt2),
    "CodeGenTokenizer": HfClass(dict.fromkeys(("unk_token", "bos_token", "eos_token"), _ENDOFTEXT), _gpt2),
    "GPTNeoXTokenizer": HfClass(
        dict.fromkeys(("unk_token", "bos_token", "eos_token"), _ENDOFTEXT) | {"pad_token": "<|padding|>"},
        _gpt_neox,
        "none",
    ),
    "CohereTokenizer": HfClass(
        {"unk_token": "<UNK>", "bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>"}
        | {"pad_token": "<PAD>", "cls_token": "<CLS>", "sep_token": "<SEP>", "mask_token": "<MASK_TOKEN>"},
        _cohere,
    ),
}
_BASE = HfClass()
_GENERIC = "TokenizersBackend"
# transformers 5.19's TOKENIZER_MAPPING_NAMES, for the model types registered to a class reproduced here or
# to the generic backend; and the types of MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS registered to a class
_REGISTERED = {
    "LlamaTokenizer": "idefics idefics2",
    "CodeLlamaTokenizer": "code_llama",
    "GemmaTokenizer": (
        "diffusion_gemma gemma gemma2 gemma3 gemma3_text gemma3n gemma3n_text recurrent_gemma "
        "shieldgemma2 t5gemma zaya"
    ),
    "Qwen2Tokenizer": (
        "audioflamingo3 colqwen2 cosmos3_omni fun_asr_nano hunyuan_vl internvl ovis2 qianfan_ocr qwen2 "
        "qwen2_5_omni qwen2_5_vl qwen2_audio qwen2_moe qwen2_vl qwen3 qwen3_asr qwen3_moe qwen3_next "
        "qwen3_omni_moe qwen3_vl qwen3_vl_moe lighton_ocr vibevoice"
    ),
    "Qwen3_5Tokenizer": "qwen3_5 qwen3_5_moe qwen3_5_moe_text qwen3_5_text qwen4_exp",
    "GPT2Tokenizer": (
        "blip-2 codegen dbrx emu3 gpt2 gpt_neo gptj hyperclovax_vision_v2 instructblip instructblipvideo "
        "jais2 opt phi starcoder2"
    ),
    "GPTNeoXTokenizer": "falcon_mamba gpt_neox mamba mamba2 mpt olmo olmoe rwkv xlstm",
    "CohereTokenizer": "aya_vision cohere cohere2",
    _GENERIC: (
        "EvollaModel arctic aria bigbird_pegasus camembertv2-base canary chameleon chatlm cohere_asr "
        "deepseek_ocr deepseek_ocr2 deepseek_v2 deepseek_v3 deepseek_v32 deepseek_v4 deepseek_vl "
        "deepseek_vl_hybrid deepseek_vl_v2 ernie4_5 ernie4_5_moe flex_olmo fuyu glm glm4 glm4_moe "
        "glm4_moe_lite glm4v glm4v_moe glm_image glmasr got_ocr2 gpt_bigcode granite granitemoe "
        "granitemoehybrid granitemoeshared h2ovl_chat hyperclovax hyperclovax_vlm internlm2 jamba janus "
        "kimi_k25 kimi_linear kosmos-2 llava llava_next mimo_v2_flash minicpm3 minicpmv minicpmv4_6 "
        "minicpmv4_7 minimax_m2 ministral ministral3 mistral mistral3 mixtral modernbert "
        "modernbert-decoder molmo molmo2 nemotron nvfp4 nystromformer olmo2 olmo3 olmo_hybrid opencua "
        "openvla paddleocr_vl pegasus_x persimmon phi3 phi3_v phimoe pix2struct pixtral smolvlm stablelm "
        "step3_vl step3p5 umt5 vipllava voxtral voxtral_realtime xlm-roberta-xl"
    ),
}
_REGISTERED_CLASS = {t: name for name, types in _REGISTERED.items() for t in types.split()}
# vLLM 0.32's _MODEL_TYPES_WITH_INCORRECT_TOKENIZER_CLASS (tokenizers/registry.py): AutoTokenizer bypassed
_VLLM_GENERIC = {"internlm2", "step3_vl", "step3p7", "unlimited-ocr", "unlimited_ocr"}
_MISLABELLED = {"hyperclovax_vision_v2", "qwen2", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp"}


def class_name(config: Mapping[str, Any], model_config: Mapping[str, Any]) -> str:
    """The transformers class AutoTokenizer picks (`AutoTokenizer.from_pretrained`), or vLLM."""
    own, model_type = config.get("tokenizer_class"), model_config.get("model_type")
    if model_type in _VLLM_GENERIC:  # vLLM loads these with TokenizersBackend itself
        return _GENERIC
    hub = own if isinstance(own, str) and own else model_config.get("tokenizer_class")
    hub = hub.removesuffix("Fast") if isinstance(hub, str) and hub else None
    registered = _REGISTERED_CLASS.get(model_type) if isinstance(model_type, str) else None
    if "auto_map" in config:  # remote code is not run: its tokenizer_class stands
        registered = None
    if hub is None:
        return registered or _GENERIC
    if registered is not None and registered != hub:
        if registered == _GENERIC:
            return _GENERIC
        return registered if model_type in _MISLABELLED else hub
    return hub


def hf_class(config: Mapping[str, Any], model_config: Mapping[str, Any] | None = None) -> HfClass:
    return _CLASSES.get(class_name(config, model_config or {}), _BASE)


_MISTRAL_TYPES = {"mistral", "mistral3", "voxtral", "ministral", "pixtral"}
_MISTRAL_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def fixes_mistral_regex(
    tok: Tokenizer, config: Mapping[str, Any], model_config: Mapping[str, Any] | None
) -> bool:
    """`TokenizersBackend._patch_mistral_regex` applies: a vocabulary over 100,000 with a pre-tokenizer, the
    config's `fix_mistral_regex`, and a config.json of a Mistral model saved before transformers 5 (or one
    that does not say which transformers saved it)."""
    if not config.get("fix_mistral_regex") or model_config is None or tok.pre_tokenizer is None:
        return False
    if tok.get_vocab_size() <= 100_000:
        return False
    version = model_config.get("transformers_version")
    if not version:
        return True
    model_type = model_config.get("model_type")
    return _before_5(version) and (model_type is None or model_type in _MISTRAL_TYPES)


def _before_5(version: str) -> bool:
    """`packaging.version.parse(version) < parse("5.0.0")` for release versions and their pre-releases."""
    match = re.match(r"\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(.*)", version)
    if match is None:
        return False  # transformers raises on a version it cannot parse
    release = tuple(int(n or 0) for n in match.groups()[:3])
    pre = re.match(r"[.\-_]?(dev|a|alpha|b|beta|c|rc|pre|preview)", match.group(4).lower()) is not None
    return release < (5, 0, 0) or (release == (5, 0, 0) and pre)


def fix_mistral_regex(tok: Tokenizer) -> None:
    """The patch: the corrected `Split` first (a `Metaspace` becomes a `ByteLevel` behind it)."""
    split = pre_tokenizers.Split(Regex(_MISTRAL_PATTERN), behavior="isolated")
    current = tok.pre_tokenizer
    if isinstance(current, pre_tokenizers.Sequence):
        current[0] = split
        return
    if isinstance(current, pre_tokenizers.Metaspace):
        current = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, current])
