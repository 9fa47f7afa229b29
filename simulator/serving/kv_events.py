"""The engine's KV events on ZeroMQ, as vLLM publishes them.

The engine's `EventSink` hands over each step's batch already msgpack-encoded and numbered (0, 1, 2,
... per engine); this module puts it on the wire with `epp.testing.kv_publisher.KvEventPublisher`:
a PUB socket sending `[topic, seq (8 bytes big-endian), payload]`, and, with a replay endpoint, a
ROUTER answering `[b"", start_seq]` from the last `buffer_steps` batches. Bind or connect follows
`config.binds` (vLLM's rule unless forced). The ROUTER always binds, as vLLM's does.

Batches are queued by the (synchronous) engine callback and sent in order by one task, so the
engine never waits on a socket. On stop, whatever is queued is sent first. `peers` counts the
ZeroMQ peers the PUB socket has completed a handshake with (subscribers that connected to it, or
the router it connected to): as with vLLM, a batch sent before a subscriber's subscription arrives
is not delivered to it (ZeroMQ's slow joiner); replay is how a subscriber catches up.

Timestamps: the engine stamps a batch with its kernel time; vLLM stamps it with `time.time()`, and
routers measure event lag against that (the EPP calls a pod "lagging" past a second). `restamp`
writes the wall-clock time of the batch's step into the payload (the msgpack float64 right after
the batch's array header), leaving every other byte as the engine encoded it.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from epp.testing.kv_publisher import KvEventPublisher
from simulator.serving.config import binds

_MAPPED = "tcp://[::ffff:"
_FLOAT64 = 0xCB


def restamp(payload: bytes, ts: float) -> bytes:
    """The batch `[ts, events, dp_rank]` with `ts` replaced; ValueError if it does not start that way."""
    if len(payload) < 10 or not 0x91 <= payload[0] <= 0x9F or payload[1] != _FLOAT64:
        raise ValueError("not a KV-event batch starting with a float64 timestamp")
    return payload[:2] + struct.pack(">d", ts) + payload[10:]


def _plain(endpoint: str) -> str:
    """A bound endpoint as given back by ZeroMQ, IPv4 addresses without their IPv6-mapped form
    (`tcp://[::ffff:127.0.0.1]:5557` -> `tcp://127.0.0.1:5557`)."""
    if endpoint.startswith(_MAPPED):
        host, sep, port = endpoint[len(_MAPPED) :].partition("]:")
        if sep:
            return f"tcp://{host}:{port}"
    return endpoint


class KvEventChannel:
    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        mode: str = "auto",
        buffer_steps: int = 10_000,
    ) -> None:
        self.bind = binds(endpoint, mode)
        self.publisher = KvEventPublisher(
            endpoint,
            replay_endpoint=replay_endpoint,
            topic=topic,
            connect=not self.bind,
            buffer_steps=buffer_steps,
        )
        self._queue: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._monitor_task: asyncio.Task[None] | None = None
        # ZeroMQ's handshake event carries no peer id (its value is 0) and a disconnect carries the fd,
        # so peers are counted: +1 per completed handshake, -1 per disconnect of a connection.
        self._peers = 0
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.published = 0

    @property
    def topic(self) -> str:
        return self.publisher.topic

    @topic.setter
    def topic(self, value: str) -> None:
        self.publisher.topic = value

    async def start(self) -> None:
        """Bind or connect; ValueError naming the endpoint when ZeroMQ refuses it."""
        pub = self.publisher
        self._monitor = pub.pub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._monitor_task = asyncio.create_task(self._watch(self._monitor), name="kv-events-monitor")
        try:
            await pub.start()
        except zmq.ZMQError as err:
            await self._stop_monitor()
            await pub.stop()
            replay = pub.router is not None  # the PUB socket was set up, the ROUTER failed
            what = self.replay_endpoint if replay else self.endpoint
            verb = "bind" if self.bind or replay else "connect"
            raise ValueError(f"KV events: cannot {verb} {what}: {err}") from None
        if self.bind:
            self.endpoint = _plain(pub.pub.getsockopt_string(zmq.LAST_ENDPOINT))
        if pub.router is not None:
            self.replay_endpoint = _plain(pub.router.getsockopt_string(zmq.LAST_ENDPOINT))
        self._task = asyncio.create_task(self._send_loop(), name="kv-events-pub")

    def submit(self, seq: int, payload: bytes, at: float) -> None:
        """The engine's `on_events` callback."""
        self._queue.put_nowait((seq, payload))

    async def stop(self) -> None:
        if self._task is not None:
            self._queue.put_nowait(None)
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._stop_monitor()
        await self.publisher.stop()

    async def _stop_monitor(self) -> None:
        task, self._monitor_task = self._monitor_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._monitor is not None:
            self.publisher.pub.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    @property
    def peers(self) -> int:
        return self._peers

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            msg = parse_monitor_message(await monitor.recv_multipart())
            if msg["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._peers += 1
            elif msg["event"] == zmq.EVENT_DISCONNECTED:
                self._peers = max(0, self._peers - 1)

    async def _send_loop(self) -> None:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            await self.publisher.publish_encoded(*item)
            self.published += 1
