"""The EPP's Prometheus metrics, on a registry the server owns (never the global one).

Names follow the reference EPP where the meaning matches (`inference_objective_*`,
`inference_pool_*`, `inference_extension_*`); ours are prefixed `epp_`.

Two kinds of collectors, because `/metrics` is rendered off the event loop (`EppMetrics.exposition`):
the prometheus_client metrics (counters, gauges, histograms: each guards its values with a lock, so any
thread may collect them), and the "live" collectors that compute families at scrape time from state the
event loop owns and mutates without locks (the datastore's records, the cost model's calibrators, the KV
index and its counters). The live ones are collected on the loop, into families that are then only
read; the thread renders those and collects the thread-safe ones itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import epp
from epp.clock import Clock
from epp.costmodel.service import CostModel
from epp.datastore import Datastore
from epp.server.tokenizing import PromptTokenizing

M = TypeVar("M", Counter, Gauge, Histogram)


class Children(Generic[M]):
    """`metric.labels(...)` looked up once per label set: the hot path then costs a dict get."""

    __slots__ = ("_cache", "metric")

    def __init__(self, metric: M) -> None:
        self.metric: M = metric
        self._cache: dict[tuple[str, ...], M] = {}

    def __call__(self, *labels: str) -> M:
        child = self._cache.get(labels)
        if child is None:
            child = self._cache[labels] = self.metric.labels(*labels)
        return child

    def forget(self, first: str) -> None:
        """Remove every series whose first label value is `first` (all were created through here)."""
        for labels in [k for k in self._cache if k[0] == first]:
            del self._cache[labels]
            self.metric.remove(*labels)


_LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)
_REQUEST_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# inference_objective_request_duration_seconds: the reference's buckets (pkg/epp/metrics/metrics.go), so
# queries and dashboards built for it read the same; long generations and queued batch jobs reach an hour.
_REQUEST_DURATION_BUCKETS = (
    *(0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 45),
    *(60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600),
)
_TOKEN_BUCKETS = (1, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
# The reference's buckets for the request and response sizes and the normalized time per output token
# (pkg/epp/metrics/metrics.go), so its dashboards read the same: requests 64 B to 1 GiB; responses 1 B to
# 64 KiB (its choice: longer answers land in +Inf); NTPOT 1 ms to 10 s per token.
_REQUEST_SIZE_BUCKETS = tuple(float(2**e) for e in range(6, 31))
_RESPONSE_SIZE_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536)
_NTPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class _PoolCollector(Collector):
    """Gauges computed from the datastore at scrape time (no per-request cost)."""

    def __init__(self, datastore: Datastore, clock: Clock, pool_name: str) -> None:
        self.datastore = datastore
        self.clock = clock
        self.pool_name = pool_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = self.clock.now()
        records = self.datastore.records()
        ready = [r for r in records if r.healthy]
        scraped = [r.metrics for r in ready if r.metrics is not None]
        kv = GaugeMetricFamily(
            "inference_pool_average_kv_cache_utilization", "Mean KV usage of ready endpoints", labels=["name"]
        )
        kv.add_metric([self.pool_name], sum(m.kv_usage for m in scraped) / len(scraped) if scraped else 0.0)
        queue = GaugeMetricFamily(
            "inference_pool_average_queue_size", "Mean waiting queue of ready endpoints", labels=["name"]
        )
        queue.add_metric([self.pool_name], sum(m.waiting for m in scraped) / len(scraped) if scraped else 0.0)
        per_pod = GaugeMetricFamily(
            "inference_pool_per_pod_queue_size",
            "Requests waiting in each ready endpoint's queue (its last scrape)",
            labels=["name", "model_server_pod"],
        )
        for r in ready:
            if r.metrics is not None:
                per_pod.add_metric([self.pool_name, r.name or r.id], r.metrics.waiting)
        pods = GaugeMetricFamily("inference_pool_ready_pods", "Ready endpoints in the pool", labels=["name"])
        pods.add_metric([self.pool_name], len(ready))
        in_flight = GaugeMetricFamily(
            "epp_endpoint_in_flight_requests",
            "Requests the EPP routed that have not finished",
            labels=["endpoint"],
        )
        in_tokens = GaugeMetricFamily(
            "epp_endpoint_in_flight_prompt_tokens", "Prompt tokens of in-flight requests", labels=["endpoint"]
        )
        healthy = GaugeMetricFamily(
            "epp_endpoint_healthy", "1 if the endpoint is a candidate", labels=["endpoint"]
        )
        age = GaugeMetricFamily(
            "epp_endpoint_metrics_age_seconds",
            "Seconds since the endpoint's metrics were last scraped (no sample before the first scrape)",
            labels=["endpoint"],
        )
        for r in records:
            in_flight.add_metric([r.id], r.in_flight_requests)
            in_tokens.add_metric([r.id], r.in_flight_prompt_tokens)
            healthy.add_metric([r.id], 1.0 if r.healthy else 0.0)
            if r.metrics is not None:  # never scraped: no sample (a -1 would read as fresh to max() or <)
                age.add_metric([r.id], now - r.metrics.observed_at)
        yield from (kv, queue, per_pod, pods, in_flight, in_tokens, healthy, age)


class _TokenizingCollector(Collector):
    """The worker thread that tokenizes long prompts (`tokenizing.py`), read at scrape time; zeros when
    the server tokenizes nothing ahead."""

    def __init__(self, tokenizing: PromptTokenizing | None) -> None:
        self.tokenizing = tokenizing

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        t = self.tokenizing
        done = CounterMetricFamily(
            "epp_prompts_tokenized_in_worker",
            "Prompts tokenized in the worker thread before scheduling (16 KiB or more, and any while it "
            "had work)",
        )
        done.add_metric([], t.offloaded if t is not None else 0)
        queued = GaugeMetricFamily(
            "epp_tokenizer_queued_chars",
            "Characters of prompts waiting for, or in, the tokenizing worker thread (past 2 MiB, requests "
            "are routed without cache credit)",
        )
        queued.add_metric([], t.queued_chars if t is not None else 0)
        yield done
        yield queued


class _CostModelCollector(Collector):
    """The cost model's calibration per model, read at scrape time."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        prefill = GaugeMetricFamily(
            "epp_cost_model_prefill_scale",
            "Fitted multiplier of the profile's prefill cost (1 = the profile as configured)",
            labels=["model_name"],
        )
        queue = GaugeMetricFamily(
            "epp_cost_model_queue_scale",
            "Fitted multiplier of the estimated queue wait (1 = as the profile predicts)",
            labels=["model_name"],
        )
        per_token = GaugeMetricFamily(
            "epp_cost_model_prefill_seconds_per_token",
            "Effective prefill seconds per uncached token after calibration",
            labels=["model_name"],
        )
        observed = CounterMetricFamily(
            "epp_cost_model_observations",
            "Observed times to first token: fitted in full (used), clipped as outliers, or ignored "
            "(disjoint kinds)",
            labels=["model_name", "kind"],
        )
        for model, c in self.cost.coefficients().items():
            prefill.add_metric([model], c["prefill_scale"])
            queue.add_metric([model], c["queue_scale"])
            per_token.add_metric([model], c["prefill_seconds_per_token"])
            # the calibrator's `observations` counts the clipped outliers too: `used` is the rest, so the
            # kinds sum to every observation
            observed.add_metric([model, "used"], c["observations"] - c["outliers"])
            observed.add_metric([model, "outlier"], c["outliers"])
            observed.add_metric([model, "ignored"], c["ignored"])
        yield from (prefill, queue, per_token, observed)


class Exposition(Collector):
    """What one `/metrics` answer renders: the thread-safe metrics, collected by whichever thread renders,
    and the live collectors' families, collected earlier on the event loop."""

    def __init__(self, threadsafe: CollectorRegistry, live: Sequence[Metric]) -> None:
        self.threadsafe = threadsafe
        self.live = live

    def collect(self) -> Iterator[Metric]:
        yield from self.threadsafe.collect()
        yield from self.live


class EppMetrics:
    """Every metric the server records. Labelled ones are `Children`: call with label values.

    `registry` holds everything (read it on the event loop: tests, `epp.docs_reference`); it holds
    `threadsafe`, where the prometheus_client metrics are, and the live collectors (`attach_live`)."""

    def __init__(self, registry: CollectorRegistry | None = None, commit: str = "unknown") -> None:
        """`commit`: the build's source commit for `inference_extension_info` (`EPP_BUILD_COMMIT`, which
        an image build sets: the Dockerfile's `--build-arg EPP_BUILD_COMMIT=...`)."""
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.threadsafe = r = CollectorRegistry(auto_describe=True)
        self._live: list[Collector] = []
        models = ["model_name", "target_model_name"]

        def counter(name: str, doc: str, labels: list[str]) -> Children[Counter]:
            return Children(Counter(name, doc, labels, registry=r))

        def histogram(
            name: str, doc: str, labels: list[str], buckets: tuple[float, ...]
        ) -> Children[Histogram]:
            return Children(Histogram(name, doc, labels, buckets=buckets, registry=r))

        info = Gauge(
            "inference_extension_info",
            "This build: its source commit and version",
            ["commit", "build_ref"],
            registry=r,
        )
        info.labels(commit or "unknown", epp.__version__).set(1)
        self.requests = counter("inference_objective_request_total", "Requests received", models)
        self.request_errors = counter(
            "inference_objective_request_error_total",
            "Requests that ended in an error: ModelServerError (the model server's), or the EPP's code",
            [*models, "error_code"],
        )
        self.request_duration = histogram(
            "inference_objective_request_duration_seconds",
            "From the request's headers to the end of the response",
            models,
            _REQUEST_DURATION_BUCKETS,
        )
        self.request_sizes = histogram(
            "inference_objective_request_sizes", "Request body bytes", models, _REQUEST_SIZE_BUCKETS
        )
        self.response_sizes = histogram(
            "inference_objective_response_sizes",
            "Response body bytes (when Envoy sends the response body)",
            models,
            _RESPONSE_SIZE_BUCKETS,
        )
        self.ntpot = histogram(
            "inference_objective_normalized_time_per_output_token_seconds",
            "Request duration over its output tokens (from usage)",
            models,
            _NTPOT_BUCKETS,
        )
        self.input_tokens = histogram(
            "inference_objective_input_tokens", "Prompt tokens (from usage)", models, _TOKEN_BUCKETS
        )
        self.output_tokens = histogram(
            "inference_objective_output_tokens", "Completion tokens (from usage)", models, _TOKEN_BUCKETS
        )
        self.running = Children(
            Gauge("inference_objective_running_requests", "Requests in flight", ["model_name"], registry=r)
        )
        self.model_rewrites = counter(
            "inference_extension_model_rewrite_decisions_total",
            "Requests whose model an InferenceModelRewrite rule rewrote",
            ["model_rewrite_name", "model_name", "target_model"],
        )
        self.scheduler_duration = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "Time spent in one scheduling cycle",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.plugin_duration = histogram(
            "inference_extension_plugin_duration_seconds",
            "Time spent in one plugin call",
            ["extension_point", "plugin_type", "plugin_name"],
            _LATENCY_BUCKETS,
        )
        self.picks = counter(
            "epp_picks_total",
            "Primary picks per endpoint, profile and reason",
            ["endpoint", "profile", "reason"],
        )
        self.pick_modes = counter(
            "epp_pick_mode_total",
            "Picks by how far the cache index was trusted: cache-aware (every candidate fresh), "
            "degraded (stale candidates got no cache credit), load-only (no cache credit at all)",
            ["mode"],
        )
        self.rejections = counter(
            "epp_rejections_total",
            "Requests answered by the EPP itself, by status and code",
            ["status", "code"],
        )
        self.ttfb = histogram(
            "epp_time_to_first_byte_seconds",
            "From routing to the first response body byte, per endpoint",
            ["endpoint"],
            _REQUEST_BUCKETS,
        )
        self.usage_tokens = counter(
            "epp_usage_tokens_total",
            "Tokens reported in responses' usage, per endpoint and kind (prompt, cached, completion)",
            ["endpoint", "kind"],
        )
        self.usage_invalid = counter(
            "epp_usage_invalid_total",
            "Completed responses whose usage had a count out of range (ignored), per endpoint",
            ["endpoint"],
        )
        self.accounting_errors = Counter(
            "epp_response_accounting_errors_total",
            "Internal errors in response-side bookkeeping (the response was passed on regardless)",
            registry=r,
        )
        self.backend_errors = counter(
            "epp_backend_errors_total",
            "Responses with a non-2xx status, per endpoint and status",
            ["endpoint", "status"],
        )
        self.stream_errors = counter(
            "epp_stream_errors_total",
            "Responses whose 2xx stream carried an error event, per endpoint and the code the event gave",
            ["endpoint", "error_code"],
        )
        self.released = counter(
            "epp_requests_released_total",
            "In-flight releases by cause (complete, error, disconnect, unobserved)",
            ["cause"],
        )
        self.scrapes = counter(
            "epp_metrics_scrapes_total", "Metric scrapes by endpoint and outcome", ["endpoint", "outcome"]
        )
        self.scrape_errors = counter(
            "epp_metrics_scrape_errors_total",
            "Failed metric scrapes by endpoint and kind",
            ["endpoint", "kind"],
        )

        # Kubernetes discovery (epp/discovery/watcher.py); nothing is recorded without it.
        self.discovery_lists = counter(
            "epp_discovery_lists_total",
            "Lists of the InferencePool, its pods (or those --endpoint-selector selects), model rewrites",
            ["resource"],
        )
        self.discovery_events = counter(
            "epp_discovery_watch_events_total",
            "Watch events received, by resource and type",
            ["resource", "type"],
        )
        self.discovery_errors = counter(
            "epp_discovery_errors_total", "Discovery errors by resource and kind", ["resource", "kind"]
        )
        self.discovery_endpoints = Gauge(
            "epp_discovery_endpoints",
            "Endpoints the candidate pods give (of the InferencePool, or selected by --endpoint-selector)",
            registry=r,
        )
        self.discovery_synced = Gauge(
            "epp_discovery_synced",
            "1 once the InferencePool (if any) and its pods have been listed",
            registry=r,
        )
        self.registry.register(self.threadsafe)
        # labelled by endpoint first: removed when the endpoint leaves the pool (`forget_endpoint`)
        self._per_endpoint: tuple[Children[Counter] | Children[Histogram], ...] = (
            self.picks,
            self.ttfb,
            self.usage_tokens,
            self.usage_invalid,
            self.backend_errors,
            self.stream_errors,
            self.scrapes,
            self.scrape_errors,
        )

    def attach_live(self, collector: Collector) -> None:
        """A collector that reads state the event loop owns at scrape time: collected on the loop only."""
        self.registry.register(collector)
        self._live.append(collector)

    def attach_pool(self, datastore: Datastore, clock: Clock, pool_name: str) -> None:
        self.attach_live(_PoolCollector(datastore, clock, pool_name))

    def attach_cost_model(self, cost: CostModel) -> None:
        self.attach_live(_CostModelCollector(cost))

    def attach_tokenizing(self, tokenizing: PromptTokenizing | None) -> None:
        self.attach_live(_TokenizingCollector(tokenizing))

    def exposition(self) -> Exposition:
        """Call on the event loop: the live collectors are collected now (their families are plain data
        from then on); render the result in any thread (`generate_latest`)."""
        return Exposition(self.threadsafe, [fam for c in self._live for fam in c.collect()])

    def forget_endpoint(self, endpoint_id: str) -> None:
        """The endpoint left the pool: its series go, so a pool whose pods come and go (every rollout
        gives new IPs) does not keep every endpoint it ever had; one that comes back starts from zero."""
        for children in self._per_endpoint:
            children.forget(endpoint_id)

    # ScrapeObserver
    def on_scrape(self, endpoint_id: str, ok: bool, error_kind: str | None, seconds: float) -> None:
        self.scrapes(endpoint_id, "ok" if ok else "error").inc()
        if not ok:
            self.scrape_errors(endpoint_id, error_kind or "unknown").inc()

    # DiscoveryObserver
    def on_discovery_list(self, resource: str) -> None:
        self.discovery_lists(resource).inc()

    def on_discovery_event(self, resource: str, kind: str) -> None:
        self.discovery_events(resource, kind).inc()

    def on_discovery_error(self, resource: str, kind: str) -> None:
        self.discovery_errors(resource, kind).inc()

    def on_discovery_endpoints(self, count: int, synced: bool) -> None:
        self.discovery_endpoints.set(count)
        self.discovery_synced.set(1.0 if synced else 0.0)
