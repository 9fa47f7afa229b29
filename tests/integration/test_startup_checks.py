"""Starting up: a port in use or a certificate that does not match its key ends `epp serve` with one
clear line, not a traceback; readiness waits for the first metrics scrape of every endpoint (a failed
scrape counts, the scrape timeout bounds the wait)."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import socket
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.cli import main
from epp.config import StaticEndpoint, default_config
from epp.server.app import EppServer, ServerSettings
from epp.server.tls import self_signed
from epp.testing.backend import FakeModelServer
from epp.testing.wait import eventually

SERVE = ["serve", "--endpoints", "127.0.0.1:1", "--host", "127.0.0.1", "--secure-serving=false"]


def listening_socket() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize(
    ("flag", "what"),
    [("--grpc-port", "ext_proc gRPC"), ("--grpc-health-port", "gRPC health"), ("--metrics-port", "metrics")],
)
def test_a_port_in_use_is_one_clear_line(flag: str, what: str, capsys: pytest.CaptureFixture[str]) -> None:
    with listening_socket() as taken:
        port = taken.getsockname()[1]
        ports = {"--grpc-port": "0", "--grpc-health-port": "0", "--metrics-port": "0", flag: str(port)}
        assert main([*SERVE, *(x for kv in ports.items() for x in kv)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"epp: cannot listen for {what} on 127.0.0.1:{port} ({flag}): ")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_certificate_that_does_not_match_its_key_is_one_clear_line(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    crt, _ = self_signed()
    _, key = self_signed()
    (tmp_path / "tls.crt").write_bytes(crt)
    (tmp_path / "tls.key").write_bytes(key)
    args = ["serve", "--endpoints", "127.0.0.1:1", "--host", "127.0.0.1", "--cert-path", str(tmp_path)]
    assert main([*args, "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"epp: --cert-path {str(tmp_path)!r}: the certificate ")
    assert "do not match" in err and "Traceback" not in err


class GatedMetrics(FakeModelServer):
    """A model server whose /metrics answers only once `gate` is set."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.gate = asyncio.Event()

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_scrapes += 1
        await self.gate.wait()
        self.metrics_scrapes -= 1  # counted again by the real handler
        return await super()._metrics(request)


async def readiness(port: int, service: str = "readiness") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service))
        return int(resp.status)


async def readyz(epp: EppServer) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{epp.metrics_port}/readyz") as r,
    ):
        return r.status


@contextlib.asynccontextmanager
async def started(backend: FakeModelServer, metrics_timeout: float) -> AsyncIterator[EppServer]:
    settings = ServerSettings.loopback(metrics_timeout=metrics_timeout)
    epp = EppServer(settings, default_config(), [StaticEndpoint(backend.address)])
    await epp.start()
    try:
        yield epp
    finally:
        await epp.stop(grace=0)


@pytest.mark.parametrize("metrics_mode", ["ok", "error500"])
async def test_ready_once_every_endpoint_has_had_its_first_scrape(metrics_mode: str) -> None:
    async with GatedMetrics("pod-0") as backend:
        backend.metrics_mode = metrics_mode  # type: ignore[assignment]
        try:
            async with started(backend, metrics_timeout=30.0) as epp:
                await eventually(lambda: backend.metrics_scrapes > 0, "first scrape begun")
                # The scrape cannot end before the gate opens: alive, not ready.
                assert not epp.is_ready()
                assert await readyz(epp) == 503
                assert await readiness(epp.grpc_health_port) == health_pb2.HealthCheckResponse.NOT_SERVING
                assert await readiness(epp.grpc_health_port, "") == health_pb2.HealthCheckResponse.NOT_SERVING
                assert (
                    await readiness(epp.grpc_health_port, "liveness")
                    == health_pb2.HealthCheckResponse.SERVING
                )
                backend.gate.set()
                await eventually(epp.is_ready, "ready after the first scrape")
                assert await readyz(epp) == 200
                assert await readiness(epp.grpc_health_port) == health_pb2.HealthCheckResponse.SERVING
                rec = epp.datastore.get(backend.address)
                assert rec is not None
                if metrics_mode == "ok":  # scraped: the staleness filter lets it through from the start
                    assert rec.metrics is not None
                else:  # a failed first scrape counts as the endpoint's attempt
                    assert rec.metrics is None and rec.scrape_failures >= 1
        finally:
            backend.gate.set()


async def test_readiness_waits_no_longer_than_the_scrape_timeout() -> None:
    async with GatedMetrics("pod-0") as backend:
        try:
            async with started(backend, metrics_timeout=0.3) as epp:
                await eventually(epp.is_ready, "ready once the first scrape timed out")
                assert await readiness(epp.grpc_health_port) == health_pb2.HealthCheckResponse.SERVING
        finally:
            backend.gate.set()
