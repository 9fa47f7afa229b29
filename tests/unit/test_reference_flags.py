"""The reference EPP's flags on `epp serve`: the chart's flag set parses, each honoured flag resolves to
its setting, and each refused value stops startup (exit 2) naming the flag and what to do instead."""

from __future__ import annotations

import json
import logging

import pytest

from epp.cli import build_parser, main
from epp.log_format import JsonFormatter
from epp.reference_flags import ReferenceFlags, log_level_given, resolve

SERVE = ["serve", "--endpoints", "127.0.0.1:1"]


def flags(*extra: str) -> ReferenceFlags:
    argv = [*SERVE, *extra]
    return resolve(build_parser().parse_args(argv), log_level_given(argv))


def test_the_reference_charts_flags_parse_and_resolve() -> None:
    """config/charts/inferencepool/templates/epp-deployment.yaml's args (with a v1alpha2 pool's group
    and leader election), plus values its users set under `flags:`."""
    argv = [
        "serve",
        "--pool-name",
        "vllm-llama3-8b-instruct",
        "--pool-group",
        "inference.networking.x-k8s.io",
        "--zap-encoder",
        "json",
        "--config-file",
        "/config/default-plugins.yaml",
        "--tracing=false",
        "--metrics-endpoint-auth=false",
        "--ha-enable-leader-election",
        "--v=3",
        "--enable-pprof=true",
        "--health-checking",
        "--refresh-prometheus-metrics-interval",
        "5s",
        "--total-queued-requests-metric",
        "vllm:num_requests_waiting",
    ]
    args = build_parser().parse_args(argv)
    ref = resolve(args, log_level_given(argv))
    assert args.config == "/config/default-plugins.yaml"
    assert args.pool_group == "inference.networking.x-k8s.io"
    assert ref.log_json and ref.log_level == "info"
    assert (ref.metrics_scheme, ref.metrics_path, ref.metrics_port) == ("http", "/metrics", None)
    assert not ref.metrics_verify_tls and not ref.cert_reload


@pytest.mark.parametrize(
    ("extra", "level"),
    [
        ((), "info"),
        (("--v", "4"), "debug"),
        (("--v=2",), "info"),
        (("--zap-log-level", "debug"), "debug"),
        (("--zap-log-level", "panic"), "error"),
        (("--zap-log-level", "5"), "debug"),
        (("--zap-devel",), "debug"),
        (("--v", "5", "--log-level", "warning"), "warning"),  # --log-level, given, wins
        (("--log-level=error", "--zap-log-level", "debug"), "error"),
    ],
)
def test_log_level_flags(extra: tuple[str, ...], level: str) -> None:
    assert flags(*extra).log_level == level


def test_scrape_flags_are_honoured() -> None:
    ref = flags(
        "--model-server-metrics-scheme",
        "https",
        "--model-server-metrics-path",
        "/stats/prometheus",
        "--model-server-metrics-port",
        "9400",
        "--model-server-metrics-https-insecure-skip-verify=false",
    )
    assert (ref.metrics_scheme, ref.metrics_path, ref.metrics_port, ref.metrics_verify_tls) == (
        "https",
        "/stats/prometheus",
        9400,
        True,
    )


@pytest.mark.parametrize(
    ("extra", "flag", "says"),
    [
        (("--tracing",), "--tracing", "--tracing=false"),
        (("--tracing=true",), "--tracing", "OpenTelemetry"),
        (("--metrics-endpoint-auth",), "--metrics-endpoint-auth", "no authentication"),
        (
            ("--metrics-staleness-threshold", "2s"),
            "--metrics-staleness-threshold",
            "metricsStalenessThreshold",
        ),
        (
            ("--total-queued-requests-metric", "nv_trt_llm_request_metrics{request_type=waiting}"),
            "--total-queued-requests-metric",
            "vllm:num_requests_waiting",
        ),
        (("--lora-info-metric", ""), "--lora-info-metric", "vllm:lora_requests_info"),
        (("--model-server-metrics-port", "70000"), "--model-server-metrics-port", "1-65535"),
        (("--model-server-metrics-path", "metrics"), "--model-server-metrics-path", "starting with '/'"),
        (("--model-server-metrics-path", "/m?x=1"), "--model-server-metrics-path", "URL path"),
        (("--refresh-prometheus-metrics-interval", "soon"), "--refresh-prometheus-metrics-interval", "soon"),
        (("--zap-log-level", "loud"), "--zap-log-level", "loud"),
        (("--zap-log-level", "-1"), "--zap-log-level", "a number >= 0"),
        (("--config-text", "x: 1", "--config", "a.yaml"), "--config-text", "not both"),
    ],
)
def test_refused_values_stop_startup_naming_the_flag(
    extra: tuple[str, ...], flag: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SERVE, *extra, "--secure-serving=false"]) == 2
    err = capsys.readouterr().err
    assert f"field '{flag}'" in err and says in err, err


@pytest.mark.parametrize(
    "extra", [("--zap-encoder", "xml"), ("--tracing=maybe",), ("--zap-time-encoding", "moon")]
)
def test_values_outside_a_flags_choices_are_usage_errors(
    extra: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*SERVE, *extra])
    assert exc.value.code == 2
    assert extra[0].split("=")[0] in capsys.readouterr().err


def test_config_text_is_read_as_a_config_file_is(capsys: pytest.CaptureFixture[str]) -> None:
    """A config given as text is checked like a file: its errors name `--config-text` as the source."""
    bad = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins: 3\n"
    assert main([*SERVE, "--config-text", bad, "--secure-serving=false"]) == 2
    err = capsys.readouterr().err
    assert "--config-text" in err and "plugins" in err


def test_json_log_lines_carry_zaps_keys() -> None:
    fmt = JsonFormatter()
    rec = logging.LogRecord(
        "epp.server", logging.WARNING, __file__, 1, "pod %s gone", ("10.0.0.1:8000",), None
    )
    line = json.loads(fmt.format(rec))
    assert line == {
        "level": "warn",
        "ts": rec.created,
        "logger": "epp.server",
        "msg": "pod 10.0.0.1:8000 gone",
    }
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        rec = logging.LogRecord("epp", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = json.loads(fmt.format(rec))
    assert line["level"] == "error" and "RuntimeError: boom" in line["stacktrace"]


def test_the_references_unset_values_mean_unset() -> None:
    """Its defaults, passed explicitly (a chart's `flags:` may): `--model-server-metrics-port 0` is the
    endpoint's own port, `--config-text ""` no config text, `--enable-cert-reload` without `--cert-path`
    nothing to reload (a self-signed certificate never changes)."""
    ref = flags("--model-server-metrics-port", "0", "--config-text", "", "--enable-cert-reload")
    assert ref.metrics_port is None and not ref.cert_reload
    argv = [*SERVE, "--config-text", ""]
    args = build_parser().parse_args(argv)
    resolve(args, log_level_given(argv))
    assert args.config_text is None


@pytest.mark.parametrize("abbreviated", [["--log", "debug"], ["--trac=false"], ["--secure", "false"]])
def test_flags_are_not_abbreviated(abbreviated: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """As the reference's pflag: a prefix of a flag is not that flag (and `--log-level`'s precedence over
    `--v` reads the full name)."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*SERVE, *abbreviated])
    assert exc.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "value"), [("t", True), ("F", False), ("TRUE", True), ("0", False)])
def test_boolean_flags_take_gos_forms(text: str, value: bool) -> None:
    args = build_parser().parse_args(
        [*SERVE, f"--secure-serving={text}", f"--ha-enable-leader-election={text}"]
    )
    assert args.secure_serving is value and args.ha_enable_leader_election is value
