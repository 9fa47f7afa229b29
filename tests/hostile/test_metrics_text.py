"""Hostile scraped metrics pages into `epp/sources/metrics_text.py`: random text, huge lines, NaN and
infinite samples, values whose sum overflows, duplicate series. The result is a snapshot with sane
values (what a literal model of the aggregation rules predicts) or a `MetricsParseError` saying why.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.sources.metrics_text import KNOWN_SERIES, MAX_REQUESTS, MetricsParseError, parse_metrics
from epp.types import MetricsSnapshot

WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
KV = ("vllm:kv_cache_usage_perc", "sglang:token_usage")
KV_LEGACY = ("vllm:gpu_cache_usage_perc",)
QUERIES = ("vllm:prefix_cache_queries_total", "sglang:prompt_tokens_total")
HITS = ("vllm:prefix_cache_hits_total", "sglang:cached_tokens_total")
MODELLED = WAITING + RUNNING + KV + KV_LEGACY + QUERIES + HITS


def parse(text: str) -> MetricsSnapshot | MetricsParseError:
    try:
        snap = parse_metrics(text, 5.0)
    except MetricsParseError as err:
        assert str(err)
        return err
    assert snap.observed_at == 5.0
    assert snap.waiting >= 0 and snap.running >= 0
    assert 0.0 <= snap.kv_usage <= 1.0
    for v in (snap.prefix_cache_queries, snap.prefix_cache_hits):
        assert v is None or math.isfinite(v)
    return snap


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_random_text_is_a_snapshot_or_a_parse_error(text: str) -> None:
    parse(text)


names = st.sampled_from(sorted(KNOWN_SERIES))
label_values = st.one_of(st.text(st.characters(blacklist_characters='"\\\n'), max_size=8), st.just(""))
label_sets = st.dictionaries(st.sampled_from(["engine", "model_name", "le", "x"]), label_values, max_size=3)
values = st.one_of(
    st.floats(),
    st.sampled_from([1e308, -1e308, 0.0, 1.0, 0.5, 2.0]),
    st.integers(-(10**6), 10**6).map(float),
)
SPELLINGS = {math.inf: ["+Inf", "Inf", "inf"], -math.inf: ["-Inf", "-inf"]}


@st.composite
def sample_lines(draw: st.DrawFn) -> tuple[str, str, dict[str, str], float]:
    name = draw(st.sampled_from(MODELLED))
    labels = draw(label_sets)
    value = draw(values)
    if math.isnan(value):
        text = draw(st.sampled_from(["NaN", "nan"]))
    elif math.isinf(value):
        text = draw(st.sampled_from(SPELLINGS[value]))
    else:
        text = repr(value)
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    line = f"{name}{{{body}}} {text}" if labels or draw(st.booleans()) else f"{name} {text}"
    if draw(st.booleans()):
        line += " 1700000000000"
    return line, name, labels, value


noise = st.one_of(
    st.sampled_from(["# HELP vllm:num_requests_waiting queued", "# TYPE x gauge", "", "other_metric 5"]),
    st.text(max_size=60).filter(lambda t: "\n" not in t and not t.startswith(("vllm:", "sglang:"))),
    st.sampled_from(["vllm:num_requests_waiting_extra{} 7", "sglang:token_usage2 1"]),  # longer names
)


def model(samples: list[tuple[str, str, dict[str, str], float]]) -> dict[str, Any] | str:
    """The aggregation rules, literally: sums for queues and prefix counters, max for KV usage, the
    legacy KV name only without the new one, non-finite samples ignored; an overflowing sum is an error."""

    def finite(names: tuple[str, ...]) -> list[float]:
        return [v for _, n, _, v in samples if n in names and math.isfinite(v)]

    sums = {}
    for key, series in (("waiting", WAITING), ("running", RUNNING), ("queries", QUERIES), ("hits", HITS)):
        total = 0.0
        for v in finite(series):
            total += v
        if not math.isfinite(total):
            return "overflow"
        sums[key] = total
    kv = finite(KV)
    legacy = finite(KV_LEGACY)
    usage = max(kv) if kv else max(legacy) if legacy else 0.0
    return {
        "waiting": min(MAX_REQUESTS, max(0, round(sums["waiting"]))),  # (capped: past it, absurd)
        "running": min(MAX_REQUESTS, max(0, round(sums["running"]))),
        "kv_usage": min(1.0, max(0.0, usage)),
        "queries": sums["queries"] if finite(QUERIES) else None,
        "hits": sums["hits"] if finite(HITS) else None,
        "models": {lab["model_name"] for _, _, lab, _ in samples if lab.get("model_name")},
    }


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(sample_lines(), noise), min_size=1, max_size=12), st.sampled_from(["\n", "\r\n"]))
def test_pages_of_well_formed_samples_aggregate_as_the_rules_say(
    lines: list[tuple[str, str, dict[str, str], float] | str], newline: str
) -> None:
    samples = [x for x in lines if isinstance(x, tuple)]
    text = newline.join(x[0] if isinstance(x, tuple) else x for x in lines) + newline
    result = parse(text)
    if not samples:
        assert isinstance(result, MetricsParseError) and "no known engine metrics" in str(result)
        return
    expected = model(samples)
    if expected == "overflow":
        assert isinstance(result, MetricsParseError) and "add up to more than a float" in str(result)
        return
    assert isinstance(result, MetricsSnapshot), result
    assert isinstance(expected, dict)
    assert result.waiting == expected["waiting"] and result.running == expected["running"]
    assert result.kv_usage == expected["kv_usage"]
    assert result.prefix_cache_queries == expected["queries"]
    assert result.prefix_cache_hits == expected["hits"]
    assert set(result.models) == expected["models"]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('vllm:num_requests_waiting{engine="0",engine="1"} 1', "duplicate label"),
        ('vllm:num_requests_waiting{engine="0} 1', "bad label set"),
        ("vllm:num_requests_waiting 1_000", "invalid value"),
        ("vllm:num_requests_waiting", "missing value"),
        ("vllm:num_requests_waiting 1 2 3", "unexpected text"),
        ('vllm:num_requests_waiting{a="\\q"} 1', "invalid escape"),
        ("vllm:num_requests_waiting 1 notatime", "invalid timestamp"),
    ],
)
def test_a_malformed_needed_line_is_an_error_naming_the_line(line: str, needle: str) -> None:
    err = parse("# a page\nvllm:num_requests_running 1\n" + line + "\n")
    assert isinstance(err, MetricsParseError)
    assert "line 3" in str(err) and needle in str(err)


@pytest.mark.parametrize(
    "line",
    [
        'vllm:num_requests_waiting{model_name="' + "m" * 4_000_000 + '"} 3',  # a 4 MB label value
        'vllm:num_requests_waiting{a="' + "\\n" * 1_000_000 + '"} 3',  # a million escapes
        "vllm:num_requests_waiting{" + 'a="1",' * 1 + " " * 2_000_000 + "} 3",  # 2 MB of blanks
        "vllm:num_requests_waiting " + " " * 2_000_000 + "3",
        "unrelated_series_" + "x" * 8_000_000 + " 1",  # an 8 MB line the parser skips
    ],
    ids=["label-value", "escapes", "label-blanks", "value-blanks", "skipped"],
)
def test_huge_lines_are_read_or_refused_in_linear_time(line: str) -> None:
    result = parse("vllm:num_requests_running 2\n" + line + "\n")
    if isinstance(result, MetricsSnapshot):
        assert result.running == 2
    else:
        assert "line 2" in str(result) and len(str(result)) < 400  # the message quotes an excerpt


def test_an_overflowing_sum_is_a_parse_error_not_an_overflow() -> None:
    page = 'vllm:num_requests_waiting{engine="0"} 1e308\nvllm:num_requests_waiting{engine="1"} 1e308\n'
    err = parse(page)
    assert isinstance(err, MetricsParseError) and "waiting samples add up" in str(err)


def test_duplicate_series_are_aggregated_and_non_finite_samples_ignored() -> None:
    page = "\n".join(
        [
            'vllm:num_requests_waiting{engine="0"} 3',
            'vllm:num_requests_waiting{engine="0"} 4',  # the same series twice: both count
            'vllm:num_requests_waiting{engine="1"} NaN',
            'vllm:kv_cache_usage_perc{engine="0"} +Inf',
            'vllm:kv_cache_usage_perc{engine="1"} 0.25',
            'vllm:kv_cache_usage_perc{engine="1"} 0.5',
        ]
    )
    snap = parse(page)
    assert isinstance(snap, MetricsSnapshot)
    assert snap.waiting == 7 and snap.kv_usage == 0.5
