"""KvIngest replays, without sockets: a replay from 0 whose engine buffer no longer reaches back to seq 0
(a suffix of the stream, applied to a publisher whose blocks are forgotten: `joined_late`, not a hole),
and replays chained when live messages are lost while one runs."""

from __future__ import annotations

from collections import Counter

import pytest

from epp.kvindex.freshness import Freshness
from epp.kvindex.ingest import MAX_CHAINED_REPLAYS, Applied, NeedReplay
from epp.testing.fakes import FakeClock
from epp.testing.kv_publisher import encode_batch, stored

from .test_kv_ingest import (
    BS,
    P,
    assert_same_index,
    chain,
    chain_len,
    gpu,
    lose_contact,
    make,
    published,
    regain_contact,
    toks,
    verdict,
)

N = 20  # messages the engine published
FIRST_BUFFERED = 15  # its replay buffer holds 15..19 (vLLM's `buffer_steps`)


def independent(n: int) -> list[bytes]:
    """`n` messages each storing a chain of its own (so a suffix of them indexes without orphans)."""
    return [encode_batch([stored([100 + i], None, toks(1, 10_000 + i * 16))]) for i in range(n)]


@pytest.mark.parametrize("how", ["first-connection", "reconnect", "first-live-message", "restart"])
def test_a_replay_from_zero_whose_buffer_starts_later_applies_it_and_is_joined_late(how: str) -> None:
    """Every EPP start against a long-running engine: its buffer no longer holds seq 0. What it holds is
    applied (the index under-reports: degraded `joined_late`, as without replay), not cleared as a hole."""
    clock = FakeClock()
    ing = make(replay=True)
    p = independent(N + 1)
    if how == "first-connection":
        assert regain_contact(ing, clock.now()) == NeedReplay(P, 0, 0)
    elif how == "reconnect":
        ing.on_live(P, 0, 0, encode_batch([stored([1], None, toks(1))]), clock.now())
        lose_contact(ing, clock.now())
        assert regain_contact(ing, clock.now()) == NeedReplay(P, 0, 0)
    elif how == "first-live-message":  # central mode: no connection to watch, the first message tells
        assert ing.on_live(P, 0, N - 1, p[N - 1], clock.now()) == NeedReplay(P, 0, 0)
    else:  # the counter went back (central mode's restart signal), and the new run's start is gone
        assert regain_contact(ing, clock.now()) == NeedReplay(P, 0, 0)
        for seq in range(N + 5):  # the old engine's run, all of it replayed
            ing.on_replayed(
                P, 0, seq, encode_batch([stored([500 + seq], None, toks(1, 50_000 + seq * BS))]), 0
            )
        ing.replay_finished(P, 0, clock.now(), complete=True)
        assert verdict(ing, clock.now()) == (Freshness.FRESH, "ok") and gpu(ing) == N + 5
        assert ing.on_live(P, 0, N - 1, p[N - 1], clock.now()) == NeedReplay(P, 0, 0)
        assert ing.counters[P].restarts == 1
    assert gpu(ing) == 0
    for seq in range(FIRST_BUFFERED, N):
        ing.on_replayed(P, 0, seq, p[seq], clock.now())
    assert ing.replay_ended(P, 0, clock.now()) is None
    ing.replay_finished(P, 0, clock.now(), complete=True)
    assert gpu(ing) == N - FIRST_BUFFERED  # the buffered suffix, nothing from before
    c = ing.counters[P]
    assert c.replays["complete"] >= 1 and not c.replays["incomplete"] and c.gaps == 0 and c.orphans == 0
    assert verdict(ing, clock.now()) == (Freshness.DEGRADED, "joined_late")
    assert ing.on_live(P, 0, N, p[N], clock.now()) == Applied(1)  # the live stream continues the suffix
    assert gpu(ing) == N - FIRST_BUFFERED + 1 and c.gaps == 0
    clock.advance(ing.freshness.recovery + 1.0)
    assert verdict(ing, clock.now()) == (Freshness.FRESH, "ok")


def test_a_replay_from_zero_that_only_meets_held_messages_past_zero_is_joined_late() -> None:
    """The engine published so much since the first live message that its buffer starts past it: all the
    replayed messages go with the held ones. Still one suffix, in order."""
    clock = FakeClock()
    ing = make(replay=True)
    p = independent(N)
    assert ing.on_live(P, 0, FIRST_BUFFERED, p[FIRST_BUFFERED], clock.now()) == NeedReplay(P, 0, 0)
    for seq in range(FIRST_BUFFERED, N):
        ing.on_replayed(P, 0, seq, p[seq], clock.now())
    assert ing.replay_ended(P, 0, clock.now()) is None
    assert ing.replay_finished(P, 0, clock.now(), complete=True) == N - FIRST_BUFFERED
    assert ing.counters[P].replays == Counter({"complete": 1})
    assert verdict(ing, clock.now()) == (Freshness.DEGRADED, "joined_late")


def test_a_jump_inside_a_replay_from_zero_is_still_a_hole() -> None:
    clock = FakeClock()
    ing = make(replay=True)
    p = independent(N)
    regain_contact(ing, clock.now())
    ing.on_replayed(P, 0, 15, p[15], clock.now())  # the buffer's start: accepted
    ing.on_replayed(P, 0, 17, p[17], clock.now())  # 16 missing from the engine's own buffer
    assert ing.replay_ended(P, 0, clock.now()) is None  # (replaying again would not find it)
    ing.replay_finished(P, 0, clock.now(), complete=True)
    assert ing.counters[P].replays == Counter({"incomplete": 1})
    assert verdict(ing, clock.now()) == (Freshness.STALE, "unrecovered_gap")
    assert gpu(ing) == 0


def test_a_gap_replay_whose_buffer_no_longer_reaches_back_is_still_a_hole() -> None:
    """Blocks of the stream are indexed: the missing messages may have removed some of them."""
    clock = FakeClock()
    ing = make(replay=True)
    p = chain(6)
    ing.on_live(P, 0, 0, p[0], clock.now())
    assert ing.on_live(P, 0, 4, p[4], clock.now()) == NeedReplay(P, 0, 1)
    ing.on_replayed(P, 0, 3, p[3], clock.now())  # 1 and 2 are gone from the buffer
    ing.replay_finished(P, 0, clock.now(), complete=True)
    assert ing.counters[P].replays == Counter({"incomplete": 1})
    assert verdict(ing, clock.now()) == (Freshness.STALE, "unrecovered_gap")
    assert chain_len(ing, 1) == 0  # seq 0's block forgotten


def test_live_messages_lost_while_a_replay_runs_are_replayed_by_a_chained_replay() -> None:
    """Seq 2 lost (replay from 2); then seq 5 is lost after the engine answered, before its end marker:
    the engine still buffers it, so a second replay from 5 fills the hole; nothing lost, fresh."""
    clock = FakeClock()
    ing = make(replay=True)
    p = chain(8)
    ing.on_live(P, 0, 0, p[0], clock.now())
    ing.on_live(P, 0, 1, p[1], clock.now())
    assert ing.on_live(P, 0, 3, p[3], clock.now()) == NeedReplay(P, 0, 2)
    for seq in (2, 3):  # the engine's buffer when the request arrived
        ing.on_replayed(P, 0, seq, p[seq], clock.now())
    ing.on_live(P, 0, 4, p[4], clock.now())
    ing.on_live(P, 0, 6, p[6], clock.now())  # 5 lost
    assert ing.replay_ended(P, 0, clock.now()) == NeedReplay(P, 0, 5)
    assert verdict(ing, clock.now()) == (Freshness.DEGRADED, "replaying")
    for seq in range(5, 8):  # the second replay; 7 is also sent live afterwards
        ing.on_replayed(P, 0, seq, p[seq], clock.now())
    ing.on_live(P, 0, 7, p[7], clock.now())
    assert ing.replay_ended(P, 0, clock.now()) is None
    assert ing.replay_finished(P, 0, clock.now(), complete=True) == 5  # 3, 4, 5, 6, 7
    c = ing.counters[P]
    assert c.replays == Counter({"complete": 1}) and c.gaps == 2
    assert_same_index(ing, published(p), 8)
    assert verdict(ing, clock.now()) == (Freshness.FRESH, "ok")


def test_a_hole_the_chained_replay_does_not_fill_makes_it_incomplete_and_counts_one_gap() -> None:
    clock = FakeClock()
    ing = make(replay=True)
    p = chain(8)
    ing.on_live(P, 0, 0, p[0], clock.now())
    assert ing.on_live(P, 0, 2, p[2], clock.now()) == NeedReplay(P, 0, 1)
    ing.on_replayed(P, 0, 1, p[1], clock.now())
    ing.on_replayed(P, 0, 2, p[2], clock.now())
    ing.on_live(P, 0, 4, p[4], clock.now())  # 3 lost
    assert ing.replay_ended(P, 0, clock.now()) == NeedReplay(P, 0, 3)
    ing.on_replayed(P, 0, 4, p[4], clock.now())  # the engine no longer has 3 either
    assert ing.replay_ended(P, 0, clock.now()) is None  # asking from 3 again would not help
    ing.replay_finished(P, 0, clock.now(), complete=True)
    c = ing.counters[P]
    assert c.replays == Counter({"incomplete": 1}) and c.gaps == 2  # 1 (the first gap) and 3
    assert verdict(ing, clock.now()) == (Freshness.STALE, "unrecovered_gap")


def test_chained_replays_are_capped() -> None:
    clock = FakeClock()
    ing = make(replay=True)
    n = 2 * MAX_CHAINED_REPLAYS + 6
    p = chain(n)
    ing.on_live(P, 0, 0, p[0], clock.now())
    assert ing.on_live(P, 0, 2, p[2], clock.now()) == NeedReplay(P, 0, 1)
    ing.on_replayed(P, 0, 1, p[1], clock.now())
    seq, chained = 2, 0
    while True:  # each replay fills the last hole, and meanwhile the live stream loses another message
        seq += 2
        ing.on_live(P, 0, seq, p[seq], clock.now())
        need = ing.replay_ended(P, 0, clock.now())
        if need is None:
            break
        chained += 1
        assert need == NeedReplay(P, 0, seq - 1)
        ing.on_replayed(P, 0, seq - 1, p[seq - 1], clock.now())
    assert chained == MAX_CHAINED_REPLAYS
    ing.replay_finished(P, 0, clock.now(), complete=True)
    assert ing.counters[P].replays == Counter({"incomplete": 1})
    assert verdict(ing, clock.now()) == (Freshness.STALE, "unrecovered_gap")
