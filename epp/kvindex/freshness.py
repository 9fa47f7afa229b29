"""How far the index can be trusted for each pod: `fresh`, `degraded` or `stale`. Pure.

The subscriber reports what happens to each pod's event stream; `state(pod, now)` turns it
into a verdict with a reason. Stale pods get no cache credit from the prefix scorer;
degraded ones still do (the index under-reports at worst).

- stale: `publisher_unreachable` (per-pod socket disconnected, or heartbeats unanswered),
  `unrecovered_gap` (events lost and not replayed, so the index may hold blocks the engine has
  evicted; the pod's entries are cleared and it stays stale until `recovery` seconds of in-order
  events),
  `lost_events` (a message that did not decode: its events are lost; cleared and recovered as
  `unrecovered_gap`),
  `restart_without_replay` (the engine restarted and its first events were missed), `silent`
  (no events for `silence` seconds while the engine's prefix-cache misses keep rising).
- degraded: `replaying` (a gap is being replayed), `joined_late` (first seen mid-stream, or
  reachable again after a lost connection, without replay, or replayed from an engine buffer that
  no longer reaches back to the stream's start: the index under-reports until `recovery` has
  passed), `orphans`, `malformed`, `dropped` or `unknown_model` (within the last `hold` seconds),
  `lagging` (events older than `lag_degraded` seconds when received), `no_events` (connected,
  nothing received yet).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Freshness(enum.Enum):
    FRESH = "fresh"
    DEGRADED = "degraded"
    STALE = "stale"


@dataclass(frozen=True, slots=True)
class Verdict:
    state: Freshness
    reason: str


FRESH = Verdict(Freshness.FRESH, "ok")


@dataclass(slots=True)
class _Pod:
    connected: bool | None = None
    last_message_at: float | None = None
    stale_reason: str | None = None
    clean_since: float | None = None  # in-order messages since then (for recovery from stale)
    replaying: bool = False
    joined_late_at: float | None = None
    degraded_reason: str | None = None
    degraded_until: float = 0.0
    lag: float = 0.0
    misses: float | None = None  # engine prefix-cache misses (queries - hits), latest scrape
    misses_at_message: float | None = None
    first_seen: float = 0.0


class FreshnessTracker:
    def __init__(
        self,
        *,
        recovery: float = 30.0,
        hold: float = 10.0,
        silence: float = 10.0,
        lag_degraded: float = 1.0,
        silent_misses: float = 64.0,
    ) -> None:
        self.recovery = recovery
        self.hold = hold
        self.silence = silence
        self.lag_degraded = lag_degraded
        self.silent_misses = silent_misses
        self._pods: dict[str, _Pod] = {}

    def _pod(self, pod: str, now: float = 0.0) -> _Pod:
        p = self._pods.get(pod)
        if p is None:
            p = self._pods[pod] = _Pod(first_seen=now)
        return p

    def watch(self, pod: str, now: float) -> None:
        """Start tracking a pod (its verdict is `no_events` until something arrives)."""
        self._pod(pod, now)

    def forget(self, pod: str) -> None:
        self._pods.pop(pod, None)

    # -- what the subscriber reports -----------------------------------------------------
    def connected(self, pod: str, now: float) -> None:
        p = self._pod(pod, now)
        p.connected = True
        if p.stale_reason == "publisher_unreachable":
            # Whatever was published meanwhile is lost: treat like a gap the next message reveals.
            p.stale_reason = None
            p.clean_since = None

    def disconnected(self, pod: str, now: float) -> None:
        p = self._pod(pod, now)
        p.connected = False
        p.stale_reason = "publisher_unreachable"
        p.clean_since = None

    def message(self, pod: str, now: float, lag: float = 0.0) -> None:
        """An event batch was applied in order."""
        p = self._pod(pod, now)
        p.last_message_at = now
        p.lag = lag
        p.misses_at_message = p.misses
        if p.stale_reason is not None and p.clean_since is None:
            p.clean_since = now

    def lost_events(self, pod: str, now: float) -> None:
        """A message arrived in order but did not decode: the pod's entries were cleared."""
        p = self._pod(pod, now)
        p.degraded_reason = "malformed"
        p.degraded_until = now + self.hold
        self._stale(p, "lost_events")

    def gap(self, pod: str, now: float, replaying: bool) -> None:
        p = self._pod(pod, now)
        if replaying:
            p.replaying = True
        else:
            self._stale(p, "unrecovered_gap")

    def replay_done(self, pod: str, now: float, complete: bool) -> None:
        p = self._pod(pod, now)
        p.replaying = False
        if not complete:
            self._stale(p, "unrecovered_gap")

    def restart(self, pod: str, now: float, recovered: bool) -> None:
        """The engine restarted; `recovered`: no event of the new run was missed (seq 0 seen, or replayed)."""
        p = self._pod(pod, now)
        p.joined_late_at = None
        if recovered:
            if p.stale_reason in ("unrecovered_gap", "restart_without_replay"):
                p.stale_reason = None
        else:
            self._stale(p, "restart_without_replay")

    def joined_late(self, pod: str, now: float) -> None:
        self._pod(pod, now).joined_late_at = now

    def problem(self, pod: str, now: float, reason: str) -> None:
        """A transient problem: `orphans`, `malformed`, `dropped`."""
        p = self._pod(pod, now)
        p.degraded_reason = reason
        p.degraded_until = now + self.hold

    def engine_misses(self, pod: str, misses: float, now: float | None = None) -> None:
        """The engine's prefix-cache misses in tokens (queries - hits), from its metrics. `now` starts
        the pod's silence clock if this is the first that is heard of it (without, it started at 0)."""
        p = self._pod(pod, 0.0 if now is None else now)
        if p.misses is not None and misses < p.misses and p.misses_at_message is not None:
            # The counter went back: a new engine process, counting from 0 since it started. Misses
            # since the last message are then at most `misses`, so the baseline becomes 0.
            p.misses_at_message = 0.0
        p.misses = misses
        if p.misses_at_message is None:
            p.misses_at_message = misses  # baseline until the first event arrives

    def _stale(self, p: _Pod, reason: str) -> None:
        p.stale_reason = reason
        p.clean_since = None

    # -- the verdict -------------------------------------------------------------------
    def state(self, pod: str, now: float) -> Verdict:
        p = self._pods.get(pod)
        if p is None:
            return Verdict(Freshness.STALE, "no_events")
        if p.stale_reason is not None:
            if p.stale_reason == "publisher_unreachable" or p.clean_since is None:
                return Verdict(Freshness.STALE, p.stale_reason)
            if now - p.clean_since < self.recovery:
                return Verdict(Freshness.STALE, p.stale_reason)
            p.stale_reason = None
            p.clean_since = None
        quiet_since = p.last_message_at if p.last_message_at is not None else p.first_seen
        if (
            p.misses is not None
            and p.misses_at_message is not None
            and p.misses - p.misses_at_message >= self.silent_misses
            and now - quiet_since > self.silence
        ):
            return Verdict(Freshness.STALE, "silent")
        if p.replaying:
            return Verdict(Freshness.DEGRADED, "replaying")
        if p.degraded_reason is not None and now < p.degraded_until:
            return Verdict(Freshness.DEGRADED, p.degraded_reason)
        if p.joined_late_at is not None and now - p.joined_late_at < self.recovery:
            return Verdict(Freshness.DEGRADED, "joined_late")
        if p.lag > self.lag_degraded:
            return Verdict(Freshness.DEGRADED, "lagging")
        if p.last_message_at is None:
            return Verdict(Freshness.DEGRADED if p.connected else Freshness.STALE, "no_events")
        return FRESH

    def pods(self) -> list[str]:
        return list(self._pods)
