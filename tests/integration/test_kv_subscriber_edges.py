"""The KV-event subscriber over real ZeroMQ sockets on loopback, covering a replay from 0
against a long-running engine, hundreds of streams, sockets that cannot be opened, endpoints sharing an
IP during replay, foreign topics, the receive loop's fair share, live messages lost during a replay,
a pod first heard of from its metrics, IP-only topics at scale, and stopping with a replay in flight."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, generate_latest

from epp.clock import MonotonicClock
from epp.config import KvEventsConfig
from epp.datastore import Datastore
from epp.kvindex.freshness import Freshness, FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.ingest import KvIngest
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.service import KvIndexService
from epp.server.kv_metrics import KvIndexCollector
from epp.sources.kv_events import _FAIR_SHARE, KvEventSubscriber
from epp.testing.envoy import free_port
from epp.testing.kv_publisher import END, KvEventPublisher, encode_batch, removed, stored
from epp.testing.wait import eventually
from epp.types import MetricsSnapshot

from .test_kv_central import two_free_ports
from .test_kv_subscriber import (
    BS,
    POD_A,
    POD_B,
    Rig,
    _idle_engine,
    joined,
    per_pod,
    replay_router,
    replays,
    rig,
    tokens,
)


@contextlib.asynccontextmanager
async def built(
    settings: KvEventsConfig, pods: tuple[str, ...], before_start: Callable[[Rig], None]
) -> AsyncIterator[Rig]:
    """Like `rig`, with `before_start` run on the parts before the subscriber starts."""
    clock = MonotonicClock()
    ds = Datastore(clock)
    for p in pods:
        ds.add_endpoint(p, "m")
    index = BlockIndex(block_size=BS, max_entries=100_000)
    fresh = FreshnessTracker(recovery=30.0, hold=5.0)
    ingest = KvIngest(index, fresh, lambda pod: "m", replay_available=settings.replay_port is not None)
    r = Rig(ds, index, fresh, ingest, KvEventSubscriber(ds, ingest, clock, settings), clock)
    before_start(r)
    await r.sub.start()
    try:
        yield r
    finally:
        await r.sub.stop()


async def delivered(r: Rig, pub: KvEventPublisher, pod: str, events: list[Any]) -> None:
    """Publish `events`, then empty batches until the subscriber has applied the batch's seq or later (a
    lost one is a gap that a replay heals)."""
    seq = await pub.publish(events)
    for _ in range(500):
        if r.ingest.last_seq.get(pod, -1) >= seq:
            return
        await asyncio.sleep(0.01)
        await pub.publish([])
    raise AssertionError(f"seq {seq} of {pod} never applied")


# -- 1. a replay from 0 against a long-running engine --------------------------------------------


async def test_a_first_replay_whose_engine_buffer_no_longer_holds_seq_0_is_joined_late_not_stale() -> None:
    """An EPP (re)started against an engine that has published more batches than its replay buffer
    holds: the buffered ones are applied and the pod is `joined_late` (degraded), as without replay; not
    a hole that clears it and makes it stale for 30 s."""
    port, replay = free_port(), free_port()
    async with KvEventPublisher(
        f"tcp://127.0.0.2:{port}", replay_endpoint=f"tcp://127.0.0.2:{replay}", buffer_steps=5
    ) as a:
        for i in range(20):  # independent one-block chains; the buffer keeps seq 15..19
            await a.publish([stored([100 + i], None, tokens(1, 16 * i))])
        async with rig(per_pod(port, replay)) as r:
            await eventually(lambda: bool(replays(r)), "the first replay ended")
            assert replays(r) == Counter({"complete": 1})
            assert r.blocks(POD_A) == 5
            assert r.state(POD_A) == (Freshness.DEGRADED, "joined_late")
            await delivered(r, a, POD_A, [stored([999], None, tokens(1, 5000))])
            await eventually(lambda: r.blocks(POD_A) == 6, "live events continue the replayed suffix")
            assert replays(r)["incomplete"] == 0 and r.ingest.counters[POD_A].orphans == 0
            assert r.state(POD_A) == (Freshness.DEGRADED, "joined_late")


# -- 2. sockets: hundreds of streams, failures to open -----------------------------------------------


def _raise_nofile(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= want:
        return
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


async def test_hundreds_of_per_pod_streams_all_open() -> None:
    """Three ZeroMQ sockets per stream: past 341 streams libzmq's default of 1023 sockets per context ran
    out, `start()` raised and later pods never got a stream."""
    _raise_nofile(8192)
    pods = tuple(f"127.0.{1 + i // 250}.{2 + i % 250}:8000" for i in range(400))
    async with rig(per_pod(free_port()), pods) as r:
        assert len(r.sub._streams) == len(pods)
        assert r.sub.socket_errors == Counter()


async def test_a_stream_whose_sockets_cannot_be_opened_is_closed_counted_and_retried(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    subs: list[zmq.asyncio.Socket] = []
    failures = [1]  # the first monitor socket cannot be made (as when file descriptors run out)
    real_monitor = zmq.asyncio.Socket.get_monitor_socket

    def monitor(self: zmq.asyncio.Socket, *args: Any, **kwargs: Any) -> Any:
        subs.append(self)
        if failures[0]:
            failures[0] -= 1
            raise zmq.ZMQError(errno.EMFILE)
        return real_monitor(self, *args, **kwargs)

    monkeypatch.setattr(zmq.asyncio.Socket, "get_monitor_socket", monitor)
    with caplog.at_level(logging.WARNING, logger="epp.kv_events"):
        async with KvEventPublisher(f"tcp://127.0.0.2:{port}") as a, rig(per_pod(port)) as r:
            # start() went on; the half-built SUB socket is closed, the pod is not listened to: stale.
            assert r.sub.socket_errors == Counter({"stream": 1})
            assert subs[0].closed
            exposed = CollectorRegistry()
            kv = KvIndexService(r.index, r.freshness, TokenizerRegistry({}), BS)
            exposed.register(KvIndexCollector(kv, r.ingest, r.clock, None, r.sub.socket_errors))
            text = generate_latest(exposed).decode()
            assert 'epp_kv_socket_errors_total{kind="stream"} 1.0' in text
            assert 'epp_kv_socket_errors_total{kind="replay"} 0.0' in text
            assert r.state(POD_A) == (Freshness.STALE, "publisher_unreachable")
            await joined(r, a, POD_A)  # opened at a later sync
            await a.publish([stored([1, 2], None, tokens(2))])
            await eventually(lambda: r.blocks(POD_A) == 2, "events after the retry")
            assert r.state(POD_A)[0] is not Freshness.STALE
    assert any("cannot open the sockets for" in rec.getMessage() for rec in caplog.records)


async def test_a_replay_that_cannot_open_its_socket_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    port, replay = free_port(), free_port()
    real_socket = zmq.asyncio.Context.socket
    failures = [1]
    contexts: list[zmq.asyncio.Context] = []

    def socket(self: zmq.asyncio.Context, kind: int, *args: Any, **kwargs: Any) -> Any:
        if kind == zmq.DEALER and self in contexts and failures[0]:
            failures[0] -= 1
            raise zmq.ZMQError(errno.EMFILE)
        return real_socket(self, kind, *args, **kwargs)

    monkeypatch.setattr(zmq.asyncio.Context, "socket", socket)
    settings = KvEventsConfig(
        mode="per-pod",
        port=port,
        replay_port=replay,
        replay_timeout=0.2,
        replay_retries=2,
        sync_interval=0.05,
    )
    async with KvEventPublisher(f"tcp://127.0.0.2:{port}", replay_endpoint=f"tcp://127.0.0.2:{replay}") as a:
        await a.publish([stored([1, 2], None, tokens(2))])
        async with built(settings, (POD_A,), lambda r: contexts.append(r.sub.ctx)) as r:
            await eventually(lambda: bool(replays(r)), "the replay ended")
            assert replays(r) == Counter({"complete": 1})
            assert r.sub.socket_errors == Counter({"replay": 1}) and a.replay_requests == 1
            assert r.blocks(POD_A) == 2


# -- 3, 4. topics ------------------------------------------------------------------------------------


async def test_a_replay_credits_endpoints_sharing_an_ip_by_the_port_their_topic_names() -> None:
    port, replay = two_free_ports(), two_free_ports()
    a0, a1 = "127.0.0.2:8000", "127.0.0.2:8001"
    settings = KvEventsConfig(
        mode="per-pod", port=port, replay_port=replay, dp_ranks=2, replay_timeout=1.0, sync_interval=0.05
    )
    async with (
        KvEventPublisher(
            f"tcp://127.0.0.2:{port}", replay_endpoint=f"tcp://127.0.0.2:{replay}", topic=f"kv@{a0}@m"
        ) as p0,
        KvEventPublisher(
            f"tcp://127.0.0.2:{port + 1}", replay_endpoint=f"tcp://127.0.0.2:{replay + 1}", topic=f"kv@{a1}@m"
        ) as p1,
    ):
        await p0.publish([stored([1, 2], None, tokens(2))])  # before the EPP: only replay delivers them
        await p1.publish([stored([3], None, tokens(1, 99))])
        async with rig(settings, (a0, a1)) as r:

            def done() -> int:
                return sum(
                    r.ingest.counters[p].replays["complete"] for p in (a0, a1) if p in r.ingest.counters
                )

            await eventually(lambda: done() == 4, "each endpoint's replay of each rank")
            assert (r.blocks(a0), r.blocks(a1)) == (2, 1)
            assert r.ingest.counters[a0].drops == Counter() and r.ingest.counters[a1].drops == Counter()
            assert r.state(a0) == r.state(a1) == (Freshness.FRESH, "ok")


async def test_a_topic_naming_a_pod_on_another_host_is_dropped_and_counted() -> None:
    """Two engines started from one template with a literal topic naming POD_A: what POD_B's engine sends
    (replayed or live) is neither credited to POD_A nor silently ignored; it is counted and POD_B is
    degraded, with nothing indexed (none of its removals can be missed)."""
    port, replay = free_port(), free_port()
    async with (
        KvEventPublisher(
            f"tcp://127.0.0.2:{port}", replay_endpoint=f"tcp://127.0.0.2:{replay}", topic=f"kv@{POD_A}@m"
        ) as a,
        KvEventPublisher(
            f"tcp://127.0.0.3:{port}", replay_endpoint=f"tcp://127.0.0.3:{replay}", topic=f"kv@{POD_A}@m"
        ) as b,
    ):
        await b.publish([stored([1, 2, 3], None, tokens(3))])
        async with rig(per_pod(port, replay), (POD_A, POD_B)) as r:
            await eventually(lambda: drops(r, POD_B)["foreign_topic"] >= 1, "the replayed message counted")
            for _ in range(500):  # (the live stream's slow joiner)
                await b.publish([removed([3])])
                if r.ingest.counters[POD_B].drops["foreign_topic"] >= 2:
                    break
                await asyncio.sleep(0.01)
            assert r.ingest.counters[POD_B].drops["foreign_topic"] >= 2
            assert r.blocks(POD_B) == 0 and r.blocks(POD_A) == 0
            assert r.state(POD_B) == (Freshness.DEGRADED, "malformed")
            await delivered(r, a, POD_A, [stored([7], None, tokens(1, 700))])
            assert r.blocks(POD_A) == 1 and r.blocks(POD_B) == 0
            assert r.ingest.counters[POD_A].drops == Counter()


def drops(r: Rig, pod: str) -> Counter[str]:
    c = r.ingest.counters.get(pod)
    return c.drops if c else Counter()


# -- 5. fair share -----------------------------------------------------------------------------------


async def test_the_receive_loop_yields_every_64_messages_across_bursts() -> None:
    """A message that arrives while the index flushes is already queued when the loop awaits the next
    one, and awaiting it does not yield: the count of messages since the last yield goes on."""
    port = free_port()
    armed = [False]
    seen = {"since": 0, "most": 0}

    async with KvEventPublisher(f"tcp://127.0.0.2:{port}") as a:
        push = zmq.Socket.shadow(a.pub.underlying)

        def setup(r: Rig) -> None:
            real_flush, real_handle = r.index.flush, r.sub.handle

            def flush() -> None:
                real_flush()
                if armed[0]:  # a burst arrives while the index flushes
                    armed[0] = False
                    for _ in range(3 * _FAIR_SHARE):
                        push.send_multipart([b"", a.seq.to_bytes(8, "big"), encode_batch([])])
                        a.seq += 1
                    sock = zmq.Socket.shadow(r.sub._streams[(POD_A, 0)][0].underlying)
                    assert sock.poll(5000, zmq.POLLIN)
                    time.sleep(0.05)  # (the rest of the burst reaches the socket's queue)

            def handle(frames: list[bytes], pod: str | None, rank: int) -> None:
                seen["since"] += 1
                seen["most"] = max(seen["most"], seen["since"])
                real_handle(frames, pod, rank)

            r.index.flush = flush  # type: ignore[method-assign]
            r.sub.handle = handle  # type: ignore[method-assign]

        async with built(per_pod(port), (POD_A,), setup) as r:
            await joined(r, a, POD_A)
            stop = asyncio.Event()

            async def ticker() -> None:
                while not stop.is_set():
                    seen["since"] = 0
                    await asyncio.sleep(0)

            seen["since"] = seen["most"] = 0
            tick = asyncio.create_task(ticker())
            try:
                armed[0] = True
                last = await a.publish([])
                await eventually(lambda: r.ingest.last_seq.get(POD_A, -1) >= last + 3 * _FAIR_SHARE, "burst")
            finally:
                stop.set()
                await tick
            assert seen["most"] <= _FAIR_SHARE


# -- 6. live messages lost during a replay -----------------------------------------------------------


class GatedReplay(KvEventPublisher):
    """Holds back the end marker of its first replay from a seq past 0 (a gap's) until `gate` is set;
    records the start of every replay asked for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()
        self.starts: list[int] = []

    async def _serve_replay(self) -> None:
        assert self.router is not None
        topic = self.topic.encode()
        while True:
            ident, _, start_b = await self.router.recv_multipart()
            self.replay_requests += 1
            start = int.from_bytes(start_b, "big")
            self.starts.append(start)
            for seq, data in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart([ident, b"", topic, seq.to_bytes(8, "big"), data])
            if start > 0 and [s for s in self.starts if s > 0] == [start]:
                await self.gate.wait()
            await self.router.send_multipart([ident, b"", topic, END.to_bytes(8, "big"), b""])


async def test_a_live_message_lost_while_a_replay_runs_is_replayed_by_the_next_one() -> None:
    """Block 2 is lost: a replay from it. While that replay's end marker is held back, block 4 is lost
    too (after the engine sent its buffer): a second replay, from block 4, fills that hole; nothing is
    lost, the pod stays fresh, and the two replays count as one complete replay."""
    port, replay = free_port(), free_port()
    async with (
        GatedReplay(f"tcp://127.0.0.2:{port}", replay_endpoint=f"tcp://127.0.0.2:{replay}") as a,
        rig(per_pod(port, replay)) as r,
    ):
        await eventually(lambda: replays(r)["complete"] == 1, "the first connection's replay")
        await delivered(r, a, POD_A, [stored([1], None, tokens(1))])
        c = r.ingest.counters[POD_A]
        gaps, complete = c.gaps, c.replays["complete"]
        lost = await a.publish([stored([2], 1, tokens(1, 16))], send=False)  # lost: a replay from here
        await a.publish([stored([3], 2, tokens(1, 32))])
        await eventually(lambda: r.blocks(POD_A) == 2, "the replay sent block 2 (3 is held)")
        hole = await a.publish([stored([4], 3, tokens(1, 48))], send=False)  # lost after it answered
        last = await a.publish([stored([5], 4, tokens(1, 64))])
        pub = r.ingest._publishers[(POD_A, 0)]
        await eventually(lambda: bool(pub.held) and pub.held[-1][0] == last, "block 5 held")
        a.gate.set()  # the end marker: the hole is asked for again
        await eventually(lambda: r.blocks(POD_A) == 5, "every block")
        assert [s for s in a.starts if s > 0] == [lost, hole]
        assert c.replays == Counter({"complete": complete + 1}) and c.gaps == gaps + 2 and c.orphans == 0
        assert r.state(POD_A) == (Freshness.FRESH, "ok")


# -- 7. a pod first heard of from its metrics ---------------------------------------------------------


async def test_a_pod_first_seen_through_its_metrics_is_not_silent_at_once() -> None:
    port = free_port()
    settings = KvEventsConfig(mode="central", bind=f"tcp://127.0.0.1:{port}", sync_interval=100)
    async with rig(settings, ()) as r:
        r.datastore.add_endpoint(POD_A, "m")  # a new pod; its engine has not published yet
        snapshot = MetricsSnapshot(observed_at=r.clock.now(), prefix_cache_queries=0.0, prefix_cache_hits=0.0)
        r.datastore.record_metrics(POD_A, snapshot)
        r.sub.sync()
        snapshot = MetricsSnapshot(
            observed_at=r.clock.now(), prefix_cache_queries=500.0, prefix_cache_hits=0.0
        )
        r.datastore.record_metrics(POD_A, snapshot)  # its first prompts missed the cache
        r.sub.sync()
        assert r.state(POD_A) == (Freshness.STALE, "no_events")  # not `silent`: it just appeared


# -- 8. IP-only topics in central mode ---------------------------------------------------------------


async def test_central_ip_only_topics_find_the_pod_without_scanning_the_endpoints(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    settings = KvEventsConfig(mode="central", bind=f"tcp://127.0.0.1:{port}", sync_interval=100)
    pods = (*(f"10.0.{i // 250}.{i % 250}:8000" for i in range(500)), POD_A)
    async with rig(settings, pods) as r:
        scans = [0]
        real_ids = r.datastore.ids

        def ids() -> list[str]:
            scans[0] += 1
            return real_ids()

        monkeypatch.setattr(r.datastore, "ids", ids)
        topic = b"kv@127.0.0.2@m"
        for seq in range(100):
            r.sub.handle([topic, seq.to_bytes(8, "big"), encode_batch([])], None, -1)
        assert r.ingest.last_seq[POD_A] == 99 and "unknown" not in r.ingest.counters
        assert scans[0] <= 1
        # A second endpoint on that IP: the IP no longer names one endpoint (found at the next sync).
        r.datastore.add_endpoint("127.0.0.2:8001", "m")
        r.sub.sync()
        r.sub.handle([topic, (100).to_bytes(8, "big"), encode_batch([])], None, -1)
        assert r.ingest.counters["unknown"].drops["unknown_pod"] == 1
        r.datastore.remove_endpoint("127.0.0.2:8001")  # found again, even before the next sync
        r.sub.handle([topic, (100).to_bytes(8, "big"), encode_batch([])], None, -1)
        assert r.ingest.last_seq[POD_A] == 100


# -- stop, pod removal --------------------------------------------------------------------------------


async def test_stopping_with_a_replay_in_flight_does_not_end_it(caplog: pytest.LogCaptureFixture) -> None:
    port, replay = free_port(), free_port()
    settings = KvEventsConfig(
        mode="per-pod", port=port, replay_port=replay, replay_timeout=5.0, sync_interval=0.05
    )
    pub = _idle_engine(port)
    try:
        with caplog.at_level(logging.WARNING, logger="epp.kv_events"):
            async with replay_router(replay, []) as starts, rig(settings) as r:  # a ROUTER that never answers
                await eventually(lambda: starts == [0], "the replay asked")
        assert replays(r) == Counter()  # not counted incomplete
        assert not any("replay" in rec.getMessage() for rec in caplog.records)
    finally:
        pub.close(linger=0)


async def test_a_removed_pod_leaves_nothing_in_the_rate_limited_log() -> None:
    port = free_port()
    async with KvEventPublisher(f"tcp://127.0.0.2:{port}") as a, rig(per_pod(port)) as r:
        await joined(r, a, POD_A)
        await a.send_raw([b"", b"\x00" * 8])  # 2 frames: dropped and logged
        await eventually(lambda: r.ingest.counters[POD_A].drops["frame_count"] == 1, "drop counted")
        assert any(pod == POD_A for pod, _ in r.sub._logs._last)
        r.datastore.remove_endpoint(POD_A)
        await eventually(lambda: POD_A not in r.ingest.counters, "pod dropped")
        assert not any(pod == POD_A for pod, _ in r.sub._logs._last)
