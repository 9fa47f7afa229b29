"""The test publisher binds a port its predecessor (or another process) still holds once it is free,
and fails clearly when it never is."""

from __future__ import annotations

import asyncio
import socket

import pytest
import zmq

from epp.testing import kv_publisher
from epp.testing.kv_publisher import KvEventPublisher


def _held_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


async def test_a_port_freed_while_it_waits_is_taken() -> None:
    holder, port = _held_port()
    pub = KvEventPublisher(f"tcp://127.0.0.1:{port}")
    starting = asyncio.create_task(pub.start())
    await asyncio.sleep(0.2)
    assert not starting.done()  # still trying
    holder.close()
    await asyncio.wait_for(starting, 5)
    try:
        assert pub.port == port
    finally:
        await pub.stop()


async def test_a_port_that_stays_taken_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_publisher, "_BIND_TRIES", 3)
    holder, port = _held_port()
    pub = KvEventPublisher(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(zmq.ZMQError, match="in use"):
            await pub.start()
    finally:
        holder.close()
        await pub.stop()
