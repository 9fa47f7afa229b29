"""Prompt -> token ids: pass-through, text, chat templates, errors, and the exactness of the prefix cache."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from epp.kvindex.chat_template import ChatTemplate, ChatTemplateError
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.prefix_cache import Chunker, PrefixCache
from epp.kvindex.prompt import PromptTokenizer, TokenizerError, TokenizerRegistry
from epp.kvindex.service import KvIndexService
from epp.testing.tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer, generated_text
from epp.types import ApiKind, ChatOptions, InferenceRequest

BOT, SH, EH, EOT = "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SYSTEM_AND_USER = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi!\n"}]
TRAIN_LINES = generated_text(30_000, seed=5).split(". ")


# --- tokenizers of several kinds, built locally ---

BYTES = pre_tokenizers.ByteLevel.alphabet()


def _tok(model: Any, normalizer: Any = None, pre_tokenizer: Any = None) -> Tokenizer:
    tok = Tokenizer(model)
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    return tok


def _bpe(specials: list[str], alphabet: list[str] = BYTES) -> trainers.BpeTrainer:
    return trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )


# kind -> (untrained tokenizer, trainer, post-processor template or "")
KINDS: dict[str, Callable[[], tuple[Tokenizer, Any, str]]] = {
    "gpt2-bytelevel": lambda: (
        _tok(models.BPE(), pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=True)),
        _bpe(["<|endoftext|>"]),
        "",
    ),
    "wordpiece-bert": lambda: (
        _tok(
            models.WordPiece(), normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
        ),
        trainers.WordPieceTrainer(
            vocab_size=400, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False
        ),
        "[CLS] $A [SEP]",
    ),
    "sentencepiece-like": lambda: (  # Llama 2 style, no pre-tokenizer: space cuts are NOT stable
        _tok(models.BPE(), normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])),
        _bpe(["<unk>", "<s>", "</s>"], []),
        "<s> $A",
    ),
    "unigram-metaspace": lambda: (
        _tok(models.Unigram(), pre_tokenizer=pre_tokenizers.Metaspace(prepend_scheme="first")),
        trainers.UnigramTrainer(
            vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
        ),
        "$A </s>",
    ),
    "word-pairs-regex": lambda: (  # joins two words across a space: space cuts are NOT stable
        _tok(
            models.BPE(),
            pre_tokenizer=pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(r"\w+ \w+|\s+|[^\s\w]+|\w+"), "isolated"),
                    pre_tokenizers.ByteLevel(use_regex=False),
                ]
            ),
        ),
        _bpe(["<|sep|>"]),
        "",
    ),
}
ALL_KINDS = ["tiny-bpe-llama3", *KINDS]


def _build(kind: str, directory: Path) -> Tokenizer:
    if kind == "tiny-bpe-llama3":
        return Tokenizer.from_file(str(build_tiny_tokenizer(directory) / "tokenizer.json"))
    tok, trainer, post = KINDS[kind]()
    tok.train_from_iterator(TRAIN_LINES, trainer)
    if post:
        specials = [(t, tok.token_to_id(t)) for t in dict.fromkeys(post.split()) if t != "$A"]
        tok.post_processor = processors.TemplateProcessing(single=post, special_tokens=specials)
    return tok


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def kinds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PromptTokenizer, PromptTokenizer]]:
    """Per kind: a tokenizer whose cache the test clears (cold), and one with a small, shared cache."""
    out = {}
    for name in ALL_KINDS:
        tok = _build(name, tmp_path_factory.mktemp(name))
        fresh = PromptTokenizer(Tokenizer.from_str(tok.to_str()), name=name, chunk_chars=4)
        small = PromptTokenizer(Tokenizer.from_str(tok.to_str()), name=name, chunk_chars=3, cache_bytes=6000)
        out[name] = (fresh, small)
    return out


# --- the cache never changes the ids ---

SPECIALS = f"{BOT} {EOT} {SH} [CLS] [SEP] [MASK] <s> </s> <unk> <|endoftext|> <|sep|> <pad>".split()
fragments = st.one_of(
    st.text(max_size=8),
    st.from_regex(r"[A-Za-z0-9]{1,9}", fullmatch=True),
    st.sampled_from([" ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n", "\n ", "\u00a0", "\u3000", " \t "]),
    st.sampled_from(SPECIALS),
    st.sampled_from(
        ["😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "é", "e\u0301", "中文", "ΣΑΣ", "'s", "...", "123456", "½"]
    ),
)
words = st.from_regex(r"( ?[a-zA-Z0-9']{1,5}[.,!?]?){1,4}", fullmatch=True)
texts = st.lists(st.one_of(fragments, words), max_size=24).map("".join)


@pytest.mark.parametrize("kind", ALL_KINDS)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.lists(st.one_of(fragments, words), max_size=40).map("".join))
def test_every_candidate_cut_is_stable(
    kinds: dict[str, tuple[PromptTokenizer, PromptTokenizer]], kind: str, text: str
) -> None:
    """The theory the cache rests on, without its insert check: cut at every candidate, encode alone."""
    tok = kinds[kind][0]
    chunker = tok.chunker
    every = Chunker(
        1,
        split_before_space=chunker.split_before_space,
        special_tokens=chunker.special_tokens,
        rstrip_tokens=chunker.rstrip_tokens,
    )
    edges = [0, *every.boundaries(text), len(text)]
    pieces = [tok.encode_uncached(text[a:b], add_special_tokens=False) for a, b in itertools.pairwise(edges)]
    assert [i for piece in pieces for i in piece] == tok.encode_uncached(text, add_special_tokens=False)


@pytest.mark.parametrize("kind", ALL_KINDS)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=texts, first=texts, second=texts)
def test_cached_ids_equal_one_call_ids_cold_and_warm(
    kinds: dict[str, tuple[PromptTokenizer, PromptTokenizer]], kind: str, prefix: str, first: str, second: str
) -> None:
    fresh, small = kinds[kind]
    fresh.clear_cache()
    for tok in (fresh, small):
        for text in (prefix + first, prefix + second, prefix + first, prefix, prefix + second + first):
            for add in (False, True):
                got = tok.encode_text(text, add_special_tokens=add)
                assert got.tolist() == tok.encode_uncached(text, add_special_tokens=add), (kind, text, add)
    assert small.cache_stats()["bytes"] <= 6000


def test_the_kinds_get_the_cuts_their_pipelines_allow(
    kinds: dict[str, tuple[PromptTokenizer, PromptTokenizer]],
) -> None:
    cuts = {name: fresh.chunker for name, (fresh, _) in kinds.items()}
    assert {name for name, c in cuts.items() if c.split_before_space} == {
        "tiny-bpe-llama3",
        "gpt2-bytelevel",
        "wordpiece-bert",
        "unigram-metaspace",
    }
    assert all(c.special_tokens for c in cuts.values())
    assert any("pre-tokenizer" in n for n in kinds["sentencepiece-like"][0].chunking_notes)
    assert any("probe texts disagree" in n for n in kinds["word-pairs-regex"][0].chunking_notes)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    system=texts,
    turns=st.lists(st.tuples(st.sampled_from(["user", "assistant"]), texts), min_size=1, max_size=4),
    generation=st.booleans(),
)
def test_chat_ids_equal_one_call_on_the_rendered_text(
    tiny: PromptTokenizer, system: str, turns: list[tuple[str, str]], generation: bool
) -> None:
    messages = [{"role": "system", "content": system}, *({"role": r, "content": c} for r, c in turns)]
    text = tiny.render_chat(messages, add_generation_prompt=generation)
    got = tiny.encode_chat(messages, add_generation_prompt=generation)
    assert got.tolist() == tiny.encode_uncached(text, add_special_tokens=False)


def test_a_context_dependent_encoder_is_caught_on_insert() -> None:
    """Ids that depend on the whole text (here: its length) fail the insert check and are never cached."""

    def encode(text: str) -> list[int]:
        return [len(text) * 1000 + ord(c) for c in text]

    cache = PrefixCache(encode, lambda ts: [encode(t) for t in ts], Chunker(2), max_bytes=1 << 20)
    for text in ("ab cd ef gh", "ab cd ef gh ij", "ab cd xx"):
        assert cache.encode(text).tolist() == encode(text)
    stats = cache.stats()
    assert stats["entries"] == 0 and stats["unstable"] > 0 and stats["hits"] == 0


# --- prompts ---


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ([1, 2, 3], [1, 2, 3]),
        ([], []),
        ((7,), [7]),
        (np.array([5, 0, 9]), [5, 0, 9]),
        ([0, 2**31 - 1], [0, 2**31 - 1]),
    ],
)
def test_token_id_prompts_pass_through(tiny: PromptTokenizer, prompt: Any, expected: list[int]) -> None:
    assert tiny.encode_prompt(prompt).tolist() == expected


@pytest.mark.parametrize("prompt", [[-1], [2**31], [[1, 2]], ["a", "b"], [1.5, None]])
def test_bad_token_id_prompts_are_refused(tiny: PromptTokenizer, prompt: Any) -> None:
    with pytest.raises(TokenizerError):
        tiny.encode_prompt(prompt)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello world",
        "  leading and trailing  ",
        "line one\nline two\n\n",
        "emoji 😀 and 中文",
        f"{EOT} raw special",
    ],
)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_text_prompts_are_tokenized_like_the_tokenizer(
    tiny_dir: Path, tiny: PromptTokenizer, text: str, add_special_tokens: bool
) -> None:
    reference = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    expected = reference.encode(text, add_special_tokens=add_special_tokens).ids
    assert tiny.encode_prompt(text, add_special_tokens=add_special_tokens).tolist() == expected
    if add_special_tokens:
        assert expected[:1] == [reference.token_to_id(BOT)]


def test_encode_request_picks_messages_then_prompt(tiny: PromptTokenizer) -> None:
    chat = InferenceRequest("r1", ApiKind.CHAT_COMPLETIONS, "m", messages=SYSTEM_AND_USER)
    completion = InferenceRequest("r2", ApiKind.COMPLETIONS, "m", prompt=[4, 5])
    assert tiny.encode_request(chat) is not None
    assert tiny.encode_request(chat).tolist() == tiny.encode_chat(SYSTEM_AND_USER).tolist()  # type: ignore[union-attr]
    assert tiny.encode_request(completion).tolist() == [4, 5]  # type: ignore[union-attr]
    assert tiny.encode_request(InferenceRequest("r3", ApiKind.EMBEDDINGS, "m")) is None


# --- chat templates ---

# as vLLM gives it to the template (a missing description is null: test_chat_template_vllm.py)
TOOL = {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}}
CALL = {"type": "function", "id": "c1", "function": {"name": "f", "arguments": '{"x": 1}'}}


@pytest.mark.parametrize(
    "messages, kwargs, rendered",
    [
        (
            SYSTEM_AND_USER,
            {},
            f"{BOT}{SH}system{EH}\n\nBe brief.{EOT}{SH}user{EH}\n\nHi!{EOT}{SH}assistant{EH}\n\n",
        ),
        (
            SYSTEM_AND_USER,
            {"add_generation_prompt": False},
            f"{BOT}{SH}system{EH}\n\nBe brief.{EOT}{SH}user{EH}\n\nHi!{EOT}",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": " b"}]}],
            {"add_generation_prompt": False},
            f"{BOT}{SH}user{EH}\n\nab{EOT}",
        ),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}],
            {"add_generation_prompt": False, "tools": [TOOL]},
            f"{BOT}{SH}system{EH}\n\nYou can call these functions. Answer with JSON "
            '{"name": ..., "arguments": ...}.\n' + json.dumps(TOOL, indent=2) + f"\n{EOT}"
            f'{SH}user{EH}\n\nq{EOT}{SH}assistant{EH}\n\n\n{{"name": "f", "arguments": {{"x": 1}}}}{EOT}',
        ),
        (
            [{"role": "developer", "content": "dev"}, {"role": "user", "content": "u"}],
            {"add_generation_prompt": False},
            f"{BOT}{SH}system{EH}\n\ndev{EOT}{SH}user{EH}\n\nu{EOT}",
        ),
        (
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": "The answer is "}],
            {"add_generation_prompt": False, "continue_final_message": True},
            f"{BOT}{SH}user{EH}\n\nu{EOT}{SH}assistant{EH}\n\nThe answer is",
        ),
    ],
    ids=["system-user", "no-generation-prompt", "text-parts", "tools-and-calls", "developer", "continue"],
)
def test_chat_is_rendered_with_the_template(
    tiny: PromptTokenizer, messages: list[dict[str, Any]], kwargs: dict[str, Any], rendered: str
) -> None:
    assert tiny.render_chat(messages, **kwargs) == rendered
    expected = tiny.encode_uncached(rendered, add_special_tokens=False)
    assert tiny.encode_chat(messages, **kwargs).tolist() == expected
    assert expected.count(expected[0]) == 1  # one bos: the template's, none added on top


def test_string_format_templates_get_joined_text_parts() -> None:
    template = ChatTemplate("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert template.content_format == "string"
    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]
    assert (
        template.render([{"role": "user", "content": parts}, {"role": "user", "content": None}]) == "[a\nb][]"
    )
    with pytest.raises(ChatTemplateError, match="malformed messages"):
        template.render([{"role": "user", "content": [{"type": "text", "text": 5}]}])
    assert ChatTemplate(CHAT_TEMPLATE).content_format == "openai"


def test_strftime_now_uses_the_injected_clock() -> None:
    source = "{{ strftime_now('%d %b %Y') if strftime_now is defined else 'no clock' }}"
    assert ChatTemplate(source).render([]) == "no clock"
    assert ChatTemplate(source, now=lambda: datetime(2024, 7, 26)).render([]) == "26 Jul 2024"


# --- files and errors ---


def _copy(src: Path, dst: Path, **config_changes: Any) -> Path:
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (dst / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return dst


def test_config_bos_flags_are_ignored_by_the_base_class(tiny_dir: Path, tmp_path: Path) -> None:
    """PreTrainedTokenizerFast (the tiny tokenizer's class) ignores add_bos_token / add_eos_token, in
    transformers 4.57 as in 5.x (vLLM 0.32's): tokenizer.json's post-processor rules. In 5.x the classes
    that rebuild the tokenizer (LlamaTokenizer, ...) ignore them too: test_tokenizer_transformers5.py."""
    for flags in ({"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True}):
        tok = PromptTokenizer.from_dir(_copy(tiny_dir, tmp_path / str(len(flags)), **flags))
        body = tok.encode_prompt("hi there", add_special_tokens=False).tolist()
        assert tok.encode_prompt("hi there").tolist() == [0, *body]


def test_named_special_tokens_missing_from_the_vocabulary_are_added(tiny_dir: Path, tmp_path: Path) -> None:
    tok = PromptTokenizer.from_dir(
        _copy(tiny_dir, tmp_path / "a", pad_token="<|pad|>", extra_special_tokens={"image_token": "<|img|>"})
    )
    assert tok.special_tokens["pad_token"] == "<|pad|>" and tok.special_tokens["image_token"] == "<|img|>"
    pad, img = tok.encode_prompt("<|pad|><|img|>", add_special_tokens=False).tolist()
    assert pad != img and pad >= 512 and img >= 512
    text = "x<|pad|>y <|img|> z"
    assert tok.encode_prompt(text).tolist() == tok.encode_uncached(text, add_special_tokens=True)


def test_template_files_and_named_templates(tiny_dir: Path, tmp_path: Path) -> None:
    named = [{"name": "default", "template": "D{{ messages|length }}"}, {"name": "tool_use", "template": "T"}]
    tok = PromptTokenizer.from_dir(_copy(tiny_dir, tmp_path / "a", chat_template=named))
    assert tok.render_chat(SYSTEM_AND_USER) == "D2"
    assert tok.render_chat(SYSTEM_AND_USER, tools=[TOOL]) == "T"
    (tmp_path / "a" / "chat_template.jinja").write_text("J")
    assert PromptTokenizer.from_dir(tmp_path / "a").render_chat(SYSTEM_AND_USER) == "J"


def _write(directory: Path, name: str, text: str) -> None:
    (directory / name).write_text(text)


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: d.rmdir(), "does not exist"),
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (lambda d: _write(d, "tokenizer.json", "{not json"), "tokenizer.json: not valid JSON"),
        (lambda d: _write(d, "tokenizer.json", '{"model": 3}'), "tokenizer.json: not a tokenizers file"),
        (lambda d: _write(d, "tokenizer_config.json", "[1,"), "tokenizer_config.json: not valid JSON"),
        (lambda d: _write(d, "tokenizer_config.json", '{"chat_template": 5}'), "chat_template must be"),
        (
            lambda d: _write(d, "tokenizer_config.json", '{"chat_template": "{% if %}"}'),
            "in .*tokenizer_config.json: syntax error on line 1",
        ),
        (
            lambda d: _write(d, "chat_template.jinja", "{% for m in messages %}"),
            "chat_template.jinja: syntax error",
        ),
    ],
    ids=[
        "no-dir",
        "no-tokenizer-json",
        "bad-json",
        "not-a-tokenizer",
        "bad-config",
        "bad-type",
        "syntax",
        "jinja",
    ],
)
def test_bad_tokenizer_directories_raise_clear_errors(
    tiny_dir: Path, tmp_path: Path, setup: Callable[[Path], None], message: str
) -> None:
    d = _copy(tiny_dir, tmp_path / "tok")
    if message == "does not exist":
        for f in d.iterdir():
            f.unlink()
    setup(d)
    with pytest.raises(TokenizerError, match=message) as info:
        TokenizerRegistry({"my-model": d})
    assert "my-model" in str(info.value)


@pytest.mark.parametrize(
    "messages, message",
    [
        (
            [{"role": "narrator", "content": "x"}],
            "the template raised: Conversation roles must be .* got narrator",
        ),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], "'image_url'"),
        ([{"content": "no role"}], "needs a string 'role'"),
        ([{"role": "user", "content": {"text": "x"}}], "must be a string or a list of parts"),
        ("not a list", "messages must be a list"),
    ],
)
def test_messages_the_template_refuses_raise(tiny_dir: Path, messages: Any, message: str) -> None:
    tok = TokenizerRegistry({"tiny": tiny_dir}).get("tiny")
    assert tok is not None
    with pytest.raises(TokenizerError, match=message) as info:
        tok.encode_chat(messages)
    assert str(info.value).startswith("tiny: chat template")


def test_no_chat_template_raises(tiny_dir: Path, tmp_path: Path) -> None:
    tok = PromptTokenizer.from_dir(_copy(tiny_dir, tmp_path / "a", chat_template=None), name="bare")
    with pytest.raises(TokenizerError, match="bare: the tokenizer has no chat_template"):
        tok.encode_chat(SYSTEM_AND_USER)


# --- the cache ---


def test_a_shared_prefix_is_served_from_the_cache(tiny_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(tiny_dir, chunk_chars=256)
    system = generated_text(20_000, seed=3)
    first = [{"role": "system", "content": system}, {"role": "user", "content": "first question"}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "another one"}]
    a = tok.encode_chat(first)
    cold = tok.cache_stats()
    b = tok.encode_chat(second)
    warm = tok.cache_stats()
    assert cold["hits"] == 0 and cold["misses"] > 60 and cold["entries"] > 60
    assert warm["hits"] >= cold["entries"] - 8  # all of the system prompt's chunks
    assert warm["tokenized_chars"] - cold["tokenized_chars"] < 2 * 300  # only the new question's part, twice
    for messages, ids in ((first, a), (second, b)):
        assert ids.tolist() == tok.encode_uncached(tok.render_chat(messages), add_special_tokens=False)


def test_the_cache_is_bounded_and_evicts(tiny_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(tiny_dir, chunk_chars=64, cache_bytes=20_000)
    for seed in range(6):
        text = generated_text(5_000, seed=seed)
        assert tok.encode_prompt(text).tolist() == tok.encode_uncached(text, add_special_tokens=True)
        assert tok.cache_stats()["bytes"] <= 20_000
    assert tok.cache_stats()["evictions"] > 0
    off = PromptTokenizer.from_dir(tiny_dir, cache_bytes=0)
    off.encode_prompt("some text " * 500)
    assert off.cache_stats()["entries"] == 0


# --- registry and the shipped helper ---


def test_registry_returns_none_for_unknown_models(tiny_dir: Path) -> None:
    registry = TokenizerRegistry({"a": tiny_dir, "b": str(tiny_dir)})
    assert registry.models() == ["a", "b"]
    assert isinstance(registry.get("a"), PromptTokenizer)
    assert registry.get("unknown") is None
    assert TokenizerRegistry({}).models() == []


def test_build_tiny_tokenizer_is_deterministic(tmp_path: Path) -> None:
    a, b = build_tiny_tokenizer(tmp_path / "a"), build_tiny_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    c = build_tiny_tokenizer(tmp_path / "c", vocab_size=300, seed=1)
    assert Tokenizer.from_file(str(c / "tokenizer.json")).get_vocab_size() == 300


def test_a_tail_that_loses_tokens_alone_is_caught_on_insert() -> None:
    """The tail's ids alone may be a strict prefix of its ids in context: the cut before it is unstable."""

    def encode(text: str) -> list[int]:
        return [ord(c) for c in text] + ([0] if text.startswith("a") and text.endswith("!") else [])

    cache = PrefixCache(encode, lambda ts: [encode(t) for t in ts], Chunker(2), max_bytes=1 << 20)
    assert cache.encode("ab cd!").tolist() == encode("ab cd!")
    assert cache.stats()["entries"] == 0 and cache.stats()["unstable"] == 1


def test_the_index_service_renders_chat_requests_with_their_options(tiny_dir: Path) -> None:
    """A chat request's tools and rendering flags reach the chat template, as they reach the engine's:
    otherwise a tool-calling request's first block differs from what the engine cached."""
    service = KvIndexService(
        BlockIndex(block_size=16, max_entries=1000),
        FreshnessTracker(),
        TokenizerRegistry({"m": tiny_dir}),
        block_size=16,
    )
    tok = service.tokenizers.get("m")
    assert tok is not None
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
    ]
    chat = ChatOptions(add_generation_prompt=False, tools=[TOOL])
    request = InferenceRequest("r", ApiKind.CHAT_COMPLETIONS, "m", messages=messages, chat=chat)
    expected = list(tok.encode_chat(messages, add_generation_prompt=False, tools=[TOOL]))
    got = service.prompt_tokens(request)
    assert got is not None and list(got) == expected
    plain = service.prompt_tokens(InferenceRequest("r", ApiKind.CHAT_COMPLETIONS, "m", messages=messages))
    assert plain is not None and list(plain) == list(tok.encode_chat(messages)) != expected


def test_prompts_over_the_keying_limit_are_not_tokenized(tiny_dir: Path) -> None:
    """Tokenizing runs on the event loop (about a second per MB): a text or chat prompt longer than
    `max_keyed_prompt_chars` gets no keys (no cache credit) and counts as unkeyed, `too_long`; token ids
    are keyed whatever their length."""
    service = KvIndexService(
        BlockIndex(block_size=16, max_entries=1000),
        FreshnessTracker(),
        TokenizerRegistry({"m": tiny_dir}),
        block_size=16,
        max_keyed_prompt_chars=1000,
    )
    short = InferenceRequest("r", ApiKind.COMPLETIONS, "m", prompt="word " * 100)
    assert service.prompt_tokens(short) is not None
    long = InferenceRequest("r", ApiKind.COMPLETIONS, "m", prompt="word " * 201)
    assert service.prompt_tokens(long) is None
    chat = InferenceRequest(
        "r",
        ApiKind.CHAT_COMPLETIONS,
        "m",
        messages=[{"role": "user", "content": "x"}],
        prompt_tokens_estimate=251,
    )
    assert service.prompt_tokens(chat) is None
    tools = [{"type": "function", "function": {"name": "f", "description": "x" * 2000}}]
    bulky = InferenceRequest(  # short messages, megabytes of tools: the body's size counts
        "r", ApiKind.CHAT_COMPLETIONS, "m", messages=[{"role": "user", "content": "x"}],
        chat=ChatOptions(tools=tools), body_bytes=2100, prompt_tokens_estimate=1,
    )  # fmt: skip
    assert service.prompt_tokens(bulky) is None
    ids = InferenceRequest("r", ApiKind.COMPLETIONS, "m", prompt=list(range(5000)))
    assert service.prompt_tokens(ids) is not None
    assert service.unkeyed[("m", "too_long")] == 3
