"""A pod leaves the endpoint set under traffic (`Datastore.set_endpoints`, as discovery does when a Pod
is deleted): no request is routed to it afterwards, its index entries and KV subscription are gone,
events it still sends are not indexed, and no in-flight state is left behind."""

from __future__ import annotations

import asyncio
import itertools
import random

import psutil

from epp.testing.kv_publisher import stored
from epp.testing.wait import eventually

from .cluster import BS, MODEL, kv_pool, tokens

PROMPTS = [tokens(30, 100_000 * i) for i in range(3)]


def connections_to(host: str, port: int) -> int:
    """Established TCP connections of this process to host:port (the EPP's SUB socket to a publisher;
    an IPv6 socket, so the address may be v4-mapped)."""
    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr
        and c.raddr.ip.removeprefix("::ffff:") == host
        and c.raddr.port == port
        and c.status == psutil.CONN_ESTABLISHED
    )


async def test_a_removed_pod_gets_no_traffic_and_leaves_nothing_behind() -> None:
    async with kv_pool(3) as pool:
        epp = pool.epp
        gone, *kept = pool.pods[2], pool.pods[0], pool.pods[1]
        gone_host = gone.rpartition(":")[0]
        pubs = [pool.publisher(p) for p in pool.pods]
        try:
            for pod, pub, prompt in zip(pool.pods, pubs, PROMPTS, strict=True):
                await pub.start()
                await pool.joined(pod, pub)
                first = 1000 * (pool.pods.index(pod) + 1)
                await pub.publish([stored(list(range(first, first + 30)), None, prompt, BS)])
            for pod, prompt in zip(pool.pods, PROMPTS, strict=True):
                await eventually(lambda pod=pod, prompt=prompt: pool.held(pod, prompt) == 30, "indexed")
            assert connections_to(gone_host, pool.events_port) == 1
            assert await pool.complete([*PROMPTS[2], 1]) == "pod-2"

            removed_at: list[float] = []
            after: list[str] = []  # pods that served requests sent after the removal
            rng = random.Random(5)
            counter = itertools.count()

            async def client() -> None:
                loop = asyncio.get_running_loop()
                while next(counter) < 150:
                    sent_after = bool(removed_at)
                    served = await pool.complete([*rng.choice(PROMPTS), rng.randrange(50)])
                    if sent_after:
                        after.append(served)
                    await asyncio.sleep(0)
                    assert loop.time() < deadline, "traffic took too long"

            deadline = asyncio.get_running_loop().time() + 60
            clients = [asyncio.create_task(client()) for _ in range(4)]
            await eventually(lambda: len(pool.backends[2].requests) >= 5, "pod-2 serving its prompt")
            # Discovery saw the Pod deleted.
            added, removed = epp.datastore.set_endpoints((p, MODEL) for p in kept)
            removed_at.append(asyncio.get_running_loop().time())
            picks_before = epp.metrics.registry.get_sample_value(
                "epp_picks_total", {"endpoint": gone, "profile": "default", "reason": "scored"}
            )
            assert (added, removed) == (set(), {gone})
            await asyncio.gather(*clients)

            assert len(after) > 50
            assert "pod-2" not in after
            assert (
                epp.metrics.registry.get_sample_value(
                    "epp_picks_total", {"endpoint": gone, "profile": "default", "reason": "scored"}
                )
                == picks_before
            )
            # The index and the subscription follow the endpoint set.
            await eventually(
                lambda: gone not in epp.kv_index.pods() and gone not in epp.ingest.counters, "index drained"
            )
            await eventually(lambda: connections_to(gone_host, pool.events_port) == 0, "unsubscribed")
            assert gone not in (await pool.debug_index())["pods"]
            assert await pool.metric("epp_kv_pod_blocks", pod=gone) == 0
            assert f'pod="{gone}"' not in await pool.admin("/metrics")
            # What it still publishes goes nowhere.
            await pubs[2].publish([stored([9000], None, tokens(1, 7), BS)])
            await asyncio.sleep(0.2)
            assert gone not in epp.kv_index.pods() and gone not in epp.ingest.counters
            # The others are untouched, and nothing is left in flight.
            for pod, prompt in zip(kept, PROMPTS[:2], strict=True):
                assert pool.held(pod, prompt) == 30
            await eventually(lambda: epp.datastore.total_in_flight() == 0, "nothing in flight")
            assert await pool.metric("inference_objective_running_requests") == 0
        finally:
            for pub in pubs:
                await pub.stop()
