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


async def test_serve_process_routes_through_envoy_with_a_given_certificate(tmp_path: object) -> None:
    import pathlib

    certs = pathlib.Path(str(tmp_path))
    crt, key = self_signed()
    (certs / "tls.crt").write_bytes(crt)
    (certs / "tls.key").write_bytes(key)
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    async with FakeModelServer("pod-0") as backend:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "epp",
            "serve",
            "--endpoints",
            backend.address,
            "--host",
            "127.0.0.1",
            "--grpc-port",
            str(grpc_port),
            "--grpc-health-port",
            str(health_port),
            "--metrics-port",
            str(metrics_port),
            "--cert-path",
            str(certs),
            "--log-level",
            "warning",
        )
        try:
            async with aiohttp.ClientSession() as s:
                await http_ok(s, f"http://127.0.0.1:{metrics_port}/readyz", "epp serve ready", process=proc)
                async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as ch:
                    resp = await health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service="")
                    )
                    assert resp.status == health_pb2.HealthCheckResponse.SERVING
                await eventually(lambda: backend.metrics_scrapes > 0, "backend scraped")
                async with EnvoyProcess(EnvoyConfig(epp_port=grpc_port, epp_tls=True)) as envoy:
                    r = await s.post(f"{envoy.url}/v1/chat/completions", json=CHAT)
                    assert r.status == 200
                    assert r.headers["x-served-by"] == "pod-0"
                    r.release()
        finally:
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 15) == 0
