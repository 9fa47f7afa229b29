"""Event data in the forms the block index queues and flushes (`index.py`). Pure.

Token ids are queued as int64 bytes: `struct` packs a tuple of Python ints at about 5 ns a token, three
times faster than numpy reads them, and a flush joins the queue into one array without another pass.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence
from typing import Final, cast

import numpy as np
import numpy.typing as npt

from epp.kvindex.keys import MASK64

StoreTokens = Sequence[int] | npt.NDArray[np.integer]
"""Token ids as an event gives them: Python ints, or an integer array (the compiled scan's)."""

_I64: Final = np.dtype(np.int64)
_U64: Final = np.dtype(np.uint64)
_STRUCT_CACHE: Final = 1024
_STRUCTS: dict[int, struct.Struct] = {}  # token count -> its packer


def pack_tokens(
    tokens: Sequence[int] | npt.NDArray[np.integer], n: int
) -> bytes | npt.NDArray[np.integer] | None:
    """Token ids for the queue: a list or tuple of ints as int64 bytes (struct packs them at about 5 ns a
    token, 3x faster than numpy reads Python ints), an integer array as it is; None when they are not
    integers. Ids outside int64 (a uint64 array or ints up to 2^64) are taken modulo 2^64, as by `keys`."""
    if isinstance(tokens, np.ndarray):
        return tokens if tokens.dtype.kind in "iu" else None
    fmt = _STRUCTS.get(n)
    if fmt is None:
        if len(_STRUCTS) >= _STRUCT_CACHE:
            _STRUCTS.clear()
        fmt = _STRUCTS[n] = struct.Struct(f"<{n}q")
    try:
        return fmt.pack(*tokens)
    except struct.error:
        pass
    try:
        return np.array([t & MASK64 for t in tokens], dtype=np.uint64)
    except TypeError:
        return None


def flat_tokens(tokens: list[bytes | npt.NDArray[np.integer]]) -> npt.NDArray[np.int64]:
    """The queued token ids as one int64 array (wrapping uint64 ids: the keys take them modulo 2^64). When
    every array is of native 64-bit integers (the compiled scan's), the pieces are joined as they are:
    one copy, no array per piece."""
    for t in tokens:
        if not isinstance(t, bytes) and t.dtype is not _I64 and t.dtype is not _U64:
            break
    else:
        with contextlib.suppress(TypeError):  # (an array that is not contiguous exports no plain buffer)
            return np.frombuffer(b"".join(cast(list[bytes], tokens)), dtype=np.int64)  # (arrays: as buffers)
    return np.concatenate(
        [
            np.frombuffer(t, dtype=np.int64) if isinstance(t, bytes) else t.astype(np.int64, copy=False)
            for t in tokens
        ]
    )


def as_u64(values: Sequence[int]) -> npt.NDArray[np.uint64]:
    try:
        return np.array(values, dtype=np.uint64)
    except OverflowError:  # signed (SGLang) or oversized hashes that bypassed the decoder
        return np.array([v & MASK64 for v in values], dtype=np.uint64)


def unsigned(hashes: Sequence[int]) -> Sequence[int]:
    """Engine hashes as unsigned 64-bit ints, a signed one (as SGLang sends them) taken modulo 2^64: the
    queue's sets and maps key hashes by value, so one hash in two forms would be two blocks. As given when
    none is negative (what the decoders give: one C-level `min`)."""
    if len(hashes) == 0 or min(hashes) >= 0:
        return hashes
    return [h & MASK64 for h in hashes]


def unsigned_parent(parent: int | None) -> int | None:
    return parent & MASK64 if parent is not None and parent < 0 else parent
