"""InferencePool + Pods -> endpoints (pure): who is a candidate, one endpoint per target port, and
malformed pools named by their bad field."""

from __future__ import annotations

from typing import Any

import pytest

from epp.discovery.pool import PoolError, exclusion, object_name, parse_pool, pod_endpoints, pool_endpoints
from epp.discovery.settings import DiscoverySettings, resolve_kubeconfig, resolve_namespace

SELECTOR = {"app": "vllm", "model": "llama"}


def pool_obj(selector: dict[str, str] | None = None, ports: list[int] | None = None, **spec: Any) -> Any:
    body: dict[str, Any] = {
        "selector": {"matchLabels": dict(SELECTOR if selector is None else selector)},
        "targetPorts": [{"number": p} for p in (ports or [8000])],
        "endpointPickerRef": {"name": "epp"},
    }
    body.update(spec)
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "pool", "namespace": "ns", "resourceVersion": "7"},
        "spec": body,
    }


def pod(
    name: str = "p",
    ip: str | None = "10.0.0.1",
    labels: dict[str, str] | None = None,
    ready: str | None = "True",
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": dict(SELECTOR if labels is None else labels)}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "PodScheduled", "status": "True"}]}
    if ready is not None:
        status["conditions"].append({"type": "Ready", "status": ready})
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


POOL = parse_pool(pool_obj())


def test_a_ready_matching_pod_is_one_endpoint_per_target_port() -> None:
    spec = parse_pool(pool_obj(ports=[8000, 8001]))
    assert spec.ports == (8000, 8001)
    assert pod_endpoints(pod(), spec) == ["10.0.0.1:8000", "10.0.0.1:8001"]
    assert pool_endpoints(spec, [pod("a", "10.0.0.2"), pod("b", "10.0.0.1")]) == [
        "10.0.0.1:8000",
        "10.0.0.1:8001",
        "10.0.0.2:8000",
        "10.0.0.2:8001",
    ]


@pytest.mark.parametrize(
    ("candidate", "reason"),
    [
        (pod(ready="False"), "not_ready"),
        (pod(ready="Unknown"), "not_ready"),
        (pod(ready=None), "not_ready"),
        (pod(deleting=True), "deleting"),
        (pod(ip=None), "no_ip"),
        (pod(ip=""), "no_ip"),
        (pod(ip="not-an-ip"), "bad_ip"),
        (pod(labels={"app": "vllm"}), "selector"),  # one selector label missing
        (pod(labels={"app": "vllm", "model": "other"}), "selector"),
        ({"metadata": {"name": "x"}}, "selector"),  # no labels, no status
        ({"metadata": {"name": "x", "labels": SELECTOR}, "status": "garbage"}, "not_ready"),
    ],
)
def test_pods_that_are_not_candidates(candidate: dict[str, Any], reason: str) -> None:
    assert exclusion(candidate, POOL) == reason
    assert pod_endpoints(candidate, POOL) == []


def test_extra_pod_labels_still_match_and_ipv6_is_bracketed() -> None:
    labels = {**SELECTOR, "pod-template-hash": "abc"}
    assert pod_endpoints(pod(labels=labels, ip="fd00::7"), POOL) == ["[fd00::7]:8000"]


def test_the_pool_mapping_skips_non_candidates_and_duplicates() -> None:
    pods = [pod("a", "10.0.0.1"), pod("b", "10.0.0.2", ready="False"), pod("c", "10.0.0.1"), pod("d", None)]
    assert pool_endpoints(POOL, pods) == ["10.0.0.1:8000"]
    assert pool_endpoints(POOL, []) == []


def test_parse_pool_reads_selector_and_ports() -> None:
    spec = parse_pool(pool_obj(ports=[9000, 8000, 9000]))
    assert spec.name == "pool"
    assert spec.labels == SELECTOR
    assert spec.label_selector() == "app=vllm,model=llama"
    assert spec.ports == (9000, 8000)  # order kept, duplicates dropped


@pytest.mark.parametrize(
    ("obj", "needle"),
    [
        ({**pool_obj(), "spec": {"selector": {"matchLabels": SELECTOR}}}, "spec.targetPorts is missing"),
        (pool_obj(targetPorts=[]), "spec.targetPorts is missing or empty"),
        (pool_obj(targetPorts=[{"number": 0}]), "spec.targetPorts[0].number"),
        (pool_obj(targetPorts=[{"number": "8000"}]), "spec.targetPorts[0].number"),
        (pool_obj(targetPorts=[{"number": p} for p in range(8000, 8009)]), "at most 8"),
        (pool_obj(selector={}), "spec.selector.matchLabels is missing or empty"),
        (pool_obj(selector={"app": 3}), "spec.selector.matchLabels['app']"),  # type: ignore[dict-item]
        ({**pool_obj(), "spec": None}, "spec is missing"),
        ({"spec": pool_obj()["spec"]}, "metadata.name is missing"),
        ("not an object", "expected an object"),
    ],
)
def test_malformed_pools_name_the_field(obj: Any, needle: str) -> None:
    with pytest.raises(PoolError) as err:
        parse_pool(obj)
    assert needle in str(err.value)


def test_object_name() -> None:
    assert object_name(pod("x")) == "x"
    assert object_name({"metadata": {}}) is None
    assert object_name({"metadata": {"name": ""}}) is None
    assert object_name(None) is None


def test_namespace_and_kubeconfig_resolution() -> None:
    assert resolve_namespace("flag", {"NAMESPACE": "env"}) == "flag"
    assert resolve_namespace(None, {"NAMESPACE": "env", "POD_NAMESPACE": "pod"}) == "env"
    assert resolve_namespace(None, {"POD_NAMESPACE": "pod"}) == "pod"
    assert resolve_namespace(None, {"NAMESPACE": "  "}) == "default"
    assert resolve_kubeconfig("/flag", {"KUBECONFIG": "/env"}) == "/flag"
    assert resolve_kubeconfig(None, {"KUBECONFIG": "/env"}) == "/env"
    assert resolve_kubeconfig(None, {}) is None


def test_settings_check() -> None:
    assert DiscoverySettings("p").check() is None
    assert "pool-name" in (DiscoverySettings("").check() or "")
    assert "pool-namespace" in (DiscoverySettings("p", namespace="").check() or "")
    assert "backoff" in (DiscoverySettings("p", backoff_initial=5, backoff_max=1).check() or "")
