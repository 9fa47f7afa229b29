"""Parse a model server's Prometheus `/metrics` page into a `MetricsSnapshot` (pure, no I/O, no clock).

A vLLM page is tens of kilobytes, mostly histogram buckets, and the EPP scrapes every pod every
50 ms. So this reads only the dozen series it needs: a line is skipped with one C-level
`str.startswith` against the known names before anything else is looked at, and labels are parsed
only on the few lines that match. It deliberately does NOT use `prometheus_client.parser`, which
builds every metric family (each bucket included) on each call and is far too slow for this.

Aggregation when a series appears several times (several `engine`, `dp_rank` or `model_name` label
values): waiting, running and the prefix-cache counters are summed, KV usage takes the maximum (the
fullest engine), cache geometry takes the first usable value, and for `vllm:lora_requests_info` the
sample with the highest value (a timestamp) wins. Non-finite samples (`NaN`, `±Inf`) are ignored.
A waiting or running series with a non-empty `priority` label is skipped: SGLang with priority
scheduling exports the total under `priority=""` and the same requests again per priority.

Parallel ranks of one SGLang scheduler are not summed. Every SGLang scheduler process labels its
gauges with its `tp_rank`, `pp_rank` and `moe_ep_rank` (and `dp_rank` with data parallelism):
sgl-project/sglang python/sglang/srt/managers/scheduler_metrics_mixin.py `init_metrics`, gauges in
python/sglang/srt/metrics/collector.py. The tensor / pipeline / expert ranks of one data-parallel rank
run the same scheduling loop over the same requests, so with `--enable-metrics-for-all-schedulers`
(by default only attention-TP rank 0 logs) they report the same running / queued requests once per
rank. Summing them would multiply the pod's load by its TP size. So the series that differ only in
those rank labels count once (their maximum); series that differ in anything else (`dp_rank`: separate
schedulers; `engine`; `model_name`) are summed as above. KV usage takes the maximum either way.

Engine versions: vLLM's KV usage is `vllm:kv_cache_usage_perc` (0.10+), else the older
`vllm:gpu_cache_usage_perc`; SGLang's is `sglang:kv_cache_usage_perc` where exported (newer releases:
KV pools only), else `sglang:token_usage` (which also counts a hybrid model's Mamba state pool).
SGLang's cache geometry is the `sglang:page_size` and `sglang:num_pages` gauges (sgl-project/sglang
#24197), or the `page_size`/`num_pages` labels of the `sglang:cache_config_info` they replaced.

Errors: `MetricsParseError` names the line when a line of a needed series is malformed (other lines
are never inspected, so garbage there is ignored), says there are no known engine metrics at all, or
that a series' (finite) samples add up to more than a float holds.
"""

from __future__ import annotations

import math
import re

from epp.types import MetricsSnapshot

__all__ = ["KNOWN_SERIES", "MetricsParseError", "parse_metrics"]


class MetricsParseError(ValueError):
    """The page cannot be used: a needed line is malformed, or it has no engine metrics at all."""


_WAITING, _RUNNING, _KV, _KV_LEGACY, _GEOMETRY, _QUERIES, _HITS, _LORA = range(8)
_KV_SGLANG, _PAGE_SIZE, _NUM_PAGES = range(8, 11)
_SUMMED = frozenset({_WAITING, _RUNNING, _QUERIES, _HITS})

_SERIES: dict[str, int] = {
    "vllm:num_requests_waiting": _WAITING,
    "sglang:num_queue_reqs": _WAITING,
    "vllm:num_requests_running": _RUNNING,
    "sglang:num_running_reqs": _RUNNING,
    "vllm:kv_cache_usage_perc": _KV,  # vLLM 0.10+
    "sglang:token_usage": _KV,  # used only without sglang:kv_cache_usage_perc
    "sglang:kv_cache_usage_perc": _KV_SGLANG,
    "vllm:gpu_cache_usage_perc": _KV_LEGACY,  # vLLM before 0.10; used only without the new name
    "vllm:cache_config_info": _GEOMETRY,
    "sglang:cache_config_info": _GEOMETRY,  # SGLang before #24197
    "sglang:page_size": _PAGE_SIZE,
    "sglang:num_pages": _NUM_PAGES,
    "vllm:prefix_cache_queries_total": _QUERIES,
    "sglang:prompt_tokens_total": _QUERIES,
    "vllm:prefix_cache_hits_total": _HITS,
    "sglang:cached_tokens_total": _HITS,
    "vllm:lora_requests_info": _LORA,
}
KNOWN_SERIES: frozenset[str] = frozenset(_SERIES)
"""The sample names this parser reads; every other line of the page is skipped unparsed."""

_PREFIXES = tuple(_SERIES)
_RANK_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")
"""Labels that tell apart the parallel ranks of one SGLang scheduler (duplicates of one state)."""
_GEOMETRY_LABELS = {
    "vllm:cache_config_info": ("block_size", "num_gpu_blocks"),
    "sglang:cache_config_info": ("page_size", "num_pages"),
}
_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_RE = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"([^"\\]*(?:\\.[^"\\]*)*)"[ \t]*([,}])')
_LABELS_END_RE = re.compile(r"[ \t]*\}")
_ESCAPE_RE = re.compile(r"\\(.)")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


MAX_REQUESTS = 1_000_000
"""Waiting and running requests (and `max_lora`) are capped here: a pod reporting more is busy beyond
any estimate, and a value near a float's limit would make its TTFT estimate NaN."""
MAX_BLOCK_SIZE = 1 << 20  # tokens per KV block; larger (or more blocks below) reads as absent
MAX_GPU_BLOCKS = 1 << 40
MAX_MODELS = 64
"""Model names kept from one page (a server serves one model and its adapters; a page naming thousands
is not followed further)."""


def parse_metrics(text: str, observed_at: float) -> MetricsSnapshot:
    """Read the engine metrics a router needs from a Prometheus text page (vLLM or SGLang)."""
    found = False
    waiting = running = 0.0
    kv: float | None = None
    kv_legacy: float | None = None
    kv_sglang: float | None = None
    queries: float | None = None
    hits: float | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    models: set[str] = set()
    lora_at = -math.inf
    lora: dict[str, str] | None = None
    # (series kind, the labels other than the rank labels) -> the largest value over the ranks
    ranked: dict[tuple[int, frozenset[tuple[str, str]]], float] = {}

    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.startswith(_PREFIXES):
            continue
        m = _NAME_RE.match(line)
        kind = _SERIES.get(m.group()) if m is not None else None
        if m is None or kind is None:
            continue  # a longer name that merely starts with a known one
        if line.endswith("\r"):
            line = line[:-1]
        try:
            labels, value = _parse_sample(line, m.end())
        except ValueError as exc:
            excerpt = line if len(line) <= 160 else line[:160] + "..."
            raise MetricsParseError(
                f"line {lineno}: malformed {m.group()} sample ({exc}): {excerpt!r}"
            ) from None
        found = True
        model = labels.get("model_name")
        if model and len(models) < MAX_MODELS:
            models.add(model)
        if kind == _GEOMETRY:
            block_label, blocks_label = _GEOMETRY_LABELS[m.group()]
            if block_size is None:
                block_size = _positive_int(labels.get(block_label), MAX_BLOCK_SIZE)
            if num_blocks is None:
                num_blocks = _positive_int(labels.get(blocks_label), MAX_GPU_BLOCKS)
        elif kind == _LORA:
            stamp = value if not math.isnan(value) else -math.inf
            if lora is None or stamp > lora_at:
                lora, lora_at = labels, stamp
        elif not math.isfinite(value):
            continue
        elif kind in (_WAITING, _RUNNING) and labels.get("priority"):
            continue  # a per-priority series repeats part of the total
        elif kind in _SUMMED and _has_rank(labels):
            key = (kind, frozenset(item for item in labels.items() if item[0] not in _RANK_LABELS))
            seen = ranked.get(key)
            ranked[key] = value if seen is None else max(seen, value)
        elif kind == _WAITING:
            waiting += value
        elif kind == _RUNNING:
            running += value
        elif kind == _KV:
            kv = value if kv is None else max(kv, value)
        elif kind == _KV_LEGACY:
            kv_legacy = value if kv_legacy is None else max(kv_legacy, value)
        elif kind == _KV_SGLANG:
            kv_sglang = value if kv_sglang is None else max(kv_sglang, value)
        elif kind == _PAGE_SIZE:
            if block_size is None:
                block_size = _whole(value, MAX_BLOCK_SIZE)
        elif kind == _NUM_PAGES:
            if num_blocks is None:
                num_blocks = _whole(value, MAX_GPU_BLOCKS)
        elif kind == _QUERIES:
            queries = (queries or 0.0) + value
        else:  # _HITS
            hits = (hits or 0.0) + value

    for (kind, _), value in ranked.items():  # each scheduler once, then summed like the rest
        if kind == _WAITING:
            waiting += value
        elif kind == _RUNNING:
            running += value
        elif kind == _QUERIES:
            queries = (queries or 0.0) + value
        else:  # _HITS
            hits = (hits or 0.0) + value
    if not found:
        raise MetricsParseError(
            "no known engine metrics (vllm:* or sglang:* queue/KV series) on the page; "
            "is this endpoint a model server?"
        )
    sums = (
        ("waiting", waiting),
        ("running", running),
        ("prefix cache queries", queries),
        ("prefix cache hits", hits),
    )
    for what, total in sums:
        if total is not None and not math.isfinite(total):  # finite samples whose sum overflows
            raise MetricsParseError(f"the {what} samples add up to more than a float holds")
    usage = next((u for u in (kv_sglang, kv, kv_legacy) if u is not None), 0.0)
    lora = lora or {}
    return MetricsSnapshot(
        observed_at=observed_at,
        waiting=min(MAX_REQUESTS, max(0, round(waiting))),
        running=min(MAX_REQUESTS, max(0, round(running))),
        kv_usage=min(1.0, max(0.0, usage)),
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        models=frozenset(models),
        running_lora_adapters=_adapters(lora.get("running_lora_adapters")),
        waiting_lora_adapters=_adapters(lora.get("waiting_lora_adapters")),
        max_lora=_positive_int(lora.get("max_lora"), MAX_REQUESTS),
    )


def _has_rank(labels: dict[str, str]) -> bool:
    return "tp_rank" in labels or "pp_rank" in labels or "moe_ep_rank" in labels


def _parse_sample(line: str, pos: int) -> tuple[dict[str, str], float]:
    """Labels and value of one sample line; `pos` is just past the name. Raises ValueError(reason)."""
    labels: dict[str, str] = {}
    if pos < len(line) and line[pos] == "{":
        pos += 1
        while True:
            end = _LABELS_END_RE.match(line, pos)
            if end is not None:
                pos = end.end()
                break
            m = _LABEL_RE.match(line, pos)
            if m is None:
                raise ValueError(f"bad label set at column {pos + 1}")
            name, raw, sep = m.groups()
            if name in labels:
                raise ValueError(f"duplicate label {name!r}")
            labels[name] = _ESCAPE_RE.sub(_unescape, raw) if "\\" in raw else raw
            pos = m.end()
            if sep == "}":
                break
    elif pos < len(line) and line[pos] not in " \t":
        raise ValueError(f"unexpected {line[pos]!r} after the metric name")
    rest = line[pos:]
    if "#" in rest:  # an OpenMetrics exemplar follows the value
        rest = rest[: rest.index("#")]
    parts = rest.split()
    if not parts:
        raise ValueError("missing value")
    if len(parts) > 2:
        raise ValueError("unexpected text after the value and timestamp")
    value = _number(parts[0], "value")
    if len(parts) == 2:
        _number(parts[1], "timestamp")
    return labels, value


def _unescape(m: re.Match[str]) -> str:
    char = _ESCAPES.get(m.group(1))
    if char is None:
        raise ValueError(f"invalid escape sequence {m.group()!r} in a label value")
    return char


def _number(token: str, what: str) -> float:
    try:
        if "_" in token:  # float() accepts "1_000"; Prometheus does not
            raise ValueError
        return float(token)
    except ValueError:
        raise ValueError(f"invalid {what} {token!r}") from None


def _positive_int(text: str | None, limit: int) -> int | None:
    """An integer label value (e.g. `num_gpu_blocks="2048"`); None when absent, like "None", or past
    `limit` (no engine has that many; as a float it could overflow the estimates)."""
    if not text or len(text) > 20:
        return None
    try:
        number = int(text)
    except ValueError:
        return None
    return number if 0 < number <= limit else None


def _whole(value: float, limit: int) -> int | None:
    """A gauge holding a count (`sglang:num_pages 6250.0`); None unless a whole number in 1..`limit`
    (the caller has already dropped non-finite values)."""
    return int(value) if value.is_integer() and 0 < value <= limit else None


def _adapters(text: str | None) -> frozenset[str]:
    if not text:
        return frozenset()
    return frozenset(name for name in (part.strip() for part in text.split(",")) if name)
