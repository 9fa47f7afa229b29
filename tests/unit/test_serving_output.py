"""The simulated engine's output: deterministic ids per prompt, in the vocabulary, text that re-tokenizes
to the same ids, and stream pieces that add up to the text."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from epp.kvindex.prompt import TokenizerError
from epp.testing.tokenizer import SPECIAL_TOKENS, build_tiny_tokenizer
from simulator.serving.output_text import WORDS, OutputText


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> OutputText:
    return OutputText.from_dir(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


PROMPTS = [np.arange(40, dtype=np.int64), np.arange(3, 90, 7, dtype=np.int64), np.array([9], dtype=np.int64)]


@pytest.mark.parametrize("count", [1, 2, 17, 300])
def test_ids_are_deterministic_in_vocabulary_and_round_trip(text: OutputText, count: int) -> None:
    assert text.decoder is not None and text.vocab_size == 512
    for prompt in PROMPTS:
        ids = text.output_ids(prompt, None, count)
        assert ids.dtype == np.int64 and len(ids) == count
        assert ids.tolist() == text.output_ids(prompt.copy(), None, count).tolist()
        assert ids.min() >= len(SPECIAL_TOKENS) and ids.max() < 512  # ordinary tokens only
        decoded = text.text(ids)
        assert "".join(text.pieces(ids)) == decoded
        # Like a real model's answer, the text tokenizes back to the same ids (all but the last one,
        # which may be cut mid-word and is never fed back to the engine anyway).
        again = text.decoder.encode(decoded, add_special_tokens=False).ids
        assert again[: count - 1] == ids.tolist()[: count - 1]


def test_the_salt_and_the_prompt_change_the_answer(text: OutputText) -> None:
    base = text.output_ids(PROMPTS[0], None, 32).tolist()
    assert text.output_ids(PROMPTS[0], "tenant-a", 32).tolist() != base
    assert text.output_ids(PROMPTS[1], None, 32).tolist() != base


def test_without_a_tokenizer_placeholder_words() -> None:
    plain = OutputText()
    assert plain.vocab_size is None and plain.prompt_tokenizer is None
    ids = plain.output_ids(PROMPTS[0], None, 5)
    assert ids.tolist() == plain.output_ids(PROMPTS[0], None, 5).tolist()
    pieces = list(plain.pieces(ids))
    assert pieces == [("" if i == 0 else " ") + WORDS[t % len(WORDS)] for i, t in enumerate(ids.tolist())]
    assert plain.text(ids) == "".join(pieces)


def test_a_bad_tokenizer_directory_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        OutputText.from_dir(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        OutputText.from_dir(tmp_path)
