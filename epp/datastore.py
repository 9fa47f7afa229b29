"""The EPP's view of its endpoints: membership, latest metrics, health and in-flight work.

Plain synchronous code with a single writer (the server's event loop, or the simulator).
Scheduling reads immutable `Endpoint` views, rebuilt only when a record changes.

In-flight work per endpoint, for the cost model: a routed request sits in the endpoint's
*prefill backlog* (its uncached prompt work) until its first token, then counts as
*decoding* until it is released (end, error, disconnect). A request whose first byte the EPP
never sees (a buffered response, a lost stream) leaves the backlog at its `first_token_by`
deadline, so the backlog cannot grow stale.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from epp.clock import Clock
from epp.types import NO_WORK, Endpoint, EndpointId, MetricsSnapshot, PrefillWork, endpoint_view


@dataclass(slots=True)
class EndpointRecord:
    id: EndpointId
    model: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    metrics: MetricsSnapshot | None = None
    healthy: bool = True
    scrape_failures: int = 0
    last_error: str | None = None
    in_flight_requests: int = 0
    in_flight_prompt_tokens: int = 0
    prefill_backlog: PrefillWork = NO_WORK
    decoding_requests: int = 0
    decoding_tokens: int = 0
    added_at: float = 0.0
    name: str | None = None  # the reference's endpoint name (`<pod>-rank-<i>`) when discovery knows the pod
    _view: Endpoint | None = None

    def view(self) -> Endpoint:
        if self._view is None:
            self._view = endpoint_view(
                self.id,
                self.metrics,
                self.healthy,
                self.in_flight_requests,
                self.in_flight_prompt_tokens,
                self.model,
                self.labels,
                self.prefill_backlog,
                self.decoding_requests,
                self.decoding_tokens,
            )
        return self._view

    def touch(self) -> None:
        self._view = None


@dataclass(slots=True)
class Ticket:
    """In-flight accounting for one routed request; release it exactly once (idempotent)."""

    endpoint: EndpointId
    prompt_tokens: int
    started_at: float
    work: PrefillWork = NO_WORK  # in the endpoint's prefill backlog until the first token
    first_token_by: float = float("inf")
    decoding: bool = False
    released: bool = False
    record: EndpointRecord | None = None  # the record it was counted on (a re-added endpoint starts afresh)


class Datastore:
    def __init__(self, clock: Clock, unhealthy_after_failures: int = 3) -> None:
        if unhealthy_after_failures < 1:
            raise ValueError("unhealthy_after_failures must be >= 1")
        self.clock = clock
        self.unhealthy_after_failures = unhealthy_after_failures
        self._records: dict[EndpointId, EndpointRecord] = {}
        self._healthy_views: list[Endpoint] | None = None
        self._served: frozenset[str] | None = None  # `served_models`, until the next change
        self._deadlines: list[tuple[float, int, Ticket]] = []
        self._seq = itertools.count()

    # -- membership -------------------------------------------------------------------
    def add_endpoint(
        self, endpoint_id: EndpointId, model: str | None = None, labels: Mapping[str, str] | None = None
    ) -> bool:
        """Returns False if it was already known (its model/labels are updated)."""
        rec = self._records.get(endpoint_id)
        if rec is not None:
            rec.model = model
            rec.labels = dict(labels or {})
            self._changed(rec)
            return False
        self._records[endpoint_id] = EndpointRecord(
            endpoint_id, model, dict(labels or {}), added_at=self.clock.now()
        )
        self._healthy_views = self._served = None
        return True

    def remove_endpoint(self, endpoint_id: EndpointId) -> bool:
        removed = self._records.pop(endpoint_id, None) is not None
        self._healthy_views = self._served = None
        return removed

    def set_endpoints(self, endpoints: Iterable[tuple[EndpointId, str | None]]) -> tuple[set[str], set[str]]:
        """Make the set exactly `endpoints`; returns (added, removed)."""
        wanted = dict(endpoints)
        removed = set(self._records) - set(wanted)
        for ep in removed:
            self.remove_endpoint(ep)
        added = {ep for ep, model in wanted.items() if self.add_endpoint(ep, model)}
        return added, removed

    def set_names(self, names: Mapping[EndpointId, str]) -> None:
        """Name the endpoints (what metrics call them where the reference names a pod); others get none."""
        for ep, rec in self._records.items():
            rec.name = names.get(ep)

    def served_models(self) -> frozenset[str]:
        """Every model name the endpoints serve: configured, named by their metrics, and the LoRA adapters
        their metrics list as running or waiting. Kept until the endpoints or their metrics change."""
        served = self._served
        if served is None:
            names: set[str] = set()
            for rec in self._records.values():
                if rec.model:
                    names.add(rec.model)
                m = rec.metrics
                if m is not None:
                    names.update(m.models, m.running_lora_adapters, m.waiting_lora_adapters)
            served = self._served = frozenset(names)
        return served

    def ids(self) -> list[EndpointId]:
        return list(self._records)

    def get(self, endpoint_id: EndpointId) -> EndpointRecord | None:
        return self._records.get(endpoint_id)

    def records(self) -> list[EndpointRecord]:
        return list(self._records.values())

    # -- metrics and health -------------------------------------------------------------
    def record_metrics(self, endpoint_id: EndpointId, snapshot: MetricsSnapshot) -> None:
        rec = self._records.get(endpoint_id)
        if rec is None:
            return
        rec.metrics = snapshot
        rec.scrape_failures = 0
        rec.last_error = None
        rec.healthy = True
        self._changed(rec)

    def record_scrape_failure(self, endpoint_id: EndpointId, error: str) -> bool:
        """Count a failed scrape; returns True when this failure made the endpoint unhealthy."""
        rec = self._records.get(endpoint_id)
        if rec is None:
            return False
        rec.scrape_failures += 1
        rec.last_error = error
        if rec.healthy and rec.scrape_failures >= self.unhealthy_after_failures:
            rec.healthy = False
            self._changed(rec)
            return True
        return False

    # -- candidates --------------------------------------------------------------------
    def candidates(self, subset: Collection[str] | None = None) -> list[Endpoint]:
        """Healthy endpoints (restricted to `subset` when given), as immutable views. A subset entry is an
        endpoint id (`ip:port`: that endpoint) or a bare host as ids write it (`10.0.0.1`, `[fd00::1]`:
        every endpoint on it). The reference matches every entry by IP alone, its port dropped
        (llm-d/llm-d-router pkg/epp/requestcontrol/candidates.go `Locate`); here a port is held to."""
        if self._deadlines and self._deadlines[0][0] <= self.clock.now():
            self.expire_backlog()
        if self._healthy_views is None:
            self._healthy_views = [r.view() for r in self._records.values() if r.healthy]
        if subset is None:
            return self._healthy_views
        return [e for e in self._healthy_views if e.id in subset or e.id.rpartition(":")[0] in subset]

    # -- in-flight accounting ------------------------------------------------------------
    def begin(
        self,
        endpoint_id: EndpointId,
        prompt_tokens: int = 0,
        work: PrefillWork = NO_WORK,
        first_token_by: float = float("inf"),
    ) -> Ticket:
        """Account a request routed to the endpoint; `work` joins its prefill backlog until
        `first_token` (or the `first_token_by` deadline, Clock seconds)."""
        rec = self._records.get(endpoint_id)
        ticket = Ticket(endpoint_id, prompt_tokens, self.clock.now(), work, first_token_by, record=rec)
        if rec is not None:
            rec.in_flight_requests += 1
            rec.in_flight_prompt_tokens += prompt_tokens
            if work.requests:
                rec.prefill_backlog = rec.prefill_backlog + work
                if first_token_by < float("inf"):  # (not NaN either: it would sit at the heap's root)
                    heapq.heappush(self._deadlines, (first_token_by, next(self._seq), ticket))
            self._changed(rec)
        return ticket

    def first_token(self, ticket: Ticket) -> bool:
        """The request's first token arrived: out of the prefill backlog, now decoding. Returns whether
        an endpoint's accounting changed (False if it already had, or the ticket was released, or its
        endpoint has gone)."""
        if ticket.released or ticket.decoding:
            return False
        ticket.decoding = True
        rec = self._live(ticket)
        if rec is None:
            return False
        if ticket.work.requests:
            rec.prefill_backlog = _floor(rec.prefill_backlog - ticket.work)
        rec.decoding_requests += 1
        rec.decoding_tokens += ticket.prompt_tokens
        self._changed(rec)
        return True

    def release(self, ticket: Ticket) -> bool:
        """Release a ticket; returns False if it was already released."""
        if ticket.released:
            return False
        rec = self._live(ticket)
        if rec is not None:
            if ticket.decoding:
                rec.decoding_requests -= 1
                rec.decoding_tokens -= ticket.prompt_tokens
            elif ticket.work.requests:
                rec.prefill_backlog = _floor(rec.prefill_backlog - ticket.work)
            rec.in_flight_requests -= 1
            rec.in_flight_prompt_tokens -= ticket.prompt_tokens
            self._changed(rec)
        ticket.released = True
        return True

    def expire_backlog(self) -> int:
        """Move requests past their first-token deadline from the backlog to decoding."""
        now = self.clock.now()
        moved = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            ticket = heapq.heappop(self._deadlines)[2]
            moved += self.first_token(ticket)
        return moved

    def total_in_flight(self) -> int:
        return sum(r.in_flight_requests for r in self._records.values())

    def _live(self, ticket: Ticket) -> EndpointRecord | None:
        rec = self._records.get(ticket.endpoint)
        return rec if rec is not None and rec is ticket.record else None

    def _changed(self, rec: EndpointRecord) -> None:
        rec.touch()
        self._healthy_views = self._served = None


def _floor(work: PrefillWork) -> PrefillWork:
    """Sums of floats drift; an empty backlog is exactly empty."""
    if work.requests <= 0:
        return NO_WORK
    return PrefillWork(work.requests, max(work.tokens, 0), max(work.pairs, 0.0))
