"""Table-driven tests of the built-in filters, scorers and pickers."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from epp.scheduling.builtin import default_registry
from epp.scheduling.framework import CycleState, PluginHandle, ScoredEndpoint
from epp.testing.fakes import FakeClock, chat_request, endpoint

NOW = 1000.0


def make(type_name: str, params: dict[str, object] | None = None, seed: int = 0) -> object:
    handle = PluginHandle(clock=FakeClock(NOW), rng=random.Random(seed))
    return default_registry().create(type_name, type_name, params, handle)[1]


def state(seed: int = 0) -> CycleState:
    return CycleState(now=NOW, rng=random.Random(seed))


@pytest.mark.parametrize(
    ("type_name", "endpoints", "expected"),
    [
        ("queue-scorer", [endpoint("a:1", waiting=0), endpoint("b:1", waiting=10)], [1.0, 0.0]),
        (
            "queue-scorer",
            [endpoint("a:1", waiting=2), endpoint("b:1", waiting=4), endpoint("c:1", waiting=3)],
            [1.0, 0.0, 0.5],
        ),
        ("queue-scorer", [endpoint("a:1", waiting=3), endpoint("b:1", waiting=3)], [1.0, 1.0]),
        ("queue-scorer", [endpoint("a:1", waiting=1), endpoint("b:1", observed_at=None)], [1.0, 1.0]),
        (
            "kv-cache-utilization-scorer",
            [endpoint("a:1", kv_usage=0.25), endpoint("b:1", kv_usage=1.0)],
            [0.75, 0.0],
        ),
        ("kv-cache-utilization-scorer", [endpoint("a:1", observed_at=None)], [0.0]),
        (
            "running-requests-size-scorer",
            [endpoint("a:1", running=8), endpoint("b:1", running=0)],
            [0.0, 1.0],
        ),
        ("active-request-scorer", [endpoint("a:1", in_flight=4), endpoint("b:1", in_flight=2)], [0.0, 1.0]),
        (
            "token-load-scorer",
            [endpoint("a:1", in_flight_tokens=8192), endpoint("b:1", in_flight_tokens=40000)],
            [0.5, 0.0],
        ),
    ],
)
def test_scorers(type_name: str, endpoints: list, expected: list[float]) -> None:  # type: ignore[type-arg]
    scorer = make(type_name)
    assert list(scorer.score(state(), chat_request(), endpoints)) == pytest.approx(expected)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("max_age", "ages", "kept"),
    [
        ("2s", [0.0, 1.9, 2.5], ["e0:1", "e1:1"]),
        ("100ms", [0.05, 0.2, 0.0], ["e0:1", "e2:1"]),
        (0.5, [1.0, 2.0, 3.0], []),
    ],
)
def test_staleness_filter(max_age: object, ages: list[float], kept: list[str]) -> None:
    f = make("metrics-staleness-filter", {"maxAge": max_age})
    eps = [endpoint(f"e{i}:1", observed_at=NOW - a) for i, a in enumerate(ages)]
    assert [e.id for e in f.filter(state(), chat_request(), eps)] == kept  # type: ignore[attr-defined]


def test_staleness_filter_drops_never_scraped() -> None:
    f = make("metrics-staleness-filter")
    eps = [endpoint("a:1", observed_at=None), endpoint("b:1")]
    assert [e.id for e in f.filter(state(), chat_request(), eps)] == ["b:1"]  # type: ignore[attr-defined]


def scored(*pairs: tuple[str, float]) -> list[ScoredEndpoint]:
    return [ScoredEndpoint(endpoint(a), s) for a, s in pairs]


def test_max_score_picker_takes_the_best_and_fallbacks_in_order() -> None:
    picker = make("max-score-picker", {"maxNumOfEndpoints": 2})
    got = picker.pick(state(), chat_request(), scored(("a:1", 0.2), ("b:1", 0.9), ("c:1", 0.5)))  # type: ignore[attr-defined]
    assert got == ["b:1", "c:1"]


def test_max_score_picker_breaks_ties_at_random_but_reproducibly() -> None:
    picker = make("max-score-picker")
    cands = scored(("a:1", 1.0), ("b:1", 1.0), ("c:1", 1.0), ("d:1", 0.1))
    st = state(seed=7)
    picks = Counter(picker.pick(st, chat_request(), cands)[0] for _ in range(300))  # type: ignore[attr-defined]
    assert set(picks) == {"a:1", "b:1", "c:1"}
    st2 = state(seed=7)
    again = Counter(picker.pick(st2, chat_request(), cands)[0] for _ in range(300))  # type: ignore[attr-defined]
    assert picks == again


def test_random_picker_ignores_scores_and_respects_max() -> None:
    picker = make("random-picker", {"maxNumOfEndpoints": 3})
    st = state(seed=1)
    cands = scored(("a:1", 0.0), ("b:1", 0.0), ("c:1", 5.0), ("d:1", 0.0))
    seen: set[str] = set()
    for _ in range(100):
        got = picker.pick(st, chat_request(), cands)  # type: ignore[attr-defined]
        assert len(got) == 3 and len(set(got)) == 3
        seen.add(got[0])
    assert seen == {"a:1", "b:1", "c:1", "d:1"}


def test_softmax_picker_samples_as_exp_score_over_temperature() -> None:
    """Dynamo's sampling: frequencies follow exp(score / T); fallbacks are distinct; the seed repeats
    the draws; temperature 0 is the argmax."""
    import math

    cands = scored(("a:1", 1.0), ("b:1", 0.5), ("c:1", 0.0))
    picker = make("softmax-picker", {"temperature": 0.5})
    st = state(seed=3)
    n = 6000
    picks = Counter(picker.pick(st, chat_request(), cands)[0] for _ in range(n))  # type: ignore[attr-defined]
    w = [math.exp(x / 0.5) for x in (1.0, 0.5, 0.0)]
    for pod, wi in zip(("a:1", "b:1", "c:1"), w, strict=True):
        expected = n * wi / sum(w)  # a:1 ~66%, b:1 ~24%, c:1 ~9%
        assert abs(picks[pod] - expected) < 5 * math.sqrt(expected), (pod, picks[pod], expected)
    st2 = state(seed=3)
    assert Counter(picker.pick(st2, chat_request(), cands)[0] for _ in range(n)) == picks  # type: ignore[attr-defined]
    two = make("softmax-picker", {"temperature": 0.5, "maxNumOfEndpoints": 2})
    for _ in range(50):
        got = two.pick(st, chat_request(), cands)  # type: ignore[attr-defined]
        assert len(got) == 2 and len(set(got)) == 2
    cold = make("softmax-picker")
    assert {cold.pick(st, chat_request(), cands)[0] for _ in range(50)} == {"a:1"}  # type: ignore[attr-defined]


def test_round_robin_cycles_and_skips_missing_endpoints() -> None:
    picker = make("round-robin-picker")
    cands = scored(("b:1", 0), ("a:1", 0), ("c:1", 0))
    got = [picker.pick(state(), chat_request(), cands)[0] for _ in range(4)]  # type: ignore[attr-defined]
    assert got == ["a:1", "b:1", "c:1", "a:1"]
    without_b = scored(("a:1", 0), ("c:1", 0))
    assert picker.pick(state(), chat_request(), without_b) == ["c:1"]  # type: ignore[attr-defined]
    assert picker.pick(state(), chat_request(), without_b) == ["a:1"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("type_name", "params", "field"),
    [
        ("max-score-picker", {"maxNumOfEndpoints": 0}, "maxNumOfEndpoints"),
        ("max-score-picker", {"maxNumOfEndpoints": "2"}, "maxNumOfEndpoints"),
        ("random-picker", {"bogus": 1}, "bogus"),
        ("metrics-staleness-filter", {"maxAge": "soon"}, "maxAge"),
        ("token-load-scorer", {"queueThresholdTokens": -5}, "queueThresholdTokens"),
        ("queue-scorer", {"anything": True}, "anything"),
        ("precise-prefix-cache-scorer", {"speculativeTtl": "soon"}, "speculativeTtl"),
        ("softmax-picker", {"temperature": -0.1}, "temperature"),
        ("softmax-picker", {"temperature": float("inf")}, "temperature"),
        ("softmax-picker", {"temperature": 1.0, "maxNumOfEndpoints": 0}, "maxNumOfEndpoints"),
        ("precise-prefix-cache-scorer", {"speculativeTtl": -2}, "speculativeTtl"),
    ],
)
def test_bad_parameters_name_the_field(type_name: str, params: dict[str, object], field: str) -> None:
    from epp.scheduling.registry import PluginParamsError

    with pytest.raises(PluginParamsError) as err:
        make(type_name, params)
    assert err.value.field == field


def test_registry_is_an_instance_not_a_global() -> None:
    from epp.scheduling.plugins.queue_scorer import SPEC

    r1 = default_registry()
    r2 = default_registry()
    assert r1 is not r2
    with pytest.raises(ValueError, match="already registered"):
        r1.register(SPEC)


def _kv_scorer(params: dict[str, object] | None = None) -> tuple[object, object]:
    from epp.kvindex.freshness import FreshnessTracker
    from epp.kvindex.index import BlockIndex
    from epp.kvindex.prompt import TokenizerRegistry
    from epp.kvindex.service import SERVICE_KEY, KvIndexService

    svc = KvIndexService(BlockIndex(16, 10_000), FreshnessTracker(), TokenizerRegistry({}), 16)
    handle = PluginHandle(clock=FakeClock(NOW), rng=random.Random(0), services={SERVICE_KEY: svc})
    return default_registry().create("precise-prefix-cache-scorer", "p", params, handle)[1], svc


def _hold(svc: object, pod: str, tokens: list[int], tier: str, first_hash: int) -> None:
    from epp.kvindex.keys import root_key

    n = len(tokens) // 16
    svc.index.store(pod, list(range(first_hash, first_hash + n)), None, tokens, 16, tier, root_key("m", None))  # type: ignore[attr-defined]
    svc.freshness.message(pod, NOW)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("holdings", "expected"),
    [
        ({"a:1": [("gpu", 8)]}, {"a:1": 1.0, "b:1": 0.0}),  # whole prompt on GPU
        ({"a:1": [("gpu", 4)], "b:1": [("cpu", 8)]}, {"a:1": 0.5, "b:1": 0.8}),  # half on GPU vs all on CPU
        ({"a:1": [("storage", 8)]}, {"a:1": 0.5, "b:1": 0.0}),
        (
            {"a:1": [("cpu", 8), ("gpu", 2)]},
            {"a:1": (2 * 1.0 + 6 * 0.8) / 8, "b:1": 0.0},
        ),  # best tier per block
        ({"a:1": [("nvme-x", 8)]}, {"a:1": 0.0, "b:1": 0.0}),  # unknown tier weight 0
    ],
)
def test_precise_prefix_scorer_weights_blocks_by_their_best_tier(
    holdings: dict[str, list[tuple[str, int]]], expected: dict[str, float]
) -> None:
    from epp.types import ApiKind, InferenceRequest

    scorer, svc = _kv_scorer()
    prompt = list(range(8 * 16 + 5))
    for pod, tiers in holdings.items():
        for i, (tier, blocks) in enumerate(tiers):
            _hold(svc, pod, prompt[: blocks * 16], tier, 1000 * (i + 1))
    req = InferenceRequest("r", ApiKind.COMPLETIONS, "m", prompt=prompt)
    eps = [endpoint("a:1"), endpoint("b:1")]
    got = scorer.score(state(), req, eps)  # type: ignore[attr-defined]
    assert got == pytest.approx([expected["a:1"], expected["b:1"]])


def test_precise_prefix_scorer_gives_stale_pods_nothing_and_text_without_tokenizer_nothing() -> None:
    from epp.types import ApiKind, InferenceRequest

    scorer, svc = _kv_scorer()
    prompt = list(range(4 * 16))
    _hold(svc, "a:1", prompt, "gpu", 1)
    req = InferenceRequest("r", ApiKind.COMPLETIONS, "m", prompt=prompt)
    assert scorer.score(state(), req, [endpoint("a:1")]) == [1.0]  # type: ignore[attr-defined]
    svc.freshness.disconnected("a:1", NOW)  # type: ignore[attr-defined]
    assert scorer.score(state(), req, [endpoint("a:1")]) == [0.0]  # type: ignore[attr-defined]
    text = InferenceRequest("r", ApiKind.COMPLETIONS, "m", prompt="no tokenizer for m")
    assert scorer.score(state(), text, [endpoint("a:1")]) == [0.0]  # type: ignore[attr-defined]
    assert svc.unkeyed[("m", "no_tokenizer")] == 1  # type: ignore[attr-defined]


def test_speculative_indexing_credits_the_pod_a_prompt_was_routed_to_until_the_ttl() -> None:
    """With `speculativeTtl`, a routed prompt's blocks count for the chosen pod (at the gpu weight) before
    any event confirms them, and for `speculativeTtl` only; a longer reported prefix still wins; stale
    pods get nothing; without the setting, routing leaves no trace."""
    from epp.scheduling.framework import CycleState
    from epp.types import ApiKind, InferenceRequest

    prompt = list(range(8 * 16))
    req = InferenceRequest("r", ApiKind.COMPLETIONS, "m", prompt=prompt)
    half = InferenceRequest("h", ApiKind.COMPLETIONS, "m", prompt=prompt[: 4 * 16] + [9999] * 64)
    eps = [endpoint("a:1"), endpoint("b:1")]
    scorer, svc = _kv_scorer({"speculativeTtl": "2s"})
    plain, plain_svc = _kv_scorer()
    for s in (svc, plain_svc):
        for pod in ("a:1", "b:1"):
            s.freshness.message(pod, NOW)  # type: ignore[attr-defined]
    assert scorer.score(CycleState(NOW, random.Random(0)), req, eps) == [0.0, 0.0]  # type: ignore[attr-defined]
    scorer.picked(CycleState(NOW, random.Random(0)), req, "b:1")  # type: ignore[attr-defined]
    plain.picked(CycleState(NOW, random.Random(0)), req, "b:1")  # type: ignore[attr-defined]
    assert scorer.score(CycleState(NOW + 1.9, random.Random(0)), req, eps) == [0.0, 1.0]  # type: ignore[attr-defined]
    assert scorer.score(CycleState(NOW + 1.9, random.Random(0)), half, eps) == [0.0, 0.5]  # type: ignore[attr-defined]
    assert plain.score(CycleState(NOW + 1.9, random.Random(0)), req, eps) == [0.0, 0.0]  # type: ignore[attr-defined]
    assert scorer.score(CycleState(NOW + 2.0, random.Random(0)), req, eps) == [0.0, 0.0]  # type: ignore[attr-defined]
    # reported blocks beat a shorter speculative prefix; a stale pod gets neither
    scorer.picked(CycleState(NOW + 3, random.Random(0)), half, "a:1")  # type: ignore[attr-defined]
    _hold(svc, "a:1", prompt, "cpu", 1)
    assert scorer.score(CycleState(NOW + 3, random.Random(0)), req, eps) == pytest.approx([0.8, 0.0])  # type: ignore[attr-defined]
    svc.freshness.disconnected("a:1", NOW + 3)  # type: ignore[attr-defined]
    assert scorer.score(CycleState(NOW + 3, random.Random(0)), half, eps) == [0.0, 0.0]  # type: ignore[attr-defined]
    assert len(svc.index.pods()) == 1  # type: ignore[attr-defined]  # the exact index holds only what was reported


def test_speculative_entries_are_reported_per_scorer_in_debug_index_and_metrics() -> None:
    """The speculative store is memory outside the index's bound: /debug/index and the
    `epp_kv_speculative_entries{plugin}` gauge say how many entries each scorer keeps; a scorer built again
    without the setting takes its series away."""
    from prometheus_client import CollectorRegistry, generate_latest

    from epp.kvindex.freshness import FreshnessTracker
    from epp.kvindex.index import BlockIndex
    from epp.kvindex.ingest import KvIngest
    from epp.kvindex.prompt import TokenizerRegistry
    from epp.kvindex.report import index_report
    from epp.kvindex.service import SERVICE_KEY, KvIndexService
    from epp.server.kv_metrics import KvIndexCollector
    from epp.types import ApiKind, InferenceRequest

    svc = KvIndexService(BlockIndex(16, 10_000), FreshnessTracker(), TokenizerRegistry({}), 16)
    handle = PluginHandle(clock=FakeClock(NOW), rng=random.Random(0), services={SERVICE_KEY: svc})
    reg = default_registry()
    scorer = reg.create("precise-prefix-cache-scorer", "spec", {"speculativeTtl": "2s"}, handle)[1]
    reg.create("ttft-scorer", "est", {"speculativeTtl": 0}, handle)
    ingest = KvIngest(svc.index, svc.freshness, lambda pod: "m")
    metrics = CollectorRegistry()
    metrics.register(KvIndexCollector(svc, ingest, FakeClock(NOW)))

    def gauge() -> list[str]:
        text = generate_latest(metrics).decode()
        return [line for line in text.splitlines() if line.startswith("epp_kv_speculative_entries{")]

    assert index_report(svc, ingest, "per-pod", NOW)["speculative_entries"] == {"spec": 0}
    req = InferenceRequest("r", ApiKind.COMPLETIONS, "m", prompt=list(range(8 * 16 + 3)))
    scorer.picked(CycleState(NOW, random.Random(0)), req, "b:1")  # type: ignore[attr-defined]
    assert index_report(svc, ingest, "per-pod", NOW)["speculative_entries"] == {"spec": 8}
    assert gauge() == ['epp_kv_speculative_entries{plugin="spec"} 8.0']
    reg.create("precise-prefix-cache-scorer", "spec", {}, handle)  # rebuilt without the setting
    assert index_report(svc, ingest, "per-pod", NOW)["speculative_entries"] == {}
    assert gauge() == []


def test_a_served_model_without_a_tokenizer_is_reported_and_its_prompts_counted(tmp_path: Path) -> None:
    """Precise scoring is off for a served model without a tokenizer: /debug/index lists the model, the
    tokenizer gauge is 0 for it (1 for a configured one) and its text prompts count as unkeyed."""
    from prometheus_client import CollectorRegistry, generate_latest

    from epp.kvindex.freshness import FreshnessTracker
    from epp.kvindex.index import BlockIndex
    from epp.kvindex.ingest import KvIngest
    from epp.kvindex.prompt import TokenizerRegistry
    from epp.kvindex.report import index_report
    from epp.kvindex.service import KvIndexService
    from epp.server.kv_metrics import KvIndexCollector
    from epp.testing.tokenizer import build_tiny_tokenizer
    from epp.types import ApiKind, InferenceRequest

    tokenizers = TokenizerRegistry({"with": build_tiny_tokenizer(tmp_path)})
    svc = KvIndexService(BlockIndex(16, 10_000), FreshnessTracker(), tokenizers, 16)
    ingest = KvIngest(svc.index, svc.freshness, lambda pod: "with")
    metrics = CollectorRegistry()
    metrics.register(KvIndexCollector(svc, ingest, FakeClock(NOW), lambda: {"with", "without"}))
    assert svc.prompt_keys(InferenceRequest("r", ApiKind.COMPLETIONS, "without", prompt="hello")) is None
    assert svc.prompt_keys(InferenceRequest("r", ApiKind.COMPLETIONS, "with", prompt="hello")) is not None
    report = index_report(svc, ingest, "per-pod", NOW, {"with", "without"})
    assert report["models_without_tokenizer"] == ["without"]
    assert report["precise_scoring_off"] == {"without": {"no_tokenizer": 1}}
    text = generate_latest(metrics).decode()
    assert 'epp_kv_tokenizer_available{model="without"} 0.0' in text
    assert 'epp_kv_tokenizer_available{model="with"} 1.0' in text
    assert 'epp_kv_unkeyed_requests_total{model="without",reason="no_tokenizer"} 1.0' in text
