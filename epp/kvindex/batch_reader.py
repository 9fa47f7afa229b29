"""A KV-event message's payload -> the runs of events `KvIngest` applies. Pure.

The compiled scan (`event_scan.py`) reads vLLM's batches of at least `SCAN_FROM` bytes straight into
runs of consecutive events; every other shape, and every error, goes to msgspec's `decode_batch`
(`events.py`), whose events become one run each (`runs_of`). `salt_of` tells a chain's tenant salt
from a LoRA adapter's name in vLLM's `extra_keys`.

Blocks whose `extra_keys` carry more than strings (vLLM's multimodal `(identifier, offset)` pairs, a
prompt-embeds digest) hold content their token ids do not name: an image's tokens are the same
placeholder ids whatever the image, prompt embeddings' ids are zeros. Their token ids are replaced by
`opaque_tokens` (negative ids derived from those keys, which no prompt's ids can equal: the EPP keys
token ids 0..2^31-1), so the index keeps them, and their descendants, under keys of their own: the
same image gives the same keys on every pod, another image other keys, and no text or token-id prompt
gets credit for them (the EPP does not key multimodal prompts).

`Message` is what `KvIngest` takes: a payload's bytes, or a batch already in this form, which a producer
that has the events in hand (the simulator's engines) builds with `BatchBuilder` instead of encoding
msgpack only for it to be decoded again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from epp.kvindex.event_scan import CLEARED, REMOVED, STORED, Run, ScannedBatch, scan_batch
from epp.kvindex.events import BlockRemoved, BlockStored, EventBatch, decode_batch, normalize_tier

Message = bytes | ScannedBatch
"""A KV-event message as `KvIngest` takes it: the payload's bytes, or the batch already decoded."""

SCAN_FROM = 512
"""Payloads of at least this many bytes go to the compiled scan first; below, msgspec is faster (the
scan's fixed cost, ~5 us, against ~3.5 us for msgspec on a one-block BlockStored)."""


def decode(payload: Message) -> ScannedBatch:
    """A message's batch in the form `_apply` applies: read by the compiled scan (`event_scan.py`), or by
    `decode_batch` when the payload is short or the scan does not take it; a batch given decoded, as it is.
    Raises DecodeError."""
    if isinstance(payload, ScannedBatch):
        return payload
    scanned = scan_batch(payload) if len(payload) >= SCAN_FROM else None
    return scanned if scanned is not None else runs_of(decode_batch(payload))


def runs_of(batch: EventBatch) -> ScannedBatch:
    """`decode_batch`'s result in the form `_apply` applies: one run per event."""
    runs: list[Run] = []
    for ev in batch.events:
        if type(ev) is BlockStored:
            extra = ev.extra_keys
            salted = ev.cache_salt or (extra and extra[0] is not None)
            salt = salt_of(extra, ev.cache_salt, ev.lora_name) if salted else None
            hashes = list(ev.block_hashes)
            tokens = ev.token_ids if extra is None else opaque_tokens(ev.token_ids, extra, ev.block_size)
            runs.append(
                (STORED, ev.tier, ev.lora_name, salt, hashes, [ev.parent_block_hash], [len(hashes)],
                 tokens, [len(tokens)], [ev.block_size], None)
            )  # fmt: skip
        elif type(ev) is BlockRemoved:
            runs.append((REMOVED, ev.tier, list(ev.block_hashes), ev.group, 1))
        else:
            runs.append((CLEARED,))
    return ScannedBatch(
        batch.ts, batch.data_parallel_rank, runs, len(batch.events), batch.skipped, batch.partial_groups
    )


def salt_of(
    extra_keys: tuple[object, ...] | None, cache_salt: str | None, lora_name: str | None = None
) -> str | None:
    """The tenant salt of a chain's first block: SGLang's `cache_salt`, or the string items of vLLM's
    `extra_keys[0]`. vLLM builds a block's extra keys as its LoRA keys, then multimodal ids, then (first
    block only) the request's cache_salt; from 0.18 the LoRA key is the adapter's name, so a leading
    item equal to `lora_name` is the adapter (already in the chain's root), not a salt."""
    if cache_salt:
        return cache_salt
    if not extra_keys:
        return None
    first = extra_keys[0]
    if isinstance(first, str):
        return None if not first or first == lora_name else first
    if isinstance(first, list | tuple):
        parts = [x for x in first if isinstance(x, str)]
        if parts and lora_name is not None and parts[0] == lora_name:
            parts = parts[1:]
        return "\x00".join(parts) if parts else None
    return None


def opaque_tokens(token_ids: Sequence[int], extra_keys: Sequence[object], block_size: int) -> Sequence[int]:
    """`token_ids` with the ids of every block whose extra keys hold anything but strings (or None) replaced
    by one negative id derived from those keys (see the module docstring); as given when there is none."""
    out: list[int] | None = None
    for j, keys in enumerate(extra_keys):
        if not keys or not isinstance(keys, tuple | list) or all(isinstance(k, str) for k in keys):
            continue
        if out is None:
            out = list(token_ids)
        digest = hashlib.blake2b(repr(tuple(keys)).encode(), digest_size=8).digest()
        opaque = -1 - (int.from_bytes(digest, "big") >> 2)
        start = j * block_size
        out[start : start + block_size] = [opaque] * len(out[start : start + block_size])
    return token_ids if out is None else out


def held_size(message: Message) -> int:
    """What a message held during a replay counts against its byte bound: its payload's size, or for a
    decoded batch an estimate (64 bytes an event, about what vLLM's one-block events take)."""
    return len(message) if not isinstance(message, ScannedBatch) else 64 * max(1, message.events)


class BatchBuilder:
    """One batch's events in the form `_apply` applies, added as an engine emits them: what `decode` would
    give for the same events encoded (consecutive BlockStored of one tier, adapter and salt in one run,
    consecutive BlockRemoved of one tier in one; hashes as unsigned 64-bit ints, token ids as given).
    Only for events without multimodal extra keys and of full-attention KV groups."""

    __slots__ = ("_events", "_last", "_runs")

    def __init__(self) -> None:
        self._runs: list[list[object] | tuple[int]] = []
        self._last: list[object] | None = None  # the run the next event may join
        self._events = 0

    def __len__(self) -> int:
        return self._events

    def stored(
        self,
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        medium: str | None,
        lora_name: str | None = None,
        salt: str | None = None,
    ) -> None:
        """A BlockStored. `salt`: the tenant salt of the chain's first block (vLLM's cache_salt), given with
        `parent` None only (on other blocks it keys nothing, as `salt_of` reads them)."""
        if not hashes or len(token_ids) > len(hashes) * block_size:
            raise ValueError("BatchBuilder.stored: the token ids do not fit the blocks")
        tier = normalize_tier(medium)
        salt = salt if parent is None else None
        run = self._last
        if run is not None and run[0] == STORED and run[1] == tier and run[2] == lora_name and run[3] == salt:
            run[4].extend(hashes)  # type: ignore[attr-defined]
            run[5].append(parent)  # type: ignore[attr-defined]
            run[6].append(len(hashes))  # type: ignore[attr-defined]
            run[7].extend(token_ids)  # type: ignore[attr-defined]
            run[8].append(len(token_ids))  # type: ignore[attr-defined]
            run[9].append(block_size)  # type: ignore[attr-defined]
        else:
            run = [
                STORED, tier, lora_name, salt, list(hashes), [parent], [len(hashes)], list(token_ids),
                [len(token_ids)], [block_size], None,
            ]  # fmt: skip
            self._runs.append(run)
            self._last = run
        self._events += 1

    def removed(self, hashes: Sequence[int], medium: str | None) -> None:
        """One BlockRemoved per hash, in order."""
        if not hashes:
            return
        tier = normalize_tier(medium)
        run = self._last
        if run is not None and run[0] == REMOVED and run[1] == tier:
            run[2].extend(hashes)  # type: ignore[attr-defined]
            run[4] += len(hashes)  # type: ignore[operator]
        else:
            run = [REMOVED, tier, list(hashes), None, len(hashes)]
            self._runs.append(run)
            self._last = run
        self._events += len(hashes)

    def cleared(self) -> None:
        self._runs.append((CLEARED,))
        self._last = None
        self._events += 1

    def take(self, ts: float, dp_rank: int | None = None) -> ScannedBatch:
        """The batch so far, stamped `ts`; the builder starts empty again."""
        runs: list[Run] = [tuple(r) for r in self._runs]  # type: ignore[misc]
        batch = ScannedBatch(ts, dp_rank, runs, self._events, 0)
        self._runs, self._last, self._events = [], None, 0
        return batch
