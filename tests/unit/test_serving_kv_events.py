"""KV-event payloads of the simulated engine server: restamped with the wall clock, otherwise untouched."""

from __future__ import annotations

import numpy as np
import pytest

from epp.kvindex.events import BlockRemoved, BlockStored, decode_batch
from epp.testing.kv_wire import encode_batch, removed, stored
from simulator.engine import Engine, EngineConfig
from simulator.kernel import Kernel
from simulator.records import SimRequest
from simulator.serving.kv_events import _plain, restamp


@pytest.mark.parametrize("dp_rank", [None, 0, 3])
def test_restamp_replaces_only_the_timestamp(dp_rank: int | None) -> None:
    events = [stored([1, 2], None, list(range(32))), removed([7])]
    payload = encode_batch(events, dp_rank, ts=0.25)
    again = restamp(payload, 1_700_000_000.5)
    assert len(again) == len(payload) and again[10:] == payload[10:]
    before, after = decode_batch(payload), decode_batch(again)
    assert (before.ts, after.ts) == (0.25, 1_700_000_000.5)
    assert after.events == before.events and after.data_parallel_rank == dp_rank


def test_restamp_of_the_engines_own_batches() -> None:
    batches: list[bytes] = []
    kernel = Kernel()
    engine = Engine(
        kernel, EngineConfig(num_gpu_blocks=8, block_size=4), on_events=lambda s, p, t: batches.append(p)
    )
    engine.submit(SimRequest("a", np.arange(9, dtype=np.int64), max_tokens=2))
    kernel.run()
    assert batches
    for payload in batches:
        batch = decode_batch(restamp(payload, 123.0))
        assert batch.ts == 123.0
        assert all(isinstance(e, (BlockStored, BlockRemoved)) for e in batch.events)


@pytest.mark.parametrize("payload", [b"", b"\x93\x00", b"\x80" + bytes(12), b"\x93\xca" + bytes(12)])
def test_restamp_refuses_what_is_not_a_batch(payload: bytes) -> None:
    with pytest.raises(ValueError, match="float64 timestamp"):
        restamp(payload, 1.0)


@pytest.mark.parametrize(
    ("bound", "plain"),
    [
        ("tcp://[::ffff:127.0.0.1]:5557", "tcp://127.0.0.1:5557"),
        ("tcp://[::]:5557", "tcp://[::]:5557"),
        ("tcp://10.1.2.3:9", "tcp://10.1.2.3:9"),
        ("ipc:///tmp/kv", "ipc:///tmp/kv"),
    ],
)
def test_bound_endpoints_are_shown_without_ipv6_mapping(bound: str, plain: str) -> None:
    assert _plain(bound) == plain
