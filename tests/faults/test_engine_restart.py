"""An engine restarts (its publisher goes away and a new one starts on the same endpoint, counting
from 0): the pod's old blocks are gone from the index before any event of the new stream is applied;
with replay configured, the new stream is replayed from 0."""

from __future__ import annotations

import asyncio

import pytest

from epp.kvindex.freshness import Freshness
from epp.testing.kv_publisher import stored
from epp.testing.wait import eventually

from .cluster import BS, kv_pool, tokens

OLD = tokens(4, 0)  # blocks of the engine before the restart
EARLY = tokens(3, 10_000)  # stored by the new engine before the EPP was connected again (lost on the wire)
NEW = tokens(2, 20_000)  # stored by the new engine afterwards


@pytest.mark.parametrize("replay", [False, True], ids=["no-replay", "replay"])
@pytest.mark.parametrize("counter", ["went-back", "continued"])
async def test_restart_forgets_old_blocks_before_the_new_stream(replay: bool, counter: str) -> None:
    """`went-back`: the new engine's first message the EPP sees has a seq below the old engine's last
    (the usual case). `continued`: the new engine had already sent as many messages as the old one
    before the EPP reconnected, so the first one seen continues the old counter (or passes it, when
    ZeroMQ's slow joiner lost the first probes): the sequence alone cannot tell a restart, the lost
    connection must."""
    async with kv_pool(1, replay=replay, envoy=False) as pool, pool.publisher(pool.pods[0]) as old:
        pod = pool.pods[0]
        await pool.joined(pod, old)
        await old.publish([stored([1, 2, 3, 4], None, OLD, BS)])
        if counter == "went-back":
            for _ in range(1000):
                await old.publish([])
        await eventually(lambda: pool.held(pod, OLD) == 4, "old blocks indexed")
        old_last = old.seq - 1
        await old.stop()
        await eventually(lambda: pool.state(pod) == (Freshness.STALE, "publisher_unreachable"), "stale")

        async with pool.publisher(pod) as new:
            # Before the EPP reconnects: lost live, but in the new engine's replay buffer (seq 0 first).
            await new.publish([stored([101, 102, 103], None, EARLY, BS)], send=False)
            if counter == "continued":
                while new.seq <= old_last:
                    await new.publish([], send=False)
            before = pool.messages(pod)
            for _ in range(500):  # probes until the EPP applies one from the new stream
                await new.publish([])
                if pool.messages(pod) > before:
                    break
                await asyncio.sleep(0.01)
            assert pool.messages(pod) > before, "the new stream never reached the EPP"
            # The first new event is applied: nothing of the old engine is left.
            assert pool.held(pod, OLD) == 0
            assert pool.blocks(pod) in (0, 3)  # nothing, or what the replay brought back (EARLY)
            await new.publish([stored([201, 202], None, NEW, BS)])
            await eventually(lambda: pool.held(pod, NEW) == 2, "new blocks indexed")
            assert pool.held(pod, OLD) == 0
            if replay:
                # The new stream was replayed from 0: what it stored before the EPP reconnected is known.
                await eventually(lambda: pool.held(pod, EARLY) == 3, "replayed from 0")
                assert new.replay_requests >= 1
                await eventually(lambda: pool.state(pod)[0] is Freshness.FRESH, "fresh after the replay")
                assert pool.blocks(pod) == 5
            else:
                assert pool.held(pod, EARLY) == 0  # lost, and not guessed
                assert pool.blocks(pod) == 2
                # Events were missed: no cache credit until the pod has been in order for a while.
                assert pool.state(pod)[0] is not Freshness.FRESH
        c = pool.counters(pod)
        assert c.orphans == 0
        if counter == "went-back" and not replay:
            assert c.restarts == 1


@pytest.mark.parametrize("replay", [False, True], ids=["no-replay", "replay"])
async def test_an_engine_that_restarts_and_stays_idle_leaves_no_blocks_behind(replay: bool) -> None:
    """The new engine sends nothing at all: only the lost connection says anything happened."""
    async with kv_pool(1, replay=replay, envoy=False) as pool, pool.publisher(pool.pods[0]) as old:
        pod = pool.pods[0]
        await pool.joined(pod, old)
        await old.publish([stored([1, 2, 3, 4], None, OLD, BS)])
        await eventually(lambda: pool.held(pod, OLD) == 4, "old blocks indexed")
        await old.stop()
        await eventually(lambda: pool.state(pod) == (Freshness.STALE, "publisher_unreachable"), "stale")
        async with pool.publisher(pod) as new:
            await eventually(lambda: pool.state(pod)[1] != "publisher_unreachable", "reconnected")
            assert pool.held(pod, OLD) == 0 and pool.blocks(pod) == 0
            if replay:
                await eventually(lambda: new.replay_requests >= 1, "replay asked for")
                await eventually(
                    lambda: pool.state(pod)[0] is Freshness.FRESH, "fresh: the replay was complete"
                )
            else:
                assert pool.state(pod) == (Freshness.DEGRADED, "joined_late")
            assert pool.blocks(pod) == 0
