"""Regenerate the KV-event test vectors in this folder (see README.md).

Genuine vectors are encoded with the engines' own event classes, loaded from their
`kv_events.py` files (extracted from the wheels; passed on the command line, never stored
here) with small stand-ins for their few vLLM / SGLang imports. Hand-built vectors (shapes no
engine class here emits) are encoded with msgspec directly. Each vector is NAME.msgpack (the
exact payload frame) plus NAME.json (the batch a decoder must produce, written out by hand
from the inputs and the rules of shared/reference/kv-events.md, not by our decoder).

  python tests/data/kv_events/generate.py \\
      --vllm 0.9.0=/tmp/vllm-src/kv_events_0.9.0.py --vllm 0.33.0=... \\
      --sglang 0.5.2=/tmp/vllm-src/sglang_0.5.2_kv_events.py --sglang 0.5.23=...
"""

from __future__ import annotations

import argparse
import enum
import importlib.util
import json
import logging
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent
MASK = (1 << 64) - 1
BIG = 0xF0E1D2C3B4A59687  # > 2**63: sent as msgpack uint64
MAX = MASK  # 2**64 - 1
TS = 1767225600.125

Json = dict[str, Any]
Case = tuple[str, Any, Json]  # file stem, batch object to encode, expected decoded batch


# --- stand-ins so the engines' modules import with msgspec and pyzmq only -------------------


def _stub(name: str, **attrs: Any) -> None:
    module = sys.modules.get(name) or types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        _stub(parent)
        setattr(sys.modules[parent], child, module)


class _Config:  # KVEventsConfig (vLLM: a config dataclass; SGLang: a pydantic model)
    pass


def _install_stubs() -> None:
    _stub("vllm.logger", init_logger=logging.getLogger)
    _stub("vllm.config", KVEventsConfig=_Config)
    _stub("vllm.config.kv_events", KVEventsConfig=_Config)
    _stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    _stub(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda host, port: f"tcp://{host}:{port}",
        is_valid_ipv6_address=lambda address: False,
        split_zmq_path=lambda path: ("tcp", "127.0.0.1", "5557"),
    )
    if importlib.util.find_spec("pydantic") is None:
        _stub("pydantic", BaseModel=_Config)
    _stub("sglang.srt.runtime_context", get_parallel=lambda: None)
    _stub("sglang.srt.utils.network", NetworkAddress=object)


def load(path: str, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --- expected values, written from the contract ----------------------------------------------


def u64(value: int | bytes) -> int:
    return int.from_bytes(value[-8:], "big") if isinstance(value, bytes) else value & MASK


def plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def stored(m: Any, tier: str, *, salt: str | None = None, **fields: Any) -> tuple[Any, Json]:
    """An engine BlockStored built with the module's class, and the event we expect."""
    event = m.BlockStored(**fields)
    parent = fields["parent_block_hash"]
    expected = {
        "type": "BlockStored",
        "block_hashes": [u64(h) for h in fields["block_hashes"]],
        "parent_block_hash": None if parent is None else u64(parent),
        "token_ids": fields["token_ids"],
        "block_size": fields["block_size"],
        "tier": tier,
        "lora_name": fields.get("lora_name"),
        "extra_keys": plain(fields.get("extra_keys")),
        "cache_salt": salt,
    }
    return event, expected


def removed(m: Any, tier: str, **fields: Any) -> tuple[Any, Json]:
    expected = {
        "type": "BlockRemoved",
        "block_hashes": [u64(h) for h in fields["block_hashes"]],
        "tier": tier,
        "group": fields.get("group_idx"),
    }
    return m.BlockRemoved(**fields), expected


def skip(pair: tuple[Any, Json]) -> tuple[Any, None]:
    """An event the decoder must drop (its KV group is not full attention)."""
    return pair[0], None


def cleared(m: Any) -> tuple[Any, Json]:
    return m.AllBlocksCleared(), {"type": "AllBlocksCleared"}


def batch(
    m: Any, stem: str, events: Sequence[tuple[Any, Json | None]], dp: int | None = None, dp_field: str = ""
) -> Case:
    """A KVEventBatch of the module; events whose expectation is None must be skipped."""
    extra = {dp_field: dp} if dp_field else {}
    obj = m.KVEventBatch(ts=TS, events=[e for e, _ in events], **extra)
    expected = [x for _, x in events if x is not None]
    partial: list[int] = []  # the groups of the skipped events, in order of appearance
    for e, x in events:
        group = getattr(e, "group_idx", None)
        if x is None and group is not None and group not in partial:
            partial.append(group)
    head = {
        "ts": TS,
        "data_parallel_rank": dp,
        "skipped": len(events) - len(expected),
        "partial_groups": partial,
    }
    return stem, obj, {**head, "events": expected}


def tokens(start: int, n: int) -> list[int]:
    return [(start + 7919 * i) % 151_000 for i in range(n)]


def digest(i: int) -> bytes:
    return bytes((i * 37 + k * 11) % 256 for k in range(32))


# --- cases per engine version ----------------------------------------------------------------


def vllm_cases(m: Any) -> Iterator[Case]:
    """Every shape the module's classes can produce (features detected from its fields)."""
    fields = set(m.BlockStored.__struct_fields__)
    has_medium = "medium" in fields  # with lora_name
    has_extra = "extra_keys" in fields
    has_groups = "kv_cache_spec_kind" in fields
    dp: dict[str, Any] = (
        {"dp": 1, "dp_field": "data_parallel_rank"}
        if "data_parallel_rank" in m.EventBatch.__struct_fields__
        else {}
    )
    gpu = {"medium": "GPU", "lora_name": None} if has_medium else {}

    def s(tier: str, hashes: list[Any], parent: Any, n_tok: int, **kw: Any) -> tuple[Any, Json]:
        return stored(
            m,
            tier,
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens(len(hashes) + n_tok, n_tok),
            block_size=16,
            lora_id=None,
            **{**gpu, **kw},
        )

    events = [s("gpu", [1, BIG], None, 32), s("gpu", [MAX], BIG, 16), s("gpu", [0, 2**63], MAX, 32)]
    if has_medium:
        events += [
            s("gpu", [1234567], 2**63, 16, lora_name="sql-adapter"),
            s("cpu", [BIG, 99], None, 32, medium="CPU"),
            s("gpu", [77], None, 16, medium=None),
        ]
    yield batch(m, "stored", events, **dp)
    removals = [removed(m, "gpu", block_hashes=[BIG, 5], **({"medium": "GPU"} if has_medium else {}))]
    if has_medium:
        removals.append(removed(m, "cpu", block_hashes=[MAX], medium="CPU"))
    yield batch(m, "removed", [*removals, cleared(m)], **dp)
    if has_medium:  # ExternalBlockHash = bytes | int (0.11+): VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
        yield batch(
            m,
            "bytes-hashes",
            [
                s("gpu", [digest(1), digest(2)], None, 32),
                s("gpu", [digest(3)], digest(2), 16),
                removed(m, "gpu", block_hashes=[digest(1)], medium="GPU"),
            ],
            **dp,
        )
    if has_extra:
        yield batch(
            m,
            "extra-keys",
            [
                s(
                    "gpu",
                    [11, 12],
                    None,
                    32,
                    lora_name="sql-adapter",
                    extra_keys=[("sql-adapter",), ("sql-adapter",)],
                ),
                s("gpu", [13, 14], None, 32, extra_keys=[("tenant-a",), None]),
                s("gpu", [15], 14, 16, extra_keys=[(("img-3f9a", 0), ("img-77c1", 12))]),
                s("gpu", [16], 15, 16, extra_keys=None),
            ],
            **dp,
        )
    if has_groups:
        yield batch(
            m,
            "groups",
            [
                s("gpu", [21, 22], None, 32, group_idx=0, kv_cache_spec_kind="full_attention"),
                skip(
                    s(
                        "gpu",
                        [23],
                        None,
                        16,
                        group_idx=1,
                        kv_cache_spec_kind="sliding_window",
                        kv_cache_spec_sliding_window=128,
                    )
                ),
                s("gpu", [24], 22, 16, group_idx=2, kv_cache_spec_kind="mla_attention"),
                skip(s("gpu", [25], None, 16, group_idx=3, kv_cache_spec_kind="mamba")),
                s("gpu", [26], None, 16, group_idx=4, kv_cache_spec_kind="sink_full_attention"),
                skip(s("gpu", [27], None, 16, group_idx=5, kv_cache_spec_kind="chunked_local_attention")),
                s("gpu", [28], None, 16, group_idx=0),
                removed(m, "gpu", block_hashes=[23], medium="GPU", group_idx=1),
            ],
            **dp,
        )
    if "locality" in fields:
        names = (
            [(m.MEDIUM_STORAGE, "storage")]
            if hasattr(m, "MEDIUM_STORAGE")
            else [(m.MEDIUM_FS, "storage"), (m.MEDIUM_OBJ, "storage")]
        )
        yield batch(
            m,
            "tiers",
            [
                *(
                    s(tier, [31 + i], None, 16, medium=name, locality="REMOTE")
                    for i, (name, tier) in enumerate(names)
                ),
                s("cpu", [35], None, 16, medium="CPU", locality="LOCAL"),
                *(
                    removed(m, tier, block_hashes=[31 + i], medium=name)
                    for i, (name, tier) in enumerate(names)
                ),
            ],
            **dp,
        )
    if "lookahead_token_ids" in fields:
        yield batch(
            m,
            "newer-fields",
            [
                s(
                    "gpu",
                    [41],
                    None,
                    16,
                    extra_keys=[("sql-adapter", ("img-3f9a", 0), "tenant-a")],
                    lora_name="sql-adapter",
                    ownership="offload-2",
                    session_id="sess-1",
                    lookahead_token_ids=[[5, 6]],
                ),
                removed(m, "storage", block_hashes=[41], medium="STORAGE", ownership="offload-2"),
            ],
            **dp,
        )


def sglang_cases(m: Any) -> Iterator[Case]:
    maps = not m.KVCacheEvent.__struct_config__.array_like  # and with medium, cache_salt, lora_name
    neg = -0x0F1E2D3C4B5A6978  # SGLang hashes are signed int64
    dp: dict[str, Any] = {"dp": 0, "dp_field": "attn_dp_rank"}

    def s(tier: str, hashes: list[int], parent: int | None, toks: list[int], size: int, **kw: Any) -> Any:
        return stored(
            m,
            tier,
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=toks,
            block_size=size,
            lora_id=None,
            **kw,
        )

    events = [s("gpu", [neg, 5], None, tokens(1, 32), 16), s("gpu", [-1], 5, tokens(2, 16), 16)]
    # page size 1: one event per token; a partial last page of 5 tokens at page size 16
    events += [s("gpu", [-(2**63) + i], None if i == 0 else -(2**63) + i - 1, [900 + i], 1) for i in range(3)]
    events.append(s("gpu", [3], -1, tokens(3, 5), 16))
    if maps:
        medium = m.StorageMedium
        events += [
            s("cpu", [neg], None, tokens(4, 16), 16, medium=medium.CPU),
            s("storage", [neg - 1], None, tokens(5, 16), 16, medium=medium.DISK),
            s("storage", [neg - 2], None, tokens(6, 16), 16, medium=medium.EXTERNAL),
            s(
                "gpu",
                [7],
                None,
                tokens(7, 16),
                16,
                medium=medium.GPU,
                cache_salt="tenant-a",
                salt="tenant-a",
                lora_name="sql-adapter",
                session_id="sess-9",
            ),
        ]
    yield batch(m, "stored", events, **dp)
    removals = [removed(m, "gpu", block_hashes=[neg, -1])]
    if maps:
        removals += [removed(m, "cpu", block_hashes=[neg], medium=m.StorageMedium.CPU)]
        removals += [removed(m, "storage", block_hashes=[neg - 1], medium=m.StorageMedium.DISK)]
    yield batch(m, "removed", [*removals, cleared(m)], dp=None, dp_field="attn_dp_rank")  # a nil rank


def hand_built() -> Iterator[tuple[str, bytes, Json]]:
    enc = msgspec.msgpack.encode

    def exp(events: list[Json], dp: int | None = None, skipped: int = 0, ts: float = TS) -> Json:
        return {
            "ts": ts,
            "data_parallel_rank": dp,
            "skipped": skipped,
            "partial_groups": [],
            "events": events,
        }

    def st(hashes: list[int], tier: str, **kw: Any) -> Json:
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": [1, 2],
            "block_size": 2,
            "tier": tier,
            "lora_name": None,
            "extra_keys": None,
            "cache_salt": None,
            **kw,
        }

    def m(medium: str | None, h: int, **kw: Any) -> Json:
        return {
            "type": "BlockStored",
            "block_hashes": [h],
            "parent_block_hash": None,
            "token_ids": [1, 2],
            "block_size": 2,
            "medium": medium,
            **kw,
        }

    yield (
        "llmd-storage",
        enc(
            [
                TS,
                [
                    m("SHARED_STORAGE", 1),
                    m("OBJECT_STORE", 2),
                    m("shared_storage", 3),
                    {"type": "BlockRemoved", "block_hashes": [1], "medium": "SHARED_STORAGE"},
                ],
                0,
            ]
        ),
        exp(
            [
                st([1], "storage"),
                st([2], "storage"),
                st([3], "storage"),
                {"type": "BlockRemoved", "block_hashes": [1], "tier": "storage", "group": None},
            ],
            dp=0,
        ),
    )
    yield (
        "tier-names",
        enc([TS, [m("Cpu", 1), m("gpu", 2), m("NVME_TIER2", 3), m("cpu_pinned", 4), m("Fs", 5)]]),
        exp([st([1], "cpu"), st([2], "gpu"), st([3], "nvme_tier2"), st([4], "cpu"), st([5], "storage")]),
    )
    yield (
        "unknown-fields",
        enc(
            [
                TS,
                [
                    m("GPU", 1, future_field={"a": [1, 2]}, locality="REMOTE", lora_id=None),
                    [
                        "BlockStored",
                        [2],
                        None,
                        [1, 2],
                        2,
                        None,
                        "GPU",
                        None,
                        None,
                        0,
                        "full_attention",
                        None,
                        "new",
                        7,
                        [8],
                    ],
                    ["BlockRemoved", [2], "GPU", 0, "future"],
                    ["AllBlocksCleared", "future"],
                    {"type": "AllBlocksCleared", "future": 1},
                ],
                None,
            ]
        ),
        exp(
            [
                st([1], "gpu"),
                st([2], "gpu"),
                {"type": "BlockRemoved", "block_hashes": [2], "tier": "gpu", "group": 0},
                {"type": "AllBlocksCleared"},
                {"type": "AllBlocksCleared"},
            ]
        ),
    )
    yield (
        "mixed-forms",
        enc(
            [
                1767225600,
                [
                    ["BlockStored", [1], None, [1, 2], 2, None],
                    {
                        "type": "BlockStored",
                        "block_hashes": [2],
                        "parent_block_hash": 1,
                        "token_ids": [1, 2],
                        "block_size": 2,
                    },
                    ["BlockRemoved", [1]],
                ],
                3,
            ]
        ),
        exp(
            [
                st([1], "gpu"),
                st([2], "gpu", parent_block_hash=1),
                {"type": "BlockRemoved", "block_hashes": [1], "tier": "gpu", "group": None},
            ],
            dp=3,
            ts=1767225600,
        ),
    )
    yield "empty", enc([TS, []]), exp([])


def write(stem: str, payload: bytes, expected: Json, source: str) -> None:
    (HERE / f"{stem}.msgpack").write_bytes(payload)
    head = {"source": source, "batch": {k: v for k, v in expected.items() if k != "events"}}
    events = ",\n".join(f"  {json.dumps(e)}" for e in expected["events"])
    text = json.dumps(head)[:-2] + ', "events": [\n' + events + ("\n" if events else "") + "]}}\n"
    assert json.loads(text) == {"source": source, "batch": expected}
    (HERE / f"{stem}.json").write_text(text)
    print(f"{stem}: {len(payload)} bytes")


def version_arg(text: str) -> tuple[str, str]:
    version, _, path = text.partition("=")
    if not path:
        raise argparse.ArgumentTypeError("expected VERSION=PATH")
    return version, path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--vllm", type=version_arg, action="append", default=[], help="VERSION=path/kv_events.py"
    )
    parser.add_argument(
        "--sglang", type=version_arg, action="append", default=[], help="VERSION=path/kv_events.py"
    )
    args = parser.parse_args()
    _install_stubs()
    encoder = msgspec.msgpack.Encoder()  # what both engines' ZmqEventPublisher encodes with
    engines: list[tuple[str, Callable[[Any], Iterator[Case]], list[tuple[str, str]]]] = [
        ("vllm", vllm_cases, args.vllm),
        ("sglang", sglang_cases, args.sglang),
    ]
    for engine, cases, versions in engines:
        for version, path in versions:
            module = load(path, f"_{engine}_kv_events_{version.replace('.', '_')}")
            for stem, obj, expected in cases(module):
                source = (
                    f"{engine} {version}: its own classes from {Path(path).name}, msgspec.msgpack.Encoder()"
                )
                write(f"{engine}-{version}-{stem}", encoder.encode(obj), expected, source)
    for stem, payload, expected in hand_built():
        write(f"hand-{stem}", payload, expected, "hand-built with msgspec.msgpack.encode (no engine class)")


if __name__ == "__main__":
    main()
