"""Settings refused before serving, each with a message naming what to change: scrape settings that
leave every endpoint stale, `--max-body-size 0`, a certificate and key that do not match, a wrongly
typed plugin weight; and the reference EPP's parameter names of `prefix-cache-scorer`."""

from __future__ import annotations

import pathlib
import random

import pytest

from epp.cli import main
from epp.clock import MonotonicClock
from epp.config import ConfigError, EppConfig, build_scheduler, default_config, parse_config
from epp.scheduling.builtin import default_registry
from epp.scheduling.plugins.approx_prefix_scorer import ApproxPrefixScorer
from epp.scheduling.scheduler import Scheduler
from epp.server.startup import check_scrape_settings
from epp.server.tls import load_cert_dir, self_signed

HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
NO_FILTER = HEAD + (
    "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: d, plugins: [{pluginRef: queue-scorer}]}]\n"
)


def scheduler(cfg: EppConfig) -> Scheduler:
    return build_scheduler(cfg, default_registry(), MonotonicClock(), random.Random(0))


def staleness(max_age: str, saturation: str = "200ms") -> EppConfig:
    return parse_config(
        HEAD + "plugins:\n- {type: metrics-staleness-filter, name: fresh, parameters: {maxAge: "
        f"{max_age}}}}}\n- type: queue-scorer\nschedulingProfiles:\n- name: main\n  plugins: "
        "[{pluginRef: fresh}, {pluginRef: queue-scorer}]\n"
        f"saturationDetector: {{metricsStalenessThreshold: {saturation}}}\n",
        "s.yaml",
    )


# -- 6. scrape settings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "interval"),
    [
        (default_config(), 0.05),  # the shipped settings
        (staleness("2s", saturation="2s"), 1.99),  # just below both
        (parse_config(NO_FILTER, "n.yaml"), 0.0),  # no scraping and no filter: nothing goes stale
        (staleness("2s", saturation="1s"), 0.999),
    ],
)
def test_consistent_scrape_settings_pass(cfg: EppConfig, interval: float) -> None:
    check_scrape_settings(cfg.source, scheduler(cfg), interval)


def test_scraping_disabled_with_the_staleness_filter_is_refused() -> None:
    cfg = staleness("2s")
    with pytest.raises(ConfigError) as err:
        check_scrape_settings(cfg.source, scheduler(cfg), 0.0)
    e = err.value
    assert e.where == "profile 'main': plugin 'fresh'"
    assert "--refresh-metrics-interval 0 disables metrics scraping" in e.message
    assert "metrics-staleness-filter" in e.message and "429" in e.message


def test_a_filter_threshold_below_the_interval_is_refused_naming_both() -> None:
    cfg = staleness("100ms")
    with pytest.raises(ConfigError) as err:
        check_scrape_settings(cfg.source, scheduler(cfg), 0.5)
    e = err.value
    assert (e.where, e.field) == ("profile 'main': plugin 'fresh'", "parameters.maxAge")
    assert "maxAge 100ms is not above --refresh-metrics-interval 500ms" in e.message


def test_a_saturation_threshold_below_the_interval_is_refused_naming_both() -> None:
    cfg = staleness("10s", saturation="200ms")
    with pytest.raises(ConfigError) as err:
        check_scrape_settings(cfg.source, scheduler(cfg), 2.0)
    e = err.value
    assert (e.where, e.field) == ("saturationDetector", "metricsStalenessThreshold")
    assert "200ms is not above --refresh-metrics-interval 2s" in e.message
    assert str(e).startswith("s.yaml: saturationDetector: field 'metricsStalenessThreshold'")


def test_serve_refuses_inconsistent_scrape_settings_before_listening(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["serve", "--endpoints", "127.0.0.1:1", "--host", "127.0.0.1", "--secure-serving=false"]
    args += ["--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0"]
    assert main([*args, "--refresh-metrics-interval", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epp: config error: <built-in default config>: profile 'default'")
    assert "--refresh-metrics-interval 0 disables metrics scraping" in err
    assert main([*args, "--refresh-metrics-interval", "5s"]) == 2
    err = capsys.readouterr().err
    assert "maxAge 2s is not above --refresh-metrics-interval 5s" in err


# -- 7. --max-body-size ----------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["0", "0k", "0MiB", " 0 gib"])
def test_a_zero_body_limit_is_refused(size: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--endpoints", "10.0.0.1:80", "--max-body-size", size])
    assert exc.value.code == 2
    assert "--max-body-size: must be more than 0 bytes" in capsys.readouterr().err


def test_a_body_limit_above_the_shared_budget_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Such a body would get 503 (retry) every time instead of 413."""
    args = ["serve", "--endpoints", "127.0.0.1:1", "--host", "127.0.0.1", "--secure-serving=false"]
    args += ["--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0"]
    assert main([*args, "--max-body-size", "64MiB", "--max-buffered-body-size", "32MiB"]) == 2
    err = capsys.readouterr().err
    assert "--max-body-size" in err and "more than --max-buffered-body-size" in err


# -- 4. a certificate and a key that do not belong together -----------------------------------------


def test_a_mismatched_certificate_and_key_are_refused(tmp_path: pathlib.Path) -> None:
    crt, _ = self_signed()
    _, other_key = self_signed()
    (tmp_path / "tls.crt").write_bytes(crt)
    (tmp_path / "tls.key").write_bytes(other_key)
    with pytest.raises(ValueError, match="do not match") as err:
        load_cert_dir(str(tmp_path))
    assert "tls.crt" in str(err.value) and "tls.key" in str(err.value)


def test_a_matching_pair_loads(tmp_path: pathlib.Path) -> None:
    crt, key = self_signed()
    (tmp_path / "tls.crt").write_bytes(crt)
    (tmp_path / "tls.key").write_bytes(key)
    assert load_cert_dir(str(tmp_path)) == (crt, key)


# -- 8. a wrongly typed weight names the profile and the plugin ---------------------------------------


def test_a_string_weight_names_the_profile_and_the_plugin() -> None:
    text = HEAD + (
        "plugins: [{type: queue-scorer}]\nschedulingProfiles:\n- name: main\n"
        "  plugins: [{pluginRef: queue-scorer, weight: heavy}]\n"
    )
    with pytest.raises(ConfigError) as err:
        parse_config(text, "w.yaml")
    e = err.value
    assert e.where == "profile 'main': plugin 'queue-scorer' (schedulingProfiles[0].plugins[0])"
    assert e.field == "weight"
    assert str(e) == (
        "w.yaml: profile 'main': plugin 'queue-scorer' (schedulingProfiles[0].plugins[0]): "
        "field 'weight': Expected `float | null`, got `str`"
    )


@pytest.mark.parametrize(
    ("text", "where", "field"),
    [
        (  # no pluginRef to name: the profile and the position
            "plugins: []\nschedulingProfiles:\n- name: main\n  plugins: [{weight: 2}]\n",
            "profile 'main' (schedulingProfiles[0].plugins[0])",
            "pluginRef",
        ),
        (
            "plugins: [{type: queue-scorer, name: q, parameters: 3}]\nschedulingProfiles: [{name: d}]\n",
            "plugin 'q' (plugins[0], type 'queue-scorer')",
            "parameters",
        ),
        (  # nothing to name a profile by: the position only
            "plugins: []\nschedulingProfiles: [{plugins: []}]\n",
            "schedulingProfiles[0]",
            "name",
        ),
    ],
)
def test_validation_errors_name_what_the_document_names(text: str, where: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(HEAD + text, "v.yaml")
    assert (err.value.where, err.value.field) == (where, field)


# -- 9. prefix-cache-scorer takes the reference EPP's parameter names --------------------------------


def prefix_scorer(parameters: str) -> ApproxPrefixScorer:
    cfg = parse_config(
        HEAD + f"plugins:\n- type: prefix-cache-scorer\n  parameters: {parameters}\n"
        "schedulingProfiles: [{name: d, plugins: [{pluginRef: prefix-cache-scorer}]}]\n",
        "p.yaml",
    )
    scorer = scheduler(cfg).profiles["d"].scorers[0].scorer
    assert isinstance(scorer, ApproxPrefixScorer)
    return scorer


@pytest.mark.parametrize(
    ("parameters", "chars", "blocks", "capacity"),
    [
        ("{}", 64, 256, 31_250),
        ("{blockSizeChars: 32, maxPrefixBlocks: 10}", 32, 10, 31_250),
        ("{blockSize: 16}", 16, 256, 31_250),
        ("{hashBlockSize: 128, maxPrefixBlocksToMatch: 7, lruCapacityPerServer: 9}", 128, 7, 9),
    ],
)
def test_the_reference_names_are_accepted(parameters: str, chars: int, blocks: int, capacity: int) -> None:
    s = prefix_scorer(parameters)
    assert (s.block_chars, s.max_blocks, s.index.capacity) == (chars, blocks, capacity)


@pytest.mark.parametrize(
    ("parameters", "field", "names"),
    [
        ("{blockSizeChars: 64, blockSize: 64}", "parameters.blockSize", "blockSizeChars and blockSize"),
        ("{blockSize: 64, hashBlockSize: 32}", "parameters.hashBlockSize", "blockSize and hashBlockSize"),
        (
            "{maxPrefixBlocks: 5, maxPrefixBlocksToMatch: 5}",
            "parameters.maxPrefixBlocksToMatch",
            "maxPrefixBlocks and maxPrefixBlocksToMatch",
        ),
    ],
)
def test_an_alias_and_our_name_together_are_refused_naming_both(
    parameters: str, field: str, names: str
) -> None:
    with pytest.raises(ConfigError) as err:
        prefix_scorer(parameters)
    assert err.value.field == field
    assert f"{names} are the same setting" in err.value.message


@pytest.mark.parametrize(
    ("parameters", "field"),
    [
        ("{hashBlockSize: 0}", "parameters.hashBlockSize"),
        ("{maxPrefixBlocksToMatch: -1}", "parameters.maxPrefixBlocksToMatch"),
        ("{blockSizeChars: 0}", "parameters.blockSizeChars"),
        ("{blockSize: big}", "parameters.blockSize"),
    ],
)
def test_bad_values_under_either_name_are_refused(parameters: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        prefix_scorer(parameters)
    assert err.value.field == field


def test_a_staleness_threshold_equal_to_the_scrape_interval_is_refused() -> None:
    """Equal is not enough: just before each scrape lands, the last one is older than the interval."""
    from epp.config import build_scheduler, parse_config
    from epp.config_sections import ConfigError
    from epp.scheduling.builtin import default_registry
    from epp.scheduling.scrape_settings import check_scrape_settings

    text = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins: [{type: metrics-staleness-filter, parameters: {maxAge: 100ms}}, {type: max-score-picker}]
schedulingProfiles:
- {name: p, plugins: [{pluginRef: metrics-staleness-filter}, {pluginRef: max-score-picker}]}
"""
    import random

    from epp.clock import MonotonicClock

    sched = build_scheduler(
        parse_config(text, "c.yaml"), default_registry(), MonotonicClock(), random.Random(0)
    )
    with pytest.raises(ConfigError) as exc:
        check_scrape_settings("c.yaml", sched, 0.1)
    assert "maxAge 100ms is not above --refresh-metrics-interval 100ms" in str(exc.value)
    check_scrape_settings("c.yaml", sched, 0.099)  # below: fine
