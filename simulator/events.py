"""One engine's KV events, encoded as real vLLM wire payloads. Pure (no sockets, no clock).

The engine adds events as its scheduler takes and fills blocks; at the end of each step that
produced any, `flush` encodes them as one vLLM batch (msgpack `[ts, events, dp_rank]`, events
map-encoded as vLLM 0.24+ does, with the event structs and `encode_batch` of
`epp.testing.kv_publisher`) with the engine's next
sequence number (0, 1, 2, ... per engine, like vLLM's publisher) and hands it to
`on_events(seq, payload, at)`. `ts` is the simulated time. Whoever receives the payload feeds it to the
production `KvIngest.on_live`, with whatever delay or loss it models. A sink made with `on_batches` (the
cluster's) hands the batch already decoded instead (`epp.kvindex.batch_reader.BatchBuilder`: the runs
`KvIngest` would decode from those bytes), which spares ~6% of a simulation's CPU; `epp-sim
serve-engine` puts the encoded bytes on a real socket.

Shapes, as vLLM emits them: one `BlockStored` per request and step covering its newly full blocks
(`parent_block_hash` = the block before them, None at block 0), with their token ids, the block
size, `medium` "GPU" or "CPU", the LoRA adapter in `lora_name`, and per block `extra_keys` as vLLM
0.18+ builds them: the adapter's name (every block of a LoRA request), then the cache salt (the first
block of the request only); one `BlockRemoved` per evicted block; `AllBlocksCleared` when the
prefix cache is reset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from epp.kvindex.batch_reader import BatchBuilder
from epp.kvindex.event_scan import ScannedBatch
from epp.testing.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

OnEvents = Callable[[int, bytes, float], object]
"""(sequence number, msgpack payload, simulated time of publication)."""
OnBatches = Callable[[int, ScannedBatch, float], object]
"""(sequence number, the batch decoded, simulated time of publication)."""

GPU = "GPU"
CPU = "CPU"


class EventSink:
    __slots__ = (
        "block_size",
        "decoded",
        "dirty",
        "dp_rank",
        "events",
        "on_batches",
        "on_events",
        "published",
        "seq",
    )

    def __init__(
        self,
        on_events: OnEvents | None,
        block_size: int,
        dp_rank: int | None = None,
        *,
        on_batches: OnBatches | None = None,
    ) -> None:
        """Exactly one of `on_events` (encoded payloads) and `on_batches` (decoded batches)."""
        if (on_events is None) == (on_batches is None):
            raise ValueError("EventSink: give exactly one of on_events and on_batches")
        self.on_events = on_events
        self.on_batches = on_batches
        self.block_size = block_size
        self.dp_rank = dp_rank
        self.decoded = BatchBuilder() if on_batches is not None else None
        self.events: list[Any] = []
        self.seq = 0
        self.published = 0  # events
        self.dirty = False  # an event was added since the last flush (`flush` returns at once while not)

    def stored(
        self,
        hashes: list[int],
        parent: int | None,
        token_ids: list[int],
        medium: str,
        lora_name: str | None,
        cache_salt: str | None,
    ) -> None:
        self.dirty = True
        if self.decoded is not None:
            self.decoded.stored(hashes, parent, token_ids, self.block_size, medium, lora_name, cache_salt)
            return
        extra: list[Any] | None = None
        if lora_name:
            extra = [[lora_name] for _ in hashes]
            if cache_salt and parent is None:
                extra[0] = [lora_name, cache_salt]
        elif cache_salt and parent is None:
            extra = [[cache_salt]] + [None] * (len(hashes) - 1)
        # kv_publisher.stored() without its defensive copies (the lists are the engine's fresh ones)
        self.events.append(
            BlockStored(
                cast("list[int | bytes]", hashes),
                parent,
                token_ids,
                self.block_size,
                None,
                medium,
                lora_name,
                extra,
            )
        )

    def cleared(self) -> None:
        """`AllBlocksCleared`: the engine reset its prefix cache."""
        self.dirty = True
        if self.decoded is not None:
            self.decoded.cleared()
            return
        self.events.append(AllBlocksCleared())

    def removed(self, hashes: list[int], medium: str) -> None:
        """One `BlockRemoved` per hash, in order."""
        self.dirty = True
        if self.decoded is not None:
            self.decoded.removed(hashes, medium)
            return
        self.events.extend([BlockRemoved([h], medium) for h in hashes])

    def flush(self, at: float) -> None:
        if not self.dirty:
            return
        self.dirty = False
        decoded = self.decoded
        seq = self.seq
        if decoded is not None:
            n = len(decoded)
            if not n:
                return
            self.seq = seq + 1
            self.published += n
            on_batches = self.on_batches
            assert on_batches is not None  # (it made `decoded`)
            on_batches(seq, decoded.take(at, self.dp_rank), at)
            return
        events = self.events
        if not events:
            return
        self.events = []
        self.seq = seq + 1
        self.published += len(events)
        on_events = self.on_events
        assert on_events is not None  # (no `decoded`)
        on_events(seq, encode_batch(events, self.dp_rank, ts=at), at)
