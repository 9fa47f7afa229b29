"""Apply engine KV-event messages to the index, in order, per publisher. Pure.

A publisher is one engine process and data-parallel rank (`(pod, rank)`). The edge hands
every live message to `on_live` (its payload's bytes; the simulator hands its engines' batches already
decoded, `batch_reader.BatchBuilder`), which decodes it, checks its sequence number and applies
it, or asks the edge to replay first (`NeedReplay`) and holds the live message until
`replay_finished`. Replayed messages go through `on_replayed`. The edge also reports a
publisher's connection dropping (`on_disconnected`) and coming back (`on_connected`): whoever
answers again may be a new engine process, so the pod's blocks are forgotten then and the stream
is taken up as a new one. Nothing here blocks or performs I/O, so the simulator drives the same
code with modelled delays.

Replays: a replay from 0 of a publisher with nothing applied (new, or its blocks forgotten at a
reconnect or restart) may find the engine's buffer starting past 0 (a long-running engine): that
suffix is applied, which can only under-report, and the pod is `joined_late`. A seq skipped anywhere
else is a hole: the replay is incomplete and the pod cleared. Live messages lost while a replay runs
(after the engine answered) leave a hole among the held ones: `replay_ended` asks for another replay
from it (`MAX_CHAINED_REPLAYS`), and the outcome is counted once that is settled.

A message is read into runs of consecutive events (`batch_reader.py`), applied in order: each run of
BlockStored of one tier and model in one `BlockIndex.store_run` call, each run of BlockRemoved of one
tier in one `BlockIndex.discard` (its lookups batched with the index's next flush), with the same
effects as applying every event on its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from epp.kvindex.batch_reader import Message, decode
from epp.kvindex.event_scan import REMOVED, STORED, ScannedBatch
from epp.kvindex.events import KNOWN_TIERS, DecodeError
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import root_key
from epp.kvindex.publisher_state import PublisherState
from epp.kvindex.sequence import SeqKind

ModelOf = Callable[[str], str | None]
"""pod -> the model it serves (configured, or from its metrics), when known."""

MAX_DP_RANKS = 1024
"""Data-parallel ranks per pod: a batch claiming another rank is dropped (`field_type`), so a
publisher cannot make the per-publisher state grow without bound."""
MAX_CHAINED_REPLAYS = 3
"""Replays started one after another when live messages were lost while a replay ran (a hole among the
held messages that the engine may still buffer), before the replay is given up as incomplete."""
MAX_UNKNOWN_TIERS = 16
"""Distinct unknown tier names counted per pod; further ones are counted under `OTHER_TIER`."""
OTHER_TIER = "other"


@dataclass(frozen=True, slots=True)
class Applied:
    events: int


@dataclass(frozen=True, slots=True)
class Dropped:
    reason: str
    detail: str = field(default="", compare=False)  # what was wrong, for the edge's (rate-limited) log


@dataclass(frozen=True, slots=True)
class NeedReplay:
    """The edge should replay from `from_seq` for this publisher, then call `replay_finished`."""

    pod: str
    rank: int
    from_seq: int


Outcome = Applied | Dropped | NeedReplay
_APPLIED = [Applied(k) for k in range(257)]  # (immutable: shared, not built per message)


def applied(events: int) -> Applied:
    return _APPLIED[events] if events < len(_APPLIED) else Applied(events)


@dataclass(slots=True)
class PodCounters:
    messages: int = 0
    events: int = 0
    drops: Counter[str] = field(default_factory=Counter)
    orphans: int = 0
    gaps: int = 0
    restarts: int = 0
    replays: Counter[str] = field(default_factory=Counter)
    unknown_tiers: Counter[str] = field(default_factory=Counter)
    skipped_groups: int = 0


MAX_PARTIAL_GROUPS = 256
"""KV groups that are not full attention remembered per pod (a hybrid model has a handful; past this,
an engine sending thousands of group ids is not followed further)."""


class KvIngest:
    def __init__(
        self,
        index: BlockIndex,
        freshness: FreshnessTracker,
        model_of: ModelOf,
        *,
        replay_available: bool = False,
        max_held: int = 10_000,
        max_held_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.index = index
        self.freshness = freshness
        self.model_of = model_of
        self.replay_available = replay_available
        self.max_held = max_held
        self.max_held_bytes = max_held_bytes  # per publisher; past it (or `max_held`), an overflow
        self._publishers: dict[tuple[str, int], PublisherState] = {}
        self.counters: dict[str, PodCounters] = {}
        self.last_seq: dict[str, int] = {}
        self._roots: dict[tuple[str, str | None], int] = {}
        self._partial_groups: dict[str, set[int]] = {}  # per pod: KV groups that are not full attention

    def _counters(self, pod: str) -> PodCounters:
        c = self.counters.get(pod)
        if c is None:
            c = self.counters[pod] = PodCounters()
        return c

    def drop(self, pod: str, reason: str, now: float, detail: str = "") -> Dropped:
        """Count a message the edge could not even hand over (bad frames, short seq, unknown topic), or
        one that did not decode."""
        self._counters(pod).drops[reason] += 1
        self.freshness.problem(pod, now, "malformed" if reason != "overflow" else "dropped")
        return Dropped(reason, detail)

    # -- live messages -------------------------------------------------------------------
    def on_live(
        self,
        pod: str,
        rank: int,
        seq: int,
        payload: Message,
        now: float,
        topic_model: str | None = None,
        wall_now: float | None = None,
    ) -> Outcome:
        """`wall_now` (seconds since the epoch) measures how late the batch arrived against its `ts`."""
        try:
            batch = decode(payload)
        except DecodeError as err:
            # Its events are lost, and they may have removed blocks: the pod's entries go and it is stale
            # until `recovery` seconds of in-order events (`lost_events`), as after a gap that cannot be
            # replayed (a replay would send the same bytes). The seq counts as received, so the next
            # message is not a gap too. Not while replaying (the seq is the replay's progress; the
            # replayed copy counts) or out of contact. Central mode (rank < 0) learns the rank from
            # the payload: the seq counts for the pod's publisher that expected it next, if any.
            pubs = [p for p in self._receivers(pod, rank, seq) if not (p.replaying or p.lost_contact)]
            for pub in pubs:
                pub.seq.advance(seq)
            if pubs or rank < 0:
                self._lost(pod, now)
            return self.drop(pod, err.reason, now, str(err))
        if rank < 0:
            rank = batch.data_parallel_rank or 0
            if not 0 <= rank < MAX_DP_RANKS:
                return self.drop(pod, "field_type", now)
        lag = max(0.0, wall_now - batch.ts) if wall_now is not None and batch.ts > 0 else 0.0
        pub = self._publisher(pod, rank)
        if pub.lost_contact:
            # Queued before the connection dropped (its engine may be gone), or sent on the new connection
            # before its handshake was reported: the stream is taken up again at `on_connected`.
            self._counters(pod).drops["disconnected"] += 1
            return Dropped("disconnected")
        if pub.replaying:
            if not pub.hold(seq, payload, topic_model, self.max_held, self.max_held_bytes):
                pub.replay_hole = True  # lost: its replayed copy would not fit either
                return self.drop(pod, "overflow", now, "too many live messages held while a replay runs")
            return _APPLIED[0]
        verdict = pub.seq.classify(seq)
        c = self._counters(pod)
        if verdict.kind is SeqKind.GAP:
            c.gaps += 1
            if self.replay_available:
                missing = verdict.missing_from
                return self._start_replay(pod, rank, pub, missing, seq, payload, topic_model, now)
            # Lost events may have removed blocks: forget the pod rather than keep phantoms.
            self.index.clear_pod(pod)
            self.freshness.gap(pod, now, replaying=False)
        elif verdict.kind is SeqKind.RESTART:
            c.restarts += 1
            self.index.clear_pod(pod)
            pub.seq.reset()
            if seq != 0 and self.replay_available:
                pub.restart_pending = True
                return self._start_replay(pod, rank, pub, 0, seq, payload, topic_model, now)
            self.freshness.restart(pod, now, recovered=seq == 0)
        elif verdict.kind is SeqKind.FIRST:
            prev, pub.prev_last = pub.prev_last, None
            if prev is not None:  # the first message since the publisher reconnected (the pod was cleared)
                if seq <= prev:
                    c.restarts += 1  # the counter went back: a new engine process
                elif seq > prev + 1:
                    c.gaps += 1
            if seq == 0:
                if prev is not None:
                    self.freshness.restart(pod, now, recovered=True)
            elif self.replay_available:
                return self._start_replay(pod, rank, pub, 0, seq, payload, topic_model, now)
            elif prev is not None and seq <= prev:
                self.freshness.restart(pod, now, recovered=False)
            elif prev is not None and seq > prev + 1:
                self.freshness.gap(pod, now, replaying=False)
            else:
                self.freshness.joined_late(pod, now)
        return self._apply(pod, pub, seq, batch, topic_model, now, lag)

    def _start_replay(
        self,
        pod: str,
        rank: int,
        pub: PublisherState,
        from_seq: int,
        seq: int,
        payload: Message,
        topic_model: str | None,
        now: float,
    ) -> NeedReplay:
        pub.begin_replay(from_seq)
        pub.hold(seq, payload, topic_model, self.max_held, self.max_held_bytes)
        self.freshness.gap(pod, now, replaying=True)
        return NeedReplay(pod, rank, from_seq)

    def on_connected(self, pod: str, rank: int, now: float) -> NeedReplay | None:
        """A publisher became reachable. With replay, a publisher never heard from is replayed from 0 at
        once, so an idle engine's existing blocks are known without waiting for its next event. A
        publisher reachable again after `on_disconnected` is taken up as a new stream (`_reconnected`):
        with replay, replayed from 0; without, the pod is `joined_late` until its next message tells more."""
        pub = self._publisher(pod, rank)
        if pub.lost_contact:
            self._reconnected(pod, pub)
            if not self.replay_available:
                self.freshness.joined_late(pod, now)
        if not self.replay_available:
            return None
        if pub.seq.last is not None or pub.replaying:
            return None
        pub.prev_last = None  # replayed from its start: nothing to compare the next message with
        pub.begin_replay(0)
        self.freshness.gap(pod, now, replaying=True)
        return NeedReplay(pod, rank, 0)

    def on_disconnected(self, pod: str, rank: int) -> None:
        """The connection to a publisher dropped (engine killed or restarting, network cut). Whoever
        answers on that endpoint next may be a new engine process, whose counter may even continue
        where the old one's stopped, so the sequence alone cannot tell; see `_reconnected`. Live
        messages until then are dropped (`disconnected`)."""
        self._publisher(pod, rank).lost_contact = True

    def _reconnected(self, pod: str, pub: PublisherState) -> None:
        """Contact is back after `on_disconnected`: what was sent meanwhile is lost and the engine may
        have restarted (an engine that restarted and stayed idle sends nothing that would tell), so the
        pod's blocks are forgotten and the stream is taken up like a new one. A replay in progress is
        abandoned (the edge has cancelled it)."""
        pub.lost_contact = False
        pub.prev_last = pub.seq.last if pub.seq.last is not None else pub.prev_last
        self.index.clear_pod(pod)
        pub.seq.reset()
        pub.end_replay()
        pub.restart_pending = False

    # -- replay ----------------------------------------------------------------------------
    def on_replayed(
        self, pod: str, rank: int, seq: int, payload: Message, now: float, topic_model: str | None = None
    ) -> Outcome:
        pub = self._publisher(pod, rank)
        if pub.seq.already_applied(seq):
            return _APPLIED[0]
        if pub.held and seq >= pub.held[0][0]:
            # Past the first held live message: the live copy is applied from `held` when the replay
            # ends; what the live stream lost in between is merged into `held`, in seq order.
            if not pub.hold(seq, payload, topic_model, self.max_held, self.max_held_bytes):
                pub.replay_hole = True
                return self.drop(pod, "overflow", now, "too many messages held while a replay runs")
            return _APPLIED[0]
        expected = 0 if pub.seq.last is None else pub.seq.last + 1
        if seq != expected:
            if pub.seq.last is None and pub.from_empty:
                # The engine's buffer no longer holds the stream's start: what it holds is applied to
                # an empty state (blocks stored before are missing, none is left behind).
                pub.late = True
            else:
                pub.replay_hole = True
        try:
            batch = decode(payload)
        except DecodeError as err:
            pub.seq.advance(seq)
            pub.replay_hole = True  # its events are lost: the replay is incomplete (the pod is cleared)
            return self.drop(pod, err.reason, now, str(err))
        return self._apply(pod, pub, seq, batch, topic_model, now, 0.0)

    def replay_ended(self, pod: str, rank: int, now: float) -> NeedReplay | None:
        """The replay's end marker arrived. If live messages were lost while it ran (a hole among the
        messages held, after what the engine had sent), the engine may still buffer them: returns the
        replay to run next, from the hole (at most `MAX_CHAINED_REPLAYS` in a row, and not again from
        where the last one started, which did not have it). None: call `replay_finished`."""
        pub = self._publishers.get((pod, rank))
        if pub is None or not pub.replaying or pub.replay_hole:
            return None
        hole = pub.held_hole()
        if hole is None:
            return None
        self._count_hole(pod, pub, hole)
        if pub.chained >= MAX_CHAINED_REPLAYS or hole == pub.replay_from:
            return None
        pub.chained += 1
        pub.replay_from = hole
        return NeedReplay(pod, rank, hole)

    def _count_hole(self, pod: str, pub: PublisherState, hole: int) -> None:
        if pub.counted_hole != hole:
            pub.counted_hole = hole
            self._counters(pod).gaps += 1

    def replay_finished(self, pod: str, rank: int, now: float, complete: bool) -> int:
        """End a replay (`complete`: the end marker arrived) and apply the held live messages in order.
        The replay counts as complete when nothing is missing: no seq skipped in what was replayed, and
        none between that and the held messages, nor among them. Returns how many held messages were
        applied."""
        pub = self._publisher(pod, rank)
        hole = pub.held_hole()
        if hole is not None and complete and not pub.replay_hole:
            self._count_hole(pod, pub, hole)  # live messages were lost while replaying
        ok = complete and hole is None and not pub.replay_hole
        late = ok and (pub.late or (pub.seq.last is None and bool(pub.held) and pub.held[0][0] != 0))
        held = pub.end_replay()
        self._counters(pod).replays["complete" if ok else "incomplete"] += 1
        if pub.restart_pending:
            pub.restart_pending = False
            self.freshness.restart(pod, now, recovered=ok)
        self.freshness.replay_done(pod, now, complete=ok)
        if late:
            # Only a suffix of the stream was there to replay: the index under-reports, as for a
            # publisher first heard from mid-stream without replay.
            self.freshness.joined_late(pod, now)
        if not ok:
            self.index.clear_pod(pod)  # events are missing: keep no blocks that may have been evicted
        applied = 0
        for seq, payload, topic_model in held:
            if pub.seq.already_applied(seq):
                continue
            try:
                batch = decode(payload)
            except DecodeError as err:  # a message held undecoded: its events are lost
                pub.seq.advance(seq)
                self.drop(pod, err.reason, now, str(err))
                self._lost(pod, now)
                continue
            self._apply(pod, pub, seq, batch, topic_model, now, 0.0)
            applied += 1
        return applied

    # -- application -------------------------------------------------------------------
    def _apply(
        self,
        pod: str,
        pub: PublisherState,
        seq: int,
        batch: ScannedBatch,
        topic_model: str | None,
        now: float,
        lag: float,
    ) -> Applied:
        c = self._counters(pod)
        c.messages += 1
        c.skipped_groups += batch.skipped
        partial = self._partial_groups.get(pod)
        if batch.partial_groups:
            if partial is None:
                partial = self._partial_groups[pod] = set()
            if len(partial) < MAX_PARTIAL_GROUPS:  # a model has a few KV groups: the set stays bounded
                partial.update(batch.partial_groups[: MAX_PARTIAL_GROUPS - len(partial)])
        index = self.index
        roots = self._roots
        pod_model: str | None = None  # model_of(pod), asked at most once per message
        asked = False
        orphans = 0
        skipped = 0  # BlockRemoved events in skipped KV groups: not applied
        arrays = batch.arrays
        for i, run in enumerate(batch.runs):
            if run[0] == STORED:
                _, tier, lora_name, salt, hashes, parents, per_event, tokens, per_tokens, sizes, array = run  # type: ignore[misc]
                model = lora_name or topic_model
                if model is None:
                    if not asked:
                        pod_model, asked = self.model_of(pod), True
                    model = pod_model
                    if model is None:
                        c.drops["unknown_model"] += len(parents)
                        self.freshness.problem(pod, now, "unknown_model")  # the index under-reports
                        continue
                if tier not in KNOWN_TIERS:
                    unknown = c.unknown_tiers
                    unknown[tier if tier in unknown or len(unknown) < MAX_UNKNOWN_TIERS else OTHER_TIER] += (
                        len(parents)
                    )
                root = roots.get((model, salt))
                if root is None:
                    if len(roots) > 4096:  # tenants come and go: keep the cache bounded
                        roots.clear()
                    root = roots[(model, salt)] = root_key(model, salt)
                cols = arrays[i] if arrays else None
                events, parent_array = cols if isinstance(cols, tuple) else (None, None)
                orphans += index.store_run(
                    pod, tier, root, hashes, parents, per_event, tokens, per_tokens, sizes, array, events,
                    parent_array,
                )  # fmt: skip
            elif run[0] == REMOVED:
                if partial and run[3] in partial:  # type: ignore[misc,operator]
                    skipped += run[4]  # type: ignore[misc,operator]
                    continue  # a sliding-window (...) group's copy: the full-attention block stays
                removed = arrays[i] if arrays else None  # (a RemovedRun's: its hashes' array)
                index.discard(pod, run[2], run[1], None if isinstance(removed, tuple) else removed)  # type: ignore[arg-type,misc]
            else:
                index.clear_pod(pod)
        if orphans:
            c.orphans += orphans
            self.freshness.problem(pod, now, "orphans")
        c.skipped_groups += skipped
        c.events += batch.events - skipped
        pub.seq.advance(seq)
        self.last_seq[pod] = seq
        self.freshness.message(pod, now, lag)
        return applied(batch.events)

    def _lost(self, pod: str, now: float) -> None:
        """A message of the pod did not decode: its events, which may have removed blocks, are lost."""
        self.index.clear_pod(pod)
        self.freshness.lost_events(pod, now)

    def _receivers(self, pod: str, rank: int, seq: int) -> list[PublisherState]:
        """The publisher a message of `pod` with `seq` came from: `rank`'s, or with the rank unknown (-1),
        the pod's publishers whose stream `seq` continues."""
        if rank >= 0:
            return [self._publisher(pod, rank)]
        return [
            pub
            for (p, _), pub in self._publishers.items()
            if p == pod and pub.seq.last is not None and pub.seq.last + 1 == seq
        ]

    def _publisher(self, pod: str, rank: int) -> PublisherState:
        key = (pod, rank)
        pub = self._publishers.get(key)
        if pub is None:
            pub = self._publishers[key] = PublisherState()
        return pub

    def remove_pod(self, pod: str) -> None:
        """The pod left the pool: drop its blocks, publishers and state."""
        self.index.clear_pod(pod)
        for key in [k for k in self._publishers if k[0] == pod]:
            del self._publishers[key]
        self.counters.pop(pod, None)
        self.last_seq.pop(pod, None)
        self._partial_groups.pop(pod, None)
        self.freshness.forget(pod)
