"""SGLang's KV-event payloads, encoded exactly as SGLang's own msgspec classes encode them.

The classes below mirror `sglang/srt/disaggregation/kv_events.py` of the SGLang wheels on PyPI (their
`msgspec.Struct` options, field order and defaults; no SGLang code is copied beyond the declarations),
and the values follow `sglang/srt/mem_cache/events.py` (`KVCacheEventRecorder.record_store`):

- 0.5.12-0.5.16: array events (`array_like=True, omit_defaults=True, tag=True`);
- 0.5.18-0.5.19: array events without `omit_defaults`, and a salted request's BlockStored is a
  `BlockStoredWithMetadata`: the base fields, then `{"cache_salt": ...}` at position 7;
- 0.5.21-0.5.23: map events (`omit_defaults=True, tag=True`) with `cache_salt`, `session_id`, `lora_name`.

In every version, a server running EAGLE speculative decoding keys its radix tree by bigrams, and its
BlockStored `token_ids` are `[token, next token]` pairs ("bigram pages expose tuples"), one per position.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec
import pytest

from epp.kvindex import batch_reader
from epp.kvindex.events import CPU, GPU, BlockRemoved, BlockStored, DecodeError, decode_batch
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.ingest import Applied, KvIngest
from epp.kvindex.keys import block_keys, root_key

TS = 1767225600.125
SIGNED = -0x0F1E2D3C4B5A6978  # SGLang block hashes are signed int64 (`hash_str_to_int64`)
MASK = (1 << 64) - 1


# --- SGLang 0.5.12-0.5.16: arrays, omit_defaults ------------------------------------------------------


class Batch16(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None  # noqa: UP045 (SGLang's spelling)


class Event16(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class Stored16(Event16, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]  # noqa: UP045
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]  # noqa: UP045
    medium: Optional[str] = None  # noqa: UP045


# --- SGLang 0.5.18-0.5.19: arrays, salt in a trailing metadata map -----------------------------------


class Batch19(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None  # noqa: UP045


class Event19(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class Metadata19(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class Stored19(Event19, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]  # noqa: UP045
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]  # noqa: UP045
    medium: Optional[str] = None  # noqa: UP045


class StoredWithMetadata19(Stored19, tag="BlockStored", kw_only=True):
    metadata: Metadata19


class Removed19(Event19, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None  # noqa: UP045


class Cleared19(Event19, tag="AllBlocksCleared"):
    pass


class KVEventBatch19(Batch19):
    events: list[Union[Stored19, Removed19, Cleared19]]  # noqa: UP007


# --- SGLang 0.5.21-0.5.23: tagged maps ------------------------------------------------------------


class Batch23(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None  # noqa: UP045


class Event23(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class Stored23(Event23, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]  # noqa: UP045
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]  # noqa: UP045
    medium: Optional[str] = None  # noqa: UP045
    cache_salt: Optional[str] = None  # noqa: UP045
    session_id: Optional[str] = None  # noqa: UP045
    lora_name: Optional[str] = None  # noqa: UP045


class Removed23(Event23, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None  # noqa: UP045


class Cleared23(Event23, tag="AllBlocksCleared"):
    pass


class KVEventBatch23(Batch23):
    events: list[Union[Stored23, Removed23, Cleared23]]  # noqa: UP007


enc = msgspec.msgpack.Encoder().encode  # what ZmqEventPublisher puts in the payload frame


def pages(tokens: list[int], page: int) -> list[list[int]]:
    return [tokens[i : i + page] for i in range(0, len(tokens), page)]


def bigrams(raw: list[int]) -> list[Any]:
    """SGLang's EAGLE key of `raw`: one (token, next token) pair per position (`convert_to_bigram_key`).
    (Typed Any: SGLang annotates `token_ids: list[int]` and passes these tuples all the same.)"""
    return [(raw[i], raw[i + 1]) for i in range(len(raw) - 1)]


# --- 0.5.18-0.5.19: the salt's metadata map --------------------------------------------------------


def test_salted_array_block_stored_reads_the_salt_from_the_metadata_map() -> None:
    payload = enc(
        KVEventBatch19(
            TS,
            [
                StoredWithMetadata19(
                    [SIGNED, 5], None, list(range(32)), 16, None, "GPU", metadata=Metadata19("tenant-a")
                )
            ],
            0,
        )
    )
    assert msgspec.msgpack.decode(payload)[1][0][7] == {"cache_salt": "tenant-a"}  # position 7
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 0
    assert batch.events == (
        BlockStored((SIGNED & MASK, 5), None, tuple(range(32)), 16, GPU, None, None, "tenant-a"),
    )


def test_a_019_batch_mixing_salted_and_unsalted_stores_decodes_whole() -> None:
    payload = enc(
        KVEventBatch19(
            TS,
            [
                Stored19([1], None, list(range(16)), 16, None, "GPU"),
                StoredWithMetadata19(
                    [2], None, list(range(16)), 16, None, "CPU_PINNED", metadata=Metadata19("t")
                ),
                Stored19([3], 1, list(range(16, 32)), 16, None, "GPU"),
                Removed19([SIGNED], "GPU"),
                Cleared19(),
            ],
            1,
        )
    )
    events = decode_batch(payload).events
    assert [type(e).__name__ for e in events] == [
        "BlockStored",
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    assert [(e.tier, e.cache_salt, e.lora_name) for e in events[:3]] == [  # type: ignore[union-attr]
        (GPU, None, None),
        (CPU, "t", None),
        (GPU, None, None),
    ]
    assert events[3] == BlockRemoved((SIGNED & MASK,), GPU)


def test_metadata_with_a_bad_salt_is_a_field_error() -> None:
    bad = ["BlockStored", [1], None, [1, 2], 2, None, "GPU", {"cache_salt": 5}]
    with pytest.raises(DecodeError) as info:
        decode_batch(enc([TS, [bad], 0]))
    assert info.value.reason == "field_type"
    assert "event 0" in str(info.value)


# --- EAGLE bigram pages ------------------------------------------------------------------------


def test_bigram_token_ids_in_map_form_read_as_the_first_token_of_each_pair() -> None:
    raw = list(range(100, 133))  # 33 tokens: 32 bigram positions, two pages of 16
    keys = bigrams(raw)
    payload = enc(
        KVEventBatch23(
            TS,
            [
                Stored23([SIGNED, 7], None, keys, 16, None, "GPU", session_id="s"),
                Stored23([8], 7, bigrams([132, 133, 134]), 2, None, "GPU"),  # a partial page
            ],
            0,
        )
    )
    batch = decode_batch(payload)
    assert batch.events == (
        BlockStored((SIGNED & MASK, 7), None, tuple(raw[:32]), 16, GPU),
        BlockStored((8,), 7, (132, 133), 2, GPU),
    )


def test_bigram_token_ids_in_array_form() -> None:
    raw = [5, 6, 7, 8, 9]
    payload = enc(Batch16(TS, [Stored16([1, 2], None, bigrams(raw), 2, None, "GPU")], 0))
    assert decode_batch(payload).events == (BlockStored((1, 2), None, (5, 6, 7, 8), 2, GPU),)


def test_token_ids_mixing_ids_and_pairs_are_a_field_error() -> None:
    bad: dict[str, Any] = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None}
    bad |= {"token_ids": [1, [2, 3]], "block_size": 2, "lora_id": None}
    with pytest.raises(DecodeError) as info:
        decode_batch(enc([TS, [bad], 0]))
    assert info.value.reason == "field_type"
    assert "token_ids" in str(info.value)


# --- through the ingest: the index gets keys a prompt can match ----------------------------------------

BS = 16
POD = "10.0.0.7:30000"


def make() -> KvIngest:
    return KvIngest(BlockIndex(block_size=BS, max_entries=10_000), FreshnessTracker(), lambda pod: "m")


def held(ing: KvIngest, tokens: list[int], salt: str | None = None) -> int:
    keys = block_keys(tokens, BS, root_key("m", salt))
    return ing.index.lookup(keys, [POD])[POD].get("any", 0)


@pytest.mark.parametrize("big", [False, True], ids=["msgspec", "compiled-scan-size"])
def test_an_eagle_server_is_indexed_under_the_prompt_s_keys(big: bool) -> None:
    raw = list(range(1000, 1000 + (256 if big else 32) + 1))
    positions = bigrams(raw)
    # page size 16: one coalesced event per node (SGLang merges a node's chained pages)
    hashes = [SIGNED + i for i in range(len(positions) // 16)]
    payload = enc(KVEventBatch23(TS, [Stored23(hashes, None, positions, 16, None, "GPU")], 0))
    assert (len(payload) >= batch_reader.SCAN_FROM) is big
    ing = make()
    assert ing.on_live(POD, 0, 0, payload, 1.0) == Applied(1)
    assert ing.counters[POD].drops == {}
    assert held(ing, raw) == len(positions) // BS
    # and removing the node's pages (one BlockRemoved per radix node) forgets them
    removal = enc(KVEventBatch23(TS, [Removed23(hashes, "GPU")], 0))
    assert ing.on_live(POD, 0, 1, removal, 2.0) == Applied(1)
    assert held(ing, raw) == 0


def test_a_salted_019_chain_is_indexed_under_the_salted_root() -> None:
    tokens = list(range(48))
    first = StoredWithMetadata19(
        [SIGNED], None, tokens[:16], 16, None, "GPU", metadata=Metadata19("tenant-a")
    )
    rest = StoredWithMetadata19(
        [SIGNED + 1, 9], SIGNED, tokens[16:], 16, None, "GPU", metadata=Metadata19("tenant-a")
    )
    ing = make()
    assert ing.on_live(POD, 0, 0, enc(KVEventBatch19(TS, [first, rest], 0)), 1.0) == Applied(2)
    assert ing.counters[POD].drops == {}
    assert held(ing, tokens, "tenant-a") == 3
    assert held(ing, tokens) == 0  # another tenant's (or no tenant's) prompt gets no credit
