"""SGLang with tensor / pipeline / expert parallelism: one scheduler's gauges once per rank.

Every SGLang scheduler process labels its gauges with `tp_rank`, `pp_rank`, `moe_ep_rank` (and
`dp_rank` with data parallelism): sgl-project/sglang python/sglang/srt/managers/scheduler_metrics_mixin.py
`init_metrics`, gauge definitions in python/sglang/srt/metrics/collector.py (`multiprocess_mode=
"mostrecent"`, which keeps one value per label set, so ranks stay apart). The ranks of one data-parallel
rank schedule the same requests, so with `--enable-metrics-for-all-schedulers` each of them reports the
same `num_running_reqs` / `num_queue_reqs` / `token_usage`: counted once. Data-parallel ranks are separate
schedulers: summed. The pages are produced by `prometheus_client` in multiprocess mode, one fake process
per scheduler, as SGLang serves them.
"""

from __future__ import annotations

import pathlib

import pytest
from prometheus_client import CollectorRegistry

from epp.sources.metrics_text import parse_metrics

from .test_metrics_engine_fidelity import (
    SGLANG_MODEL,
    Emit,
    SglangScheduler,
    multiprocess_page,
    sglang_tokenizer,
)


def labels(tp: int = 0, pp: int = 0, ep: int | None = None, dp: int | None = None) -> dict[str, object]:
    """The label dict `init_metrics` builds for the scheduler of one rank, in its order."""
    out: dict[str, object] = {
        "model_name": SGLANG_MODEL,
        "engine_type": "unified",
        "tp_rank": tp,
        "pp_rank": pp,
        "moe_ep_rank": tp if ep is None else ep,  # expert parallelism over the TP group
    }
    if dp is not None:
        out["dp_rank"] = dp
    return out


def scheduler(rank: dict[str, object], running: int, queue: int, usage: float, log: bool = True) -> Emit:
    """One scheduler process: its constants always; its load only if it logs stats (by default only
    attention-TP rank 0 does)."""

    def emit(_: CollectorRegistry | None) -> None:
        s = SglangScheduler(rank)
        s.emit_constants(page_size=64, num_pages=6250)
        if log:
            s.log_stats(running=running, queue=queue, usage=usage)

    return emit


def page(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, processes: list[Emit]) -> str:
    return multiprocess_page(tmp_path, monkeypatch, [*processes, sglang_tokenizer(5000, 2000, 0)])


def test_tensor_parallel_ranks_logging_the_same_state_count_once(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = page(tmp_path, monkeypatch, [scheduler(labels(tp=tp), 7, 5, 0.6) for tp in range(4)])
    assert text.count("sglang:num_running_reqs{") == 4  # one series per TP rank
    snap = parse_metrics(text, 0.0)
    assert (snap.waiting, snap.running, snap.kv_usage) == (5, 7, 0.6)  # not 20 and 28
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (5000.0, 2000.0)


def test_pipeline_parallel_ranks_count_once(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = [labels(tp=tp, pp=pp) for pp in range(2) for tp in range(2)]
    snap = parse_metrics(page(tmp_path, monkeypatch, [scheduler(r, 3, 9, 0.4) for r in ranks]), 0.0)
    assert (snap.waiting, snap.running) == (9, 3)


def test_only_rank_zero_logging_is_read_as_it_is(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default: the other ranks' schedulers set their constants and never their load."""
    processes = [scheduler(labels(tp=0), 4, 2, 0.5)] + [
        scheduler(labels(tp=tp), 0, 0, 0.0, log=False) for tp in range(1, 4)
    ]
    snap = parse_metrics(page(tmp_path, monkeypatch, processes), 0.0)
    assert (snap.waiting, snap.running, snap.kv_usage) == (2, 4, 0.5)
    assert (snap.block_size, snap.num_gpu_blocks) == (64, 6250)


def test_ranks_caught_at_different_steps_take_the_largest(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank logs on its own: a scrape may catch one a step behind. Neither summed nor averaged."""
    processes = [scheduler(labels(tp=0), 6, 3, 0.5), scheduler(labels(tp=1), 5, 4, 0.55)]
    snap = parse_metrics(page(tmp_path, monkeypatch, processes), 0.0)
    assert (snap.waiting, snap.running, snap.kv_usage) == (4, 6, 0.55)


def test_data_parallel_ranks_are_summed_and_their_tensor_ranks_counted_once(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP attention, dp=2 x tp=2, every scheduler logging: DP rank d owns TP ranks 2d and 2d+1."""
    load = {0: (4, 1, 0.3), 1: (6, 2, 0.8)}
    processes = [scheduler(labels(tp=2 * dp + i, dp=dp), *load[dp]) for dp in range(2) for i in range(2)]
    snap = parse_metrics(page(tmp_path, monkeypatch, processes), 0.0)
    assert (snap.waiting, snap.running, snap.kv_usage) == (3, 10, 0.8)


RANKED_TEXT = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"} 8.0
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="1",pp_rank="0",moe_ep_rank="1"} 8.0
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="1",pp_rank="0",moe_ep_rank="1",\
priority="0"} 8.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"} 2.0
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="1",pp_rank="0",moe_ep_rank="1"} NaN
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"} 0.25
sglang:token_usage{model_name="m",engine_type="unified",tp_rank="1",pp_rank="0",moe_ep_rank="1"} 0.25
"""


def test_rank_labelled_text_with_a_priority_series_and_a_nan() -> None:
    """The per-priority repeat is still skipped, a NaN rank still ignored (the other rank counts)."""
    snap = parse_metrics(RANKED_TEXT, 0.0)
    assert (snap.running, snap.waiting, snap.kv_usage) == (8, 2, 0.25)


def test_rank_labelled_counters_count_once_and_unranked_series_still_add_up() -> None:
    text = (
        'sglang:prompt_tokens_total{model_name="m",tp_rank="0"} 100\n'
        'sglang:prompt_tokens_total{model_name="m",tp_rank="1"} 100\n'
        'sglang:cached_tokens_total{model_name="m",tp_rank="0",cache_source="device"} 30\n'
        'sglang:cached_tokens_total{model_name="m",tp_rank="1",cache_source="device"} 30\n'
        'sglang:cached_tokens_total{model_name="m",tp_rank="0",cache_source="host"} 5\n'
        'sglang:num_queue_reqs{model_name="m"} 1\n'
        'sglang:num_queue_reqs{model_name="m",tp_rank="0"} 2\n'
        'sglang:num_queue_reqs{model_name="m",tp_rank="1"} 2\n'
    )
    snap = parse_metrics(text, 0.0)
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (100.0, 35.0)  # host is its own series
    assert snap.waiting == 3  # the unlabelled series and the ranked one: two series, summed


def test_vllm_engines_without_rank_labels_are_still_summed() -> None:
    text = (
        'vllm:num_requests_running{model_name="m",engine="0"} 3\n'
        'vllm:num_requests_running{model_name="m",engine="1"} 3\n'
    )
    assert parse_metrics(text, 0.0).running == 6
