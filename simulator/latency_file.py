"""`--latency-profile`: a named step-time profile, or one read from a YAML file.

A file holds either

- one profile entry, with the keys of an EPP config's `costModel.profiles[]` entry (`reference`,
  `architecture` or `kvBytesPerToken`, `prefill`, `decode`, `tiers`, ...; unset keys come from the
  `reference` profile), or
- a whole EPP config (`kind: EndpointPickerConfig`): its `costModel.profiles` entry, the only one or
  the one for every model (`model: "*"`), so that the simulated engines run what the router is told.

The engines use the step coefficients, the KV bytes per token and the `cpu` tier's reload cost; keys
only the router reads (`maxBatchedTokens`, `unknownRequestTokens`, `kvWaitSteps`, `asyncScheduling`, other
tiers) are accepted and do not change the engines (their step budget is `--max-num-batched-tokens`, their
scheduling `--async-scheduling`).
"""

from __future__ import annotations

import pathlib
from typing import Any

import yaml

from epp.config import ConfigError, load_config
from epp.costmodel.profile import ProfileError, build_profile
from epp.costmodel.service import ANY_MODEL
from simulator.latency import PROFILES, LatencyProfile


def load_latency_profile(spec: str) -> LatencyProfile:
    """The profile `spec` names, or the one its YAML file holds. ValueError saying what is wrong."""
    known = PROFILES.get(spec)
    if known is not None:
        return known
    path = pathlib.Path(spec)
    if path.suffix.lower() not in (".yaml", ".yml") and not path.is_file():
        raise ValueError(
            f"--latency-profile {spec!r}: not a known profile ({', '.join(sorted(PROFILES))}) "
            "nor a YAML file (PATH.yaml)"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"--latency-profile {spec}: cannot read: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--latency-profile {spec}: not UTF-8 text") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"--latency-profile {spec}: not valid YAML: {err}") from None
    except RecursionError:
        raise ValueError(f"--latency-profile {spec}: not valid YAML: nested too deeply") from None
    if not isinstance(raw, dict):
        raise ValueError(
            f"--latency-profile {spec}: must be a YAML mapping (a profile entry or an EPP config)"
        )
    if "kind" in raw:
        return _from_config(spec)
    try:
        _, profile = build_profile(_entry(raw))
    except ProfileError as err:
        raise ValueError(f"--latency-profile {spec}: {err}") from None
    return LatencyProfile.from_model(profile, name=path.name)


def _entry(raw: dict[Any, Any]) -> dict[Any, Any]:
    """A single entry: `model` names nothing here (one profile for every engine)."""
    return {k: v for k, v in raw.items() if k != "model"}


def _from_config(spec: str) -> LatencyProfile:
    try:
        config = load_config(spec)
    except ConfigError as err:
        raise ValueError(f"--latency-profile: {err}") from None
    declared = (config.doc.cost_model or {}).get("profiles") or []
    models = [str(e.get("model", ANY_MODEL)) for e in declared]
    if not models:
        raise ValueError(f"--latency-profile {spec}: the EPP config declares no costModel.profiles")
    if len(models) > 1 and ANY_MODEL not in models:
        raise ValueError(
            f"--latency-profile {spec}: the EPP config has profiles for {', '.join(map(repr, models))}; "
            f"the simulated engines take one: add one for every model (model: {ANY_MODEL!r}) or give a "
            "file with one profile entry"
        )
    model = models[0] if len(models) == 1 else ANY_MODEL
    return LatencyProfile.from_model(config.cost_model.profiles[model], name=f"{pathlib.Path(spec).name}")
