"""The cost model: profiles (KV bytes, prefill/decode/reload formulas), the TTFT estimate term by term,
and the per-model CostModel service. Expected values are computed from the profile, not hard-coded."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import pytest

from epp.costmodel.estimate import estimate_ttft, tier_order
from epp.costmodel.profile import (
    DEFAULT_REFERENCE,
    REFERENCE_PROFILES,
    ModelProfile,
    ProfileError,
    TierCost,
    build_profile,
    kv_bytes_per_token,
)
from epp.costmodel.service import ANY_MODEL, CostModel, CostModelSettings, parse_cost_model
from epp.testing.fakes import endpoint
from epp.types import NO_WORK, Endpoint, PrefillWork

P = REFERENCE_PROFILES[DEFAULT_REFERENCE]


# -- profile ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layers", "kv_heads", "head_dim", "dtype_bytes"),
    [(32, 8, 128, 2), (80, 8, 128, 2), (28, 4, 128, 1), (1, 1, 1, 0.5)],
)
def test_kv_bytes_per_token_is_two_x_layers_x_kv_heads_x_head_dim_x_dtype(
    layers: int, kv_heads: int, head_dim: int, dtype_bytes: float
) -> None:
    assert kv_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes) == pytest.approx(
        2 * layers * kv_heads * head_dim * dtype_bytes
    )


def test_reference_profile_is_llama_8b_gqa_in_bf16() -> None:
    assert P.kv_bytes_per_token == 128 * 1024 == kv_bytes_per_token(32, 8, 128, 2)
    assert set(P.tiers) == {"cpu", "storage"}
    assert P.tiers["cpu"].bandwidth_bytes_per_s > P.tiers["storage"].bandwidth_bytes_per_s


@pytest.mark.parametrize(("uncached", "cached"), [(1, 0), (1000, 0), (512, 4096), (8000, 100)])
def test_prefill_cost_has_fixed_linear_and_attention_terms(uncached: int, cached: int) -> None:
    expected = (
        P.prefill_fixed_s
        + P.prefill_per_token_s * uncached
        + P.prefill_per_pair_s * uncached * (cached + uncached / 2)
    )
    assert P.prefill_s(uncached, cached) == pytest.approx(expected)
    assert P.work(uncached, cached) == PrefillWork(1, uncached, uncached * (cached + uncached / 2))


def test_prefill_work_adds_up_over_requests() -> None:
    works = [P.work(1000, 0), P.work(300, 2000), P.work(0, 500)]
    total = works[0] + works[1] + works[2]
    assert total.requests == 3
    expected = P.prefill_s(1000, 0) + P.prefill_s(300, 2000) + P.prefill_s(0, 500)
    assert P.work_s(total) == pytest.approx(expected)
    assert P.work(0, 500) == PrefillWork(1, 0, 0.0)  # a fully cached request still costs one step
    assert P.work_s(NO_WORK) == 0.0


def test_decode_step_cost() -> None:
    assert P.decode_step_s(10, 20_000) == pytest.approx(
        P.decode_fixed_s + 10 * P.decode_per_sequence_s + 20_000 * P.decode_per_context_token_s
    )


def test_reload_cost_per_tier() -> None:
    cpu = P.tiers["cpu"]
    assert P.reload_s("cpu", 4096) == pytest.approx(
        cpu.latency_s + 4096 * P.kv_bytes_per_token / cpu.bandwidth_bytes_per_s
    )
    assert P.reload_s("gpu", 4096) == 0.0
    assert P.reload_s("cpu", 0) == 0.0
    assert P.reload_s("tape", 4096) is None


def test_tier_order_is_fastest_first() -> None:
    prof = replace(P, tiers={"storage": TierCost(5e9), "cpu": TierCost(25e9), "remote": TierCost(1e9)})
    assert tier_order(prof) == ["cpu", "storage", "remote"]


# -- build_profile ------------------------------------------------------------------------------
def test_build_profile_defaults_to_the_reference() -> None:
    model, prof = build_profile({})
    assert model == ANY_MODEL
    assert prof == P


def test_build_profile_from_architecture_and_partial_overrides() -> None:
    model, prof = build_profile(
        {
            "model": "llama-70b",
            "architecture": {"layers": 80, "kvHeads": 8, "headDim": 128, "dtypeBytes": 1},
            "prefill": {"perTokenSeconds": 1.2e-4},
            "decode": {"perSequenceSeconds": 1e-4},
            "maxBatchedTokens": 4096,
            "tiers": {"CPU": {"bandwidthBytesPerSecond": 1e10}, "nvme": {"bandwidthBytesPerSecond": 2e9}},
            "unknownRequestTokens": 0,
            "kvWaitSteps": 0,
        }
    )
    assert model == "llama-70b"
    assert prof.name == "llama-70b"
    assert prof.kv_bytes_per_token == 2 * 80 * 8 * 128 * 1
    assert prof.prefill_per_token_s == 1.2e-4
    # unset fields come from the reference
    assert prof.prefill_fixed_s == P.prefill_fixed_s
    assert prof.prefill_per_pair_s == P.prefill_per_pair_s
    assert prof.decode_per_sequence_s == 1e-4
    assert prof.decode_fixed_s == P.decode_fixed_s
    assert prof.max_batched_tokens == 4096
    assert prof.tiers["cpu"] == TierCost(1e10, 0.0)  # tier names are lower-cased; given ones replace
    assert prof.tiers["nvme"] == TierCost(2e9, 0.0)
    assert prof.tiers["storage"] == P.tiers["storage"]
    assert (prof.unknown_request_tokens, prof.kv_wait_steps) == (0, 0)


def test_build_profile_takes_kv_bytes_per_token_as_given() -> None:
    assert build_profile({"kvBytesPerToken": 65536})[1].kv_bytes_per_token == 65536


@pytest.mark.parametrize(
    ("raw", "field", "fragment"),
    [
        ({"reference": "gpt-9-on-abacus"}, "reference", "unknown reference profile 'gpt-9-on-abacus'"),
        (
            {"kvBytesPerToken": 1024, "architecture": {"layers": 1, "kvHeads": 1, "headDim": 1}},
            "kvBytesPerToken",
            "not both",
        ),
        ({"kvBytesPerToken": 0}, "kvBytesPerToken", "> 0"),
        ({"prefill": {"perTokenSeconds": -1e-5}}, "prefill.perTokenSeconds", ">= 0"),
        ({"prefill": {"perPairSeconds": float("nan")}}, "prefill.perPairSeconds", "finite"),
        ({"prefill": {"fixedSeconds": float("inf")}}, "prefill.fixedSeconds", "finite"),
        ({"decode": {"perContextTokenSeconds": -1}}, "decode.perContextTokenSeconds", ">= 0"),
        ({"prefill": {"perTokenSeconds": "fast"}}, "prefill.perTokenSeconds", "Expected"),
        ({"architecture": {"layers": 0, "kvHeads": 8, "headDim": 128}}, "architecture.layers", ">= 1"),
        ({"architecture": {"layers": 2, "kvHeads": 0, "headDim": 128}}, "architecture.kvHeads", ">= 1"),
        ({"architecture": {"layers": 2, "kvHeads": 8, "headDim": 0}}, "architecture.headDim", ">= 1"),
        (
            {"architecture": {"layers": 2, "kvHeads": 8, "headDim": 64, "dtypeBytes": 0}},
            "architecture.dtypeBytes",
            "> 0",
        ),
        ({"architecture": {"layers": 32}}, "architecture", "kvHeads"),
        ({"maxBatchedTokens": 0}, "maxBatchedTokens", ">= 1"),
        ({"tiers": {"gpu": {"bandwidthBytesPerSecond": 1e12}}}, "tiers.gpu", "gpu tier"),
        ({"tiers": {"cpu": {"bandwidthBytesPerSecond": 0}}}, "tiers.cpu.bandwidthBytesPerSecond", "> 0"),
        (
            {"tiers": {"cpu": {"bandwidthBytesPerSecond": 1e9, "latencySeconds": -0.1}}},
            "tiers.cpu.latencySeconds",
            ">= 0",
        ),
        ({"unknownRequestTokens": -1}, "unknownRequestTokens", ">= 0"),
        ({"kvWaitSteps": -1}, "kvWaitSteps", ">= 0"),
        ({"asyncScheduling": "sometimes"}, "asyncScheduling", "Expected `bool"),
        ({"asyncScheduling": 2}, "asyncScheduling", "Expected `bool"),
        ({"model": ""}, "model", "model name"),
        ({"prefill": {"perTokens": 1}}, "prefill", "unknown field `perTokens`"),
        ({"perTokenSeconds": 1e-5}, "perTokenSeconds", "unknown field `perTokenSeconds`"),
    ],
)
def test_build_profile_errors_name_the_field(raw: dict[str, object], field: str, fragment: str) -> None:
    with pytest.raises(ProfileError) as err:
        build_profile(raw)
    assert err.value.field == field
    assert fragment in err.value.message
    assert str(err.value).startswith(f"{field}: ")


# -- estimate_ttft ------------------------------------------------------------------------------
def test_idle_pod_without_cache_costs_just_the_prefill() -> None:
    est = estimate_ttft(P, endpoint("a:1"), 4096)
    assert est.prefill_s == pytest.approx(P.prefill_s(4096, 0))
    assert (est.queue_s, est.reload_s, est.decode_s) == (0.0, 0.0, 0.0)
    assert est.ttft_s == pytest.approx(P.prefill_s(4096, 0))
    assert (est.prompt_tokens, est.cached_tokens, est.reloaded_tokens) == (4096, 0, 0)
    assert est.work == P.work(4096, 0)


@pytest.mark.parametrize("held", [4096, 5000])
def test_at_most_prompt_minus_one_tokens_count_as_cached(held: int) -> None:
    est = estimate_ttft(P, endpoint("a:1"), 4096, {"gpu": held})
    assert est.cached_tokens == 4095
    assert est.prefill_s == pytest.approx(P.prefill_s(1, 4095))
    assert est.work == PrefillWork(1, 1, 1 * (4095 + 0.5))


@pytest.mark.parametrize(
    ("prompt", "held", "block", "metrics_block", "cached"),
    [
        (4096, 4096, 16, None, 4080),  # a block-aligned prompt recomputes its whole last block
        (4100, 4100, 16, None, 4096),
        (4100, 4090, 16, None, 4080),  # a partial block of the hit is no hit
        (4096, 4096, 16, 64, 4032),  # the engine's own block size (from its metrics) decides
        (40, 40, 64, None, 0),
    ],
)
def test_hits_count_in_whole_engine_blocks(
    prompt: int, held: int, block: int, metrics_block: int | None, cached: int
) -> None:
    ep = endpoint("a:1", block_size=metrics_block, num_gpu_blocks=10**6 if metrics_block else None)
    assert estimate_ttft(P, ep, prompt, {"gpu": held}, block_size=block).cached_tokens == cached
    on_cpu = estimate_ttft(P, ep, prompt, {"cpu": held}, block_size=block)
    assert on_cpu.cached_tokens in (0, cached)  # reloaded whole blocks, or recomputed


def test_empty_prompt_counts_as_one_token() -> None:
    est = estimate_ttft(P, endpoint("a:1"), 0, {"gpu": 64})
    assert (est.prompt_tokens, est.cached_tokens) == (1, 0)
    assert est.prefill_s == pytest.approx(P.prefill_s(1, 0))


def test_partial_gpu_prefix_prefills_only_the_rest() -> None:
    est = estimate_ttft(P, endpoint("a:1"), 4096, {"gpu": 1024})
    assert est.cached_tokens == 1024
    assert est.reloaded_tokens == 0
    assert est.prefill_s == pytest.approx(P.prefill_s(3072, 1024))


def test_queue_is_own_backlog_plus_scraped_waiting_the_epp_did_not_route() -> None:
    backlog = P.work(2000, 0) + P.work(500, 1000)
    unk = P.unknown_request_tokens
    est = estimate_ttft(P, endpoint("a:1", waiting=5, backlog=backlog), 100)
    # 5 waiting, 2 of them ours: 3 unknown requests of `unknown_request_tokens` each
    assert est.queue_s == pytest.approx(P.work_s(backlog) + 3 * P.prefill_s(unk, 0))
    # fewer waiting than our own backlog: no negative unknown load
    est = estimate_ttft(P, endpoint("a:1", waiting=1, backlog=backlog), 100)
    assert est.queue_s == pytest.approx(P.work_s(backlog))
    # no scraped metrics at all: only our own backlog counts
    est = estimate_ttft(P, endpoint("a:1", observed_at=None, backlog=backlog), 100)
    assert est.queue_s == pytest.approx(P.work_s(backlog))


def test_decode_interference_counts_own_and_unknown_running_requests_per_prefill_step() -> None:
    unk = P.unknown_request_tokens
    prompt = 20_000
    ep = endpoint("a:1", running=7, waiting=2, decoding=3, decoding_tokens=9000)
    est = estimate_ttft(P, ep, prompt)
    sequences = 3 + (7 - 3)
    context = 9000 + (7 - 3) * unk
    steps = math.ceil((2 * unk + prompt) / P.max_batched_tokens)
    assert steps > 1
    assert est.decode_s == pytest.approx(
        steps * (P.decode_per_sequence_s * sequences + P.decode_per_context_token_s * context)
    )
    assert estimate_ttft(P, endpoint("a:1", running=0), prompt).decode_s == 0.0


@pytest.mark.parametrize(("asynchronous", "waits"), [(True, 1.5), (False, 0.5)])
def test_a_decoding_pod_with_nothing_queued_adds_the_decode_steps_an_arrival_waits(
    asynchronous: bool, waits: float
) -> None:
    """A pod that decodes is always mid-step: an arrival waits about half a step before its prefill, and,
    with async scheduling (the default), the whole step the engine scheduled ahead. With a backlog (own
    or unknown waiting requests) the step in progress is the backlog's, counted whole."""
    p = dataclasses.replace(P, async_scheduling=asynchronous)
    assert P.async_scheduling and build_profile({"asyncScheduling": "false"})[1].async_scheduling is False
    prompt = 2_000
    steps = math.ceil(prompt / P.max_batched_tokens)
    per_step = P.decode_per_sequence_s * 5 + P.decode_per_context_token_s * 4000
    busy = estimate_ttft(p, endpoint("a:1", running=5, decoding=5, decoding_tokens=4000), prompt)
    assert busy.decode_s == pytest.approx(steps * per_step + waits * P.decode_step_s(5, 4000))
    backlog = estimate_ttft(
        p, endpoint("a:1", running=5, decoding=5, decoding_tokens=4000, backlog=P.work(500, 0)), prompt
    )
    assert backlog.decode_s == pytest.approx(math.ceil((500 + prompt) / P.max_batched_tokens) * per_step)
    waiting = estimate_ttft(
        p, endpoint("a:1", running=5, waiting=1, decoding=5, decoding_tokens=4000), prompt
    )
    unk = P.unknown_request_tokens
    assert waiting.decode_s == pytest.approx(math.ceil((unk + prompt) / P.max_batched_tokens) * per_step)
    idle = estimate_ttft(p, endpoint("a:1"), prompt)
    assert idle.decode_s == 0.0
    # the half step makes the busier of two otherwise equal pods the slower one
    quieter = estimate_ttft(p, endpoint("a:1", running=2, decoding=2, decoding_tokens=4000), prompt)
    assert quieter.ttft_s < busy.ttft_s


def test_kv_wait_is_added_only_when_free_kv_cannot_hold_the_uncached_prompt() -> None:
    unk = P.unknown_request_tokens

    def ep() -> Endpoint:  # 10% of 100 blocks x 16 tokens free: 160 tokens
        return endpoint("a:1", running=4, kv_usage=0.9, num_gpu_blocks=100, block_size=16)

    big = estimate_ttft(P, ep(), 1000)
    wait = P.kv_wait_steps * P.decode_step_s(4, 4 * unk)
    assert big.queue_s == pytest.approx(wait)
    small = estimate_ttft(P, ep(), 100)
    assert small.queue_s == 0.0
    # a cached prefix does not need free blocks: only the uncached part counts
    cached = estimate_ttft(P, ep(), 1000, {"gpu": 950})
    assert cached.queue_s == 0.0
    # without the pool size from the scrape there is no KV-wait term
    assert estimate_ttft(P, endpoint("a:1", running=4, kv_usage=0.99), 1000).queue_s == 0.0
    # blocks reloaded from a slower tier need free GPU blocks as much as recomputed ones
    reloaded = estimate_ttft(P, ep(), 1000, {"cpu": 992})
    assert reloaded.reloaded_tokens > 0 and reloaded.queue_s == pytest.approx(wait)


def test_calibrated_scales_multiply_queue_and_prefill_but_nominal_terms_stay_unscaled() -> None:
    ep = endpoint("a:1", waiting=3)
    base = estimate_ttft(P, ep, 3000)
    scaled = estimate_ttft(P, ep, 3000, prefill_scale=0.5, queue_scale=2.0)
    assert scaled.prefill_s == pytest.approx(0.5 * base.prefill_s)
    assert scaled.queue_s == pytest.approx(2.0 * base.queue_s)
    assert scaled.prefill_nominal_s == pytest.approx(base.prefill_s)
    assert scaled.queue_nominal_s == pytest.approx(base.queue_s)


# -- reload versus recompute --------------------------------------------------------------------
def test_long_prompt_held_on_cpu_is_reloaded_because_it_is_cheaper_than_recomputing() -> None:
    n = 16 * 1024
    est = estimate_ttft(P, endpoint("a:1"), n, {"cpu": n})
    recompute = P.prefill_s(n, 0)
    reload = P.reload_s("cpu", n - 1)
    assert reload is not None
    assert reload + P.prefill_s(1, n - 1) < recompute
    assert est.reloaded_tokens == n - 1 > 0
    assert est.cached_tokens == n - 1
    assert est.reload_s == pytest.approx(reload)
    assert est.prefill_s == pytest.approx(P.prefill_s(1, n - 1))
    assert est.ttft_s < recompute


def test_tiny_prompt_held_on_storage_is_recomputed() -> None:
    n = 32
    est = estimate_ttft(P, endpoint("a:1"), n, {"storage": n})
    reload = P.reload_s("storage", n - 1)
    assert reload is not None
    assert P.tiers["storage"].latency_s == pytest.approx(0.010)
    assert reload + P.prefill_s(1, n - 1) > P.prefill_s(n, 0)
    assert est.reloaded_tokens == 0
    assert est.cached_tokens == 0
    assert est.reload_s == 0.0
    assert est.ttft_s == pytest.approx(P.prefill_s(n, 0))


def test_gpu_prefix_plus_cpu_blocks_reloads_only_the_cpu_part() -> None:
    n = 8192
    est = estimate_ttft(P, endpoint("a:1"), n, {"gpu": 1024, "cpu": 6144})
    assert est.cached_tokens == 1024 + 6144
    assert est.reloaded_tokens == 6144
    assert est.reload_s == pytest.approx(P.reload_s("cpu", 6144))
    assert est.prefill_s == pytest.approx(P.prefill_s(n - 7168, 7168))


def test_a_slower_tier_is_skipped_when_its_reload_costs_more_than_recomputing_its_blocks() -> None:
    n = 16 * 1024
    held = {"cpu": 8192, "storage": 16}  # 16 tokens behind a 10 ms storage latency
    est = estimate_ttft(P, endpoint("a:1"), n, held)
    cpu_only = P.reload_s("cpu", 8192) + P.prefill_s(n - 8192, 8192)  # type: ignore[operator]
    both = P.reload_s("cpu", 8192) + P.reload_s("storage", 16) + P.prefill_s(n - 8208, 8208)  # type: ignore[operator]
    assert cpu_only < both
    assert est.reloaded_tokens == 8192
    assert est.reload_s + est.prefill_s == pytest.approx(cpu_only)


def test_blocks_on_a_tier_the_profile_has_no_cost_for_get_no_credit() -> None:
    est = estimate_ttft(P, endpoint("a:1"), 4096, {"tape": 4096})
    assert (est.cached_tokens, est.reloaded_tokens, est.reload_s) == (0, 0, 0.0)


# -- the scenarios the picker exists for --------------------------------------------------------
def test_a_gpu_hit_behind_a_three_second_queue_loses_to_an_idle_pod_without_cache() -> None:
    n = 4096
    per_waiting = P.prefill_s(P.unknown_request_tokens, 0)
    waiting = math.ceil(3.0 / per_waiting)
    hit = estimate_ttft(P, endpoint("a:1", waiting=waiting), n, {"gpu": n})
    idle = estimate_ttft(P, endpoint("b:1"), n)
    assert hit.cached_tokens == n - 1
    assert 3.0 <= hit.queue_s < 3.0 + per_waiting
    assert idle.ttft_s == pytest.approx(P.prefill_s(n, 0))
    assert idle.ttft_s < hit.ttft_s


def _load_worth_less_than(savings: float) -> int:
    """Waiting requests whose queue costs about half of `savings`."""
    return int(0.5 * savings / P.prefill_s(P.unknown_request_tokens, 0))


def test_cpu_held_long_prefix_with_some_load_beats_an_idle_pod_but_a_short_one_does_not() -> None:
    long_n = 16 * 1024
    savings = P.prefill_s(long_n, 0) - P.reload_s("cpu", long_n - 1) - P.prefill_s(1, long_n - 1)  # type: ignore[operator]
    waiting = _load_worth_less_than(savings)
    assert waiting >= 1

    held = estimate_ttft(P, endpoint("a:1", waiting=waiting), long_n, {"cpu": long_n})
    idle = estimate_ttft(P, endpoint("b:1"), long_n)
    assert held.queue_s > 0 and held.reloaded_tokens > 0
    assert held.ttft_s < idle.ttft_s

    short_n = 32
    held = estimate_ttft(P, endpoint("a:1", waiting=waiting), short_n, {"cpu": short_n})
    idle = estimate_ttft(P, endpoint("b:1"), short_n)
    assert held.reloaded_tokens == 0  # not worth reloading: recomputed, so the load decides
    assert idle.ttft_s < held.ttft_s


# -- the service: per-model profiles and calibration -------------------------------------------
def test_parse_cost_model_none_is_the_reference_for_every_model() -> None:
    settings = parse_cost_model(None)
    assert dict(settings.profiles) == {ANY_MODEL: P}
    cm = CostModel(settings)
    assert cm.profile("anything") is P
    assert cm.profile_key("anything") == ANY_MODEL


def test_per_model_profiles_with_a_star_fallback() -> None:
    settings = parse_cost_model(
        {
            "profiles": [
                {"model": "big", "prefill": {"perTokenSeconds": 1e-4}},
                {"model": "*", "kvBytesPerToken": 4096},
            ]
        }
    )
    cm = CostModel(settings)
    assert cm.profile_key("big") == "big"
    assert cm.profile("big").prefill_per_token_s == 1e-4
    assert cm.profile("small").kv_bytes_per_token == 4096
    assert cm.profile("small").prefill_per_token_s == P.prefill_per_token_s
    est_big = cm.estimate("big", endpoint("a:1"), 2048, None)
    est_small = cm.estimate("small", endpoint("a:1"), 2048, None)
    assert est_big.prefill_s == pytest.approx(cm.profile("big").prefill_s(2048, 0))
    assert est_small.prefill_s == pytest.approx(cm.profile("small").prefill_s(2048, 0))


def test_a_model_specific_profile_leaves_the_reference_as_fallback() -> None:
    settings = parse_cost_model({"profiles": [{"model": "m"}]})
    assert set(settings.profiles) == {"m", ANY_MODEL}
    assert settings.profiles[ANY_MODEL] is P
    assert settings.profiles["m"].name == "m"


def test_estimates_use_each_models_own_calibration_and_coefficients_report_it() -> None:
    cm = CostModel()
    ep = endpoint("a:1")
    assert cm.coefficients() == {}
    before = cm.estimate("m", ep, 2000, None)
    for _ in range(50):  # every request took half the estimated prefill
        est = cm.estimate("m", ep, 2000, None)
        assert cm.observe("m", est, 0.5 * before.prefill_s) is True
    after = cm.estimate("m", ep, 2000, None)
    assert after.prefill_s == pytest.approx(0.5 * before.prefill_s, rel=0.02)
    assert after.prefill_nominal_s == pytest.approx(before.prefill_s)
    assert cm.estimate("other", ep, 2000, None).prefill_s == pytest.approx(before.prefill_s)
    coeffs = cm.coefficients()
    assert list(coeffs) == ["m"]
    assert coeffs["m"]["prefill_scale"] == pytest.approx(0.5, rel=0.02)
    assert coeffs["m"]["prefill_seconds_per_token"] == pytest.approx(
        P.prefill_per_token_s * coeffs["m"]["prefill_scale"]
    )
    assert coeffs["m"]["observations"] == 50


def test_parse_cost_model_reads_calibration_settings() -> None:
    raw = {"calibration": {"enabled": False, "forgetting": 0.95, "minScale": 0.5, "warmup": 3}}
    s = parse_cost_model(raw)
    assert (s.calibration.enabled, s.calibration.forgetting, s.calibration.min_scale) == (False, 0.95, 0.5)
    assert s.calibration.warmup == 3
    assert parse_cost_model({"calibration": {"warmup": 5}}).calibration.warmup == 5
    assert isinstance(s, CostModelSettings)


@pytest.mark.parametrize(
    ("raw", "field", "fragment"),
    [
        ({"profile": []}, "profile", "unknown field"),
        ({"profiles": {"model": "m"}}, "profiles", "must be a list"),
        ({"profiles": ["m"]}, "profiles[0]", "must be a mapping"),
        (
            {"profiles": [{"model": "a"}, {"model": "b", "reference": "x"}]},
            "profiles[1].reference",
            "unknown reference profile 'x'",
        ),
        ({"profiles": [{"model": "a"}, {"model": "a"}]}, "profiles[1].model", "duplicate"),
        (
            {"profiles": [{"prefill": {"perTokenSeconds": -1}}]},
            "profiles[0].prefill.perTokenSeconds",
            ">= 0",
        ),
        ({"calibration": {"forgetting": 0.2}}, "calibration.forgetting", "[0.5, 1]"),
        ({"calibration": {"minScale": 0}}, "calibration.minScale", "(0, 1]"),
        ({"calibration": {"maxScale": 0.5}}, "calibration.maxScale", ">= 1"),
        ({"calibration": {"maxScale": float("inf")}}, "calibration.maxScale", "finite"),
        ({"calibration": {"outlierThreshold": 0}}, "calibration.outlierThreshold", "> 0"),
        ({"calibration": {"outlierThreshold": float("inf")}}, "calibration.outlierThreshold", "finite"),
        ({"profiles": {}}, "profiles", "must be a list"),
        ({"calibration": []}, "calibration", "must be a mapping"),
        ({"calibration": {"warmup": -1}}, "calibration.warmup", "must be"),
        ({"calibration": {"forgetting": "slow"}}, "calibration.forgetting", "Expected"),
        ({"calibration": {"learningRate": 1}}, "calibration.learningRate", "unknown field `learningRate`"),
        (
            {"profiles": [{"model": "m", "perTokenSeconds": 1}]},
            "profiles[0].perTokenSeconds",
            "unknown field",
        ),
    ],
)
def test_parse_cost_model_errors_name_the_field(raw: dict[str, object], field: str, fragment: str) -> None:
    with pytest.raises(ProfileError) as err:
        parse_cost_model(raw)
    assert err.value.field == field
    assert fragment in err.value.message


def test_profile_dataclass_defaults() -> None:
    prof = ModelProfile("x", 1.0, 0, 0, 0, 0, 0, 0)
    assert prof.tiers == {}
    assert prof.reload_s("cpu", 10) is None
    assert estimate_ttft(prof, endpoint("a:1"), 100, {"cpu": 100}).reloaded_tokens == 0


def test_own_requests_in_prefill_are_not_counted_again_as_unknown_running_load() -> None:
    # two requests this EPP routed are past the engine's queue (running, still in prefill)
    ep = endpoint("a:1", waiting=0, running=2, backlog=PrefillWork(2, 2000, 2e6))
    assert estimate_ttft(P, ep, 100).decode_s == 0.0
    # a third running request the EPP does not know decodes alongside
    other = endpoint("a:1", waiting=0, running=3, backlog=PrefillWork(2, 2000, 2e6))
    assert estimate_ttft(P, other, 100).decode_s > 0.0


@pytest.mark.parametrize(
    ("name", "index_tier"), [("disk", "storage"), ("CPU_PINNED", "cpu"), ("FS", "storage")]
)
def test_a_profile_tier_named_as_an_engine_medium_is_refused_naming_the_index_tier(
    name: str, index_tier: str
) -> None:
    """The index files engines' media under its own tier names (DISK -> storage): a cost given under the
    medium's name would never apply."""
    with pytest.raises(ProfileError, match=rf"tiers\.{name}: .*under the tier '{index_tier}'"):
        build_profile({"tiers": {name: {"bandwidthBytesPerSecond": 5e9}}})
    with pytest.raises(ProfileError, match=r"tiers\.GPU: the gpu tier is free"):
        build_profile({"tiers": {"GPU": {"bandwidthBytesPerSecond": 5e9}}})
    custom = build_profile({"tiers": {"nvme-pool": {"bandwidthBytesPerSecond": 5e9}}})[1]
    assert "nvme-pool" in custom.tiers  # a tier of its own (an engine sending that medium) is kept
