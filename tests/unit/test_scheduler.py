"""The scheduler end to end on the pure core: config -> profile -> decision."""

from __future__ import annotations

import random

import pytest

from epp.config import LOAD_AWARE_CONFIG_YAML, build_scheduler, default_config, parse_config
from epp.scheduling.builtin import default_registry
from epp.scheduling.errors import AllFilteredError, NoEndpointsError, PoolSaturatedError
from epp.scheduling.scheduler import Scheduler
from epp.testing.fakes import FakeClock, chat_request, endpoint
from epp.types import PrefillWork

NOW = 1000.0


def scheduler(yaml_text: str | None = None, seed: int = 0, clock: FakeClock | None = None) -> Scheduler:
    cfg = default_config() if yaml_text is None else parse_config(yaml_text, "test.yaml")
    return build_scheduler(cfg, default_registry(), clock or FakeClock(NOW), random.Random(seed))


@pytest.mark.parametrize(
    ("endpoints", "winner"),
    [
        # requests the engine reports waiting (routed by someone else)
        ([endpoint("a:1", waiting=5), endpoint("b:1", waiting=0)], "b:1"),
        # this EPP's own prefill backlog on a
        ([endpoint("a:1", backlog=PrefillWork(2, 8000, 3.2e7)), endpoint("b:1")], "b:1"),
        # decode interference from many running requests
        ([endpoint("a:1", decoding=200, decoding_tokens=400_000), endpoint("b:1", decoding=1)], "b:1"),
        # a's free KV cannot hold the prompt: it waits for running requests to free blocks
        (
            [
                endpoint("a:1", kv_usage=0.99, num_gpu_blocks=100, block_size=16, running=8),
                endpoint("b:1", kv_usage=0.1, num_gpu_blocks=100, block_size=16, running=8),
            ],
            "b:1",
        ),
        # the stale endpoint is filtered even though it looks idle
        ([endpoint("a:1", observed_at=NOW - 5), endpoint("b:1", waiting=3, kv_usage=0.7)], "b:1"),
    ],
)
def test_default_profile_picks_the_smallest_estimated_ttft(endpoints: list, winner: str) -> None:  # type: ignore[type-arg]
    for seed in range(5):  # not a tie
        result = scheduler(seed=seed).schedule(chat_request("x" * 400), endpoints)
        assert result.decision.primary == winner
        assert result.decision.profile == "default"
        assert result.decision.mode == "load-only"
        assert set(result.decision.estimates) == {e.id for e in endpoints if e.metrics_age(NOW) < 2}


def test_scores_are_the_weighted_sum_of_clamped_scores() -> None:
    s = scheduler(LOAD_AWARE_CONFIG_YAML)
    d = s.schedule(
        chat_request(), [endpoint("a:1", waiting=0, kv_usage=0.25), endpoint("b:1", waiting=2)]
    ).decision
    # a: queue 1*2 + kv 0.75*2 + active 1*1 = 4.5 ; b: 0 + 1*2 + 1 = 3
    assert d.scores == pytest.approx({"a:1": 4.5, "b:1": 3.0})


def test_no_candidates_is_503_and_all_filtered_is_429() -> None:
    s = scheduler()
    with pytest.raises(NoEndpointsError) as e1:
        s.schedule(chat_request(), [])
    assert e1.value.status == 503
    with pytest.raises(AllFilteredError) as e2:
        s.schedule(chat_request(), [endpoint("a:1", observed_at=None)])
    assert e2.value.status == 429


@pytest.mark.parametrize(
    ("eps", "priority", "shed"),
    [
        ([endpoint("a:1", waiting=9)], -1, True),
        ([endpoint("a:1", kv_usage=0.95)], -1, True),
        ([endpoint("a:1", waiting=9), endpoint("b:1", waiting=0)], -1, False),
        ([endpoint("a:1", waiting=9)], 0, False),
        ([endpoint("a:1", waiting=9)], 5, False),
        # the reference's comparisons: saturated *above* a threshold (defaults 5 waiting, 0.8 KV usage)
        ([endpoint("a:1", waiting=5)], -1, False),
        ([endpoint("a:1", waiting=6)], -1, True),
        ([endpoint("a:1", kv_usage=0.8)], -1, False),
        ([endpoint("a:1", kv_usage=0.81)], -1, True),
    ],
)
def test_sheddable_requests_are_refused_by_a_saturated_pool(eps: list, priority: int, shed: bool) -> None:  # type: ignore[type-arg]
    s = scheduler()
    req = chat_request(priority=priority)
    if shed:
        with pytest.raises(PoolSaturatedError):
            s.schedule(req, eps)
    else:
        assert s.schedule(req, eps).decision.primary


def test_same_seed_same_picks() -> None:
    eps = [endpoint(f"10.0.0.{i}:80") for i in range(8)]
    s1, s2 = scheduler(seed=3), scheduler(seed=3)
    a = [s1.schedule(chat_request(), eps).decision.primary for _ in range(50)]
    b = [s2.schedule(chat_request(), eps).decision.primary for _ in range(50)]
    assert a == b
    assert len(set(a)) > 1


ROUND_ROBIN = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: round-robin-picker
  parameters: {maxNumOfEndpoints: 2}
schedulingProfiles:
- name: rr
  plugins:
  - pluginRef: round-robin-picker
"""


def test_a_profile_without_scorers_uses_its_picker_and_reports_fallbacks() -> None:
    s = scheduler(ROUND_ROBIN)
    eps = [endpoint("a:1"), endpoint("b:1"), endpoint("c:1")]
    got = [s.schedule(chat_request(), eps).decision.endpoints for _ in range(3)]
    assert got == [("a:1", "b:1"), ("b:1", "c:1"), ("c:1", "a:1")]


def test_plugin_timings_are_reported_with_a_timer() -> None:
    clock = FakeClock(NOW)
    cfg = default_config()
    s = build_scheduler(cfg, default_registry(), clock, random.Random(0), timer=clock)
    result = s.schedule(chat_request(), [endpoint("a:1")])
    points = [(t[0], t[1]) for t in result.timings]
    assert ("Filter", "metrics-staleness-filter") in points
    assert ("Scorer", "ttft-scorer") in points
    assert ("Picker", "max-score-picker") in points


class _Fixed:
    def __init__(self, values: list[float]) -> None:
        self.values = values

    @property
    def name(self) -> str:
        return "fixed"

    def score(self, state: object, request: object, endpoints: object) -> list[float]:
        return self.values


def test_scores_are_clamped_and_nan_counts_as_zero() -> None:
    from epp.scheduling.framework import CycleState
    from epp.scheduling.plugins.max_score_picker import MaxScorePicker
    from epp.scheduling.profile import SchedulerProfile, WeightedScorer

    profile = SchedulerProfile(
        "p",
        [],
        [WeightedScorer(_Fixed([float("nan"), -3.0, 7.0, 0.5]), 2.0, "fixed")],
        MaxScorePicker("m", 1),
        "max-score-picker",
    )
    eps = [endpoint(f"e{i}:1") for i in range(4)]
    result = profile.run(CycleState(now=NOW, rng=random.Random(0)), chat_request(), eps)
    assert result.scores == {"e0:1": 0.0, "e1:1": 0.0, "e2:1": 2.0, "e3:1": 1.0}
    assert result.endpoints == ["e2:1"]


def test_a_scorer_returning_the_wrong_number_of_scores_is_an_error() -> None:
    from epp.scheduling.framework import CycleState
    from epp.scheduling.plugins.max_score_picker import MaxScorePicker
    from epp.scheduling.profile import SchedulerProfile, WeightedScorer

    profile = SchedulerProfile(
        "p", [], [WeightedScorer(_Fixed([1.0]), 1.0, "fixed")], MaxScorePicker("m", 1), "max-score-picker"
    )
    with pytest.raises(RuntimeError, match="returned 1 scores for 2 endpoints"):
        profile.run(
            CycleState(now=NOW, rng=random.Random(0)), chat_request(), [endpoint("a:1"), endpoint("b:1")]
        )
