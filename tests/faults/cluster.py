"""A KV-aware pool on loopback for the fault suite: fake engines on their own loopback addresses
(127.0.0.2, .3, ...) sharing an HTTP port and a KV-event port, the EPP in-process subscribed per pod
(with or without replay), and optionally a real Envoy in front. Publishers are the tests' business
(in-process `KvEventPublisher`s or `PublisherProcess`es), at `KvPool.endpoint(pod)`."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import numpy as np

from epp.config import DEFAULT_CONFIG_YAML, EppConfig, KvEventsConfig, StaticEndpoint, parse_config
from epp.kvindex.freshness import Freshness
from epp.kvindex.keys import block_keys, root_key
from epp.server.app import EppServer, ServerSettings
from epp.testing.backend import FakeModelServer
from epp.testing.envoy import EnvoyConfig, EnvoyProcess, free_port
from epp.testing.kv_publisher import KvEventPublisher
from epp.testing.wait import eventually

BS = 16
MODEL = "tiny"


def tokens(n_blocks: int, start: int) -> list[int]:
    """Token ids of `n_blocks` full blocks; `start` keeps prompts of one test apart."""
    return [1000 + start + i for i in range(n_blocks * BS)]


def keys_of(token_ids: list[int]) -> np.ndarray:
    return block_keys(token_ids, BS, root_key(MODEL, None))


@dataclass
class KvPool:
    epp: EppServer
    backends: list[FakeModelServer]
    events_port: int
    replay_port: int | None
    envoy: EnvoyProcess | None
    session: aiohttp.ClientSession

    @property
    def pods(self) -> list[str]:
        return [b.address for b in self.backends]

    def endpoint(self, pod: str) -> str:
        return f"tcp://{pod.rpartition(':')[0]}:{self.events_port}"

    def replay_endpoint(self, pod: str) -> str | None:
        if self.replay_port is None:
            return None
        return f"tcp://{pod.rpartition(':')[0]}:{self.replay_port}"

    def publisher(self, pod: str) -> KvEventPublisher:
        return KvEventPublisher(self.endpoint(pod), replay_endpoint=self.replay_endpoint(pod))

    def name_of(self, pod: str) -> str:
        return next(b.name for b in self.backends if b.address == pod)

    # -- the index ------------------------------------------------------------------------
    def blocks(self, pod: str) -> int:
        return self.epp.kv_index.pod_counts(pod).get("gpu", 0)

    def held(self, pod: str, token_ids: list[int]) -> int:
        """How many leading blocks of `token_ids` the index says `pod` holds."""
        return self.epp.kv_index.lookup(keys_of(token_ids), [pod])[pod].get("gpu", 0)

    def state(self, pod: str) -> tuple[Freshness, str]:
        v = self.epp.freshness.state(pod, self.epp.clock.now())
        return v.state, v.reason

    def counters(self, pod: str) -> Any:
        return self.epp.ingest.counters.get(pod)

    async def joined(self, pod: str, pub: KvEventPublisher) -> None:
        """Defeat ZeroMQ's slow joiner: empty batches until the EPP has applied one from `pub`."""
        start = self.messages(pod)
        for _ in range(500):
            await pub.publish([])
            if self.messages(pod) > start:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{pod} never received an event batch")

    def messages(self, pod: str) -> int:
        c = self.epp.ingest.counters.get(pod)
        return c.messages if c is not None else 0

    # -- requests and the admin port ----------------------------------------------------------
    async def complete(self, prompt: list[int]) -> str:
        """A completion with a token-id prompt through Envoy; returns the pod that served it."""
        assert self.envoy is not None
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        async with self.session.post(f"{self.envoy.url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return str(r.headers["x-served-by"])

    async def admin(self, path: str) -> str:
        async with self.session.get(f"http://127.0.0.1:{self.epp.metrics_port}{path}") as r:
            assert r.status == 200, path
            return await r.text()

    async def debug_index(self) -> dict[str, Any]:
        return json.loads(await self.admin("/debug/index"))  # type: ignore[no-any-return]

    async def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for line in (await self.admin("/metrics")).splitlines():
            if not (line.startswith(name + "{") or line.startswith(name + " ")):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total


HOSTS = tuple(f"127.0.0.{i}" for i in range(2, 10))


@contextlib.asynccontextmanager
async def kv_pool(
    n: int = 3,
    *,
    replay: bool = False,
    envoy: bool = True,
    config: EppConfig | None = None,
    kv: dict[str, Any] | None = None,
    settings: ServerSettings | None = None,
    backend_kwargs: dict[str, Any] | None = None,
) -> AsyncIterator[KvPool]:
    """`kv`: KvEventsConfig fields over per-pod mode on the pool's ports.

    The fake engines serve requests without publishing KV events for them, which a real engine's
    growing prefix-cache misses would make the EPP call `silent` (stale) after 10 s; that rule is off
    here (`silence`), so that a slow run of a test about another fault is not mistaken for it. For the
    same reason the default config here has no speculative entries (`speculativeTtl: 0`): they would
    credit the pods that served a prompt with holding it, which these engines never report."""
    http, events = free_port(), free_port()
    replay_port = free_port() if replay else None
    backends = [
        FakeModelServer(f"pod-{i}", host=h, port=http, model=MODEL, **(backend_kwargs or {}))
        for i, h in enumerate(HOSTS[:n])
    ]
    no_speculation = "- type: ttft-scorer\n  parameters: {speculativeTtl: 0}\n"
    cfg = config or parse_config(
        DEFAULT_CONFIG_YAML.replace("- type: ttft-scorer\n", no_speculation), "<faults default>"
    )
    kv_settings = KvEventsConfig(mode="per-pod", port=events, replay_port=replay_port, replay_timeout=1.0)
    cfg = replace(cfg, kv_events=replace(kv_settings, sync_interval=0.05, **(kv or {})))
    base = settings or ServerSettings()
    server_settings = replace(
        base, host="127.0.0.1", grpc_port=0, grpc_health_port=0, metrics_port=0, secure_serving=False, seed=5
    )
    epp = EppServer(server_settings, cfg, [StaticEndpoint(f"{b.host}:{http}", MODEL) for b in backends])
    epp.freshness.silence = 3600.0
    proc: EnvoyProcess | None = None
    try:
        for b in backends:
            await b.start()
        await epp.start()
        if envoy:
            proc = EnvoyProcess(EnvoyConfig(epp_port=epp.grpc_port))
            await proc.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            pool = KvPool(epp, backends, events, replay_port, proc, session)
            if server_settings.refresh_metrics_interval > 0:
                await eventually(
                    lambda: all(r.metrics is not None for r in epp.datastore.records()), "every pod scraped"
                )
            yield pool
    finally:
        if proc is not None:
            await proc.stop()
        await epp.stop(grace=0.2)
        for b in backends:
            await b.stop()
