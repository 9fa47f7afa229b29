"""`ttft-scorer`: estimated TTFT per pod from the cost model and the KV index, the tie band, the pick
mode, and the scenarios it exists for, through the scorer and through the default scheduler."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from epp.config import DEFAULT_CONFIG_YAML, build_scheduler, parse_config
from epp.costmodel.estimate import estimate_ttft
from epp.costmodel.profile import DEFAULT_REFERENCE, REFERENCE_PROFILES
from epp.costmodel.service import SERVICE_KEY as COST_KEY
from epp.costmodel.service import CostModel
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import block_keys, root_key
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.service import SERVICE_KEY as KV_KEY
from epp.kvindex.service import KvIndexService
from epp.scheduling.builtin import default_registry
from epp.scheduling.framework import ESTIMATES, FASTEST, MODE, RANKING, CycleState, PluginHandle
from epp.scheduling.registry import PluginParamsError
from epp.scheduling.scheduler import Scheduler
from epp.testing.fakes import FakeClock, chat_request, endpoint, token_request
from epp.types import ApiKind, Endpoint, InferenceRequest, PrefillWork

NOW = 1000.0
P = REFERENCE_PROFILES[DEFAULT_REFERENCE]
RANK = {"gpu": math.inf, **{t: c.bandwidth_bytes_per_s for t, c in P.tiers.items()}}


def kv_service() -> KvIndexService:
    return KvIndexService(BlockIndex(16, 100_000), FreshnessTracker(), TokenizerRegistry({}), 16)


def hold(
    svc: KvIndexService, pod: str, tokens: list[int], tier: str, first_hash: int, salt: str | None = None
) -> None:
    """The pod's engine stored these tokens' full blocks on `tier` (and its event stream is fresh)."""
    n = len(tokens) // 16
    hashes = list(range(first_hash, first_hash + n))
    svc.index.store(pod, hashes, None, tokens, 16, tier, root_key("m", salt))
    svc.freshness.message(pod, NOW)


def fresh(svc: KvIndexService, *pods: str) -> None:
    for pod in pods:
        svc.freshness.message(pod, NOW)


def make_scorer(services: dict[str, object] | None = None, params: dict[str, object] | None = None) -> object:
    handle = PluginHandle(clock=FakeClock(NOW), rng=random.Random(0), services=dict(services or {}))
    return default_registry().create("ttft-scorer", "ttft-scorer", params, handle)[1]


def score(
    scorer: object, request: InferenceRequest, endpoints: list[Endpoint]
) -> tuple[list[float], CycleState]:
    st = CycleState(now=NOW, rng=random.Random(0))
    return list(scorer.score(st, request, endpoints)), st  # type: ignore[attr-defined]


def scheduler(
    services: dict[str, object] | None = None, yaml_text: str = DEFAULT_CONFIG_YAML, seed: int = 0
) -> Scheduler:
    cfg = parse_config(yaml_text, "test.yaml")
    return build_scheduler(cfg, default_registry(), FakeClock(NOW), random.Random(seed), services=services)


# -- BlockIndex.lookup_by_best_tier -------------------------------------------------------------------
def _keys(prompt: list[int], salt: str | None = None) -> list[int]:
    return block_keys(prompt, 16, root_key("m", salt)).tolist()  # type: ignore[no-any-return]


def test_lookup_by_best_tier_counts_the_held_prefix_by_best_tier() -> None:
    svc = kv_service()
    prompt = list(range(8 * 16))
    hold(svc, "a:1", prompt, "cpu", 1000)  # all 8 blocks on CPU
    hold(svc, "a:1", prompt[: 3 * 16], "gpu", 2000)  # the first 3 also on GPU
    hold(svc, "b:1", prompt[: 5 * 16], "storage", 3000)
    hold(svc, "c:1", list(range(500, 500 + 64)), "gpu", 4000)  # known, holds none of this prompt
    got = svc.index.lookup_by_best_tier(
        _keys(prompt), ["a:1", "b:1", "c:1", "d:1"], lambda t: RANK.get(t, -1.0)
    )
    assert got["a:1"] == {"gpu": 3, "cpu": 5}  # a block on gpu and cpu counts as gpu
    assert got["b:1"] == {"storage": 5}
    assert got["c:1"] == {}
    assert "d:1" not in got  # pods the index does not know are left out


def test_lookup_by_best_tier_uses_the_given_rank() -> None:
    svc = kv_service()
    prompt = list(range(4 * 16))
    hold(svc, "a:1", prompt, "cpu", 1000)
    hold(svc, "a:1", prompt, "gpu", 2000)
    assert svc.index.lookup_by_best_tier(_keys(prompt), ["a:1"], lambda t: RANK[t]) == {"a:1": {"gpu": 4}}
    cpu_first = {"gpu": 1.0, "cpu": 2.0}
    assert svc.index.lookup_by_best_tier(_keys(prompt), ["a:1"], lambda t: cpu_first[t]) == {
        "a:1": {"cpu": 4}
    }


def test_lookup_by_best_tier_counts_only_the_consecutive_prefix() -> None:
    svc = kv_service()
    prompt = list(range(8 * 16))
    hold(svc, "a:1", prompt, "gpu", 1000)
    svc.index.remove("a:1", [1000 + 4], "gpu")  # the engine evicted block 4
    got = svc.index.lookup_by_best_tier(_keys(prompt), ["a:1"], lambda t: RANK.get(t, -1.0))
    assert got == {"a:1": {"gpu": 4}}
    # a prompt that diverges after block 2 matches only those
    other = prompt[: 2 * 16] + [7] * (6 * 16)
    assert svc.index.lookup_by_best_tier(_keys(other), ["a:1"], lambda t: RANK[t]) == {"a:1": {"gpu": 2}}


# -- the scorer ------------------------------------------------------------------------------------
def test_without_an_index_the_estimate_is_load_only() -> None:
    scorer = make_scorer()
    req = chat_request("x" * 4000)
    eps = [endpoint("a:1", waiting=3), endpoint("b:1")]
    scores, st = score(scorer, req, eps)
    n = req.prompt_tokens_estimate
    ests = st.data[ESTIMATES]
    assert st.data[MODE] == "load-only"
    assert set(ests) == {"a:1", "b:1"}
    assert ests["b:1"].ttft_s == pytest.approx(P.prefill_s(n, 0))
    assert ests["a:1"].ttft_s == pytest.approx(estimate_ttft(P, eps[0], n).ttft_s)
    assert st.data[FASTEST] == pytest.approx(ests["b:1"].ttft_s)
    assert scores == pytest.approx([ests["b:1"].ttft_s / ests["a:1"].ttft_s, 1.0])


def test_a_gpu_hit_on_an_idle_pod_wins_and_is_credited() -> None:
    svc = kv_service()
    prompt = list(range(4096))
    hold(svc, "a:1", prompt, "gpu", 1)
    fresh(svc, "b:1")
    scores, st = score(make_scorer({KV_KEY: svc}), token_request(prompt), [endpoint("a:1"), endpoint("b:1")])
    ests = st.data[ESTIMATES]
    assert st.data[MODE] == "cache-aware"
    assert ests["a:1"].cached_tokens == 4080  # whole blocks, and never the last prompt token
    assert ests["b:1"].cached_tokens == 0
    assert scores[0] == 1.0
    assert scores[1] == pytest.approx(ests["a:1"].ttft_s / ests["b:1"].ttft_s)


def test_stale_pods_get_no_cache_credit_and_the_mode_says_degraded() -> None:
    svc = kv_service()
    prompt = list(range(4096))
    hold(svc, "a:1", prompt, "gpu", 1)
    hold(svc, "b:1", prompt[:2048], "gpu", 10_000)
    svc.freshness.disconnected("a:1", NOW)
    scores, st = score(make_scorer({KV_KEY: svc}), token_request(prompt), [endpoint("a:1"), endpoint("b:1")])
    ests = st.data[ESTIMATES]
    assert st.data[MODE] == "degraded"
    assert ests["a:1"].cached_tokens == 0  # it holds the whole prompt, but its index is stale
    assert ests["b:1"].cached_tokens == 2048
    assert scores[1] == 1.0 > scores[0]


def test_a_degraded_pod_still_gets_credit() -> None:
    svc = kv_service()
    prompt = list(range(2048))
    hold(svc, "a:1", prompt, "gpu", 1)
    fresh(svc, "b:1")
    svc.freshness.problem("a:1", NOW, "orphans")
    _, st = score(make_scorer({KV_KEY: svc}), token_request(prompt), [endpoint("a:1"), endpoint("b:1")])
    assert st.data[MODE] == "degraded"
    assert st.data[ESTIMATES]["a:1"].cached_tokens == 2032


def test_every_pod_stale_is_load_only() -> None:
    svc = kv_service()
    prompt = list(range(2048))
    hold(svc, "a:1", prompt, "gpu", 1)
    svc.freshness.disconnected("a:1", NOW)
    # b:1 never published anything: unknown to the freshness tracker, so stale too
    scores, st = score(make_scorer({KV_KEY: svc}), token_request(prompt), [endpoint("a:1"), endpoint("b:1")])
    assert st.data[MODE] == "load-only"
    assert [e.cached_tokens for e in st.data[ESTIMATES].values()] == [0, 0]
    assert scores == [1.0, 1.0]


def test_a_prompt_that_cannot_be_tokenized_is_load_only() -> None:
    svc = kv_service()
    fresh(svc, "a:1", "b:1")
    req = InferenceRequest(
        "r", ApiKind.COMPLETIONS, "m", prompt="text, no tokenizer", prompt_tokens_estimate=900
    )
    _, st = score(make_scorer({KV_KEY: svc}), req, [endpoint("a:1"), endpoint("b:1", waiting=1)])
    assert st.data[MODE] == "load-only"
    assert st.data[ESTIMATES]["a:1"].prompt_tokens == 900  # falls back to the request's estimate


def test_cache_credit_off_ignores_the_index() -> None:
    svc = kv_service()
    prompt = list(range(4096))
    hold(svc, "a:1", prompt, "gpu", 1)
    fresh(svc, "b:1")
    scorer = make_scorer({KV_KEY: svc}, {"cacheCredit": False})
    scores, st = score(scorer, token_request(prompt), [endpoint("a:1"), endpoint("b:1")])
    assert st.data[MODE] == "load-only"
    assert st.data[ESTIMATES]["a:1"].cached_tokens == 0
    assert scores == [1.0, 1.0]


def test_another_tenants_prefix_gives_no_affinity() -> None:
    svc = kv_service()
    prompt = list(range(4096))
    hold(svc, "a:1", prompt, "gpu", 1, salt="t1-tenant-a")
    fresh(svc, "b:1")
    eps = [endpoint("a:1"), endpoint("b:1")]
    _, st = score(make_scorer({KV_KEY: svc}), token_request(prompt, cache_salt="t1-tenant-b"), eps)
    assert st.data[ESTIMATES]["a:1"].cached_tokens == 0
    _, st = score(make_scorer({KV_KEY: svc}), token_request(prompt, cache_salt="t1-tenant-a"), eps)
    assert st.data[ESTIMATES]["a:1"].cached_tokens == 4080


def test_the_scorer_uses_the_shared_cost_model_and_its_calibration() -> None:
    cm = CostModel()
    ep = endpoint("a:1")
    for _ in range(50):
        cm.observe("m", cm.estimate("m", ep, 2000, None), 0.5 * P.prefill_s(2000, 0))
    _, st = score(make_scorer({COST_KEY: cm}), token_request(list(range(2000))), [ep])
    assert st.data[ESTIMATES]["a:1"].prefill_s == pytest.approx(0.5 * P.prefill_s(2000, 0), rel=0.02)


# -- tie band --------------------------------------------------------------------------------------
def _near_ties() -> tuple[list[Endpoint], list[float]]:
    """a idle; b and c a few ms behind (inside the 5% band of a 4k-token prefill); d a queue behind."""
    eps = [
        endpoint("a:1"),
        endpoint("b:1", backlog=P.work(16, 0)),
        endpoint("c:1", backlog=P.work(64, 0)),
        endpoint("d:1", backlog=P.work(2048, 0)),
    ]
    times = [estimate_ttft(P, e, 4096).ttft_s for e in eps]
    return eps, times


def test_near_ties_all_score_one_and_the_rest_score_best_over_ttft() -> None:
    eps, times = _near_ties()
    best = times[0]
    assert best < times[1] < times[2] <= best * 1.05 < times[3]
    scores, _ = score(make_scorer(), token_request(list(range(4096))), eps)
    assert scores[:3] == [1.0, 1.0, 1.0]
    assert scores[3] == pytest.approx(best / times[3])


def test_tie_band_seconds_is_the_minimum_band() -> None:
    # a tiny prompt: 5% of its TTFT is well below the 2 ms floor (all three decode: each waits for the
    # rest of the step in progress and the step scheduled ahead)
    eps = [endpoint("a:1", decoding=1), endpoint("b:1", decoding=10), endpoint("c:1", decoding=80)]
    times = [estimate_ttft(P, e, 32).ttft_s for e in eps]
    assert times[0] * 0.05 < times[1] - times[0] < 0.002 < times[2] - times[0]
    scores, _ = score(make_scorer(), token_request(list(range(32))), eps)
    assert scores == pytest.approx([1.0, 1.0, times[0] / times[2]])


def test_a_zero_band_keeps_only_the_strict_best_at_one() -> None:
    eps, times = _near_ties()
    scores, _ = score(
        make_scorer(params={"tieBand": 0, "tieBandSeconds": 0}), token_request(list(range(4096))), eps
    )
    assert scores == pytest.approx([1.0] + [times[0] / t for t in times[1:]])
    assert all(s < 1.0 for s in scores[1:])


_ZERO_BAND_YAML = DEFAULT_CONFIG_YAML.replace(
    "- type: ttft-scorer\n", "- type: ttft-scorer\n  parameters: {tieBand: 0, tieBandSeconds: 0}\n"
)


def _burst(yaml_text: str, seed: int) -> list[str]:
    eps, _ = _near_ties()
    s = scheduler(yaml_text=yaml_text, seed=seed)
    return [s.schedule(token_request(list(range(4096))), eps).decision.primary for _ in range(90)]


def test_a_burst_of_identical_requests_spreads_over_the_tied_pods_reproducibly() -> None:
    picks = _burst(DEFAULT_CONFIG_YAML, seed=7)
    counts = Counter(picks)
    assert set(counts) == {"a:1", "b:1", "c:1"}  # never d, which is outside the band
    assert min(counts.values()) >= 15
    assert _burst(DEFAULT_CONFIG_YAML, seed=7) == picks
    assert _burst(DEFAULT_CONFIG_YAML, seed=8) != picks


def test_without_a_band_the_burst_herds_onto_the_fastest() -> None:
    assert set(_burst(_ZERO_BAND_YAML, seed=7)) == {"a:1"}


@pytest.mark.parametrize("ttl", ["2s", "0"])
def test_a_request_right_behind_one_with_its_prompt_is_estimated_hitting_where_that_one_went(
    ttl: str,
) -> None:
    """Speculative entries (default 2 s): before any KV event, the prompt just routed counts as the chosen
    pod's GPU prefix for the next request (and nowhere else), until the TTL; `speculativeTtl: 0` never."""
    svc = kv_service()
    fresh(svc, "a:1", "b:1")
    clock = FakeClock(NOW)
    yaml_text = DEFAULT_CONFIG_YAML.replace(
        "- type: ttft-scorer\n", f"- type: ttft-scorer\n  parameters: {{speculativeTtl: {ttl}}}\n"
    )
    assert "speculativeTtl" in yaml_text
    cfg = parse_config(yaml_text, "test.yaml")
    s = build_scheduler(cfg, default_registry(), clock, random.Random(0), services={KV_KEY: svc})
    prompt = list(range(4096))

    def eps() -> list[Endpoint]:  # scraped just now
        return [endpoint("a:1", observed_at=clock.now()), endpoint("b:1", observed_at=clock.now())]

    first = s.schedule(token_request(prompt), eps()).decision
    assert {first.estimates[p].cached_tokens for p in ("a:1", "b:1")} == {0}
    clock.advance(1.9)
    second = s.schedule(token_request(prompt), eps()).decision
    other = "b:1" if first.primary == "a:1" else "a:1"
    held = 4096 - 16 if ttl == "2s" else 0  # (the last block is always recomputed)
    assert second.estimates[first.primary].cached_tokens == held
    assert second.estimates[other].cached_tokens == 0
    if held:
        assert second.primary == first.primary
    clock.advance(2.1)  # both entries expired (the second request's too)
    third = s.schedule(token_request(prompt), eps()).decision
    assert {third.estimates[p].cached_tokens for p in ("a:1", "b:1")} == {0}
    assert svc.index.pods() == []  # the exact index holds only what engines reported


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"tieBand": 1.5}, "tieBand"),
        ({"tieBand": -0.1}, "tieBand"),
        ({"tieBandSeconds": -1}, "tieBandSeconds"),
        ({"tieBandSeconds": 11}, "tieBandSeconds"),
        ({"speculativeTtl": "later"}, "speculativeTtl"),
        ({"speculativeTtl": -1}, "speculativeTtl"),
        ({"tieBreak": "lowest"}, "tieBreak"),
        ({"copyWeight": -1}, "copyWeight"),
        ({"copyWeight": 101}, "copyWeight"),
    ],
)
def test_bad_band_parameters_name_the_field(params: dict[str, object], field: str) -> None:
    with pytest.raises(PluginParamsError) as err:
        make_scorer(params=params)
    assert err.value.field == field


def test_services_of_the_wrong_type_are_refused() -> None:
    with pytest.raises(PluginParamsError):
        make_scorer({COST_KEY: object()})
    with pytest.raises(PluginParamsError):
        make_scorer({KV_KEY: object()})


# -- the scenarios through the default scheduler -----------------------------------------------------
def test_default_profile_a_gpu_hit_behind_a_three_second_queue_loses_to_an_idle_pod() -> None:
    svc = kv_service()
    n = 4096
    prompt = list(range(n))
    hold(svc, "a:1", prompt, "gpu", 1)
    fresh(svc, "b:1")
    waiting = math.ceil(3.0 / P.prefill_s(P.unknown_request_tokens, 0))
    s = scheduler({KV_KEY: svc})
    d = s.schedule(token_request(prompt), [endpoint("a:1", waiting=waiting), endpoint("b:1")]).decision
    assert d.primary == "b:1"
    assert d.mode == "cache-aware"
    assert d.estimates["a:1"].cached_tokens == n - 16  # the last block is recomputed (block 16)
    assert d.estimates["a:1"].queue_s >= 3.0
    assert d.estimates["b:1"].ttft_s == pytest.approx(P.prefill_s(n, 0))
    # without the queue the hit wins (a new scheduler: this one counts the prompt just routed to b:1
    # as b:1's, speculatively)
    d = scheduler({KV_KEY: svc}).schedule(token_request(prompt), [endpoint("a:1"), endpoint("b:1")]).decision
    assert d.primary == "a:1"


def test_among_near_ties_the_pods_holding_the_prompt_win_and_equals_stay_random() -> None:
    """A pod holding the prompt behind a short queue ties (within the band) with an idle pod that does
    not: the holder scores 1, the idle one just below 1 and above every pod outside the band; two
    idle pods holding nothing still tie at 1 (a burst spreads)."""
    svc = kv_service()
    n = 4096
    prompt = list(range(n))
    hold(svc, "a:1", prompt, "gpu", 1)
    fresh(svc, "b:1", "c:1", "d:1")
    scorer = make_scorer({KV_KEY: svc})
    ratio, tokens = 0.0, 0
    while ratio < 1.01:  # a's backlog grows until its estimate is just above the idle pods' one
        tokens += 64
        a = endpoint("a:1", backlog=PrefillWork(1, tokens, tokens * tokens / 2.0))
        others = [endpoint("b:1"), endpoint("c:1"), endpoint("d:1", waiting=8)]
        scores, st = score(scorer, token_request(prompt), [a, *others])
        table = st.data[ESTIMATES]
        ratio = float(table.ttft[0] / table.ttft[1])
    assert ratio < 1.04  # inside the 5% band
    assert table.cached[0] == n - 16 and table.cached[1] == 0
    assert scores[0] == 1.0
    assert scores[1] == scores[2] < 1.0  # b and c: near-ties holding less, equal to each other
    assert scores[3] < scores[1]  # d (a queue of 8): outside the band
    # without the holder, b and c tie at 1 and the picker spreads between them
    scores, _ = score(scorer, token_request(prompt), others)
    assert scores[:2] == [1.0, 1.0] and scores[2] < 1.0


def test_among_near_ties_the_lowest_kv_usage_wins_and_random_keeps_them_equal() -> None:
    """Near-ties equal in what they hold: the one with the most free KV wins (`tieBreak: kv-usage`, the
    default), equal usage still ties (a burst spreads), and every near-tie stays above the band's others;
    `tieBreak: random` leaves them all at 1."""
    eps, times = _near_ties()
    usage = [0.6, 0.2, 0.2, 0.0]  # d (outside the band) the emptiest: it still loses
    eps = [endpoint(e.id, backlog=e.prefill_backlog, kv_usage=u) for e, u in zip(eps, usage, strict=True)]
    request = token_request(list(range(4096)))
    scores, st = score(make_scorer(), request, eps)
    assert scores[1] == scores[2] > scores[0] > scores[3]
    assert scores[3] == pytest.approx(times[0] / times[3])
    assert list(st.data[ESTIMATES].ttft) == pytest.approx(times)  # the estimates themselves do not change
    scores, _ = score(make_scorer(params={"tieBreak": "random"}), request, eps)
    assert scores[:3] == [1.0, 1.0, 1.0]


def test_copying_a_held_prefix_costs_more_as_the_target_pods_kv_fills() -> None:
    """An idle pod faster than the holder of a 4K-token prompt by more than the band wins while its KV is
    plentiful; at 90% KV usage the copy of the prefix it would make is charged (prefill of the copied part
    x copyWeight x min(u / (1 - u), 2), u its usage) and the holder wins. The charge is the target's: a
    full holder does not make a copy into an empty pod cost anything. `copyWeight: 0` never charges it.
    The estimates, and the fastest one admission reads, stay the request's own TTFT."""
    svc = kv_service()
    n = 4096
    prompt = list(range(n))
    hold(svc, "a:1", prompt, "gpu", 1)
    fresh(svc, "b:1")
    backlog = P.work(6000, 0)  # a's queue: its estimate ~1.4x b's, outside the 5% band

    def pick(
        usage: float, params: dict[str, object] | None = None, holder: float | None = None
    ) -> tuple[list[float], CycleState]:
        a_usage = usage if holder is None else holder
        eps = [endpoint("a:1", backlog=backlog, kv_usage=a_usage), endpoint("b:1", kv_usage=usage)]
        return score(make_scorer({KV_KEY: svc}, params), token_request(prompt), eps)

    low, st_low = pick(0.0)
    table = st_low.data[ESTIMATES]
    assert table.cached[0] == n - 16 and table.cached[1] == 0
    assert table.ttft[0] > 1.1 * table.ttft[1]
    assert low[1] == 1.0 > low[0]
    high, st_high = pick(0.9)
    assert high[0] == 1.0 > high[1]
    assert list(st_high.data[ESTIMATES].ttft) == pytest.approx(list(table.ttft))
    assert st_high.data[FASTEST] == pytest.approx(float(table.ttft[1]))
    off, _ = pick(0.9, {"copyWeight": 0})
    assert off[1] == 1.0 > off[0]
    empty_target, _ = pick(0.0, holder=0.95)
    assert empty_target[1] == 1.0 > empty_target[0]
    # the ranking terms explain the pick: b was charged for the copy (more than the estimates' gap)
    ranking = st_high.data[RANKING]
    charge_b = ranking.of("b:1")[0]
    assert ranking.of("a:1") == (0.0, True) and charge_b > table.ttft[0] - table.ttft[1] > 0
    assert st_low.data[RANKING].copy_charge_s is None  # nobody's KV in use: nothing charged


def test_default_profile_cpu_tier_beats_recompute_for_a_long_prompt_not_a_short_one() -> None:
    svc = kv_service()
    long_prompt = list(range(16 * 1024))
    hold(svc, "a:1", long_prompt, "cpu", 1)
    fresh(svc, "b:1")
    n = len(long_prompt)
    savings = P.prefill_s(n, 0) - P.reload_s("cpu", n - 16) - P.prefill_s(16, n - 16)  # type: ignore[operator]
    waiting = int(0.5 * savings / P.prefill_s(P.unknown_request_tokens, 0))
    assert waiting >= 1
    eps = [endpoint("a:1", waiting=waiting), endpoint("b:1")]
    s = scheduler({KV_KEY: svc})
    d = s.schedule(token_request(long_prompt), eps).decision
    assert d.primary == "a:1"
    assert d.estimates["a:1"].reloaded_tokens == n - 16
    assert d.estimates["a:1"].reload_s == pytest.approx(P.reload_s("cpu", n - 16))

    short = long_prompt[:32]  # the same prefix, two blocks of it
    d = s.schedule(token_request(short), eps).decision
    assert d.primary == "b:1"
    assert d.estimates["a:1"].reloaded_tokens == 0


def test_decision_carries_every_scored_candidates_estimate_and_the_mode() -> None:
    eps = [endpoint("a:1", waiting=2), endpoint("b:1"), endpoint("c:1", observed_at=NOW - 10)]
    d = scheduler().schedule(chat_request("y" * 2000), eps).decision
    assert d.mode == "load-only"
    assert set(d.estimates) == {"a:1", "b:1"}  # c:1 was filtered (stale metrics) before scoring
    assert d.primary == "b:1"
    assert d.estimates["a:1"].queue_s > 0 == d.estimates["b:1"].queue_s


def test_own_backlog_from_the_datastore_moves_the_next_pick() -> None:
    from epp.datastore import Datastore

    clock = FakeClock(NOW)
    ds = Datastore(clock)
    for pod in ("a:1", "b:1"):
        ds.add_endpoint(pod)
        ds.record_metrics(pod, endpoint(pod).metrics)  # type: ignore[arg-type]
    s = scheduler(yaml_text=_ZERO_BAND_YAML)
    req = token_request(list(range(4096)))
    picks = []
    for _ in range(4):
        d = s.schedule(req, ds.candidates()).decision
        picks.append(d.primary)
        ds.begin(d.primary, 4096, d.estimates[d.primary].work, first_token_by=NOW + 30)
    assert Counter(picks) == {"a:1": 2, "b:1": 2}
    assert ds.candidates()[0].prefill_backlog == P.work(4096, 0) + P.work(4096, 0)


def test_prefill_work_of_the_estimate_is_what_joins_the_backlog() -> None:
    _, st = score(make_scorer(), token_request(list(range(3000))), [endpoint("a:1")])
    assert st.data[ESTIMATES]["a:1"].work == PrefillWork(1, 3000, 3000 * 1500.0)


def test_a_batchs_other_items_are_prefilled_on_the_pod_with_no_credit() -> None:
    """A completion's batch keys its first item only; the engine prefills every item on the pod picked, so
    the estimate counts the rest (`batch_tokens`) as uncached prompt."""
    svc = kv_service()
    prompt = list(range(4096))
    hold(svc, "a:1", prompt, "gpu", 1)
    fresh(svc, "b:1")
    single = token_request(prompt)
    batch = InferenceRequest(
        single.request_id,
        single.api_kind,
        "m",
        prompt=prompt,
        prompt_tokens_estimate=4096 + 1000,
        batch_tokens=1000,
    )
    _, st1 = score(make_scorer({KV_KEY: svc}), single, [endpoint("a:1"), endpoint("b:1")])
    _, st2 = score(make_scorer({KV_KEY: svc}), batch, [endpoint("a:1"), endpoint("b:1")])
    one, both = st1.data[ESTIMATES], st2.data[ESTIMATES]
    for pod in ("a:1", "b:1"):
        assert both[pod].prompt_tokens == one[pod].prompt_tokens + 1000
        assert both[pod].cached_tokens == one[pod].cached_tokens  # only the first item is credited
        assert both[pod].ttft_s > one[pod].ttft_s
