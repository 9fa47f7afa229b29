"""A server that cannot start leaves nothing behind: what it had started is stopped."""

from __future__ import annotations

import socket

import pytest

from epp.config import StaticEndpoint, default_config
from epp.server.app import EppServer, ServerSettings


async def test_a_port_in_use_fails_start_and_releases_what_was_started() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = ServerSettings(
            host="127.0.0.1",
            grpc_port=0,
            grpc_health_port=0,
            metrics_port=taken.getsockname()[1],
            secure_serving=False,
        )
        server = EppServer(settings, default_config(), [StaticEndpoint("127.0.0.1:1", None)])
        with pytest.raises(OSError, match="address already in use"):
            await server.start()
    assert server.grpc_port > 0 and not server.is_ready()
    with socket.socket() as again:  # the gRPC listener that had started is closed
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", server.grpc_port))
