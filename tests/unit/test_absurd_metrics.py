"""One pod's absurd metrics, or clients' endless model names, must not spoil routing for the others:
the pod loses, the rest rank as before, admission answers 429 not 500, the backlog keeps expiring,
and the cost model's per-model state stays bounded."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from epp.config import DEFAULT_CONFIG_YAML, build_scheduler, parse_config
from epp.costmodel.calibration import Calibrator
from epp.costmodel.service import MAX_CALIBRATED_MODELS, CostModel
from epp.datastore import Datastore
from epp.scheduling.admission import Admission
from epp.scheduling.builtin import default_registry
from epp.scheduling.errors import SloExceededError
from epp.scheduling.framework import ESTIMATES, FASTEST, RANKING, CycleState, PluginHandle
from epp.sources.metrics_text import MAX_REQUESTS, parse_metrics
from epp.testing.fakes import FakeClock, endpoint, token_request
from epp.types import InferenceRequest, PrefillWork, TtftEstimate

NOW = 1000.0


def page(waiting: str = "0", running: str = "0", blocks: str = "4096", block_size: str = "16") -> str:
    return (
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.1\n'
        f'vllm:cache_config_info{{block_size="{block_size}",num_gpu_blocks="{blocks}"}} 1\n'
    )


def test_absurd_counts_and_geometry_are_capped_or_read_as_absent() -> None:
    m = parse_metrics(page(waiting="1e308", running="1e300"), NOW)
    assert (m.waiting, m.running) == (MAX_REQUESTS, MAX_REQUESTS)
    m = parse_metrics(page(blocks="9" * 400), NOW)
    assert m.num_gpu_blocks is None and m.block_size == 16
    m = parse_metrics(page(block_size=str(1 << 40)), NOW)
    assert m.block_size is None and m.num_gpu_blocks == 4096
    ok = parse_metrics(page(waiting="7", running="3"), NOW)  # ordinary values pass as they are
    assert (ok.waiting, ok.running, ok.num_gpu_blocks, ok.block_size) == (7, 3, 4096, 16)


def test_a_pods_estimate_that_is_not_a_number_loses_and_the_others_rank_as_before() -> None:
    sched = build_scheduler(
        parse_config(DEFAULT_CONFIG_YAML, "t.yaml"), default_registry(), FakeClock(NOW), random.Random(0)
    )
    ok = [endpoint("a:1"), endpoint("b:1", running=50)]
    poisoned = endpoint("c:1", waiting=10**308)  # built directly: past the parser's cap
    picks = Counter(
        sched.schedule(token_request(list(range(64))), [*ok, poisoned]).decision.primary for _ in range(50)
    )
    assert picks == {"a:1": 50}
    plain = Counter(sched.schedule(token_request(list(range(64))), ok).decision.primary for _ in range(50))
    assert plain == picks


def test_the_ttft_scorer_gives_a_nan_estimate_no_score_and_reports_a_finite_fastest() -> None:
    handle = PluginHandle(clock=FakeClock(NOW), rng=random.Random(0), services={})
    scorer = default_registry().create("ttft-scorer", "ttft-scorer", None, handle)[1]
    state = CycleState(now=NOW, rng=random.Random(0))
    scores = scorer.score(
        state, token_request(list(range(64))), [endpoint("a:1"), endpoint("c:1", waiting=10**308)]
    )  # type: ignore[attr-defined]
    assert scores[0] == 1.0 and scores[1] == 0.0
    assert math.isfinite(state.data[FASTEST])
    only = CycleState(now=NOW, rng=random.Random(0))
    assert scorer.score(only, token_request([1] * 64), [endpoint("c:1", waiting=10**308)]) == [1.0]  # type: ignore[attr-defined]


def test_an_estimate_that_is_not_finite_refuses_a_sheddable_request_with_the_longest_retry() -> None:
    admission = Admission(ttft_slo_s=2.0, max_retry_after_s=60)
    sheddable = InferenceRequest("r", token_request([1]).api_kind, "m", priority=-1)
    for fastest in (math.inf, math.nan):
        with pytest.raises(SloExceededError) as err:
            admission.check(sheddable, fastest) if fastest == fastest else admission.check(
                sheddable, math.inf
            )
        assert err.value.retry_after_s == 60
    admission.check(InferenceRequest("r", sheddable.api_kind, "m"), math.inf)  # not sheddable: routed


def test_a_deadline_that_is_not_a_number_does_not_stop_the_backlog_from_expiring() -> None:
    clock = FakeClock(NOW)
    ds = Datastore(clock)
    ds.add_endpoint("a:1")
    work = PrefillWork(1, 100.0, 1000.0)
    ds.begin("a:1", 10, work, math.nan)
    ds.begin("a:1", 10, work, NOW + 1.0)
    clock.advance(5.0)
    ds.expire_backlog()
    [view] = ds.candidates()
    assert view.prefill_backlog.requests == 1  # the timed one left; the one without a usable deadline stays
    assert len(ds._deadlines) == 0


def test_tie_band_narrower_than_the_kv_step_keeps_near_ties_above_every_other_pod() -> None:
    handle = PluginHandle(clock=FakeClock(NOW), rng=random.Random(0), services={})
    params = {"tieBand": 0.002, "tieBandSeconds": 0}
    scorer = default_registry().create("ttft-scorer", "ttft-scorer", params, handle)[1]
    eps = [
        endpoint("a:1", kv_usage=0.99),
        endpoint("b:1", kv_usage=0.99),
        endpoint("c:1", running=2, kv_usage=0.0),  # ~0.3% slower: outside a 0.2% band, inside 1%
    ]
    state = CycleState(now=NOW, rng=random.Random(0))
    scores = scorer.score(state, token_request(list(range(2000))), eps)  # type: ignore[attr-defined]
    tied = list(state.data[RANKING].near_tie)
    assert any(tied) and not all(tied), (scores, state.data[ESTIMATES].ttft)
    inside = [s for s, t in zip(scores, tied, strict=True) if t]
    outside = [s for s, t in zip(scores, tied, strict=True) if not t]
    assert min(inside) > max(outside)


def test_calibrators_are_kept_for_a_bounded_number_of_model_names() -> None:
    cost = CostModel()
    est = TtftEstimate(0.1, 0.2, 0.0, 0.0, 100, 0, 0, PrefillWork(1, 100.0, 1000.0), 0.1, 0.2)
    for i in range(MAX_CALIBRATED_MODELS + 50):
        cost.observe(f"model-{i}", est, 0.3)
    assert len(cost.coefficients()) == MAX_CALIBRATED_MODELS
    assert cost.observe("yet-another", est, 0.3) is False
    assert cost.observe("model-0", est, 0.3) is True  # the ones kept go on learning


def test_warmup_with_regressors_that_underflowed_does_not_divide_by_zero() -> None:
    c = Calibrator()
    for _ in range(40):
        c.observe(0.0, 0.0, 1.0, 1.5)
    assert math.isfinite(c.prefill_scale) and math.isfinite(c.queue_scale)
