"""`epp-sim replay` refuses, before anything runs, what would otherwise silently spoil or stall a run: a
`--scrape-interval` a policy's staleness filter cannot live with (the production check, shared), and a
trace whose arrivals span more than `MAX_SPAN_S` (a file's line, `--rate`, `--rate-scale` named). What
is within the bounds still runs as before."""

from __future__ import annotations

import json
import pathlib

import pytest

import epp.server.startup
from epp.config import ConfigError
from epp.scheduling import scrape_settings
from simulator import cli
from simulator.cli import main
from simulator.cluster import MIN_SCRAPE_INTERVAL, ClusterConfig
from simulator.replay import resolve
from simulator.trace_span import MAX_SPAN_S, scaled_span_error
from simulator.traces import TraceError, TraceRequest, read_azure, read_mooncake

QUICK = ["replay", "--no-progress", "--jobs", "1", "--pods", "1", "--num-gpu-blocks", "1024"]
HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def fresh_policy(path: pathlib.Path, max_age: str) -> pathlib.Path:
    path.write_text(
        HEAD
        + f"plugins:\n- {{type: metrics-staleness-filter, name: fresh, parameters: {{maxAge: {max_age}}}}}\n"
        "- {type: queue-scorer}\nschedulingProfiles:\n- name: main\n"
        "  plugins: [{pluginRef: fresh}, {pluginRef: queue-scorer}]\n"
    )
    return path


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a simulation started")

    monkeypatch.setattr(cli, "replay_parallel", never)


def mooncake_line(ms: object, ids: tuple[int, ...] = (1,)) -> str:
    return (
        json.dumps({"timestamp": ms, "input_length": 100, "output_length": 5, "hash_ids": list(ids)}) + "\n"
    )


# -- 1. --scrape-interval against the policies' staleness thresholds ---------------------------------


def test_the_production_check_is_shared_not_copied() -> None:
    assert epp.server.startup.check_scrape_settings is scrape_settings.check_scrape_settings


def test_a_scrape_interval_above_a_filter_s_max_age_is_refused_naming_everything(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], nothing_runs: None
) -> None:
    out = tmp_path / "out"
    assert main([*QUICK, "--policies", "random,ttft", "--scrape-interval", "5", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "epp-sim: <policy ttft>: profile 'default': plugin 'metrics-staleness-filter': field "
        "'parameters.maxAge': maxAge 2s is not above --scrape-interval 5s: "
    )
    assert "requests get rejected" in err and "429" not in err and "--refresh-metrics-interval" not in err
    assert not out.exists()
    mine = fresh_policy(tmp_path / "mine.yaml", "100ms")
    assert main([*QUICK, "--policies", f"hot={mine}", "--scrape-interval", "0.2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"<policy hot={mine}>: profile 'main': plugin 'fresh'" in err
    assert "maxAge 100ms is not above --scrape-interval 200ms" in err


def test_resolve_checks_only_when_given_the_interval() -> None:
    with pytest.raises(ConfigError) as err:
        resolve("ttft", 2.5)
    assert (err.value.source, err.value.field) == ("<policy ttft>", "parameters.maxAge")
    with pytest.raises(ConfigError):  # equal is not enough, as in production
        resolve("ttft", 2.0)
    assert resolve("ttft", 1.99) == ["ttft"]
    assert resolve("ttft") == ["ttft"]  # (a library caller may study rejections on purpose)


def test_policies_the_interval_cannot_spoil_still_run(tmp_path: pathlib.Path) -> None:
    """`random` has no staleness filter; `oracle` scrapes at every arrival; the saturation detector's
    200 ms threshold refuses only sheddable requests, which the simulator never sends: a 5 s scrape
    interval is fine for them, and nothing is rejected."""
    out = tmp_path / "out"
    args = ["--requests", "10", "--rate", "2", "--scrape-interval", "5", "--out", str(out)]
    assert main([*QUICK, *args, "--policies", "random,oracle,least-load"]) == 0
    doc = json.loads((out / "summary.json").read_text())
    assert {name: f["rejected_requests"] for name, f in doc["policies"].items()} == {
        "random": 0,
        "oracle": 0,
        "least-load": 0,
    }
    assert doc["meta"]["scrape_interval_s"] == 5.0
    ok = fresh_policy(tmp_path / "ok.yaml", "150ms")
    assert main([*QUICK, *args, "--scrape-interval", "0.1", "--policies", str(ok), "--out", str(out)]) == 0


# -- 2. a trace's span -------------------------------------------------------------------------------


def test_mooncake_timestamps_years_apart_name_the_line(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], nothing_runs: None
) -> None:
    trace = tmp_path / "far.jsonl"
    trace.write_text(mooncake_line(5) + mooncake_line(1e300) + mooncake_line(0))
    assert main([*QUICK, "--trace", str(trace), "--policies", "random", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"epp-sim: {trace}:2: 'timestamp' is 1e+297 s after the earliest one (line 3): ")
    assert "more than the 1e+08 s (about 3 years) of simulated time a trace may span" in err


def test_the_bound_itself_is_allowed_and_one_ms_more_is_not() -> None:
    edge = read_mooncake(mooncake_line(0) + mooncake_line(MAX_SPAN_S * 1000), "edge.jsonl")
    assert edge[-1].arrival == MAX_SPAN_S
    with pytest.raises(TraceError) as err:
        read_mooncake(mooncake_line(0) + mooncake_line(MAX_SPAN_S * 1000 + 1), "over.jsonl")
    assert str(err.value).startswith("over.jsonl:2: 'timestamp' is 1e+08 s after the earliest one (line 1)")


@pytest.mark.parametrize(
    ("rows", "line"),
    [
        (["2020-01-01T00:00:00", "2021-06-01T00:00:00", "2024-01-01T00:00:00"], 4),  # ~4 years
        (["1e9", "5", "200000000"], 2),  # seconds; the first line past it, the earliest on line 3
    ],
)
def test_azure_rows_years_apart_name_the_line(rows: list[str], line: int) -> None:
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{r},10,2\n" for r in rows)
    with pytest.raises(TraceError) as err:
        read_azure(text, "years.csv")
    message = str(err.value)
    assert message.startswith(f"years.csv:{line}: TIMESTAMP is ") and "a trace may span" in message


def test_a_rate_scale_that_stretches_the_trace_past_the_bound_is_named(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], nothing_runs: None
) -> None:
    trace = tmp_path / "near.jsonl"
    trace.write_text(mooncake_line(0) + mooncake_line(1000))  # 1 s apart
    args = [*QUICK, "--trace", str(trace), "--policies", "random", "--out", str(tmp_path / "o")]
    assert main([*args, "--rate-scale", "1e-9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"epp-sim: --rate-scale 1e-09 stretches the arrivals of {trace} from 1 s to 1e+09 s: "
    )
    assert err.rstrip().endswith("give a --rate-scale of at least 1e-08")
    assert main([*args, "--rate-scale", "5e-324"]) == 2
    assert "to beyond any finite number of seconds" in capsys.readouterr().err


def test_the_least_rate_scale_suggested_is_enough() -> None:
    trace = [TraceRequest(0.0, None, 1), TraceRequest(123456.789, None, 1)]  # type: ignore[arg-type]
    message = scaled_span_error(trace, 1e-5, "t")
    assert message is not None
    least = float(message.rsplit(" ", 1)[1])
    assert scaled_span_error(trace, least, "t") is None and least == 1.24e-3


def test_a_synthetic_rate_too_low_names_the_rate(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], nothing_runs: None
) -> None:
    assert main([*QUICK, "--rate", "1e-9", "--policies", "random", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epp-sim: synthetic:shared-prefix: generated request ")
    assert "a trace may span; raise --rate (1e-09 per s)" in err


def test_a_trace_months_long_within_the_bound_runs_quickly(tmp_path: pathlib.Path) -> None:
    """Two requests ~3 months apart: accepted, and the idle gap's scrapes are skipped (no 1.6e8 rounds)."""
    trace = tmp_path / "months.jsonl"
    trace.write_text(mooncake_line(0) + mooncake_line(8e9, (2,)))
    out = tmp_path / "o"
    assert main([*QUICK, "--trace", str(trace), "--policies", "ttft,random", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "records-ttft.jsonl").read_text().splitlines()]
    assert [(r["status"], r["arrival_s"]) for r in records] == [("completed", 0.0), ("completed", 8e6)]
    assert set(json.loads((out / "summary.json").read_text())["policies"]) == {"ttft", "random"}


def test_a_scrape_interval_below_a_millisecond_is_refused_by_the_cluster_too() -> None:
    """The CLI refuses `--scrape-interval 1e-9` (test_sim_replay); a `ClusterConfig` built in code does too,
    before any engine exists: one that short would not move the clock past ~2^24 s and never end."""
    with pytest.raises(ValueError, match=r"scrape interval must be at least 1 ms, got 1e-09 s"):
        ClusterConfig(pods=1, scrape_interval=1e-9).check()
    ClusterConfig(pods=1, scrape_interval=MIN_SCRAPE_INTERVAL).check()  # the floor itself is fine
