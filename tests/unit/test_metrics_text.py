"""parse_metrics: the Prometheus text page of vLLM / SGLang -> MetricsSnapshot."""

from __future__ import annotations

import math
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.sources.metrics_text import KNOWN_SERIES, MetricsParseError, parse_metrics
from epp.types import MetricsSnapshot

VLLM_NEW = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="llama"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 400.0
vllm:prefix_cache_hits_created{engine="0",model_name="llama"} 1.7e9
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",\
num_cpu_blocks="None",num_gpu_blocks="2048",engine="0"} 1.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7e9
"""

VLLM_OLD = """\
vllm:num_requests_running{model_name="m"} 1
vllm:num_requests_waiting{model_name="m"} 0
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
"""

SGLANG = """\
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen"} 5.0
sglang:num_running_reqs{model_name="qwen"} 7.0
sglang:token_usage{model_name="qwen"} 0.6
sglang:cache_config_info{page_size="1",num_pages="100000"} 1.0
sglang:prompt_tokens_total{model_name="qwen"} 5000.0
sglang:cached_tokens_total{model_name="qwen"} 2500.0
sglang:cache_hit_rate{model_name="qwen"} 0.5
"""

TWO_ENGINES = """\
vllm:num_requests_waiting{engine="0",model_name="m"} 2
vllm:num_requests_waiting{engine="1",model_name="m"} 3
vllm:num_requests_running{engine="0",model_name="m"} 1
vllm:num_requests_running{engine="1",model_name="m"} 4
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 10
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 30
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 2
"""

TWO_MODELS = """\
vllm:num_requests_waiting{model_name="base"} 1
vllm:num_requests_waiting{model_name="other"} 1
vllm:num_requests_running{model_name="base"} 2
"""

ESCAPED = r"""vllm:num_requests_waiting{model_name="my \"quoted\", model\\x",engine="0"} 1
vllm:num_requests_running{ model_name = "line\nbreak" , } 2
vllm:lora_requests_info{max_lora="2",running_lora_adapters="x\\y, z",waiting_lora_adapters=""} 5
"""

NAN_INF = """\
vllm:num_requests_waiting{engine="0",model_name="m"} NaN
vllm:num_requests_waiting{engine="1",model_name="m"} 4
vllm:num_requests_running{model_name="m"} +Inf
vllm:kv_cache_usage_perc{engine="0",model_name="m"} NaN
vllm:kv_cache_usage_perc{engine="1",model_name="m"} -Inf
vllm:prefix_cache_hits_total{model_name="m"} Nan
"""

TIMESTAMPS = """\
vllm:num_requests_waiting{model_name="m"} 4 1712345678901
vllm:num_requests_running 6 1712345678901
vllm:kv_cache_usage_perc{model_name="m"}\t0.4\t-17
vllm:prefix_cache_hits_total{model_name="m"} 5 # {trace_id="abc"} 1.0 1712345678.9
"""

GARBAGE_ELSEWHERE = """\
this is not prometheus at all {{{ "
vllm:time_to_first_token_seconds_bucket{le="0.1" model_name=broken 1 2 3 4
vllm:num_requests_waiting_max{{{ nonsense
vllm:num_requests_waitingX 12abc
# TYPE vllm:num_requests_waiting gauge with trailing junk
vllm:num_requests_waiting{model_name="m"} 9
\x00\x01 binary junk
"""

CRLF = 'vllm:num_requests_waiting{model_name="m"} 3\r\nvllm:num_requests_running{model_name="m"} 1\r\n'

LORA_NEWEST_WINS = """\
vllm:num_requests_waiting 0
vllm:lora_requests_info{max_lora="8",running_lora_adapters="new",waiting_lora_adapters=""} 200
vllm:lora_requests_info{max_lora="8",running_lora_adapters="old1,old2",waiting_lora_adapters="w"} 100
"""

GEOMETRY_UNKNOWN = """\
vllm:num_requests_waiting 0
vllm:cache_config_info{block_size="32",num_gpu_blocks="None"} 1
"""

OVERFULL_AND_OLD_AFTER_NEW = """\
vllm:gpu_cache_usage_perc{model_name="m"} 0.1
vllm:kv_cache_usage_perc{model_name="m"} 1.5
vllm:gpu_cache_usage_perc{model_name="m"} 0.9
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            VLLM_NEW,
            dict(
                waiting=2,
                running=3,
                kv_usage=0.25,
                block_size=16,
                num_gpu_blocks=2048,
                prefix_cache_queries=1000.0,
                prefix_cache_hits=400.0,
                models=frozenset({"llama"}),
                running_lora_adapters=frozenset({"a", "b"}),
                waiting_lora_adapters=frozenset({"c"}),
                max_lora=4,
            ),
            id="vllm-0.10-names",
        ),
        pytest.param(
            VLLM_OLD, dict(waiting=0, running=1, kv_usage=0.5, models=frozenset({"m"})), id="vllm-old-kv"
        ),
        pytest.param(OVERFULL_AND_OLD_AFTER_NEW, dict(kv_usage=1.0), id="new-kv-name-preferred-and-clamped"),
        pytest.param(
            SGLANG,
            dict(
                waiting=5,
                running=7,
                kv_usage=0.6,
                block_size=1,
                num_gpu_blocks=100000,
                prefix_cache_queries=5000.0,
                prefix_cache_hits=2500.0,
                models=frozenset({"qwen"}),
                max_lora=None,
            ),
            id="sglang",
        ),
        pytest.param(
            TWO_ENGINES,
            dict(waiting=5, running=5, kv_usage=0.7, prefix_cache_queries=40.0, prefix_cache_hits=3.0),
            id="engines-summed-kv-max",
        ),
        pytest.param(
            TWO_MODELS, dict(waiting=2, running=2, models=frozenset({"base", "other"})), id="models"
        ),
        pytest.param(
            ESCAPED,
            dict(
                waiting=1,
                running=2,
                models=frozenset({'my "quoted", model\\x', "line\nbreak"}),
                running_lora_adapters=frozenset({"x\\y", "z"}),
                waiting_lora_adapters=frozenset(),
                max_lora=2,
            ),
            id="escaped-labels",
        ),
        pytest.param(
            NAN_INF, dict(waiting=4, running=0, kv_usage=0.0, prefix_cache_hits=None), id="nan-inf-ignored"
        ),
        pytest.param(
            TIMESTAMPS,
            dict(waiting=4, running=6, kv_usage=0.4, prefix_cache_hits=5.0),
            id="timestamps-exemplar",
        ),
        pytest.param(
            GARBAGE_ELSEWHERE, dict(waiting=9, models=frozenset({"m"})), id="garbage-elsewhere-ignored"
        ),
        pytest.param(CRLF, dict(waiting=3, running=1, models=frozenset({"m"})), id="crlf"),
        pytest.param(
            LORA_NEWEST_WINS,
            dict(running_lora_adapters=frozenset({"new"}), waiting_lora_adapters=frozenset(), max_lora=8),
            id="lora-newest-sample-wins",
        ),
        pytest.param(
            GEOMETRY_UNKNOWN, dict(block_size=32, num_gpu_blocks=None, models=frozenset()), id="geometry"
        ),
    ],
)
def test_parse(text: str, expected: dict[str, Any]) -> None:
    snap = parse_metrics(text, observed_at=12.5)
    assert snap.observed_at == 12.5
    assert {k: getattr(snap, k) for k in expected} == expected


def test_absent_series_keep_defaults() -> None:
    assert parse_metrics("vllm:num_requests_running 2\n", 1.0) == MetricsSnapshot(observed_at=1.0, running=2)


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        pytest.param('vllm:num_requests_waiting{model_name="m"}\n', 1, "missing value", id="no-value"),
        pytest.param("# HELP x\nvllm:num_requests_running 12abc\n", 2, "invalid value", id="bad-value"),
        pytest.param(
            '\n\nvllm:kv_cache_usage_perc{model_name="m} 0.5\n', 3, "bad label set", id="unclosed-quote"
        ),
        pytest.param("vllm:num_requests_waiting{model_name=m} 1\n", 1, "bad label set", id="unquoted-label"),
        pytest.param(
            'vllm:num_requests_waiting{a="1",a="2"} 1\n', 1, "duplicate label", id="duplicate-label"
        ),
        pytest.param(r'vllm:num_requests_waiting{model_name="a\q"} 1' + "\n", 1, "escape", id="bad-escape"),
        pytest.param("x 1\nvllm:num_requests_waiting 1 2 3\n", 2, "unexpected text", id="extra-tokens"),
        pytest.param("vllm:num_requests_waiting 1 later\n", 1, "invalid timestamp", id="bad-timestamp"),
        pytest.param("vllm:num_requests_waiting 1_000\n", 1, "invalid value", id="underscore-number"),
        pytest.param("vllm:num_requests_waiting-x 1\n", 1, "after the metric name", id="junk-after-name"),
        pytest.param(
            "vllm:num_requests_running 1\r\nvllm:prefix_cache_hits_total{\r\n", 2, "", id="crlf-line-no"
        ),
    ],
)
def test_malformed_needed_line_names_the_line(text: str, line: int, reason: str) -> None:
    with pytest.raises(MetricsParseError, match=f"^line {line}: .*{reason}") as info:
        parse_metrics(text, 0.0)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param(
            "# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\n", id="comments"
        ),
        pytest.param('node_cpu_seconds_total{cpu="0",mode="idle"} 1234.5\nup 1\n', id="node-exporter"),
        pytest.param('vllm:time_to_first_token_seconds_bucket{le="0.1"} 3\n', id="only-histograms"),
        pytest.param("<html><body>404 Not Found</body></html>", id="html"),
    ],
)
def test_page_without_engine_metrics_is_an_error(text: str) -> None:
    with pytest.raises(MetricsParseError, match=r"^no known engine metrics"):
        parse_metrics(text, 0.0)


# -- a realistic vLLM page ---------------------------------------------------------------------
_HISTOGRAMS: dict[str, list[float]] = {
    "vllm:time_to_first_token_seconds": [
        0.001,
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.25,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
        160.0,
        640.0,
        2560.0,
    ],
    "vllm:inter_token_latency_seconds": [
        0.01,
        0.025,
        0.05,
        0.075,
        0.1,
        0.15,
        0.2,
        0.3,
        0.4,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
    ],
    "vllm:e2e_request_latency_seconds": [
        0.3,
        0.5,
        0.8,
        1.0,
        1.5,
        2.0,
        2.5,
        5.0,
        10.0,
        15.0,
        20.0,
        30.0,
        40.0,
        50.0,
        60.0,
        120.0,
        240.0,
        480.0,
        960.0,
        1920.0,
        7680.0,
    ],
    "vllm:request_queue_time_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0],
    "vllm:request_prefill_time_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0],
    "vllm:request_decode_time_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0],
    "vllm:request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000],
    "vllm:request_generation_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000],
}


def realistic_vllm_page(engines: int = 2, model: str = "meta-llama/Llama-3.1-8B-Instruct") -> str:
    out = [
        "# HELP python_gc_objects_collected_total Objects collected during gc",
        "# TYPE python_gc_objects_collected_total counter",
        'python_gc_objects_collected_total{generation="0"} 12345.0',
        "process_resident_memory_bytes 8.123456e+09",
    ]
    for name, buckets in _HISTOGRAMS.items():
        out += [f"# HELP {name} Histogram of {name}.", f"# TYPE {name} histogram"]
        for e in range(engines):
            labels = f'engine="{e}",model_name="{model}"'
            for i, le in enumerate([*(str(float(b)) for b in buckets), "+Inf"]):
                out.append(f'{name}_bucket{{{labels},le="{le}"}} {float(i * 7 + e)}')
            out += [
                f"{name}_count{{{labels}}} {float(len(buckets) * 7 + e)}",
                f"{name}_sum{{{labels}}} 1234.5",
            ]
            out.append(f"{name}_created{{{labels}}} 1.7123456789e+09")

    def gauge(name: str, values: list[float], kind: str = "gauge") -> None:
        family = name.removesuffix("_total")
        out.extend([f"# HELP {family} {family}.", f"# TYPE {family} {kind}"])
        for e, v in enumerate(values):
            out.append(f'{name}{{engine="{e}",model_name="{model}"}} {v}')
            if kind == "counter":
                out.append(f'{family}_created{{engine="{e}",model_name="{model}"}} 1.7123456789e+09')

    gauge("vllm:num_requests_running", [3.0, 4.0][:engines])
    gauge("vllm:num_requests_waiting", [1.0, 6.0][:engines])
    gauge("vllm:kv_cache_usage_perc", [0.42, 0.37][:engines])
    gauge("vllm:prefix_cache_queries_total", [5000.0, 7000.0][:engines], "counter")
    gauge("vllm:prefix_cache_hits_total", [2000.0, 1000.0][:engines], "counter")
    gauge("vllm:prompt_tokens_total", [99999.0, 88888.0][:engines], "counter")
    out.append(
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
        'gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27000",sliding_window="None"} 1.0'
    )
    out.append(
        'vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""} 1.7e9'
    )
    for reason in ("stop", "length", "abort"):
        out.append(f'vllm:request_success_total{{finished_reason="{reason}",model_name="{model}"}} 42.0')
    return "\n".join(out) + "\n"


def test_realistic_vllm_page() -> None:
    page = realistic_vllm_page()
    assert len(page) >= 30_000
    snap = parse_metrics(page, 3.0)
    assert snap == MetricsSnapshot(
        observed_at=3.0,
        waiting=7,
        running=7,
        kv_usage=0.42,
        block_size=16,
        num_gpu_blocks=27000,
        prefix_cache_queries=12000.0,
        prefix_cache_hits=3000.0,
        models=frozenset({"meta-llama/Llama-3.1-8B-Instruct"}),
        max_lora=None,
    )


def test_realistic_page_agrees_with_prometheus_client() -> None:
    """Cross-check the hand-rolled reader against the full (slow) parser on the needed series."""
    page = realistic_vllm_page()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name in KNOWN_SERIES and math.isfinite(sample.value):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    snap = parse_metrics(page, 0.0)
    assert snap.waiting == sums["vllm:num_requests_waiting"]
    assert snap.running == sums["vllm:num_requests_running"]
    assert snap.prefix_cache_queries == sums["vllm:prefix_cache_queries_total"]
    assert snap.prefix_cache_hits == sums["vllm:prefix_cache_hits_total"]


def test_garbage_in_histogram_lines_of_a_real_page_is_ignored() -> None:
    page = realistic_vllm_page().replace('le="0.5"}', 'le="0.5" BROKEN')
    assert parse_metrics(page, 0.0).waiting == 7
