"""The KV-event subscriber's socket plumbing: size cap, logs, and when a per-pod SUB session ends for good.

Every SUB socket (per-pod and central) and every replay DEALER refuses a message over
`MAX_MESSAGE_BYTES` (`zmq.MAXMSGSIZE`): ZeroMQ never buffers it and ends that connection on a protocol
error. On a bound socket (central mode) the publisher connects again by itself. On a connecting one
(per-pod mode) libzmq 4.3 ends the socket's session for good: its monitor reports `EVENT_DISCONNECTED`
and nothing more, while any other loss (the peer closed, heartbeats unanswered) is followed at once by
`EVENT_CONNECT_RETRIED` (libzmq reconnects by itself). A ZMTP handshake that fails on a protocol error
(`EVENT_HANDSHAKE_FAILED_PROTOCOL`, e.g. not a ZeroMQ publisher on that port) ends the session the same
way. `watch_session` follows a per-pod monitor and returns when that happened; the subscriber then
re-creates the pod's socket after a `Backoff` delay. `recv_with_peer` / `await_with_peer` receive a
message with its first frame as a `zmq.Frame`, whose `Peer-Address` central mode's `verifyPeer` reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("epp.kv_events")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest KV message accepted (`zmq.MAXMSGSIZE`, per frame): a larger one is refused, never buffered."""
MAX_SOCKETS = 65536
"""ZeroMQ sockets allowed in the subscriber's context (libzmq's default, 1023, is 341 per-pod streams);
capped at what libzmq supports. The process also needs a file descriptor per socket and connection."""
MONITORED = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
)
"""The per-pod monitor's events: reachable (handshake done), lost, and libzmq reconnecting (or not)."""


RECONNECT_MAX_MS = 2000

Stream = tuple[zmq.asyncio.Socket, zmq.asyncio.Socket, list["asyncio.Task[None]"]]
"""A per-pod stream: its SUB socket, the SUB's monitor socket, and their tasks."""


def sub_socket(
    ctx: zmq.asyncio.Context, rcvhwm: int, topics: Iterable[str], heartbeat: tuple[float, float]
) -> zmq.asyncio.Socket:
    """A SUB socket with the size cap, `rcvhwm`, `topics` and ZMTP heartbeats (interval, timeout)."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)  # pods may have IPv6 addresses ([addr]:port)
    # An unreachable pod is retried after 0.1 s, then less often, up to every 2 s (libzmq's default
    # retries every 0.1 s for ever, and every attempt wakes the monitor); a connection resets it.
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat[0] * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat[1] * 1000))
    for topic in topics:
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    return sock


def open_monitored(
    make_sub: Callable[[], zmq.asyncio.Socket], url: str
) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    """A SUB connecting to `url` and its monitor (`MONITORED`); on a ZMQError (out of sockets or file
    descriptors) what was built is closed again and the error raised."""
    sock: zmq.asyncio.Socket | None = None
    monitor: zmq.asyncio.Socket | None = None
    try:
        sock = make_sub()
        # Reachable = the ZMTP handshake succeeded (a frozen engine's kernel still accepts TCP).
        monitor = sock.get_monitor_socket(MONITORED)
        sock.connect(url)
    except zmq.ZMQError:
        if monitor is not None:
            monitor.close(linger=0)
        if sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            sock.close(linger=0)
        raise
    return sock, monitor


def close_stream(stream: Stream) -> None:
    """Cancel the stream's tasks (but the one calling), stop its monitor (which frees the monitor's inproc
    address for a new socket) and close both sockets."""
    sock, monitor, tasks = stream
    current = asyncio.current_task()
    for t in tasks:
        if t is not current:
            t.cancel()
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)


class RateLimitedLog:
    def __init__(self, every: float = 30.0) -> None:
        self.every = every
        self._last: dict[tuple[str, str], float] = {}

    def warn(self, pod: str, reason: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        key = (pod, reason)
        if now - self._last.get(key, -1e9) >= self.every:
            self._last[key] = now
            log.warning(msg, *args)

    def forget(self, pod: str) -> None:
        for key in [k for k in self._last if k[0] == pod]:
            del self._last[key]


class Backoff:
    """Delays before re-creating a pod's socket: doubling from `initial` to `maximum` per (pod, rank),
    each drawn in [half, whole] (jitter, so pods refused together do not come back together); `reset`
    once the new socket has received a message."""

    def __init__(self, initial: float = 0.1, maximum: float = 5.0) -> None:
        self.initial = initial
        self.maximum = maximum
        self._attempts: dict[tuple[str, int], int] = {}

    def next(self, key: tuple[str, int]) -> float:
        n = self._attempts.get(key, 0)
        self._attempts[key] = min(n + 1, 32)
        delay = min(self.initial * 2**n, self.maximum)
        return random.uniform(delay / 2, delay)

    def reset(self, key: tuple[str, int]) -> None:
        self._attempts.pop(key, None)

    def forget(self, pod: str) -> None:
        for key in [k for k in self._attempts if k[0] == pod]:
            del self._attempts[key]


@dataclass(frozen=True, slots=True)
class SessionEnded:
    """libzmq ended a connecting socket's session for good. `handshaken`: the connection had completed
    its handshake, so the protocol error came from a message (over the cap): that message is lost."""

    handshaken: bool

    def describe(self, rank: int, delay: float) -> str:
        what = (
            f"a message over {MAX_MESSAGE_BYTES} bytes (or broken ZeroMQ framing) ended the connection"
            if self.handshaken
            else "the ZeroMQ handshake failed on a protocol error (not a ZeroMQ PUB on that port?)"
        )
        return f"rank {rank}: {what}; the socket is re-created in {delay:.2f}s, events meanwhile are lost"


async def watch_session(
    monitor: zmq.asyncio.Socket,
    grace: float,
    connected: Callable[[], None],
    disconnected: Callable[[], None],
) -> SessionEnded:
    """Follow a connecting socket's monitor (`MONITORED` events): `connected` at each handshake done,
    `disconnected` at each connection lost; return once a loss was not followed by libzmq's reconnect
    within `grace` seconds (it reports `EVENT_CONNECT_RETRIED` together with the loss)."""
    handshaken = False
    pending = False  # a connection lost, libzmq's reconnect not reported yet
    while True:
        if (
            pending
            and not await monitor.poll(int(grace * 1000))
            and not int(monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN  # (a busy loop may time out first)
        ):
            return SessionEnded(handshaken)
        event = parse_monitor_message(await monitor.recv_multipart())["event"]
        if pending:  # libzmq is reconnecting: whatever comes next is a new connection
            pending = handshaken = False
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            handshaken = True
            connected()
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            handshaken = False
        elif event == zmq.EVENT_DISCONNECTED:
            pending = True
            disconnected()


def recv_with_peer(sock: zmq.Socket[bytes], flags: int) -> tuple[zmq.Frame, list[bytes]]:
    """A message received without waiting (`flags`), its first frame as a `zmq.Frame` (for its peer
    address): that frame, and every frame's bytes."""
    return _with_rest(sock, sock.recv(flags, copy=False))


async def await_with_peer(
    sock: zmq.asyncio.Socket, shadow: zmq.Socket[bytes]
) -> tuple[zmq.Frame, list[bytes]]:
    """`recv_with_peer`, waiting for the message."""
    return _with_rest(shadow, await sock.recv(copy=False))


def _with_rest(sock: zmq.Socket[bytes], first: zmq.Frame) -> tuple[zmq.Frame, list[bytes]]:
    """The rest of a multipart message is there once its first frame is (ZeroMQ delivers it whole)."""
    frames = [first.bytes]
    while sock.getsockopt(zmq.RCVMORE):
        frames.append(sock.recv())
    return first, frames
