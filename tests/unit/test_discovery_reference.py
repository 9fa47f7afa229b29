"""Pod -> endpoints as the reference EPPs map them (pure).

The reference (gateway-api-inference-extension `pkg/epp/datastore`, llm-d-router the same) gives a
ready pod one endpoint per `spec.targetPorts[]` entry, except that a pod annotated with the ports it
actually serves (`inference.networking.k8s.io/active-ports`, or llm-d's `llm-d.ai/active-ports`,
which wins) only gives those: a comma-separated list, each entry read as a decimal number, kept when
it is one of the target ports; an annotation with no usable entry leaves the pod without endpoints.
"""

from __future__ import annotations

from typing import Any

import pytest

from epp.discovery.pool import parse_pool, pod_endpoints, pool_endpoint_names, pool_endpoints

GAIE = "inference.networking.k8s.io/active-ports"
LLMD = "llm-d.ai/active-ports"
LABELS = {"app": "vllm"}
POOL = parse_pool(
    {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "pool", "namespace": "ns", "resourceVersion": "3", "generation": 1},
        "spec": {
            "selector": {"matchLabels": LABELS},
            "targetPorts": [{"number": 8000}, {"number": 8001}, {"number": 8002}],
            "endpointPickerRef": {"group": "", "kind": "Service", "name": "epp", "port": {"number": 9002}},
        },
    }
)


def pod(name: str = "p", ip: str = "10.0.0.1", annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A running, ready pod as the API server lists it."""
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "labels": dict(LABELS), "uid": f"uid-{name}"}
    if annotations is not None:
        meta["annotations"] = annotations
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}],
            "podIP": ip,
            "podIPs": [{"ip": ip}],
        },
    }


def test_without_the_annotation_every_target_port_is_an_endpoint() -> None:
    assert pod_endpoints(pod(annotations={"other": "x"}), POOL) == [
        "10.0.0.1:8000",
        "10.0.0.1:8001",
        "10.0.0.1:8002",
    ]


@pytest.mark.parametrize(
    ("value", "ports"),
    [
        ("8001", [8001]),
        ("8002,8000", [8000, 8002]),  # the pool's port order, not the annotation's
        (" 8000 , 8002 ", [8000, 8002]),  # entries are trimmed
        ("8001,9999", [8001]),  # not a target port: ignored
        ("8001,abc,,-8000,0", [8001]),  # not a positive number: ignored
        ("8001x", [8001]),  # read as a number, the rest ignored (Go's Sscanf %d)
        ("+8002", [8002]),
        ("", []),  # annotated with nothing usable: the pod serves no target port
        ("9999", []),
    ],
)
def test_the_active_ports_annotation_limits_the_pods_endpoints(value: str, ports: list[int]) -> None:
    assert pod_endpoints(pod(annotations={GAIE: value}), POOL) == [f"10.0.0.1:{p}" for p in ports]


def test_the_llm_d_annotation_wins_over_the_gaie_one() -> None:
    both = {LLMD: "8002", GAIE: "8000"}
    assert pod_endpoints(pod(annotations=both), POOL) == ["10.0.0.1:8002"]
    assert pod_endpoints(pod(annotations={LLMD: "8001"}), POOL) == ["10.0.0.1:8001"]


def test_the_pool_set_honours_each_pods_annotation() -> None:
    pods = [
        pod("a", "10.0.0.1", {GAIE: "8000"}),
        pod("b", "10.0.0.2"),
        pod("c", "10.0.0.3", {GAIE: ""}),
    ]
    assert pool_endpoints(POOL, pods) == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.2:8001", "10.0.0.2:8002"]


def test_each_endpoint_is_named_as_the_reference_names_it_the_pod_and_its_ports_place_in_the_pool() -> None:
    pods = [
        pod("a", "10.0.0.1", {GAIE: "8002"}),  # the place among the pool's target ports, not the active ones
        pod("b", "10.0.0.2"),
        pod("c", "10.0.0.3", {GAIE: ""}),
        {**pod("d", "10.0.0.4"), "status": {"podIP": "10.0.0.4"}},  # not ready: not an endpoint
    ]
    assert pool_endpoint_names(POOL, pods) == {
        "10.0.0.1:8002": "a-rank-2",
        "10.0.0.2:8000": "b-rank-0",
        "10.0.0.2:8001": "b-rank-1",
        "10.0.0.2:8002": "b-rank-2",
    }
    assert sorted(pool_endpoint_names(POOL, pods)) == pool_endpoints(POOL, pods)
