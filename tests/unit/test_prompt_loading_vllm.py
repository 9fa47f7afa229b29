"""Tokenizer directories loaded as vLLM 0.32 loads them (transformers 5.19: `kvindex/tokenizer_files.py`; more
cases in test_tokenizer_transformers5.py), rendered chats bounded by the keying limit, and template failures
that leave a request unkeyed instead of failing it.

The expected ids are what transformers 5.19's `AutoTokenizer.from_pretrained(dir, trust_remote_code=False,
revision=None, truncation_side="left", mistral_format=False)` (vLLM 0.32's call) computes on these very files
(`tok(text, add_special_tokens=...)["input_ids"]`; the chat rendered by `apply_chat_template(...,
tokenize=False)`, then encoded without special tokens), written down as literals.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from epp.kvindex.chat_template import ChatTemplateError
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.prompt import PromptTokenizer, PromptTooLong, TokenizerRegistry
from epp.kvindex.service import KvIndexService
from epp.requests import build_request
from epp.testing.tokenizer import BOS, EOS, build_tiny_tokenizer

BYTE_LEVEL_APS = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
ENTRY = {"content": BOS, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
HELLO = [44, 73, 80, 310, 225, 91, 274, 80, 72]  # "Hello world", no special tokens
HI_CHAT = [2, 445, 300, 3, 203, 203, 44, 77, 285, 268, 4, 2, 363, 87, 77, 297, 313, 88, 3, 203, 203]
HI_CHAT_APS = [
    2, 225, 445, 300, 3, 225, 203, 203, 44, 77, 285, 268, 4, 2, 293, 87, 77, 297, 313, 88, 3, 225, 203, 203
]  # fmt: skip
# LlamaTokenizer rebuilds the tokenizer from tokenizer.json's vocabulary and merges with a Metaspace
# pre-tokenizer: on this byte-level vocabulary, spaces are lost ("▁" is not in it)
HELLO_LLAMA = [44, 73, 80, 310, 91, 274, 80, 72]
HI_CHAT_LLAMA = [2, 445, 300, 3, 44, 276, 73, 268, 4, 2, 363, 87, 77, 297, 313, 88, 3]


def _variant(
    base: Path,
    dst: Path,
    *,
    config: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    special_tokens_map: dict[str, Any] | None = None,
    pre_tokenizer: dict[str, Any] | None = None,
) -> Path:
    dst.mkdir()
    spec = json.loads((base / "tokenizer.json").read_text())
    if pre_tokenizer is not None:
        spec["pre_tokenizer"] = pre_tokenizer
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    cfg = {k: v for k, v in json.loads((base / "tokenizer_config.json").read_text()).items() if k not in drop}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg | (config or {})))
    if special_tokens_map is not None:
        (dst / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    return dst


def _added_tokens_decoder(base: Path) -> dict[str, Any]:
    spec = json.loads((base / "tokenizer.json").read_text())
    return {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in spec["added_tokens"]}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny"))


VARIANTS: dict[str, dict[str, Any]] = {
    "llama_nobos": {"config": {"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": False}},
    "llama_bos_eos": {
        "config": {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": True}
    },
    "neox": {"config": {"tokenizer_class": "GPTNeoXTokenizer"}},
    "stm_legacy": {
        "drop": ("bos_token", "eos_token"),
        "special_tokens_map": {"bos_token": BOS, "eos_token": EOS},
    },
    "stm_override": {"config": {"bos_token": EOS}, "special_tokens_map": {"bos_token": ENTRY}},
    "stm_ignored": {
        "drop": ("bos_token",),
        "special_tokens_map": {"bos_token": BOS},
    },  # + added_tokens_decoder
    "aps_base": {"pre_tokenizer": BYTE_LEVEL_APS},
    "aps_llama": {"config": {"tokenizer_class": "LlamaTokenizerFast"}, "pre_tokenizer": BYTE_LEVEL_APS},
    "aps_config_true": {"config": {"add_prefix_space": True}, "pre_tokenizer": BYTE_LEVEL_APS},
    "gpt2_defaults": {"config": {"tokenizer_class": "GPT2Tokenizer"}, "drop": ("bos_token", "eos_token")},
}
# name -> ("Hello world" with special tokens, without, the chat [{"user": "Hi there"}] with its generation
# prompt, encoded without special tokens): transformers 5.19
EXPECTED: dict[str, tuple[list[int], list[int], list[int]]] = {
    # add_bos_token / add_eos_token are ignored: tokenizer.json's post-processor (which adds the bos token)
    # stays, also for LlamaTokenizerFast, which rebuilds the rest of the tokenizer
    "llama_nobos": ([0, *HELLO_LLAMA], HELLO_LLAMA, [0, *HI_CHAT_LLAMA]),
    "llama_bos_eos": ([0, *HELLO_LLAMA], HELLO_LLAMA, [0, *HI_CHAT_LLAMA]),
    # GPTNeoXTokenizer replaces it with one that adds nothing
    "neox": (HELLO, HELLO, [0, *HI_CHAT]),
    # special_tokens_map.json names the bos token the template writes (no added_tokens_decoder: read) ...
    "stm_legacy": ([0, *HELLO], HELLO, [0, *HI_CHAT]),
    # ... and wins over tokenizer_config.json's
    "stm_override": ([0, *HELLO], HELLO, [0, *HI_CHAT]),
    # ... but is not read when the config has an added_tokens_decoder: no bos token to render
    "stm_ignored": ([0, *HELLO], HELLO, HI_CHAT),
    # the generic class keeps tokenizer.json's pre-tokenizer, add_prefix_space included (4.57 set the
    # config's, False when unset) ...
    "aps_base": ([0, 225, *HELLO], [225, *HELLO], [0, *HI_CHAT_APS]),
    # ... LlamaTokenizerFast replaces it
    "aps_llama": ([0, *HELLO_LLAMA], HELLO_LLAMA, [0, *HI_CHAT_LLAMA]),
    "aps_config_true": ([0, 225, *HELLO], [225, *HELLO], [0, *HI_CHAT_APS]),
    # GPT2TokenizerFast's default bos token, missing from the vocabulary: added (id 512), and rendered
    "gpt2_defaults": ([0, *HELLO], HELLO, [512, *HI_CHAT]),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_tokenizer_files_are_read_as_transformers_5_reads_them(base: Path, tmp_path: Path, name: str) -> None:
    spec = dict(VARIANTS[name])
    if name == "stm_ignored":
        spec["config"] = {"added_tokens_decoder": _added_tokens_decoder(base)}
    tok = PromptTokenizer.from_dir(_variant(base, tmp_path / name, **spec))
    special, plain, chat = EXPECTED[name]
    for text, add, want in (("Hello world", True, special), ("Hello world", False, plain)):
        assert tok.encode_prompt(text, add_special_tokens=add).tolist() == want
        assert tok.encode_uncached(text, add_special_tokens=add) == want
    assert tok.encode_chat([{"role": "user", "content": "Hi there"}]).tolist() == chat


def test_the_class_default_special_tokens_are_named_and_added(base: Path, tmp_path: Path) -> None:
    tok = PromptTokenizer.from_dir(
        _variant(base, tmp_path / "neox", config={"tokenizer_class": "GPTNeoXTokenizer"})
    )
    # transformers 5.19: special_tokens_map {bos, eos, unk: <|endoftext|>, pad: <|padding|>}, ids 512, 513
    specials = {"bos_token": BOS, "eos_token": EOS, "unk_token": "<|endoftext|>", "pad_token": "<|padding|>"}
    assert tok.special_tokens == specials
    assert tok.encode_prompt("<|endoftext|><|padding|>", add_special_tokens=False).tolist() == [512, 513]


def test_a_llama_class_without_its_bos_token_still_gets_the_files_bos(base: Path, tmp_path: Path) -> None:
    """transformers 5.19 loads it (4.57 raised "add_bos_token = True but bos_token = None"): tokenizer.json's
    post-processor still adds <|begin_of_text|>, and the template has no bos_token to write."""
    d = _variant(base, tmp_path / "x", config={"tokenizer_class": "LlamaTokenizerFast", "bos_token": None})
    tok = PromptTokenizer.from_dir(d)
    assert tok.encode_prompt("Hello world").tolist() == [0, *HELLO_LLAMA]
    assert tok.encode_chat([{"role": "user", "content": "Hi there"}]).tolist() == HI_CHAT_LLAMA


# --- rendered chats over the keying limit ---


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


def test_a_rendered_chat_over_max_chars_is_not_encoded(base: Path) -> None:
    tok = PromptTokenizer.from_dir(base)
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": _nested(8)}}]
    rendered = len(tok.render_chat(messages, tools=tools))
    assert tok.encode_chat(messages, tools=tools, max_chars=rendered).tolist() == tok.encode_uncached(
        tok.render_chat(messages, tools=tools), add_special_tokens=False
    )
    with pytest.raises(PromptTooLong, match=f"{rendered} characters"):
        tok.encode_chat(messages, tools=tools, max_chars=rendered - 1)


def test_the_service_keys_by_the_rendered_size_not_the_body_size(base: Path) -> None:
    """Tool schemas under `tojson(indent=...)` render a small body to many times its size: the rendered text
    is held to `max_keyed_prompt_chars` too (unkeyed, "too_long", not encoded)."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": _nested(12)}} for i in range(4)]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    raw = json.dumps(body).encode()
    request = build_request({":path": "/v1/chat/completions"}, body, {}, len(raw))
    service = KvIndexService(BlockIndex(16, 1000), FreshnessTracker(), TokenizerRegistry({"m": base}), 16)
    tok = service.tokenizers.get("m")
    assert tok is not None and request.chat is not None
    rendered = len(tok.render_chat(request.messages or [], tools=request.chat.tools))
    assert rendered > 2 * len(raw)
    service.max_keyed_prompt_chars = (rendered + len(raw)) // 2
    assert service.tokenizing_chars(request) > 0  # the body is under the limit
    assert service.prompt_tokens(request) is None
    assert service.unkeyed[("m", "too_long")] == 1
    service.max_keyed_prompt_chars = rendered
    assert service.prompt_tokens(request) is not None


def test_a_template_error_from_anywhere_leaves_the_request_unkeyed(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ChatTemplateError (a nesting bound, a template that raises) is a request without keys, not a 500."""
    service = KvIndexService(BlockIndex(16, 1000), FreshnessTracker(), TokenizerRegistry({"m": base}), 16)
    request = build_request(
        {":path": "/v1/chat/completions"}, {"model": "m", "messages": [{"role": "user"}]}, {}
    )

    def fail(*args: Any, **kwargs: Any) -> str:
        raise ChatTemplateError("nested deeper than allowed")

    monkeypatch.setattr(PromptTokenizer, "render_chat", fail)
    assert service.prompt_tokens(request) is None
    assert service.unkeyed[("m", "tokenizer_error")] == 1
