"""The engine's `/metrics` page with vLLM's names, on a `CollectorRegistry` of its own.

Series (labels `model_name` and `engine="0"`, as vLLM's V1 engine, except `vllm:cache_config_info`):

- gauges as of the end of the engine's last step, as vLLM makes them once per step
  (`simulator/step_stats.py`, `Engine.metrics`): `vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (0..1); and `vllm:cache_config_info` (value
  1; `block_size`, `num_gpu_blocks`, `num_cpu_blocks`, `enable_prefix_caching` labels);
- counters: `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (tokens, as of the end
  of the last step too), `vllm:num_preemptions_total`, `vllm:prompt_tokens_total`,
  `vllm:generation_tokens_total`, `vllm:request_success_total{finished_reason="length"}`;
- histograms with vLLM's buckets, in engine seconds: `vllm:time_to_first_token_seconds`,
  `vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`.

Counts are plain ints updated from the engine's callbacks and turned into metric families only when
scraped (no `_created` series, no locks).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from simulator.engine import Engine
from simulator.records import RequestRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip


class _Histogram:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self, name: str, doc: str, labels: list[str], values: list[str]) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=labels)
        cumulative: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            cumulative.append((bound, float(running)))
        fam.add_metric(values, cumulative, self.total)
        return fam


class EngineMetrics(Collector):
    """Feed it the engine's callbacks (`on_first_token`, `on_finish`); `render()` is the page."""

    def __init__(self, engine: Engine, model: str, engine_index: str = "0") -> None:
        self.engine = engine
        self.model = model
        self._labels = ["model_name", "engine"]
        self._values = [model, engine_index]
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.e2e = _Histogram(REQUEST_BUCKETS)
        self.queue = _Histogram(REQUEST_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def on_first_token(self, rec: RequestRecord, t: float) -> None:
        self.ttft.observe(t - rec.arrival_s)
        if rec.queue_s is not None:
            self.queue.observe(rec.queue_s)

    def on_finish(self, rec: RequestRecord, t: float) -> None:
        self.e2e.observe(t - rec.arrival_s)
        self.prompt_tokens += rec.prompt_tokens
        self.generation_tokens += rec.output_tokens
        self.finished += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=self._labels)
        g.add_metric(self._values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=self._labels)
        c.add_metric(self._values, value)
        return c

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        cfg = e.config
        stats = e.metrics()  # the end of the last step, not the scheduler mid-step
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", stats.running
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "engine", "num_cpu_blocks", "num_gpu_blocks"],
        )
        cpu = str(cfg.cpu_blocks) if cfg.cpu_blocks else "None"
        info.add_metric([str(cfg.block_size), "True", self._values[1], cpu, str(cfg.num_gpu_blocks)], 1.0)
        yield info
        yield self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries or 0.0,
        )  # fmt: skip
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits or 0.0,
        )
        yield self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", e.preemptions
        )
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens)
        yield self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", self.generation_tokens
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*self._labels, "finished_reason"],
        )
        success.add_metric([*self._values, "length"], self.finished)
        yield success
        yield self.ttft.family(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            self._labels, self._values,
        )  # fmt: skip
        yield self.e2e.family(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            self._labels, self._values,
        )  # fmt: skip
        yield self.queue.family(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            self._labels, self._values,
        )  # fmt: skip
