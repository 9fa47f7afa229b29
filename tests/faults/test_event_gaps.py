"""Lost KV events (a sequence gap). Without replay: the pod is cleared and stale (no cache credit; with
every candidate stale, picks are `load-only`), the gap is counted, and the pod is fresh again after
`recovery` seconds of in-order events. With replay: healed, with no block lost or left behind."""

from __future__ import annotations

import random

from epp.kvindex.freshness import Freshness
from epp.testing.kv_publisher import removed, stored
from epp.testing.wait import eventually

from .cluster import BS, kv_pool, tokens


async def test_a_gap_without_replay_is_stale_load_only_and_counted() -> None:
    async with kv_pool(2) as pool:
        pool.epp.freshness.recovery = 1.0  # seconds of in-order events before a stale pod is trusted again
        pubs = [pool.publisher(p) for p in pool.pods]
        try:
            for pod, pub in zip(pool.pods, pubs, strict=True):
                await pub.start()
                await pool.joined(pod, pub)
            prompts = [tokens(30, 0), tokens(30, 50_000)]
            for i, (pub, prompt) in enumerate(zip(pubs, prompts, strict=True)):
                await pub.publish([stored(list(range(100 * i + 1, 100 * i + 31)), None, prompt, BS)])
            for pod, prompt in zip(pool.pods, prompts, strict=True):
                await eventually(lambda pod=pod, prompt=prompt: pool.held(pod, prompt) == 30, "indexed")
            await eventually(
                lambda: all(pool.state(p)[0] is Freshness.FRESH for p in pool.pods), "every pod fresh"
            )
            assert await pool.complete([*prompts[1], 5]) == "pod-1"
            assert await pool.metric("epp_pick_mode_total", mode="cache-aware") == 1

            for pub in pubs:
                await pub.publish([removed([1, 101])], send=False)  # lost: the index cannot know
                await pub.publish([])
            for pod in pool.pods:
                await eventually(
                    lambda pod=pod: pool.state(pod) == (Freshness.STALE, "unrecovered_gap"), f"{pod} stale"
                )
                assert pool.blocks(pod) == 0  # cleared: a lost removal must not leave phantom blocks
                assert await pool.metric("epp_kv_gaps_total", pod=pod) == 1
                assert (await pool.debug_index())["pods"][pod]["reason"] == "unrecovered_gap"
            for _ in range(3):
                await pool.complete([*prompts[1], 5])
            assert await pool.metric("epp_pick_mode_total", mode="load-only") == 3

            # In-order events again: trusted after `recovery` seconds.
            await pubs[1].publish([stored([201, 202], None, prompts[1][: 2 * BS], BS)])
            await eventually(lambda: pool.held(pool.pods[1], prompts[1]) == 2, "new events indexed")
            for pod in pool.pods:
                await eventually(lambda pod=pod: pool.state(pod)[0] is Freshness.FRESH, f"{pod} fresh again")
            await pool.complete([*prompts[1], 5])
            assert await pool.metric("epp_pick_mode_total", mode="cache-aware") == 2
        finally:
            for pub in pubs:
                await pub.stop()


async def test_gaps_with_replay_heal_with_no_block_lost_or_left_behind() -> None:
    rng = random.Random(8)
    chain = tokens(60, 0)
    async with kv_pool(1, replay=True, envoy=False) as pool:
        pod = pool.pods[0]
        async with pool.publisher(pod) as pub:
            await pool.joined(pod, pub)
            await eventually(lambda: pool.state(pod)[0] is Freshness.FRESH, "fresh")
            lost = 0
            events = [
                stored([h], h - 1 if h > 1 else None, chain[(h - 1) * BS : h * BS], BS) for h in range(1, 61)
            ]
            events += [removed([h]) for h in range(60, 50, -1)]  # the engine evicts the tail
            for ev in events:
                send = rng.random() > 0.2
                lost += not send
                await pub.publish([ev], send=send)
            await pub.publish([])  # the last message reveals any gap at the end
            assert lost > 5
            await eventually(lambda: pool.held(pod, chain) == 50 and pool.blocks(pod) == 50, "healed")
            await eventually(lambda: pool.state(pod)[0] is Freshness.FRESH, "fresh after the replays")
            c = pool.counters(pod)
            assert c.gaps >= 1 and c.replays["complete"] >= 1 and c.replays["incomplete"] == 0
            assert c.orphans == 0
            assert pool.epp.kv_index.stats().entries == 50
