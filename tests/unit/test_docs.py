"""The references in docs/ cannot drift from the code (epp/docs_reference.py), and the shipped configs load.

The first tests check the real docs against the real code; the rest show that the check fails,
with a message naming the problem, for each way the two can disagree.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import shutil
from collections.abc import Iterator

import msgspec
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp import docs_reference as ref
from epp.cli import build_parser, main
from epp.config import build_scheduler, load_config
from epp.costmodel.profile import ProfileError
from epp.costmodel.service import SERVICE_KEY as COST_KEY
from epp.costmodel.service import CostModel, parse_cost_model
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.service import SERVICE_KEY, KvIndexService
from epp.scheduling.builtin import default_registry
from epp.scheduling.plugins.queue_scorer import SPEC as QUEUE_SPEC
from epp.scheduling.registry import Params, PluginRegistry, PluginSpec
from epp.testing.fakes import FakeClock

ROOT = pathlib.Path(__file__).resolve().parents[2]
METRICS = (ROOT / ref.METRICS_DOC).read_text()
CONFIG = (ROOT / ref.CONFIG_DOC).read_text()


def _edit(text: str, old: str, new: str) -> str:
    assert old in text, f"the test's anchor {old!r} is gone from the doc"
    return text.replace(old, new, 1)


# -- the real docs agree with the real code ----------------------------------------------------


def test_the_metrics_reference_lists_every_metric_with_its_type_and_labels() -> None:
    exposed = ref.exposed_metrics()
    # both metric sources the brief names are seen: EppMetrics and the KV index collector
    assert {"epp_picks_total", "epp_cost_model_prefill_scale", "epp_kv_drops_total"} <= set(exposed)
    assert exposed["epp_kv_pod_freshness"].labels == {"pod", "state", "reason"}
    assert ref.metric_problems(METRICS, exposed) == []


def test_the_configuration_reference_lists_every_section_key_and_default() -> None:
    sections = ref.config_sections()
    assert {"", "kvEvents", "costModel.profiles[].tiers.<name>", "costModel.calibration"} <= set(sections)
    assert ref.section_problems(CONFIG, sections) == []


def test_the_configuration_reference_lists_every_plugin_and_parameter() -> None:
    assert ref.plugin_problems(CONFIG, ref.plugin_infos(default_registry())) == []


def test_every_serve_flag_is_documented() -> None:
    flags = ref.serve_flags(build_parser())
    assert {"--config", "--config-file", "--tokenizer", "--kv-events-mode"} <= set(flags)
    assert "--help" not in flags
    assert ref.flag_problems(ref.read_docs(ROOT), flags) == []


def test_the_check_command_passes_on_this_checkout(capsys: pytest.CaptureFixture[str]) -> None:
    assert ref.main(["--root", str(ROOT)]) == 0
    assert "agree with the code" in capsys.readouterr().out


# -- metrics: what the code exposes ---------------------------------------------------------------


class _Families(Collector):
    def __init__(self, *families: Metric) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def test_metrics_are_read_with_their_labels_even_without_samples() -> None:
    r = CollectorRegistry()
    Counter("jobs_total", "d", ["queue", "outcome"], registry=r)
    Histogram("wait_seconds", "d", ["queue"], registry=r)
    Gauge("up", "d", registry=r)
    r.register(_Families(GaugeMetricFamily("depth", "d", labels=["pod", "tier"])))
    assert ref.registry_metrics(r) == {
        "jobs_total": ref.MetricInfo("jobs_total", "counter", frozenset({"queue", "outcome"})),
        "wait_seconds": ref.MetricInfo("wait_seconds", "histogram", frozenset({"queue"})),
        "up": ref.MetricInfo("up", "gauge", frozenset()),
        "depth": ref.MetricInfo("depth", "gauge", frozenset({"pod", "tier"})),
    }


def test_a_family_without_label_names_takes_them_from_its_samples_or_fails() -> None:
    plain = Metric("lag_seconds", "d", "gauge")
    plain.add_sample("lag_seconds", {"pod": "a"}, 1.0)
    r = CollectorRegistry()
    r.register(_Families(plain))
    assert ref.registry_metrics(r)["lag_seconds"].labels == {"pod"}
    empty = CollectorRegistry()
    empty.register(_Families(Metric("silent", "d", "gauge")))
    with pytest.raises(ValueError, match="cannot tell the label names of 'silent'"):
        ref.registry_metrics(empty)


# -- metrics: the check fails on every disagreement ----------------------------------------------


def test_a_missing_label_is_a_metrics_problem() -> None:
    text = _edit(
        METRICS,
        "| `epp_kv_drops_total` | counter | `pod`, `reason` |",
        "| `epp_kv_drops_total` | counter | `pod` |",
    )
    (problem,) = ref.metric_problems(text, ref.exposed_metrics())
    assert "`epp_kv_drops_total` has labels pod, reason, documented pod" in problem


def test_an_extra_label_a_wrong_type_and_prose_in_the_labels_cell_are_problems() -> None:
    exposed = ref.exposed_metrics()
    text = _edit(
        METRICS,
        "| `epp_picks_total` | counter | `endpoint`, `profile`, `reason` |",
        "| `epp_picks_total` | gauge | `endpoint`, `profile`, `reason`, `model` |",
    )
    text = _edit(
        text,
        "| `epp_endpoint_healthy` | gauge | `endpoint` |",
        "| `epp_endpoint_healthy` | gauge | the endpoint |",
    )
    problems = ref.metric_problems(text, exposed)
    assert len(problems) == 3
    assert "`epp_picks_total` is a counter, documented as 'gauge'" in problems[0]
    assert "`epp_picks_total` has labels endpoint, profile, reason, documented endpoint, model" in problems[1]
    assert "`epp_endpoint_healthy`: the labels cell must list label names in `code`" in problems[2]


def test_a_metric_documented_that_does_not_exist_is_a_problem() -> None:
    text = _edit(METRICS, "| `epp_kv_gaps_total` |", "| `epp_kv_lost_total` |")
    problems = ref.metric_problems(text, ref.exposed_metrics())
    assert any("`epp_kv_lost_total` is documented but the EPP exposes no such metric" in p for p in problems)
    assert any(
        p.startswith(
            "docs/metrics.md: `epp_kv_gaps_total` (counter, labels pod) is not documented; "
            "add | `epp_kv_gaps_total` | counter | `pod` |"
        )
        for p in problems
    )


def test_a_metric_documented_twice_or_without_a_meaning_is_a_problem() -> None:
    row = next(line for line in METRICS.splitlines() if line.startswith("| `epp_kv_events_total` |"))
    text = _edit(METRICS, row, f"{row}\n| `epp_kv_events_total` | counter | `pod` |  |")
    problems = ref.metric_problems(text, ref.exposed_metrics())
    assert [p.split(": ", 1)[1] for p in problems] == [
        "`epp_kv_events_total` is documented twice",
        "`epp_kv_events_total` has no meaning",
    ]


def test_a_blank_line_that_breaks_a_table_loses_its_rows() -> None:
    # Markdown ends a table at a blank line; rows after it render as text, not as reference.
    text = _edit(METRICS, "| `epp_kv_index_entries` |", "\n| `epp_kv_index_entries` |")
    problems = ref.metric_problems(text, ref.exposed_metrics())
    assert any("`epp_kv_index_entries` (gauge, labels none) is not documented" in p for p in problems)
    assert any("`epp_kv_unkeyed_requests_total`" in p for p in problems)


def test_a_metric_added_to_the_code_is_a_problem_until_documented() -> None:
    exposed = dict(ref.exposed_metrics())
    exposed["epp_new_total"] = ref.MetricInfo("epp_new_total", "counter", frozenset({"pod"}))
    assert ref.metric_problems(METRICS, exposed) == [
        "docs/metrics.md: `epp_new_total` (counter, labels pod) is not documented; "
        "add | `epp_new_total` | counter | `pod` | ... |"
    ]


# -- config sections ---------------------------------------------------------------------------


def test_config_sections_follow_lists_mappings_and_yaml_names() -> None:
    sections = ref.config_sections()
    assert set(sections["costModel.profiles[].tiers.<name>"]) == {"bandwidthBytesPerSecond", "latencySeconds"}
    assert set(sections["schedulingProfiles[].plugins[]"]) == {"pluginRef", "weight"}
    assert set(sections["endpoints[]"]) == {"address", "model"}  # from `str | EndpointEntry`
    kv = sections["kvEvents"]
    assert kv["receiveHighWaterMark"].default == "100000"
    assert kv["mode"].default == '"off"'  # YAML would read a bare off as false
    assert kv["topicFilters"].default == '[""]'
    assert kv["replayPort"].default == ref.UNSET
    assert sections[""]["apiVersion"].default == ref.REQUIRED


def test_the_cost_model_keys_are_the_ones_its_parser_takes() -> None:
    for key in ref.COST_MODEL_KEYS:
        parse_cost_model({key: None})
    with pytest.raises(ProfileError, match="costModel takes profiles and calibration"):
        parse_cost_model({"profile": []})


def test_a_missing_key_an_unknown_key_and_a_wrong_default_are_problems() -> None:
    sections = ref.config_sections()
    text = _edit(CONFIG, "| `replayRetries` | `2` |", "| `replayAttempts` | `2` |")
    text = _edit(text, "| `port` | `5557` |", "| `port` | `5558` |")
    problems = ref.section_problems(text, sections)
    assert len(problems) == 3
    assert "kvEvents key `port` defaults to `5557`, documented '`5558`'" in problems[0]
    assert "kvEvents key `replayAttempts` is documented but not accepted by the code" in problems[1]
    assert problems[2] == (
        "docs/configuration.md: `kvEvents` key `replayRetries` is not documented; "
        "add | `replayRetries` | `2` | ... |"
    )


@pytest.mark.parametrize(
    ("documented", "default", "ok"),
    [
        ("`10,000,000` entries", "10000000", True),
        ("`1.0`", "1", True),
        ("`3e-5`", "3e-05", True),
        ('`"*"`', '"*"', True),
        ("`*`", '"*"', False),
        ('`[""]`', '[""]', True),
        ("`{}` (merged over ...)", "{}", True),
        ("unset (off)", ref.UNSET, True),
        ("`null`", ref.UNSET, False),
        ("required", ref.REQUIRED, True),
        ("—", "5", False),
        ("about `5`", "5", False),
    ],
)
def test_default_cells(documented: str, default: str, ok: bool) -> None:
    assert ref._same_default(documented, default) is ok


def test_a_section_without_its_table_or_under_a_wrong_heading_is_a_problem() -> None:
    sections = ref.config_sections()
    text = _edit(CONFIG, "### `explain`", "### Explanations")
    problems = ref.section_problems(text, sections)
    assert len(problems) == 2
    assert (
        "a key table must sit under `### Top-level keys` or a heading that is the section path" in problems[0]
    )
    assert "'Explanations'" in problems[0]
    assert problems[1] == (
        'docs/configuration.md: config section `explain` has no key table (add one under "### `explain`")'
    )


def test_a_section_the_config_does_not_have_is_a_problem() -> None:
    text = (
        CONFIG + "\n### `tracing`\n\n| key | default | meaning |\n|---|---|---|\n| `endpoint` | unset | x |\n"
    )
    assert ref.section_problems(text, ref.config_sections()) == [
        "docs/configuration.md: section `tracing` is documented but the config has no such section"
    ]


def test_a_new_config_key_is_a_problem_until_documented() -> None:
    sections = {k: dict(v) for k, v in ref.config_sections().items()}
    sections["index"]["shards"] = ref.KeyInfo("shards", "4")
    assert ref.section_problems(CONFIG, sections) == [
        "docs/configuration.md: `index` key `shards` is not documented; add | `shards` | `4` | ... |"
    ]


# -- plugins ------------------------------------------------------------------------------------


class _RenamedParams(Params, rename={"window_ms": "windowMillis"}):
    window_ms: int = 250
    max_items: int | None = None


def _registry_with_extra_plugin() -> PluginRegistry:
    registry = default_registry()
    registry.register(PluginSpec("window-filter", "filter", _RenamedParams, QUEUE_SPEC.build))
    return registry


def test_plugin_parameters_are_read_with_their_yaml_names() -> None:
    info = ref.plugin_infos(_registry_with_extra_plugin())["window-filter"]
    assert info.kind == "filter"
    assert info.params == {
        "windowMillis": ref.KeyInfo("windowMillis", "250"),
        "max_items": ref.KeyInfo("max_items", "unset"),
    }
    ttft = ref.plugin_infos(default_registry())["ttft-scorer"].params
    assert set(ttft) == {
        "tieBand",
        "tieBandSeconds",
        "cacheCredit",
        "speculativeTtl",
        "tieBreak",
        "copyWeight",
    }  # camelCase, as in YAML


def test_a_new_plugin_is_a_problem_until_it_and_its_parameters_are_documented() -> None:
    plugins = ref.plugin_infos(_registry_with_extra_plugin())
    assert ref.plugin_problems(CONFIG, plugins) == [
        "docs/configuration.md: plugin `window-filter` (filter) is not in the plugin table",
        "docs/configuration.md: parameter `max_items` of `window-filter` is not documented; "
        "add | `window-filter` | `max_items` | unset | ... |",
        "docs/configuration.md: parameter `windowMillis` of `window-filter` is not documented; "
        "add | `window-filter` | `windowMillis` | `250` | ... |",
    ]
    rows = "| `window-filter` | filter | drops endpoints outside the window |\n| `single-profile-handler` |"
    text = _edit(CONFIG, "| `single-profile-handler` |", rows)
    text = _edit(
        text,
        "| `round-robin-picker` | `maxNumOfEndpoints` |",
        "| `window-filter` | `window_ms` | `250` | the window |\n"
        "| `window-filter` | `windowMillis` | `250` | the window |\n"
        "| `window-filter` | `max_items` | unset | cap |\n"
        "| `round-robin-picker` | `maxNumOfEndpoints` |",
    )
    (problem,) = ref.plugin_problems(text, plugins)
    assert "window-filter parameter `window_ms` is documented but not accepted by the code" in problem


def test_a_removed_parameter_a_wrong_kind_and_an_unknown_plugin_are_problems() -> None:
    plugins = ref.plugin_infos(default_registry())
    text = _edit(
        CONFIG, "| `ttft-scorer` | `cacheCredit` | `true` |", "| `ttft-scorer` | `cacheCredit` | `false` |"
    )
    text = _edit(text, "| `random-picker` | picker |", "| `random-picker` | scorer |")
    text = _edit(
        text,
        "| `max-score-picker` | picker |",
        "| `best-picker` | picker | the best |\n"
        "| `round-robin-picker` | picker |\n"
        "| `max-score-picker` | picker |",
    )
    problems = ref.plugin_problems(text, plugins)
    assert len(problems) == 5
    assert "plugin `best-picker` is documented but not registered" in problems[0]
    assert "plugin `round-robin-picker` needs a kind and what it does" in problems[1]
    assert "plugin `random-picker` is a picker, documented 'scorer'" in problems[2]
    assert "plugin `round-robin-picker` is listed twice" in problems[3]
    assert "ttft-scorer parameter `cacheCredit` defaults to `true`, documented '`false`'" in problems[4]


# -- flags --------------------------------------------------------------------------------------


def test_a_flag_in_no_doc_and_a_documented_flag_that_does_not_exist_are_problems() -> None:
    flags = ["--host", "--seed", "--pool-zone"]
    table = "| flag | default | meaning |\n|---|---|---|\n| `--host` | x | y |\n| `--seeds` | 1 | z |\n"
    docs = {ref.CONFIG_DOC: table}
    problems = ref.flag_problems(docs, flags)
    assert problems[0] == "`epp serve --seed` is in no doc (docs/configuration.md)"
    assert problems[1] == "`epp serve --pool-zone` is in no doc (docs/configuration.md)"
    assert problems[2] == "docs/configuration.md:4: `--seeds` is documented but `epp serve` has no such flag"
    assert len(problems) == 3


def test_a_flag_documented_in_any_doc_counts() -> None:
    flags = ["--pool-zone", "--kubeconfig"]
    docs = {"README.md": "use `--kubeconfig FILE`", "docs/discovery.md": "| `--pool-zone` | zone |"}
    assert ref.flag_problems(docs, flags) == []
    assert ref.flag_problems({"README.md": "--pool-zones"}, ["--pool-zone"]) != []


def test_serve_flags_come_from_the_serve_parser_only() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    sub.add_parser("serve").add_argument("--alpha", "--a2")
    sub.add_parser("other").add_argument("--beta")
    assert ref.serve_flags(p) == ["--alpha", "--a2"]


# -- the command --------------------------------------------------------------------------------


def test_the_check_command_fails_and_names_the_problem(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    metrics = tmp_path / ref.METRICS_DOC
    metrics.write_text(_edit(metrics.read_text(), "| `epp_kv_gaps_total` |", "| `epp_kv_holes_total` |"))
    assert ref.main(["--root", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "`epp_kv_holes_total` is documented but the EPP exposes no such metric" in out
    assert "`epp_kv_gaps_total` (counter, labels pod) is not documented" in out
    assert "2 problem(s)" in err


# -- the shipped configs ------------------------------------------------------------------------

CONFIG_FILES = sorted(
    [*(ROOT / "examples").glob("*.yaml"), *(ROOT / "simulator" / "policies").glob("*.yaml")]
)


def test_the_shipped_configs_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in CONFIG_FILES}
    assert {"examples/epp.yaml", "simulator/policies/ttft.yaml"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_shipped_config_loads_and_builds(path: pathlib.Path) -> None:
    """As `epp serve` builds it: the services a server provides, every plugin's parameters validated."""
    config = load_config(str(path))
    svc = KvIndexService(BlockIndex(16, 10_000), FreshnessTracker(), TokenizerRegistry({}), 16)
    scheduler = build_scheduler(
        config,
        default_registry(),
        FakeClock(),
        random.Random(0),
        services={SERVICE_KEY: svc, COST_KEY: CostModel()},
    )
    assert scheduler.profiles


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_check_config_accepts_every_shipped_config(
    path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err
    assert f"{path}: ok" in capsys.readouterr().out


def test_params_structs_forbid_unknown_keys() -> None:
    # what makes "no documented parameter that does not exist" checkable: the struct is the whole truth
    for spec in default_registry().types():
        assert spec.params_type.__struct_config__.forbid_unknown_fields, spec.type_name
    ttft = default_registry().spec("ttft-scorer").params_type
    with pytest.raises(msgspec.ValidationError, match="unknown field `tieBands`"):
        msgspec.convert({"tieBands": 1}, ttft)
