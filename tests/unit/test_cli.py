"""The `epp` command line: every bad input is a clear error and a non-zero exit."""

from __future__ import annotations

import pathlib

import pytest

from epp.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["epp.yaml", "load-aware.yaml"])
def test_check_config_accepts_the_examples(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(ROOT / "examples" / name)]) == 0
    assert "ok" in capsys.readouterr().out


def test_the_examples_match_the_built_in_profiles() -> None:
    from epp.config import DEFAULT_CONFIG_YAML, LOAD_AWARE_CONFIG_YAML, load_config, parse_config

    for name, text in (("epp.yaml", DEFAULT_CONFIG_YAML), ("load-aware.yaml", LOAD_AWARE_CONFIG_YAML)):
        example = load_config(str(ROOT / "examples" / name)).doc
        built_in = parse_config(text).doc
        assert [p.type for p in example.plugins] == [p.type for p in built_in.plugins]
        assert example.scheduling_profiles == built_in.scheduling_profiles


def test_check_config_names_the_problem(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins:\n- type: max-score-picker\n  parameters: {maxNumOfEndpoints: 0}\n"
        "schedulingProfiles: [{name: d, plugins: [{pluginRef: max-score-picker}]}]\n"
    )
    assert main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "max-score-picker" in err and "maxNumOfEndpoints" in err


def test_plugins_lists_the_builtins(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for name in ("queue-scorer", "kv-cache-utilization-scorer", "max-score-picker", "round-robin-picker"):
        assert name in out


def test_serve_without_endpoints_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve"]) == 2
    assert "no endpoints" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["serve", "--endpoints", "10.0.0.1"], "is not ip:port"),
        (["serve", "--endpoints", "host.example:80"], "is not an IP address"),
        (["serve", "--endpoints", "10.0.0.1:80", "--grpc-port", "70000"], "port out of range"),
        (["serve", "--endpoints", "10.0.0.1:80", "--secure-serving=maybe"], "expected true or false"),
        (["serve", "--endpoints", "10.0.0.1:80", "--refresh-metrics-interval", "soon"], "not a duration"),
        (["serve", "--endpoints", "10.0.0.1:80", "--max-body-size", "lots"], "not a size"),
        (["serve", "--endpoints", "10.0.0.1:80", "--tokenizer", "no-equals-sign"], "expected MODEL=DIR"),
        (["serve", "--endpoints", "10.0.0.1:80", "--kv-events-mode", "sideways"], "invalid choice"),
        (["serve", "--endpoints", "10.0.0.1:80", "--shutdown-grace", "a while"], "not a duration"),
    ],
)
def test_bad_flags_exit_2_with_a_message(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_missing_config_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", "/nonexistent.yaml"]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def test_bad_cert_path_fails_before_serving(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["serve", "--endpoints", "127.0.0.1:1", "--cert-path", str(tmp_path), "--host", "127.0.0.1"]
    args += ["--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0"]
    assert main(args) == 1
    assert "tls.crt" in capsys.readouterr().err


def test_missing_tokenizer_directory_fails_at_startup(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "serve",
        "--endpoints",
        "127.0.0.1:1",
        "--tokenizer",
        f"m={tmp_path / 'nope'}",
        "--host",
        "127.0.0.1",
    ]
    args += ["--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0", "--secure-serving=false"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "tokenizer error" in err and "nope" in err


def test_bad_kv_bind_flag_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "serve",
        "--endpoints",
        "127.0.0.1:1",
        "--kv-events-mode",
        "central",
        "--kv-events-bind",
        "nowhere",
    ]
    assert main(args) == 2
    assert "bind" in capsys.readouterr().err


def test_verify_peer_flag_needs_a_tcp_bind(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["serve", "--endpoints", "127.0.0.1:1", "--kv-events-mode", "central", "--kv-events-verify-peer"]
    assert main([*args, "--kv-events-bind", "ipc:///tmp/epp-kv"]) == 2
    err = capsys.readouterr().err
    assert "verifyPeer" in err and "tcp://" in err


def test_check_config_can_skip_loading_tokenizers(capsys: pytest.CaptureFixture[str]) -> None:
    """A deployment's config names tokenizer directories that exist only in the pod."""
    path = ROOT / "deploy" / "base" / "epp-config.yaml"
    assert main(["check-config", str(path)]) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert main(["check-config", "--skip-tokenizers", str(path)]) == 0
    assert "ok (tokenizers not loaded)" in capsys.readouterr().out


HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def test_check_config_reads_the_tenancy_secret_as_serve_does(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config whose secret `epp serve` could not read is not `ok`; `--skip-secrets` checks the rest."""
    missing = tmp_path / "t-missing.yaml"
    missing.write_text(HEAD + f"tenancy: {{secretFile: {tmp_path / 'nope'}}}\n")
    assert main(["check-config", str(missing)]) == 1
    err = capsys.readouterr().err
    assert "cannot read secretFile" in err and "nope" in err
    assert main(["check-config", "--skip-secrets", str(missing)]) == 0
    assert "ok (secrets not loaded)" in capsys.readouterr().out

    short = tmp_path / "short"
    short.write_text("too-short\n")
    cfg = tmp_path / "t-short.yaml"
    cfg.write_text(HEAD + f"tenancy: {{secretFile: {short}}}\n")
    assert main(["check-config", str(cfg)]) == 1
    assert "at least 16 bytes" in capsys.readouterr().err

    env = tmp_path / "t-env.yaml"
    env.write_text(HEAD + "tenancy: {secretEnv: EPP_TEST_TENANT_SECRET}\n")
    monkeypatch.delenv("EPP_TEST_TENANT_SECRET", raising=False)
    assert main(["check-config", str(env)]) == 1
    assert "EPP_TEST_TENANT_SECRET" in capsys.readouterr().err
    monkeypatch.setenv("EPP_TEST_TENANT_SECRET", "a-secret-of-enough-bytes")
    assert main(["check-config", str(env)]) == 0
    assert capsys.readouterr().out.strip().endswith(": ok")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("50ms", 0.05), ("2", 2.0), ("1m30s", 90.0), ("1h2m3.5s", 3723.5), ("100ns", 1e-7), ("1.5m", 90.0)],
)
def test_durations_take_go_s_compound_form(text: str, seconds: float) -> None:
    """The reference EPP's flags are Go durations (`1m30s`); ours read them too, and bare seconds."""
    from epp.durations import parse_duration

    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["1m30", "m", "1m 30s", "-1s", "1d"])
def test_bad_durations_name_the_text(text: str) -> None:
    from epp.durations import parse_duration

    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)
