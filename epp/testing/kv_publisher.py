"""A KV-event publisher that speaks exactly what vLLM's ZMQ publisher does, for tests and demos.

PUB socket with 3-frame messages `[topic, seq (8 bytes big-endian), msgpack batch]`, a
ROUTER replay endpoint answering `[b"", start_seq]` with one message per buffered batch
(`[b"", topic, seq, payload]`, vLLM 0.26+, or `[b"", seq, payload]` with `old_replay=True`)
and the end marker. Events are msgspec structs shaped like vLLM's (map-encoded as in vLLM
0.24+, or array-encoded as in 0.9-0.23 with `form="array"`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from collections import deque
from typing import Any

import zmq
import zmq.asyncio

from epp.testing.kv_wire import (
    AllBlocksCleared,
    ArrayAllBlocksCleared,
    ArrayBlockRemoved,
    ArrayBlockStored,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Form,
    cleared,
    removed,
    stored,
)
from epp.testing.kv_wire import encode_batch as wire_encode

END = 0xFFFFFFFFFFFFFFFF


def encode_batch(events: list[Any], dp_rank: int | None = None, ts: float | None = None) -> bytes:
    """A batch stamped with the wall clock unless `ts` is given."""
    return wire_encode(events, dp_rank, time.time() if ts is None else ts)


_BIND_TRIES = 40


async def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> None:
    """Bind, trying again for about 2 s while the port is in use: a restarted engine takes the port its
    predecessor had (tests pick a free port ahead of time, and another process may hold it briefly)."""
    for attempt in range(_BIND_TRIES):
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != errno.EADDRINUSE or attempt == _BIND_TRIES - 1:
                raise
            await asyncio.sleep(0.05)


class KvEventPublisher:
    """Bind `endpoint` (PUB) and optionally `replay_endpoint` (ROUTER); `connect=True` connects the PUB
    instead (the central mode, where engines connect to the router)."""

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:*",
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        connect: bool = False,
        buffer_steps: int = 10_000,
        old_replay: bool = False,
        dp_rank: int | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.connect = connect
        self.old_replay = old_replay
        self.dp_rank = dp_rank
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 1_000_000)
        self.pub.setsockopt(zmq.IPV6, 1)
        self.router: zmq.asyncio.Socket | None = None
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.port = 0
        self.replay_port = 0
        self.replay_requests = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> KvEventPublisher:
        if self.connect:
            self.pub.connect(self.endpoint)
        else:
            await _bind(self.pub, self.endpoint)
            self.port = int(self.pub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        if self.replay_endpoint is not None:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.setsockopt(zmq.IPV6, 1)
            await _bind(self.router, self.replay_endpoint)
            self.replay_port = int(self.router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            self._task = asyncio.create_task(self._serve_replay())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
        self.ctx.destroy(linger=0)

    async def __aenter__(self) -> KvEventPublisher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def publish(self, events: list[Any], *, send: bool = True, payload: bytes | None = None) -> int:
        """Publish one batch; `send=False` buffers it for replay without sending (a lost message)."""
        seq = self.seq
        self.seq += 1
        data = payload if payload is not None else encode_batch(events, self.dp_rank)
        self.buffer.append((seq, data))
        if send:
            await self.pub.send_multipart([self.topic.encode(), seq.to_bytes(8, "big"), data])
        return seq

    async def publish_encoded(self, seq: int, payload: bytes, *, send: bool = True) -> None:
        """Publish a batch encoded and numbered elsewhere (a simulated engine's `EventSink`); it is
        buffered for replay like any other, and a later `publish` continues from `seq + 1`."""
        self.seq = seq + 1
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([self.topic.encode(), seq.to_bytes(8, "big"), payload])

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def restart(self) -> None:
        """Like a restarted engine: the counter starts again at 0 and the replay buffer is empty."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            self.replay_requests += 1
            topic = self.topic.encode()
            for seq, data in list(self.buffer):
                if seq >= start:
                    body = (
                        [seq.to_bytes(8, "big"), data]
                        if self.old_replay
                        else [topic, seq.to_bytes(8, "big"), data]
                    )
                    await self.router.send_multipart([ident, b"", *body])
            end = [END.to_bytes(8, "big"), b""] if self.old_replay else [topic, END.to_bytes(8, "big"), b""]
            await self.router.send_multipart([ident, b"", *end])


__all__ = [
    "END",
    "AllBlocksCleared",
    "ArrayAllBlocksCleared",
    "ArrayBlockRemoved",
    "ArrayBlockStored",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "Form",
    "KvEventPublisher",
    "cleared",
    "encode_batch",
    "removed",
    "stored",
]
