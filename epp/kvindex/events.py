"""Decode engine KV-cache event batches (vLLM 0.9+, SGLang 0.5.x) into typed events.

Payload (shared/reference/kv-events.md): msgpack `[ts, events, data_parallel_rank?]`; events
are positional arrays (vLLM 0.9-0.23, SGLang up to 0.5.19) or maps tagged by `type` (vLLM 0.24+,
SGLang 0.5.21+). Missing trailing / defaulted fields are allowed, unknown ones ignored.
Fast path: one typed msgspec decode (types checked in C, token ids straight into tuples), then
a short loop per event. If that decode rejects the payload, a slow path decodes event by event
(accepting batches that mix both encodings) and names the bad event, field and reason.

Two SGLang shapes take the slow path (`_narrow`): an EAGLE server's BlockStored carries
`[token, next token]` bigram pairs as token ids (the block holds the first token of each pair),
and SGLang 0.5.18-0.5.19 append a salted request's `{"cache_salt": ...}` metadata map to the
array-form BlockStored, at position 7 (where vLLM puts `lora_name`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Annotated, Any, Final, Generic, TypeVar, Union

import msgspec

from epp.frozen import twin

GPU: Final = "gpu"
CPU: Final = "cpu"
STORAGE: Final = "storage"
KNOWN_TIERS: Final[frozenset[str]] = frozenset({GPU, CPU, STORAGE})

# Engine medium names (compared case-insensitively) -> tier.
_TIER_OF: Final[dict[str, str]] = {
    "gpu": GPU,  # vLLM MEDIUM_GPU; SGLang StorageMedium.GPU (device HBM)
    "cpu": CPU,  # vLLM MEDIUM_CPU (CPU offloading)
    "cpu_pinned": CPU,  # SGLang StorageMedium.CPU (host pinned memory, L2)
    "storage": STORAGE,  # vLLM MEDIUM_STORAGE (0.27+)
    "fs": STORAGE,  # vLLM 0.26 MEDIUM_FS (file system offload)
    "obj": STORAGE,  # vLLM 0.26 MEDIUM_OBJ (object store offload)
    "disk": STORAGE,  # SGLang StorageMedium.DISK (SSD / NVMe, L3)
    "external": STORAGE,  # SGLang StorageMedium.EXTERNAL (shared / remote pool, L4)
    "shared_storage": STORAGE,  # llm-d shared storage backend
    "object_store": STORAGE,  # llm-d object store backend
}
# Exact spellings seen on the wire, so the common case skips str.lower().
_TIER_EXACT: Final[dict[str | None, str]] = {None: GPU}
_TIER_EXACT.update(_TIER_OF)
_TIER_EXACT.update({name.upper(): tier for name, tier in _TIER_OF.items()})

# KV-cache group kinds whose blocks describe reusable prefixes; events of other groups
# (sliding window, mamba, chunked local, cross attention, ...) are skipped.
FULL_ATTENTION_KINDS: Final[frozenset[str]] = frozenset(
    {"full_attention", "mla_attention", "sink_full_attention"}
)

_MASK64: Final = (1 << 64) - 1
# Digest sizes of vLLM's block hash functions: sha256 / sha256_cbor (32), xxhash / xxhash_cbor
# (xxh3-128, 16). Sent as msgpack bin when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
_DIGEST_SIZES: Final = (32, 16)


def normalize_tier(medium: str | None) -> str:
    """The tier a medium name belongs to. None (older engines, SGLang default) -> "gpu".

    Case-insensitive: GPU -> gpu; CPU, CPU_PINNED -> cpu; STORAGE, FS, OBJ, DISK,
    SHARED_STORAGE, OBJECT_STORE, EXTERNAL -> storage. Any other name is kept, lower-cased,
    as a tier of its own (callers report tiers outside KNOWN_TIERS).
    """
    tier = _TIER_EXACT.get(medium)
    if tier is None:  # medium is a str here (None is in the table)
        lowered = str(medium).lower()
        tier = _TIER_OF.get(lowered, lowered)
    return tier


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]  # engine hashes as unsigned 64-bit ints
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: str  # normalize_tier(medium)
    lora_name: str | None = None  # adapter name; None = base model
    extra_keys: tuple[object, ...] | None = None  # per block: None or a tuple (lists made tuples)
    cache_salt: str | None = None  # SGLang's cache_salt


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    tier: str
    group: int | None = None  # the KV-cache group (`group_idx`) it left; None when not sent


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None
    skipped: int  # events dropped: their KV group is not full attention, or an offloading placeholder
    partial_groups: tuple[int, ...] = ()  # the `group_idx` of those (sent ones), in order of appearance


class DecodeError(ValueError):
    """A payload that is not a valid event batch. `reason` is a short label for metrics:
    "msgpack", "batch_shape", "event_shape", "field_type" or "unknown_event"."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def engine_hash(value: int | bytes) -> int:
    """An engine block hash as an unsigned 64-bit id.

    int (vLLM unsigned, SGLang signed int64) -> value mod 2**64; bytes (a 32-byte sha256 or
    16-byte xxh3-128 digest) -> its last 8 bytes big-endian, the same id vLLM publishes
    for that digest when it sends ints. Other lengths or types raise DecodeError.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _MASK64
    if isinstance(value, bytes):
        if len(value) in _DIGEST_SIZES:
            return int.from_bytes(value[-8:], "big")
        raise DecodeError("field_type", f"bytes block hash of length {len(value)}, expected 32 or 16")
    raise DecodeError("field_type", f"block hash must be an int or bytes, got {type(value).__name__}")


# --- wire schema (msgspec) ---------------------------------------------------------------

_Hash = int | bytes
_UHash = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints are below 2**64: an unsigned 64-bit hash


class _StoredFields(msgspec.Struct, gc=False):
    block_hashes: tuple[_Hash, ...]
    parent_block_hash: _Hash | None
    token_ids: tuple[int, ...]
    block_size: Annotated[int, msgspec.Meta(ge=0)]  # 0: a placeholder (see `_convert`)
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _RemovedFields(msgspec.Struct, gc=False):
    block_hashes: tuple[_Hash, ...]
    medium: str | None = None
    group_idx: int | None = None


class _ArrStored(_StoredFields, array_like=True, tag="BlockStored"):
    pass


class _ArrRemoved(_RemovedFields, array_like=True, tag="BlockRemoved"):
    pass


class _ArrCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _MapStored(_StoredFields, tag="BlockStored"):
    cache_salt: str | None = None


class _MapRemoved(_RemovedFields, tag="BlockRemoved"):
    pass


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


# Variants with unsigned int hashes only (vLLM's default), tried first: no per-hash work.
class _ArrStoredU(_ArrStored, tag="BlockStored"):
    block_hashes: tuple[_UHash, ...]
    parent_block_hash: _UHash | None


class _ArrRemovedU(_ArrRemoved, tag="BlockRemoved"):
    block_hashes: tuple[_UHash, ...]


class _MapStoredU(_MapStored, tag="BlockStored"):
    block_hashes: tuple[_UHash, ...]
    parent_block_hash: _UHash | None


class _MapRemovedU(_MapRemoved, tag="BlockRemoved"):
    block_hashes: tuple[_UHash, ...]


# SGLang shapes the typed fast path leaves to the slow path, where `_narrow` reads them.
_Bigram = tuple[int, int]  # EAGLE keys SGLang's radix tree by (token, next token), one pair per position


class _SglMetadata(msgspec.Struct, gc=False):
    """SGLang 0.5.18-0.5.19 `BlockStoredMetadata`: a salted request's BlockStored array ends with it."""

    cache_salt: str | None = None


class _ArrStoredWide(_ArrStored, tag="BlockStored"):
    token_ids: tuple[int | _Bigram, ...]  # type: ignore[assignment]
    lora_name: str | _SglMetadata | None = None  # type: ignore[assignment]


class _MapStoredWide(_MapStored, tag="BlockStored"):
    token_ids: tuple[int | _Bigram, ...]  # type: ignore[assignment]


_E = TypeVar("_E")


class _Batch(msgspec.Struct, Generic[_E], array_like=True, forbid_unknown_fields=True, gc=False):
    ts: float
    events: list[_E]
    data_parallel_rank: int | None = None


_WireEvent = _StoredFields | _RemovedFields | _ArrCleared | _MapCleared
_ArrEvent = Union[_ArrStored, _ArrRemoved, _ArrCleared]  # noqa: UP007 (a runtime value)
_MapEvent = Union[_MapStored, _MapRemoved, _MapCleared]  # noqa: UP007
# (map form?, unsigned hashes?) -> batch decoder
_BATCH: Final[dict[tuple[bool, bool], msgspec.msgpack.Decoder[_Batch[_WireEvent]]]] = {
    (False, True): msgspec.msgpack.Decoder(_Batch[Union[_ArrStoredU, _ArrRemovedU, _ArrCleared]]),  # noqa: UP007
    (True, True): msgspec.msgpack.Decoder(_Batch[Union[_MapStoredU, _MapRemovedU, _MapCleared]]),  # noqa: UP007
    (False, False): msgspec.msgpack.Decoder(_Batch[_ArrEvent]),
    (True, False): msgspec.msgpack.Decoder(_Batch[_MapEvent]),
}
_RAW_BATCH: Final = msgspec.msgpack.Decoder(_Batch[msgspec.Raw])
# (the slow path's, per event: also SGLang's bigram token ids and metadata)
_EVENT: Final[dict[bool, msgspec.msgpack.Decoder[_WireEvent]]] = {
    False: msgspec.msgpack.Decoder(Union[_ArrStoredWide, _ArrRemoved, _ArrCleared]),  # noqa: UP007
    True: msgspec.msgpack.Decoder(Union[_MapStoredWide, _MapRemoved, _MapCleared]),  # noqa: UP007
}
_WIDE: Final = (_ArrStoredWide, _MapStoredWide)
_FIRST: Final = itemgetter(0)


# --- decoding -------------------------------------------------------------------------------


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack event batch. Raises DecodeError (only) when it is not valid."""
    try:
        is_map = _first_event_is_map(payload)
        for unsigned in (True, False):
            try:
                batch = _BATCH[is_map, unsigned].decode(payload)
            except msgspec.ValidationError:
                continue
            return _convert(batch.ts, batch.events, batch.data_parallel_rank, unsigned)
        return _decode_slow(payload)
    except msgspec.DecodeError as e:
        raise DecodeError("msgpack", f"not a msgpack document: {e}") from None
    except RecursionError:
        raise DecodeError("msgpack", "msgpack nesting too deep") from None


def _first_event_is_map(payload: bytes) -> bool:
    """Peek at the header bytes: is the first event a map? (Only picks the first decoder.)"""
    ts = payload[1:2]  # after the batch's fixarray header
    pos = 10 if ts == b"\xcb" else 6 if ts == b"\xca" else 2  # float64 (as engines send), float32, int
    head = payload[pos : pos + 1]
    pos += 1 if head and 0x90 <= head[0] <= 0x9F else 3 if head == b"\xdc" else 5
    first = payload[pos : pos + 1]
    return bool(first) and (0x80 <= first[0] <= 0x8F or first in (b"\xde", b"\xdf"))


_StoredTwin: Final = twin(BlockStored)  # (3x faster to build: `epp/frozen.py`)
_RemovedTwin: Final = twin(BlockRemoved)
_BatchTwin: Final = twin(EventBatch)
_CLEARED: Final = AllBlocksCleared()


def _convert(ts: float, wire: Sequence[_WireEvent], dp_rank: int | None, unsigned: bool) -> EventBatch:
    events: list[Any] = []
    append = events.append
    skipped = 0
    partial: dict[int, None] = {}  # distinct, in order of appearance
    tiers = _TIER_EXACT
    for ev in wire:
        if isinstance(ev, _StoredFields):
            kind = ev.kv_cache_spec_kind
            if kind is not None and kind not in FULL_ATTENTION_KINDS:
                skipped += 1
                if ev.group_idx is not None:
                    partial[ev.group_idx] = None
                continue
            if ev.block_size == 0:
                # vLLM's offloading connector stores a block it has no metadata for as a placeholder
                # (`block_size` 0, no token ids, "so consumers can ignore them"): its content is unknown
                if ev.token_ids:
                    raise _field_error(wire, ev, "block_size", "field_type", "0 with token ids")
                skipped += 1
                continue
            hashes = ev.block_hashes
            parent = ev.parent_block_hash
            if not unsigned:
                hashes = _hashes(hashes, wire, ev, "block_hashes")
                if type(parent) is int:
                    parent &= _MASK64
                elif parent is not None:
                    parent = _hashes((parent,), wire, ev, "parent_block_hash")[0]
            medium = ev.medium
            extra = ev.extra_keys
            stored = _StoredTwin(
                hashes,
                parent,
                ev.token_ids,
                ev.block_size,
                tiers.get(medium) or normalize_tier(medium),
                ev.lora_name,
                extra if extra is None or extra.count(None) == len(extra) else _freeze(extra),
                getattr(ev, "cache_salt", None),
            )
            stored.__class__ = BlockStored
            append(stored)
        elif isinstance(ev, _RemovedFields):
            hashes = ev.block_hashes
            medium = ev.medium
            removed = _RemovedTwin(
                hashes if unsigned else _hashes(hashes, wire, ev, "block_hashes"),
                tiers.get(medium) or normalize_tier(medium),
                ev.group_idx,
            )
            removed.__class__ = BlockRemoved
            append(removed)
        else:
            append(_CLEARED)
    batch = _BatchTwin(ts, tuple(events), dp_rank, skipped, tuple(partial))
    batch.__class__ = EventBatch
    return batch  # type: ignore[no-any-return]


def _hashes(values: tuple[_Hash, ...], wire: Sequence[object], event: object, field: str) -> tuple[int, ...]:
    try:
        if not values or min(values) >= 0:  # type: ignore[operator]
            return values  # type: ignore[return-value]  # all ints in [0, 2**64)
        return tuple([h & _MASK64 for h in values])  # type: ignore[operator]  # signed ints
    except TypeError:  # bytes digests among them
        pass
    try:
        return tuple(map(engine_hash, values))
    except DecodeError as e:
        raise _field_error(wire, event, field, e.reason, str(e)) from None


def _field_error(wire: Sequence[object], event: object, field: str, reason: str, detail: str) -> DecodeError:
    """A DecodeError naming the event (its position in the batch and its type) and the field."""
    index = next(i for i, ev in enumerate(wire) if ev is event)
    tag = type(event).__struct_config__.tag  # type: ignore[attr-defined]
    return DecodeError(reason, f"event {index} ({tag}): field {field}: {detail}")


def _freeze(value: Any) -> Any:
    """Arrays inside extra keys (e.g. (mm_identifier, offset) pairs) as tuples, recursively."""
    if type(value) is list or type(value) is tuple:
        return tuple(map(_freeze, value))
    return value


# --- slow path: event by event, with precise errors ----------------------------------------


def _decode_slow(payload: bytes) -> EventBatch:
    try:
        batch = _RAW_BATCH.decode(payload)
    except msgspec.ValidationError as e:
        raise _batch_error(payload, e) from None
    wire: list[_WireEvent] = []
    for i, raw in enumerate(batch.events):
        head = memoryview(raw)[0]
        try:
            ev = _EVENT[0x80 <= head <= 0x8F or head in (0xDE, 0xDF)].decode(raw)
        except msgspec.ValidationError as e:
            raise _event_error(i, msgspec.msgpack.decode(raw), e) from None
        wire.append(_narrow(i, ev) if type(ev) in _WIDE else ev)
    return _convert(batch.ts, wire, batch.data_parallel_rank, False)


def _narrow(index: int, ev: Any) -> _WireEvent:
    """A BlockStored decoded with SGLang's wider types, as the fast path's types have it: bigram token ids
    as the first token of each pair (the tokens of the positions the page holds: the ids a prompt's keys
    run over), and a 0.5.18-0.5.19 metadata map as the event's `cache_salt` (no adapter name)."""
    tokens = ev.token_ids
    meta = ev.lora_name if type(ev.lora_name) is _SglMetadata else None
    kinds = set(map(type, tokens))
    if tuple in kinds:
        if int in kinds:
            detail = "mixes token ids and [token, next token] bigram pairs"
            raise DecodeError("field_type", f"event {index} (BlockStored): field token_ids: {detail}")
        tokens = tuple(map(_FIRST, tokens))
    elif meta is None:
        return ev  # type: ignore[no-any-return]  # nothing SGLang-only in it
    return _MapStored(
        block_hashes=ev.block_hashes,
        parent_block_hash=ev.parent_block_hash,
        token_ids=tokens,
        block_size=ev.block_size,
        lora_id=ev.lora_id,
        medium=ev.medium,
        lora_name=None if meta is not None else ev.lora_name,
        extra_keys=ev.extra_keys,
        group_idx=ev.group_idx,
        kv_cache_spec_kind=ev.kv_cache_spec_kind,
        kv_cache_spec_sliding_window=ev.kv_cache_spec_sliding_window,
        cache_salt=meta.cache_salt if meta is not None else getattr(ev, "cache_salt", None),
    )


def _batch_error(payload: bytes, error: msgspec.ValidationError) -> DecodeError:
    top = msgspec.msgpack.decode(payload)
    if type(top) is not list:
        return DecodeError("batch_shape", f"batch is a {_kind(top)}, expected an array [ts, events, dp_rank]")
    if not 2 <= len(top) <= 3:
        return DecodeError("batch_shape", f"batch array has {len(top)} elements, expected 2 or 3")
    if type(top[0]) not in (int, float):
        return DecodeError("field_type", f"batch field ts: expected a number, got {_kind(top[0])}")
    if type(top[1]) is not list:
        return DecodeError("batch_shape", f"batch field events: expected an array, got {_kind(top[1])}")
    if len(top) == 3 and top[2] is not None and type(top[2]) is not int:
        got = _kind(top[2])
        return DecodeError("field_type", f"batch field data_parallel_rank: expected int or nil, got {got}")
    return DecodeError("batch_shape", f"bad batch: {error}")


def _opt(t: type) -> Any:
    return lambda v: v is None or type(v) is t


def _list_of(pred: Any) -> Any:
    return lambda v: type(v) is list and all(map(pred, v))


def _is_hash(v: object) -> bool:
    return type(v) is int or type(v) is bytes


def _is_token(v: object) -> bool:
    return type(v) is int or (type(v) is list and len(v) == 2 and type(v[0]) is int and type(v[1]) is int)


# Field name -> (check, expectation), in wire order; the first `_REQUIRED[tag]` are required.
_CHECKS: Final[dict[str, tuple[Any, str]]] = {
    "block_hashes": (_list_of(_is_hash), "an array of int or bin hashes"),
    "parent_block_hash": (lambda v: v is None or _is_hash(v), "nil or an int or bin hash"),
    "token_ids": (_list_of(_is_token), "an array of ints (or of SGLang's [int, int] bigram pairs)"),
    "block_size": (lambda v: type(v) is int and v >= 1, "an int >= 1"),
    "lora_id": (_opt(int), "nil or an int"),
    "medium": (_opt(str), "nil or a string"),
    "lora_name": (
        lambda v: v is None or type(v) in (str, dict),
        "nil or a string (SGLang: its metadata map)",
    ),
    "extra_keys": (lambda v: v is None or _list_of(_opt(list))(v), "nil or an array of nil/arrays"),
    "group_idx": (_opt(int), "nil or an int"),
    "kv_cache_spec_kind": (_opt(str), "nil or a string"),
    "kv_cache_spec_sliding_window": (_opt(int), "nil or an int"),
    "cache_salt": (_opt(str), "nil or a string"),
}
_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    "BlockStored": tuple(_StoredFields.__struct_fields__),
    "BlockRemoved": tuple(_RemovedFields.__struct_fields__),
    "AllBlocksCleared": (),
}
_REQUIRED: Final[dict[str, int]] = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}


def _event_error(index: int, event: object, error: msgspec.ValidationError) -> DecodeError:
    where = f"event {index}"
    if type(event) is list:
        tag = event[0] if event else None
        values = dict(zip(_FIELDS.get(tag, ()) if type(tag) is str else (), event[1:], strict=False))
    elif type(event) is dict:
        tag = event.get("type") if all(type(k) is str for k in event) else None
        values = event
    else:
        return DecodeError("event_shape", f"{where} is a {_kind(event)}, expected an array or a map")
    if type(tag) is not str:
        return DecodeError("event_shape", f"{where}: no event type (first element, or 'type' key)")
    if tag not in _FIELDS:
        return DecodeError("unknown_event", f"{where}: unknown event type {tag!r}")
    names = _FIELDS[tag] + (("cache_salt",) if type(event) is dict and tag == "BlockStored" else ())
    missing = [name for name in names[: _REQUIRED[tag]] if name not in values]
    if missing:
        return DecodeError("event_shape", f"{where} ({tag}): missing field {', '.join(missing)}")
    for name in names:
        check, expected = _CHECKS[name]
        if name in values and not check(values[name]):
            message = f"{where} ({tag}): field {name}: expected {expected}, got {_kind(values[name])}"
            return DecodeError("field_type", message)
    return DecodeError("field_type", f"{where} ({tag}): {error}")


_KIND_NAMES: Final[dict[type, str]] = {list: "array", dict: "map", bytes: "bin", type(None): "nil"}


def _kind(value: object) -> str:
    return _KIND_NAMES.get(type(value), type(value).__name__)
