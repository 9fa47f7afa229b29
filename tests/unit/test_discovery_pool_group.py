"""`--pool-group`: the v1 InferencePool (`inference.networking.k8s.io`, the default) or the older
v1alpha2 one (`inference.networking.x-k8s.io`: `spec.selector` a plain label map, one
`spec.targetPortNumber`) give the same endpoint set, as the reference EPP reduces both to one pool
(gateway-api-inference-extension `pkg/epp/util/pool/pool.go`); any other group is refused at start."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from epp.cli import main
from epp.config import default_config
from epp.discovery.flags import discovery_settings as _discovery
from epp.discovery.pool import PoolError, parse_pool, pod_endpoints, pool_endpoints
from epp.discovery.settings import GROUP_V1, GROUP_V1ALPHA2, REWRITE_GROUP, DiscoverySettings

LOCAL = ["--host", "127.0.0.1", "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0"]
SELECTOR = {"app": "vllm", "model": "llama"}


def alpha_obj(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "selector": dict(SELECTOR),
        "targetPortNumber": 8000,
        "extensionRef": {"group": "", "kind": "Service", "name": "epp", "failureMode": "FailClose"},
    }
    body.update(spec)
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferencePool",
        "metadata": {"name": "pool", "namespace": "ns", "resourceVersion": "7"},
        "spec": body,
    }


def v1_obj(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "selector": {"matchLabels": dict(SELECTOR)},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "epp"},
    }
    body.update(spec)
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "pool", "namespace": "ns"},
        "spec": body,
    }


def pod(name: str, ip: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": dict(SELECTOR if labels is None else labels)},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_a_v1alpha2_pool_is_the_same_spec_and_endpoints_as_its_v1_twin() -> None:
    alpha = parse_pool(alpha_obj(), GROUP_V1ALPHA2)
    v1 = parse_pool(v1_obj(), GROUP_V1)
    assert alpha == v1
    assert alpha.labels == SELECTOR and alpha.ports == (8000,)
    assert alpha.label_selector() == "app=vllm,model=llama"
    pods = [pod("a", "10.0.0.1"), pod("b", "fd00::2"), pod("c", "10.0.0.3", {"app": "vllm"})]
    assert pool_endpoints(alpha, pods) == ["10.0.0.1:8000", "[fd00::2]:8000"]
    # the active-ports annotation applies to the one target port as it does to v1's
    annotated = {**pod("d", "10.0.0.4"), "metadata": {**pod("d", "10.0.0.4")["metadata"]}}
    annotated["metadata"]["annotations"] = {"inference.networking.k8s.io/active-ports": "9000"}
    assert pod_endpoints(annotated, alpha) == []


def test_the_default_group_is_v1() -> None:
    assert parse_pool(v1_obj()) == parse_pool(v1_obj(), GROUP_V1)
    settings = DiscoverySettings("pool")
    assert (settings.pool_group, settings.pool_version) == (GROUP_V1, "v1")
    alpha = DiscoverySettings("pool", pool_group=GROUP_V1ALPHA2)
    assert (alpha.check(), alpha.pool_version) == (None, "v1alpha2")


@pytest.mark.parametrize(
    ("obj", "needle"),
    [
        (alpha_obj(targetPortNumber=None), "spec.targetPortNumber must be a port number"),
        ({**alpha_obj(), "spec": {"selector": SELECTOR}}, "spec.targetPortNumber must be a port number"),
        (alpha_obj(targetPortNumber=0), "spec.targetPortNumber must be a port number 1-65535"),
        (alpha_obj(targetPortNumber=65536), "spec.targetPortNumber must be a port number 1-65535"),
        (alpha_obj(targetPortNumber="8000"), "spec.targetPortNumber"),
        (alpha_obj(targetPortNumber=True), "spec.targetPortNumber"),
        (alpha_obj(selector={}), "spec.selector is missing or empty"),
        (alpha_obj(selector=None), "spec.selector is missing or empty"),
        (alpha_obj(selector={"app": 3}), "spec.selector['app'] must map a label to a string"),
        # a v1 object read as v1alpha2: its selector's value is a map, not a label value
        (v1_obj(), "spec.selector['matchLabels'] must map a label to a string"),
        ({**alpha_obj(), "spec": None}, "spec is missing"),
        ({"spec": alpha_obj()["spec"]}, "metadata.name is missing"),
    ],
)
def test_malformed_v1alpha2_pools_name_the_field(obj: Any, needle: str) -> None:
    with pytest.raises(PoolError) as err:
        parse_pool(obj, GROUP_V1ALPHA2)
    assert needle in str(err.value)
    assert "InferencePool" in str(err.value)


def test_a_v1alpha2_object_read_as_v1_names_the_v1_field() -> None:
    with pytest.raises(PoolError, match=r"spec\.selector\.matchLabels is missing or empty"):
        parse_pool(alpha_obj(selector={"matchLabels": "x"}), GROUP_V1)
    with pytest.raises(PoolError, match=r"spec\.targetPorts is missing"):
        parse_pool({**alpha_obj(), "spec": {"selector": {"matchLabels": SELECTOR}, "targetPortNumber": 1}})


def test_an_unknown_group_is_refused_by_the_parser_too() -> None:
    with pytest.raises(PoolError, match=r"unknown InferencePool API group 'example\.com'"):
        parse_pool(v1_obj(), "example.com")


@pytest.mark.parametrize(
    "group",
    ["example.com", "", "Inference.Networking.K8s.io", "inference.networking.k8s.io/v1", "x-k8s.io"],
)
def test_settings_refuse_an_unknown_group_and_name_both_known_ones(group: str) -> None:
    problem = DiscoverySettings("pool", pool_group=group).check()
    assert problem is not None
    assert problem.startswith(f"--pool-group {group!r} is not an InferencePool API group")
    assert GROUP_V1 in problem and GROUP_V1ALPHA2 in problem


def args_for(**kw: Any) -> argparse.Namespace:
    base: dict[str, Any] = {
        "pool_name": "pool",
        "pool_group": None,
        "model_rewrite_group": None,
        "pool_namespace": None,
        "kubeconfig": None,
        "endpoint_selector": None,
        "endpoint_target_ports": None,
        "endpoints": [],
    }
    return argparse.Namespace(**{**base, **kw})


def test_the_flag_reaches_the_settings_with_everything_else() -> None:
    env = {"NAMESPACE": "inference", "KUBECONFIG": "/kc"}
    settings = _discovery(args_for(pool_group=GROUP_V1ALPHA2), default_config(), env)
    assert settings == DiscoverySettings("pool", "inference", kubeconfig="/kc", pool_group=GROUP_V1ALPHA2)
    default = _discovery(args_for(), default_config(), env)
    assert default is not None and default.pool_group == GROUP_V1 and default.namespace == "inference"


@pytest.mark.parametrize("group", ["example.com", ""])
def test_serve_refuses_an_unknown_group_before_anything_starts(
    group: str, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    # A kubeconfig that does not exist: had the group passed, serve would stop later (exit 1) on it.
    missing = str(tmp_path / "nope")
    assert main(["serve", "--pool-name", "pool", "--pool-group", group, "--kubeconfig", missing, *LOCAL]) == 2
    err = capsys.readouterr().err
    assert f"field '--pool-group': --pool-group {group!r} is not an InferencePool API group" in err
    assert GROUP_V1 in err and GROUP_V1ALPHA2 in err
    assert "kubeconfig" not in err.replace("--kubeconfig", "")


def test_a_known_group_goes_on_to_the_credentials(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    missing = str(tmp_path / "nope")
    assert (
        main(["serve", "--pool-name", "p", "--pool-group", GROUP_V1ALPHA2, "--kubeconfig", missing, *LOCAL])
        == 1
    )
    assert f"kubeconfig {missing!r}: no such file" in capsys.readouterr().err


def test_the_group_needs_pool_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--endpoints", "10.0.0.1:8000", "--pool-group", GROUP_V1ALPHA2, *LOCAL]) == 2
    assert "'--pool-group': needs --pool-name" in capsys.readouterr().err


def test_the_model_rewrite_group_flag_reaches_the_settings(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    env = {"NAMESPACE": "inference", "KUBECONFIG": "/kc"}
    settings = _discovery(args_for(model_rewrite_group="llm-d.ai"), default_config(), env)
    assert settings is not None and settings.rewrite_group == "llm-d.ai"
    default = _discovery(args_for(), default_config(), env)
    assert default is not None and default.rewrite_group == REWRITE_GROUP
    missing = str(tmp_path / "nope")
    args = [
        "serve",
        "--pool-name",
        "p",
        "--model-rewrite-group",
        "example.com",
        "--kubeconfig",
        missing,
        *LOCAL,
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        "field '--model-rewrite-group': --model-rewrite-group 'example.com' is not an InferenceModelRewrite"
        in err
    )
    assert REWRITE_GROUP in err and "llm-d.ai" in err
    assert main(["serve", "--endpoints", "10.0.0.1:8000", "--model-rewrite-group", "llm-d.ai", *LOCAL]) == 2
    assert "'--model-rewrite-group': needs --pool-name" in capsys.readouterr().err
