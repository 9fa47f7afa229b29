"""Summaries of simulated runs and the trace's cache bounds."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from simulator import report
from simulator.results import FIGURES, REJECTED, RequestRecord, cache_bounds, summarize


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
    assert (s["rejected_requests"], s["rejected_rate"]) == (0, 0)
    with pytest.raises(ValueError, match="no requests to summarize"):
        summarize([], ["a"])


def test_rejected_requests_are_counted_apart_from_the_figures_of_the_completed_ones() -> None:
    done = [rec(0, "a", 0.0, 0.5, 1.5, cached=50), rec(2, "b", 2.0, 2.3, 4.3)]
    rejected = [RequestRecord.rejected(1, 1.0, 100), RequestRecord.rejected(3, 3.0, 80)]
    s = summarize([done[0], rejected[0], done[1], rejected[1]], ["a", "b"])
    assert s == {**summarize(done, ["a", "b"]), "rejected_requests": 2, "rejected_rate": 0.5}
    assert s["requests"] == 2 and s["token_hit_rate"] == pytest.approx(50 / 200)
    doc = rejected[0].to_json()
    assert doc["status"] == REJECTED and doc["pod"] is None
    assert doc["ttft_s"] is None and doc["e2e_s"] is None and doc["tpot_s"] is None
    assert done[0].to_json()["status"] == "completed"


def test_a_policy_that_completed_nothing_has_null_figures_and_a_dash_row() -> None:
    s = summarize([RequestRecord.rejected(0, 0.0, 10), RequestRecord.rejected(1, 1.0, 10)], ["a"])
    assert (s["requests"], s["rejected_requests"], s["rejected_rate"]) == (0, 2, 1.0)
    assert set(s) == set(summarize([rec(0, "a", 0.0, 0.5, 1.5)], ["a"]))  # the same figures, null
    assert all(s[key] is None for key in FIGURES)
    fine = summarize([rec(0, "a", 0.0, 0.5, 1.5), RequestRecord.rejected(1, 1.0, 10)], ["a"])
    text = report.table({"ttft": s, "random": fine})
    ttft_row, random_row = text.splitlines()[1:3]
    assert ttft_row.split()[1:] == ["-"] * 10 + ["2"]  # every figure "-", then the rejected column
    assert random_row.split()[-1] == "1"
    assert "ttft rejected all 2 requests" in text and "it has no figures" in text
    assert "random rejected 1 of 2 requests" in text and "those of the 1 it completed" in text


def test_cache_bounds_infinite_and_cluster_lru() -> None:
    bs = 4
    a = np.arange(1, 17, dtype=np.int32)  # 4 blocks
    b = np.concatenate([a[:8], np.arange(100, 108, dtype=np.int32)])  # shares 2 blocks with a
    c = np.arange(200, 216, dtype=np.int32)
    bounds = cache_bounds([(p, p) for p in (a, b, c, a)], bs, capacity_blocks=1000)
    # hits: b 8 tokens, a again 12 tokens (the last block is capped: len-1); of 64 prompt tokens
    assert bounds["infinite_cache_token_hit_rate"] == pytest.approx(20 / 64)
    assert bounds["cluster_lru_token_hit_rate"] == pytest.approx(20 / 64)
    small = cache_bounds(
        [(p, p) for p in (a, b, c, a)], bs, capacity_blocks=4
    )  # c pushes a's blocks out before a returns
    assert small["cluster_lru_token_hit_rate"] == pytest.approx(8 / 64)
    assert small["infinite_cache_token_hit_rate"] == pytest.approx(20 / 64)


def test_cache_bounds_count_the_blocks_an_answer_completes() -> None:
    """Turn 2 resends turn 1's prompt and answer: its blocks are hits as on an engine, which caches the
    blocks its generated tokens fill (all tokens but the last are fed back)."""
    bs = 4
    prompt1 = np.arange(1, 7, dtype=np.int32)  # 6 tokens: 1 full block
    answer = np.arange(50, 57, dtype=np.int32)  # 7 generated; 6 fed back: 12 computed, 3 full blocks
    computed1 = np.concatenate([prompt1, answer[:6]])
    prompt2 = np.concatenate([prompt1, answer, np.arange(90, 95, dtype=np.int32)])  # 18 tokens
    bounds = cache_bounds([(prompt1, computed1), (prompt2, prompt2)], bs, capacity_blocks=1000)
    # turn 2 hits the 3 blocks turn 1 computed (12 tokens), of 6 + 18 prompt tokens
    assert bounds["infinite_cache_token_hit_rate"] == pytest.approx(12 / 24)
    assert bounds["cluster_lru_token_hit_rate"] == pytest.approx(12 / 24)
    prompts_only = cache_bounds([(prompt1, prompt1), (prompt2, prompt2)], bs, capacity_blocks=1000)
    assert prompts_only["infinite_cache_token_hit_rate"] == pytest.approx(4 / 24)  # the old, beatable one
    tiny = cache_bounds([(prompt1, computed1), (prompt2, prompt2)], bs, capacity_blocks=2)
    assert tiny["cluster_lru_token_hit_rate"] == 0.0  # the answer's blocks pushed the prompt's out
    with pytest.raises(ValueError, match="start with its prompt"):
        cache_bounds([(prompt2, prompt1)], bs, capacity_blocks=10)


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
    assert "infinite shared cache (a bound) 60.0%" in text and "(a reference, not a bound) 40.0%" in text
    assert "observed / estimated" not in text  # (neither policy estimated)
    estimated = [RequestRecord(0, 0.0, "a", 100, 0, 0, 2, 0.3, 1.0, estimated_ttft_s=0.2)]
    text = report.table({"ttft": summarize(estimated, ["a"])}, bounds)
    assert "ttft: observed / estimated TTFT p10 1.50, p50 1.50, p90 1.50" in text


def test_tpot_is_null_when_no_completed_request_has_a_second_token() -> None:
    s = summarize([rec(0, "a", 0.0, 0.5, 0.5, out=1), rec(1, "a", 1.0, 1.2, 1.2, out=1)], ["a"])
    tpot = [f"tpot_{stat}_s" for stat in ("mean", "p50", "p90", "p99")]
    assert all(s[key] is None for key in tpot)
    assert s["ttft_mean_s"] == pytest.approx(0.35) and s["e2e_p50_s"] == pytest.approx(0.35)
    assert s["output_tokens_per_s"] == pytest.approx(2 / 1.2)
    row = report.table({"one-token": s}).splitlines()[1].split()
    assert row[5] == "-" and row[1] == "350.00"  # TPOT column "-", the others numbers
    mixed = summarize([rec(0, "a", 0.0, 0.5, 0.5, out=1), rec(1, "a", 1.0, 1.2, 2.2, out=11)], ["a"])
    assert mixed["tpot_mean_s"] == pytest.approx(0.1)


def test_a_single_request_s_ttft_cdf_is_a_visible_step_from_0_to_1() -> None:
    import matplotlib.colors
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3))
    try:
        report.ttft_cdf(ax, ["only"], {"only": [rec(0, "a", 0.0, 0.25, 1.0)]})
        assert ax.get_ylim() == (0.0, 1.0)
        (line,) = ax.lines
        xy = line.get_xydata()
        assert xy[0].tolist() == [0.25, 0.0] and xy[-1].tolist() == [0.25, 1.0]
        fig.canvas.draw()
        pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)  # type: ignore[attr-defined]
        color = np.array(matplotlib.colors.to_rgb(line.get_color())) * 255
        drawn = int((np.abs(pixels - color).sum(axis=-1) < 30).sum())
        assert drawn > 50  # no legend here: these pixels are the line's
    finally:
        plt.close(fig)


def test_results_of_policies_not_in_the_run_are_removed(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for name in ("records-ttft.jsonl", "records-random.jsonl", "records-old.json", "notes.txt"):
        (out / name).write_text("earlier\n")
    (out / "records-dir.jsonl").mkdir()  # not a file: left alone
    records = {"random": [rec(0, "b", 0.0, 0.9, 1.9)]}
    summary = {"random": summarize(records["random"], ["a", "b"])}
    written = report.write(out, summary, records, {}, {})
    assert sorted(p.name for p in out.iterdir()) == [
        "hit_rates.png",
        "notes.txt",
        "records-dir.jsonl",
        "records-old.json",
        "records-random.jsonl",
        "summary.json",
        "ttft_cdf.png",
    ]
    assert (
        out / "records-random.jsonl"
    ).read_text() != "earlier\n" and out / "records-random.jsonl" in written
    assert (out / "notes.txt").read_text() == "earlier\n" == (out / "records-old.json").read_text()


def test_a_single_token_answer_has_no_tpot_in_its_record_as_in_the_summary() -> None:
    """The records agree with the summary (which leaves such requests out of TPOT, as vLLM's benchmark
    does): recomputing TPOT from the records gives the summary's figure."""
    one = RequestRecord(0, 0.0, "p", 100, 0, 0, 1, 0.05, 0.05)
    many = RequestRecord(1, 0.0, "p", 100, 0, 0, 11, 0.05, 0.15)
    assert one.tpot_s is None and one.to_json()["tpot_s"] is None
    assert many.tpot_s == pytest.approx(0.01)
    figures = summarize([one, many], ["p"])
    assert figures["tpot_mean_s"] == pytest.approx(0.01)


def test_estimate_ratios_are_observed_over_estimated_ttft_of_the_estimated_requests() -> None:
    def timed(i: int, ttft: float, estimate: float | None) -> RequestRecord:
        return RequestRecord(i, 0.0, "a", 100, 0, 0, 2, ttft, ttft + 1.0, estimated_ttft_s=estimate)

    records = [timed(0, 0.2, 0.1), timed(1, 0.1, 0.1), timed(2, 0.1, 0.2), timed(3, 0.5, None)]
    s = summarize([*records, RequestRecord.rejected(4, 0.0, 100)], ["a"])
    ratios = [2.0, 1.0, 0.5]  # the unestimated and the rejected requests count in no ratio
    assert [s[f"ttft_estimate_ratio_p{q}"] for q in (10, 50, 90)] == pytest.approx(
        [np.percentile(ratios, q) for q in (10, 50, 90)]
    )
    assert timed(0, 0.2, 0.1).to_json()["estimated_ttft_s"] == 0.1
    none = summarize([timed(0, 0.2, None), timed(1, 0.2, 0.0)], ["a"])  # (a zero estimate: no ratio)
    assert [none[f"ttft_estimate_ratio_p{q}"] for q in (10, 50, 90)] == [None, None, None]
