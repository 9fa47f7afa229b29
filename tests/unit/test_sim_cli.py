"""`epp-sim replay`'s flags and what it reports: rejected requests, arrival processes, policies checked
before anything runs, bad values named, and the run's metadata."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import pytest

from simulator import cli, replay, report
from simulator.cli import main
from simulator.traces import agentic, multi_turn, shared_prefix

REPO = pathlib.Path(cli.__file__).resolve().parents[1]
DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
QUICK = ["replay", "--no-progress", "--jobs", "1", "--pods", "1", "--num-gpu-blocks", "1024"]

BAD_POLICY = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: no-such-plugin
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: no-such-plugin
"""


def summary(out: pathlib.Path) -> dict:  # type: ignore[type-arg]
    return json.loads((out / "summary.json").read_text())  # type: ignore[no-any-return]


def test_a_policy_that_rejects_everything_is_reported_and_the_others_still_are(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ttft's staleness filter refuses metrics scraped 1,000 s apart: every request is rejected. (The
    command refuses that setting before running, as `epp serve` does: tests/unit/test_sim_bad_inputs.py;
    the check is switched off here to reach the reporting of rejections.)"""
    monkeypatch.setattr(replay, "check_staleness_filters", lambda *_args, **_kwargs: None)
    out = tmp_path / "out"
    args = ["--requests", "10", "--rate", "0.1", "--scrape-interval", "1000", "--out", str(out)]
    assert main([*QUICK, *args, "--policies", "ttft,random"]) == 0
    doc = summary(out)["policies"]
    assert (doc["ttft"]["requests"], doc["ttft"]["rejected_requests"], doc["ttft"]["rejected_rate"]) == (
        0,
        10,
        1,
    )
    assert doc["ttft"]["ttft_p99_s"] is None and doc["ttft"]["token_hit_rate"] is None
    assert (doc["random"]["requests"], doc["random"]["rejected_requests"]) == (10, 0)
    lines = [json.loads(line) for line in (out / "records-ttft.jsonl").read_text().splitlines()]
    assert len(lines) == 10 and {(d["status"], d["pod"], d["ttft_s"]) for d in lines} == {
        ("rejected", None, None)
    }
    printed = capsys.readouterr().out
    assert "rejected" in printed.splitlines()[0]  # the table's column
    assert "ttft rejected all 10 requests" in printed

    assert main([*QUICK, *args, "--policies", "ttft", "--out", str(tmp_path / "all")]) == 1
    assert "no policy completed any request: ttft rejected all 10 requests" in capsys.readouterr().err
    assert summary(tmp_path / "all")["policies"]["ttft"]["rejected_requests"] == 10  # still written


def test_a_policy_file_that_does_not_build_fails_before_anything_runs(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It parses (so reading it is not enough) but names a plugin type that does not exist."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_POLICY)

    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a simulation started")

    monkeypatch.setattr(cli, "replay_parallel", never)
    out = tmp_path / "out"
    assert (
        main(["replay", "--no-progress", "--jobs", "2", "--policies", f"random,{bad}", "--out", str(out)])
        == 2
    )
    err = capsys.readouterr().err
    assert f"<policy {bad}>: plugin 'no-such-plugin'" in err and "unknown plugin type" in err
    assert "worker" not in err and not (out / "summary.json").exists()


@pytest.mark.parametrize("workload", ["shared-prefix", "multi-turn", "agentic"])
def test_arrivals_gamma_drives_every_synthetic_workload(tmp_path: pathlib.Path, workload: str) -> None:
    out = tmp_path / "out"
    args = [
        "--workload",
        workload,
        "--requests",
        "12",
        "--rate",
        "2",
        "--policies",
        "random",
        "--out",
        str(out),
    ]
    assert main([*QUICK, *args, "--arrivals", "gamma", "--arrival-cv", "3"]) == 0
    got = [json.loads(line)["arrival_s"] for line in (out / "records-random.jsonl").read_text().splitlines()]
    if workload == "shared-prefix":
        want = shared_prefix(2, 5, 2000, 400, 100, 2.0, 1, "gamma", 3.0)
    elif workload == "multi-turn":
        want = multi_turn(2, 5, 600, 150, 150, 0.4, seed=1, process="gamma", cv=3.0)
    else:
        want = agentic(2, 6, 1500, 200, 300, 100, 2 / 6, seed=1, process="gamma", cv=3.0)
    assert got == [r.arrival for r in want]
    meta = summary(out)["meta"]
    assert (meta["arrivals"], meta["arrival_cv"]) == ("gamma", 3.0)
    assert main([*QUICK, *args, "--out", str(tmp_path / "poisson")]) == 0
    poisson = summary(tmp_path / "poisson")["meta"]
    assert (poisson["arrivals"], poisson["arrival_cv"]) == ("poisson", None)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--arrival-cv", "2"], "--arrival-cv needs --arrivals gamma"),
        (["--arrivals", "poisson", "--arrival-cv", "2"], "--arrival-cv needs --arrivals gamma"),
        (["--trace", str(DATA / "azure_sample.csv"), "--arrivals", "gamma"], "are for --workload"),
        (["--cpu-blocks", "-1"], "--cpu-blocks must be >= 0, got -1"),
        (["--max-num-seqs", "300", "--max-num-batched-tokens", "256"], "must be >= --max-num-seqs (300)"),
        (["--policies", "all,ttft"], "'all' cannot be combined with other policies"),
        (["--policies", "ttft,all"], "'all' cannot be combined with other policies"),
    ],
)
def test_bad_values_are_named(
    tmp_path: pathlib.Path, args: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*QUICK, "--requests", "10", "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err
    if "--cpu-blocks" in args:
        assert "--event-delay" not in err
    assert not (tmp_path / "o" / "summary.json").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--scrape-interval", "inf"], "--scrape-interval: must be a finite number > 0, got inf"),
        (["--scrape-interval", "0"], "--scrape-interval: must be a finite number > 0"),
        (["--rate", "inf"], "--rate: must be a finite number > 0"),
        (["--arrivals", "uniform"], "--arrivals: invalid choice: 'uniform'"),
        (["--cpu-write-policy", "lazy"], "--cpu-write-policy: invalid choice: 'lazy'"),
        (["--arrivals", "gamma", "--arrival-cv", "0"], "--arrival-cv: must be a finite number > 0"),
        (["--arrivals", "gamma", "--arrival-cv", "nan"], "--arrival-cv: must be a finite number > 0"),
        (["--arrivals", "gamma", "--arrival-cv", "inf"], "--arrival-cv: must be a finite number > 0"),
    ],
)
def test_bad_flag_values_are_refused_by_the_parser(
    args: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*QUICK, *args])
    assert exit_.value.code == 2
    assert fragment in capsys.readouterr().err


def test_meta_has_the_format_used_and_the_commit_of_the_simulator_s_repository(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    monkeypatch.chdir(tmp_path)  # not a repository: the commit comes from where the package lives
    for trace, fmt in (("azure_sample.csv", "azure"), ("mooncake_sample.jsonl", "mooncake")):
        out = tmp_path / fmt
        assert main([*QUICK, "--trace", str(DATA / trace), "--policies", "random", "--out", str(out)]) == 0
        meta = summary(out)["meta"]
        assert meta["trace_format"] == fmt  # inferred from the extension
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
    status = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True
    ).stdout
    assert (meta["commit"], meta["dirty"]) == (head.strip(), bool(status.strip()))


def test_without_git_the_commit_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_git(*_args: object, **_kwargs: object) -> None:
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert cli._commit() == ("unknown", None)


def test_engine_settings_reach_the_engines_and_the_meta(tmp_path: pathlib.Path) -> None:
    """A smaller step budget makes long prompts take more steps (a slower TTFT); a slower CPU link is
    recorded; both are in `meta`."""
    args = [*QUICK, "--requests", "20", "--policies", "random"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    small = ["--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--cpu-bandwidth", "2.5"]
    assert main([*args, *small, "--out", str(tmp_path / "b")]) == 0
    a, b = summary(tmp_path / "a"), summary(tmp_path / "b")
    assert b["meta"]["max_num_batched_tokens"] == 64 and b["meta"]["max_num_seqs"] == 8
    assert b["meta"]["cpu_bandwidth_gb_per_s"] == 2.5 and a["meta"]["cpu_bandwidth_gb_per_s"] is None
    assert b["policies"]["random"]["ttft_mean_s"] > a["policies"]["random"]["ttft_mean_s"]
    assert (a["meta"]["async_scheduling"], a["meta"]["cpu_write_policy"]) == (True, "write-through")
    other = ["--no-async-scheduling", "--cpu-write-policy", "write-back"]
    assert main([*args, *other, "--out", str(tmp_path / "c")]) == 0
    c = summary(tmp_path / "c")
    assert (c["meta"]["async_scheduling"], c["meta"]["cpu_write_policy"]) == (False, "write-back")
    assert c["policies"]["random"]["ttft_mean_s"] < a["policies"]["random"]["ttft_mean_s"]  # no step ahead


def mooncake(path: pathlib.Path, *rows: tuple[int, int, int]) -> pathlib.Path:
    """A Mooncake trace of (timestamp ms, input_length, output_length) rows, each in one 512-token block."""
    lines = [
        json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": [i]})
        for i, (ts, n_in, n_out) in enumerate(rows)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def never(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("a simulation started")


def test_an_epoch_mooncake_trace_starts_at_zero(tmp_path: pathlib.Path) -> None:
    """Epoch-ms arrivals would have the cluster scrape from t=0 for 54 years of simulated time first."""
    trace = mooncake(tmp_path / "epoch.jsonl", (1_700_000_000_000, 100, 5), (1_700_000_000_500, 100, 5))
    args = cli.build_parser().parse_args(["replay", "--trace", str(trace)])
    loaded, source, fmt = cli.load_trace(args)
    assert [r.arrival for r in loaded] == [0.0, 0.5] and (source, fmt) == (str(trace), "mooncake")


@pytest.mark.parametrize(
    ("name", "text", "line"),
    [
        (
            "bigts.jsonl",
            '{"timestamp": 1' + "0" * 400 + ', "input_length": 1, "output_length": 1, "hash_ids": [1]}\n',
            1,
        ),
        ("big.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,1\n1,10000000000000,10\n", 3),
        ("far.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1e308,10,1\n-1e308,10,1\n", 2),
        (
            "tz.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,1\n2023-11-16 18:15:47Z,10,1\n",
            3,
        ),
    ],
)
def test_huge_or_inconsistent_trace_values_are_named_before_anything_runs(
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    text: str,
    line: int,
) -> None:
    monkeypatch.setattr(cli, "replay_parallel", never)
    trace = tmp_path / name
    trace.write_text(text)
    out = tmp_path / "out"
    assert main([*QUICK, "--trace", str(trace), "--policies", "random", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"epp-sim: {trace}:{line}: ") and "Traceback" not in err
    assert not out.exists()


def test_the_oversized_request_message_does_the_arithmetic_it_prints(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2 blocks of 16, one of them vLLM's null block: 16 tokens, for the prompt and all output tokens but
    the last."""
    small = [*QUICK, "--num-gpu-blocks", "2", "--block-size", "16", "--policies", "random"]
    fits = mooncake(tmp_path / "fits.jsonl", (0, 10, 7))
    assert main([*small, "--trace", str(fits), "--out", str(tmp_path / "a")]) == 0
    assert summary(tmp_path / "a")["policies"]["random"]["requests"] == 1
    capsys.readouterr()
    big = mooncake(tmp_path / "big.jsonl", (0, 10, 7), (5, 10, 8))
    assert main([*small, "--trace", str(big), "--out", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err == (
        f"epp-sim: {big}:2: 10 prompt + 8 output tokens need 17 tokens of KV cache (10 + 8 - 1: the last "
        "output token is never stored); an engine holds 16 = (2 - 1) x 16 (--num-gpu-blocks less the "
        "reserved null block, x --block-size)\n"
    )
    assert main([*QUICK, "--requests", "10", "--num-gpu-blocks", "8", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "epp-sim: synthetic:shared-prefix: generated request 0 (in arrival order): 2400 prompt"
    )
    assert "+ 100 output tokens need 2499 tokens" in err and "holds 112 = (8 - 1) x 16" in err
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_an_unusable_out_stops_the_run_before_it_starts(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = mooncake(tmp_path / "one.jsonl", (0, 100, 5))
    run = [*QUICK, "--trace", str(trace), "--policies", "random,ttft"]
    monkeypatch.setattr(cli, "replay_parallel", never)
    out = tmp_path / "taken"
    (out / "records-ttft.jsonl").mkdir(parents=True)
    assert main([*run, "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"epp-sim: --out {out}: {out / 'records-ttft.jsonl'} is in the way: it exists and is not a file\n"
    )
    assert sorted(p.name for p in out.iterdir()) == ["records-ttft.jsonl"]  # nothing written or probed
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    assert main([*run, "--out", str(afile)]) == 2
    assert f"--out {afile}: cannot create the results directory" in capsys.readouterr().err
    assert afile.read_text() == "mine\n"

    def refused(*_args: object, **_kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(report.tempfile, "mkstemp", refused)  # (root may write anywhere)
    assert main([*run, "--out", str(tmp_path / "ro")]) == 2
    assert f"--out {tmp_path / 'ro'}: cannot write in the results directory: Permission denied" in (
        capsys.readouterr().err
    )


def test_the_probe_leaves_nothing_and_a_failed_write_loses_no_figures(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory is fine before the run, taken during it: exit 2 naming the file, the table printed."""
    trace = mooncake(tmp_path / "one.jsonl", (0, 100, 5), (10, 100, 5))
    out = tmp_path / "out"
    real = cli.replay_parallel

    def run_then_take(*args: object, **kwargs: object) -> object:
        assert sorted(p.name for p in out.iterdir()) == []  # the probe's file is gone
        result = real(*args, **kwargs)  # type: ignore[arg-type]
        (out / "records-random.jsonl").mkdir()
        return result

    monkeypatch.setattr(cli, "replay_parallel", run_then_take)
    assert main([*QUICK, "--trace", str(trace), "--policies", "random", "--out", str(out)]) == 2
    printed = capsys.readouterr()
    assert printed.err.startswith(f"epp-sim: --out {out}: cannot write {out / 'records-random.jsonl'}: ")
    assert "Traceback" not in printed.err
    row = printed.out.splitlines()[1].split()
    assert row[0] == "random" and row[-1] == "0" and float(row[1]) > 0  # the figures were printed


def test_a_reused_out_holds_only_this_run_s_records(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    run = [*QUICK, "--requests", "5", "--out", str(out)]
    assert main([*run, "--policies", "random,ttft"]) == 0
    (out / "notes.txt").write_text("mine\n")
    assert main([*run, "--policies", "round-robin"]) == 0
    assert sorted(p.name for p in out.glob("records-*")) == ["records-round-robin.jsonl"]
    assert (out / "notes.txt").read_text() == "mine\n"
    assert list(summary(out)["policies"]) == ["round-robin"]


def make_repo(root: pathlib.Path, *tracked: str) -> None:
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    for name in tracked:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x\n")
    subprocess.run([*git, "add", "--", *tracked], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)


def test_the_commit_is_that_of_the_simulator_s_own_checkout_only(tmp_path: pathlib.Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    own = tmp_path / "own"  # the package checked out at the top of its repository
    make_repo(own, "simulator/cli.py")
    head, dirty = cli._commit(own / "simulator")
    assert len(head) == 40 and dirty is False
    (own / "simulator" / "cli.py").write_text("changed\n")
    assert cli._commit(own / "simulator") == (head, True)

    enclosing = tmp_path / "user"  # installed (untracked) inside someone's repository
    make_repo(enclosing, "README")
    (enclosing / "site" / "simulator").mkdir(parents=True)
    (enclosing / "site" / "simulator" / "cli.py").write_text("x\n")
    assert cli._commit(enclosing / "site" / "simulator") == ("unknown", None)

    deeper = tmp_path / "deeper"  # tracked, but by a repository that is not the package's parent
    make_repo(deeper, "vendor/simulator/cli.py")
    assert cli._commit(deeper / "vendor" / "simulator") == ("unknown", None)

    untracked = tmp_path / "untracked"  # the right top, but cli.py is not tracked there
    make_repo(untracked, "README")
    (untracked / "simulator").mkdir()
    (untracked / "simulator" / "cli.py").write_text("x\n")
    assert cli._commit(untracked / "simulator") == ("unknown", None)
