"""Which cuts of a text are stable for a given `tokenizers` pipeline. Pure (inspects a parsed tokenizer.json).

A cut at position b is *stable* when `ids(text) == ids(text[:b]) + ids(text[b:])` for every text with
that cut, whatever follows (`prefix_cache.py` relies on it to reuse a prefix's ids). Two kinds:

- Before a special (added) token matched on the raw text (`normalized: false`, no `lstrip`, not
  `single_word`): stable for every pipeline, because added tokens are split out first and each piece
  between them is normalized, pre-tokenized and modelled on its own. (Off with `split_special_tokens`.)
- Before a space that follows a letter or digit: stable when
  - the normalizer works per character: none, NFC/NFD/NFKC/NFKD, Lowercase, StripAccents, BERT (none of
    them joins a letter or digit with a following space, or maps them to spaces);
  - the pre-tokenizer always splits there and looks no further back than the piece it is in: the GPT-2
    byte-level regex, a `Split` regex with `Isolated`/`Removed` behaviour and no look-behind (Llama 3,
    GPT-4o, Qwen, DeepSeek patterns: a match may start with a space but never continues from a letter
    or digit into one), and the BERT, whitespace, punctuation, digits and metaspace splitters
    (`add_prefix_space` is harmless: the piece after the cut already starts with a space);
  - the model works per pre-token: BPE without dropout, WordPiece, WordLevel, Unigram;
  - no added token has a space after its first character (it could straddle the cut), and an added
    token with `rstrip` (which eats the spaces after it) is never right before the cut.

Both kinds are then tried on probe texts (cut at every candidate, pieces encoded alone must give the
same ids as the whole); a disagreement turns that kind off. `prefix_cache.py` verifies each new cached
chunk once more on insert.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from epp.kvindex.prefix_cache import Chunker

_PER_CHAR_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents", "BertNormalizer"}
_SPLITTERS = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer", "Punctuation", "Digits"}
_PER_PIECE_MODELS = {"WordPiece", "WordLevel", "Unigram"}
PROBES = (
    "Hello world, this is a test.  Two  spaces\tand tabs\n\nnew lines\r\n  indented line x",
    "numbers 12345 67890 3.14 1,000,000 x2 2x a1 b22 c333 d4444",
    "punctuation!!! ... ?! (parens) [brackets] {braces} \"quotes\" 'single' it's they're we'll I'd",
    "unicode: café naïve résumé 中文 字符 日本語 한국어 ñandú Ωmega ﬁx ½ ² Σ ΣΑΣ ΣΑΣ x",
    "emoji 😀 👍🏽 a🚀 🚀🚀 family 👨‍👩‍👧 flag 🇫🇷 end",
    "def f(x):\n    return x  # comment\n\tif a==b: pass\nUPPER lower MiXeD CamelCase snake_case kebab-case",
    "trailing space \n and \u00a0nbsp\u3000ideographic a\u0301 combining e\u0308x",
)


def normalizer_per_char(spec: Any) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(normalizer_per_char(s) for s in spec.get("normalizers", []))
    return kind in _PER_CHAR_NORMALIZERS


def pre_tokenizer_splits_before_space(spec: Any) -> bool:
    """True if the pre-tokenizer always splits before a space that follows a letter or digit."""

    def walk(s: Any) -> tuple[bool, bool]:  # (allowed, splits)
        kind = s.get("type")
        if kind == "Sequence":
            results = [walk(p) for p in s.get("pretokenizers", [])]
            return all(a for a, _ in results), any(p for _, p in results)
        if kind == "ByteLevel":
            return True, bool(s.get("use_regex", True))
        if kind == "Metaspace":
            return True, bool(s.get("split", True))
        if kind == "Split":
            pattern = s.get("pattern", {})
            regex = pattern.get("Regex", pattern.get("String", ""))
            ok = s.get("behavior") in ("Isolated", "Removed") and not s.get("invert") and "(?<" not in regex
            return ok, ok
        return kind in _SPLITTERS, kind in _SPLITTERS

    if spec is None:
        return False
    allowed, splits = walk(spec)
    return allowed and splits


def model_per_piece(spec: Any) -> bool:
    kind = spec.get("type")
    if kind == "BPE":
        return not spec.get("dropout")
    return kind in _PER_PIECE_MODELS


def _encode(tok: Tokenizer, text: str) -> list[int]:
    ids: list[int] = tok.encode(text, add_special_tokens=False).ids
    return ids


def special_affixes(tok: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids `add_special_tokens=True` puts before and after the body, if that is all it does."""
    probe = "hello world 123"
    body, full = _encode(tok, probe), tok.encode(probe).ids
    for i in range(len(full) - len(body) + 1):
        if full[i : i + len(body)] == body:
            prefix, suffix = full[:i], full[i + len(body) :]
            break
    else:
        return None
    for text in ("", *PROBES):
        if tok.encode(text).ids != prefix + _encode(tok, text) + suffix:
            return None
    return prefix, suffix


def probes_agree(tok: Tokenizer, chunker: Chunker, added: Sequence[str] = ()) -> bool:
    """Cut the probe texts at every candidate: the pieces encoded alone must agree with the whole."""
    probe = Chunker(
        1,
        split_before_space=chunker.split_before_space,
        special_tokens=chunker.special_tokens,
        rstrip_tokens=chunker.rstrip_tokens,
    )
    texts = list(PROBES)
    for t in added[:16]:
        texts.append(f"a{t}b {t} c{t} {t}{t}  d{t}\n{t}x y {t}, z{t}")
    for text in texts:
        edges = [0, *probe.boundaries(text), len(text)]
        pieces = [_encode(tok, text[a:b]) for a, b in itertools.pairwise(edges)]
        if [i for piece in pieces for i in piece] != _encode(tok, text):
            return False
    return True


def stable_chunker(tok: Tokenizer, spec: Mapping[str, Any], chunk_chars: int) -> tuple[Chunker, list[str]]:
    """The chunker for this pipeline, and notes on the kinds of cut turned off (and why)."""
    added = [t for t in spec.get("added_tokens") or [] if isinstance(t.get("content"), str)]
    contents = [t["content"] for t in added]
    split_out = not tok.encode_special_tokens
    specials = [
        t["content"]
        for t in added
        if split_out and not (t.get("normalized") or t.get("lstrip") or t.get("single_word"))
    ]
    rstrip = [t["content"] for t in added if t.get("rstrip")]
    notes: list[str] = []
    reasons = []
    if not normalizer_per_char(spec.get("normalizer")):
        reasons.append("the normalizer is not per-character")
    if not pre_tokenizer_splits_before_space(spec.get("pre_tokenizer")):
        reasons.append("the pre-tokenizer does not always split before a space")
    if not model_per_piece(spec.get("model") or {}):
        reasons.append("the model is not per-piece")
    if any(" " in c[1:] for c in contents):
        reasons.append("an added token contains a space")
    if reasons:
        notes.append("no space cuts: " + "; ".join(reasons))
    spaces = not reasons and probes_agree(tok, Chunker(1, rstrip_tokens=rstrip), contents)
    if not reasons and not spaces:
        notes.append("no space cuts: the probe texts disagree")
    if specials and not probes_agree(
        tok, Chunker(1, split_before_space=False, special_tokens=specials), contents
    ):
        notes.append("no special-token cuts: the probe texts disagree")
        specials = []
    chunker = Chunker(chunk_chars, split_before_space=spaces, special_tokens=specials, rstrip_tokens=rstrip)
    if spaces and specials and not probes_agree(tok, chunker, contents):
        notes.append("no space cuts: the probe texts disagree when cut at special tokens too")
        chunker = Chunker(chunk_chars, split_before_space=False, special_tokens=specials)
    if not chunker.enabled:
        notes.append("prefix cache off: every prompt is tokenized whole")
    return chunker, notes
