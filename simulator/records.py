"""What a simulated engine is given (`SimRequest`) and what it records per request (`RequestRecord`). Pure."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numba
import numpy as np
import numpy.typing as npt

TokenIds = Sequence[int] | npt.NDArray[np.integer]


@dataclass(frozen=True, slots=True, eq=False)
class SimRequest:
    """One request as an engine receives it (already tokenised).

    `output_token_ids`: the tokens the engine "generates" (at least `max_tokens - 1` of them are
    used: the last generated token is never fed back, so its KV is never computed). Give them when
    a later prompt should contain this answer (multi-turn chats); by default they are deterministic
    pseudo-random ids derived from `request_id`. `context`: anything the caller wants back in the
    callbacks (through `RequestRecord.request`).
    """

    request_id: str
    prompt_token_ids: TokenIds
    max_tokens: int = 1
    cache_salt: str | None = None
    lora_name: str | None = None
    output_token_ids: TokenIds | None = None
    context: Any = None


@dataclass(slots=True, eq=False)
class RequestRecord:
    """Times are kernel seconds; None until the event happened."""

    request: SimRequest
    prompt_tokens: int
    arrival_s: float
    scheduled_s: float | None = None  # first scheduled (its first prefill chunk)
    first_token_s: float | None = None
    finished_s: float | None = None
    cached_tokens: int = 0  # GPU prefix-cache hit when first scheduled (what vllm:prefix_cache_hits adds)
    cpu_loaded_tokens: int = 0  # loaded from the CPU tier instead of recomputed, when first scheduled
    output_tokens: int = 0
    preemptions: int = 0
    aborted_s: float | None = None  # `Engine.abort`: when its client went away (it never finishes)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def max_tokens(self) -> int:
        return self.request.max_tokens

    @property
    def reported_cached_tokens(self) -> int:
        """What vLLM reports as `usage.prompt_tokens_details.cached_tokens`: tokens not computed,
        from the GPU prefix cache or loaded by the KV connector (the CPU tier)."""
        return self.cached_tokens + self.cpu_loaded_tokens

    @property
    def queue_s(self) -> float | None:
        return None if self.scheduled_s is None else self.scheduled_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; 0.0 for a single-token answer."""
        if self.finished_s is None or self.first_token_s is None:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.finished_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s


RequestCallback = Callable[[RequestRecord, float], object]
"""(the request's record, kernel time)."""

_OUT_MUL_INT = 0x9E3779B97F4A7C15
_OUT_SHIFT = 47  # pseudo output ids in [0, 2^17)


def output_tokens(request: SimRequest, k: int) -> npt.NDArray[np.int64]:
    """The first `k` tokens the engine generates for `request`: its `output_token_ids`, or deterministic
    pseudo-random ids from a hash of its `request_id` (the same id always answers the same)."""
    if request.output_token_ids is not None:
        out = as_token_array(request.output_token_ids, "output token ids")
        if len(out) < k:
            raise ValueError(
                f"request {request.request_id!r}: {len(out)} output token ids for max_tokens "
                f"{request.max_tokens} (at least {k} needed)"
            )
        return out[:k]
    digest = hashlib.blake2b(request.request_id.encode(), digest_size=8).digest()
    out = np.empty(max(k, 0), dtype=np.int64)
    _pseudo_ids(np.uint64(int.from_bytes(digest, "little")), out)
    return out


def fed_tokens(request: SimRequest, prompt: npt.NDArray[np.int64], k: int) -> npt.NDArray[np.int64]:
    """The prompt followed by the first `k` generated tokens (`output_tokens`): what the engine computes
    KV for. The prompt itself when k is 0; with pseudo-random outputs, one compiled pass."""
    if k <= 0:
        return prompt
    if request.output_token_ids is not None:
        return np.concatenate((prompt, output_tokens(request, k)))
    digest = hashlib.blake2b(request.request_id.encode(), digest_size=8).digest()
    out = np.empty(len(prompt) + k, dtype=np.int64)
    _prompt_and_pseudo_ids(prompt, np.uint64(int.from_bytes(digest, "little")), out)
    return out


@numba.njit(cache=True, nogil=True)
def _prompt_and_pseudo_ids(prompt: Any, seed: Any, out: Any) -> None:  # pragma: no cover - compiled
    n = prompt.shape[0]
    out[:n] = prompt
    _pseudo_ids(seed, out[n:])


@numba.njit(cache=True, nogil=True)
def _pseudo_ids(seed: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out[j] = ((j + 1) * _OUT_MUL_INT + seed) >> 47 (mod 2^64): ids in [0, 2^17)."""
    for j in range(out.shape[0]):
        out[j] = np.int64(
            (numba.uint64(j + 1) * numba.uint64(_OUT_MUL_INT) + seed) >> numba.uint64(_OUT_SHIFT)
        )


@numba.njit(cache=True, nogil=True)
def _has_negative(ids: Any) -> bool:  # pragma: no cover - compiled
    for j in range(ids.shape[0]):  # noqa: SIM110 (numba compiles no generator inside any())
        if ids[j] < 0:
            return True
    return False


def warm_up() -> None:
    """Compile (or load the cached machine code of) the loops now."""
    _pseudo_ids(np.uint64(1), np.empty(1, dtype=np.int64))
    _prompt_and_pseudo_ids(np.zeros(1, dtype=np.int64), np.uint64(1), np.empty(2, dtype=np.int64))
    _has_negative(np.zeros(1, dtype=np.int64))


def as_token_array(token_ids: TokenIds, what: str = "token ids") -> npt.NDArray[np.int64]:
    """Token ids as an int64 array; ValueError for non-integers or negative ids."""
    if type(token_ids) is np.ndarray and token_ids.dtype == np.int64 and token_ids.ndim == 1:
        if _has_negative(token_ids):
            raise ValueError(f"{what} must be >= 0")
        return cast("npt.NDArray[np.int64]", token_ids)
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of integers")
    if arr.dtype.kind not in "iu":
        if arr.size:
            raise ValueError(f"{what} must be integers, got {arr.dtype}")
        arr = arr.astype(np.int64)
    if arr.dtype != np.int64:
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise ValueError(f"{what} out of range")
        arr = arr.astype(np.int64)
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{what} must be >= 0")
    return arr
