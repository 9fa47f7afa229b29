"""vLLM's KV-event wire format as msgspec structs, and encoding a batch. Pure (no sockets, no clock).

Map-encoded events as vLLM 0.24+ sends them (`{"type": "BlockStored", ...}`, defaulted fields left
out) and array-encoded ones as vLLM 0.9-0.23 did; a batch is `[ts, events, dp_rank]` in msgpack.
Used by the test publisher (`kv_publisher`) and the simulator's engines.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class _StoredFields(msgspec.Struct, gc=False):
    """vLLM's BlockStored fields, in its order (0.22+: the hybrid-model fields at the end)."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _RemovedFields(msgspec.Struct, gc=False):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


# Map-encoded (vLLM 0.24+): {"type": "BlockStored", ...}, defaulted fields left out.
class BlockStored(_StoredFields, tag=True, omit_defaults=True):
    pass


class BlockRemoved(_RemovedFields, tag=True, omit_defaults=True):
    pass


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    pass


# Array-encoded (vLLM 0.9-0.23): ["BlockStored", ...].
class ArrayBlockStored(_StoredFields, tag="BlockStored", array_like=True, omit_defaults=True):
    pass


class ArrayBlockRemoved(_RemovedFields, tag="BlockRemoved", array_like=True, omit_defaults=True):
    pass


class ArrayAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


Form = Literal["map", "array"]


def stored(
    hashes: list[int],
    parent: int | None,
    token_ids: list[int],
    block_size: int = 16,
    medium: str | None = "GPU",
    lora_name: str | None = None,
    extra_keys: list[Any] | None = None,
    form: Form = "map",
) -> msgspec.Struct:
    if form == "array":
        return ArrayBlockStored(list(hashes), parent, list(token_ids), block_size, None, medium, lora_name)
    return BlockStored(list(hashes), parent, list(token_ids), block_size, None, medium, lora_name, extra_keys)


def removed(hashes: list[int], medium: str | None = "GPU", form: Form = "map") -> msgspec.Struct:
    if form == "array":
        return ArrayBlockRemoved(list(hashes), medium)
    return BlockRemoved(list(hashes), medium)


def cleared(form: Form = "map") -> msgspec.Struct:
    return ArrayAllBlocksCleared() if form == "array" else AllBlocksCleared()


_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: list[Any], dp_rank: int | None, ts: float) -> bytes:
    """One vLLM event batch, `ts` in seconds (the publisher's wall clock, or simulated time)."""
    return _encoder.encode(EventBatch(ts, events, dp_rank))
