"""EndpointPickerConfig: parse and validate the YAML, then build the scheduler. Pure.

The format is the reference EPP's (`apiVersion: inference.networking.x-k8s.io/v1alpha1`,
`kind: EndpointPickerConfig`, `plugins`, `schedulingProfiles`, `saturationDetector`,
`featureGates`), plus our own optional sections (`endpoints`, `objectives`, ...). Every error is a
`ConfigError` naming the file, the plugin (or section) and the field, raised at startup.

Defaults are applied as the reference's loader applies them: a plugin's name is its type; without
`schedulingProfiles` one profile `default` takes every declared filter, scorer and picker; a scorer
without a weight weighs 1; a profile without a picker uses the first declared picker, else a
`max-score-picker`; one profile without a profile handler gets `single-profile-handler`; a
`saturationDetector` threshold of 0 is unset. The reference's sections this EPP does not implement
(`flowControl`, `data`, ...) are refused by name (`config_sections.UNSUPPORTED_SECTIONS`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import yaml

from epp.clock import Clock
from epp.config_sections import (
    AdmissionEntry,
    ConfigError,
    ExplainConfig,
    ExplainEntry,
    IndexConfig,
    IndexEntry,
    KvEventsConfig,
    KvEventsEntry,
    SaturationEntry,
    TenancyEntry,
    TokenizerEntry,
    _Struct,
    admission_config,
    explain_config,
    kv_events_config,
    refuse_unsupported,
    saturation_config,
    tenancy_config,
    tokenizers_config,
    validation_error,
)
from epp.costmodel.profile import ProfileError
from epp.costmodel.service import CostModelSettings, parse_cost_model
from epp.kvindex.server_chat import TokenizerSpec
from epp.scheduling.admission import Admission
from epp.scheduling.framework import Filter, Picker, PluginHandle, ProfileHandler, Scorer
from epp.scheduling.plugins.max_score_picker import MaxScorePicker
from epp.scheduling.plugins.single_profile_handler import SingleProfileHandler
from epp.scheduling.profile import NamedFilter, SchedulerProfile, WeightedScorer
from epp.scheduling.registry import PROFILE_KINDS, PluginParamsError, PluginRegistry
from epp.scheduling.saturation import SaturationDetector
from epp.scheduling.scheduler import Scheduler
from epp.tenancy import TenancyConfig

API_VERSIONS = ("inference.networking.x-k8s.io/v1alpha1", "llm-d.ai/v1alpha1")
"""The reference EPP's apiVersion, and llm-d's name for the same schema since its router moved it."""
KIND = "EndpointPickerConfig"
DEFAULT_PROFILE = "default"


class PluginEntry(_Struct):
    type: str
    name: str | None = None
    parameters: dict[str, Any] | None = None


class ProfilePluginRef(_Struct):
    plugin_ref: str
    weight: float | None = None


class ProfileEntry(_Struct):
    name: str
    plugins: list[ProfilePluginRef] = []


class EndpointEntry(_Struct):
    address: str
    model: str | None = None


class ObjectiveEntry(_Struct):
    name: str
    priority: int = 0


class ConfigDoc(_Struct):
    api_version: str
    kind: str
    plugins: list[PluginEntry] = []
    scheduling_profiles: list[ProfileEntry] = []
    saturation_detector: SaturationEntry | None = None
    endpoints: list[str | EndpointEntry] = []
    objectives: list[ObjectiveEntry] = []
    feature_gates: list[str] = []
    kv_events: KvEventsEntry | None = None
    index: IndexEntry | None = None
    tokenizers: dict[str, str | TokenizerEntry] = {}
    cost_model: dict[str, Any] | None = None
    admission: AdmissionEntry | None = None
    tenancy: TenancyEntry | None = None
    explain: ExplainEntry | None = None


@dataclass(frozen=True, slots=True)
class StaticEndpoint:
    address: str
    model: str | None = None


@dataclass(frozen=True, slots=True)
class EppConfig:
    source: str
    doc: ConfigDoc
    endpoints: tuple[StaticEndpoint, ...]
    objectives: Mapping[str, int]
    saturation: SaturationDetector
    kv_events: KvEventsConfig = dataclasses.field(default_factory=KvEventsConfig)
    index: IndexConfig = dataclasses.field(default_factory=IndexConfig)
    tokenizers: Mapping[str, str | TokenizerSpec] = dataclasses.field(default_factory=dict)
    """model -> its tokenizer directory, or a `TokenizerSpec` when the config mirrors the model's vLLM
    server-side chat settings (`tokenizers: {model: {path, defaultChatTemplateKwargs, ...}}`)."""
    cost_model: CostModelSettings = dataclasses.field(default_factory=CostModelSettings)
    admission: Admission = dataclasses.field(default_factory=Admission)
    tenancy: TenancyConfig | None = None
    explain: ExplainConfig = dataclasses.field(default_factory=ExplainConfig)
    implied_profile: bool = False
    """`schedulingProfiles` was not given: `doc` holds the reference's default profile, which lists
    every plugin; the filters, scorers and picker among them make it up."""


DEFAULT_CONFIG_YAML = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: metrics-staleness-filter
  parameters: {maxAge: 2s}
- type: ttft-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: metrics-staleness-filter
  - pluginRef: ttft-scorer
  - pluginRef: max-score-picker
"""
"""The built-in default: pick by estimated time to first token. With KV events on, the estimate
credits cached prefixes from the index; without, it is load-aware only."""

LOAD_AWARE_CONFIG_YAML = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: metrics-staleness-filter
  parameters: {maxAge: 2s}
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: active-request-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: metrics-staleness-filter
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: active-request-scorer, weight: 1}
  - pluginRef: max-score-picker
"""
"""The reference EPP's load-aware scorers (the default before the TTFT picker)."""


def parse_endpoint_address(address: str) -> str:
    """Normalise `ip:port` (IPv6 as `[addr]:port`); ValueError on anything else."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {address!r} is not ip:port")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise ValueError(f"endpoint {address!r}: {host!r} is not an IP address") from None
    if ip.version == 6:
        return f"[{ip}]:{int(port)}"
    return f"{ip}:{int(port)}"


def parse_config(text: str, source: str = "<config>") -> EppConfig:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(source, "", "", f"not valid YAML: {err}") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(source, "", "", "not valid YAML: nested too deeply") from None
    if not isinstance(raw, dict):
        raise ConfigError(source, "", "", "the config must be a YAML mapping")
    refuse_unsupported(source, raw, KIND)
    try:
        doc = msgspec.convert(raw, ConfigDoc, strict=True)
    except msgspec.ValidationError as err:
        raise validation_error(source, raw, err) from None
    except RecursionError:
        raise ConfigError(source, "", "", "the config is nested too deeply") from None
    if doc.api_version not in API_VERSIONS:
        accepted = " or ".join(API_VERSIONS)
        raise ConfigError(
            source, "", "apiVersion", f"unsupported apiVersion {doc.api_version!r} (accepted: {accepted})"
        )
    if doc.kind != KIND:
        raise ConfigError(source, "", "kind", f"kind must be {KIND!r}, got {doc.kind!r}")
    implied_profile = not doc.scheduling_profiles
    if implied_profile:  # the reference's default profile; `build_scheduler` keeps the kinds it takes
        refs = [ProfilePluginRef(p.name or p.type) for p in doc.plugins]
        doc = msgspec.structs.replace(doc, scheduling_profiles=[ProfileEntry(DEFAULT_PROFILE, refs)])
    endpoints = []
    for i, e in enumerate(doc.endpoints):
        entry = EndpointEntry(address=e) if isinstance(e, str) else e
        try:
            endpoints.append(StaticEndpoint(parse_endpoint_address(entry.address), entry.model))
        except ValueError as err:
            raise ConfigError(source, f"endpoints[{i}]", "address", str(err)) from None
    objectives: dict[str, int] = {}
    for o in doc.objectives:
        if o.name in objectives:
            raise ConfigError(source, f"objective {o.name!r}", "name", "duplicate objective")
        objectives[o.name] = o.priority
    saturation = saturation_config(source, doc.saturation_detector or SaturationEntry())
    kv = kv_events_config(source, doc.kv_events or KvEventsEntry())
    idx = doc.index or IndexEntry()
    if not 1 <= idx.block_size <= 256:
        raise ConfigError(source, "index", "blockSize", f"must be in 1..256, got {idx.block_size}")
    if idx.max_entries < 1:
        raise ConfigError(source, "index", "maxEntries", "must be >= 1")
    if idx.max_keyed_prompt_chars < 0:
        raise ConfigError(source, "index", "maxKeyedPromptChars", "must be >= 0")
    tokenizers = tokenizers_config(source, doc.tokenizers)
    try:
        cost_model = parse_cost_model(doc.cost_model)
    except ProfileError as err:
        raise ConfigError(source, "costModel", err.field, err.message) from None
    return EppConfig(
        source,
        doc,
        tuple(endpoints),
        objectives,
        saturation,
        kv,
        IndexConfig(idx.block_size, idx.max_entries, idx.max_keyed_prompt_chars),
        tokenizers,
        cost_model,
        admission_config(source, doc.admission or AdmissionEntry()),
        tenancy_config(source, doc.tenancy),
        explain_config(source, doc.explain or ExplainEntry()),
        implied_profile,
    )


def load_config(path: str) -> EppConfig:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ConfigError(path, "", "", f"cannot read config file: {err.strerror}") from None
    return parse_config(text, path)


def default_config() -> EppConfig:
    return parse_config(DEFAULT_CONFIG_YAML, "<built-in default config>")


def build_scheduler(
    config: EppConfig,
    registry: PluginRegistry,
    clock: Clock,
    rng: random.Random,
    timer: Clock | None = None,
    services: Mapping[str, Any] | None = None,
) -> Scheduler:
    """Instantiate every plugin (validating parameters) and assemble the profiles."""
    src = config.source
    handle = PluginHandle(clock=clock, rng=rng, services=dict(services or {}))
    _refuse_unknown_types(src, config.doc.plugins, registry)
    built: dict[str, tuple[str, Any]] = {}
    kinds: dict[str, str] = {}
    handler: ProfileHandler | None = None
    handler_where = ""
    for i, entry in enumerate(config.doc.plugins):
        name = entry.name or entry.type
        where = f"plugin {name!r} (plugins[{i}], type {entry.type!r})"
        if name in built:
            raise ConfigError(src, where, "name", "duplicate plugin name")
        try:
            kind, plugin = registry.create(entry.type, name, entry.parameters, handle)
        except PluginParamsError as err:
            field = err.field if err.field in ("type", "parameters") else f"parameters.{err.field}"
            raise ConfigError(src, where, field if err.field else "parameters", err.message) from None
        built[name] = (entry.type, plugin)
        kinds[name] = kind
        if kind == "profile-handler":
            if handler is not None:
                raise ConfigError(src, where, "type", "only one profile handler may be configured")
            assert isinstance(plugin, ProfileHandler)
            handler, handler_where = plugin, where
    if not config.doc.scheduling_profiles:
        raise ConfigError(src, "schedulingProfiles", "", "at least one scheduling profile is required")
    # Like the reference, a profile without a picker uses a declared one (the first), else max-score.
    pickers = [(built[n][0], built[n][1]) for n, kind in kinds.items() if kind == "picker"]
    default_picker = pickers[0] if pickers else ("max-score-picker", MaxScorePicker("max-score-picker", 1))
    profiles: dict[str, SchedulerProfile] = {}
    for profile in config.doc.scheduling_profiles:
        if profile.name in profiles:
            raise ConfigError(src, f"profile {profile.name!r}", "name", "duplicate profile name")
        if config.implied_profile:
            refs = [r for r in profile.plugins if kinds.get(r.plugin_ref) in PROFILE_KINDS]
            profile = msgspec.structs.replace(profile, plugins=refs)
        profiles[profile.name] = _build_profile(
            src, profile, built, kinds, default_picker, config.implied_profile
        )
    if handler is None:
        if len(profiles) > 1:
            raise ConfigError(src, "schedulingProfiles", "", "several profiles need a profile-handler plugin")
        handler = SingleProfileHandler("single-profile-handler")
    elif isinstance(handler, SingleProfileHandler) and len(profiles) > 1:
        raise ConfigError(
            src,
            handler_where,
            "type",
            f"single-profile-handler runs one profile, but {len(profiles)} are configured "
            "(several profiles need a handler that chooses between them)",
        )
    return Scheduler(profiles, handler, clock, rng, config.saturation, timer, config.admission)


def _refuse_unknown_types(src: str, plugins: Sequence[PluginEntry], registry: PluginRegistry) -> None:
    """One error naming every plugin type the registry lacks (a pasted config often has several)."""
    unknown = [(i, e) for i, e in enumerate(plugins) if e.type not in registry]
    if not unknown:
        return
    i, entry = unknown[0]
    name = entry.name or entry.type
    others = list(dict.fromkeys(e.type for _, e in unknown[1:] if e.type != entry.type))
    message = registry.unknown_type_message(entry.type, others)
    raise ConfigError(src, f"plugin {name!r} (plugins[{i}], type {entry.type!r})", "type", message)


def _build_profile(
    src: str,
    profile: ProfileEntry,
    built: Mapping[str, tuple[str, Any]],
    kinds: Mapping[str, str],
    default_picker: tuple[str, Picker],
    implied: bool = False,
) -> SchedulerProfile:
    filters: list[NamedFilter] = []
    scorers: list[WeightedScorer] = []
    picker: tuple[str, Picker] | None = None
    for ref in profile.plugins:
        where = f"profile {profile.name!r}: plugin {ref.plugin_ref!r}"
        if ref.plugin_ref not in built:
            raise ConfigError(src, where, "pluginRef", "no plugin of that name is declared under plugins")
        type_name, plugin = built[ref.plugin_ref]
        kind = kinds[ref.plugin_ref]
        if kind != "scorer" and ref.weight is not None:
            raise ConfigError(src, where, "weight", f"only scorers take a weight ({type_name} is a {kind})")
        if kind == "scorer":
            weight = 1.0 if ref.weight is None else float(ref.weight)
            if not math.isfinite(weight) or weight < 0:
                raise ConfigError(
                    src, where, "weight", f"weight must be a finite number >= 0, got {ref.weight}"
                )
            assert isinstance(plugin, Scorer)
            scorers.append(WeightedScorer(plugin, weight, type_name))
        elif kind == "filter":
            assert isinstance(plugin, Filter)
            filters.append(NamedFilter(plugin, type_name))
        elif kind == "picker":
            if picker is not None:
                why = "a profile takes exactly one picker"
                if implied:
                    why += " (schedulingProfiles is not given, so this one takes every declared picker)"
                raise ConfigError(src, where, "pluginRef", why)
            assert isinstance(plugin, Picker)
            picker = (type_name, plugin)
        else:
            raise ConfigError(src, where, "pluginRef", f"a {kind} cannot be part of a profile")
    if picker is None:
        picker = default_picker
    return SchedulerProfile(profile.name, filters, scorers, picker[1], picker[0])


__all__ = [
    "DEFAULT_CONFIG_YAML",
    "LOAD_AWARE_CONFIG_YAML",
    "ConfigError",
    "EppConfig",
    "ExplainConfig",
    "IndexConfig",
    "KvEventsConfig",
    "StaticEndpoint",
    "build_scheduler",
    "default_config",
    "load_config",
    "parse_config",
    "parse_endpoint_address",
]
