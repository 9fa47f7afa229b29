"""A real stack on loopback for integration tests: fake model servers, the EPP in-process, real Envoy."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from epp.config import EppConfig, StaticEndpoint, default_config
from epp.server.app import EppServer, ServerSettings
from epp.testing.backend import FakeModelServer, start_backends, stop_backends
from epp.testing.envoy import EnvoyConfig, EnvoyProcess
from epp.testing.wait import eventually

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}]}


@dataclass
class Stack:
    backends: list[FakeModelServer]
    epp: EppServer
    envoy: EnvoyProcess
    session: aiohttp.ClientSession
    served: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.envoy.url

    def backend(self, name: str) -> FakeModelServer:
        return next(b for b in self.backends if b.name == name)

    def by_address(self, address: str) -> FakeModelServer:
        return next(b for b in self.backends if b.address == address)

    async def chat(self, body: dict[str, Any] | None = None, **kwargs: Any) -> tuple[int, str | None, str]:
        if "data" not in kwargs:
            kwargs["json"] = body or CHAT
        async with self.session.post(f"{self.url}/v1/chat/completions", **kwargs) as r:
            text = await r.text()
            return r.status, r.headers.get("x-served-by"), text

    async def admin(self, path: str) -> tuple[int, str]:
        async with self.session.get(f"http://127.0.0.1:{self.epp.metrics_port}{path}") as r:
            return r.status, await r.text()

    async def metric(self, metric_name: str, **labels: str) -> float:
        """Sum of the samples of `metric_name` whose labels include `labels`."""
        name = metric_name
        _, text = await self.admin("/metrics")
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    async def wait_scraped(self) -> None:
        await eventually(
            lambda: all(r.metrics is not None for r in self.epp.datastore.records()), "every endpoint scraped"
        )

    async def wait_idle(self) -> None:
        await eventually(lambda: self.epp.datastore.total_in_flight() == 0, "in-flight back to zero")


@contextlib.asynccontextmanager
async def stack(
    n_backends: int = 3,
    *,
    config: EppConfig | None = None,
    settings: ServerSettings | None = None,
    envoy: EnvoyConfig | None = None,
    endpoints: list[str] | None = None,
    backend_kwargs: dict[str, Any] | None = None,
    override_host: bool = False,
) -> AsyncIterator[Stack]:
    """`override_host`: route with Envoy's override_host policy over the backends (fallback lists)
    instead of ORIGINAL_DST, which takes exactly one address."""
    backends = await start_backends(n_backends, **(backend_kwargs or {}))
    base = settings or ServerSettings()
    settings = replace(
        base,
        host="127.0.0.1",
        grpc_port=0,
        grpc_health_port=0,
        metrics_port=0,
        secure_serving=base.secure_serving if settings else False,
        seed=base.seed if base.seed is not None else 1,
    )
    addresses = endpoints if endpoints is not None else [b.address for b in backends]
    epp = EppServer(settings, config or default_config(), [StaticEndpoint(a) for a in addresses])
    await epp.start()
    envoy_cfg = replace(envoy or EnvoyConfig(), epp_port=epp.grpc_port, epp_tls=settings.secure_serving)
    if override_host:
        envoy_cfg = replace(
            envoy_cfg, pool="override_host", pool_endpoints=tuple(b.address for b in backends)
        )
    proc = EnvoyProcess(envoy_cfg)
    try:
        await proc.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            st = Stack(backends, epp, proc, session)
            if addresses and settings.refresh_metrics_interval > 0:
                await st.wait_scraped()
            yield st
    finally:
        await proc.stop()
        await epp.stop(grace=0.2)
        await stop_backends(backends)
