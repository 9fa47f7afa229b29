"""vLLM's offloading connector (0.32) stores a block it has no metadata for as a placeholder: a BlockStored
with one hash, no parent, no token ids and `block_size` 0 ("so consumers can ignore them"). Such an event
is skipped, not a malformed batch: the other events of its message are applied and the pod stays fresh."""

from __future__ import annotations

import msgspec
import pytest

from epp.kvindex.batch_reader import decode
from epp.kvindex.events import DecodeError, decode_batch
from epp.kvindex.freshness import Freshness, FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.ingest import KvIngest
from epp.kvindex.keys import block_keys, root_key

BS = 4


def placeholder(**fields: object) -> dict[str, object]:
    """As vLLM 0.32's `OffloadingEventsTracker._placeholder_stored` builds it (map form, its field names)."""
    event: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": [0xABCDEF],
        "parent_block_hash": None,
        "token_ids": [],
        "lora_id": None,
        "block_size": 0,
        "medium": "CPU",
        "lora_name": None,
        "group_idx": 0,
        "locality": None,
        "ownership": None,
    }
    event.update(fields)
    return event


def real(hashes: list[int], tokens: list[int]) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": tokens,
        "lora_id": None,
        "block_size": BS,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": None,
        "group_idx": 0,
    }


def payload(*events: dict[str, object]) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


def test_a_placeholder_is_skipped_and_the_rest_of_its_message_is_applied() -> None:
    tokens = list(range(100, 100 + 2 * BS))
    body = payload(placeholder(), real([1, 2], tokens), placeholder(medium="DISK"))
    batch = decode(body)
    assert batch.skipped == 2 and batch.events == 1
    index, freshness = BlockIndex(block_size=BS), FreshnessTracker()
    ingest = KvIngest(index, freshness, lambda pod: "m")
    freshness.connected("p", 0.0)
    ingest.on_live("p", 0, 0, body, 0.0)
    keys = block_keys(tokens, BS, root_key("m"))
    assert index.lookup(keys, ["p"]) == {"p": {"gpu": 2, "any": 2}}
    assert freshness.state("p", 0.0).state is Freshness.FRESH
    assert ingest.counters["p"].skipped_groups == 2 and not ingest.counters["p"].drops


def test_a_block_size_of_0_with_token_ids_is_still_malformed() -> None:
    with pytest.raises(DecodeError, match=r"event 0 \(BlockStored\): field block_size: 0 with token ids"):
        decode_batch(payload(placeholder(token_ids=[1, 2, 3])))
    with pytest.raises(DecodeError):
        decode_batch(payload(placeholder(block_size=-1)))
