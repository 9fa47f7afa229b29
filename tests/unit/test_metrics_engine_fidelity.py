"""parse_metrics fed the `/metrics` pages vLLM 0.32 and current SGLang really emit.

The pages are not hand-typed: each is produced by `prometheus_client` from the metric definitions
of the engine's source (names, documentation, label names and label order, gauge multiprocess
modes), the way the engine produces it:

- vLLM 0.32 (`vllm/v1/metrics/loggers.py`, `PrometheusStatLogger`): labels `model_name`,`engine`
  on every per-engine series; counters named without `_total` (the client adds it, and
  `_created`); `vllm:cache_config_info` labelled with every `CacheConfig` field plus `engine`.
  One API server is a plain registry; with data parallelism vLLM starts one API server per
  engine and switches the client to multiprocess mode (`entrypoints/cli/serve.py`,
  `setup_multiprocess_prometheus`), emulated below with one mmap file per API server.
- SGLang always runs multiprocess (schedulers and the HTTP server are separate processes): scheduler
  gauges (`observability/metrics_collector.py`, `SchedulerMetricsCollector`) carry
  `model_name`,`engine_type`,`tp_rank`,`pp_rank`,`moe_ep_rank` (+ `priority`, `dp_rank`);
  tokenizer counters carry `model_name` (+ `cache_source` on `sglang:cached_tokens_total`).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    values,
)

from epp.sources.metrics_text import parse_metrics
from epp.types import MetricsSnapshot

VLLM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SGLANG_MODEL = "Qwen/Qwen3-8B"

Emit = Callable[[CollectorRegistry | None], None]


def single_process_page(emit: Emit) -> str:
    registry = CollectorRegistry()
    emit(registry)
    return generate_latest(registry).decode()


def multiprocess_page(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, processes: Sequence[Emit]
) -> str:
    """What `MultiProcessCollector` serves after each of `processes` (one fake pid each) wrote its
    metrics into the shared directory, as the engines' API servers / schedulers do."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    pid = [0]
    value_class = values.MultiProcessValue(lambda: pid[0])  # type: ignore[no-untyped-call]
    monkeypatch.setattr(values, "ValueClass", value_class)
    for i, emit in enumerate(processes):
        pid[0] = 1000 + i
        emit(None)  # like the engines: metrics of the process, not of a registry we collect
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))  # type: ignore[no-untyped-call]
    page = generate_latest(registry).decode()
    value_class.close_all_files()
    return page


# -- vLLM 0.32 -----------------------------------------------------------------------------------
LABELS = ["model_name", "engine"]
# CacheConfig fields in declaration order (vllm/config/cache.py), as `metrics_info()` turns
# `__dict__` into labels, then `engine` (loggers.py `log_metrics_info`).
CACHE_CONFIG_KEYS = (  # noqa: SIM905
    "block_size user_specified_block_size kv_cache_layout prefix_match_unit gpu_memory_utilization "
    "cache_dtype is_attention_free num_gpu_blocks_override sliding_window enable_prefix_caching "
    "prefix_caching_hash_algo prefix_cache_retention_interval kv_cache_dtype_skip_layers "
    "mamba_page_size_padded skip_page_size_padded mamba_block_size mamba_cache_dtype "
    "mamba_ssm_cache_dtype mamba_cache_mode enable_mamba_shared_prefix_checkpoint replayssm_buffer_len "
    "use_replayssm use_kda_recoverssm num_gpu_blocks num_cpu_blocks effective_attention_block_size "
    "kv_cache_size_tokens kv_cache_max_concurrency hash_block_size cache_hit_alignment_tokens "
    "kv_sharing_fast_prefill swa_bounded_replay kv_cache_memory_bytes kv_offloading_size "
    "kv_offloading_backend _block_size_resolved"
).split()


def cache_config(num_gpu_blocks: int, kv_cache_size_tokens: int) -> dict[str, str]:
    info = {key: "None" for key in CACHE_CONFIG_KEYS}
    info.update(
        block_size="16",
        user_specified_block_size="False",
        gpu_memory_utilization="0.92",
        cache_dtype="auto",
        is_attention_free="False",
        enable_prefix_caching="True",
        prefix_caching_hash_algo="sha256",
        prefix_cache_retention_interval="0",
        kv_cache_dtype_skip_layers="[]",
        mamba_cache_dtype="auto",
        mamba_ssm_cache_dtype="auto",
        mamba_cache_mode="none",
        enable_mamba_shared_prefix_checkpoint="False",
        replayssm_buffer_len="16",
        use_replayssm="False",
        use_kda_recoverssm="False",
        num_gpu_blocks=str(num_gpu_blocks),  # the frontend's sum over its engines (core_client.py)
        effective_attention_block_size="16",
        kv_cache_size_tokens=str(kv_cache_size_tokens),  # per engine
        kv_cache_max_concurrency="3.375",
        kv_sharing_fast_prefill="False",
        swa_bounded_replay="True",
        kv_offloading_backend="native",
        _block_size_resolved="True",
    )
    return info


class VllmApiServer:
    """The families `PrometheusStatLogger.__init__` registers that matter here, with its names,
    documentation, label names and multiprocess modes; `record` mirrors `PrometheusStatLogger.record`."""

    def __init__(self, registry: CollectorRegistry | None, engines: Sequence[int], lora: bool) -> None:
        r = registry
        self.engines = engines
        self.running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            LABELS,
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            LABELS,
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason.",
            [*LABELS, "reason"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state.",
            [*LABELS, "sleep_state"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.kv = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            LABELS,
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            LABELS,
            registry=r,
        )
        self.hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            LABELS,
            registry=r,
        )
        self.ext_queries = Counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
            LABELS,
            registry=r,
        )
        self.cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier.",
            [*LABELS, "source"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            buckets=[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
            registry=r,
        )
        self.rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=r,
        )
        self.lora = (
            Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                multiprocess_mode="sum",
                registry=r,
            )
            if lora
            else None
        )
        for e in engines:  # `create_metric_per_engine`: every engine's children exist from the start
            for m in (self.running, self.waiting, self.kv, self.queries, self.hits, self.ext_queries):
                m.labels(VLLM_MODEL, str(e))
            for reason in ("capacity", "deferred"):
                self.waiting_by_reason.labels(VLLM_MODEL, str(e), reason)
            self.sleep.labels(VLLM_MODEL, str(e), "awake").set(1)
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            self.rejections.labels(model_name=VLLM_MODEL, reason=reason)
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*CACHE_CONFIG_KEYS, "engine"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        for e in engines:  # `log_engine_initialized`
            info.labels(**cache_config(27000 * len(engines), 432000), engine=str(e)).set(1)

    def record(
        self, engine: int, running: int, waiting: int, deferred: int, kv: float, queries: int, hits: int
    ) -> None:
        e = str(engine)
        self.running.labels(VLLM_MODEL, e).set(running)
        self.waiting.labels(VLLM_MODEL, e).set(waiting + deferred)
        self.waiting_by_reason.labels(VLLM_MODEL, e, "capacity").set(waiting)
        self.waiting_by_reason.labels(VLLM_MODEL, e, "deferred").set(deferred)
        self.kv.labels(VLLM_MODEL, e).set(kv)
        self.queries.labels(VLLM_MODEL, e).inc(queries)
        self.hits.labels(VLLM_MODEL, e).inc(hits)
        self.cached_by_source.labels(VLLM_MODEL, e, "device").inc(hits)
        self.prompt_tokens.labels(VLLM_MODEL, e).inc(queries)
        self.ttft.labels(VLLM_MODEL, e).observe(0.03)

    def record_lora(self, running: str, waiting: str, stamp: float) -> None:
        assert self.lora is not None  # `set_to_current_time`, with the time given
        self.lora.labels(max_lora="4", waiting_lora_adapters=waiting, running_lora_adapters=running).set(
            stamp
        )


def test_vllm_032_one_engine_page() -> None:
    def emit(registry: CollectorRegistry | None) -> None:
        server = VllmApiServer(registry, engines=[0], lora=True)
        server.record_lora(running="", waiting="", stamp=1_760_000_000.0)
        server.record(0, running=3, waiting=1, deferred=1, kv=0.25, queries=1000, hits=400)
        server.record_lora(running="sql-lora,chat-lora", waiting="sql-lora,chat-lora", stamp=1_760_000_050.5)

    page = single_process_page(emit)
    assert "vllm:prefix_cache_queries_total{" in page and "vllm:prefix_cache_queries_created{" in page
    assert "vllm:num_requests_waiting_by_reason{" in page  # a longer name: not read
    assert parse_metrics(page, 1.0) == MetricsSnapshot(
        observed_at=1.0,
        waiting=2,  # `num_waiting_reqs + num_skipped_waiting_reqs`, one series
        running=3,
        kv_usage=0.25,
        block_size=16,
        num_gpu_blocks=27000,
        prefix_cache_queries=1000.0,
        prefix_cache_hits=400.0,
        models=frozenset({VLLM_MODEL}),
        running_lora_adapters=frozenset({"sql-lora", "chat-lora"}),
        waiting_lora_adapters=frozenset({"sql-lora", "chat-lora"}),
        max_lora=4,
    )


def test_vllm_032_data_parallel_page_with_one_api_server_per_engine(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP=2 on one pod: `engine="0"`/`"1"` series; each API server process gets some engine
    stats (gauges: most recent wins, counters: summed over processes by the client)."""

    def api_server_a(_: CollectorRegistry | None) -> None:
        server = VllmApiServer(None, engines=[0, 1], lora=False)
        server.record(0, running=3, waiting=2, deferred=0, kv=0.25, queries=600, hits=200)
        server.record(1, running=1, waiting=0, deferred=0, kv=0.10, queries=1000, hits=0)

    def api_server_b(_: CollectorRegistry | None) -> None:
        server = VllmApiServer(None, engines=[0, 1], lora=False)
        server.record(1, running=5, waiting=3, deferred=1, kv=0.75, queries=2000, hits=1200)
        server.record(0, running=3, waiting=2, deferred=0, kv=0.25, queries=400, hits=200)

    page = multiprocess_page(tmp_path, monkeypatch, [api_server_a, api_server_b])
    assert 'vllm:prefix_cache_queries_total{engine="1",' in page  # labels sorted, no `_created`
    assert "_created" not in page
    assert parse_metrics(page, 2.0) == MetricsSnapshot(
        observed_at=2.0,
        waiting=6,  # 2 + 4: the pod's engines summed
        running=8,
        kv_usage=0.75,  # the fullest engine
        block_size=16,
        num_gpu_blocks=54000,  # as vLLM labels it: the frontend's sum over both engines
        prefix_cache_queries=4000.0,
        prefix_cache_hits=1600.0,
        models=frozenset({VLLM_MODEL}),
    )


# -- SGLang --------------------------------------------------------------------------------------
def scheduler_labels(
    tp_rank: int = 0, priority: bool = False, dp_rank: int | None = None
) -> dict[str, object]:
    """`SchedulerMetricsCollector.init_new`: the label dict, in its order."""
    labels: dict[str, object] = {
        "model_name": SGLANG_MODEL,
        "engine_type": "unified",
        "tp_rank": tp_rank,
        "pp_rank": 0,
        "moe_ep_rank": 0,
    }
    if priority:
        labels["priority"] = ""
    if dp_rank is not None:
        labels["dp_rank"] = dp_rank
    return labels


class SglangScheduler:
    """The scheduler gauges read here, as `SchedulerMetricsCollector.__init__` defines them (after
    sgl-project/sglang#24197: `emit_constants` with `sglang:page_size` / `sglang:num_pages`)."""

    def __init__(self, labels: dict[str, object]) -> None:
        self.labels = labels
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, multiprocess_mode="mostrecent", registry=None)

        self.running = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.queue = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.grammar_queue = gauge(
            "sglang:num_grammar_queue_reqs", "The number of requests in the grammar waiting queue."
        )
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.full_token_usage = gauge("sglang:full_token_usage", "The token usage for full attention layers.")
        self.mamba_usage = gauge("sglang:mamba_usage", "The token usage for Mamba layers.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.max_total_num_tokens = gauge(
            "sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."
        )
        self.page_size = gauge("sglang:page_size", "KV cache page size in tokens.")
        self.num_pages = gauge("sglang:num_pages", "Number of KV cache pages.")
        self.context_len = gauge("sglang:context_len", "Maximum context length.")
        self.known_priorities: set[int] = set()

    def set(self, gauge: Gauge, value: float) -> None:  # `_log_gauge`
        gauge.labels(**self.labels).set(value)

    def set_queue_count(self, gauge: Gauge, total: int, by_priority: dict[int, int] | None) -> None:
        """`_log_gauge_queue_count`: the total under the default labels (`priority=""`), then one
        series per priority seen so far."""
        gauge.labels(**self.labels).set(total)
        if by_priority is not None:
            self.known_priorities.update(by_priority)
            for priority in self.known_priorities:
                gauge.labels(**{**self.labels, "priority": str(priority)}).set(by_priority.get(priority, 0))

    def emit_constants(self, page_size: int, num_pages: int) -> None:
        self.set(self.max_total_num_tokens, page_size * num_pages)
        self.set(self.page_size, page_size)
        self.set(self.num_pages, num_pages)
        self.set(self.context_len, 40960)

    def log_stats(
        self,
        running: int,
        queue: int,
        usage: float,
        by_priority: tuple[dict[int, int], dict[int, int]] | None = None,
        mamba: float = 0.0,
    ) -> None:
        self.set_queue_count(self.running, running, by_priority[0] if by_priority else None)
        self.set_queue_count(self.queue, queue, by_priority[1] if by_priority else None)
        self.set(self.grammar_queue, 0)
        self.set(self.cache_hit_rate, 0.4)
        self.set(self.token_usage, max(usage, mamba))  # max(full, swa, mamba)
        self.set(self.full_token_usage, usage)
        self.set(self.mamba_usage, mamba)


def sglang_tokenizer(prompt_tokens: int, device: int, host: int) -> Emit:
    """`TokenizerMetricsCollector` (its own process): counters named with `_total` already."""

    def emit(_: CollectorRegistry | None) -> None:
        labels = {"model_name": SGLANG_MODEL}
        prompt = Counter(
            "sglang:prompt_tokens_total", "Number of prefill tokens processed.", list(labels), registry=None
        )
        cached = Counter(
            "sglang:cached_tokens_total",
            "Number of cached prompt tokens by source (device/host/storage).",
            [*labels, "cache_source"],
            registry=None,
        )
        requests = Counter(
            "sglang:num_requests_total", "Number of requests processed.", list(labels), registry=None
        )
        prompt.labels(**labels).inc(prompt_tokens)
        cached.labels(**labels, cache_source="device").inc(device)
        cached.labels(**labels, cache_source="host").inc(host)
        requests.labels(**labels).inc(10)

    return emit


def test_sglang_cache_geometry_comes_from_the_page_size_and_num_pages_gauges(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sgl-project/sglang#24197 replaced `sglang:cache_config_info{page_size,num_pages}` with two
    gauges; a current SGLang page has no info metric left."""

    def scheduler(_: CollectorRegistry | None) -> None:
        s = SglangScheduler(scheduler_labels())
        s.emit_constants(page_size=64, num_pages=6250)
        s.log_stats(running=7, queue=5, usage=0.6)

    page = multiprocess_page(
        tmp_path, monkeypatch, [scheduler, sglang_tokenizer(5000, device=2000, host=500)]
    )
    assert "sglang:cache_config_info" not in page
    assert parse_metrics(page, 3.0) == MetricsSnapshot(
        observed_at=3.0,
        waiting=5,
        running=7,
        kv_usage=0.6,
        block_size=64,
        num_gpu_blocks=6250,
        prefix_cache_queries=5000.0,
        prefix_cache_hits=2500.0,  # every `cache_source`
        models=frozenset({SGLANG_MODEL}),
    )


def test_sglang_per_priority_breakdown_is_not_counted_on_top_of_the_total(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With priority scheduling, `sglang:num_queue_reqs` / `num_running_reqs` hold the total under
    `priority=""` and the same requests again under `priority="<n>"`."""

    def scheduler(_: CollectorRegistry | None) -> None:
        s = SglangScheduler(scheduler_labels(priority=True))
        s.emit_constants(page_size=1, num_pages=400000)
        s.log_stats(running=4, queue=9, usage=0.5, by_priority=({0: 4}, {0: 3, 10: 6}))
        s.log_stats(running=3, queue=6, usage=0.5, by_priority=({0: 3}, {10: 6}))  # priority 0 left the queue

    page = multiprocess_page(tmp_path, monkeypatch, [scheduler, sglang_tokenizer(100, device=0, host=0)])
    assert 'priority="10"' in page and 'priority=""' in page
    snap = parse_metrics(page, 0.0)
    assert (snap.waiting, snap.running) == (6, 3)


def test_sglang_data_parallel_ranks_are_summed(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP attention: one logging scheduler per DP rank (attn_tp_rank 0), told apart by `dp_rank`."""

    def rank(dp: int, running: int, queue: int, usage: float) -> Emit:
        def emit(_: CollectorRegistry | None) -> None:
            s = SglangScheduler(scheduler_labels(tp_rank=2 * dp, dp_rank=dp))
            s.emit_constants(page_size=64, num_pages=3000)
            s.log_stats(running=running, queue=queue, usage=usage)

        return emit

    page = multiprocess_page(
        tmp_path, monkeypatch, [rank(0, 4, 1, 0.3), rank(1, 6, 2, 0.8), sglang_tokenizer(10, 1, 0)]
    )
    snap = parse_metrics(page, 0.0)
    assert (snap.waiting, snap.running, snap.kv_usage) == (3, 10, 0.8)
    assert (snap.block_size, snap.num_gpu_blocks) == (64, 3000)


def test_sglang_kv_cache_usage_perc_is_preferred_to_token_usage(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a hybrid Mamba model `sglang:token_usage` is max(full, swa, mamba): the Mamba state pool
    can fill long before the KV cache. Newer SGLang also exports `sglang:kv_cache_usage_perc`, the
    KV pools only ("Equivalent of vLLM's gpu_cache_usage_perc", docs/references/production_metrics)."""

    def scheduler(_: CollectorRegistry | None) -> None:
        s = SglangScheduler(scheduler_labels())
        kv = Gauge(
            "sglang:kv_cache_usage_perc",
            "The KV cache usage (0.0-1.0): max usage across the KV cache pools (full and SWA attention), "
            "excluding the Mamba state pool. Equivalent of vLLM's gpu_cache_usage_perc.",
            list(s.labels),
            multiprocess_mode="mostrecent",
            registry=None,
        )
        s.emit_constants(page_size=64, num_pages=6250)
        s.log_stats(running=2, queue=0, usage=0.3, mamba=0.9)
        s.set(kv, 0.3)

    page = multiprocess_page(tmp_path, monkeypatch, [scheduler])
    assert parse_metrics(page, 0.0).kv_usage == 0.3


def test_sglang_token_usage_still_read_without_the_newer_gauge(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def scheduler(_: CollectorRegistry | None) -> None:
        SglangScheduler(scheduler_labels()).log_stats(running=2, queue=0, usage=0.3, mamba=0.9)

    page = multiprocess_page(tmp_path, monkeypatch, [scheduler])
    assert parse_metrics(page, 0.0).kv_usage == 0.9
