"""Config sections of the TTFT picker (`costModel`, `admission`, `tenancy`, `explain`) and admission by
estimated TTFT: sheddable requests get 429 + retry-after when no endpoint can meet the SLO."""

from __future__ import annotations

import math
import random

import pytest

from epp.config import DEFAULT_CONFIG_YAML, LOAD_AWARE_CONFIG_YAML, ConfigError, build_scheduler, parse_config
from epp.costmodel.estimate import estimate_ttft
from epp.costmodel.profile import DEFAULT_REFERENCE, REFERENCE_PROFILES
from epp.costmodel.service import ANY_MODEL
from epp.scheduling.admission import Admission
from epp.scheduling.builtin import default_registry
from epp.scheduling.errors import SchedulingError, SloExceededError
from epp.scheduling.scheduler import Scheduler
from epp.tenancy import TenancyConfig
from epp.testing.fakes import FakeClock, chat_request, endpoint
from epp.types import Endpoint

HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
NOW = 1000.0
P = REFERENCE_PROFILES[DEFAULT_REFERENCE]


def config_error(extra: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        parse_config(HEAD + extra, "epp.yaml")
    return err.value


# -- accepted sections ---------------------------------------------------------------------------
def test_defaults_without_the_new_sections() -> None:
    cfg = parse_config(HEAD)
    assert set(cfg.cost_model.profiles) == {ANY_MODEL}
    assert cfg.admission == Admission()
    assert cfg.admission.ttft_slo_s is None
    assert cfg.tenancy is None
    assert (cfg.explain.keep, cfg.explain.response_header) == (100, False)


def test_all_sections_parse() -> None:
    cfg = parse_config(
        HEAD
        + """\
costModel:
  profiles:
  - model: llama-70b
    architecture: {layers: 80, kvHeads: 8, headDim: 128}
    prefill: {perTokenSeconds: 1e-4}
    tiers:
      cpu: {bandwidthBytesPerSecond: 2e10, latencySeconds: 0.001}
  calibration: {forgetting: 0.98, maxScale: 10}
admission: {ttftSlo: 1500ms, maxRetryAfter: 2m}
tenancy: {header: X-Org-Id, missing: reject, secretEnv: EPP_TENANT_SECRET}
explain: {keep: 5, responseHeader: true}
""",
        "epp.yaml",
    )
    prof = cfg.cost_model.profiles["llama-70b"]
    assert prof.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert prof.prefill_per_token_s == 1e-4  # `1e-4` is a YAML 1.1 string; it is still read as a number
    assert prof.tiers["cpu"].bandwidth_bytes_per_s == 2e10
    assert cfg.cost_model.profiles[ANY_MODEL] == P
    assert (cfg.cost_model.calibration.forgetting, cfg.cost_model.calibration.max_scale) == (0.98, 10.0)
    assert cfg.admission == Admission(1.5, 1, 120)
    assert cfg.tenancy == TenancyConfig("x-org-id", "reject", None, "EPP_TENANT_SECRET")
    assert (cfg.explain.keep, cfg.explain.response_header) == (5, True)


@pytest.mark.parametrize(("value", "seconds"), [("2s", 2.0), ("250ms", 0.25), (3, 3.0), (0.5, 0.5)])
def test_ttft_slo_takes_durations_and_numbers(value: object, seconds: float) -> None:
    assert parse_config(HEAD + f"admission: {{ttftSlo: {value}}}\n").admission.ttft_slo_s == seconds


# -- errors name section and field ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "where", "field", "fragment"),
    [
        (
            "costModel: {profiles: [{model: m, reference: gpt-9}]}",
            "costModel",
            "profiles[0].reference",
            "unknown reference profile 'gpt-9'",
        ),
        (
            "costModel: {profiles: [{model: m, prefill: {perTokenSeconds: -1.0e-5}}]}",
            "costModel",
            "profiles[0].prefill.perTokenSeconds",
            ">= 0",
        ),
        (
            "costModel: {profiles: [{kvBytesPerToken: 1024,"
            + " architecture: {layers: 1, kvHeads: 1, headDim: 1}}]}",
            "costModel",
            "profiles[0].kvBytesPerToken",
            "not both",
        ),
        (
            "costModel: {profiles: [{model: a}, {model: a}]}",
            "costModel",
            "profiles[1].model",
            "duplicate profile for model 'a'",
        ),
        ("costModel: {profile: []}", "costModel", "profile", "unknown field"),
        ("costModel: {calibration: {forgetting: 2}}", "costModel", "calibration.forgetting", "[0.5, 1]"),
        ("costModel: [1]", "costModel", "costModel", "Expected"),
        ("admission: {ttftSlo: abc}", "admission", "ttftSlo", "not a duration: 'abc'"),
        ("admission: {ttftSlo: 0}", "admission", "ttftSlo", "must be > 0"),
        ("admission: {ttftSlo: -1}", "admission", "ttftSlo", ">= 0"),
        ("admission: {maxRetryAfter: 500ms}", "admission", "maxRetryAfter", "at least 1s"),
        ("admission: {maxRetryAfter: soon}", "admission", "maxRetryAfter", "not a duration"),
        ("admission: {ttftSLO: 1s}", "admission", "ttftSLO", "unknown field"),
        ("tenancy: {header: x-tenant-id}", "tenancy", "secretFile", "secretFile or secretEnv"),
        ("tenancy: {secretEnv: S, secretFile: /s}", "tenancy", "secretFile", "exactly one"),
        ("tenancy: {secretEnv: S, missing: maybe}", "tenancy", "missing", "'maybe'"),
        ("tenancy: {secretEnv: S, header: 'x-tenant:'}", "tenancy", "header", "HTTP header name"),
        ("explain: {keep: -1}", "explain", "keep", "got -1"),
        ("explain: {keep: 10001}", "explain", "keep", "0..10000"),
        ("explain: {responseHeaders: true}", "explain", "responseHeaders", "unknown field"),
    ],
)
def test_bad_sections_name_section_and_field(extra: str, where: str, field: str, fragment: str) -> None:
    err = config_error(extra + "\n")
    assert err.where == where
    assert err.field == field
    assert fragment in err.message
    assert str(err).startswith(f"epp.yaml: {where}: field {field!r}: ")


def test_an_unknown_field_of_a_cost_model_profile_is_named() -> None:
    err = config_error("costModel: {profiles: [{model: m, perTokenSeconds: 1}]}\n")
    assert err.where == "costModel"
    assert err.field == "profiles[0].perTokenSeconds"
    assert "unknown field `perTokenSeconds`" in err.message


# -- Admission.check ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("priority", "fastest", "slo"),
    [
        (0, 10.0, 1.0),  # not sheddable: still routed
        (5, 10.0, 1.0),
        (-1, 1.0, 1.0),  # exactly at the SLO
        (-1, 0.5, 1.0),
        (-1, None, 1.0),  # no TTFT estimate in this profile
        (-1, 10.0, None),  # no SLO configured
    ],
)
def test_admission_lets_through(priority: int, fastest: float | None, slo: float | None) -> None:
    Admission(slo).check(chat_request(priority=priority), fastest)


@pytest.mark.parametrize(
    ("fastest", "slo", "retry"),
    [
        (1.2, 1.0, 1),  # 0.2 s over: rounded up to 1
        (3.5, 1.0, 3),  # ceil(2.5)
        (4.0, 1.0, 3),
        (1.0001, 1.0, 1),
        (500.0, 1.0, 60),  # bounded by max_retry_after
    ],
)
def test_admission_refuses_sheddable_requests_over_the_slo(fastest: float, slo: float, retry: int) -> None:
    with pytest.raises(SloExceededError) as err:
        Admission(slo).check(chat_request(priority=-1), fastest)
    assert err.value.retry_after_s == retry == max(1, min(60, math.ceil(fastest - slo)))
    assert err.value.status == 429
    assert isinstance(err.value, SchedulingError)
    assert "sheddable" in str(err.value)


def test_admission_retry_after_bounds_are_configurable() -> None:
    with pytest.raises(SloExceededError) as err:
        Admission(1.0, min_retry_after_s=5, max_retry_after_s=10).check(chat_request(priority=-1), 1.5)
    assert err.value.retry_after_s == 5
    with pytest.raises(SloExceededError) as err:
        Admission(1.0, min_retry_after_s=5, max_retry_after_s=10).check(chat_request(priority=-1), 100.0)
    assert err.value.retry_after_s == 10


# -- admission through the scheduler built from the config ---------------------------------------
_NO_SATURATION = "saturationDetector: {queueDepthThreshold: 100000, kvCacheUtilThreshold: 1.0}\n"


def _scheduler(yaml_text: str) -> Scheduler:
    return build_scheduler(
        parse_config(yaml_text, "t.yaml"), default_registry(), FakeClock(NOW), random.Random(0)
    )


def _loaded(waiting: int) -> list[Endpoint]:
    return [endpoint("a:1", waiting=waiting), endpoint("b:1", waiting=2 * waiting + 20)]  # b clearly slower


def test_scheduler_refuses_a_sheddable_request_when_every_estimate_is_over_the_slo() -> None:
    s = _scheduler(DEFAULT_CONFIG_YAML + "admission: {ttftSlo: 1s, maxRetryAfter: 30s}\n" + _NO_SATURATION)
    req = chat_request("z" * 4000, priority=-1)
    eps = _loaded(waiting=100)
    fastest = min(estimate_ttft(P, e, req.prompt_tokens_estimate).ttft_s for e in eps)
    assert fastest > 2.0
    with pytest.raises(SloExceededError) as err:
        s.schedule(req, eps)
    assert err.value.status == 429
    assert err.value.retry_after_s == min(30, math.ceil(fastest - 1.0))
    # the same load, a request that is not sheddable: routed to the faster endpoint
    assert s.schedule(chat_request("z" * 4000, priority=0), eps).decision.primary == "a:1"
    # a sheddable request on an idle pool: routed
    assert s.schedule(req, _loaded(waiting=0)).decision.primary == "a:1"


def test_retry_after_is_bounded_by_max_retry_after_from_the_config() -> None:
    s = _scheduler(DEFAULT_CONFIG_YAML + "admission: {ttftSlo: 100ms, maxRetryAfter: 2s}\n" + _NO_SATURATION)
    with pytest.raises(SloExceededError) as err:
        s.schedule(chat_request("z" * 4000, priority=-1), _loaded(waiting=1000))
    assert err.value.retry_after_s == 2


def test_without_an_slo_sheddable_requests_are_routed_however_slow() -> None:
    s = _scheduler(DEFAULT_CONFIG_YAML + _NO_SATURATION)
    d = s.schedule(chat_request("z" * 4000, priority=-1), _loaded(waiting=1000)).decision
    assert d.primary == "a:1"
    assert d.estimates["a:1"].ttft_s > 10.0


def test_a_profile_without_ttft_estimates_never_refuses_by_slo() -> None:
    s = _scheduler(LOAD_AWARE_CONFIG_YAML + "admission: {ttftSlo: 1ms}\n" + _NO_SATURATION)
    d = s.schedule(chat_request("z" * 4000, priority=-1), _loaded(waiting=1000)).decision
    assert d.primary == "a:1"
    assert d.estimates == {}
