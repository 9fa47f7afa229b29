"""`epp serve --endpoint-selector ... --endpoint-target-ports ...`: every bad value or combination stops
serve at start (exit 2) naming the flag, before the credentials are even looked at; good ones reach
the settings with the namespace and kubeconfig resolved as for a pool."""

from __future__ import annotations

import argparse
import logging
import pathlib
from typing import Any

import pytest

from epp.cli import main
from epp.config import default_config
from epp.discovery.flags import discovery_settings
from epp.discovery.selector import parse_selector
from epp.discovery.settings import DiscoverySettings
from tests.support.configs import STATIC_ENDPOINT

LOCAL = ["--host", "127.0.0.1", "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0"]
GOOD = ["--endpoint-selector", "app=vllm", "--endpoint-target-ports", "8000"]


def serve(tmp_path: pathlib.Path, *flags: str) -> list[str]:
    """`epp serve` with a kubeconfig that does not exist: a run that passed validation stops on it (1)."""
    return ["serve", *flags, "--kubeconfig", str(tmp_path / "nope"), *LOCAL]


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], flag: str, message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"epp: config error: flags: field '{flag}': " in err and message in err, err
    assert "no such file" not in err  # stopped before the credentials: nothing was started


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        ("app in (a", "'app in (a' is not a Kubernetes label selector: found end of string in 'app in (..."),
        ("app=vllm env=prod", "is not a Kubernetes label selector: found 'env' after app=vllm"),
        ("app=x,,env=y", "found ',', expected a label key"),
        ("-x=1", "label key '-x' is not valid"),
        ("", "'' is not a Kubernetes label selector: empty selector"),
    ],
)
def test_a_malformed_selector_is_refused(
    selector: str, message: str, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    argv = serve(tmp_path, f"--endpoint-selector={selector}", "--endpoint-target-ports", "8000")
    refused(capsys, argv, "--endpoint-selector", message)


@pytest.mark.parametrize(
    ("ports", "message"),
    [
        (["80a"], "'80a' is not a port number (expected comma-separated numbers, e.g. 8000,8001)"),
        (["8000,,8001"], "'' is not a port number"),
        ([""], "'' is not a port number"),
        (["0"], "--endpoint-target-ports: 0 is not a port number 1-65535"),
        (["8000,65536"], "--endpoint-target-ports: 65536 is not a port number 1-65535"),
        ([",".join(str(p) for p in range(8000, 8009))], "--endpoint-target-ports has 9 ports, at most 8"),
        (["8000,8001,8002,8003,8004", "8005,8006,8007,8008"], "has 9 ports, at most 8"),
    ],
)
def test_bad_target_ports_are_refused(
    ports: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    flags = ["--endpoint-selector", "app=vllm"]
    for value in ports:
        flags += ["--endpoint-target-ports", value]
    refused(capsys, serve(tmp_path, *flags), "--endpoint-target-ports", message)


@pytest.mark.parametrize(
    ("flags", "flag", "message"),
    [
        (["--endpoint-selector", "app=vllm"], "--endpoint-selector", "needs --endpoint-target-ports"),
        (["--pool-name", "p", *GOOD], "--endpoint-selector", "--pool-name and --endpoint-selector cannot"),
        (
            ["--pool-name", "p", "--endpoint-target-ports", "8000"],
            "--endpoint-target-ports",
            "needs --endpoint-selector (a pool names its own target ports)",
        ),
        (
            [*GOOD, "--pool-group", "inference.networking.k8s.io"],
            "--pool-group",
            "needs --pool-name (selector mode reads no InferencePool nor InferenceModelRewrite)",
        ),
        (
            [*GOOD, "--model-rewrite-group", "llm-d.ai"],
            "--model-rewrite-group",
            "needs --pool-name (selector",
        ),
        (
            [*GOOD, "--endpoints", "10.0.0.1:8000"],
            "--endpoint-selector",
            "Kubernetes discovery cannot be combined with static endpoints (--endpoints)",
        ),
    ],
)
def test_bad_combinations_are_refused(
    flags: list[str], flag: str, message: str, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    refused(capsys, serve(tmp_path, *flags), flag, message)


def test_target_ports_without_any_discovery_need_the_selector(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--endpoints", "10.0.0.1:8000", "--endpoint-target-ports", "8000", *LOCAL]
    assert main(argv) == 2
    assert (
        "'--endpoint-target-ports': needs --endpoint-selector (Kubernetes discovery)"
        in capsys.readouterr().err
    )


def test_config_endpoints_and_a_selector_are_refused(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "epp.yaml"
    cfg.write_text(STATIC_ENDPOINT)
    message = f"cannot be combined with static endpoints (the endpoints of {cfg})"
    refused(capsys, serve(tmp_path, "--config", str(cfg), *GOOD), "--endpoint-selector", message)


def test_a_good_selector_goes_on_to_the_credentials(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    argv = serve(tmp_path, "--endpoint-selector", "app=vllm,env in (prod)", "--endpoint-target-ports", "8000")
    assert main(argv) == 1
    assert f"kubeconfig {str(tmp_path / 'nope')!r}: no such file" in capsys.readouterr().err


def test_repeated_ports_are_used_once_with_a_warning(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="epp.discovery"):
        argv = serve(tmp_path, "--endpoint-selector", "app=vllm", "--endpoint-target-ports", "8000,8001,8000")
        assert main(argv) == 1  # accepted (as the reference does): it went on to the credentials
    assert "no such file" in capsys.readouterr().err
    assert "--endpoint-target-ports lists 8000 more than once; each port is used once" in caplog.messages
    settings = discovery_settings(args(endpoint_target_ports=["8000,8001,8000"]), default_config(), {})
    assert settings is not None and settings.target_ports == (8000, 8001)


def args(**kw: Any) -> argparse.Namespace:
    base: dict[str, Any] = {
        "pool_name": None,
        "pool_group": None,
        "model_rewrite_group": None,
        "pool_namespace": None,
        "kubeconfig": None,
        "endpoint_selector": "app=vllm,env notin (dev)",
        "endpoint_target_ports": ["8000,8001"],
        "endpoints": [],
    }
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize(
    ("flag", "environ", "namespace"),
    [
        ("inference", {"NAMESPACE": "env-ns", "POD_NAMESPACE": "pod-ns"}, "inference"),
        (None, {"NAMESPACE": "env-ns", "POD_NAMESPACE": "pod-ns"}, "env-ns"),
        (None, {"POD_NAMESPACE": "pod-ns"}, "pod-ns"),
        (None, {}, "default"),
    ],
)
def test_the_namespace_resolves_as_for_a_pool(
    flag: str | None, environ: dict[str, str], namespace: str
) -> None:
    settings = discovery_settings(
        args(pool_namespace=flag), default_config(), {**environ, "KUBECONFIG": "/kc"}
    )
    assert settings == DiscoverySettings(
        namespace=namespace,
        kubeconfig="/kc",
        endpoint_selector=parse_selector("app=vllm,env notin (dev)"),
        target_ports=(8000, 8001),
    )
    assert settings.pool_name == "" and settings.selector_mode


def test_without_pool_name_or_selector_there_is_no_discovery() -> None:
    none = args(endpoint_selector=None, endpoint_target_ports=None, endpoints=["10.0.0.1:8000"])
    assert discovery_settings(none, default_config(), {"NAMESPACE": "x"}) is None
