"""Token ids of long shared text prefixes, cached by exact text and verified once. Pure.

A text is cut into chunks at *stable boundaries*: places where the tokenizer's pipeline always splits,
whatever comes after (which boundaries are stable for which pipelines: `prompt.py`). Two kinds:

- before a space that follows a letter or digit, the first such place at least `chunk_chars` after
  the chunk's start (byte-level / GPT-style regexes, BERT and whitespace pre-tokenizers never merge a
  letter or digit with a following space, and never look behind);
- before an added (special) token: added tokens are split out before anything else runs.

The cut depends only on the text up to the boundary, so a shared prefix is cut the same way in every
request. The cache is a trie stored in an LRU map: key `(parent node, chunk text)` -> (node, ids of the
chunk). A lookup walks from the root comparing whole chunk texts (dict equality, no hash trust), so a
hit means the whole prefix text is equal. Only the rest (after the last cached chunk) is tokenized, in
one call, exactly as the full text would be. New chunks of that rest (and its tail) are then tokenized
alone too, and a chunk is inserted only if its ids and those of the piece after it equal the ids of the
rest (in one go) at the same places, i.e. its end cut held for this text (checked once, on insert); from
the first disagreement on, nothing is cached (`unstable` counts those chunks).

At most `MAX_NEW_CHUNKS` new chunks are cached per call (the first ones after the cached prefix): a text
cut into very many chunks (a prompt of nothing but special tokens is one chunk per token) would otherwise
tokenize each piece alone and fill the cache with them in one request; the next call with the same
prefix goes on from there, so long shared prefixes still warm up.

Eviction drops the least recently used entries first; a path is touched leaf-first so that shared
roots outlive their leaves. Entries whose parent was evicted can no longer be reached and age out.
Not thread-safe: one owner (the event loop) calls it.
"""

from __future__ import annotations

import itertools
import re
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

TOKEN_DTYPE = np.int32
TokenIds = npt.NDArray[np.int32]
# What an entry costs beyond its chunk text and its id array (both counted with `sys.getsizeof`): the
# key tuple, the `_Entry`, its two ints (node id, size) and the OrderedDict's slot and link: 283 bytes
# measured with tracemalloc on CPython 3.11, ~370 once evictions leave deleted slots in the dict's
# table; plus malloc's headers for the text, the array's data and its shape, which tracemalloc does
# not see. The bound is on this estimate, so it must not undercount: with the ndarray header left
# out and 256 here, a full "64 MiB" cache held ~75 MB (tests/unit/test_prefix_cache_memory.py).
_ENTRY_OVERHEAD = 400
_SPACE_BOUNDARY = re.compile(r"(?<=[^\W_]) ")
MAX_NEW_CHUNKS = 512
"""New chunks one `encode` caches at most: 512 KiB of prose at the default 1,024-character chunks (the
keying limit, `index.maxKeyedPromptChars`, is 512 KiB)."""


class Chunker:
    """Where a text may be cut: `boundaries(text, start)` lists the stable cuts after `start`."""

    def __init__(
        self,
        chunk_chars: int = 1024,
        *,
        split_before_space: bool = True,
        special_tokens: Sequence[str] = (),
        rstrip_tokens: Sequence[str] = (),
    ) -> None:
        if chunk_chars < 1:
            raise ValueError("chunk_chars must be >= 1")
        self.chunk_chars = chunk_chars
        self.split_before_space = split_before_space
        self.special_tokens = tuple(sorted(set(filter(None, special_tokens)), key=lambda t: (-len(t), t)))
        self.rstrip_tokens = tuple(t for t in rstrip_tokens if t)
        pattern = "|".join(map(re.escape, self.special_tokens))
        self._special = re.compile(pattern) if pattern else None

    @property
    def enabled(self) -> bool:
        return self.split_before_space or self._special is not None

    def boundaries(self, text: str, start: int = 0) -> list[int]:
        """Every cut after `start`, in order (exclusive of `start` and of `len(text)`)."""
        out: list[int] = []
        n = len(text)
        pos = start
        no_space_from = n + 1  # a failed space search from x means none at or after x
        while pos < n:
            cut = n
            target = pos + self.chunk_chars
            if self.split_before_space and target < no_space_from:
                cut = self._space_boundary(text, target)
                if cut == n:
                    no_space_from = target
            if self._special is not None:
                m = self._special.search(text, pos + 1, cut)
                if m is not None:
                    cut = m.start()
            if cut >= n:
                break
            out.append(cut)
            pos = cut
        return out

    def _space_boundary(self, text: str, target: int) -> int:
        while True:
            m = _SPACE_BOUNDARY.search(text, target)
            if m is None:
                return len(text)
            cut = m.start()
            if not any(text.endswith(t, 0, cut) for t in self.rstrip_tokens):
                return cut
            target = cut + 1


def entry_bytes(chunk: str, ids: TokenIds) -> int:
    """What one cached chunk costs in memory, as the bound counts it (an estimate that errs high)."""
    return sys.getsizeof(chunk) + sys.getsizeof(ids) + _ENTRY_OVERHEAD


class _Entry:
    __slots__ = ("ids", "nbytes", "node")

    def __init__(self, node: int, ids: TokenIds, nbytes: int) -> None:
        self.node = node
        self.ids = ids
        self.nbytes = nbytes


class PrefixCache:
    """`encode(text)` == `encode_one(text)`, paying only for the part after the longest cached prefix."""

    def __init__(
        self,
        encode_one: Callable[[str], list[int]],
        encode_many: Callable[[list[str]], list[list[int]]],
        chunker: Chunker,
        *,
        max_bytes: int,
    ) -> None:
        self._encode_one = encode_one
        self._encode_many = encode_many
        self.chunker = chunker
        self.max_bytes = max(0, max_bytes)
        self._store: OrderedDict[tuple[int, str], _Entry] = OrderedDict()
        self._ids = itertools.count(1)  # node 0 is the root; ids are never reused
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.unstable = 0
        self.tokenized_chars = 0

    @property
    def caching(self) -> bool:
        return self.max_bytes > 0 and self.chunker.enabled

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "bytes": self.bytes,
            "entries": len(self._store),
            "evictions": self.evictions,
            "unstable": self.unstable,
            "tokenized_chars": self.tokenized_chars,
        }

    def clear(self) -> None:
        self._store.clear()
        self.bytes = 0

    def encode(self, text: str) -> TokenIds:
        if not self.caching:
            self.tokenized_chars += len(text)
            return np.asarray(self._encode_one(text), dtype=TOKEN_DTYPE)
        cuts = self.chunker.boundaries(text)
        store = self._store
        node, pos = 0, 0
        path: list[tuple[int, str]] = []
        found: list[TokenIds] = []
        for cut in cuts:
            key = (node, text[pos:cut])
            entry = store.get(key)
            if entry is None:
                break
            path.append(key)
            found.append(entry.ids)
            node, pos = entry.node, cut
        self.hits += len(found)
        rest = text[pos:]
        ids = self._encode_one(rest)
        self.tokenized_chars += len(rest)
        new_cuts = [c for c in cuts if c > pos][:MAX_NEW_CHUNKS]
        if new_cuts:
            self._insert(text, pos, new_cuts, ids, node, path)
        for key in reversed(path):
            store.move_to_end(key)
        self._evict()
        found.append(np.asarray(ids, dtype=TOKEN_DTYPE))
        return found[0] if len(found) == 1 else np.concatenate(found)

    def _insert(
        self, text: str, pos: int, cuts: list[int], ids: list[int], node: int, path: list[tuple[int, str]]
    ) -> None:
        """Tokenize each new chunk (and the tail) alone; cache the chunks whose end is verified.

        A chunk's end cut is verified when the ids of the chunk and of the piece after it, each tokenized
        alone, equal the ids of the whole rest (tokenized in one go) at the same places.
        """
        edges = [pos, *cuts, len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(edges)]
        parts = self._encode_many(pieces)
        self.tokenized_chars += len(text) - pos
        self.misses += len(cuts)
        agree, offset = 0, 0
        for piece_ids in parts:
            end = offset + len(piece_ids)
            if ids[offset:end] != piece_ids:
                break
            agree, offset = agree + 1, end
        if agree == len(parts) and offset != len(ids):  # the tail alone is a strict prefix of its ids
            agree -= 1
        cacheable = min(len(cuts), max(0, agree - 1))
        self.unstable += len(cuts) - cacheable
        store = self._store
        for chunk, piece_ids in zip(pieces[:cacheable], parts[:cacheable], strict=True):
            key = (node, chunk)
            entry = store.get(key)
            if entry is None:
                arr = np.asarray(piece_ids, dtype=TOKEN_DTYPE)
                entry = _Entry(next(self._ids), arr, entry_bytes(chunk, arr))
                store[key] = entry
                self.bytes += entry.nbytes
            node = entry.node
            path.append(key)

    def _evict(self) -> None:
        store = self._store
        while self.bytes > self.max_bytes and store:
            _, entry = store.popitem(last=False)
            self.bytes -= entry.nbytes
            self.evictions += 1
