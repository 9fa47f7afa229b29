"""Central mode over real ZeroMQ sockets on loopback: the EPP binds one SUB, engines connect to it and name
themselves in the topic `kv@<ip:port>@<model>`. Gaps healed through the engine's replay ROUTER (at the
pod's host, replay port + data-parallel rank), engine restarts, and gaps without replay."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from epp.config import KvEventsConfig
from epp.kvindex.freshness import Freshness
from epp.kvindex.keys import block_keys, root_key
from epp.sources.kv_events import UNKNOWN_POD
from epp.testing.envoy import free_port
from epp.testing.kv_publisher import KvEventPublisher, cleared, removed, stored
from epp.testing.wait import eventually

from .test_kv_subscriber import BS, POD_A, POD_B, Rig, joined, rig, tokens

POD_HOST = POD_A.rpartition(":")[0]  # where the engine's replay ROUTER listens


def central(port: int, replay: int | None = None) -> KvEventsConfig:
    return KvEventsConfig(
        mode="central",
        bind=f"tcp://127.0.0.1:{port}",
        replay_port=replay,
        replay_timeout=1.0,
        sync_interval=0.05,
    )


def engine(port: int, replay: int | None = None, dp_rank: int | None = None) -> KvEventPublisher:
    """An engine of POD_A connecting to the EPP's central SUB, with its replay ROUTER (if any) bound on
    the pod's host at `replay`."""
    return KvEventPublisher(
        f"tcp://127.0.0.1:{port}",
        connect=True,
        topic=f"kv@{POD_A}@m",
        replay_endpoint=None if replay is None else f"tcp://{POD_HOST}:{replay}",
        dp_rank=dp_rank,
    )


def held(r: Rig, token_ids: list[int]) -> int:
    """How many leading blocks of `token_ids` the index says POD_A holds."""
    r.index.flush()
    keys = block_keys(token_ids, BS, root_key("m", None))
    return r.index.lookup(keys, [POD_A])[POD_A].get("any", 0)


def two_free_ports(host: str = POD_HOST) -> int:
    """A port p such that p and p + 1 are both free on `host` (replay ports of data-parallel ranks 0, 1)."""
    for _ in range(100):
        with contextlib.ExitStack() as stack:
            a = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            a.bind((host, 0))
            p = int(a.getsockname()[1])
            b = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                b.bind((host, p + 1))
            except OSError:
                continue
            return p
    raise AssertionError("no two consecutive free ports")


async def test_central_gap_is_healed_through_the_engines_replay_router() -> None:
    port, replay = free_port(), free_port()
    async with rig(central(port, replay)) as r, engine(port, replay) as a:
        await joined(r, a, POD_A)
        before = a.replay_requests
        await a.publish([stored([1, 2], None, tokens(2))])
        await a.publish([stored([3], 2, tokens(1, 32))], send=False)  # lost on the wire
        await a.publish([stored([4], 3, tokens(1, 48))])
        await eventually(lambda: r.blocks(POD_A) == 4, "gap healed by replay")
        assert held(r, tokens(4)) == 4  # the chain 1-2-3-4, in order: nothing lost, nothing orphaned
        c = r.ingest.counters[POD_A]
        assert c.gaps == 1 and c.orphans == 0 and c.restarts == 0
        assert c.replays["complete"] >= 1 and c.replays["incomplete"] == 0
        assert a.replay_requests > before  # the replay went to the engine's ROUTER on the pod's host
        await eventually(lambda: r.state(POD_A) == (Freshness.FRESH, "ok"), "fresh after replay")


async def test_central_replay_goes_to_the_replay_port_of_the_batchs_data_parallel_rank() -> None:
    """Two ranks of one pod share the topic; only rank 1's ROUTER (replay port + 1) holds the batch
    rank 1 lost, so the gap heals only if the replay asks there."""
    port, replay = free_port(), two_free_ports()
    async with (
        rig(central(port, replay)) as r,
        engine(port, replay, dp_rank=0) as r0,
        engine(port, replay + 1, dp_rank=1) as r1,
    ):
        await joined(r, r0, POD_A)
        await r0.publish([stored([1], None, tokens(1))])
        await eventually(lambda: r.blocks(POD_A) == 1, "rank 0 indexed")
        # Rank 1's slow joiner: its empty batches go on until one of them has been applied.
        start = r.ingest.counters[POD_A].messages
        for _ in range(500):
            await r1.publish([])
            if r.ingest.counters[POD_A].messages > start:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("rank 1 never reached the EPP")
        gaps_before = r.ingest.counters[POD_A].gaps
        r0_requests, r1_requests = r0.replay_requests, r1.replay_requests
        await r1.publish([stored([11], None, tokens(1, 1000))], send=False)  # lost
        await r1.publish([stored([12], 11, tokens(1, 1016))])
        await eventually(lambda: held(r, tokens(2, 1000)) == 2, "rank 1's gap healed from its own ROUTER")
        assert r.blocks(POD_A) == 3 and held(r, tokens(1)) == 1  # rank 0's block untouched
        assert r.ingest.counters[POD_A].gaps == gaps_before + 1
        assert r1.replay_requests > r1_requests and r0.replay_requests == r0_requests


@pytest.mark.parametrize("with_replay", [False, True], ids=["no-replay", "replay"])
@pytest.mark.parametrize("first_lost", [False, True], ids=["seen-at-seq-0", "seq-0-lost"])
async def test_central_engine_restart_clears_the_pod_before_new_events(
    with_replay: bool, first_lost: bool
) -> None:
    """The engine's counter goes back to 0 (a new process). The pod is cleared before the new run's events
    are applied. If seq 0 of the new run is seen, nothing was missed: fresh. If it was lost, a replay
    recovers it (fresh again); without replay the pod is stale (`restart_without_replay`)."""
    port = free_port()
    replay = free_port() if with_replay else None
    old, new0, new1 = tokens(3), tokens(1, 700), tokens(1, 800)
    async with rig(central(port, replay)) as r, engine(port, replay) as a:
        await joined(r, a, POD_A)
        await a.publish([stored([1, 2, 3], None, old)])
        await eventually(lambda: held(r, old) == 3, "stored before the restart")
        assert a.seq >= 2  # the new run's seq 1 is behind the old counter: a restart, not a gap
        a.restart()
        await a.publish([stored([7], None, new0)], send=not first_lost)  # seq 0 of the new engine
        await a.publish([stored([8], None, new1)])  # seq 1
        expect_new0 = not first_lost or with_replay
        await eventually(
            lambda: (
                r.ingest.counters[POD_A].restarts == 1
                and held(r, new1) == 1
                and held(r, new0) == int(expect_new0)
            ),
            "the new run's events indexed",
        )
        assert held(r, old) == 0  # cleared before the new events
        assert r.blocks(POD_A) == (2 if expect_new0 else 1)
        c = r.ingest.counters[POD_A]
        assert c.restarts == 1 and c.gaps == 0 and c.orphans == 0
        expected = (
            (Freshness.STALE, "restart_without_replay")
            if first_lost and not with_replay
            else (Freshness.FRESH, "ok")
        )
        await eventually(lambda: r.state(POD_A) == expected, f"freshness {expected}")
        if first_lost and with_replay:
            assert c.replays["incomplete"] == 0 and c.replays["complete"] >= 1


async def test_central_gap_without_replay_makes_the_pod_stale_and_forgets_its_blocks() -> None:
    port = free_port()
    async with rig(central(port)) as r, engine(port) as a:
        await joined(r, a, POD_A)
        await a.publish([stored([1, 2], None, tokens(2))])
        await eventually(lambda: held(r, tokens(2)) == 2, "stored")
        await a.publish([removed([2])], send=False)  # the removal is lost
        await a.publish([stored([9], None, tokens(1, 900))])
        await eventually(lambda: r.state(POD_A) == (Freshness.STALE, "unrecovered_gap"), "stale")
        # Block 2 may have been evicted: the pod's blocks from before the gap are forgotten.
        await eventually(lambda: r.blocks(POD_A) == 1, "pod cleared, new block indexed")
        assert held(r, tokens(2)) == 0 and held(r, tokens(1, 900)) == 1
        c = r.ingest.counters[POD_A]
        assert c.gaps == 1 and c.restarts == 0 and not c.replays
        await a.publish([stored([10], 9, tokens(1, 916))])  # later in-order events are indexed
        await eventually(lambda: held(r, tokens(2, 900)) == 2, "indexed after the gap")
        assert r.state(POD_A) == (Freshness.STALE, "unrecovered_gap")  # until `recovery` has passed


@pytest.mark.parametrize("bind_host", ["127.0.0.1", "*"])  # "*": dual stack, IPv4-mapped peer addresses
async def test_verify_peer_lets_a_publisher_speak_only_for_the_pod_on_its_own_host(bind_host: str) -> None:
    port = free_port()
    settings = KvEventsConfig(
        mode="central", bind=f"tcp://{bind_host}:{port}", sync_interval=0.05, verify_peer=True
    )
    own = f"tcp://{POD_HOST}:0;127.0.0.1:{port}"  # (source address: connecting from the pod's IP)
    spoof = f"tcp://127.0.0.5:0;127.0.0.1:{port}"
    async with (
        rig(settings, (POD_A, POD_B)) as r,
        KvEventPublisher(own, connect=True, topic=f"kv@{POD_A}@m") as a,
        KvEventPublisher(spoof, connect=True, topic=f"kv@{POD_A}@m") as liar,
    ):
        await joined(r, a, POD_A)
        await a.publish([stored([1, 2], None, tokens(2))])
        await eventually(lambda: r.blocks(POD_A) == 2, "the pod's own events indexed")
        for _ in range(500):  # (the other publisher is a slow joiner too)
            await liar.publish([stored([7, 8, 9], None, tokens(3, 500)), cleared()])
            if r.ingest.counters[POD_A].drops["peer_mismatch"]:
                break
            await asyncio.sleep(0.01)
        assert r.ingest.counters[POD_A].drops["peer_mismatch"] >= 1
        # malformed messages from the pod itself: counted as without verifyPeer, the stream goes on
        await a.send_raw([f"kv@{POD_A}@m".encode()])
        await a.send_raw([f"kv@{POD_A}@m".encode(), b"\x00" * 3, b"\x90"])
        await eventually(
            lambda: (
                UNKNOWN_POD in r.ingest.counters and r.ingest.counters[UNKNOWN_POD].drops["frame_count"] == 1
            ),
            "one frame",
        )
        await eventually(lambda: r.ingest.counters[UNKNOWN_POD].drops["bad_seq"] == 1, "a short seq")
        await a.publish([stored([3], 2, tokens(1, 32))])
        await eventually(lambda: r.blocks(POD_A) == 3, "the pod's own events still indexed")
        assert held(r, tokens(3)) == 3  # the other publisher's clear removed nothing
        assert held(r, tokens(3, 500)) == 0  # and its blocks were never stored
        assert r.ingest.counters[POD_A].gaps == 0  # its sequence numbers were not taken for the pod's
        assert POD_B not in r.index.pods()


async def test_without_verify_peer_any_publisher_speaks_for_the_pod_its_topic_names() -> None:
    """What `verifyPeer` is for: by default a publisher from another host is believed."""
    port = free_port()
    spoof = f"tcp://127.0.0.5:0;127.0.0.1:{port}"
    async with rig(central(port)) as r, KvEventPublisher(spoof, connect=True, topic=f"kv@{POD_A}@m") as liar:
        await joined(r, liar, POD_A)
        await liar.publish([stored([7, 8, 9], None, tokens(3, 500))])
        await eventually(lambda: r.blocks(POD_A) == 3, "the other host's events indexed for the pod")
        assert r.ingest.counters[POD_A].drops["peer_mismatch"] == 0
