"""The compiled scan of KV-event batches (`event_scan.py`) against `decode_batch`: every batch it takes
reads exactly as `decode_batch` reads it, and every batch `decode_batch` rejects, it leaves to it."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from benchmarks.kv_decode import make_batches
from epp.kvindex.batch_reader import decode
from epp.kvindex.event_scan import CLEARED, REMOVED, STORED, scan_batch
from epp.kvindex.events import DecodeError
from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import block_keys
from epp.testing.kv_scan import same_reading

M64 = (1 << 64) - 1
enc = msgspec.msgpack.encode


# -- batches of every shape ---------------------------------------------------------------

_int64 = st.integers(-(1 << 63), (1 << 63) - 1)
_hash = st.one_of(
    st.integers(0, M64), _int64, st.binary(min_size=32, max_size=32), st.binary(min_size=16, max_size=16)
)  # (bent ones: the tests below)
_token = st.one_of(
    st.integers(0, 200_000), st.integers(-(1 << 63), M64), st.sampled_from([0, 127, 128, 65535, 65536])
)
_medium = st.sampled_from([None, "GPU", "gpu", "CPU", "cpu_pinned", "DISK", "weird", "ÿ-tier"])
_opt_int = st.one_of(st.none(), st.integers(0, M64), st.integers(-5, 5))


@st.composite
def stored_event(draw: st.DrawFn, form: str) -> Any:
    n = draw(st.integers(0, 4))
    bs = draw(st.sampled_from([1, 2, 16]))
    fields: dict[str, Any] = {
        "block_hashes": draw(st.lists(_hash, min_size=n, max_size=n)),
        "parent_block_hash": draw(st.one_of(st.none(), _hash)),
        "token_ids": draw(st.lists(_token, min_size=0, max_size=n * bs + 1)),
        "block_size": draw(st.sampled_from([bs] * 30 + [0, -1, 1 << 63])),
    }
    optional = {
        "lora_id": _opt_int,
        "medium": _medium,
        "lora_name": st.sampled_from([None, "adapter", "a"]),
        "extra_keys": st.sampled_from(
            [
                None,
                [None] * n,
                [["salt"]] + [None] * max(0, n - 1),
                [],
                [["adapter"]] * n,  # vLLM 0.18+: the adapter's name in every block
                [["a"]] + [None] * max(0, n - 1),
                [["adapter", "salt"]] + [["adapter"]] * max(0, n - 1),  # and the salt in the first
                [["adapter"], ["a"]],
                [[7]] * n,
            ]
        ),
        "group_idx": _opt_int,
        "kv_cache_spec_kind": st.sampled_from([None, "full_attention", "mla_attention", "sliding_window"]),
        "kv_cache_spec_sliding_window": _opt_int,
    }
    if form == "array":
        k = draw(st.integers(0, len(optional)))
        return ["BlockStored", *fields.values(), *[draw(s) for s in list(optional.values())[:k]]]
    for name, strategy in optional.items():
        if draw(st.booleans()):
            fields[name] = draw(strategy)
    if draw(st.integers(0, 5)) == 0:
        fields["cache_salt"] = draw(st.sampled_from([None, "tenant", "", 5]))
    if draw(st.integers(0, 7)) == 0:
        fields["unknown_field"] = 1
    items = [("type", "BlockStored"), *fields.items()]
    if draw(st.booleans()):
        items = draw(st.permutations(items))
    return dict(items)


@st.composite
def removed_event(draw: st.DrawFn, form: str) -> Any:
    hashes = draw(st.lists(_hash, max_size=3))
    medium = draw(_medium)
    if form == "array":
        return ["BlockRemoved", hashes, medium, draw(_opt_int)][: draw(st.integers(2, 4))]
    event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes}
    if draw(st.booleans()):
        event["medium"] = medium
    if draw(st.booleans()):
        event["group_idx"] = draw(_opt_int)
    if draw(st.integers(0, 7)) == 0:  # a field of BlockStored: msgspec ignores it here
        event[draw(st.sampled_from(["token_ids", "lora_name", "block_size"]))] = draw(
            st.sampled_from([[1], "x", 2])
        )
    return event


@st.composite
def batch(draw: st.DrawFn) -> bytes:
    events = []
    for _ in range(draw(st.integers(0, 6))):
        form = draw(st.sampled_from(["map", "array"]))
        kind = draw(st.sampled_from(["stored", "stored", "removed", "cleared"]))
        if kind == "stored":
            events.append(draw(stored_event(form)))
        elif kind == "removed":
            events.append(draw(removed_event(form)))
        else:
            events.append(["AllBlocksCleared"] if form == "array" else {"type": "AllBlocksCleared"})
    ts = draw(st.one_of(st.floats(), st.integers(-(1 << 63), M64)))
    head = [ts, events]
    rank = draw(st.sampled_from(["absent", None, 0, 3, -1, 1 << 64 - 1]))
    if rank != "absent":
        head.append(rank)
    return enc(head)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=batch())
def test_a_batch_the_scan_takes_reads_as_decode_batch_reads_it(payload: bytes) -> None:
    same_reading(payload)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=batch(), data=st.data())
def test_bent_batches_are_left_to_decode_batch_unless_they_read_the_same(payload: bytes, data: Any) -> None:
    """Bytes changed, cut or added anywhere: the scan takes only what decode_batch reads the same way."""
    raw = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 3))):
        action = data.draw(st.sampled_from(["flip", "cut", "add"]))
        at = data.draw(st.integers(0, len(raw)))
        if action == "flip" and at < len(raw):
            raw[at] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del raw[at : at + data.draw(st.integers(1, 4))]
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=4))
    same_reading(bytes(raw))


@pytest.mark.parametrize("form", ["map", "array"])
def test_vllm_batches_are_taken_and_grouped_into_runs(form: str) -> None:
    """The engines' common batch (8 BlockStored, 4 BlockRemoved) is taken by the scan: one run of stores
    and one run of removals, reading as decode_batch reads them."""
    for payload in make_batches(20, form, seed=3):
        scanned = same_reading(payload)
        assert scanned is not None
        assert [run[0] for run in scanned.runs] == [STORED, REMOVED]
        assert scanned.events == 12


def test_runs_split_where_the_tier_model_or_kind_changes() -> None:
    def st_(medium: str | None, lora: str | None = None) -> dict[str, Any]:
        return {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
                "block_size": 2, "medium": medium, "lora_name": lora}  # fmt: skip

    events = [
        st_("GPU"), st_(None), st_("CPU"), st_("CPU", "a"), st_("CPU", "a"),
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"},
        {"type": "AllBlocksCleared"}, {"type": "AllBlocksCleared"},
    ]  # fmt: skip
    scanned = same_reading(enc([1.0, events]))
    assert scanned is not None
    # "GPU" and nil are the same tier but not the same bytes: separate runs, applied alike
    kinds = [(run[0], len(run[5]) if run[0] == STORED else None) for run in scanned.runs]  # type: ignore[misc]
    assert kinds == [
        (STORED, 1),
        (STORED, 1),
        (STORED, 1),
        (STORED, 2),
        (REMOVED, None),
        (CLEARED, None),
        (CLEARED, None),
    ]
    assert scanned.runs[4] == (REMOVED, "gpu", [1, 2], None, 2)


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (enc([1.0, [["BlockStored", [1], None, [1], 1]]]) + b"\x00", "trailing bytes"),
        (
            enc(
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [1],
                            "parent_block_hash": None,
                            "token_ids": [1],
                            "block_size": 1,
                            "extra": 1,
                        }
                    ],
                ]
            ),
            "unknown field",
        ),
        (enc([1.0, [["BlockStored", [1], None, [1], 1, None, None, None, [["salt"]]]]]), "a tenant salt"),
        (
            enc([1.0, [["BlockStored", [1], None, [1], 1, None, None, "ad", [["ad", "s"]]]]]),
            "an adapter's salt",
        ),
        (enc([1.0, [["BlockStored", [1], None, [1], 1, None, None, "ad", [["other"]]]]]), "not the adapter"),
        (enc([1.0, [["BlockStored", [b"\x00" * 8], None, [1], 1]]]), "an 8-byte hash"),
        (enc([1.0, [["BlockStored", [1], None, [1.5], 1]]]), "a float token id"),
        (enc([1.0, [["BlockRemoved", [True]]]]), "a bool hash"),
        (b"\x92\xcb" + bytes(8) + b"\x91\x91\xa9BlockGone", "an unknown event"),
        (enc([1.0, [["BlockStored", [1], None, [1], 1, None, b"\xff"]]]), "a medium that is bin"),
        (b"\x93\xcb" + bytes(8) + b"\x90\xcf" + bytes([255] * 8), "a dp rank beyond int64"),
    ],
)
def test_shapes_outside_the_scan_are_left_to_decode_batch(payload: bytes, why: str) -> None:
    assert scan_batch(payload) is None, why
    same_reading(payload)


def test_a_medium_that_is_not_utf8_is_left_to_decode_batch_which_names_it() -> None:
    payload = enc([1.0, [["BlockRemoved", [1], "x"]]]).replace(b"\xa1x", b"\xa1\xff")
    assert scan_batch(payload) is None
    with pytest.raises(DecodeError):
        decode(payload)


def test_digests_and_signed_hashes_read_as_engine_hash() -> None:
    digest = bytes(range(32))
    payload = enc([2, [["BlockStored", [digest, -1, 1 << 63], digest[:16], [1, 2, 3], 1, None, "cpu"]], None])
    scanned = same_reading(payload)
    assert scanned is not None and scanned.ts == 2.0 and scanned.data_parallel_rank is None
    run = scanned.runs[0]
    assert run[4] == [int.from_bytes(digest[-8:], "big"), M64, 1 << 63]  # type: ignore[misc]
    assert run[5] == [int.from_bytes(digest[8:16], "big")]  # type: ignore[misc]


def test_float32_timestamps_and_ranks() -> None:
    payload = b"\x93\xca" + np.float32(1.5).byteswap().tobytes() + b"\x90\x05"
    scanned = same_reading(payload)
    assert scanned is not None and (scanned.ts, scanned.data_parallel_rank) == (1.5, 5)


def test_lora_batches_with_the_adapter_in_extra_keys_are_taken() -> None:
    """vLLM 0.18+ puts the adapter's name in every block's extra keys: the scan takes such a batch (one
    run, no salt), as decode_batch reads it."""
    events = [
        ["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None, "GPU", "ad", [["ad"], ["ad"]]],
        ["BlockStored", [3], 2, [5, 6], 2, None, "GPU", "ad", [["ad"]]],
    ]
    scanned = same_reading(enc([1.0, events]))
    assert scanned is not None and len(scanned.runs) == 1
    run = scanned.runs[0]
    assert (run[0], run[2], run[3], run[4]) == (STORED, "ad", None, [1, 2, 3])  # type: ignore[misc]


def test_other_kv_groups_are_skipped_and_counted() -> None:
    events = [
        ["BlockStored", [1], None, [1], 1, None, None, None, None, 1, "sliding_window", 128],
        ["BlockStored", [2], None, [2], 1, None, None, None, None, 0, "full_attention", None],
    ]
    scanned = same_reading(enc([1.0, events]))
    assert scanned is not None and (scanned.events, scanned.skipped) == (1, 1)


@example(seed=0)
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_random_garbage_is_never_taken_as_something_else(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        size = rng.randrange(0, 64)
        same_reading(bytes([rng.choice([0x92, 0x93, 0xCB, 0x90, 0x91, 0xC0, 0xDC, 0xDE, rng.randrange(256)])
                            for _ in range(size)]))  # fmt: skip


# -- store_run: the index side of a run ------------------------------------------------------


def test_store_run_rejects_columns_that_do_not_add_up() -> None:
    index = BlockIndex(block_size=2)
    with pytest.raises(ValueError, match="differ in length"):
        index.store_run("p", "gpu", 1, [1, 2], [None], [1, 1], np.arange(4), [2, 2], [2, 2])
    with pytest.raises(ValueError, match="add up"):
        index.store_run("p", "gpu", 1, [1, 2], [None, 1], [1, 1], np.arange(3), [2, 2], [2, 2])
    assert index.stats().entries == 0 and index.pods() == []


def test_store_run_refuses_a_hash_array_that_is_not_the_hashes() -> None:
    index = BlockIndex(block_size=2)
    args = ("p", "gpu", 1, [1, 2], [None, 1], [1, 1], np.arange(4), [2, 2], [2, 2])
    for bad in (np.array([1, 2, 3], dtype=np.uint64), np.array([1, 2], dtype=np.int64)):
        with pytest.raises(ValueError, match="hash_array"):
            index.store_run(*args, bad)  # type: ignore[arg-type]
    assert index.stats().entries == 0 and index.pods() == []
    index.store_run(*args, np.array([1, 2], dtype=np.uint64))  # type: ignore[arg-type]  # (nothing lost)
    assert index.stats().entries == 2


@pytest.mark.parametrize("arrays", ["all", "none", "mixed"])
def test_runs_queued_with_their_hash_arrays_index_as_without(arrays: str) -> None:
    """The scan hands ingestion each run's hashes as a uint64 array too, which the queue keeps instead of
    converting the Python ints at the flush; with every run's array, none, or some, the index is the same
    (hashes above 2^63 included)."""
    rng = random.Random(5)

    def runs() -> list[tuple[list[int], list[int | None]]]:
        out: list[tuple[list[int], list[int | None]]] = []
        parent: int | None = None
        for _ in range(40):
            hashes = [rng.getrandbits(64) | (1 << 63) * rng.randrange(2) for _ in range(6)]
            parents: list[int | None] = [parent, hashes[2]]
            out.append((hashes, parents))
            parent = hashes[-1] if rng.random() < 0.7 else None
        return out

    def build(with_array: bool | None) -> BlockIndex:
        index = BlockIndex(block_size=4)
        for i, (hashes, parents) in enumerate(plan):
            use = with_array if with_array is not None else i % 2 == 0
            array = np.array(hashes, dtype=np.uint64) if use else None
            tokens = np.arange(i * 24, i * 24 + 24, dtype=np.int64)
            assert (
                index.store_run("p", "gpu", 7, hashes, parents, [3, 3], tokens, [12, 12], [4, 4], array) == 0
            )
        index.flush()
        return index

    plan = runs()
    reference = build(False)
    index = build({"all": True, "none": False, "mixed": None}[arrays])
    assert index.stats() == reference.stats() and index.stats().entries == 240
    chain: list[int] = []  # each run's prompt: its chain's tokens up to its last block
    for i, (_, parents) in enumerate(plan):
        chain = ([] if parents[0] is None else chain) + list(range(i * 24, i * 24 + 24))
        keys = block_keys(chain, 4, 7)
        assert (
            index.lookup(keys, ["p"])
            == reference.lookup(keys, ["p"])
            == {"p": {"gpu": len(keys), "any": len(keys)}}
        )
    # The records carry the right engine hashes: removing some runs' middle blocks by their hashes ends those
    # prefixes there, as in the reference (records under the wrong hashes would end others).
    for idx in (index, reference):
        for hashes, _ in plan[::4]:
            assert idx.remove("p", [hashes[2]], "gpu") == 1
    chain = []
    cut = 0
    for i, (_, parents) in enumerate(plan):
        chain = ([] if parents[0] is None else chain) + list(range(i * 24, i * 24 + 24))
        keys = block_keys(chain, 4, 7)
        got = index.lookup(keys, ["p"])
        assert got == reference.lookup(keys, ["p"])
        cut += got["p"]["gpu"] < len(keys)
    assert 0 < cut < len(plan)


def test_batches_of_many_short_events_are_taken_whole() -> None:
    """More events than the scan's first guess from the payload's size (it tries again with room for all)."""
    events = [["BlockRemoved", [i], "GPU"] if i % 3 else ["AllBlocksCleared"] for i in range(300)]
    scanned = same_reading(enc([1.0, events]))
    assert scanned is not None and scanned.events == 300
    assert sum(len(run[2]) for run in scanned.runs if run[0] == REMOVED) == 200  # type: ignore[misc]
