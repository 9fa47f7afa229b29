"""Traces: Mooncake JSONL, Azure CSV and the synthetic generators; bad input names file and line."""

from __future__ import annotations

import itertools
import pathlib
import random

import numpy as np
import pytest

from simulator.traces import (
    MOONCAKE_BLOCK,
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
