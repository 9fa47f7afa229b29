"""Config loading: the reference format is accepted, and every mistake names file, plugin and field."""

from __future__ import annotations

import random

import pytest

from epp.config import ConfigError, build_scheduler, load_config, parse_config
from epp.scheduling.builtin import default_registry
from epp.testing.fakes import FakeClock

HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
GOOD = (
    HEAD
    + """\
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- name: picker
  type: max-score-picker
  parameters:
    maxNumOfEndpoints: 2
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 1.5}
  - {pluginRef: picker}
saturationDetector:
  queueDepthThreshold: 7
  kvCacheUtilThreshold: 0.9
  metricsStalenessThreshold: 300ms
endpoints:
- 10.0.0.5:8000
- {address: "[fd00::1]:8000", model: llama}
objectives:
- {name: batch, priority: -1}
- {name: interactive, priority: 10}
"""
)


def build(text: str) -> object:
    return build_scheduler(
        parse_config(text, "epp.yaml"),
        default_registry(),
        FakeClock(),
        random.Random(0),
        services=kv_services(),
    )


def kv_services() -> dict[str, object]:
    from epp.kvindex.freshness import FreshnessTracker
    from epp.kvindex.index import BlockIndex
    from epp.kvindex.prompt import TokenizerRegistry
    from epp.kvindex.service import SERVICE_KEY, KvIndexService

    svc = KvIndexService(BlockIndex(16, 1000), FreshnessTracker(), TokenizerRegistry({}), 16)
    return {SERVICE_KEY: svc}


def test_reference_style_config_is_accepted() -> None:
    cfg = parse_config(GOOD, "epp.yaml")
    s = build(GOOD)
    assert [e.address for e in cfg.endpoints] == ["10.0.0.5:8000", "[fd00::1]:8000"]
    assert cfg.endpoints[1].model == "llama"
    assert cfg.objectives == {"batch": -1, "interactive": 10}
    assert cfg.saturation.metrics_staleness_threshold == pytest.approx(0.3)
    assert cfg.saturation.queue_depth_threshold == 7
    profile = s.profiles["default"]  # type: ignore[attr-defined]
    assert [w.weight for w in profile.scorers] == [2.0, 1.5]
    assert profile.picker.max_endpoints == 2


@pytest.mark.parametrize(
    ("text", "where", "field"),
    [
        (HEAD.replace("v1alpha1", "v9") + "plugins: []\n", "", "apiVersion"),
        (HEAD.replace("EndpointPickerConfig", "Other"), "", "kind"),
        (
            HEAD + "plugins:\n- type: no-such-scorer\nschedulingProfiles: [{name: d}]\n",
            "no-such-scorer",
            "type",
        ),
        (
            HEAD + "plugins:\n- type: max-score-picker\n  parameters: {maxNumOfEndpoint: 2}\n"
            "schedulingProfiles: [{name: d}]\n",
            "max-score-picker",
            "parameters.maxNumOfEndpoint",
        ),
        (
            HEAD + "plugins:\n- type: max-score-picker\n  parameters: {maxNumOfEndpoints: -1}\n"
            "schedulingProfiles: [{name: d}]\n",
            "max-score-picker",
            "parameters.maxNumOfEndpoints",
        ),
        (
            HEAD + "plugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: d\n  plugins:\n"
            "  - {pluginRef: queue-scorer, weight: -1}\n",
            "queue-scorer",
            "weight",
        ),
        (
            HEAD + "plugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: d\n  plugins:\n"
            "  - {pluginRef: queue-scorer, weight: .nan}\n",
            "queue-scorer",
            "weight",
        ),
        (
            HEAD + "plugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: d\n  plugins:\n"
            "  - {pluginRef: queue-scorer, weight: heavy}\n",
            "plugins[0]",
            "weight",
        ),
        (
            HEAD + "plugins:\n- type: max-score-picker\nschedulingProfiles:\n- name: d\n  plugins:\n"
            "  - {pluginRef: max-score-picker, weight: 2}\n",
            "max-score-picker",
            "weight",
        ),
        (
            HEAD + "plugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: d\n  plugins:\n"
            "  - {pluginRef: missing}\n",
            "missing",
            "pluginRef",
        ),
        (
            HEAD + "plugins:\n- type: queue-scorer\n- type: queue-scorer\nschedulingProfiles: [{name: d}]\n",
            "queue-scorer",
            "name",
        ),
        (  # the reference refuses single-profile-handler with several profiles too
            HEAD + "plugins:\n- type: single-profile-handler\nschedulingProfiles: [{name: a}, {name: b}]\n",
            "single-profile-handler",
            "type",
        ),
        (  # no schedulingProfiles: the default profile takes every picker, and a profile takes one
            HEAD + "plugins:\n- type: max-score-picker\n- type: random-picker\n",
            "random-picker",
            "pluginRef",
        ),
        (HEAD + "plugins: []\nschedulingProfiles: [{name: a}, {name: b}]\n", "schedulingProfiles", ""),
        (HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nsurprise: 1\n", "", "surprise"),
        (
            HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nendpoints: [not-an-ip:80]\n",
            "endpoints[0]",
            "address",
        ),
        (
            HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nendpoints: ['10.0.0.1:99999']\n",
            "endpoints[0]",
            "address",
        ),
        (
            HEAD
            + "plugins: []\nschedulingProfiles: [{name: d}]\nsaturationDetector: {kvCacheUtilThreshold: 2}\n",
            "saturationDetector",
            "kvCacheUtilThreshold",
        ),
        (
            HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nsaturationDetector: "
            "{metricsStalenessThreshold: never}\n",
            "saturationDetector",
            "metricsStalenessThreshold",
        ),
        (
            HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nkvEvents: {mode: sideways}\n",
            "kvEvents",
            "mode",
        ),
        (HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nkvEvents: {mode: on}\n", "kvEvents", "mode"),
        (HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nkvEvents: {port: 0}\n", "kvEvents", "port"),
        (
            HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nkvEvents: {replayPort: 70000}\n",
            "kvEvents",
            "replayPort",
        ),
        (
            HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nkvEvents: {mode: central, bind: 'x:1'}\n",
            "kvEvents",
            "bind",
        ),
        (
            HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nkvEvents: {replayTimeout: later}\n",
            "kvEvents",
            "replayTimeout",
        ),
        (
            HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nkvEvents: {dpRanks: 0}\n",
            "kvEvents",
            "dpRanks",
        ),
        (
            HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nkvEvents: {sideways: 1}\n",
            "kvEvents",
            "sideways",
        ),
        (
            HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nindex: {blockSize: 0}\n",
            "index",
            "blockSize",
        ),
        (
            HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nindex: {maxEntries: 0}\n",
            "index",
            "maxEntries",
        ),
        (
            HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nindex: {maxKeyedPromptChars: -1}\n",
            "index",
            "maxKeyedPromptChars",
        ),
        (
            HEAD + "plugins:\n- type: precise-prefix-cache-scorer\n  parameters: {tierWeights: {cpu: 2}}\n"
            "schedulingProfiles: [{name: d}]\n",
            "precise-prefix-cache-scorer",
            "parameters.tierWeights.cpu",
        ),
        ("plugins: [\n", "", ""),
        ("- just\n- a list\n", "", ""),
    ],
)
def test_config_errors_name_file_plugin_and_field(text: str, where: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        build(text)
    e = err.value
    assert e.source == "epp.yaml"
    assert where in e.where
    assert e.field == field
    assert str(e).startswith("epp.yaml")


def test_missing_file_is_a_config_error(tmp_path: object) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config("/nonexistent/epp.yaml")


def test_load_config_from_file(tmp_path: object) -> None:
    import pathlib

    p = pathlib.Path(str(tmp_path)) / "epp.yaml"
    p.write_text(GOOD)
    assert load_config(str(p)).source == str(p)


def test_kv_sections_parse() -> None:
    cfg = parse_config(
        HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\n"
        "kvEvents: {mode: per-pod, port: 6000, replayPort: 6001, dpRanks: 2, replayTimeout: 500ms}\n"
        "index: {blockSize: 64, maxEntries: 1000}\ntokenizers: {llama: /models/llama}\n",
        "kv.yaml",
    )
    assert (cfg.kv_events.mode, cfg.kv_events.port, cfg.kv_events.replay_port) == ("per-pod", 6000, 6001)
    assert cfg.kv_events.dp_ranks == 2 and cfg.kv_events.replay_timeout == pytest.approx(0.5)
    assert (cfg.index.block_size, cfg.index.max_entries) == (64, 1000)
    assert cfg.tokenizers == {"llama": "/models/llama"}


def test_precise_scorer_without_the_kv_index_is_a_config_error() -> None:
    text = HEAD + "plugins:\n- type: precise-prefix-cache-scorer\nschedulingProfiles: [{name: d}]\n"
    with pytest.raises(ConfigError, match="needs the KV index"):
        build_scheduler(parse_config(text, "epp.yaml"), default_registry(), FakeClock(), random.Random(0))


def test_the_default_profile_is_the_ttft_scorer_with_the_kv_index_when_there_is_one() -> None:
    from epp.config import default_config
    from epp.scheduling.plugins.ttft_scorer import TtftScorer

    services = kv_services()
    s = build_scheduler(
        default_config(), default_registry(), FakeClock(), random.Random(0), services=services
    )
    [scorer] = s.profiles["default"].scorers
    assert scorer.type_name == "ttft-scorer"
    assert isinstance(scorer.scorer, TtftScorer) and scorer.scorer.kv is services["kv_index"]
    plain = build_scheduler(default_config(), default_registry(), FakeClock(), random.Random(0))
    assert isinstance(plain.profiles["default"].scorers[0].scorer, TtftScorer)
    assert plain.profiles["default"].scorers[0].scorer.kv is None


def test_a_bare_off_kv_events_mode_is_off() -> None:
    """YAML 1.1 reads `off` as false; the config means the mode "off"."""
    body = "plugins: []\nschedulingProfiles: [{name: d}]\nkvEvents: {mode: off, port: 5600}\n"
    cfg = parse_config(HEAD + body)
    assert cfg.kv_events.mode == "off" and cfg.kv_events.port == 5600


def test_the_keyed_prompt_limit_reaches_the_index_config() -> None:
    cfg = parse_config(
        HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\nindex: {maxKeyedPromptChars: 10}\n", "x"
    )
    assert cfg.index.max_keyed_prompt_chars == 10
    assert parse_config(
        HEAD + "plugins: []\nschedulingProfiles: [{name: d}]\n", "x"
    ).index.max_keyed_prompt_chars == (524_288)
