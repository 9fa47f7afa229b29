"""KV-event subscriber (ZeroMQ, asyncio): the edge that feeds `KvIngest` from engine publishers.

Two deployment modes, as in the field:
- per-pod: one SUB socket per endpoint and data-parallel rank, connected to
  `tcp://<pod-ip>:<port + rank>`, added and removed with the endpoint set. A socket monitor
  reports when a publisher is reachable (ZMTP handshake done) and when it is lost (the connection
  closed, or ZMTP heartbeats unanswered: a frozen engine or a vanished node).
- central: one bound SUB socket that engines connect to; the pod comes from the topic
  `kv@<ip:port>@<model>` (or `kv@<ip>@<model>` when the IP names one endpoint).

Replay (optional): a DEALER to the engine's ROUTER at `<pod-ip>:<replay port + rank>` sends
`[b"", start_seq]` and reads one message per buffered batch until the end marker.

Receiving: once a message has arrived, whatever else is queued on the socket is drained with plain
non-blocking receives (yielding to the event loop every 64 messages, counted across bursts); when the
socket is idle, the index's batched work is flushed, so requests do not pay for it.

Topics (`kv_topics.py`): in per-pod mode a message whose topic names another endpoint of the pool on
the same host (an InferencePool with several target ports) is that endpoint's and is skipped; one
naming an endpoint or host of the pool elsewhere is a misconfigured publisher: dropped and counted
(`foreign_topic`). The same rule applies to replayed messages.

Sockets: each per-pod stream takes three ZeroMQ sockets (SUB, libzmq's monitor socket, the monitor's
PAIR), each replay a DEALER; the context allows `MAX_SOCKETS`. A stream whose sockets cannot be
opened (file descriptors exhausted) is closed again, logged, and tried again at the next sync.
Every socket refuses a message over `MAX_MESSAGE_BYTES` (`kv_socket.py`); a per-pod socket whose
session libzmq then ends for good is re-created after a short backoff (the message counted, `oversized`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import zmq
import zmq.asyncio

from epp.clock import Clock
from epp.config_sections import KvEventsConfig
from epp.datastore import Datastore
from epp.kvindex.ingest import Dropped, KvIngest, NeedReplay
from epp.kvindex.sequence import END_OF_REPLAY
from epp.sources.kv_socket import (
    MAX_MESSAGE_BYTES,
    MAX_SOCKETS,
    Backoff,
    RateLimitedLog,
    Stream,
    await_with_peer,
    close_stream,
    open_monitored,
    recv_with_peer,
    sub_socket,
    watch_session,
)
from epp.sources.kv_topics import FOREIGN, OWN, TOPIC_CACHE, PoolHosts, endpoint_url, is_host_of, parse_topic

log = logging.getLogger("epp.kv_events")

UNKNOWN_POD = "unknown"
_FAIR_SHARE = 64  # messages handled in a row before yielding to the event loop
__all__ = ["MAX_MESSAGE_BYTES", "MAX_SOCKETS", "UNKNOWN_POD", "KvEventSubscriber"]


class KvEventSubscriber:
    heartbeat_interval: float = 1.0
    """Seconds between ZMTP heartbeats (PING) on each per-pod SUB connection; the engine's ZeroMQ I/O
    thread answers them (libzmq >= 4.2), whatever its Python threads are doing."""
    heartbeat_timeout: float = 3.0
    """A connection that receives nothing (no event, no PONG) for this long after a PING is closed, so
    a hung engine or a vanished node turns the pod stale (`publisher_unreachable`) within
    `heartbeat_interval + heartbeat_timeout` seconds. A killed engine's connection closes at once."""
    model_wait: float = 5.0
    """Seconds a replay waits for the pod's model to be known (from its metrics, when neither the
    endpoint list nor the topic names it): events are keyed by model, and a replay at startup would
    otherwise come before the first scrape and drop every block (`unknown_model`)."""
    session_grace: float = 0.5
    """Seconds a per-pod connection's loss may go without libzmq reporting its reconnect (it does so at
    once) before the socket's session counts as ended for good (`kv_socket.watch_session`)."""

    def __init__(
        self,
        datastore: Datastore,
        ingest: KvIngest,
        clock: Clock,
        settings: KvEventsConfig,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.datastore = datastore
        self.ingest = ingest
        self.clock = clock
        self.settings = settings
        self.wall = wall
        self.ctx = zmq.asyncio.Context()
        # Before any socket: the default (1023) would stop at 341 per-pod streams.
        self.ctx.set(zmq.MAX_SOCKETS, min(MAX_SOCKETS, self.ctx.get(zmq.SOCKET_LIMIT)))
        self._streams: dict[tuple[str, int], Stream] = {}  # per-pod mode: (SUB, its monitor, their tasks)
        self._replays: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._central: zmq.asyncio.Socket | None = None
        self._logs = RateLimitedLog()
        self._backoff = Backoff()  # before re-creating a per-pod socket whose session ended
        self._topics: dict[bytes, tuple[str | None, str | None]] = {}  # topic frame -> parse_topic
        self._hosts = PoolHosts(datastore.ids, lambda p: datastore.get(p) is not None)
        self.socket_errors: Counter[str] = Counter()
        """Sockets that could not be opened, by what for (`stream`, `replay`): each is tried again."""
        self.bound_endpoint: str | None = None

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        if s.mode == "off":
            return
        if s.mode == "central":
            sock = self._sub_socket()
            sock.bind(s.bind)
            self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._central = sock
            self._tasks.append(asyncio.create_task(self._recv_loop(sock, None, -1), name="kv-central"))
        self.sync()
        self._tasks.append(asyncio.create_task(self._sync_loop(), name="kv-sync"))

    async def stop(self) -> None:
        tasks = list(self._tasks) + list(self._replays.values())
        self._replays.clear()  # a replay cut short by the shutdown is not ended (counted, pod cleared)
        for _, _, ts in self._streams.values():
            tasks.extend(ts)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for stream in self._streams.values():
            close_stream(stream)
        self._streams.clear()
        self._replays.clear()
        self._tasks.clear()
        if self._central is not None:
            self._central.close(linger=0)
            self._central = None
        self.ctx.destroy(linger=0)  # closes any socket still open (e.g. a monitor whose task never ran)

    def _sub_socket(self) -> zmq.asyncio.Socket:
        heartbeat = (self.heartbeat_interval, self.heartbeat_timeout)
        return sub_socket(self.ctx, self.settings.rcvhwm, self.settings.topic_filters, heartbeat)

    # -- endpoint set ------------------------------------------------------------------
    def sync(self) -> None:
        """Follow the endpoint set: subscribe to new pods (per-pod mode), drop departed ones."""
        now = self.clock.now()
        ids = self.datastore.ids()
        known = set(ids)
        self._hosts.rebuild(ids)
        for pod in known:
            rec = self.datastore.get(pod)
            if rec is not None and rec.metrics is not None and rec.metrics.prefix_cache_queries is not None:
                misses = rec.metrics.prefix_cache_queries - (rec.metrics.prefix_cache_hits or 0.0)
                self.ingest.freshness.engine_misses(pod, misses, now)
        tracked = (
            {pod for pod, _ in self._streams} | set(self.ingest.counters) | set(self.ingest.freshness.pods())
        )
        for pod in tracked - known - {UNKNOWN_POD}:
            self._drop_pod(pod)
        if self.settings.mode != "per-pod":
            return
        for pod in known:
            for rank in range(self.settings.dp_ranks):
                if (pod, rank) not in self._streams:
                    self._open(pod, rank, now)

    def _open(self, pod: str, rank: int, now: float) -> None:
        try:
            sock, monitor = open_monitored(self._sub_socket, endpoint_url(pod, self.settings.port + rank))
        except zmq.ZMQError as err:
            # Out of sockets or file descriptors (what was built is closed): tried again at the next sync.
            self.socket_errors["stream"] += 1
            self.ingest.freshness.watch(pod, now)
            self.ingest.freshness.disconnected(pod, now)  # not listened to: stale (`publisher_unreachable`)
            failures = sum(self.socket_errors.values())
            msg = "kv events: cannot open the sockets for %s rank %d (%s; %d socket failures so far): retried"
            self._logs.warn("", "socket", msg, pod, rank, err, failures)
            return
        self.ingest.freshness.watch(pod, now)
        tasks = [
            asyncio.create_task(self._recv_loop(sock, pod, rank), name=f"kv-{pod}-{rank}"),
            asyncio.create_task(self._monitor_loop(monitor, pod, rank), name=f"kv-mon-{pod}-{rank}"),
        ]
        self._streams[(pod, rank)] = (sock, monitor, tasks)

    def _drop_pod(self, pod: str) -> None:
        for key in [k for k in self._streams if k[0] == pod]:
            close_stream(self._streams.pop(key))
        for key in [k for k in self._replays if k[0] == pod]:
            self._replays.pop(key).cancel()
        self.ingest.remove_pod(pod)
        self._logs.forget(pod)
        self._backoff.forget(pod)

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sync_interval)
            try:
                self.sync()
            except Exception:
                log.exception("kv events: endpoint sync failed")

    # -- receiving ---------------------------------------------------------------------
    async def _recv_loop(self, sock: zmq.asyncio.Socket, pod: str | None, rank: int) -> None:
        # The same socket without futures: once a message has arrived, what else is queued is drained
        # with plain non-blocking receives (about a third of the cost of awaiting each one).
        shadow: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        recv: Callable[[], Awaitable[Any]]
        drain: Callable[[int], Any]
        handle: Callable[[Any, str | None, int], None]
        if pod is None and self.settings.verify_peer:  # (the first frame as a zmq.Frame: it has the peer)
            recv, drain = partial(await_with_peer, sock, shadow), partial(recv_with_peer, shadow)
            handle = self._handle_frames
        else:
            recv, drain, handle = sock.recv_multipart, shadow.recv_multipart, self.handle
        flush = self.ingest.index.flush
        handled = 0  # since the loop last yielded: awaiting a message already queued does not yield
        frames: Any = await recv()
        if pod is not None:
            self._backoff.reset((pod, rank))  # heard from: a later refusal starts from the shortest delay
        while True:
            while True:
                try:
                    handle(frames, pod, rank)
                except Exception:
                    log.exception("kv events: unexpected error handling a message from %s", pod or "central")
                handled += 1
                if handled >= _FAIR_SHARE:
                    handled = 0
                    await asyncio.sleep(0)  # a long burst: let requests run in between
                try:
                    frames = drain(zmq.NOBLOCK)
                except zmq.Again:
                    break
            try:
                # Nothing else is waiting: apply the index's batched work now rather than make the next
                # request's lookup pay for it (during a burst, batching continues).
                flush()
            except Exception:
                log.exception("kv events: unexpected error flushing the index after %s", pod or "central")
            frames = await recv()

    def _handle_frames(self, message: tuple[zmq.Frame, list[bytes]], pod: str | None, rank: int) -> None:
        """`handle` for a central socket with `verify_peer`: the first frame's `Peer-Address` is checked
        against the pod the topic names."""
        try:
            peer = str(message[0].get("Peer-Address"))
        except zmq.ZMQError:  # (not a TCP connection)
            peer = ""
        self.handle(message[1], pod, rank, peer)

    def handle(self, frames: list[bytes], pod: str | None, rank: int, peer: str | None = None) -> None:
        """One message from `pod`'s socket (None: the central one, the pod from its topic). `peer`: the
        address it came from, when the topic must name that host (central mode's `verify_peer`)."""
        now = self.clock.now()
        if len(frames) != 3:
            self._drop(pod or UNKNOWN_POD, "frame_count", now, f"{len(frames)} frames, expected 3")
            return
        topic_b, seq_b, payload = frames
        if len(seq_b) != 8:
            self._drop(pod or UNKNOWN_POD, "bad_seq", now, f"seq frame of {len(seq_b)} bytes, expected 8")
            return
        parsed = self._topics.get(topic_b)
        if parsed is None:
            try:
                topic = topic_b.decode()
            except UnicodeDecodeError:
                self._drop(pod or UNKNOWN_POD, "bad_topic", now, "topic is not UTF-8")
                return
            if len(self._topics) >= TOPIC_CACHE:
                self._topics.clear()
            parsed = self._topics[topic_b] = parse_topic(topic)
        where, topic_model = parsed
        if pod is None:
            pod = self._hosts.pod_of(where)
            if pod is None:
                topic = topic_b.decode()
                self._drop(UNKNOWN_POD, "unknown_pod", now, f"topic {topic!r} names no endpoint of the pool")
                return
            if peer is not None and not is_host_of(peer, pod):
                topic = topic_b.decode()
                seen = f"from {peer}" if peer else "without a peer address"
                detail = f"topic {topic!r} names {pod}, but the publisher connected {seen} (verifyPeer)"
                self._drop(pod, "peer_mismatch", now, detail)
                return
        elif self.datastore.get(pod) is None:
            return  # the pod left while this message was queued
        elif where is not None and where != pod and not self._topic_is_own(where, pod, topic_b, now):
            return
        seq = int.from_bytes(seq_b, "big")
        outcome = self.ingest.on_live(pod, rank, seq, payload, now, topic_model, self.wall())
        if isinstance(outcome, NeedReplay):
            self._start_replay(outcome)
        elif isinstance(outcome, Dropped) and outcome.detail:
            self._log_dropped(pod, outcome)

    def _log_dropped(self, pod: str, outcome: Dropped) -> None:
        """A message the ingest dropped (it did not decode, or a replay's backlog overflowed): logged at a
        bounded rate per pod and reason, like the edge's own drops."""
        self._logs.warn(
            pod, outcome.reason, "kv events from %s dropped (%s): %s", pod, outcome.reason, outcome.detail
        )

    def _topic_is_own(self, where: str, pod: str, topic_b: bytes, now: float) -> bool:
        """Whether a message on `pod`'s socket whose topic names `where` (not `pod`) counts for `pod`
        (`kv_topics.PoolHosts.owner`); a foreign one is dropped and counted."""
        owner = self._hosts.owner(where, pod)
        if owner == FOREIGN:
            topic = topic_b.decode(errors="replace")
            self._drop(pod, "foreign_topic", now, f"topic {topic!r} names another host than {pod}'s")
        return owner == OWN

    def _drop(self, pod: str, reason: str, now: float, detail: str) -> None:
        self._log_dropped(pod, self.ingest.drop(pod, reason, now, detail))

    async def _monitor_loop(self, monitor: zmq.asyncio.Socket, pod: str, rank: int) -> None:
        try:
            ended = await watch_session(
                monitor,
                self.session_grace,
                lambda: self._connected(pod, rank),
                lambda: self._disconnected(pod, rank),
            )
        except Exception:  # a bug must not leave the pod without a monitor (never reopened): start again
            log.exception("kv events of %s: the connection monitor failed; opening the socket again", pod)
            ended = None
        finally:
            # The socket goes now (reopened after the backoff): its monitor is stopped before the monitor
            # socket closes. Stopping a monitor whose socket is closed blocks in libzmq for as long as the
            # socket still reports events (a publisher that went away: it keeps reconnecting).
            stream = self._streams.get((pod, rank))
            if stream is not None and asyncio.current_task() in stream[2]:
                close_stream(stream)
            else:
                monitor.close(linger=0)
        # libzmq will not reconnect; the pod is `publisher_unreachable` since the loss (`_disconnected`).
        delay = self._backoff.next((pod, rank))
        if ended is None:
            pass  # (logged; a message lost meanwhile is a sequence gap on the new socket)
        elif ended.handshaken:  # a message was refused: counted, logged
            self._drop(pod, "oversized", self.clock.now(), ended.describe(rank, delay))
        else:
            self._logs.warn(
                pod, "handshake", "kv events publisher of %s: %s", pod, ended.describe(rank, delay)
            )
        await asyncio.sleep(delay)
        self._reopen(pod, rank)

    def _connected(self, pod: str, rank: int) -> None:
        now = self.clock.now()
        self.ingest.freshness.connected(pod, now)
        need = self.ingest.on_connected(pod, rank, now)
        if need is not None:
            self._start_replay(need)

    def _disconnected(self, pod: str, rank: int) -> None:
        self.ingest.freshness.disconnected(pod, self.clock.now())
        self.ingest.on_disconnected(pod, rank)
        replay = self._replays.pop((pod, rank), None)
        if replay is not None:
            replay.cancel()  # whoever answers next may be a new engine: start again then
        self._logs.warn(pod, "disconnected", "kv events publisher of %s disconnected", pod)

    def _reopen(self, pod: str, rank: int) -> None:
        """Replace the pod's socket whose session ended (unless the pod left meanwhile)."""
        key = (pod, rank)
        entry = self._streams.get(key)
        if entry is None or asyncio.current_task() not in entry[2]:
            return
        close_stream(self._streams.pop(key))
        if self.datastore.get(pod) is not None:
            self._open(pod, rank, self.clock.now())

    # -- replay ------------------------------------------------------------------------
    def _start_replay(self, need: NeedReplay) -> None:
        key = (need.pod, need.rank)
        old = self._replays.get(key)
        if old is not None and not old.done():
            # The ingest asks again only once it has given up on that replay (the publisher reconnected).
            old.cancel()
        self._replays[key] = asyncio.create_task(self._replay(need), name=f"kv-replay-{need.pod}")

    async def _replay(self, need: NeedReplay) -> None:
        s = self.settings
        complete = False
        next_seq = need.from_seq
        try:
            if s.replay_port is None:
                return
            url = endpoint_url(need.pod, s.replay_port + need.rank)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.model_wait
            while self.ingest.model_of(need.pod) is None and loop.time() < deadline:
                await asyncio.sleep(0.05)  # live messages are held meanwhile
            attempts = s.replay_retries + 1
            while attempts > 0:
                attempts -= 1
                done, next_seq = await self._replay_once(url, need, next_seq)
                if not done:
                    continue
                # Live messages lost while this replay ran may still be in the engine's buffer.
                again = self.ingest.replay_ended(need.pod, need.rank, self.clock.now())
                if again is None:
                    complete = True
                    break
                next_seq, attempts = again.from_seq, s.replay_retries + 1
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("kv events: replay from %s failed", need.pod)
        finally:
            key = (need.pod, need.rank)
            current = self._replays.get(key) is asyncio.current_task()
            if current:
                del self._replays[key]
            if current and self.datastore.get(need.pod) is not None:  # not superseded or dropped
                self.ingest.replay_finished(need.pod, need.rank, self.clock.now(), complete)
                if not complete:
                    self._logs.warn(need.pod, "replay", "kv events replay from %s incomplete", need.pod)

    async def _replay_once(self, url: str, need: NeedReplay, start: int) -> tuple[bool, int]:
        try:
            sock = self.ctx.socket(zmq.DEALER)
        except zmq.ZMQError as err:  # out of sockets or file descriptors: a failed attempt, retried
            self.socket_errors["replay"] += 1
            failures = sum(self.socket_errors.values())
            msg = "kv events: cannot open a replay socket for %s (%s; %d socket failures so far)"
            self._logs.warn("", "replay_socket", msg, need.pod, err, failures)
            await asyncio.sleep(self.settings.replay_timeout)
            return False, start
        try:
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # one socket per attempt: a refusal fails it
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)
            sock.connect(url)
        except BaseException:
            sock.close(linger=0)
            raise
        timeout_ms = int(self.settings.replay_timeout * 1000)
        next_seq = start
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(timeout_ms):
                    return False, next_seq
                frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:
                    topic_b, seq_b, payload = frames
                elif len(frames) == 2:
                    topic_b, (seq_b, payload) = b"", frames
                else:
                    detail = f"replay reply of {len(frames)} frames, expected 2 or 3 after the envelope"
                    self._drop(need.pod, "replay_frames", self.clock.now(), detail)
                    continue
                if len(seq_b) != 8:
                    self._drop(need.pod, "bad_seq", self.clock.now(), f"replayed seq of {len(seq_b)} bytes")
                    continue
                seq = int.from_bytes(seq_b, "big")
                if seq == END_OF_REPLAY:
                    return True, next_seq
                where, topic_model = parse_topic(topic_b.decode(errors="replace"))
                next_seq = max(next_seq, seq + 1)
                if (
                    where is not None
                    and where != need.pod
                    and not self._topic_is_own(where, need.pod, topic_b, self.clock.now())
                ):
                    continue  # another endpoint's on this host (skipped), or a foreign topic (dropped)
                outcome = self.ingest.on_replayed(
                    need.pod, need.rank, seq, payload, self.clock.now(), topic_model
                )
                if isinstance(outcome, Dropped) and outcome.detail:
                    self._log_dropped(need.pod, outcome)
        finally:
            sock.close(linger=0)
