"""One publisher's stream state (an engine process and data-parallel rank): its sequence, the replay in
progress, and the live messages held until that replay ends. Pure; `ingest.KvIngest` drives it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from operator import itemgetter

from epp.kvindex.batch_reader import Message, held_size
from epp.kvindex.sequence import SequenceTracker


@dataclass(slots=True)
class PublisherState:
    seq: SequenceTracker = field(default_factory=SequenceTracker)
    replaying: bool = False
    restart_pending: bool = False  # a restart is being healed by this replay
    replay_hole: bool = False  # the replay skipped a seq: it cannot be complete
    replay_from: int = 0  # where the current replay (of a chain) started
    # The replay is from 0 and nothing of this stream is applied (a new publisher, or its blocks forgotten
    # at a reconnect or restart): a first replayed seq > 0 is the engine's buffer no longer reaching back
    # to 0, a suffix of the stream applied to an empty state (the index under-reports), not a hole.
    from_empty: bool = False
    late: bool = False  # such a suffix was taken: the pod is `joined_late` once the replay ends
    chained: int = 0  # replays chained after this one's end marker (`MAX_CHAINED_REPLAYS`)
    counted_hole: int | None = None  # the hole among held messages last counted as a gap
    lost_contact: bool = False  # the connection dropped: whoever answers next may be a new engine process
    prev_last: int | None = None  # the last seq before contact was lost, until the next message is seen
    # Live messages (and replayed ones past the first of them) waiting for the replay to end: (seq, payload,
    # topic model). Payloads, not decoded batches: a decoded token id costs about ten times its wire size (a
    # batch given decoded, by the simulator, is held as it is).
    held: deque[tuple[int, Message, str | None]] = field(default_factory=deque)
    held_bytes: int = 0

    def begin_replay(self, from_seq: int) -> None:
        """A replay from `from_seq` starts (the first of a chain)."""
        self.replaying = True
        self.replay_from = from_seq
        self.from_empty = from_seq == 0 and self.seq.last is None
        self.late = False
        self.chained = 0
        self.counted_hole = None

    def end_replay(self) -> list[tuple[int, Message, str | None]]:
        """The replay (chain) is over: its state goes; returns the messages that were held, in seq order."""
        held = list(self.held)
        self.held.clear()
        self.held_bytes = 0
        self.replaying = False
        self.replay_hole = False
        self.from_empty = self.late = False
        self.chained = 0
        self.counted_hole = None
        return held

    def hold(
        self, seq: int, payload: Message, topic_model: str | None, max_held: int, max_held_bytes: int
    ) -> bool:
        """Keep a message for the end of the replay, in seq order (a seq held already is kept once);
        False (not kept) past `max_held` messages or `max_held_bytes`, except the first (the replay
        needs it)."""
        held = self.held
        at = len(held)
        if held and seq <= held[-1][0]:  # a replayed message, or a live one that came after its replayed copy
            at = bisect_left(held, seq, key=itemgetter(0))
            if held[at][0] == seq:
                return True
        if held and (len(held) >= max_held or self.held_bytes + held_size(payload) > max_held_bytes):
            return False
        if at == len(held):
            held.append((seq, payload, topic_model))
        else:
            held.insert(at, (seq, payload, topic_model))
        self.held_bytes += held_size(payload)
        return True

    def held_hole(self) -> int | None:
        """The first seq missing between what is applied and the held messages, or among them; None when
        applying them in order leaves no gap."""
        cur = self.seq.last
        for seq, _, _ in self.held:
            if cur is None:
                if seq != 0 and not self.from_empty:
                    return 0
            elif seq <= cur:
                continue
            elif seq != cur + 1:
                return cur + 1
            cur = seq
        return None
