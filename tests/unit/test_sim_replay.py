"""The simulator end to end: every policy runs on identical clusters, the same seed gives the same
numbers, a checked-in summary is reproduced, and the command line reports bad input clearly."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from simulator import policies
from simulator.cli import main
from simulator.cluster import Cluster, ClusterConfig
from simulator.engine import EngineConfig
from simulator.replay import replay, resolve
from simulator.traces import shared_prefix

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "golden_summary.json"
SMALL = ClusterConfig(pods=3, engine=EngineConfig(num_gpu_blocks=2048), seed=3)


def small_trace() -> list:  # type: ignore[type-arg]
    return shared_prefix(8, 4, system_tokens=1000, question_tokens=200, output_tokens=30, rate=15, seed=2)


def test_every_policy_serves_every_request_and_caching_policies_hit_more() -> None:
    trace = small_trace()
    result = replay(trace, resolve("all"), SMALL)
    assert list(result.summary) == policies.names()
    for name, recs in result.records.items():
        assert sorted(r.index for r in recs) == list(range(len(trace))), name
        assert result.rejected[name] == 0
        assert all(r.first_token_s >= r.arrival_s and r.finished_s >= r.first_token_s for r in recs)
    hits = {name: s["token_hit_rate"] for name, s in result.summary.items()}
    bound = result.bounds["infinite_cache_token_hit_rate"]
    assert all(h <= bound + 1e-9 for h in hits.values())
    assert hits["ttft"] > hits["random"] and hits["llm-d-precise"] > hits["round-robin"]


def test_policies_that_estimate_ttft_record_their_estimate_and_the_others_none() -> None:
    result = replay(small_trace(), ["ttft", "oracle", "random"], SMALL)
    for name in ("ttft", "oracle"):
        estimates = [r.estimated_ttft_s for r in result.records[name]]
        assert all(e is not None and e > 0 for e in estimates), name
        ratio = result.summary[name]["ttft_estimate_ratio_p50"]
        assert ratio is not None and 0.2 < ratio < 5.0, name  # (same order as what happened)
    assert all(r.estimated_ttft_s is None for r in result.records["random"])
    assert result.summary["random"]["ttft_estimate_ratio_p50"] is None


def test_the_router_state_returns_to_zero_and_the_index_follows_the_engines() -> None:
    c = Cluster(policies.load("ttft"), SMALL)
    c.run(small_trace())
    for rec in c.datastore.records():
        assert (rec.in_flight_requests, rec.decoding_requests, rec.prefill_backlog.requests) == (0, 0, 0)
    # every engine's cached blocks are in the router's index (events delayed, none lost)
    for pod, engine in c.engines.items():
        assert c.index.pod_counts(pod).get("gpu", 0) == len(engine.pool.cached) > 0


def test_same_seed_same_numbers_and_another_seed_other_numbers() -> None:
    trace = small_trace()
    a = replay(trace, ["ttft", "random"], SMALL).summary
    b = replay(trace, ["ttft", "random"], SMALL).summary
    assert a == b
    c = replay(trace, ["random"], ClusterConfig(pods=3, engine=SMALL.engine, seed=4)).summary
    assert c["random"] != a["random"]


def test_a_small_trace_reproduces_the_checked_in_summary() -> None:
    """Regenerate with `EPP_UPDATE_GOLDEN=1` after an intended change to the engine model or a policy."""
    got = replay(small_trace(), ["ttft", "gie-default", "random"], SMALL).summary
    if os.environ.get("EPP_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert set(got) == set(want)
    for name in want:
        assert set(got[name]) == set(want[name]), name
        nones = {k for k, v in want[name].items() if v is None}  # (a figure with nothing to measure)
        assert nones == {k for k, v in got[name].items() if v is None}, name
        numbers = {k: v for k, v in want[name].items() if v is not None}
        assert {k: got[name][k] for k in numbers} == pytest.approx(numbers, rel=1e-9, abs=1e-12), name


def test_the_cli_writes_results(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "res"
    code = main(
        [
            "replay",
            "--workload",
            "shared-prefix",
            "--requests",
            "40",
            "--rate",
            "20",
            "--pods",
            "2",
            "--policies",
            "ttft,random",
            "--out",
            str(out),
            "--no-progress",
            "--num-gpu-blocks",
            "1024",
        ]
    )
    assert code == 0
    doc = json.loads((out / "summary.json").read_text())
    assert set(doc["policies"]) == {"ttft", "random"}
    assert {"ttft_mean_s", "ttft_p99_s", "token_hit_rate", "tpot_mean_s", "load_imbalance"} <= set(
        doc["policies"]["ttft"]
    )
    assert doc["meta"]["pods"] == 2 and doc["meta"]["seed"] == 1
    assert (out / "ttft_cdf.png").is_file() and (out / "records-ttft.jsonl").is_file()
    assert "token hit rate of one infinite shared cache (a bound)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--policies", "ttft,best"], "unknown policy best"),
        (["--policies", ",,"], "unknown policy (none)"),
        (["--event-loss", "1.5"], "--event-loss"),
        (["--event-delay", "nan"], "--event-delay must be a finite number"),
        (["--scrape-interval", "1e-9"], "--scrape-interval must be at least 0.001 s (1 ms), got 1e-09"),
        (["--trace", "/nonexistent/trace.jsonl"], "cannot read"),
        (["--num-gpu-blocks", "8"], "an engine holds 112"),
        (["--out", "/proc/no-such-dir/results"], "cannot create the results directory"),
    ],
)
def test_bad_cli_input_is_a_clear_error(
    args: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--no-progress", "--requests", "10", *args]) == 2
    assert fragment in capsys.readouterr().err


def test_an_epp_config_file_is_a_policy_under_its_name(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--policies` takes EPP config files: named after the file or NAME=PATH; a copy of a shipped
    policy's config gives that policy's figures, under its own name, in summary.json and records."""
    mine = tmp_path / "my-ttft.yaml"
    mine.write_text(policies.config_text("ttft"))
    soft = tmp_path / "dyn.yml"
    soft.write_text(policies.config_text("dynamo-kv").replace("max-score-picker", "softmax-picker"))
    out = tmp_path / "out"
    spec = f"ttft,{mine},hot={soft}"
    assert main(["replay", "--no-progress", "--requests", "40", "--pods", "3", "--jobs", "1",
                 "--policies", spec, "--out", str(out)]) == 0  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["policies"]) == ["ttft", "my-ttft", "hot"]
    assert summary["policies"]["my-ttft"] == summary["policies"]["ttft"]
    assert (out / "records-my-ttft.jsonl").read_text() == (out / "records-ttft.jsonl").read_text()
    assert summary["meta"]["policies"] == spec.split(",")
    assert "my-ttft" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("policy", "fragment"),
    [
        ("{tmp}/missing.yaml", "policy file"),
        ("{tmp}/bad.yaml", "bad.yaml"),
        ("ttft={tmp}/ok.yaml", "is a shipped policy's"),
        ("{tmp}/ok.yaml,ok={tmp}/ok.yaml", "both go by 'ok'"),
        ("a/b={tmp}/ok.yaml", "must be letters"),
    ],
)
def test_a_bad_policy_file_is_a_clear_error(
    tmp_path: pathlib.Path, policy: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ok.yaml").write_text(policies.config_text("random"))
    (tmp_path / "bad.yaml").write_text("plugins: [{type: no-such-plugin}]\n")
    out = tmp_path / "out"
    args = ["replay", "--no-progress", "--requests", "10", "--policies", policy.format(tmp=tmp_path)]
    assert main([*args, "--out", str(out)]) == 2
    assert fragment in capsys.readouterr().err
    assert not (out / "summary.json").exists()  # refused before anything ran


def test_a_bad_trace_line_is_named(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n'
    )
    assert main(["replay", "--trace", str(bad), "--no-progress", "--out", str(tmp_path / "o")]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing written


def test_lost_kv_events_make_pods_stale_and_picks_lose_cache_credit() -> None:
    trace = small_trace()
    clean = replay(trace, ["ttft"], SMALL).summary["ttft"]
    lossy_cfg = ClusterConfig(pods=3, engine=SMALL.engine, seed=3, event_loss=0.3)
    lossy = replay(trace, ["ttft"], lossy_cfg)
    s = lossy.summary["ttft"]
    assert len(lossy.records["ttft"]) == len(trace)  # nothing lost but cache credit
    assert clean["picks_cache_aware_rate"] > 0.5  # the rest: pods before their first event
    assert s["picks_cache_aware_rate"] < 0.1  # gaps: every pod stale or degraded most of the time
    assert s["picks_degraded_rate"] + s["picks_load_only_rate"] > 0.9
    assert s["token_hit_rate"] < clean["token_hit_rate"]


def test_a_trace_that_is_not_utf8_is_named(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_bytes(b"\xff\xfe{}")
    assert main(["replay", "--trace", str(bad), "--no-progress", "--out", str(tmp_path / "o")]) == 2
    assert f"{bad}: not UTF-8" in capsys.readouterr().err


def test_multi_turn_answers_are_what_the_next_turn_resends_so_they_hit_the_cache() -> None:
    from simulator.traces import multi_turn

    trace = multi_turn(
        sessions=4, turns=3, system_tokens=64, user_tokens=32, output_tokens=48, rate=0.5, seed=1
    )
    c = Cluster(
        policies.load("ttft"), ClusterConfig(pods=1, engine=EngineConfig(num_gpu_blocks=4096), seed=1)
    )
    recs = {r.index: r for r in c.run(trace)}
    later = [recs[r.index] for r in trace if r.session == "session-0"][1:]
    # turn 2 resends turn 1's prompt and answer: all of it but the last (partial) block is cached
    for rec, req in zip(later, [r for r in trace if r.session == "session-0"][1:], strict=True):
        assert rec.cached_tokens >= len(req.prompt) - 32 - 16


def test_the_router_sees_kv_events_exactly_event_delay_after_they_are_published() -> None:
    """What the router's index holds when a second request arrives just before / exactly at / just after
    the first request's events reach it (its first token plus `event_delay`): nothing, nothing (the
    arrival, scheduled first, runs first, as in the kernel's order), then the prompt's blocks."""
    import numpy as np

    from simulator.traces import TraceRequest

    prompt = np.arange(1, 1 + 64 * 16, dtype=np.int32)
    cfg = ClusterConfig(pods=2, engine=EngineConfig(num_gpu_blocks=1024), seed=1, event_delay=0.004)
    first = Cluster(policies.load("ttft"), cfg).run([TraceRequest(0.0, prompt, 500)])
    published = first[0].first_token_s  # the prefill's step ends: its BlockStored goes out then
    known = {}
    for name, arrival in (("before", published + 0.004 - 1e-6), ("at", published + 0.004),
                          ("after", published + 0.004 + 1e-6)):  # fmt: skip
        c = Cluster(policies.load("ttft"), cfg)
        schedule = c.scheduler.schedule

        def seen(request, candidates, c=c, schedule=schedule, name=name):  # type: ignore[no-untyped-def]
            if request.request_id == "1":
                known[name] = sum(c.index.pod_counts(p).get("gpu", 0) for p in c.pods)
            return schedule(request, candidates)

        c.scheduler.schedule = seen  # type: ignore[method-assign]
        trace = [TraceRequest(0.0, prompt, 500), TraceRequest(arrival, prompt, 5, index=1)]
        recs = {r.index: r for r in c.run(trace)}
        assert recs[0].first_token_s == published
    assert known == {"before": 0, "at": 0, "after": 64}


@pytest.mark.parametrize("workload", ["multi-turn", "agentic"])
def test_no_policy_beats_the_infinite_cache_bound_when_answers_are_resent(workload: str) -> None:
    """Multi-turn and agentic prompts resend earlier answers, whose blocks the engines cached as they
    generated them: the bound counts them, so it stays above every policy's hit rate (counting only
    prompts' blocks, it would not)."""
    from simulator.results import cache_bounds
    from simulator.traces import agentic, multi_turn

    if workload == "multi-turn":
        trace = multi_turn(8, 5, 600, 150, 150, rate=1.0, seed=1)
    else:
        trace = agentic(6, 6, 1500, 200, 300, 100, rate=0.8, seed=1)
    cfg = ClusterConfig(pods=2, engine=EngineConfig(num_gpu_blocks=4096), seed=1)
    result = replay(trace, resolve("all"), cfg)
    bound = result.bounds["infinite_cache_token_hit_rate"]
    hits = {name: s["token_hit_rate"] for name, s in result.summary.items()}
    assert all(h is not None and h <= bound + 1e-12 for h in hits.values()), (hits, bound)
    assert result.bounds["cluster_lru_token_hit_rate"] <= bound
    prompts_only = cache_bounds([(r.prompt, r.prompt) for r in trace], 16, 10**9)
    assert max(h or 0.0 for h in hits.values()) > prompts_only["infinite_cache_token_hit_rate"]


def test_a_policy_s_index_section_sizes_its_router_s_index() -> None:
    """As `epp serve` does: the index's block size and entry bound come from the policy's config."""
    from epp.config import parse_config

    def run(index: str) -> Cluster:
        c = Cluster(parse_config(policies.config_text("ttft") + index, "p.yaml"), SMALL)
        c.run(small_trace())
        return c

    default, big, bounded = run(""), run("index: {blockSize: 32}\n"), run("index: {maxEntries: 50}\n")
    assert (default.index.block_size, default.kv.block_size, default.index.max_entries) == (16, 16, 10**7)
    assert (big.index.block_size, big.kv.block_size) == (32, 32)
    # the engines' 16-token blocks, indexed in 32-token blocks: half the entries
    assert big.index.stats().entries * 2 == default.index.stats().entries > 0
    assert big.modes["cache-aware"] > 0
    assert bounded.index.max_entries == 50 and bounded.index.stats().evicted > 0


def test_rejected_requests_are_recorded_counted_and_reported_as_done() -> None:
    """Scraped every 1,000 s, the metrics are older than ttft's staleness filter allows (2 s) at every
    arrival after the first scrape's: no pod passes, the request is rejected."""
    trace = shared_prefix(2, 5, system_tokens=100, question_tokens=20, output_tokens=5, rate=0.1, seed=1)
    cfg = ClusterConfig(pods=2, engine=EngineConfig(num_gpu_blocks=256), scrape_interval=1000.0, seed=1)
    seen: list[int] = []
    result = replay(trace, ["ttft", "random"], cfg, progress=lambda r: seen.append(r.index))
    assert sorted(seen) == sorted([r.index for r in trace] * 2)  # every request done, rejected or not
    ttft, rand = result.summary["ttft"], result.summary["random"]
    assert result.rejected == {"ttft": len(trace), "random": 0}
    assert (ttft["requests"], ttft["rejected_requests"], ttft["rejected_rate"]) == (0, len(trace), 1.0)
    assert ttft["ttft_mean_s"] is None and ttft["token_hit_rate"] is None
    assert (rand["requests"], rand["rejected_requests"]) == (len(trace), 0)
    recs = result.records["ttft"]
    assert [r.index for r in recs] == list(range(len(trace)))
    assert {(r.status, r.pod, r.first_token_s) for r in recs} == {("rejected", None, None)}
    assert [(r.prompt_tokens, r.output_tokens) for r in recs] == [
        (len(t.prompt), 5) for t in trace
    ]  # asked for
    assert {r.status for r in result.records["random"]} == {"completed"}


def test_a_policy_that_rejects_some_requests_is_read_against_the_bound_over_the_rest() -> None:
    """Its hit rates are of the requests it completed; the trace's bound (over every request) does not
    bound them, so its figures carry the bounds over those requests, and the table says so."""
    from simulator.cluster import computed_tokens
    from simulator.report import table
    from simulator.results import cache_bounds

    trace = shared_prefix(2, 6, system_tokens=200, question_tokens=20, output_tokens=5, rate=3.0, seed=1)
    cfg = ClusterConfig(pods=2, engine=EngineConfig(num_gpu_blocks=256), scrape_interval=1000.0, seed=1)
    result = replay(trace, ["ttft", "random"], cfg)  # ttft: metrics over 2 s old after the first scrape
    ttft, rand = result.summary["ttft"], result.summary["random"]
    done = [trace[r.index] for r in result.records["ttft"] if r.status == "completed"]
    assert 0 < len(done) < len(trace)
    capacity = 2 * (256 - 1)
    own = cache_bounds(((r.prompt, computed_tokens(r)) for r in done), 16, capacity)
    assert own != result.bounds
    assert ttft["infinite_cache_token_hit_rate"] == own["infinite_cache_token_hit_rate"]
    assert ttft["cluster_lru_token_hit_rate"] == own["cluster_lru_token_hit_rate"]
    assert (
        ttft["token_hit_rate"] is not None and ttft["token_hit_rate"] <= own["infinite_cache_token_hit_rate"]
    )
    assert {k: rand[k] for k in result.bounds} == result.bounds  # nothing rejected: the trace's
    text = table(result.summary, result.bounds)
    bound = own["infinite_cache_token_hit_rate"] * 100
    assert f"one infinite shared cache over those: token hit rate {bound:.1f}%" in text
