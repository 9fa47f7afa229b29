"""Summaries of simulated runs and the trace's cache bounds."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from simulator import report
from simulator.results import RequestRecord, cache_bounds, summarize


def rec(
    i: int,
    pod: str,
    arrival: float,
    first: float,
    end: float,
    prompt: int = 100,
    cached: int = 0,
    loaded: int = 0,
    out: int = 11,
) -> RequestRecord:
    return RequestRecord(i, arrival, pod, prompt, cached, loaded, out, first, end)


def test_summary_figures_are_named_with_units_and_computed_from_records() -> None:
    records = [
        rec(0, "a", 0.0, 0.5, 1.5, cached=50),
        rec(1, "a", 1.0, 1.1, 2.1, loaded=20),
        rec(2, "b", 2.0, 2.3, 4.3),
        rec(3, "a", 3.0, 3.1, 3.1, out=1),
    ]
    s = summarize(records, ["a", "b", "c"])
    assert s["requests"] == 4
    assert s["ttft_mean_s"] == pytest.approx((0.5 + 0.1 + 0.3 + 0.1) / 4)
    assert s["ttft_p50_s"] == pytest.approx(0.2)
    assert s["tpot_mean_s"] == pytest.approx((0.1 + 0.1 + 0.2) / 3)  # the 1-token output has no TPOT
    assert s["e2e_p99_s"] == pytest.approx(np.percentile([1.5, 1.1, 2.3, 0.1], 99))
    assert s["token_hit_rate"] == pytest.approx(70 / 400)
    assert s["gpu_token_hit_rate"] == pytest.approx(50 / 400)
    assert s["request_hit_rate"] == pytest.approx(0.5)
    assert s["load_imbalance"] == pytest.approx(3 / (4 / 3))  # a served 3, mean over 3 pods 4/3
    assert s["throughput_rps"] == pytest.approx(4 / 4.3)
    assert s["output_tokens_per_s"] == pytest.approx(34 / 4.3)
    with pytest.raises(ValueError, match="no completed requests"):
        summarize([], ["a"])


def test_cache_bounds_infinite_and_cluster_lru() -> None:
    bs = 4
    a = np.arange(1, 17, dtype=np.int32)  # 4 blocks
    b = np.concatenate([a[:8], np.arange(100, 108, dtype=np.int32)])  # shares 2 blocks with a
    c = np.arange(200, 216, dtype=np.int32)
    bounds = cache_bounds([a, b, c, a], bs, capacity_blocks=1000)
    # hits: b 8 tokens, a again 12 tokens (the last block is capped: len-1); of 64 prompt tokens
    assert bounds["infinite_cache_token_hit_rate"] == pytest.approx(20 / 64)
    assert bounds["cluster_lru_token_hit_rate"] == pytest.approx(20 / 64)
    small = cache_bounds([a, b, c, a], bs, capacity_blocks=4)  # c pushes a's blocks out before a returns
    assert small["cluster_lru_token_hit_rate"] == pytest.approx(8 / 64)
    assert small["infinite_cache_token_hit_rate"] == pytest.approx(20 / 64)


def test_report_writes_summary_records_and_plots(tmp_path: pathlib.Path) -> None:
    records = {"ttft": [rec(0, "a", 0.0, 0.5, 1.5, cached=50)], "random": [rec(0, "b", 0.0, 0.9, 1.9)]}
    summary = {name: summarize(recs, ["a", "b"]) for name, recs in records.items()}
    bounds = {"infinite_cache_token_hit_rate": 0.6, "cluster_lru_token_hit_rate": 0.4}
    paths = report.write(tmp_path / "out", summary, records, {"seed": 1}, bounds)
    doc = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert doc["policies"]["ttft"]["ttft_mean_s"] == pytest.approx(0.5)
    assert doc["meta"] == {"seed": 1} and doc["bounds"] == bounds
    lines = (tmp_path / "out" / "records-random.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["ttft_s"] == pytest.approx(0.9)
    pngs = [p for p in paths if p.suffix == ".png"]
    assert len(pngs) == 2 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    text = report.table(summary, bounds)
    assert text.splitlines()[1].startswith("ttft") and "500.00" in text.splitlines()[1]
    assert "infinite shared cache 60.0%" in text
