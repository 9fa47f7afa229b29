"""The decision log behind /debug/decisions and the x-epp-decision header."""

from __future__ import annotations

import pytest

from epp.server.decisions import DECISION_HEADER, DecisionLog, header_value
from epp.testing.fakes import chat_request
from epp.types import Decision, InferenceRequest, PrefillWork, RankTerms, TtftEstimate


def est(
    queue: float, prefill: float, *, reload: float = 0.0, decode: float = 0.0, cached: int = 0
) -> TtftEstimate:
    return TtftEstimate(
        queue_s=queue,
        prefill_s=prefill,
        reload_s=reload,
        decode_s=decode,
        prompt_tokens=1000,
        cached_tokens=cached,
        reloaded_tokens=0,
        work=PrefillWork(1, 1000 - cached, 0.0),
    )


def decision(winner: str = "b:1", mode: str = "cache-aware") -> Decision:
    return Decision(
        endpoints=(winner,),
        profile="default",
        reason="scored",
        scores={"a:1": 0.25, "b:1": 1.0, "c:1": 0.5},
        mode=mode,
        estimates={
            "a:1": est(0.3, 0.1),
            "b:1": est(0.0, 0.1, reload=0.01, cached=900),
            "c:1": est(0.1, 0.1, decode=0.0123456789),
        },
    )


def request(i: int, model: str = "m", priority: int = 0) -> InferenceRequest:
    return chat_request("hi", request_id=f"r-{i}", model=model, priority=priority)


def test_render_lists_the_newest_first_and_respects_the_limit() -> None:
    log = DecisionLog(keep=10)
    for i in range(5):
        log.add(100.0 + i, request(i), decision())
    out = log.render(3, now=110.0)
    assert [d["request_id"] for d in out["decisions"]] == ["r-4", "r-3", "r-2"]
    assert [d["age_s"] for d in out["decisions"]] == [6.0, 7.0, 8.0]
    assert (out["kept"], out["capacity"]) == (5, 10)
    assert [d["request_id"] for d in log.render(100, 110.0)["decisions"]] == [
        f"r-{i}" for i in range(4, -1, -1)
    ]
    assert log.render(0, 110.0)["decisions"] == []


def test_the_ring_buffer_keeps_only_the_last_n() -> None:
    log = DecisionLog(keep=3)
    for i in range(7):
        log.add(float(i), request(i), decision())
    assert len(log) == 3
    out = log.render(10, 7.0)
    assert [d["request_id"] for d in out["decisions"]] == ["r-6", "r-5", "r-4"]
    assert out["kept"] == 3


def test_keep_zero_records_nothing() -> None:
    log = DecisionLog(keep=0)
    log.add(1.0, request(1), decision())
    assert len(log) == 0
    assert log.render(10, 2.0) == {"kept": 0, "capacity": 0, "decisions": []}


def test_each_decision_shows_every_candidates_terms_sorted_by_ttft() -> None:
    log = DecisionLog()
    calibration = {"prefill_scale": 0.8, "queue_scale": 1.1}
    log.add(1.0, request(1, model="llama", priority=-1), decision(), calibration)
    (d,) = log.render(1, 2.0)["decisions"]
    assert d["model"] == "llama"
    assert d["priority"] == -1
    assert (d["profile"], d["mode"], d["winner"], d["endpoints"]) == (
        "default",
        "cache-aware",
        "b:1",
        ["b:1"],
    )
    assert d["calibration"] == {"prefill_scale": 0.8, "queue_scale": 1.1}
    cands = d["candidates"]
    assert [c["endpoint"] for c in cands] == ["b:1", "c:1", "a:1"]  # by estimated TTFT
    ttfts = [c["ttft_s"] for c in cands]
    assert ttfts == sorted(ttfts)
    b = cands[0]
    assert b["score"] == 1.0
    assert b["ttft_s"] == pytest.approx(0.11)
    assert (b["queue_s"], b["prefill_s"], b["reload_s"], b["decode_s"]) == (0.0, 0.1, 0.01, 0.0)
    assert (b["prompt_tokens"], b["cached_tokens"], b["reloaded_tokens"]) == (1000, 900, 0)
    assert cands[1]["decode_s"] == 0.012346  # rounded to the microsecond
    assert d["calibration"] is not calibration


def test_a_decision_without_estimates_lists_candidates_by_score() -> None:
    log = DecisionLog()
    plain = Decision(endpoints=("a:1",), profile="p", reason="scored", scores={"b:1": 0.5, "a:1": 0.9})
    log.add(1.0, request(1), plain)
    (d,) = log.render(5, 1.0)["decisions"]
    assert d["candidates"] == [{"endpoint": "a:1", "score": 0.9}, {"endpoint": "b:1", "score": 0.5}]
    assert d["mode"] == ""
    assert d["calibration"] == {}


def test_header_value_has_the_winners_terms() -> None:
    d = decision()
    assert DECISION_HEADER == "x-epp-decision"
    assert header_value(d) == (
        "endpoint=b:1; profile=default; mode=cache-aware; ttft=0.1100; queue=0.0000; prefill=0.1000; "
        "reload=0.0100; decode=0.0000; cached_tokens=900; prompt_tokens=1000"
    )


def test_header_value_without_mode_or_estimate() -> None:
    d = Decision(endpoints=("a:1", "b:1"), profile="p", reason="scored")
    assert header_value(d) == "endpoint=a:1; profile=p"
    assert header_value(decision(winner="a:1", mode="")).startswith(
        "endpoint=a:1; profile=default; ttft=0.4000;"
    )


def test_the_ranking_terms_explain_a_winner_with_a_larger_ttft() -> None:
    """The ttft-scorer charged c for copying a prefix and ranked a and b as near-ties: the explanation
    and the header say so, next to the estimates."""
    d = Decision(
        endpoints=("a:1",),
        profile="default",
        reason="scored",
        scores={"a:1": 1.0, "b:1": 0.99, "c:1": 0.4},
        estimates={"a:1": est(0.3, 0.1), "b:1": est(0.3, 0.1), "c:1": est(0.0, 0.2)},
        ranking=RankTerms(("a:1", "b:1", "c:1"), [0.0, 0.0, 0.5], [True, True, False]),
    )
    log = DecisionLog()
    log.add(1.0, request(1), d)
    cands = {c["endpoint"]: c for c in log.render(1, 1.0)["decisions"][0]["candidates"]}
    assert (cands["c:1"]["copy_charge_s"], cands["c:1"]["near_tie"]) == (0.5, False)
    assert (cands["a:1"]["copy_charge_s"], cands["a:1"]["near_tie"]) == (0.0, True)
    assert cands["c:1"]["ttft_s"] < cands["a:1"]["ttft_s"]
    assert header_value(d).endswith("; near_ties=2; copy_charged=1")
    uncharged = Decision(
        endpoints=("a:1",),
        profile="p",
        reason="scored",
        ranking=RankTerms(("a:1", "b:1"), None, [True, False]),
    )
    assert "near_ties" not in header_value(uncharged) and "copy_charged" not in header_value(uncharged)
    assert RankTerms(("a:1",), None, [True]).of("z:1") is None


def test_ranking_terms_of_every_candidate_at_once_match_one_by_one() -> None:
    rank = RankTerms(("a:1", "b:1", "c:1"), [0.0, 0.25, 0.0], [True, False, True])
    every = rank.by_endpoint()
    assert every == {ep: rank.of(ep) for ep in rank.ids}
    assert every["b:1"] == (0.25, False)
    assert RankTerms(("a:1",), None, [False]).by_endpoint() == {"a:1": (0.0, False)}
