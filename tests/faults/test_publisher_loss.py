"""A pod's KV-event publisher goes away: killed (SIGKILL: the kernel closes its connection) or frozen
(SIGSTOP: a hung engine, or a node gone without a word, whose connection stays open). The pod turns
stale (`publisher_unreachable`) and gets no cache credit, so picks are `degraded`; when a publisher is
back, the index is rebuilt by replay and the pod is fresh again."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import zmq

from epp.kvindex.freshness import Freshness
from epp.testing.kv_publisher import KvEventPublisher
from epp.testing.wait import eventually

from .cluster import BS, KvPool, kv_pool, tokens
from .publisher import PublisherProcess

PROMPT = tokens(40, 0)
HASHES = list(range(1, 41))


async def cached_tokens(pool: KvPool, pod: str) -> list[int]:
    """The cache credit `pod` got in each decision of /debug/decisions (newest first)."""
    doc = json.loads(await pool.admin("/debug/decisions?limit=100"))
    out = []
    for d in doc["decisions"]:
        entry: dict[str, Any] = next(c for c in d["candidates"] if c["endpoint"] == pod)
        out.append(int(entry["cached_tokens"]))
    return out


async def picks(pool: KvPool, n: int) -> list[str]:
    return [await pool.complete([*PROMPT, 7, 7, 7]) for _ in range(n)]


async def indexed(pool: KvPool, victim: str, proc: PublisherProcess) -> None:
    """Wait until the victim's prompt is indexed. It reaches the EPP live or by the replay on connect;
    should it fall between the two (sent before the subscription took effect, after the replay), the
    next message reveals the gap and a replay brings it: so empty batches until it is there."""
    for _ in range(200):
        if pool.held(victim, PROMPT) == 40:
            return
        await proc.empty()
        await asyncio.sleep(0.05)
    raise AssertionError(f"{victim}: prompt never indexed ({pool.held(victim, PROMPT)} blocks)")


async def setup(pool: KvPool, victim: str) -> PublisherProcess:
    proc = await PublisherProcess(pool.endpoint(victim), replay_endpoint=pool.replay_endpoint(victim)).start()
    await proc.store(HASHES, None, PROMPT)
    await indexed(pool, victim, proc)
    return proc


async def start_others(pool: KvPool, victim: str) -> list[KvEventPublisher]:
    """Start a publisher for every pod but `victim`, each joined by the EPP."""
    others = []
    for pod in pool.pods:
        if pod != victim:
            p = pool.publisher(pod)
            await p.start()
            await pool.joined(pod, p)
            others.append(p)
    return others


async def test_killed_publisher_turns_stale_then_recovers_from_a_new_one() -> None:
    async with kv_pool(3, replay=True) as pool:
        victim = pool.pods[1]
        others = await start_others(pool, victim)
        try:
            proc = await setup(pool, victim)
            for pod in pool.pods:
                await eventually(
                    lambda pod=pod: pool.state(pod)[0] is Freshness.FRESH, f"{pod} fresh", timeout=20
                )
            assert await picks(pool, 4) == ["pod-1"] * 4
            assert await pool.metric("epp_pick_mode_total", mode="cache-aware") == 4

            await proc.kill()
            await eventually(
                lambda: pool.state(victim) == (Freshness.STALE, "publisher_unreachable"), "stale once killed"
            )
            report = (await pool.debug_index())["pods"][victim]
            assert (report["freshness"], report["reason"]) == ("stale", "publisher_unreachable")
            await picks(pool, 6)
            # No cache credit for the stale pod: the pick is by load alone among the three.
            assert await pool.metric("epp_pick_mode_total", mode="degraded") == 6
            assert (await cached_tokens(pool, victim))[:6] == [0] * 6
            assert await pool.metric("epp_kv_pod_freshness", pod=victim, state="stale") == 1

            # A new engine process on the same endpoint, which served the prompt again.
            async with PublisherProcess(
                pool.endpoint(victim), replay_endpoint=pool.replay_endpoint(victim)
            ) as again:
                await again.store([h + 1000 for h in HASHES], None, PROMPT)
                await indexed(pool, victim, again)
                await eventually(lambda: pool.state(victim)[0] is Freshness.FRESH, "fresh again")
                assert await picks(pool, 4) == ["pod-1"] * 4
                assert await pool.metric("epp_pick_mode_total", mode="cache-aware") == 8
                assert pool.counters(victim).orphans == 0
        finally:
            for p in others:
                await p.stop()


async def test_frozen_publisher_turns_stale_by_heartbeat_then_recovers() -> None:
    async with kv_pool(3, replay=True) as pool:
        victim = pool.pods[1]
        others = await start_others(pool, victim)
        proc = await setup(pool, victim)
        try:
            # The bound: a heartbeat every interval, the connection closed `timeout` after an unanswered one.
            sub = pool.epp.subscriber
            assert sub is not None
            sock = sub._streams[(victim, 0)][0]
            bound = sub.heartbeat_interval + sub.heartbeat_timeout
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) == int(sub.heartbeat_interval * 1000)
            assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == int(sub.heartbeat_timeout * 1000)
            assert bound <= 5.0

            proc.signal(signal.SIGSTOP)  # its socket stays open: only the heartbeat can tell
            await eventually(
                lambda: pool.state(victim) == (Freshness.STALE, "publisher_unreachable"),
                "stale once frozen",
                timeout=bound + 10,
            )
            await picks(pool, 3)
            assert await pool.metric("epp_pick_mode_total", mode="degraded") >= 3
            assert (await cached_tokens(pool, victim))[:3] == [0] * 3

            proc.signal(signal.SIGCONT)  # the same engine, its buffer intact: replayed from 0
            await eventually(lambda: pool.state(victim)[0] is Freshness.FRESH, "fresh again", timeout=20)
            assert pool.held(victim, PROMPT) == 40
            await proc.store([41], HASHES[-1], tokens(1, 40 * BS))  # and live events continue the chain
            await eventually(lambda: pool.blocks(victim) == 41, "live after the replay")
            assert pool.counters(victim).orphans == 0
        finally:
            await proc.kill()
            for p in others:
                await p.stop()
