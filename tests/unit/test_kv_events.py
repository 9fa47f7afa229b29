"""The KV-event decoder: genuine engine vectors, every shape of the contract, every error."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.kv_decode import BLOCK_EVENTS_PER_BATCH, make_batches
from epp.kvindex import events as events_module
from epp.kvindex.events import (
    CPU,
    GPU,
    KNOWN_TIERS,
    STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    decode_batch,
    engine_hash,
    normalize_tier,
)
from tests.unit.test_architecture import violations

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "kv_events"
VECTORS = sorted(DATA.glob("*.msgpack"))
TS = 1767225600.5
enc = msgspec.msgpack.encode


def plain(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def as_json(batch: EventBatch) -> dict[str, Any]:
    def event(e: object) -> dict[str, Any]:
        fields = {f.name: plain(getattr(e, f.name)) for f in dataclasses.fields(e)}  # type: ignore[arg-type]
        return {"type": type(e).__name__, **fields}

    return {
        "ts": batch.ts,
        "data_parallel_rank": batch.data_parallel_rank,
        "skipped": batch.skipped,
        "partial_groups": list(batch.partial_groups),
        "events": [event(e) for e in batch.events],
    }


def stored(hashes: list[Any], parent: Any = None, *extra: Any) -> list[Any]:
    """An array-form BlockStored with 2 tokens per block, then any trailing fields."""
    return ["BlockStored", hashes, parent, list(range(2 * len(hashes))), 2, *extra]


def mstored(hashes: list[Any], parent: Any = None, **fields: Any) -> dict[str, Any]:
    base = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent}
    return {**base, "token_ids": list(range(2 * len(hashes))), "block_size": 2, **fields}


def one(event: Any) -> Any:
    """The single event a one-event batch decodes to."""
    batch = decode_batch(enc([TS, [event]]))
    assert len(batch.events) == 1
    return batch.events[0]


def expect_stored(hashes: list[int], parent: int | None = None, tier: str = GPU, **kw: Any) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(range(2 * len(hashes))), 2, tier, **kw)


# --- genuine and hand-built vectors ------------------------------------------------------------


def test_vectors_cover_every_engine_version() -> None:
    stems = {p.stem for p in VECTORS}
    for version in ["0.9.0", "0.14.0", "0.18.0", "0.22.0", "0.24.0", "0.26.0", "0.33.0"]:
        assert {f"vllm-{version}-stored", f"vllm-{version}-removed"} <= stems, version
    assert {"sglang-0.5.2-stored", "sglang-0.5.23-stored", "vllm-0.22.0-groups", "vllm-0.33.0-tiers"} <= stems
    assert all(p.with_suffix(".json").exists() for p in VECTORS)
    assert sum(p.stat().st_size for p in DATA.iterdir()) < 200_000


@pytest.mark.parametrize("path", VECTORS, ids=lambda p: p.stem)
def test_vector_decodes_to_its_expected_batch(path: pathlib.Path) -> None:
    expected = json.loads(path.with_suffix(".json").read_text())["batch"]
    assert as_json(decode_batch(path.read_bytes())) == expected


@pytest.mark.parametrize("path", VECTORS, ids=lambda p: p.stem)
def test_truncated_vector_is_a_msgpack_error(path: pathlib.Path) -> None:
    payload = path.read_bytes()
    for cut in {1, len(payload) // 2, len(payload) - 1}:
        with pytest.raises(DecodeError) as info:
            decode_batch(payload[:cut])
        assert info.value.reason == "msgpack"


# --- shapes --------------------------------------------------------------------------------------

SHAPES = [
    # array form, vLLM 0.9 (6 elements) up to 0.22/0.23 (12), and the bare minimum
    ("array-5", stored([1]), expect_stored([1])),
    ("array-6-0.9", stored([1], 9, None), expect_stored([1], 9)),
    ("array-7-medium", stored([1], None, 3, "CPU"), expect_stored([1], tier=CPU)),
    ("array-8-lora", stored([1], None, None, None, "sql"), expect_stored([1], lora_name="sql")),
    (
        "array-9-extra",
        stored([1], None, None, "GPU", None, [["s"]]),
        expect_stored([1], extra_keys=(("s",),)),
    ),
    ("array-10-group", stored([1, 2], 5, None, "GPU", None, None, 3), expect_stored([1, 2], 5)),  # 0.20/0.21
    ("array-11-kind", stored([1], None, None, "GPU", None, None, 1, "mla_attention"), expect_stored([1])),
    (
        "array-12-groups",
        stored([1, 2], 5, None, "GPU", None, None, 0, "full_attention", None),
        expect_stored([1, 2], 5),
    ),
    ("array-removed-2", ["BlockRemoved", [4]], BlockRemoved((4,), GPU)),
    ("array-removed-3", ["BlockRemoved", [4], "CPU"], BlockRemoved((4,), CPU)),
    ("array-removed-4", ["BlockRemoved", [4], "DISK", 1], BlockRemoved((4,), STORAGE, 1)),
    ("array-cleared", ["AllBlocksCleared"], AllBlocksCleared()),
    # map form: defaulted fields left out, or all present
    ("map-minimal", mstored([1]), expect_stored([1])),
    (
        "map-full",
        mstored(
            [1],
            7,
            lora_id=None,
            medium="CPU",
            lora_name="a",
            extra_keys=[["a", ["mm", 0], "s"]],
            group_idx=0,
            kv_cache_spec_kind="mla_attention",
            kv_cache_spec_sliding_window=None,
            cache_salt="s",
            locality="LOCAL",
            ownership=None,
            session_id="x",
            lookahead_token_ids=[[1]],
        ),
        expect_stored([1], 7, CPU, lora_name="a", extra_keys=(("a", ("mm", 0), "s"),), cache_salt="s"),
    ),
    (
        "map-nil-extra-entries",
        mstored([1, 2], extra_keys=[None, None]),
        expect_stored([1, 2], extra_keys=(None, None)),
    ),
    ("map-removed", {"type": "BlockRemoved", "block_hashes": [4]}, BlockRemoved((4,), GPU)),
    (
        "map-removed-medium",
        {"type": "BlockRemoved", "block_hashes": [4], "medium": "obj"},
        BlockRemoved((4,), STORAGE),
    ),
    ("map-cleared", {"type": "AllBlocksCleared"}, AllBlocksCleared()),
    ("map-type-key-last", {k: v for k, v in reversed(mstored([1]).items())}, expect_stored([1])),
    ("empty-hashes", mstored([]), expect_stored([])),
    # SGLang: partial pages and page size 1
    (
        "sglang-partial",
        mstored([3], block_size=16, token_ids=[1, 2, 3]),
        BlockStored((3,), None, (1, 2, 3), 16, GPU),
    ),
    ("sglang-page-1", mstored([3], block_size=1, token_ids=[9]), BlockStored((3,), None, (9,), 1, GPU)),
    # SGLang with EAGLE: [token, next token] bigram pairs, read as the first token of each
    (
        "sglang-bigrams",
        mstored([3], block_size=2, token_ids=[[7, 8], [8, 9]]),
        BlockStored((3,), None, (7, 8), 2, GPU),
    ),
    (
        "sglang-bigrams-array",
        [*stored([3])[:3], [[7, 8], [8, 9]], 2, None],
        BlockStored((3,), None, (7, 8), 2, GPU),
    ),
    # SGLang 0.5.18-0.5.19: a salted request's array BlockStored ends with {"cache_salt": ...}
    (
        "sglang-0.5.19-metadata",
        stored([1], None, None, "CPU_PINNED", {"cache_salt": "t"}),
        expect_stored([1], tier=CPU, cache_salt="t"),
    ),
]


@pytest.mark.parametrize(("event", "expected"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_event_shape(event: Any, expected: object) -> None:
    assert one(event) == expected


@pytest.mark.parametrize(
    ("batch", "dp"),
    [([TS, []], None), ([TS, [], None], None), ([TS, [], 3], 3), ([17, []], None)],
    ids=["two-elements", "nil-rank", "rank", "int-ts"],
)
def test_batch_shapes(batch: list[Any], dp: int | None) -> None:
    decoded = decode_batch(enc(batch))
    assert decoded == EventBatch(float(batch[0]), (), dp, 0)


def test_batch_mixing_array_and_map_events_decodes() -> None:
    batch = decode_batch(enc([TS, [stored([1]), mstored([2], 1), ["BlockRemoved", [1]]], 0]))
    assert batch.events == (expect_stored([1]), expect_stored([2], 1), BlockRemoved((1,), GPU))


def test_unknown_fields_are_ignored() -> None:
    event = mstored([1], future={"x": [1, 2]}, locality="REMOTE")
    assert one(event) == expect_stored([1])
    long_array = stored([1], None, None, "GPU", None, None, 0, "full_attention", None, "new", [1], {"a": 1})
    assert one(long_array) == expect_stored([1])
    assert one(["BlockRemoved", [1], "GPU", 0, "future"]) == BlockRemoved((1,), GPU, 0)
    assert one(["AllBlocksCleared", 1, 2]) == AllBlocksCleared()


# --- hashes -------------------------------------------------------------------------------------

DIGEST = bytes(range(32))
LAST8 = int.from_bytes(DIGEST[-8:], "big")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (5, 5),
        (2**63, 2**63),
        (2**64 - 1, 2**64 - 1),
        (-1, 2**64 - 1),
        (-(2**63), 2**63),
        (-5, 2**64 - 5),
        (DIGEST, LAST8),
        (DIGEST[:16], int.from_bytes(DIGEST[8:16], "big")),
    ],
)
def test_engine_hash(value: int | bytes, expected: int) -> None:
    assert engine_hash(value) == expected


@pytest.mark.parametrize("value", [b"", b"1234567", bytes(8), bytes(20), bytes(33), True, "abc", 1.5])
def test_engine_hash_rejects(value: Any) -> None:
    with pytest.raises(DecodeError) as info:
        engine_hash(value)
    assert info.value.reason == "field_type"


@pytest.mark.parametrize(
    ("hashes", "parent", "expected", "expected_parent"),
    [
        ([2**64 - 1, 2**63], 2**63 + 1, [2**64 - 1, 2**63], 2**63 + 1),
        ([-1, -(2**63), 7], -2, [2**64 - 1, 2**63, 7], 2**64 - 2),
        ([DIGEST, 3], DIGEST, [LAST8, 3], LAST8),
        ([DIGEST[:16]], None, [int.from_bytes(DIGEST[8:16], "big")], None),
    ],
    ids=["uint64", "signed", "bytes", "bytes16"],
)
@pytest.mark.parametrize("form", ["array", "map"])
def test_hashes_in_events(
    hashes: list[Any], parent: Any, expected: list[int], expected_parent: Any, form: str
) -> None:
    event = stored(hashes, parent) if form == "array" else mstored(hashes, parent)
    assert one(event) == expect_stored(expected, expected_parent)
    removal = (
        ["BlockRemoved", hashes] if form == "array" else {"type": "BlockRemoved", "block_hashes": hashes}
    )
    assert one(removal) == BlockRemoved(tuple(expected), GPU)


# --- tiers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (None, GPU),
        ("GPU", GPU),
        ("gpu", GPU),
        ("Gpu", GPU),
        ("CPU", CPU),
        ("cpu", CPU),
        ("CPU_PINNED", CPU),
        ("Cpu_Pinned", CPU),
        ("STORAGE", STORAGE),
        ("FS", STORAGE),
        ("fs", STORAGE),
        ("OBJ", STORAGE),
        ("DISK", STORAGE),
        ("SHARED_STORAGE", STORAGE),
        ("OBJECT_STORE", STORAGE),
        ("object_store", STORAGE),
        ("EXTERNAL", STORAGE),
        ("NVME_TIER2", "nvme_tier2"),
        ("Remote-HBM", "remote-hbm"),
        ("", ""),
    ],
)
def test_normalize_tier(medium: str | None, tier: str) -> None:
    assert normalize_tier(medium) == tier
    assert one(mstored([1], medium=medium)).tier == tier
    assert one(["BlockRemoved", [1], medium]).tier == tier


def test_known_tiers() -> None:
    assert frozenset({"gpu", "cpu", "storage"}) == KNOWN_TIERS
    assert normalize_tier("NVME") not in KNOWN_TIERS


# --- KV groups ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "kept"),
    [
        (None, True),
        ("full_attention", True),
        ("mla_attention", True),
        ("sink_full_attention", True),
        ("sliding_window", False),
        ("sliding_window_mla", False),
        ("mamba", False),
        ("chunked_local_attention", False),
        ("cross_attention", False),
        ("unknown", False),
        ("FULL", False),
    ],
)
@pytest.mark.parametrize("form", ["array", "map"])
def test_non_full_attention_groups_are_skipped(kind: str | None, kept: bool, form: str) -> None:
    if form == "array":
        event: Any = stored([1], None, None, "GPU", None, None, 1, kind, 128)
    else:
        event = mstored([1], group_idx=1, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=128)
    batch = decode_batch(enc([TS, [event, ["AllBlocksCleared"]]]))
    assert batch.events == ((expect_stored([1]),) if kept else ()) + (AllBlocksCleared(),)
    assert batch.skipped == (0 if kept else 1)


# --- malformed input ------------------------------------------------------------------------------

GOOD = stored([1])
BAD = [
    ("empty", b"", "msgpack", ""),
    ("never-used-byte", b"\xc1", "msgpack", ""),
    ("truncated", enc([TS, [GOOD]])[:-3], "msgpack", ""),
    ("trailing-bytes", enc([TS, []]) + b"\x00", "msgpack", ""),
    ("str", enc("batch"), "batch_shape", ""),
    ("int", enc(5), "batch_shape", ""),
    ("map", enc({"ts": TS, "events": []}), "batch_shape", ""),
    ("empty-array", enc([]), "batch_shape", ""),
    ("one-element", enc([TS]), "batch_shape", ""),
    ("four-elements", enc([TS, [], 0, 1]), "batch_shape", ""),
    ("events-map", enc([TS, {"a": 1}]), "batch_shape", "events"),
    ("events-nil", enc([TS, None]), "batch_shape", "events"),
    ("ts-str", enc(["now", []]), "field_type", "ts"),
    ("ts-bool", enc([True, []]), "field_type", "ts"),
    ("rank-str", enc([TS, [], "0"]), "field_type", "data_parallel_rank"),
    ("unknown-array-tag", enc([TS, [GOOD, ["BlockEvicted", [1]]]]), "unknown_event", "event 1"),
    ("unknown-map-tag", enc([TS, [GOOD, {"type": "BlockEvicted"}]]), "unknown_event", "event 1"),
    ("event-int", enc([TS, [GOOD, 5]]), "event_shape", "event 1"),
    ("event-str", enc([TS, [GOOD, "BlockStored"]]), "event_shape", "event 1"),
    ("event-empty-array", enc([TS, [GOOD, []]]), "event_shape", "event 1"),
    ("event-int-tag", enc([TS, [GOOD, [3, [1]]]]), "event_shape", "event 1"),
    ("map-no-type", enc([TS, [GOOD, {"block_hashes": [1]}]]), "event_shape", "event 1"),
    ("map-int-type", enc([TS, [GOOD, {"type": 1}]]), "event_shape", "event 1"),
    ("map-int-key", enc([TS, [GOOD, {**mstored([1]), 5: 1}]]), "event_shape", "event 1"),
    (
        "array-stored-short",
        enc([TS, [GOOD, ["BlockStored", [1], None, [1, 2]]]]),
        "event_shape",
        "block_size",
    ),
    ("array-removed-short", enc([TS, [GOOD, ["BlockRemoved"]]]), "event_shape", "block_hashes"),
    (
        "map-missing-tokens",
        enc(
            [
                TS,
                [
                    GOOD,
                    {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "block_size": 2},
                ],
            ]
        ),
        "event_shape",
        "token_ids",
    ),
    (
        "map-missing-parent",
        enc([TS, [GOOD, {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 2}]]),
        "event_shape",
        "parent_block_hash",
    ),
    (
        "map-removed-missing-hashes",
        enc([TS, [GOOD, {"type": "BlockRemoved"}]]),
        "event_shape",
        "block_hashes",
    ),
]
FIELD_TYPES: list[tuple[str, str, Any]] = [
    ("hashes-int", "block_hashes", 5),
    ("hashes-str", "block_hashes", "abc"),
    ("hashes-float", "block_hashes", [1, 2.5]),
    ("hashes-nil-entry", "block_hashes", [1, None]),
    ("hashes-bool-entry", "block_hashes", [True]),
    ("hashes-bytes-7", "block_hashes", [b"1234567"]),
    ("hashes-bytes-20", "block_hashes", [1, bytes(20)]),
    ("parent-str", "parent_block_hash", "x"),
    ("parent-list", "parent_block_hash", [1]),
    ("parent-bytes-9", "parent_block_hash", bytes(9)),
    ("tokens-str", "token_ids", "abc"),
    ("tokens-nil", "token_ids", None),
    ("tokens-float", "token_ids", [1, 2.0]),
    ("tokens-str-entry", "token_ids", [1, "2"]),
    ("tokens-bool-entry", "token_ids", [1, False]),
    ("tokens-nested", "token_ids", [[1, 2, 3]]),  # (a pair [1, 2] is SGLang's EAGLE bigram: valid)
    ("tokens-pair-str", "token_ids", [[1, "2"]]),
    ("tokens-mixed-pairs", "token_ids", [1, [2, 3]]),
    ("block-size-str", "block_size", "16"),
    ("block-size-zero", "block_size", 0),
    ("block-size-nil", "block_size", None),
    ("lora-id-str", "lora_id", "1"),
    ("medium-int", "medium", 1),
    ("lora-name-int", "lora_name", 1),
    ("extra-keys-str", "extra_keys", "salt"),
    ("extra-keys-entry-str", "extra_keys", ["salt"]),
    ("group-str", "group_idx", "0"),
    ("kind-int", "kv_cache_spec_kind", 1),
    ("window-str", "kv_cache_spec_sliding_window", "128"),
]
ARRAY_INDEX = {name: i for i, name in enumerate(events_module._FIELDS["BlockStored"], start=1)}


def _array_event_with(field: str, value: Any) -> list[Any]:
    event: list[Any] = stored([1], None, None, "GPU", None, None, 0, "full_attention", None)
    event[ARRAY_INDEX[field]] = value
    return event


for _name, _field, _value in FIELD_TYPES:
    BAD.append((f"array-{_name}", enc([TS, [GOOD, _array_event_with(_field, _value)]]), "field_type", _field))
    BAD.append((f"map-{_name}", enc([TS, [GOOD, mstored([1], **{_field: _value})]]), "field_type", _field))
BAD += [
    ("map-cache-salt-int", enc([TS, [GOOD, mstored([1], cache_salt=5)]]), "field_type", "cache_salt"),
    ("removed-hashes-str", enc([TS, [GOOD, ["BlockRemoved", ["a"]]]]), "field_type", "block_hashes"),
    ("removed-bytes-31", enc([TS, [GOOD, ["BlockRemoved", [bytes(31)]]]]), "field_type", "block_hashes"),
    (
        "removed-medium-int",
        enc([TS, [GOOD, {"type": "BlockRemoved", "block_hashes": [1], "medium": 2}]]),
        "field_type",
        "medium",
    ),
    ("removed-group-str", enc([TS, [GOOD, ["BlockRemoved", [1], None, "0"]]]), "field_type", "group_idx"),
]


@pytest.mark.parametrize(("payload", "reason", "mentions"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_input(payload: bytes, reason: str, mentions: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_batch(payload)
    assert info.value.reason == reason
    assert mentions in str(info.value)
    if reason in ("event_shape", "unknown_event") or (reason == "field_type" and mentions in ARRAY_INDEX):
        assert "event 1" in str(info.value)  # the bad event follows a good one


def test_decode_error_is_a_value_error() -> None:
    assert issubclass(DecodeError, ValueError)
    error = DecodeError("msgpack", "boom")
    assert (error.reason, str(error)) == ("msgpack", "boom")


def test_deep_nesting_is_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        decode_batch(b"\x91" * 100_000)
    with pytest.raises(DecodeError):
        decode_batch(enc([TS, [mstored([1], extra_keys=[["x"]])]])[:-1] + b"\x91" * 50_000)


# --- the decoded values -----------------------------------------------------------------------------


def test_decoded_events_are_ordinary_frozen_dataclasses() -> None:
    batch = decode_batch(enc([TS, [mstored([1], extra_keys=[["a", ["mm", 0]]]), ["BlockRemoved", [-1]]], 2]))
    built = EventBatch(
        TS, (expect_stored([1], extra_keys=(("a", ("mm", 0)),)), BlockRemoved((2**64 - 1,), GPU)), 2, 0
    )
    assert batch == built and hash(batch) == hash(built)
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved] and type(batch) is EventBatch
    assert repr(batch) == repr(built)
    for obj in (batch, *batch.events):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, dataclasses.fields(obj)[0].name, None)
    removal = batch.events[1]
    assert isinstance(removal, BlockRemoved)
    assert dataclasses.replace(removal, tier=CPU) == BlockRemoved((2**64 - 1,), CPU)


def test_cleared_is_always_equal() -> None:
    assert decode_batch(enc([TS, [["AllBlocksCleared"]]])).events == (AllBlocksCleared(),)


def test_module_is_pure() -> None:
    assert violations(pathlib.Path(events_module.__file__).read_text()) == []


def test_benchmark_batches_decode_alike_in_both_forms() -> None:
    decoded = {form: [decode_batch(p) for p in make_batches(3, form, seed=1)] for form in ("map", "array")}
    assert decoded["map"] == decoded["array"]
    for batch in decoded["map"]:
        blocks = sum(len(e.block_hashes) for e in batch.events if not isinstance(e, AllBlocksCleared))
        assert blocks == BLOCK_EVENTS_PER_BATCH


# --- fuzzing ---------------------------------------------------------------------------------------

_INT = st.integers(min_value=-(2**63), max_value=2**64 - 1)
_SCALAR = st.none() | st.booleans() | _INT | st.floats() | st.text(max_size=8) | st.binary(max_size=40)
_TAGS = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other", "type"])
_ANY = st.recursive(
    _SCALAR | _TAGS,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8) | _TAGS, inner, max_size=4)
    ),
    max_leaves=30,
)
_EVENT = st.one_of(
    st.tuples(
        _TAGS, st.lists(_INT | st.binary(max_size=33), max_size=3), _ANY, st.lists(_INT, max_size=4), _ANY
    )
    .map(list)
    .flatmap(lambda head: st.lists(_ANY, max_size=8).map(lambda tail: head + tail)),
    st.fixed_dictionaries(
        {"type": _TAGS, "block_hashes": _ANY}, optional={"token_ids": _ANY, "medium": _ANY}
    ),
    _ANY,
)


def _decode_or_error(payload: bytes) -> None:
    try:
        result = decode_batch(payload)
    except DecodeError as e:
        assert e.reason in {"msgpack", "batch_shape", "event_shape", "field_type", "unknown_event"}
    else:
        assert isinstance(result, EventBatch)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes(payload: bytes) -> None:
    _decode_or_error(payload)


@settings(max_examples=500, deadline=None)
@given(_ANY)
def test_arbitrary_msgpack(value: Any) -> None:
    _decode_or_error(enc(value))


@settings(max_examples=500, deadline=None)
@given(st.floats() | _INT, st.lists(_EVENT, max_size=4), _ANY)
def test_arbitrary_batches(ts: Any, events: list[Any], dp: Any) -> None:
    _decode_or_error(enc([ts, events, dp]))
    _decode_or_error(enc([ts, events]))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(VECTORS), st.data())
def test_corrupted_vectors(path: pathlib.Path, data: st.DataObject) -> None:
    payload = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    _decode_or_error(bytes(payload))
