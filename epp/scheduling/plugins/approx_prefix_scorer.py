"""`prefix-cache-scorer`: the reference EPP's *approximate* prefix affinity, from routing history only.

The prompt is cut into blocks of `blockSizeChars` characters (64) of its text — for chat
requests, of the JSON of its messages — at most `maxPrefixBlocks` (256) of them, each hashed with
xxhash64 chained from the previous block's hash, the first seeded with the model name and the
cache salt. When a request is routed, its blocks are recorded for the chosen pod (an LRU of
`lruCapacityPerServer` blocks per pod, 31,250). The score of a pod is the number of leading
blocks of the prompt recorded for it, divided by the prompt's block count. No engine events: the
index believes a pod holds what was sent there, whether the engine kept it or not.

The reference EPP's parameter names are accepted too: `blockSize` and `hashBlockSize` for
`blockSizeChars`, `maxPrefixBlocksToMatch` for `maxPrefixBlocks` (one name per setting).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import msgspec
import numpy as np
import xxhash

from epp.scheduling.framework import CycleState, PluginHandle
from epp.scheduling.registry import Params, PluginParamsError, PluginSpec
from epp.types import Endpoint, EndpointId, InferenceRequest

HASHES = "approx_prefix_hashes"
"""CycleState key: this request's block hashes, computed once per cycle."""
_json = msgspec.json.Encoder()


BLOCK_CHARS_DEFAULT = 64
MAX_BLOCKS_DEFAULT = 256


class ApproxPrefixParams(Params):
    block_size_chars: int | None = None  # BLOCK_CHARS_DEFAULT
    max_prefix_blocks: int | None = None  # MAX_BLOCKS_DEFAULT
    lru_capacity_per_server: int = 31_250
    # The reference EPP's names for the same settings.
    block_size: int | None = None
    hash_block_size: int | None = None
    max_prefix_blocks_to_match: int | None = None


def prompt_hashes(request: InferenceRequest, block_chars: int, max_blocks: int) -> list[int]:
    """Chained xxhash64 of the prompt's full `block_chars`-character blocks, seeded by model and salt."""
    if request.messages is not None:
        text = _json.encode(list(request.messages)).decode("utf-8", "replace")
    elif isinstance(request.prompt, str):
        text = request.prompt
    elif request.prompt is not None:  # token ids: the JSON of the list (only as much as can be hashed)
        head = request.prompt[: block_chars * max_blocks]
        ids = head.tolist() if isinstance(head, np.ndarray) else list(head)
        text = _json.encode(ids).decode()
    else:
        return []
    n = min(len(text) // block_chars, max_blocks)
    prev = xxhash.xxh64_intdigest(f"{request.model}\x00{request.cache_salt or ''}".encode())
    out = []
    for i in range(n):
        prev = xxhash.xxh64_intdigest(text[i * block_chars : (i + 1) * block_chars].encode(), seed=prev)
        out.append(prev)
    return out


class ApproxPrefixIndex:
    """Which block hashes were routed to which pod; a per-pod LRU bounds it."""

    def __init__(self, capacity_per_pod: int) -> None:
        self.capacity = capacity_per_pod
        self._pods: dict[EndpointId, OrderedDict[int, None]] = {}
        self._holders: dict[int, set[EndpointId]] = {}

    def record(self, pod: EndpointId, hashes: Sequence[int]) -> None:
        lru = self._pods.setdefault(pod, OrderedDict())
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            self._holders.setdefault(h, set()).add(pod)
            if len(lru) > self.capacity:
                old, _ = lru.popitem(last=False)
                holders = self._holders[old]
                holders.discard(pod)
                if not holders:
                    del self._holders[old]

    def matched(self, hashes: Sequence[int], pods: Sequence[EndpointId]) -> dict[EndpointId, int]:
        """Leading blocks of `hashes` recorded for each of `pods`."""
        out = dict.fromkeys(pods, 0)
        alive = set(pods)
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            kept = alive & holders if holders else set()
            for p in alive - kept:  # its run ends before block i
                out[p] = i
            alive = kept
            if not alive:
                return out
        for p in alive:
            out[p] = len(hashes)
        return out

    def forget(self, pod: EndpointId) -> None:
        for h in self._pods.pop(pod, {}):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(pod)
                if not holders:
                    del self._holders[h]

    def size(self) -> int:
        return sum(len(lru) for lru in self._pods.values())


class ApproxPrefixScorer:
    def __init__(self, name: str, block_chars: int, max_blocks: int, capacity: int) -> None:
        self._name = name
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.index = ApproxPrefixIndex(capacity)

    @property
    def name(self) -> str:
        return self._name

    def _hashes(self, state: CycleState, request: InferenceRequest) -> list[int]:
        key = f"{HASHES}:{self._name}"
        got: list[int] | None = state.data.get(key)
        if got is None:
            got = state.data[key] = prompt_hashes(request, self.block_chars, self.max_blocks)
        return got

    def score(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[float]:
        hashes = self._hashes(state, request)
        if not hashes:
            return [0.0] * len(endpoints)
        matched = self.index.matched(hashes, [e.id for e in endpoints])
        n = len(hashes)
        return [matched[e.id] / n for e in endpoints]

    def picked(self, state: CycleState, request: InferenceRequest, endpoint: EndpointId) -> None:
        self.index.record(endpoint, self._hashes(state, request))


def _setting(given: list[tuple[str, int | None]], default: int) -> int:
    """The one value given under any of a setting's names (ours first), else `default`; each >= 1."""
    named = [(key, value) for key, value in given if value is not None]
    if len(named) > 1:
        keys = " and ".join(key for key, _ in named)
        raise PluginParamsError(named[1][0], f"{keys} are the same setting: give only one of them")
    if not named:
        return default
    key, value = named[0]
    if value is None or value < 1:
        raise PluginParamsError(key, "must be >= 1")
    return value


def _build(name: str, params: ApproxPrefixParams, handle: PluginHandle) -> ApproxPrefixScorer:
    block_chars = _setting(
        [
            ("blockSizeChars", params.block_size_chars),
            ("blockSize", params.block_size),
            ("hashBlockSize", params.hash_block_size),
        ],
        BLOCK_CHARS_DEFAULT,
    )
    max_blocks = _setting(
        [
            ("maxPrefixBlocks", params.max_prefix_blocks),
            ("maxPrefixBlocksToMatch", params.max_prefix_blocks_to_match),
        ],
        MAX_BLOCKS_DEFAULT,
    )
    if params.lru_capacity_per_server < 1:
        raise PluginParamsError("lruCapacityPerServer", "must be >= 1")
    return ApproxPrefixScorer(name, block_chars, max_blocks, params.lru_capacity_per_server)


SPEC = PluginSpec(
    "prefix-cache-scorer",
    "scorer",
    ApproxPrefixParams,
    _build,
    "The reference EPP's approximate prefix affinity: 64-char blocks of the prompt routed to each pod.",
)
