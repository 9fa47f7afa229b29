"""Online calibration of the prefill and queue coefficients from observed times to first byte. Pure.

Each routed request gives one observation: the estimate's nominal prefill term `P` and queue
term `Q` (before scaling), its unscaled terms `R` (reload + decode), and the observed time
to first byte `y`. The calibrator fits `y - R ~ kp * P + kq * Q` by recursive least squares
with exponential forgetting (`forgetting` 0.99 ~ the last ~100 observations weigh most), on
observations divided by their predicted size (so a 20 ms and a 2 s request count alike). It
is robust and bounded:

- the first `warmup` (3) observations only set a starting scale: the median of their
  observed / predicted ratios; after that, a residual beyond `outlier_threshold` times the
  residual scale (1.4826 x the median absolute residual of the last 32 observations) is
  clipped to that limit (Huber) and counted as an outlier, so a stalled request cannot drag the fit,
  not even among the first few; three in a row on the same side are a real change (the
  engine got slower, a queue appeared) and are fitted in full;
- the scales stay within `[min_scale, max_scale]`, and the covariance is capped so a
  direction that is never excited (no queue yet) does not wind up;
- observations that cannot be right (non-finite, <= 0, over `max_observation_s`) are ignored.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

_P0 = 100.0  # initial (and maximum) variance of each scale
_WINDOW = 32  # recent residuals the robust scale is the median of
_MIN_SIGMA = 0.02  # relative residual below which nothing is an outlier
_SHIFT = 3  # this many residuals in a row over the limit on one side are a change, not outliers


@dataclass(frozen=True, slots=True)
class CalibrationSettings:
    enabled: bool = True
    forgetting: float = 0.99
    min_scale: float = 0.05
    max_scale: float = 20.0
    outlier_threshold: float = 3.0
    warmup: int = 3  # observations before outliers are judged
    max_observation_s: float = 600.0

    def check(self) -> tuple[str, str] | None:
        if not 0.5 <= self.forgetting <= 1.0:
            return "forgetting", f"must be in [0.5, 1], got {self.forgetting}"
        if not 0 < self.min_scale <= 1.0:
            return "minScale", f"must be in (0, 1], got {self.min_scale}"
        if not 1.0 <= self.max_scale < math.inf:
            return "maxScale", f"must be a finite number >= 1, got {self.max_scale}"
        if not 0 < self.outlier_threshold < math.inf:
            return "outlierThreshold", f"must be a finite number > 0, got {self.outlier_threshold}"
        if not 1 <= self.warmup <= _WINDOW:
            return "warmup", f"must be in 1..{_WINDOW}"
        return None


class Calibrator:
    """(prefill scale, queue scale) for one model, fitted online."""

    def __init__(self, settings: CalibrationSettings | None = None) -> None:
        self.settings = settings or CalibrationSettings()
        self.prefill_scale = 1.0
        self.queue_scale = 1.0
        self._p = [[_P0, 0.0], [0.0, _P0]]
        self._residuals: deque[float] = deque(maxlen=_WINDOW)
        self._first: list[tuple[float, float, float]] = []  # (x0, x1, y) until warmup is reached
        self._run = 0  # consecutive residuals over the limit, signed by their side
        self.observations = 0
        self.outliers = 0
        self.ignored = 0

    def observe(self, prefill_nominal: float, queue_nominal: float, rest: float, actual: float) -> bool:
        """Fold in one observation; returns False when it was ignored."""
        s = self.settings
        values = (prefill_nominal, queue_nominal, rest, actual)
        if (
            not s.enabled
            or not all(math.isfinite(v) for v in values)
            or actual <= 0
            or actual > s.max_observation_s
            or prefill_nominal < 0
            or queue_nominal < 0
            or prefill_nominal + queue_nominal <= 0
        ):
            self.ignored += 1
            return False
        norm = max(prefill_nominal + queue_nominal + max(rest, 0.0), 1e-6)
        x0, x1 = prefill_nominal / norm, queue_nominal / norm
        y = (actual - rest) / norm
        self.observations += 1
        if len(self._first) < s.warmup:
            self._start(x0, x1, y)
            return True
        err = y - (self.prefill_scale * x0 + self.queue_scale * x1)
        limit = s.outlier_threshold * self.residual_scale()
        self._residuals.append(abs(err))
        if abs(err) > limit:
            sign = 1 if err > 0 else -1
            self._run = self._run + sign if self._run * sign > 0 else sign
            if abs(self._run) < _SHIFT:  # Huber: moves the fit no more than a residual at the limit
                err = sign * limit
                self.outliers += 1
        else:
            self._run = 0
        self._update(x0, x1, err)
        return True

    def _start(self, x0: float, x1: float, y: float) -> None:
        """The first `warmup` observations: nothing to judge outliers by yet, so they set a starting
        scale for both coefficients from their median ratio observed / predicted (one stalled
        request among them cannot move a median), then the fit goes on from there."""
        s = self.settings
        self._first.append((x0, x1, y))
        if len(self._first) < s.warmup:
            return
        ratios = sorted(y / (a + b) for a, b, y in self._first if a + b > 0)
        if not ratios:  # (regressors that underflowed to 0: nothing to scale by)
            ratios = [1.0]
        start = _clamp(_median(ratios), s.min_scale, s.max_scale)
        self.prefill_scale = start
        if any(b >= 0.1 for _, b, _ in self._first):  # a queue was seen: it starts there too
            self.queue_scale = start
        for a, b, y in self._first:
            self._residuals.append(abs(y - start * (a + b)))

    def _update(self, x0: float, x1: float, err: float) -> None:
        s = self.settings
        lam = s.forgetting
        p = self._p
        px0 = p[0][0] * x0 + p[0][1] * x1
        px1 = p[1][0] * x0 + p[1][1] * x1
        denom = lam + x0 * px0 + x1 * px1
        k0, k1 = px0 / denom, px1 / denom
        self.prefill_scale = _clamp(self.prefill_scale + k0 * err, s.min_scale, s.max_scale)
        self.queue_scale = _clamp(self.queue_scale + k1 * err, s.min_scale, s.max_scale)
        # P = (P - K x^T P) / lambda, symmetric; cap the variances (no wind-up).
        a = (p[0][0] - k0 * px0) / lam
        b = (p[0][1] - k0 * px1) / lam
        d = (p[1][1] - k1 * px1) / lam
        a, d = min(a, _P0), min(d, _P0)
        b = max(-math.sqrt(a * d), min(b, math.sqrt(a * d)))
        self._p = [[a, b], [b, d]]

    def residual_scale(self) -> float:
        """1.4826 x the median absolute residual of the recent observations (floored)."""
        if not self._residuals:
            return _MIN_SIGMA
        return max(1.4826 * _median(sorted(self._residuals)), _MIN_SIGMA)

    def snapshot(self) -> dict[str, float]:
        return {
            "prefill_scale": self.prefill_scale,
            "queue_scale": self.queue_scale,
            "observations": self.observations,
            "outliers": self.outliers,
            "ignored": self.ignored,
            "residual_scale": self.residual_scale(),
        }


def _median(ordered: list[float]) -> float:
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def _clamp(v: float, lo: float, hi: float) -> float:
    return lo if v < lo else hi if v > hi else v
