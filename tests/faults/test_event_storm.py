"""An event storm: an engine (its own process) publishes far faster than the EPP can index. The EPP's
memory stays bounded (the SUB socket's receive high-water mark, bounded queues), messages ZeroMQ drops
show up as sequence gaps and are counted, the pod is marked stale or degraded rather than silently
wrong, and the EPP keeps answering meanwhile."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import psutil
import pytest

from epp.config import IndexConfig, default_config
from epp.kvindex.freshness import Freshness

from .cluster import BS, kv_pool
from .publisher import PublisherProcess

BATCHES = 40_000
BLOCKS = 64  # per batch: 1,024 token ids, about 5 KB on the wire
CYCLE = 64  # the engine's state is the current cycle's batches (each cycle starts with AllBlocksCleared)
MB = 1024 * 1024


@pytest.mark.parametrize("replay", [False, True], ids=["no-replay", "replay"])
async def test_an_event_storm_keeps_memory_bounded_and_the_pod_honest(replay: bool) -> None:
    config = replace(default_config(), index=IndexConfig(block_size=BS, max_entries=200_000))
    async with kv_pool(1, replay=replay, envoy=False, config=config, kv={"rcvhwm": 1000}) as pool:
        pod = pool.pods[0]
        proc = PublisherProcess(pool.endpoint(pod), replay_endpoint=pool.replay_endpoint(pod), sndhwm=1000)
        async with proc:
            await proc.empty()
            for _ in range(500):  # the slow joiner
                if pool.messages(pod):
                    break
                await proc.empty()
                await asyncio.sleep(0.01)
            assert pool.messages(pod), "the EPP never heard from the engine"
            me = psutil.Process()
            rss_before = me.memory_info().rss
            peak = rss_before
            storm = asyncio.create_task(proc.command(op="storm", batches=BATCHES, blocks=BLOCKS, cycle=CYCLE))
            answered = 0
            while not storm.done():
                # The EPP keeps serving while it indexes as fast as it can.
                assert "epp_kv_events_total" in await pool.admin("/metrics")
                answered += 1
                peak = max(peak, me.memory_info().rss)
                await asyncio.sleep(0.05)
            assert storm.result() > BATCHES and answered > 0
            # The EPP catches up with what reached it (ZeroMQ dropped the rest at its high-water marks);
            # a last message, once through, reveals any gap at the very end.
            c = pool.counters(pod)
            for _ in range(300):
                last = await proc.empty() - 1
                await asyncio.sleep(0.1)
                peak = max(peak, me.memory_info().rss)
                if pool.epp.ingest.last_seq.get(pod) == last:
                    break
            assert pool.epp.ingest.last_seq.get(pod) == last, "the EPP never caught up"
            assert c.gaps >= 1  # drops are counted, as gaps in the sequence
            state, reason = pool.state(pod)
            if state is Freshness.FRESH:
                # Trusted only if the index is exactly the engine's state: the last cycle's blocks.
                assert replay and c.replays["complete"] >= 1
                assert pool.blocks(pod) == ((BATCHES - 1) % CYCLE + 1) * BLOCKS
            else:
                assert reason in ("unrecovered_gap", "replaying"), reason
            assert (peak - rss_before) < 200 * MB, f"RSS grew by {(peak - rss_before) / MB:.0f} MB"
