"""Sequence tracking for one KV-event publisher (one engine process, one data-parallel rank). Pure.

Every live message carries a counter that starts at 0 per engine process and grows by one.
Given the next live seq, the tracker says whether it continues the stream, leaves a gap,
or went backwards (the engine restarted: on the live socket a seq never repeats otherwise).
Replayed messages are checked with `already_applied` instead, since a replay may overlap
what was applied.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

END_OF_REPLAY = 0xFFFFFFFFFFFFFFFF


class SeqKind(enum.Enum):
    FIRST = "first"  # the first message seen from this publisher
    NEXT = "next"  # exactly last + 1
    GAP = "gap"  # > last + 1: messages last+1 .. seq-1 were lost
    RESTART = "restart"  # <= last: the engine restarted with a new counter


@dataclass(frozen=True, slots=True)
class SeqVerdict:
    kind: SeqKind
    missing_from: int = 0  # for GAP: first missing seq
    missing_to: int = 0  # for GAP: last missing seq (inclusive)


_FIRST = SeqVerdict(SeqKind.FIRST)  # (verdicts without a range are shared: built once)
_NEXT = SeqVerdict(SeqKind.NEXT)
_RESTART = SeqVerdict(SeqKind.RESTART)


class SequenceTracker:
    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: int | None = None

    def classify(self, seq: int) -> SeqVerdict:
        last = self.last
        if last is None:
            return _FIRST
        if seq == last + 1:
            return _NEXT
        if seq > last + 1:
            return SeqVerdict(SeqKind.GAP, last + 1, seq - 1)
        return _RESTART

    def already_applied(self, seq: int) -> bool:
        return self.last is not None and seq <= self.last

    def advance(self, seq: int) -> None:
        """Record that `seq` was applied."""
        self.last = seq

    def reset(self) -> None:
        self.last = None
