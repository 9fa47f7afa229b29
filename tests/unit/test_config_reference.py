"""Configs of the reference EPP and of llm-d, pasted as they are: what each builds here, or the error.

The files under tests/data/reference_configs/ are verbatim copies (source repository, path and commit
in each file's header). Where a config uses what this EPP does not implement, the error must name it.
The reference's defaults (pkg/epp/config/loader of kubernetes-sigs/gateway-api-inference-extension)
are checked with small configs of the same shapes.
"""

from __future__ import annotations

import pathlib
import random
from typing import Any

import pytest
import yaml

from epp.cli import main
from epp.config import ConfigError, EppConfig, build_scheduler, load_config, parse_config
from epp.scheduling.builtin import default_registry
from epp.scheduling.plugins.approx_prefix_scorer import ApproxPrefixScorer
from epp.scheduling.plugins.max_score_picker import MaxScorePicker
from epp.scheduling.plugins.precise_prefix_scorer import PrecisePrefixCacheScorer
from epp.scheduling.plugins.random_picker import RandomPicker
from epp.scheduling.plugins.single_profile_handler import SingleProfileHandler
from epp.scheduling.scheduler import Scheduler
from epp.testing.fakes import FakeClock
from tests.unit.test_config import kv_services

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "reference_configs"
HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def build_config(cfg: EppConfig) -> Scheduler:
    return build_scheduler(cfg, default_registry(), FakeClock(), random.Random(0), services=kv_services())


def build_file(name: str) -> Scheduler:
    return build_config(load_config(str(DATA / name)))


def build_text(text: str) -> Scheduler:
    return build_config(parse_config(text, "epp.yaml"))


def error_of_file(name: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        build_file(name)
    return err.value


def error_of_text(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        build_text(text)
    return err.value


def weights(s: Scheduler, profile: str = "default") -> list[tuple[str, float]]:
    return [(w.scorer.name, w.weight) for w in s.profiles[profile].scorers]


def scorer(s: Scheduler, name: str, profile: str = "default") -> Any:
    return next(w.scorer for w in s.profiles[profile].scorers if w.scorer.name == name)


def prefix(s: Scheduler, name: str = "prefix-cache-scorer") -> tuple[int, int, int]:
    """(characters per block, blocks at most, blocks remembered per pod) of a prefix-cache-scorer."""
    p = scorer(s, name)
    assert isinstance(p, ApproxPrefixScorer)
    return p.block_chars, p.max_blocks, p.index.capacity


def plugin_entry(name: str, type_name: str) -> dict[str, Any]:
    """The `plugins` entry of type `type_name` in reference config `name`."""
    raw = yaml.safe_load((DATA / name).read_text())
    return next(p for p in raw["plugins"] if p["type"] == type_name)


def single_plugin_config(entry: dict[str, Any]) -> str:
    """`entry` alone, in a profile of its own."""
    profile = {"name": "default", "plugins": [{"pluginRef": entry.get("name") or entry["type"]}]}
    return HEAD + yaml.safe_dump({"plugins": [entry], "schedulingProfiles": [profile]})


def one_plugin(type_name: str, params: str) -> str:
    """A plugin of `type_name` with `params` (YAML flow), in a profile of its own."""
    return (
        HEAD + f"plugins:\n- type: {type_name}\n  parameters: {params}\n"
        f"schedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: {type_name}\n"
    )


QUEUE_PROFILE = (
    "- type: queue-scorer\nschedulingProfiles: [{name: default, plugins: [{pluginRef: queue-scorer}]}]\n"
)


# -- the reference configs ----------------------------------------------------------------------


def test_every_reference_config_names_its_source() -> None:
    files = sorted(DATA.glob("*.yaml"))
    assert len(files) >= 4
    for f in files:
        head = f.read_text().splitlines()[:4]
        assert head[0].startswith("# Source: "), f
        assert any("commit " in line and len(line.split("commit ")[1].strip()) == 40 for line in head), f


def test_gie_helm_chart_default() -> None:
    s = build_file("gie-helm-default-plugins.yaml")
    assert list(s.profiles) == ["default"]
    assert weights(s) == [
        ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
        ("prefix-cache-scorer", 3.0),
    ]
    assert prefix(s) == (64, 256, 31_250)  # the reference's defaults (64 characters = 16 tokens x 4)
    profile = s.profiles["default"]
    assert profile.filters == ()
    assert isinstance(profile.picker, MaxScorePicker) and profile.picker.max_endpoints == 1  # injected
    assert isinstance(s.handler, SingleProfileHandler)  # injected


def test_gie_chart_library_default_with_its_data_layer_plugins() -> None:
    # Before: "unknown plugin type 'metrics-data-source'".
    s = build_file("gie-epplib-default-plugins.yaml")
    assert weights(s) == [
        ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
        ("prefix-cache-scorer", 3.0),
    ]
    assert prefix(s) == (64, 256, 31_250)
    assert isinstance(s.profiles["default"].picker, MaxScorePicker)


def test_gie_docs_complete_configuration() -> None:
    s = build_file("gie-docs-config-text.yaml")
    assert weights(s) == [("prefix-cache-scorer", 50.0)]
    assert prefix(s) == (5, 256, 31_250)  # hashBlockSize is in characters in that release
    assert isinstance(s.profiles["default"].picker, MaxScorePicker)
    assert isinstance(s.handler, SingleProfileHandler)


def test_llmd_tiered_prefix_cache_guide() -> None:
    # Before: "parameters.autoTune: Object contains unknown field `autoTune`".
    s = build_file("llmd-tiered-prefix-cache-cpu.yaml")
    assert weights(s) == [
        ("active-request-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
        ("gpu-prefix-cache-scorer", 1.0),
        ("cpu-prefix-cache-scorer", 1.0),
    ]
    assert prefix(s, "gpu-prefix-cache-scorer") == (64, 256, 31_250)
    assert prefix(s, "cpu-prefix-cache-scorer") == (64, 256, 41_000)
    assert isinstance(s.profiles["default"].picker, MaxScorePicker)


def test_llmd_disaggregation_names_every_plugin_not_implemented() -> None:
    e = error_of_file("llmd-disaggregation-by-label.yaml")
    assert e.field == "type"
    assert e.where == "plugin 'prefill-pods' (plugins[0], type 'by-label')"
    for name in ("by-label", "prefill-header-handler", "prefix-based-pd-decider", "disagg-profile-handler"):
        assert repr(name) in e.message  # before: only 'by-label'
    assert "known types: " in e.message


def test_llmd_disaggregation_prefix_scorer_parameters() -> None:
    # Its prefix-cache-scorer alone: autoTune false, blockSizeTokens 5 (20 characters, as the reference
    # hashes them), maxPrefixBlocksToMatch 256, lruCapacityPerServer 31250. Before: unknown `autoTune`.
    entry = plugin_entry("llmd-disaggregation-by-label.yaml", "prefix-cache-scorer")
    s = build_text(single_plugin_config(entry))
    assert prefix(s) == (20, 256, 31_250)
    assert weights(s) == [("prefix-cache-scorer", 1.0)]


def test_llmd_precise_config_is_refused_naming_what_is_not_implemented() -> None:
    e = error_of_file("llmd-precise-prefix-cache.yaml")
    assert (e.where, e.field) == ("", "dataLayer")
    assert "data layer" in e.message and "Remove the section" in e.message
    # Without the section: its plugins this EPP lacks, all named.
    text = (DATA / "llmd-precise-prefix-cache.yaml").read_text()
    raw = yaml.safe_load(text)
    del raw["dataLayer"]
    e = error_of_text(yaml.safe_dump(raw))
    assert e.field == "type"
    for name in ("tokenizer", "endpoint-notification-source", "decode-filter"):
        assert repr(name) in e.message


def test_llmd_precise_scorer_parameters() -> None:
    entry = plugin_entry("llmd-precise-prefix-cache.yaml", "precise-prefix-cache-scorer")
    e = error_of_text(single_plugin_config(entry))
    assert e.field == "parameters.indexerConfig"
    assert "tokenizers" in e.message  # where the tokenizer goes here
    del entry["parameters"]["indexerConfig"]
    s = build_text(single_plugin_config(entry))  # tokenProcessorConfig is accepted: not needed here
    p = scorer(s, "precise-prefix-cache-scorer")
    assert isinstance(p, PrecisePrefixCacheScorer) and p.speculative is None


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("gie-helm-default-plugins.yaml", 0),
        ("gie-epplib-default-plugins.yaml", 0),
        ("gie-docs-config-text.yaml", 0),
        ("llmd-tiered-prefix-cache-cpu.yaml", 0),
        ("llmd-disaggregation-by-label.yaml", 2),
        ("llmd-precise-prefix-cache.yaml", 2),
    ],
)
def test_check_config(name: str, code: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "--skip-tokenizers", str(DATA / name)]) == code
    if code:
        assert "config error" in capsys.readouterr().err


# -- the reference loader's defaults --------------------------------------------------------------


def test_without_profiles_one_default_profile_takes_every_filter_scorer_and_picker() -> None:
    # The reference's loader (ensureSchedulingLayer) and docs: "If no scheduling profile is specified, a
    # default profile, named `default` will be added and will reference all of the instantiated plugins".
    # Before: "at least one scheduling profile is required".
    s = build_text(
        HEAD + "plugins:\n- type: metrics-staleness-filter\n- type: queue-scorer\n"
        "- type: kv-cache-utilization-scorer\n- type: random-picker\n- type: single-profile-handler\n"
        "- type: metrics-data-source\n"
    )
    assert list(s.profiles) == ["default"]
    profile = s.profiles["default"]
    assert [f.type_name for f in profile.filters] == ["metrics-staleness-filter"]
    assert weights(s) == [("queue-scorer", 1.0), ("kv-cache-utilization-scorer", 1.0)]
    assert isinstance(profile.picker, RandomPicker)


def test_without_profiles_or_a_picker_the_default_profile_picks_the_max_score() -> None:
    s = build_text(HEAD + "plugins:\n- type: queue-scorer\nschedulingProfiles: []\n")
    assert weights(s) == [("queue-scorer", 1.0)]
    assert isinstance(s.profiles["default"].picker, MaxScorePicker)


def test_a_profile_without_a_picker_uses_the_declared_one() -> None:
    # The reference reuses a declared picker for profiles without one (ensureSchedulingLayer). Before: a
    # fresh max-score-picker, ignoring the declared random-picker and its maxNumOfEndpoints.
    s = build_text(
        HEAD + "plugins:\n- type: queue-scorer\n- type: random-picker\n  parameters: {maxNumOfEndpoints: 2}\n"
        "schedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: queue-scorer\n"
    )
    picker = s.profiles["default"].picker
    assert isinstance(picker, RandomPicker) and picker.max_endpoints == 2


def test_single_profile_handler_refuses_several_profiles() -> None:
    e = error_of_text(
        HEAD + "plugins:\n- type: single-profile-handler\n- type: queue-scorer\n"
        "schedulingProfiles:\n- {name: a, plugins: [{pluginRef: queue-scorer}]}\n"
        "- {name: b, plugins: [{pluginRef: queue-scorer}]}\n"
    )
    assert e.where == "plugin 'single-profile-handler' (plugins[0], type 'single-profile-handler')"
    assert e.field == "type" and "2 are configured" in e.message


def test_llm_d_api_version_is_accepted() -> None:
    text = (
        (DATA / "gie-helm-default-plugins.yaml")
        .read_text()
        .replace("inference.networking.x-k8s.io/v1alpha1", "llm-d.ai/v1alpha1")
    )
    assert weights(build_text(text))[2] == ("prefix-cache-scorer", 3.0)
    e = error_of_text(text.replace("llm-d.ai/v1alpha1", "llm-d.ai/v9"))
    assert e.field == "apiVersion" and "accepted: inference.networking.x-k8s.io/v1alpha1 or" in e.message


def test_saturation_thresholds_of_zero_are_unset() -> None:
    # The reference's buildSaturationConfig keeps its defaults for 0 (omitempty fields). Before: 0 was
    # taken literally (every endpoint saturated, so every sheddable request got 429).
    cfg = parse_config(
        HEAD + "plugins: []\nsaturationDetector:\n  queueDepthThreshold: 0\n  kvCacheUtilThreshold: 0\n"
        "  metricsStalenessThreshold: 0s\n",
        "epp.yaml",
    )
    sat = cfg.saturation
    assert (sat.queue_depth_threshold, sat.kv_cache_util_threshold) == (5, 0.8)
    assert sat.metrics_staleness_threshold == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ("saturationDetector: {queueDepthThreshold: -1}", "queueDepthThreshold"),
        ("saturationDetector: {kvCacheUtilThreshold: -0.5}", "kvCacheUtilThreshold"),
        ("saturationDetector: {kvCacheUtilThreshold: 1.5}", "kvCacheUtilThreshold"),
        ("saturationDetector: {pluginRef: utilization-detector}", "pluginRef"),
    ],
)
def test_saturation_detector_errors(section: str, field: str) -> None:
    e = error_of_text(HEAD + "plugins:\n" + QUEUE_PROFILE + section + "\n")
    assert (e.where, e.field) == ("saturationDetector", field)
    if field == "pluginRef":  # before: "Object contains unknown field `pluginRef`"
        assert "queueDepthThreshold, kvCacheUtilThreshold and metricsStalenessThreshold" in e.message


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ("data: {sources: [{pluginRef: metrics-data-source, extractors: []}]}", "data layer"),
        ("dataLayer: {sources: []}", "data layer"),
        ("flowControl: {maxBytes: 1024}", "flow control"),
        ("parser: {pluginRef: openai-parser}", "parsers"),
        ("requestHandler: {propagatePriority: true}", "parsers"),
        ("requestControl: {prepareDataTimeout: 1s}", "request control"),
        ("discovery: {pluginRef: file-discovery}", "--pool-name"),
    ],
)
def test_reference_sections_not_implemented_are_refused_by_name(section: str, words: str) -> None:
    e = error_of_text(HEAD + "plugins:\n" + QUEUE_PROFILE + section + "\n")
    assert (e.where, e.field) == ("", section.split(":")[0])
    assert words in e.message and "Remove the section" in e.message


def test_feature_gates_are_accepted() -> None:
    s = build_text(HEAD + "featureGates: [flowControl, prepareDataPlugins]\nplugins:\n" + QUEUE_PROFILE)
    assert weights(s) == [("queue-scorer", 1.0)]


@pytest.mark.parametrize(
    ("old", "new"),
    [("kv-cache-scorer", "kv-cache-utilization-scorer"), ("prefix-cache", "prefix-cache-scorer")],
)
def test_renamed_plugin_types_name_the_current_type(old: str, new: str) -> None:
    e = error_of_text(HEAD + f"plugins:\n- type: {old}\n")
    assert e.field == "type" and f"renamed it {new!r}" in e.message


def test_data_layer_plugins_cannot_be_in_a_profile() -> None:
    e = error_of_text(
        HEAD + "plugins:\n- type: core-metrics-extractor\nschedulingProfiles:\n- name: d\n  plugins:\n"
        "  - pluginRef: core-metrics-extractor\n"
    )
    assert e.field == "pluginRef" and "a data-extractor cannot be part of a profile" in e.message


@pytest.mark.parametrize(
    ("plugin", "field"),
    [
        ("{type: metrics-data-source, parameters: {scheme: https}}", "parameters.scheme"),
        ("{type: metrics-data-source, parameters: {path: /stats}}", "parameters.path"),
        ("{type: core-metrics-extractor, parameters: {defaultEngine: sglang}}", "parameters.defaultEngine"),
    ],
)
def test_data_layer_plugins_refuse_what_this_epp_does_not_do(plugin: str, field: str) -> None:
    assert error_of_text(HEAD + f"plugins:\n- {plugin}\n" + QUEUE_PROFILE).field == field


# -- prefix-cache-scorer: every name the reference gave its settings -------------------------------


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ("{}", (64, 256, 31_250)),
        ("{hashBlockSize: 5, maxPrefixBlocksToMatch: 256, lruCapacityPerServer: 31250}", (5, 256, 31_250)),
        ("{blockSize: 32}", (32, 256, 31_250)),  # characters in the reference's v1 releases
        ("{blockSizeTokens: 16}", (64, 256, 31_250)),  # 16 tokens x 4 characters
        ("{blockSizeTokens: 64, blockSize: 10}", (256, 256, 31_250)),  # blockSizeTokens wins, as there
        ("{autoTune: true}", (64, 256, 31_250)),  # accepted; never auto-tuned here
        ("{autoTune: false, blockSizeTokens: 5}", (20, 256, 31_250)),
        ("{maxPrefixTokensToMatch: 16384}", (64, 1024, 31_250)),  # 16384 tokens / 16 per block
        ("{blockSizeTokens: 64, maxPrefixTokensToMatch: 16384}", (256, 256, 31_250)),
        ("{maxPrefixTokensToMatch: 2048, maxPrefixBlocksToMatch: 10}", (64, 128, 31_250)),  # tokens win
        ("{maxPrefixTokensToMatch: 0, maxPrefixBlocksToMatch: 10}", (64, 10, 31_250)),  # 0 is unset
    ],
)
def test_prefix_cache_scorer_parameters(params: str, expected: tuple[int, int, int]) -> None:
    assert prefix(build_text(one_plugin("prefix-cache-scorer", params))) == expected


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ("{blockSizeTokens: 0}", "parameters.blockSizeTokens"),
        ("{blockSizeTokens: 16, blockSizeChars: 64}", "parameters.blockSizeTokens"),
        ("{blockSizeTokens: 16, hashBlockSize: 64}", "parameters.blockSizeTokens"),
        ("{maxPrefixTokensToMatch: 8}", "parameters.maxPrefixTokensToMatch"),  # less than one 16-token block
        ("{maxPrefixTokensToMatch: 64, maxPrefixBlocks: 4}", "parameters.maxPrefixTokensToMatch"),
        ("{autoTune: maybe}", "parameters.autoTune"),
        ("{prefixMatchInfoProducerName: cpu}", "parameters.prefixMatchInfoProducerName"),
    ],
)
def test_prefix_cache_scorer_parameter_errors(params: str, field: str) -> None:
    assert error_of_text(one_plugin("prefix-cache-scorer", params)).field == field


# -- precise-prefix-cache-scorer: llm-d's names ----------------------------------------------------


@pytest.mark.parametrize(
    ("params", "ttl"),
    [
        ("{}", None),
        ("{speculativeTtl: 2s}", 2.0),
        ("{speculativeIndexing: true}", 2.0),  # llm-d's defaultSpeculativeTTL
        ("{speculativeIndexing: true, speculativeTTL: 500ms}", 0.5),
        ("{speculativeIndexing: false, speculativeTTL: 5s}", None),  # off, as in llm-d
        ("{speculativeTTL: 3s}", 3.0),
        ("{tokenProcessorConfig: {blockSize: 64, hashSeed: '42'}}", None),
    ],
)
def test_precise_prefix_scorer_speculative_indexing(params: str, ttl: float | None) -> None:
    p = scorer(build_text(one_plugin("precise-prefix-cache-scorer", params)), "precise-prefix-cache-scorer")
    assert isinstance(p, PrecisePrefixCacheScorer)
    assert (None if p.speculative is None else p.speculative.ttl) == (
        None if ttl is None else pytest.approx(ttl)
    )


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ("{speculativeTtl: 1s, speculativeTTL: 2s}", "parameters.speculativeTTL"),
        ("{kvEventsConfig: {zmqEndpoint: 'tcp://*:5557'}}", "parameters.kvEventsConfig"),
        ("{indexerConfig: {tokenizersPoolConfig: {modelName: m}}}", "parameters.indexerConfig"),
        ("{tokenProcessorConfig: {blockSizeInChars: 64}}", "parameters.blockSizeInChars"),
    ],
)
def test_precise_prefix_scorer_parameter_errors(params: str, field: str) -> None:
    assert error_of_text(one_plugin("precise-prefix-cache-scorer", params)).field == field
