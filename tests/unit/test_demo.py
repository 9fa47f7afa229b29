"""`epp demo`'s pure parts: workloads, figures, the report, and its flags."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import pytest

from epp.demo.client import _Stream
from epp.demo.report import TurnResult, comparison, figures, quantile, table
from epp.demo.runner import DEFAULT_POLICY, add_arguments, options, policy_config
from epp.demo.workload import WorkloadSpec, build_sessions, messages


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_same_seed_same_sessions_other_seed_other_text() -> None:
    spec = WorkloadSpec(duration_s=5, rate=4)
    a, b = build_sessions(spec, 3), build_sessions(spec, 3)
    assert a == b
    c = build_sessions(spec, 4)
    assert [s.questions for s in a] != [s.questions for s in c]


def test_sessions_start_in_order_within_the_duration() -> None:
    sessions = build_sessions(WorkloadSpec(duration_s=10, rate=5), 1)
    starts = [s.start_s for s in sessions]
    assert starts == sorted(starts)
    assert starts[0] > 0 and starts[-1] < 10


def test_shared_prefix_sessions_share_their_groups_system_prompt() -> None:
    spec = WorkloadSpec(kind="shared-prefix", duration_s=20, rate=5, groups=3)
    sessions = build_sessions(spec, 1)
    groups: dict[str, set[str]] = {}
    for s in sessions:
        assert len(s.questions) == 1
        groups.setdefault(s.session_id.rsplit("-", 1)[0], set()).add(s.system)
    assert len(groups) == 3
    assert all(len(systems) == 1 for systems in groups.values())
    assert len({s.questions[0] for s in sessions}) == len(sessions)


def test_mixed_alternates_kinds_and_multi_turn_has_the_turns() -> None:
    sessions = build_sessions(WorkloadSpec(kind="mixed", duration_s=10, rate=4, turns=3), 2)
    kinds = [s.kind for s in sessions]
    assert kinds[:4] == ["shared-prefix", "multi-turn", "shared-prefix", "multi-turn"]
    assert all(len(s.questions) == 3 for s in sessions if s.kind == "multi-turn")


def test_messages_resend_the_conversation_with_the_answers() -> None:
    s = next(x for x in build_sessions(WorkloadSpec(kind="multi-turn", duration_s=2, rate=5), 1))
    first = messages(s, [])
    assert [m["role"] for m in first] == ["system", "user"]
    third = messages(s, ["answer one", "answer two"])
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert third[2]["content"] == "answer one" and third[5]["content"] == s.questions[2]
    assert third[:2] == first  # each turn extends the previous prompt: the prefix a pod already holds
    with pytest.raises(ValueError, match="has 4 turns, asked for 5"):
        messages(s, ["a"] * 4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rate": 0}, "rate must be > 0"),
        ({"duration_s": -1}, "duration_s must be > 0"),
        ({"think_s": -0.1}, "think_s must be >= 0"),
        ({"kind": "bursty"}, "workload must be one of"),
        ({"duration_s": 1e6, "rate": 10}, "at most 100000"),
    ],
)
def test_bad_workload_is_refused_by_name(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_sessions(replace(WorkloadSpec(), **change), 1)  # type: ignore[arg-type]


def _ok(ttft: float, prompt: int = 100, cached: int = 0) -> TurnResult:
    return TurnResult("s", "shared-prefix", 0, 200, ttft, ttft * 2, prompt, cached)


def test_figures_count_errors_and_take_hit_rate_from_usage() -> None:
    results = [
        _ok(0.1, 100, 50),
        _ok(0.3, 300, 0),
        TurnResult("s", "multi-turn", 1, 503, None, 0.01, 0, 0, "x"),
    ]
    f = figures("ttft", results, {"b:2": 1, "a:1": 2})
    assert (f.requests, f.errors) == (3, 1)
    assert f.token_hit_rate == pytest.approx(50 / 400)
    assert f.ttft_p50_s == pytest.approx(0.2) and f.ttft_mean_s == pytest.approx(0.2)
    assert list(f.per_pod) == ["a:1", "b:2"]
    assert f.as_json()["requests_per_pod"] == {"a:1": 2, "b:2": 1}


def test_a_200_without_usage_counts_as_an_error() -> None:
    r = TurnResult("s", "shared-prefix", 0, 200, 0.1, 0.2, 0, 0, "no usage in the stream")
    assert not r.ok
    assert figures("p", [r], {}).errors == 1


def test_quantile_interpolates_and_is_nan_for_nothing() -> None:
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert quantile([5.0], 0.99) == 5.0
    assert math.isnan(quantile([], 0.5))


def test_table_and_comparison_show_every_policy() -> None:
    fast = figures("default", [_ok(0.05, 100, 90)], {"a:1": 1})
    slow = figures("round-robin", [_ok(0.2, 100, 10)], {"a:1": 1})
    text = table([fast, slow])
    assert "default" in text and "round-robin" in text and "90.0%" in text and "50 ms" in text
    line = comparison(fast, slow)
    assert "TTFT p50 4.00x lower" in line and "+80.0 points" in line
    assert "HIGHER" in comparison(slow, fast)


def test_stream_parser_takes_first_content_and_usage() -> None:
    s = _Stream()
    s.feed(b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n', 1.0)
    s.feed(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n', 2.0)
    s.feed(b'data: {"choices": [{"delta": {"content": " there"}}]}\n', 3.0)
    s.feed(b'data: {"choices": [], "usage": {"prompt_tokens": 7}}\n', 4.0)
    s.feed(b"data: [DONE]\n", 5.0)
    assert s.first_content == 2.0 and "".join(s.text) == "hi there" and s.usage == {"prompt_tokens": 7}


def test_policies_resolve_to_configs() -> None:
    assert policy_config(DEFAULT_POLICY) is None
    rr = policy_config("round-robin")
    assert rr is not None and rr.name == "round-robin.yaml"
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        policy_config("fastest")


def test_flags_become_options() -> None:
    o = options(
        _parse("--pods", "3", "--workload", "shared-prefix", "--duration", "5", "--policies", "default")
    )
    assert (o.pods, o.workload.kind, o.workload.duration_s, o.policies) == (
        3,
        "shared-prefix",
        5.0,
        ("default",),
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pods", "0"], "--pods must be in 1..64"),
        (["--gpu-blocks", "1"], "--gpu-blocks must be >= 2"),
        (["--policies", ","], "name at least one policy"),
        (["--policies", "default,nope"], "unknown policy 'nope'"),
        (["--engines", "10.0.0.1"], "is not ip:port"),
        (["--engines", "10.0.0.1:8000"], "--engines needs --tokenizer"),
        (["--rate", "0"], "rate must be > 0"),
    ],
)
def test_bad_flags_are_refused_by_name(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        options(_parse(*argv))
