"""A simulated cluster: N engines behind the production router, on one event kernel. Pure.

The router side is the EPP's own code, built and fed the way the server does it:
`epp.config.build_scheduler` from the policy's config file (its KV index sized by the config's
`index` section, as `epp serve` sizes it), a `Datastore` of endpoints whose
metrics are "scraped" from the engines every `scrape_interval` seconds
(`Engine.metrics` = what the scraper reads from vLLM's `/metrics`), the `BlockIndex` fed by
`KvIngest.on_live` with each engine's KV-event batches (handed decoded: the runs the production decoder
gives for the payloads a real vLLM would send, `simulator/events.py`) after `event_delay` seconds (a
fraction `event_loss` of them dropped, as a lossy PUB/SUB would), and the request accounting of
`epp.accounting` (prefill backlog until the first token, calibration, release at the end).
The router never reads an engine's internals — except for the `oracle` policy, labelled as
such: it scrapes every engine at every arrival and sees events at once and without loss, to
show what staleness costs. A request the router finds no pod for (`SchedulingError`: a filter left
none) is rejected: recorded with status `rejected`, never served.

While the whole cluster is idle (no request on any engine, no KV-event message waiting) the scrapes
before the next arrival would read the same metrics, each overwriting the last but for its time stamp:
the cluster skips to the last of them before the arrival, at the exact time the chain of scrapes reaches
(`Kernel.repeat_before`), so a trace's long quiet gaps cost nothing and the records are the same byte
for byte (`tests/unit/test_sim_idle_scrapes.py` compares with every round run).
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import numpy.typing as npt

from epp import accounting
from epp.clock import Clock
from epp.config import EppConfig, build_scheduler
from epp.costmodel.service import SERVICE_KEY as COST_KEY
from epp.costmodel.service import CostModel
from epp.datastore import Datastore, Ticket
from epp.kvindex.event_scan import ScannedBatch
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.ingest import KvIngest
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.service import SERVICE_KEY as KV_KEY
from epp.kvindex.service import KvIndexService
from epp.scheduling.builtin import default_registry
from epp.scheduling.errors import SchedulingError
from epp.scheduling.scheduler import Scheduler
from epp.types import ApiKind, Decision, InferenceRequest
from simulator.engine import Engine, EngineConfig
from simulator.kernel import Kernel, repeat_before
from simulator.latency import DEFAULT_PROFILE, LatencyProfile
from simulator.records import RequestRecord as EngineRecord
from simulator.records import SimRequest, as_token_array, fed_tokens
from simulator.results import REJECTED, RequestRecord
from simulator.traces import TraceRequest

MIN_SCRAPE_INTERVAL = 0.001
"""Seconds. Shorter scrape intervals are refused: a round per engine every microsecond would take a busy
run forever, and one below a clock tick (the float64 time's resolution, ~15 ns at the 1e8 s a trace may
span, `trace_span.py`) would not move the clock at all. Real scrapers run every 10 ms or more."""


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    pods: int = 16
    engine: EngineConfig = field(default_factory=EngineConfig)
    latency: str | LatencyProfile = DEFAULT_PROFILE  # a name in `latency.PROFILES`, or a profile
    scrape_interval: float = 0.05  # seconds between metric scrapes of each engine (>= MIN_SCRAPE_INTERVAL)
    event_delay: float = 0.002  # seconds from an engine publishing KV events to the router applying them
    event_loss: float = 0.0  # fraction of KV-event messages lost
    seed: int = 0

    def check(self) -> None:
        if self.pods < 1:
            raise ValueError("pods must be >= 1")
        if not self.scrape_interval >= MIN_SCRAPE_INTERVAL:
            raise ValueError(
                f"scrape interval must be at least {MIN_SCRAPE_INTERVAL * 1000:g} ms, "
                f"got {self.scrape_interval:g} s"
            )
        if self.event_delay < 0:
            raise ValueError("event delay must be >= 0")
        if not 0.0 <= self.event_loss < 1.0:
            raise ValueError("event loss must be in [0, 1)")


@dataclass(slots=True)
class _InFlight:
    index: int
    arrival: float
    request: InferenceRequest
    decision: Decision
    ticket: Ticket
    routed_at: float


def _estimated(decision: Decision) -> float | None:
    """The router's TTFT estimate for the pod it picked (None when no plugin estimated one)."""
    estimate = decision.estimates.get(decision.primary) if decision.estimates else None
    return None if estimate is None else estimate.ttft_s


def pod_address(i: int) -> str:
    return f"10.{i // 62500}.{i // 250 % 250}.{i % 250}:8000"


def sim_request(r: TraceRequest, context: object = None) -> SimRequest:
    """What the engine serving trace request `r` is given."""
    return SimRequest(
        str(r.index), r.prompt, max(r.output_tokens, 1), output_token_ids=r.answer, context=context
    )


def computed_tokens(r: TraceRequest) -> npt.NDArray[np.int64]:
    """The tokens an engine computes KV for when it serves `r` (as `Engine.submit` takes them): the
    prompt, then the generated tokens it feeds back (all but the last)."""
    sim = sim_request(r)
    return fed_tokens(sim, as_token_array(sim.prompt_token_ids), sim.max_tokens - 1)


@dataclass(frozen=True, slots=True)
class Router:
    """The EPP's side of a cluster, built as `epp serve` builds it: the KV index (sized by the config's
    `index` section) with its freshness and lookup service, the cost model and the scheduler."""

    index: BlockIndex
    freshness: FreshnessTracker
    kv: KvIndexService
    cost: CostModel
    scheduler: Scheduler


def build_router(config: EppConfig, clock: Clock, seed: int) -> Router:
    """A policy's router; ConfigError (naming the config's source) when a plugin cannot be built."""
    index = BlockIndex(config.index.block_size, config.index.max_entries)
    freshness = FreshnessTracker()
    kv = KvIndexService(index, freshness, TokenizerRegistry({}), config.index.block_size)
    cost = CostModel(config.cost_model)
    services = {KV_KEY: kv, COST_KEY: cost}
    scheduler = build_scheduler(config, default_registry(), clock, random.Random(seed + 1), None, services)
    return Router(index, freshness, kv, cost, scheduler)


class Cluster:
    def __init__(
        self,
        config: EppConfig,
        cluster: ClusterConfig,
        oracle: bool = False,
        on_done: Callable[[RequestRecord], object] | None = None,
        skip_idle_scrapes: bool = True,
    ) -> None:
        """`skip_idle_scrapes=False` runs every scrape round of idle gaps too (the same results, slower;
        a check, see `_scrape`)."""
        cluster.check()
        self.cfg = cluster
        self.oracle = oracle
        self.on_done = on_done
        self.skip_idle_scrapes = skip_idle_scrapes
        self.scrape_rounds = 0  # scrape rounds performed (skipped ones not counted)
        self.kernel = k = Kernel()
        self.model = cluster.engine.model
        self._rng = random.Random(cluster.seed)  # event loss
        self.datastore = Datastore(k)
        router = build_router(config, k, cluster.seed)
        self.index, self.freshness, self.kv = router.index, router.freshness, router.kv
        self.cost, self.scheduler = router.cost, router.scheduler
        self.ingest = KvIngest(self.index, self.freshness, lambda pod: self.model)
        self.pods = [pod_address(i) for i in range(cluster.pods)]
        self._inbox: deque[tuple[tuple[float, int, int], str, int, ScannedBatch]] = deque()  # see _receive
        self.engines: dict[str, Engine] = {}
        for pod in self.pods:
            self.datastore.add_endpoint(pod, self.model)
            self.freshness.connected(pod, 0.0)
            self.engines[pod] = Engine(
                k,
                cluster.engine,
                cluster.latency,
                on_batches=self._publisher(pod),
                on_first_token=self._first_token,
                on_finish=self._finish,
            )
        self.records: list[RequestRecord] = []
        self.modes: Counter[str] = Counter()  # picks by mode (cache-aware, degraded, load-only)
        self._pending = -1  # requests of the trace not yet finished or rejected (-1: not started)
        self._arrivals_left = -1
        self._scrape()

    @property
    def rejected(self) -> int:
        """Requests of the run the router found no pod for (recorded with status `rejected`)."""
        return sum(1 for r in self.records if r.status == REJECTED)

    # -- the router's view -------------------------------------------------------------------------
    def _scrape(self) -> None:
        self.scrape_rounds += 1
        self._receive()
        if self._arrivals_left == 0 and self._pending > 0 and all(e.idle for e in self.engines.values()):
            raise RuntimeError(f"{self._pending} requests were routed but no engine is working on them")
        record, misses = self.datastore.record_metrics, self.freshness.engine_misses
        for pod, engine in self.engines.items():
            m = engine.metrics()
            record(pod, m)
            # as the server's subscriber does: misses rising without events make a pod stale
            misses(pod, (m.prefix_cache_queries or 0.0) - (m.prefix_cache_hits or 0.0))
        if self._done():
            return
        k, interval = self.kernel, self.cfg.scrape_interval
        if self.skip_idle_scrapes and self._arrivals_left > 0 and self._idle():  # (an arrival is scheduled)
            # Until the next event (an arrival) nothing changes but the scrapes' own time stamps, and each
            # scrape overwrites the last: only the last round before that event can be seen. Go straight
            # to it, at the very time the chain of rounds would reach (`repeat_before`); its seq number
            # still orders it after every event already scheduled, as the chain's round would be.
            at, rounds = repeat_before(k.now(), interval, k.peek())
            if rounds > 1:
                k.at(at, self._scrape)
                return
        k.schedule(interval, self._scrape)

    def _idle(self) -> bool:
        """Nothing can change what a scrape reads before the kernel's next event: no engine has a request
        or a step pending, and no KV-event message waits in the inbox (one would be applied at a scrape)."""
        if self._inbox:
            return False
        return all(e.idle and not e.waiting and not e.running for e in self.engines.values())

    def _publisher(self, pod: str) -> Callable[[int, ScannedBatch, float], None]:
        oracle, loss, delay = self.oracle, self.cfg.event_loss, self.cfg.event_delay
        key, inbox = self.kernel.key, self._inbox

        def publish(seq: int, payload: ScannedBatch, at: float) -> None:
            if not oracle:
                if loss and self._rng.random() < loss:
                    return
                if delay > 0:
                    inbox.append((key(delay), pod, seq, payload))
                    return
            self._deliver(pod, seq, payload, self.kernel.now())

        return publish

    def _receive(self) -> None:
        """Deliver the KV-event messages due before the event running now, in the kernel's order. The router
        reads what they change only when a request arrives and at scrapes, so they wait in `_inbox` (in
        due order: the delay is one constant) until then instead of taking a kernel event each."""
        inbox = self._inbox
        if inbox:
            current = self.kernel.current()
            on_live, model = self.ingest.on_live, self.model  # (`_deliver`, inlined)
            while inbox and inbox[0][0] < current:
                key, pod, seq, payload = inbox.popleft()
                now = key[0]
                on_live(pod, 0, seq, payload, now, model, now)

    def _deliver(self, pod: str, seq: int, payload: ScannedBatch, now: float) -> None:
        """As the server's subscriber does: received at `now`; the lag is measured against the batch's ts."""
        self.ingest.on_live(pod, 0, seq, payload, now, self.model, now)

    # -- requests ----------------------------------------------------------------------------------
    def run(self, trace: Sequence[TraceRequest]) -> list[RequestRecord]:
        self._pending = self._arrivals_left = len(trace)
        for r in trace:
            self.kernel.at(r.arrival, lambda r=r: self._arrive(r))  # type: ignore[misc]
        self.kernel.run()
        while self._inbox:  # published after the last arrival and scrape: applied, as they would arrive
            key, pod, seq, payload = self._inbox.popleft()
            self._deliver(pod, seq, payload, key[0])
        return self.records

    def _done(self) -> bool:
        return self._pending == 0

    def _arrive(self, r: TraceRequest) -> None:
        self._receive()
        self._arrivals_left -= 1
        now = self.kernel.now()
        if self.oracle:
            for pod, engine in self.engines.items():
                self.datastore.record_metrics(pod, engine.metrics(now))
        request = InferenceRequest(
            request_id=str(r.index),
            api_kind=ApiKind.COMPLETIONS,
            model=self.model,
            prompt=cast(Sequence[int], r.prompt),  # an int32 array: keyed as it is
            stream=True,
            max_tokens=r.output_tokens,
            prompt_tokens_estimate=len(r.prompt),
        )
        try:
            decision = self.scheduler.schedule(request, self.datastore.candidates()).decision
        except SchedulingError:
            self._pending -= 1
            rejected = RequestRecord.rejected(r.index, r.arrival, len(r.prompt), r.output_tokens)
            self.records.append(rejected)
            if self.on_done is not None:
                self.on_done(rejected)
            return
        if decision.mode:
            self.modes[decision.mode] += 1
        ticket = accounting.begin(self.datastore, request, decision, now, True, self.cost)
        flight = _InFlight(r.index, r.arrival, request, decision, ticket, now)
        self.engines[decision.primary].submit(sim_request(r, flight))

    def _first_token(self, rec: EngineRecord, now: float) -> None:
        f: _InFlight = rec.request.context
        accounting.first_token(
            self.datastore, self.cost, f.request, f.decision, f.ticket, now - f.routed_at, calibrate=True
        )

    def _finish(self, rec: EngineRecord, now: float) -> None:
        f: _InFlight = rec.request.context
        self.datastore.release(f.ticket)
        done = RequestRecord(
            index=f.index,
            arrival_s=f.arrival,
            pod=f.decision.primary,
            prompt_tokens=rec.prompt_tokens,
            cached_tokens=rec.cached_tokens,
            loaded_tokens=rec.cpu_loaded_tokens,
            output_tokens=rec.output_tokens,
            first_token_s=rec.first_token_s if rec.first_token_s is not None else now,
            finished_s=now,
            estimated_ttft_s=_estimated(f.decision),
        )
        self.records.append(done)
        self._pending -= 1
        if self.on_done is not None:
            self.on_done(done)
