"""The KV-event subscriber with real ZeroMQ sockets on loopback: per-pod and central modes, gaps
healed by replay, restarts, garbage frames, pods leaving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import zmq
import zmq.asyncio

from epp.clock import MonotonicClock
from epp.config import KvEventsConfig
from epp.datastore import Datastore
from epp.kvindex.freshness import Freshness, FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.ingest import KvIngest
from epp.sources.kv_events import KvEventSubscriber
from epp.testing.envoy import free_port
from epp.testing.kv_publisher import KvEventPublisher, cleared, encode_batch, removed, stored

from .stack import eventually

BS = 16
POD_A, POD_B = "127.0.0.2:8000", "127.0.0.3:8000"


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


@dataclass
class Rig:
    datastore: Datastore
    index: BlockIndex
    freshness: FreshnessTracker
    ingest: KvIngest
    sub: KvEventSubscriber
    clock: MonotonicClock

    def blocks(self, pod: str) -> int:
        return self.index.pod_counts(pod).get("gpu", 0)

    def state(self, pod: str) -> tuple[Freshness, str]:
        v = self.freshness.state(pod, self.clock.now())
        return v.state, v.reason


@contextlib.asynccontextmanager
async def rig(settings: KvEventsConfig, pods: tuple[str, ...] = (POD_A,)) -> AsyncIterator[Rig]:
    clock = MonotonicClock()
    ds = Datastore(clock)
    for p in pods:
        ds.add_endpoint(p, "m")
    index = BlockIndex(block_size=BS, max_entries=100_000)
    fresh = FreshnessTracker(recovery=30.0, hold=5.0)
    ingest = KvIngest(index, fresh, lambda pod: "m", replay_available=settings.replay_port is not None)
    sub = KvEventSubscriber(ds, ingest, clock, settings)
    await sub.start()
    try:
        yield Rig(ds, index, fresh, ingest, sub, clock)
    finally:
        await sub.stop()


async def joined(r: Rig, pub: KvEventPublisher, pod: str) -> None:
    """Defeat ZeroMQ's slow joiner: publish empty batches until the subscriber has seen one."""
    for _ in range(500):
        await pub.publish([])
        if pod in r.ingest.last_seq:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{pod} never received an event batch")


def per_pod(port: int, replay: int | None = None) -> KvEventsConfig:
    return KvEventsConfig(
        mode="per-pod", port=port, replay_port=replay, replay_timeout=1.0, sync_interval=0.05
    )


async def test_per_pod_events_reach_the_index_and_pods_are_kept_apart() -> None:
    port = free_port()
    async with (
        KvEventPublisher(f"tcp://127.0.0.2:{port}") as a,
        KvEventPublisher(f"tcp://127.0.0.3:{port}") as b,
        rig(per_pod(port), (POD_A, POD_B)) as r,
    ):
        await joined(r, a, POD_A)
        await joined(r, b, POD_B)
        await a.publish([stored([11, 12, 13], None, tokens(3))])
        await b.publish([stored([21], None, tokens(1, 1000))])
        await eventually(lambda: r.blocks(POD_A) == 3 and r.blocks(POD_B) == 1, "blocks indexed")
        await a.publish([removed([13])])
        await eventually(lambda: r.blocks(POD_A) == 2, "removal applied")
        await b.publish([cleared()])
        await eventually(lambda: r.blocks(POD_B) == 0, "clear applied")
        # Without replay, a subscriber that missed the first batches (ZeroMQ's slow joiner) says so;
        # one that caught seq 0 is fresh.
        assert r.state(POD_A) in {(Freshness.FRESH, "ok"), (Freshness.DEGRADED, "joined_late")}


async def test_a_gap_is_healed_by_replay_with_no_lost_block() -> None:
    port, replay = free_port(), free_port()
    async with (
        KvEventPublisher(f"tcp://127.0.0.2:{port}", replay_endpoint=f"tcp://127.0.0.2:{replay}") as a,
        rig(per_pod(port, replay)) as r,
    ):
        await joined(r, a, POD_A)
        await a.publish([stored([1, 2], None, tokens(2))])
        await a.publish([stored([3], 2, tokens(1, 32))], send=False)  # lost on the wire
        await a.publish([stored([4], 3, tokens(1, 48))])
        await eventually(lambda: r.blocks(POD_A) == 4, "gap healed by replay")
        assert r.ingest.counters[POD_A].gaps == 1
        assert r.ingest.counters[POD_A].replays["complete"] >= 1
        assert r.ingest.counters[POD_A].orphans == 0
        await eventually(lambda: r.state(POD_A)[0] is Freshness.FRESH, "fresh after replay")


async def test_a_first_connection_replays_from_zero_even_from_an_idle_engine() -> None:
    port, replay = free_port(), free_port()
    async with KvEventPublisher(f"tcp://127.0.0.2:{port}", replay_endpoint=f"tcp://127.0.0.2:{replay}") as a:
        # Published before anyone subscribed, and nothing after: only replay can deliver these.
        await a.publish([stored([1, 2], None, tokens(2))])
        await a.publish([stored([3], 2, tokens(1, 32))])
        async with rig(per_pod(port, replay)) as r:
            await eventually(lambda: r.blocks(POD_A) == 3, "replayed from 0 on connect")
            assert a.replay_requests >= 1
            assert r.ingest.counters[POD_A].orphans == 0
            await eventually(lambda: r.ingest.counters[POD_A].replays["complete"] == 1, "replay finished")
            assert r.state(POD_A)[0] is Freshness.FRESH
            await a.publish([stored([4], 3, tokens(1, 48))])  # live events continue the replayed stream
            await eventually(lambda: r.blocks(POD_A) == 4, "live after replay")
            assert r.ingest.counters[POD_A].gaps == 0


async def test_a_gap_without_replay_makes_the_pod_stale_and_forgets_its_blocks() -> None:
    port = free_port()
    async with KvEventPublisher(f"tcp://127.0.0.2:{port}") as a, rig(per_pod(port)) as r:
        await joined(r, a, POD_A)
        await a.publish([stored([1, 2], None, tokens(2))])
        await eventually(lambda: r.blocks(POD_A) == 2, "stored")
        await a.publish([removed([2])], send=False)  # the removal is lost
        await a.publish([stored([9], None, tokens(1, 900))])
        await eventually(lambda: r.state(POD_A) == (Freshness.STALE, "unrecovered_gap"), "stale")
        # The blocks from before the gap are gone (block 2 may have been evicted); new events index.
        await eventually(lambda: r.blocks(POD_A) == 1, "pod cleared, new block indexed")


async def test_engine_restart_clears_the_pod_before_new_events() -> None:
    port = free_port()
    async with KvEventPublisher(f"tcp://127.0.0.2:{port}") as a, rig(per_pod(port)) as r:
        await joined(r, a, POD_A)
        await a.publish([stored([1, 2, 3], None, tokens(3))])
        await eventually(lambda: r.blocks(POD_A) == 3, "stored")
        a.restart()
        await a.publish([stored([7], None, tokens(1, 700))])  # seq 0 of the new engine
        await eventually(lambda: r.ingest.counters[POD_A].restarts == 1, "restart seen")
        assert r.blocks(POD_A) == 1
        assert r.state(POD_A)[0] is Freshness.FRESH


async def test_garbage_is_counted_logged_and_never_stops_the_subscriber(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    async with KvEventPublisher(f"tcp://127.0.0.2:{port}") as a, rig(per_pod(port)) as r:
        await joined(r, a, POD_A)
        with caplog.at_level(logging.WARNING, logger="epp.sources.kv_events"):
            await a.send_raw([b"", b"\x00" * 8])  # 2 frames
            await a.send_raw([b"", b"\x00\x01", b"x"])  # short seq
            await a.send_raw([b"", b"", b"", b""])  # 4 frames
            await a.publish([], payload=b"\xc1 not msgpack")
            await a.publish([], payload=b"\xc1 not msgpack either")
            await a.publish([], payload=encode_batch([stored([1], None, [1, 2, 3])]))  # token count wrong
            await a.publish([stored([5], None, tokens(1))])
            await eventually(lambda: r.blocks(POD_A) == 1, "good event after garbage")
        drops = r.ingest.counters[POD_A].drops
        assert drops["frame_count"] == 2 and drops["bad_seq"] == 1 and drops["msgpack"] == 2
        assert r.state(POD_A) == (Freshness.STALE, "lost_events")  # (the payloads that did not decode)
        logged = [rec.getMessage() for rec in caplog.records]
        for reason in ("frame_count", "bad_seq", "msgpack"):  # each once: the log is rate-limited
            assert sum(f"{POD_A} dropped ({reason})" in m for m in logged) == 1, (reason, logged)
        assert sum("dropped (" in m for m in logged) == 3  # (a wrong token count is a store rejected)


@contextlib.asynccontextmanager
async def replay_router(port: int, replies: list[list[list[bytes]]]) -> AsyncIterator[list[int]]:
    """An engine's replay ROUTER on 127.0.0.2:`port` that answers each request with the next list of
    messages in `replies` (each a list of frames; nothing once they run out) and records each request's
    start seq."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.2:{port}")
    starts: list[int] = []

    async def serve() -> None:
        while True:
            ident, _, start = await sock.recv_multipart()
            starts.append(int.from_bytes(start, "big"))
            for frames in replies[len(starts) - 1] if len(starts) <= len(replies) else []:
                await sock.send_multipart([ident, b"", *frames])

    task = asyncio.create_task(serve())
    try:
        yield starts
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close(linger=0)
        ctx.term()


def _idle_engine(port: int) -> zmq.Socket[bytes]:
    """A PUB socket that sends nothing: the SUB connects, and the first connection asks for a replay."""
    pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.2:{port}")
    return pub


_END = [(2**64 - 1).to_bytes(8, "big"), b""]


def replays(r: Rig) -> Counter[str]:
    c = r.ingest.counters.get(POD_A)
    return c.replays if c else Counter()


async def test_bad_replay_replies_are_counted_logged_and_the_replay_completes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port, replay = free_port(), free_port()
    good = encode_batch([stored([1], None, tokens(1))])
    reply = [[b"a", b"b", b"c", b"d"], [b"\x00\x01", good], [(0).to_bytes(8, "big"), good], _END]
    pub = _idle_engine(port)
    try:
        with caplog.at_level(logging.WARNING, logger="epp.sources.kv_events"):
            async with replay_router(replay, [reply]) as starts, rig(per_pod(port, replay)) as r:
                await eventually(lambda: r.blocks(POD_A) == 1, "the good replayed message applied")
                await eventually(lambda: replays(r)["complete"] == 1, "replay complete")
                drops = r.ingest.counters[POD_A].drops
                assert drops["replay_frames"] == 1 and drops["bad_seq"] == 1 and starts == [0]
        logged = " ".join(rec.getMessage() for rec in caplog.records)
        assert "dropped (replay_frames)" in logged and "dropped (bad_seq)" in logged
    finally:
        pub.close(linger=0)


async def test_a_replay_cut_short_is_retried_from_where_it_stopped_then_given_up() -> None:
    """The ROUTER sends one message and no end marker, then never answers: each retry asks from the next
    seq, and after the last the replay is incomplete: the pod is cleared and stale."""
    port, replay = free_port(), free_port()
    first = [[(0).to_bytes(8, "big"), encode_batch([stored([1], None, tokens(1))])]]
    settings = KvEventsConfig(
        mode="per-pod",
        port=port,
        replay_port=replay,
        replay_timeout=0.2,
        replay_retries=2,
        sync_interval=0.05,
    )
    pub = _idle_engine(port)
    try:
        async with replay_router(replay, [first]) as starts, rig(settings) as r:
            await eventually(lambda: replays(r)["incomplete"] == 1, "replay given up")
            assert starts == [0, 1, 1]  # retries: replay_retries + 1 requests in all
            assert r.blocks(POD_A) == 0
            assert r.state(POD_A) == (Freshness.STALE, "unrecovered_gap")
    finally:
        pub.close(linger=0)


async def test_a_burst_is_drained_in_order_and_flushed_once_the_socket_is_idle() -> None:
    port = free_port()
    async with KvEventPublisher(f"tcp://127.0.0.2:{port}") as a, rig(per_pod(port)) as r:
        await joined(r, a, POD_A)
        start = r.ingest.counters[POD_A].events
        parent = None
        for h in range(1, 301):  # far more than the subscriber handles between two yields
            await a.publish([stored([h], parent, tokens(1, 16 * h))])
            parent = h
        await eventually(lambda: r.ingest.counters[POD_A].events - start == 300, "burst handled")
        assert r.index._q_blocks == 0  # flushed when nothing else was waiting, before any read
        assert r.blocks(POD_A) == 300 and r.ingest.counters[POD_A].orphans == 0


async def test_endpoints_sharing_an_ip_are_credited_by_the_port_their_topic_names() -> None:
    """An InferencePool with two target ports on one pod: both endpoints subscribe to the IP's
    publishers (port + dp rank); each message counts only for the endpoint its topic names."""
    port = free_port()
    a0, a1 = "127.0.0.2:8000", "127.0.0.2:8001"
    settings = KvEventsConfig(mode="per-pod", port=port, dp_ranks=2, sync_interval=0.05)
    async with (
        rig(settings, (a0, a1)) as r,
        KvEventPublisher(f"tcp://127.0.0.2:{port}", topic=f"kv@{a0}@m") as p0,
        KvEventPublisher(f"tcp://127.0.0.2:{port + 1}", topic=f"kv@{a1}@m") as p1,
    ):
        await joined(r, p0, a0)
        await joined(r, p1, a1)
        await p0.publish([stored([1, 2], None, tokens(2))])
        await p1.publish([stored([3], None, tokens(1, 99))])
        await eventually(lambda: r.blocks(a0) == 2 and r.blocks(a1) == 1, "each endpoint's own blocks")
        await asyncio.sleep(0.2)  # (nothing more arrives: the other endpoint's copies were not applied)
        assert (r.blocks(a0), r.blocks(a1)) == (2, 1)
        assert r.ingest.counters[a0].gaps == 0 and r.ingest.counters[a1].gaps == 0


async def test_central_mode_identifies_pods_from_the_topic() -> None:
    port = free_port()
    settings = KvEventsConfig(mode="central", bind=f"tcp://127.0.0.1:{port}", sync_interval=0.05)
    async with (
        rig(settings, (POD_A, POD_B)) as r,
        KvEventPublisher(f"tcp://127.0.0.1:{port}", connect=True, topic=f"kv@{POD_A}@m") as a,
        KvEventPublisher(f"tcp://127.0.0.1:{port}", connect=True, topic="kv@127.0.0.3@m") as b,
        KvEventPublisher(f"tcp://127.0.0.1:{port}", connect=True, topic="kv@10.9.9.9:1@m") as stranger,
    ):
        await joined(r, a, POD_A)
        await joined(r, b, POD_B)
        await a.publish([stored([1, 2], None, tokens(2))])
        await b.publish([stored([3], None, tokens(1, 99))])
        await eventually(lambda: r.blocks(POD_A) == 2 and r.blocks(POD_B) == 1, "central events indexed")
        for _ in range(500):  # the stranger is a slow joiner too
            await stranger.publish([stored([4], None, tokens(1))])
            if "unknown" in r.ingest.counters:
                break
            await asyncio.sleep(0.01)
        assert r.ingest.counters["unknown"].drops["unknown_pod"] >= 1
        assert "10.9.9.9:1" not in r.index.pods()


async def test_a_pod_that_leaves_is_drained_and_unsubscribed() -> None:
    port = free_port()
    async with KvEventPublisher(f"tcp://127.0.0.2:{port}") as a, rig(per_pod(port)) as r:
        await joined(r, a, POD_A)
        await a.publish([stored([1, 2], None, tokens(2))])
        await eventually(lambda: r.blocks(POD_A) == 2, "stored")
        r.datastore.remove_endpoint(POD_A)
        await eventually(lambda: POD_A not in r.index.pods() and POD_A not in r.ingest.counters, "drained")
        await a.publish([stored([3], None, tokens(1, 64))])
        await asyncio.sleep(0.2)
        assert POD_A not in r.index.pods()


async def test_unreachable_publisher_is_stale() -> None:
    port = free_port()
    async with rig(per_pod(port)) as r:
        async with KvEventPublisher(f"tcp://127.0.0.2:{port}") as a:
            await joined(r, a, POD_A)
            assert r.state(POD_A)[0] is not Freshness.STALE
        await eventually(
            lambda: r.state(POD_A) == (Freshness.STALE, "publisher_unreachable"), "stale on disconnect"
        )


@pytest.mark.parametrize("old_replay", [False, True])
async def test_both_replay_reply_layouts(old_replay: bool) -> None:
    port, replay = free_port(), free_port()
    async with (
        KvEventPublisher(
            f"tcp://127.0.0.2:{port}", replay_endpoint=f"tcp://127.0.0.2:{replay}", old_replay=old_replay
        ) as a,
        rig(per_pod(port, replay)) as r,
    ):
        await joined(r, a, POD_A)
        await a.publish([stored([1], None, tokens(1))], send=False)
        await a.publish([stored([2], 1, tokens(1, 16))])
        await eventually(lambda: r.blocks(POD_A) == 2, "replayed")


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
async def test_ipv6_pods() -> None:
    port = free_port()
    pod = "[::1]:8000"
    async with KvEventPublisher(f"tcp://[::1]:{port}") as a, rig(per_pod(port), (pod,)) as r:
        await joined(r, a, pod)
        await a.publish([stored([1, 2], None, tokens(2))])
        await eventually(lambda: r.index.pod_counts(pod).get("gpu", 0) == 2, "IPv6 pod indexed")
