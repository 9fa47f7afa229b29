"""Discovery's command line and credentials: every bad combination or file is a clear error at start,
before anything listens; and watch lines / error answers are read as the API server sends them."""

from __future__ import annotations

import pathlib

import pytest

from epp.cli import main
from epp.discovery.client import ApiError, DiscoveryConfigError, Gone, connect, parse_event, status_error
from epp.discovery.settings import DiscoverySettings
from tests.support.configs import STATIC_ENDPOINT

LOCAL = ["--host", "127.0.0.1", "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0"]


def test_endpoints_and_pool_name_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--endpoints", "10.0.0.1:8000", "--pool-name", "pool", *LOCAL]) == 2
    err = capsys.readouterr().err
    assert "--pool-name" in err and "cannot be combined with static endpoints (--endpoints)" in err


def test_config_endpoints_and_pool_name_together_are_refused(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "epp.yaml"
    cfg.write_text(STATIC_ENDPOINT)
    assert main(["serve", "--config", str(cfg), "--pool-name", "pool", *LOCAL]) == 2
    err = capsys.readouterr().err
    assert "cannot be combined with static endpoints" in err and str(cfg) in err


@pytest.mark.parametrize("flag", ["--pool-namespace", "--kubeconfig"])
def test_discovery_flags_need_pool_name(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--endpoints", "10.0.0.1:8000", flag, "x", *LOCAL]) == 2
    assert f"'{flag}': needs --pool-name" in capsys.readouterr().err


def test_a_missing_kubeconfig_stops_serve_with_its_path(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope" / "kubeconfig"
    assert main(["serve", "--pool-name", "pool", "--kubeconfig", str(missing), *LOCAL]) == 1
    err = capsys.readouterr().err
    assert f"kubeconfig {str(missing)!r}: no such file" in err


def test_kubeconfig_env_is_used_when_no_flag(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "from-env"
    monkeypatch.setenv("KUBECONFIG", str(missing))
    assert main(["serve", "--pool-name", "pool", *LOCAL]) == 1
    assert str(missing) in capsys.readouterr().err


def test_outside_a_cluster_without_kubeconfig_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    assert main(["serve", "--pool-name", "pool", *LOCAL]) == 1
    assert "no --kubeconfig or KUBECONFIG, and no in-cluster service account" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text",
    [
        "not: [valid",
        "apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n",  # no current context
        # its context names a cluster that does not exist
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "contexts: [{name: c, context: {cluster: x, user: u}}]\nclusters: []\nusers: []\n",
    ],
)
async def test_an_unusable_kubeconfig_is_a_clear_error(tmp_path: pathlib.Path, text: str) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    with pytest.raises(DiscoveryConfigError) as err:
        await connect(DiscoverySettings("pool", kubeconfig=str(path)))
    assert f"kubeconfig {str(path)!r} is not usable" in str(err.value)


def test_watch_lines_and_error_answers() -> None:
    kind, obj = parse_event(b'{"type": "ADDED", "object": {"metadata": {"name": "a"}}}')
    assert (kind, obj["metadata"]["name"]) == ("ADDED", "a")
    gone = b'{"type":"ERROR","object":{"kind":"Status","code":410,"reason":"Expired","message":"too old"}}'
    with pytest.raises(Gone) as g:
        parse_event(gone)
    assert g.value.status == 410 and "too old" in str(g.value) and g.value.from_event
    with pytest.raises(ApiError) as e:
        parse_event(b'{"type":"ERROR","object":{"kind":"Status","code":500,"message":"etcd down"}}')
    assert e.value.status == 500 and not isinstance(e.value, Gone)
    for bad in (b"{not json", b"[1]", b'{"type": "SIDEWAYS", "object": {}}', b'{"type": "ADDED"}'):
        with pytest.raises(ApiError) as err:
            parse_event(bad)
        assert err.value.status == 0
    http_gone = status_error(410, b'{"kind":"Status","code":410,"message":"expired"}')
    assert isinstance(http_gone, Gone) and not http_gone.from_event
    forbidden = status_error(403, b'{"kind":"Status","code":403,"message":"pods is forbidden"}')
    assert forbidden.status == 403 and "pods is forbidden" in str(forbidden)
    assert "bad gateway" in str(status_error(502, b"bad gateway"))


def test_the_server_refuses_static_endpoints_with_discovery() -> None:
    from epp.config import StaticEndpoint, default_config
    from epp.server.app import EppServer, ServerSettings

    settings = ServerSettings(secure_serving=False, discovery=DiscoverySettings("pool"))
    with pytest.raises(ValueError, match="cannot be used together"):
        EppServer(settings, default_config(), [StaticEndpoint("10.0.0.1:8000")])
    assert EppServer(settings, default_config()).discovery is not None
    assert EppServer(ServerSettings(secure_serving=False), default_config()).discovery is None
