"""Active-active: two EPP replicas behind one Envoy (both in its ext_proc cluster, which Envoy balances
per stream), both subscribed per pod to every simulated engine's KV events (each engine binds its own
loopback address, 127.0.0.2..4, on one events port).

- Their indexes hold the same blocks once the traffic settles (`/debug/index`, and lookups of every
  prompt of the workload).
- The pool's token hit rate (the engines' `cached_tokens / prompt_tokens`) with two replicas is within
  5% of one replica's on the same seeded shared-prefix workload, fresh engines for each run.

Traffic runs in waves of concurrent requests and the test waits between waves until every replica has
applied every KV event batch the engines published: what is compared is routing behaviour, not timing.
What may diverge between replicas, and why it does not matter, is in docs/operations.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import numpy as np

from epp.config import KvEventsConfig, StaticEndpoint, default_config
from epp.kvindex.freshness import Freshness
from epp.kvindex.keys import block_keys, root_key
from epp.server.app import EppServer, ServerSettings
from epp.testing.envoy import EnvoyConfig, EnvoyProcess, free_port, render_bootstrap
from epp.testing.wait import eventually
from simulator.engine import EngineConfig
from simulator.serving import EngineServerConfig, SimulatedEngineServer

MODEL = "demo"
BS = 16
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
GROUPS = 8  # shared prefixes (system prompts, documents)
PREFIX_BLOCKS = 192  # 3,072 tokens: the cache saves more than a few queued requests cost
REQUESTS = 56  # the first of each group, then waves of WAVE concurrent requests
WAVE = 4


@dataclass
class Cluster:
    epps: list[EppServer]
    engines: list[SimulatedEngineServer]
    envoy: EnvoyProcess
    session: aiohttp.ClientSession

    def settled(self) -> bool:
        """Every replica has applied every KV event batch every engine has published."""
        return all(
            epp.ingest.last_seq.get(e.address, -1) == e.engine.sink.seq - 1  # type: ignore[union-attr]
            for epp in self.epps
            for e in self.engines
        )

    async def settle(self) -> None:
        await eventually(self.settled, "every replica applied every KV event batch")
        await eventually(
            lambda: all(epp.datastore.total_in_flight() == 0 for epp in self.epps), "in-flight back to zero"
        )
        # ... and every replica has scraped every engine idle, so no wave sees the last one's queues.
        await eventually(
            lambda: all(
                r.metrics is not None and r.metrics.waiting == 0 and r.metrics.running == 0
                for epp in self.epps
                for r in epp.datastore.records()
            ),
            "every replica scraped every engine idle",
        )

    async def complete(self, prompt: list[int]) -> dict[str, Any]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
        async with self.session.post(f"{self.envoy.url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return dict(await r.json())

    async def debug_index(self, epp: EppServer) -> dict[str, Any]:
        async with self.session.get(f"http://127.0.0.1:{epp.metrics_port}/debug/index") as r:
            assert r.status == 200
            return json.loads(await r.text())  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def cluster(replicas: int) -> AsyncIterator[Cluster]:
    """Fresh engines, `replicas` EPPs subscribed per pod to all of them (with replay), one Envoy."""
    kv_port, replay_port = free_port(), free_port()
    engines = [
        SimulatedEngineServer(
            EngineServerConfig(
                model=MODEL,
                host=h,
                port=free_port(),
                engine=EngineConfig(num_gpu_blocks=2048, block_size=BS),
                kv_events_endpoint=f"tcp://{h}:{kv_port}",
                kv_replay_endpoint=f"tcp://{h}:{replay_port}",
                kv_events_mode="bind",
            )
        )
        for h in HOSTS
    ]
    kv = KvEventsConfig(mode="per-pod", port=kv_port, replay_port=replay_port, sync_interval=0.05)
    config = replace(default_config(), kv_events=kv)
    started: list[SimulatedEngineServer | EppServer] = []
    envoy: EnvoyProcess | None = None
    epps: list[EppServer] = []
    try:
        for e in engines:
            await e.start()
            started.append(e)
        for i in range(replicas):
            settings = ServerSettings.loopback(
                seed=100 + i,  # each replica breaks ties with its own seed
            )
            epp = EppServer(settings, config, [StaticEndpoint(e.address, MODEL) for e in engines])
            await epp.start()
            started.append(epp)
            epps.append(epp)
        envoy_cfg = EnvoyConfig(epp_endpoints=tuple(("127.0.0.1", epp.grpc_port) for epp in epps))
        envoy = EnvoyProcess(envoy_cfg)
        await envoy.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            await eventually(
                lambda: all(r.metrics is not None for epp in epps for r in epp.datastore.records()),
                "every replica scraped every engine",
            )
            # Every replica's SUB socket completed its handshake with every engine's PUB (with replay,
            # anything sent before its subscription arrived is replayed), as each replica sees it.
            await eventually(
                lambda: all(
                    epp.freshness.state(e.address, epp.clock.now()).state != Freshness.STALE
                    for epp in epps
                    for e in engines
                ),
                "every replica subscribed to every engine",
            )
            yield Cluster(epps, engines, envoy, session)
    finally:
        if envoy is not None:
            await envoy.stop()
        for part in reversed(started):
            if isinstance(part, EppServer):
                await part.stop(grace=0.2)
            else:
                await part.stop()


def workload(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(group prefixes, prompts): each prompt is a group's prefix and a suffix of its own; the first
    GROUPS prompts open one group each, the rest pick groups at random."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 30_000) for _ in range(PREFIX_BLOCKS * BS)] for _ in range(GROUPS)]
    order = list(range(GROUPS)) + [rng.randrange(GROUPS) for _ in range(REQUESTS - GROUPS)]
    prompts = [prefixes[g] + [rng.randrange(10, 30_000) for _ in range(rng.randrange(5, 40))] for g in order]
    return prefixes, prompts


@dataclass
class Run:
    prompt_tokens: int
    cached_tokens: int
    routed: list[int]  # requests each replica routed

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens


async def drive(c: Cluster, prompts: list[list[int]]) -> Run:
    """The first GROUPS prompts one at a time, then waves of WAVE at once; settled after each."""
    replies: list[dict[str, Any]] = []
    for p in prompts[:GROUPS]:
        replies.append(await c.complete(p))
        await c.settle()
    rest = prompts[GROUPS:]
    for start in range(0, len(rest), WAVE):
        replies += await asyncio.gather(*(c.complete(p) for p in rest[start : start + WAVE]))
        await c.settle()
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in replies)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies)
    assert prompt_tokens == sum(len(p) for p in prompts)
    return Run(prompt_tokens, cached, [len(epp.decisions) for epp in c.epps])


def test_the_bootstrap_lists_every_replica_in_the_ext_proc_cluster() -> None:
    boot = render_bootstrap(EnvoyConfig(epp_endpoints=(("127.0.0.1", 9002), ("127.0.0.1", 9004))))
    [epp] = [c for c in boot["static_resources"]["clusters"] if c["name"] == "epp"]
    [group] = epp["load_assignment"]["endpoints"]
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"] for e in group["lb_endpoints"]]
    assert ports == [9002, 9004]
    one = render_bootstrap(EnvoyConfig(epp_port=9100))  # unset: the one EPP at epp_host:epp_port
    [epp] = [c for c in one["static_resources"]["clusters"] if c["name"] == "epp"]
    [group] = epp["load_assignment"]["endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in group["lb_endpoints"]] == [9100]


async def test_two_replicas_hold_the_same_index_and_route_as_well_as_one() -> None:
    prefixes, prompts = workload(seed=7)
    async with cluster(1) as single:
        one = await drive(single, prompts)
    async with cluster(2) as pair:
        two = await drive(pair, prompts)
        a, b = pair.epps
        # Envoy spread the streams over both replicas.
        assert sum(two.routed) == len(prompts) and min(two.routed) >= len(prompts) // 4, two.routed
        # The same blocks: per pod the same counts, the same last sequence number, the same entries.
        index_a, index_b = await pair.debug_index(a), await pair.debug_index(b)
        assert index_a["size"] == index_b["size"] > 0
        pods = sorted(e.address for e in pair.engines)
        assert sorted(index_a["pods"]) == sorted(index_b["pods"]) == pods
        for pod in pods:
            pa, pb = index_a["pods"][pod], index_b["pods"][pod]
            assert (pa["blocks"], pa["last_seq"], pa["freshness"]) == (
                pb["blocks"],
                pb["last_seq"],
                pb["freshness"],
            )
            assert pa["gaps"] == pb["gaps"] == 0
        root = root_key(MODEL, None)
        held_somewhere = 0
        for p in prefixes + prompts:
            keys = block_keys(np.asarray(p), BS, root)
            held_a, held_b = a.kv_index.lookup(keys, pods), b.kv_index.lookup(keys, pods)
            assert held_a == held_b
            held_somewhere += max(h.get("gpu", 0) for h in held_a.values()) >= PREFIX_BLOCKS
        assert held_somewhere == len(prefixes) + len(prompts)  # every prefix is held by some pod
    # The pool's hit rate: substantial, and two replicas within 5% of one.
    assert one.hit_rate > 0.5 and two.hit_rate > 0.5, (one, two)
    assert abs(two.hit_rate - one.hit_rate) <= 0.05 * one.hit_rate, (one.hit_rate, two.hit_rate)
