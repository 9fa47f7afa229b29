"""A text cut into very many chunks (every special token starts one) caches at most `MAX_NEW_CHUNKS` new
chunks per call: one request cannot fill the prefix cache or tokenize thousands of pieces one by one, and
the ids stay those of the whole text."""

from __future__ import annotations

from epp.kvindex.prefix_cache import MAX_NEW_CHUNKS, Chunker, PrefixCache

SPECIAL = "<|eot_id|>"


def encode(text: str) -> list[int]:
    """Character ids, a special token as one id: a tokenizer whose cuts before special tokens always hold."""
    out: list[int] = []
    i = 0
    while i < len(text):
        if text.startswith(SPECIAL, i):
            out.append(0)
            i += len(SPECIAL)
        else:
            out.append(ord(text[i]))
            i += 1
    return out


def test_a_prompt_of_special_tokens_caches_a_bounded_number_of_chunks_per_call() -> None:
    pieces: list[int] = []  # how many pieces each encode_many call tokenized alone
    cache = PrefixCache(
        encode,
        lambda texts: pieces.append(len(texts)) or [encode(t) for t in texts],  # type: ignore[func-returns-value]
        Chunker(1024, special_tokens=[SPECIAL]),
        max_bytes=64 << 20,
    )
    text = "x" + SPECIAL * 5000  # 5,000 cuts
    assert cache.encode(text).tolist() == encode(text)
    assert cache.stats()["entries"] == MAX_NEW_CHUNKS and pieces == [MAX_NEW_CHUNKS + 1]
    # The next call of the same text starts after the cached chunks and caches as many again.
    assert cache.encode(text).tolist() == encode(text)
    assert cache.stats()["hits"] == MAX_NEW_CHUNKS
    assert cache.stats()["entries"] == 2 * MAX_NEW_CHUNKS and pieces[1] == MAX_NEW_CHUNKS + 1
