"""Traces: Mooncake JSONL, Azure CSV and the synthetic generators; bad input names file and line."""

from __future__ import annotations

import itertools
import json
import pathlib
import random

import numpy as np
import pytest

from simulator.traces import (
    MOONCAKE_BLOCK,
    TokenSource,
    TraceError,
    agentic,
    arrivals,
    multi_turn,
    read_azure,
    read_mooncake,
    scale_rate,
    shared_prefix,
)

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def test_mooncake_hash_ids_become_shared_token_prefixes() -> None:
    trace = read_mooncake((DATA / "mooncake_sample.jsonl").read_text(), "sample.jsonl")
    assert [r.arrival for r in trace] == [0.0, 0.1, 0.25, 0.9]  # sorted, in seconds
    first, other, second, single = trace
    assert [len(r.prompt) for r in trace] == [1100, 600, 1536, 512]
    assert [r.output_tokens for r in trace] == [20, 5, 10, 1]
    # [1, 2, 3] and [1, 2, 4] share exactly two 512-token blocks; [1] is the first block of both
    assert common_prefix(first.prompt, second.prompt) == 2 * MOONCAKE_BLOCK
    assert np.array_equal(single.prompt, first.prompt[:MOONCAKE_BLOCK])
    assert common_prefix(first.prompt, other.prompt) < 5
    # the same file and seed give the same tokens; another seed other tokens
    again = read_mooncake((DATA / "mooncake_sample.jsonl").read_text(), "sample.jsonl")
    assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(trace, again, strict=True))
    reseeded = read_mooncake((DATA / "mooncake_sample.jsonl").read_text(), "sample.jsonl", seed=1)
    assert not np.array_equal(reseeded[0].prompt, first.prompt)


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}', "input_length"),
        ('{"timestamp": 0, "input_length": 10, "output_length": "5", "hash_ids": [1]}', "output_length"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1.5]}', "hash_ids"),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
            "does not fit 1 blocks",
        ),
        ('{"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [1, 2]}', "does not fit 2"),
    ],
)
def test_bad_mooncake_lines_name_the_line(line: str, fragment: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    with pytest.raises(TraceError) as err:
        read_mooncake(f"{good}\n\n{line}\n", "t.jsonl")
    assert str(err.value).startswith("t.jsonl:3: ") and fragment in str(err.value)


def test_an_empty_trace_is_an_error() -> None:
    with pytest.raises(TraceError, match="no requests"):
        read_mooncake("\n\n", "empty.jsonl")


def test_azure_csv_gives_arrivals_and_unique_prompts() -> None:
    trace = read_azure((DATA / "azure_sample.csv").read_text(), "azure.csv")
    assert [len(r.prompt) for r in trace] == [374, 396, 879]
    assert [r.output_tokens for r in trace] == [44, 109, 46]
    assert trace[0].arrival == 0.0
    assert trace[1].arrival == pytest.approx(4.314579)
    assert common_prefix(trace[0].prompt, trace[1].prompt) < 5  # no reuse in this trace


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("A,B\n1,2\n", 1, "header must name"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,1,1\n\n\n5,x,1\n", 5, "must be integers"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nnan,1,1\n", 2, "not a finite number"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n", 2, "not seconds or an ISO"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,1,1\n1,x,1\n", 3, "must be integers"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,0,1\n", 2, ">= 1"),
    ],
)
def test_bad_azure_rows_name_the_line(text: str, line: int, fragment: str) -> None:
    with pytest.raises(TraceError) as err:
        read_azure(text, "a.csv")
    assert str(err.value).startswith(f"a.csv:{line}: ") and fragment in str(err.value)


def test_shared_prefix_groups_share_exactly_their_system_prompt() -> None:
    trace = shared_prefix(4, 5, system_tokens=600, question_tokens=120, output_tokens=10, rate=50, seed=2)
    assert len(trace) == 20 and all(len(r.prompt) == 720 for r in trace)
    by_group: dict[str, list[np.ndarray]] = {}
    for r in trace:
        by_group.setdefault(r.session, []).append(r.prompt)
    assert len(by_group) == 4 and all(len(v) == 5 for v in by_group.values())
    for prompts in by_group.values():
        assert all(common_prefix(prompts[0], p) >= 600 for p in prompts[1:])
        assert all(common_prefix(prompts[0], p) < 605 for p in prompts[1:])
    groups = list(by_group.values())
    assert common_prefix(groups[0][0], groups[1][0]) < 5
    assert [r.arrival for r in trace] == sorted(r.arrival for r in trace)
    same = shared_prefix(4, 5, 600, 120, 10, rate=50, seed=2)
    assert [r.arrival for r in same] == [r.arrival for r in trace]


def test_multi_turn_resends_the_conversation() -> None:
    trace = multi_turn(
        sessions=3, turns=4, system_tokens=100, user_tokens=20, output_tokens=30, rate=1.0, seed=1
    )
    s0 = [r for r in trace if r.session == "session-0"]
    assert [len(r.prompt) for r in s0] == [120, 170, 220, 270]
    for earlier, later in itertools.pairwise(s0):
        assert np.array_equal(later.prompt[: len(earlier.prompt)], earlier.prompt)
        assert later.arrival >= earlier.arrival


def test_agentic_context_grows_by_output_and_tool_result() -> None:
    trace = agentic(
        loops=2, steps=3, system_tokens=50, task_tokens=10, tool_tokens=40, output_tokens=5, rate=1.0
    )
    a0 = [r for r in trace if r.session == "agent-0"]
    assert [len(r.prompt) for r in a0] == [60, 105, 150]
    assert np.array_equal(a0[2].prompt[:105], a0[1].prompt)


def test_arrival_processes_and_rate_scale() -> None:
    rng = random.Random(0)
    poisson = arrivals(4000, 20.0, rng)
    assert 4000 / poisson[-1] == pytest.approx(20.0, rel=0.1)
    gaps = np.diff([0.0, *arrivals(4000, 20.0, random.Random(1), "gamma", cv=3.0)])
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.2)
    trace = shared_prefix(2, 2, 10, 10, 1, rate=1.0)
    faster = scale_rate(trace, 4.0)
    assert [r.arrival for r in faster] == pytest.approx([r.arrival / 4 for r in trace])
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="rate scale"):
            scale_rate(trace, bad)
    with pytest.raises(ValueError, match="rate must be"):
        arrivals(3, 0.0, rng)
    with pytest.raises(ValueError, match="poisson or gamma"):
        arrivals(3, 1.0, rng, "uniform")


def test_azure_rows_out_of_time_order_and_a_bom_are_fine() -> None:
    text = "\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n10,5,1\n4,6,1\n7,7,1\n"
    trace = read_azure(text, "a.csv")
    assert [(r.arrival, len(r.prompt)) for r in trace] == [(0.0, 6), (3.0, 7), (6.0, 5)]


@pytest.mark.parametrize("kind", ["multi-turn", "agentic"])
def test_sessions_and_loops_start_at_the_chosen_arrival_process(kind: str) -> None:
    def make(**arrival: object) -> list:  # type: ignore[type-arg]
        if kind == "multi-turn":
            return multi_turn(200, 2, 20, 10, 5, rate=4.0, seed=3, **arrival)  # type: ignore[arg-type]
        return agentic(200, 2, 20, 10, 10, 5, rate=4.0, seed=3, **arrival)  # type: ignore[arg-type]

    def starts(trace: list) -> list[float]:  # type: ignore[type-arg]
        first: dict[str, float] = {}
        for r in trace:
            first.setdefault(r.session, r.arrival)
        return sorted(first.values())

    gamma = starts(make(process="gamma", cv=3.0))
    assert gamma == pytest.approx(arrivals(200, 4.0, random.Random(3), "gamma", cv=3.0))
    assert starts(make()) == pytest.approx(arrivals(200, 4.0, random.Random(3)))  # Poisson by default
    with pytest.raises(ValueError, match="poisson or gamma"):
        make(process="uniform")
    with pytest.raises(ValueError, match="cv must be a finite number > 0"):
        make(process="gamma", cv=0.0)


def test_a_bad_gamma_cv_is_refused_before_any_arrival() -> None:
    for cv in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="cv must be a finite number > 0"):
            arrivals(1, 1.0, random.Random(0), "gamma", cv=cv)
    with pytest.raises(ValueError, match="poisson or gamma"):
        arrivals(0, 1.0, random.Random(0), "uniform")


def mooncake_line(ts: object, n_in: int = 100, n_out: int = 10, ids: object = (1,)) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": list(ids)})  # type: ignore[call-overload]


def test_mooncake_epoch_timestamps_start_at_zero() -> None:
    """Absolute (epoch ms) timestamps become seconds from the first request, as Azure's do."""
    text = "".join(
        mooncake_line(ts) + "\n" for ts in (1_700_000_000_500, 1_700_000_000_000, 1_700_000_002_000)
    )
    trace = read_mooncake(text, "epoch.jsonl")
    assert [r.arrival for r in trace] == [0.0, 0.5, 2.0]
    assert [r.index for r in trace] == [0, 1, 2]
    relative = read_mooncake("".join(mooncake_line(ts) + "\n" for ts in (500, 0, 2000)), "rel.jsonl")
    assert [r.arrival for r in relative] == [r.arrival for r in trace]
    later = read_mooncake(mooncake_line(3000) + "\n" + mooncake_line(4000) + "\n", "late.jsonl")
    assert [r.arrival for r in later] == [0.0, 1.0]  # a trace starting late starts at 0 too


def test_a_byte_order_mark_before_a_mooncake_trace_is_skipped() -> None:
    body = mooncake_line(0) + "\n" + mooncake_line(5, n_in=600, ids=[1, 2]) + "\n"
    with_bom = read_mooncake("\ufeff" + body, "bom.jsonl")
    plain = read_mooncake(body, "bom.jsonl")
    assert [(r.arrival, r.output_tokens) for r in with_bom] == [(0.0, 10), (0.005, 10)]
    assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(with_bom, plain, strict=True))
    with pytest.raises(TraceError) as err:  # line numbers are unchanged
        read_mooncake("\ufeff" + mooncake_line(0) + "\nnot json\n", "bom.jsonl")
    assert str(err.value).startswith("bom.jsonl:2: not JSON")


@pytest.mark.parametrize(
    "ts",
    [10**400, -(10**400), 1e308 * 10, float("nan"), True, "0"],
    ids=["huge", "-huge", "inf", "nan", "bool", "str"],
)
def test_a_mooncake_timestamp_that_is_no_finite_number_names_the_line(ts: object) -> None:
    with pytest.raises(TraceError) as err:
        read_mooncake(mooncake_line(0) + "\n" + mooncake_line(ts) + "\n", "t.jsonl")
    message = str(err.value)
    assert message.startswith("t.jsonl:2: 'timestamp' must be a finite number of ms >= 0, got ")
    assert len(message) < 120  # a 401-digit number is shortened


def test_requests_that_do_not_fit_are_refused_before_their_tokens_are_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[int, int]] = []

    def fits(prompt: int, output: int) -> str | None:
        asked.append((prompt, output))
        return "too big" if prompt + output - 1 > 1000 else None

    built: list[int] = []
    real = TokenSource.tokens

    def tokens(self: TokenSource, kind: str, content_id: int, length: int) -> np.ndarray:
        built.append(length)
        return real(self, kind, content_id, length)

    monkeypatch.setattr(TokenSource, "tokens", tokens)
    head = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    with pytest.raises(TraceError) as err:
        read_azure(f"{head}0,100,10\n1,10000000000000,10\n", "a.csv", fits=fits)
    assert str(err.value) == "a.csv:3: too big"
    assert asked == [(100, 10), (10**13, 10)] and built == [100]  # never 10^13 tokens
    assert [len(r.prompt) for r in read_azure(f"{head}0,991,10\n", "a.csv", fits=fits)] == [991]
    built.clear()
    with pytest.raises(TraceError) as err:
        read_mooncake(
            mooncake_line(0) + "\n" + mooncake_line(1, 1000, 2, [1, 2]) + "\n", "m.jsonl", fits=fits
        )
    assert str(err.value) == "m.jsonl:2: too big" and built == [MOONCAKE_BLOCK]
    assert len(read_mooncake(mooncake_line(0, 1000, 1, [1, 2]), "m.jsonl", fits=fits)[0].prompt) == 1000


def test_azure_iso_timestamps_keep_their_utc_offset() -> None:
    head = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    rows = [
        "2023-11-16T18:15:46.12+05:30",  # 12:45:46.12 UTC
        "2023-11-16 12:45:47.1234567+00:00",  # 7 fractional digits and an offset
        "2023-11-16T12:45:48Z",
        "2023-11-16T13:45:49.5+01:00",  # 12:45:49.5 UTC
    ]
    trace = read_azure(head + "".join(f"{t},5,1\n" for t in rows), "tz.csv")
    assert [r.arrival for r in trace] == pytest.approx([0.0, 1.003456, 1.88, 3.38], abs=1e-6)
    naive = ["2023-11-16 18:15:46.6805900", "2023-11-16 18:15:47.68059001", "2023-11-16T18:15:49"]
    trace = read_azure(head + "".join(f"{t},5,1\n" for t in naive), "naive.csv")
    assert [r.arrival for r in trace] == pytest.approx([0.0, 1.0, 2.31941], abs=1e-6)


@pytest.mark.parametrize(
    ("first", "second", "fragment"),
    [
        (
            "2023-11-16 18:15:46",
            "2023-11-16 18:15:47+00:00",
            "with a UTC offset but line 2's is a date-time without",
        ),
        (
            "2023-11-16T18:15:46Z",
            "2023-11-16 18:15:47",
            "without a UTC offset but line 2's is a date-time with",
        ),
        ("12.5", "2023-11-16 18:15:47", "without a UTC offset but line 2's is a number of seconds"),
    ],
)
def test_azure_timestamps_of_mixed_kinds_name_the_line(first: str, second: str, fragment: str) -> None:
    text = f"TIMESTAMP,ContextTokens,GeneratedTokens\n{first},5,1\n{second},5,1\n"
    with pytest.raises(TraceError) as err:
        read_azure(text, "mixed.csv")
    assert str(err.value).startswith("mixed.csv:3: TIMESTAMP is a ") and fragment in str(err.value)


def test_azure_timestamps_too_far_apart_name_the_line() -> None:
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n0,5,1\n1e308,5,1\n-1e308,5,1\n"
    with pytest.raises(TraceError) as err:
        read_azure(text, "far.csv")
    message = str(err.value)
    assert message.startswith("far.csv:3: TIMESTAMP 1e+308 s is too far after the earliest one")
    assert "line 4" in message
