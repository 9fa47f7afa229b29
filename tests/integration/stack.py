"""A real stack on loopback for integration tests: fake model servers, the EPP in-process, real Envoy."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import pytest

from epp.config import EppConfig, KvEventsConfig, StaticEndpoint, default_config
from epp.server.app import EppServer, ServerSettings
from epp.testing.backend import FakeModelServer, start_backends, stop_backends
from epp.testing.envoy import EnvoyConfig, EnvoyProcess, find_envoy, free_port
from epp.testing.kv_publisher import KvEventPublisher
from epp.testing.wait import eventually

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}]}


def _have_envoy() -> bool:
    try:
        find_envoy()
    except FileNotFoundError:
        return False
    return True


ENVOY_MARKS = [pytest.mark.envoy, pytest.mark.skipif(not _have_envoy(), reason="no envoy binary")]
"""A module's `pytestmark` when all its tests run a real Envoy."""


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
            await eventually(epp.is_ready, "EPP ready")  # after the first scrape round
            yield st
    finally:
        await proc.stop()
        await epp.stop(grace=0.2)
        await stop_backends(backends)


BS = 16
MODEL = "tiny"
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


@contextlib.asynccontextmanager
async def kv_cluster(
    tokenizer_dir: str | None = None,
    *,
    config: EppConfig | None = None,
    backend_kwargs: dict[str, Any] | None = None,
    envoy: EnvoyConfig | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """Three fake engines on their own loopback addresses, each with a real ZeroMQ KV-event publisher;
    the EPP subscribed per pod; a real Envoy in front. Keys of the yielded dict: epp, envoy, backends,
    pubs, session."""
    port, events = free_port(), free_port()
    backends = [
        FakeModelServer(f"pod-{i}", host=h, port=port, model=MODEL, **(backend_kwargs or {}))
        for i, h in enumerate(HOSTS)
    ]
    for b in backends:
        await b.start()
    pubs = [
        await KvEventPublisher(f"tcp://{h}:{events}", topic=f"kv@{h}:{port}@{MODEL}").start() for h in HOSTS
    ]
    cfg = config or default_config()
    cfg = replace(
        cfg,
        kv_events=KvEventsConfig(mode="per-pod", port=events, sync_interval=0.05),
        tokenizers={MODEL: tokenizer_dir} if tokenizer_dir else dict(cfg.tokenizers),
    )
    settings = ServerSettings.loopback(seed=3)
    epp = EppServer(settings, cfg, [StaticEndpoint(b.address, MODEL) for b in backends])
    await epp.start()
    proc = EnvoyProcess(replace(envoy or EnvoyConfig(), epp_port=epp.grpc_port))
    try:
        await proc.start()
        async with aiohttp.ClientSession() as session:
            # Every pod's publisher reaches the EPP (ZeroMQ's slow joiner) before the test starts.
            for _ in range(500):
                for p in pubs:
                    await p.publish([])
                if all(b.address in epp.ingest.last_seq for b in backends):
                    break
                await asyncio.sleep(0.01)
            await eventually(
                lambda: all(r.metrics is not None for r in epp.datastore.records()), "every endpoint scraped"
            )
            yield {"epp": epp, "envoy": proc, "backends": backends, "pubs": pubs, "session": session}
    finally:
        await proc.stop()
        await epp.stop(grace=0.2)
        for p in pubs:
            await p.stop()
        for b in backends:
            await b.stop()
