"""`epp serve` as a process: it serves, answers health checks, and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.server.tls import self_signed
from epp.testing.backend import FakeModelServer
from epp.testing.envoy import EnvoyConfig, EnvoyProcess, free_port
from epp.testing.wait import http_ok

from .stack import CHAT, eventually


class Ports:
    def __init__(self) -> None:
        self.grpc, self.health, self.metrics = free_port(), free_port(), free_port()

    def flags(self) -> list[str]:
        return [
            "--host",
            "127.0.0.1",
            "--grpc-port",
            str(self.grpc),
            "--grpc-health-port",
            str(self.health),
            "--metrics-port",
            str(self.metrics),
        ]


async def serve(ports: Ports, *flags: str, **kw: object) -> asyncio.subprocess.Process:
    """`python -m epp serve` on loopback, on `ports`."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "epp",
        "serve",
        *flags,
        *ports.flags(),
        **kw,  # type: ignore[arg-type]
    )


async def health_status(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service))
        return int(resp.status)


async def test_serve_process_routes_through_envoy_with_a_given_certificate(tmp_path: object) -> None:
    import pathlib

    certs = pathlib.Path(str(tmp_path))
    crt, key = self_signed()
    (certs / "tls.crt").write_bytes(crt)
    (certs / "tls.key").write_bytes(key)
    ports = Ports()
    async with FakeModelServer("pod-0") as backend:
        proc = await serve(
            ports, "--endpoints", backend.address, "--cert-path", str(certs), "--log-level", "warning"
        )
        try:
            async with aiohttp.ClientSession() as s:
                await http_ok(s, f"http://127.0.0.1:{ports.metrics}/readyz", "epp serve ready", process=proc)
                assert await health_status(ports.health, "") == health_pb2.HealthCheckResponse.SERVING
                await eventually(lambda: backend.metrics_scrapes > 0, "backend scraped")
                async with EnvoyProcess(EnvoyConfig(epp_port=ports.grpc, epp_tls=True)) as envoy:
                    r = await s.post(f"{envoy.url}/v1/chat/completions", json=CHAT)
                    assert r.status == 200
                    assert r.headers["x-served-by"] == "pod-0"
                    r.release()
        finally:
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 15) == 0


async def test_serve_process_takes_the_reference_charts_flags(tmp_path: object) -> None:
    """`epp serve` with the reference chart's flags (JSON logs, tracing and metrics auth off, leader
    election) starts, answers the chart's health probe service `inference-extension`, logs JSON lines, and
    scrapes the port `--model-server-metrics-port` names instead of the endpoint's own."""
    import json

    ports = Ports()
    async with FakeModelServer("pod-0") as backend, FakeModelServer("exporter") as exporter:
        config = (
            "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
            f"endpoints:\n- address: {backend.address}\n"
        )
        proc = await serve(
            ports,
            "--config-text",
            config,
            "--zap-encoder",
            "json",
            "--tracing=false",
            "--metrics-endpoint-auth=false",
            "--ha-enable-leader-election",
            "--v=3",
            "--model-server-metrics-port",
            str(exporter.port),
            "--secure-serving=false",
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with aiohttp.ClientSession() as s:
                await http_ok(s, f"http://127.0.0.1:{ports.metrics}/readyz", "epp serve ready", process=proc)
            serving = health_pb2.HealthCheckResponse.SERVING
            assert await health_status(ports.health, "inference-extension") == serving
            await eventually(lambda: exporter.metrics_scrapes > 0, "the exporter port scraped")
            assert backend.metrics_scrapes == 0
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.stderr is not None
            err = await asyncio.wait_for(proc.stderr.read(), 15)
            assert await asyncio.wait_for(proc.wait(), 15) == 0
    lines = [json.loads(line) for line in err.decode().splitlines() if line.strip()]
    assert lines and all({"level", "ts", "logger", "msg"} <= line.keys() for line in lines)
    assert any("--ha-enable-leader-election" in line["msg"] for line in lines)


async def test_enable_cert_reload_serves_a_renewed_certificate(tmp_path: object) -> None:
    """With `--enable-cert-reload`, a TLS connection made after `tls.crt` / `tls.key` change gets the new
    certificate (no restart); a broken pair written later is refused and the last good one stays."""
    import pathlib

    from epp.config import StaticEndpoint, default_config
    from epp.server.app import EppServer, ServerSettings

    certs = pathlib.Path(str(tmp_path))
    old_crt, old_key = self_signed()
    (certs / "tls.crt").write_bytes(old_crt)
    (certs / "tls.key").write_bytes(old_key)

    async def handshake(trusted: bytes) -> bool:
        creds = grpc.ssl_channel_credentials(root_certificates=trusted)
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{server.grpc_port}", creds, options=[("grpc.ssl_target_name_override", "epp")]
        ) as ch:
            try:
                await asyncio.wait_for(ch.channel_ready(), 3)
            except TimeoutError:
                return False
            return True

    settings = ServerSettings.loopback(secure_serving=True, cert_path=str(certs), cert_reload=True)
    server = EppServer(settings, default_config(), [StaticEndpoint("127.0.0.1:1")])
    await server.start()
    try:
        assert await handshake(old_crt)
        new_crt, new_key = self_signed()
        (certs / "tls.key").write_bytes(new_key)
        (certs / "tls.crt").write_bytes(new_crt)
        assert await handshake(new_crt)
        assert not await handshake(old_crt)
        (certs / "tls.crt").write_bytes(b"not a certificate")
        assert await handshake(new_crt)  # the broken pair is not taken
    finally:
        await server.stop(grace=0)
