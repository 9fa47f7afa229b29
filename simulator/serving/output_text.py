"""What the simulated engine "generates": its output token ids and their text.

The engine model needs the ids of its output tokens up front (they are hashed into its KV blocks as
they are decoded). They are a deterministic function of the prompt and the cache salt, like greedy
decoding: the same prompt always answers the same.

- With a tokenizer: the ids are the tokenization of a slice of deterministic pseudo-text
  (`epp.testing.tokenizer.generated_text`), starting at a word, so decoding them and tokenizing the
  text again gives the same ids, as with a real model's answers. A multi-turn conversation that sends
  the answer back therefore hits the engine's cached answer blocks as it would on vLLM. The text is
  the tokenizer's decoding (incrementally, with `tokenizers.decoders.DecodeStream`, when streamed).
- Without one: pseudo-random ids, and a placeholder word per token (`WORDS[id % len(WORDS)]`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from epp.kvindex.prompt import PromptTokenizer, TokenizerError
from epp.testing.tokenizer import generated_text

WORDS = (
    "lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do",
    "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore", "magna", "aliqua", "enim",
    "ad", "minim", "veniam", "quis", "nostrud", "exercitation", "ullamco", "laboris", "nisi", "aliquip",
)  # fmt: skip
_SOURCE_CHARS = 64 * 1024
_PLACEHOLDER_BASE = 1000  # placeholder ids fall in [1000, 1000 + 2^15)


def _digest(prompt_ids: npt.NDArray[np.int64], cache_salt: str | None) -> int:
    h = hashlib.blake2b(digest_size=8, person=b"epp-sim-output")
    h.update(np.ascontiguousarray(prompt_ids, dtype=np.int64).tobytes())
    h.update((cache_salt or "").encode())
    return int.from_bytes(h.digest(), "little")


class OutputText:
    """Output ids and text for one served model. `from_dir` loads a tokenizer; `OutputText()` has none."""

    def __init__(
        self, prompt_tokenizer: PromptTokenizer | None = None, decoder: Tokenizer | None = None
    ) -> None:
        if (prompt_tokenizer is None) != (decoder is None):
            raise ValueError("give both the prompt tokenizer and its decoding tokenizer, or neither")
        self.prompt_tokenizer = prompt_tokenizer
        self.decoder = decoder
        self.vocab_size: int | None = None
        self._source = ""
        self._starts: list[int] = []
        if decoder is not None:
            self.vocab_size = decoder.get_vocab_size(with_added_tokens=True)
            self._source = generated_text(_SOURCE_CHARS, seed=11)
            text = self._source
            self._starts = [i + 1 for i, c in enumerate(text) if c == " " and text[i + 1 : i + 2].isalpha()]
            if not self._starts:
                self._starts = [0]

    @classmethod
    def from_dir(cls, path: str | Path, name: str | None = None) -> OutputText:
        """Load a Hugging Face tokenizer directory (TokenizerError when it is unusable); `name` labels
        its errors (default: the path)."""
        prompt = PromptTokenizer.from_dir(path, name=name)
        try:
            decoder = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        except Exception as err:  # the Rust side raises plain Exception
            raise TokenizerError(f"{path}: cannot load tokenizer.json: {err}") from err
        return cls(prompt, decoder)

    def output_ids(
        self, prompt_ids: npt.NDArray[np.int64], cache_salt: str | None, count: int
    ) -> npt.NDArray[np.int64]:
        """The `count` tokens the engine generates for this prompt (the same prompt, the same ids)."""
        seed = _digest(prompt_ids, cache_salt)
        if self.decoder is None:
            x = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
            return (x >> np.uint64(49)).astype(np.int64) + _PLACEHOLDER_BASE
        src, starts = self._source, self._starts
        at = starts[seed % len(starts)]
        ids: list[int] = []
        span = max(64, 6 * count)
        while len(ids) < count:  # every character yields at least one token, so this ends
            piece = (
                src[at : at + span] if at + span <= len(src) else src[at:] + " " + src[: at + span - len(src)]
            )
            ids.extend(self.decoder.encode(piece.strip(), add_special_tokens=False).ids)
            at = starts[(seed + len(ids)) % len(starts)]
        return np.asarray(ids[:count], dtype=np.int64)

    def text(self, ids: npt.NDArray[np.int64]) -> str:
        if self.decoder is None:
            return "".join(self.pieces(ids))
        return self.decoder.decode(ids.tolist(), skip_special_tokens=True)

    def pieces(self, ids: npt.NDArray[np.int64]) -> Iterator[str]:
        """The text each token adds, in order (a token completing nothing yet adds "")."""
        if self.decoder is None:
            for i, t in enumerate(ids.tolist()):
                word = WORDS[t % len(WORDS)]
                yield f" {word}" if i else word
            return
        stream = DecodeStream(skip_special_tokens=True)
        for t in ids.tolist():
            yield stream.step(self.decoder, t) or ""
