"""Online calibration: a robust, bounded recursive least squares fit of the prefill and queue scales."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from epp.costmodel.calibration import CalibrationSettings, Calibrator
from epp.costmodel.estimate import estimate_ttft
from epp.costmodel.profile import DEFAULT_REFERENCE, REFERENCE_PROFILES
from epp.costmodel.service import CostModel, CostModelSettings
from epp.testing.fakes import endpoint

# Prefill cost purely per token (no fixed or attention term), so "the per-token cost is 3x wrong"
# means the whole prefill (and the queue of unknown requests) is 3x wrong: the true scale is known.
TRUE = replace(REFERENCE_PROFILES[DEFAULT_REFERENCE], prefill_fixed_s=0.0, prefill_per_pair_s=0.0)


def _converge(factor: float, seed: int, n: int = 300, outliers: float = 0.05) -> CostModel:
    """Route `n` requests with a profile whose per-token prefill cost is `factor` x the truth and
    feed back times drawn from the true cost with 10% noise and `outliers` wild ones."""
    wrong = replace(TRUE, prefill_per_token_s=TRUE.prefill_per_token_s * factor)
    cm = CostModel(CostModelSettings({"*": wrong}))
    rng = random.Random(seed)
    for _ in range(n):
        prompt = rng.randint(500, 8000)
        ep = endpoint("a:1", waiting=rng.choice((0, 0, 1, 2, 4)))
        est = cm.estimate("m", ep, prompt, None)
        actual = estimate_ttft(TRUE, ep, prompt, None).ttft_s * rng.lognormvariate(0.0, 0.1)
        if rng.random() < outliers:
            actual *= rng.choice((0.05, 10.0, 30.0))  # a stalled request, or a bogus early byte
        cm.observe("m", est, actual)
    return cm


@pytest.mark.parametrize("factor", [3.0, 1 / 3])
@pytest.mark.parametrize("seed", range(8))
def test_a_profile_three_times_wrong_converges_within_300_requests(factor: float, seed: int) -> None:
    cm = _converge(factor, seed)
    c = cm.coefficients()["m"]
    assert c["observations"] == 300
    assert c["prefill_scale"] == pytest.approx(1 / factor, rel=0.15)
    assert c["prefill_seconds_per_token"] == pytest.approx(TRUE.prefill_per_token_s, rel=0.15)
    assert c["queue_scale"] == pytest.approx(1 / factor, rel=0.25)
    assert c["outliers"] > 0  # the wild observations were recognised, not fitted
    s = cm.settings.calibration
    assert s.min_scale <= c["prefill_scale"] <= s.max_scale
    assert s.min_scale <= c["queue_scale"] <= s.max_scale


def test_the_calibrated_estimate_predicts_the_truth() -> None:
    cm = _converge(3.0, seed=11)
    ep = endpoint("a:1", waiting=2)
    est = cm.estimate("m", ep, 4000, None)
    assert est.ttft_s == pytest.approx(estimate_ttft(TRUE, ep, 4000, None).ttft_s, rel=0.15)


def test_noiseless_observations_recover_both_scales() -> None:
    cal = Calibrator()
    rng = random.Random(3)
    for _ in range(200):
        p, q, rest = rng.uniform(0.01, 1.0), rng.uniform(0.0, 1.0), rng.uniform(0.0, 0.05)
        assert cal.observe(p, q, rest, 0.4 * p + 2.5 * q + rest)
    assert cal.prefill_scale == pytest.approx(0.4, rel=0.01)
    assert cal.queue_scale == pytest.approx(2.5, rel=0.01)
    assert cal.outliers == 0


def test_one_wild_observation_after_warmup_barely_moves_a_converged_fit() -> None:
    cal = Calibrator()
    rng = random.Random(5)
    for _ in range(100):
        p = rng.uniform(0.05, 0.5)
        cal.observe(p, 0.0, 0.0, 0.5 * p * rng.uniform(0.95, 1.05))
    before, outliers = cal.prefill_scale, cal.outliers
    assert before == pytest.approx(0.5, rel=0.05)
    assert cal.observe(0.2, 0.0, 0.0, 0.2 * 50) is True  # a stalled request: 100x the fit
    assert cal.outliers == outliers + 1
    assert cal.prefill_scale == pytest.approx(before, rel=0.05)


@pytest.mark.parametrize(("ratio", "bound"), [(1000.0, "max"), (1e-4, "min")])
def test_scales_stay_within_their_bounds(ratio: float, bound: str) -> None:
    settings = CalibrationSettings(min_scale=0.2, max_scale=5.0)
    cal = Calibrator(settings)
    seen = []
    for i in range(100):
        p, q = 0.1 + 0.01 * (i % 7), 0.05 * (i % 3)
        cal.observe(p, q, 0.0, ratio * (p + q))
        seen += [cal.prefill_scale, cal.queue_scale]
    assert all(0.2 <= s <= 5.0 for s in seen)
    expected = 5.0 if bound == "max" else 0.2
    assert cal.prefill_scale == expected


@pytest.mark.parametrize(
    ("prefill", "queue", "rest", "actual"),
    [
        (0.1, 0.0, 0.0, float("nan")),
        (0.1, 0.0, 0.0, float("inf")),
        (float("nan"), 0.0, 0.0, 0.1),
        (0.1, float("inf"), 0.0, 0.1),
        (0.1, 0.0, float("nan"), 0.1),
        (0.1, 0.0, 0.0, -0.5),
        (0.1, 0.0, 0.0, 0.0),
        (-0.1, 0.0, 0.0, 0.1),
        (0.1, -0.1, 0.0, 0.1),
        (0.0, 0.0, 0.01, 0.1),  # nothing to fit
        (0.1, 0.0, 0.0, 601.0),  # over max_observation_s
    ],
)
def test_observations_that_cannot_be_right_are_ignored_and_counted(
    prefill: float, queue: float, rest: float, actual: float
) -> None:
    cal = Calibrator()
    cal.observe(0.1, 0.1, 0.0, 0.3)
    snap = cal.snapshot()
    assert cal.observe(prefill, queue, rest, actual) is False
    after = cal.snapshot()
    assert after["ignored"] == snap["ignored"] + 1 == 1
    assert after["observations"] == snap["observations"] == 1
    assert (after["prefill_scale"], after["queue_scale"]) == (snap["prefill_scale"], snap["queue_scale"])


def test_a_disabled_calibrator_ignores_everything() -> None:
    cal = Calibrator(CalibrationSettings(enabled=False))
    assert cal.observe(0.1, 0.0, 0.0, 0.5) is False
    assert (cal.prefill_scale, cal.queue_scale, cal.ignored, cal.observations) == (1.0, 1.0, 1, 0)


def test_cost_model_observe_feeds_nominal_terms_and_unscaled_rest() -> None:
    cm = CostModel()
    ep = endpoint("a:1", waiting=2, decoding=4, decoding_tokens=4000)
    est = cm.estimate("m", ep, 3000, None)
    assert est.decode_s > 0
    # the truth is exactly the estimate: the scales stay put
    for _ in range(20):
        assert cm.observe("m", est, est.ttft_s)
    c = cm.coefficients()["m"]
    assert c["prefill_scale"] == pytest.approx(1.0)
    assert c["queue_scale"] == pytest.approx(1.0)
    assert cm.observe("m", est, float("nan")) is False
    assert cm.coefficients()["m"]["ignored"] == 1


def test_snapshot_reports_the_fit() -> None:
    cal = Calibrator()
    snap = cal.snapshot()
    assert set(snap) == {
        "prefill_scale",
        "queue_scale",
        "observations",
        "outliers",
        "ignored",
        "residual_scale",
    }
    assert {k: v for k, v in snap.items() if k != "residual_scale"} == {
        "prefill_scale": 1.0,
        "queue_scale": 1.0,
        "observations": 0,
        "outliers": 0,
        "ignored": 0,
    }
    initial = snap["residual_scale"]
    assert math.isfinite(initial) and initial >= 0
    for i in range(cal.settings.warmup):  # three times the estimate; the scale starts there after warm-up
        assert cal.snapshot()["prefill_scale"] == 1.0
        cal.observe(0.1, 0.0, 0.0, 0.3 + 0.01 * i)
    snap = cal.snapshot()
    assert snap["observations"] == cal.settings.warmup
    assert snap["prefill_scale"] == pytest.approx(3.1)  # the median ratio
    assert math.isfinite(snap["residual_scale"]) and snap["residual_scale"] > initial


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        (CalibrationSettings(forgetting=0.4), "forgetting"),
        (CalibrationSettings(forgetting=1.01), "forgetting"),
        (CalibrationSettings(min_scale=0.0), "minScale"),
        (CalibrationSettings(min_scale=1.5), "minScale"),
        (CalibrationSettings(max_scale=0.9), "maxScale"),
        (CalibrationSettings(max_scale=float("inf")), "maxScale"),
        (CalibrationSettings(outlier_threshold=0.0), "outlierThreshold"),
        (CalibrationSettings(warmup=-1), "warmup"),
        (CalibrationSettings(warmup=0), "warmup"),
        (CalibrationSettings(warmup=10_000), "warmup"),
    ],
)
def test_settings_check_names_the_bad_field(settings: CalibrationSettings, field: str) -> None:
    problem = settings.check()
    assert problem is not None
    assert problem[0] == field
    assert problem[1]


def test_default_settings_are_valid() -> None:
    assert CalibrationSettings().check() is None
    assert CalibrationSettings(forgetting=1.0, min_scale=1.0, max_scale=1.0, warmup=1).check() is None


def test_a_direction_never_excited_does_not_wind_up() -> None:
    """Hundreds of requests without any queue, then queued ones: the queue scale moves only when
    there is queue to fit, and then quickly."""
    cal = Calibrator()
    rng = random.Random(9)
    for _ in range(500):
        p = rng.uniform(0.05, 0.5)
        cal.observe(p, 0.0, 0.0, 0.8 * p)
    assert cal.queue_scale == 1.0
    assert cal.prefill_scale == pytest.approx(0.8, rel=0.01)
    for _ in range(30):
        p, q = rng.uniform(0.05, 0.5), rng.uniform(0.1, 1.0)
        cal.observe(p, q, 0.0, 0.8 * p + 3.0 * q)
    assert cal.queue_scale == pytest.approx(3.0, rel=0.05)
    assert cal.prefill_scale == pytest.approx(0.8, rel=0.05)


def test_a_stalled_request_right_after_warmup_is_an_outlier_and_does_not_drag_the_fit() -> None:
    cal = Calibrator()
    first_judged = cal.settings.warmup
    rng = random.Random(1)
    for i in range(first_judged + 50):
        p = rng.uniform(0.05, 0.5)
        cal.observe(p, 0.0, 0.0, p * (30.0 if i == first_judged else 1.0))  # the profile is right
        if i == first_judged:
            assert cal.outliers == 1
            assert cal.prefill_scale == pytest.approx(1.0, rel=0.1)
    assert cal.outliers == 1  # the correct observations after it are not flagged
    assert cal.prefill_scale == pytest.approx(1.0, rel=0.01)


def test_a_stalled_first_request_does_not_drag_the_fit() -> None:
    cal = Calibrator()
    rng = random.Random(1)
    for i in range(21):
        p = rng.uniform(0.05, 0.5)
        cal.observe(p, 0.0, 0.0, p * (30.0 if i == 0 else 1.0))  # the profile is right
    assert cal.prefill_scale == pytest.approx(1.0, rel=0.5)
