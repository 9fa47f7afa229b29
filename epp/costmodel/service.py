"""The cost model as the scheduler and the server use it: one profile and one calibrator per model. Pure.

Built once from the config's `costModel` section and handed to plugins through
`PluginHandle.services` (key `SERVICE_KEY`); the server feeds it observed times to first
byte, the simulator does the same from simulated responses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from epp.costmodel.calibration import CalibrationSettings, Calibrator
from epp.costmodel.estimate import F64, EstimateTable, estimate_all, tier_order
from epp.costmodel.profile import (
    DEFAULT_REFERENCE,
    REFERENCE_PROFILES,
    ModelProfile,
    ProfileError,
    build_profile,
    validation_field,
)
from epp.types import Endpoint, TtftEstimate

SERVICE_KEY = "cost_model"
ANY_MODEL = "*"


class _Struct(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    pass


class CalibrationSpec(_Struct):
    enabled: bool = True
    forgetting: float = 0.99
    min_scale: float = 0.05
    max_scale: float = 20.0
    outlier_threshold: float = 3.0
    warmup: int = 3


@dataclass(frozen=True, slots=True)
class CostModelSettings:
    profiles: Mapping[str, ModelProfile] = field(
        default_factory=lambda: {ANY_MODEL: REFERENCE_PROFILES[DEFAULT_REFERENCE]}
    )
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)


def parse_cost_model(raw: Mapping[str, Any] | None) -> CostModelSettings:
    """The `costModel` config section: `profiles` (list) and `calibration`. Raises ProfileError."""
    if raw is None:
        return CostModelSettings()
    unknown = set(raw) - {"profiles", "calibration"}
    if unknown:
        raise ProfileError(sorted(unknown)[0], "unknown field (costModel takes profiles and calibration)")
    profiles: dict[str, ModelProfile] = {}
    entries = raw.get("profiles")
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise ProfileError("profiles", "must be a list of profiles")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ProfileError(f"profiles[{i}]", "must be a mapping")
        try:
            model, profile = build_profile(entry)
        except ProfileError as err:
            raise ProfileError(f"profiles[{i}].{err.field}".rstrip("."), err.message) from None
        if model in profiles:
            raise ProfileError(f"profiles[{i}].model", f"duplicate profile for model {model!r}")
        profiles[model] = profile
    profiles.setdefault(ANY_MODEL, REFERENCE_PROFILES[DEFAULT_REFERENCE])
    calibration = raw.get("calibration")
    if calibration is not None and not isinstance(calibration, dict):
        raise ProfileError("calibration", "must be a mapping")
    try:
        c = msgspec.convert(calibration or {}, CalibrationSpec, strict=False)  # (as build_profile)
    except msgspec.ValidationError as err:
        where, message = validation_field(err)
        raise ProfileError(f"calibration.{where}".rstrip("."), message) from None
    settings = CalibrationSettings(
        c.enabled, c.forgetting, c.min_scale, c.max_scale, c.outlier_threshold, c.warmup
    )
    problem = settings.check()
    if problem is not None:
        raise ProfileError(f"calibration.{problem[0]}", problem[1])
    return CostModelSettings(profiles, settings)


MAX_CALIBRATED_MODELS = 256
"""Model names calibrated (and exported) at most: past these, a model keeps its profile's coefficients."""


class CostModel:
    def __init__(self, settings: CostModelSettings | None = None) -> None:
        self.settings = settings or CostModelSettings()
        self._calibrators: dict[str, Calibrator] = {}
        self._orders = {name: tier_order(p) for name, p in self.settings.profiles.items()}

    def profile_key(self, model: str) -> str:
        return model if model in self.settings.profiles else ANY_MODEL

    def profile(self, model: str) -> ModelProfile:
        return self.settings.profiles[self.profile_key(model)]

    def calibrator(self, model: str) -> Calibrator | None:
        """The model's calibrator, created at its first observation; None past MAX_CALIBRATED_MODELS names
        (model names come from clients: those models keep the profile's coefficients)."""
        c = self._calibrators.get(model)
        if c is None:
            if len(self._calibrators) >= MAX_CALIBRATED_MODELS:
                return None
            c = self._calibrators[model] = Calibrator(self.settings.calibration)
        return c

    def estimate(
        self,
        model: str,
        endpoint: Endpoint,
        prompt_tokens: int,
        held_tokens: Mapping[str, int] | None,
        block_size: int = 1,
    ) -> TtftEstimate:
        """One endpoint's estimate; `held_tokens`: tier -> tokens it can take from that tier."""
        held = {t: np.array([float(v)]) for t, v in (held_tokens or {}).items()}
        return self.estimate_all(model, [endpoint], prompt_tokens, held, block_size).row(0)

    def estimate_all(
        self,
        model: str,
        endpoints: Sequence[Endpoint],
        prompt_tokens: int,
        held_tokens: Mapping[str, F64] | None,
        block_size: int = 1,
    ) -> EstimateTable:
        """Every candidate at once; `held_tokens`: tier -> tokens per endpoint (aligned arrays);
        `block_size`: the engines' block size where their metrics do not say."""
        key = self.profile_key(model)
        c = self._calibrators.get(model)
        return estimate_all(
            self.settings.profiles[key],
            endpoints,
            prompt_tokens,
            held_tokens,
            c.prefill_scale if c else 1.0,
            c.queue_scale if c else 1.0,
            self._orders[key],
            block_size,
        )

    def tier_order(self, model: str) -> list[str]:
        """The model's slower tiers, fastest reload first."""
        return self._orders[self.profile_key(model)]

    def observe(self, model: str, estimate: TtftEstimate, actual_s: float) -> bool:
        """An observed time to first token for a request routed with `estimate`; False when not used."""
        c = self.calibrator(model)
        if c is None:
            return False
        return c.observe(
            estimate.prefill_nominal_s,
            estimate.queue_nominal_s,
            estimate.reload_s + estimate.decode_s,
            actual_s,
        )

    def coefficients(self) -> dict[str, dict[str, float]]:
        """Per model seen so far: fitted scales and the effective prefill seconds per token."""
        out: dict[str, dict[str, float]] = {}
        for model, c in sorted(self._calibrators.items()):
            snap = c.snapshot()
            snap["prefill_seconds_per_token"] = self._per_token(model, c.prefill_scale)
            out[model] = snap
        return out

    def calibration_of(self, model: str) -> dict[str, float]:
        """One model's scales now (1 and 1 before any fit), its observations and effective prefill seconds
        per token; creates no calibrator (model names come from clients)."""
        c = self._calibrators.get(model)
        prefill, queue, seen = (c.prefill_scale, c.queue_scale, c.observations) if c else (1.0, 1.0, 0)
        return {
            "prefill_scale": prefill,
            "queue_scale": queue,
            "observations": seen,
            "prefill_seconds_per_token": self._per_token(model, prefill),
        }

    def _per_token(self, model: str, prefill_scale: float) -> float:
        return self.profile(model).prefill_per_token_s * prefill_scale
