"""Checks of deploy/ used by tests/unit/test_deploy.py: builds, schemas, and the cross-checks that
keep the manifests, the dashboard and the benchmarking config in step with the code. Each check
returns problems as text, so the tests can show the exact message a broken manifest produces."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import importlib.util
import io
import json
import random
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml
from aiohttp import web

from epp.cli import build_parser
from epp.config import EppConfig, build_scheduler, parse_config
from epp.config_sections import ConfigError
from epp.docs_reference import exposed_metrics
from epp.scheduling.builtin import default_registry
from epp.server.readiness import HEALTH_SERVICES
from epp.testing.fakes import FakeClock
from simulator.cli import build_parser as sim_parser
from simulator.serving.command import config_from_args as sim_config_from_args
from tests.support.kustomize import build

Obj = dict[str, Any]


ROOT = Path(__file__).resolve().parents[2]


DEPLOY = ROOT / "deploy"


STACKS = ("base", "overlays/dev", "overlays/production")  # a whole pool: EPP, vLLM, gateway objects


TARGETS = (*STACKS, "gateway")


KUBECTL = shutil.which("kubectl")


K8S_VERSION = "1.32"


FIELD_SAMPLES = {"status.podIP": "10.1.2.3", "metadata.name": "pod-0", "spec.nodeName": "node-0"}


VLLM_KV_EVENTS_KEYS = {
    *("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint"),
    *("buffer_steps", "hwm", "max_queue_size", "topic"),
}


VLLM_COMMAND = ["vllm", "serve"]


SIM_COMMAND = ["epp-sim", "serve-engine"]  # vLLM's CPU stand-in (docs/simulator.md), in the EPP image


TOKENIZER_INITS = ("fetch-tokenizer", "make-tokenizer")  # download one / build the tiny one


ENVOY_GATEWAY_CONTROLLER = "gateway.envoyproxy.io/gatewayclass-controller"


INFERENCE_GROUP = "inference.networking.k8s.io"


GATEWAY_GROUP = "gateway.networking.k8s.io"


API_VERSIONS = {
    "InferencePool": f"{INFERENCE_GROUP}/v1",
    "Gateway": f"{GATEWAY_GROUP}/v1",
    "HTTPRoute": f"{GATEWAY_GROUP}/v1",
    "GatewayClass": f"{GATEWAY_GROUP}/v1",
    "ClientTrafficPolicy": "gateway.envoyproxy.io/v1alpha1",
}


CRD_SHAPES: dict[str, dict[str, tuple[set[str], set[str]]]] = {
    "InferencePool": {
        "spec": (
            {"selector", "targetPorts", "appProtocol", "endpointPickerRef"},
            {"selector", "targetPorts", "endpointPickerRef"},
        ),
        "spec.selector": ({"matchLabels"}, {"matchLabels"}),
        "spec.targetPorts[]": ({"number"}, {"number"}),
        "spec.endpointPickerRef": ({"group", "kind", "name", "port", "failureMode"}, {"name"}),
        "spec.endpointPickerRef.port": ({"number"}, {"number"}),
    },
    "Gateway": {
        "spec": (
            {"gatewayClassName", "listeners", "addresses", "infrastructure"},
            {"gatewayClassName", "listeners"},
        ),
        "spec.listeners[]": (
            {"name", "protocol", "port", "hostname", "tls", "allowedRoutes"},
            {"name", "protocol", "port"},
        ),
    },
    "HTTPRoute": {
        "spec": ({"parentRefs", "hostnames", "rules"}, {"rules"}),
        "spec.parentRefs[]": ({"group", "kind", "namespace", "name", "sectionName", "port"}, {"name"}),
        "spec.rules[]": ({"name", "matches", "filters", "backendRefs", "timeouts", "retry"}, set()),
        "spec.rules[].backendRefs[]": (
            {"group", "kind", "name", "namespace", "port", "weight", "filters"},
            {"name"},
        ),
        "spec.rules[].timeouts": ({"request", "backendRequest"}, set()),
    },
    "GatewayClass": {"spec": ({"controllerName", "parametersRef", "description"}, {"controllerName"})},
    # Envoy Gateway's api/v1alpha1 clienttrafficpolicy_types.go (only the parts used here are checked)
    "ClientTrafficPolicy": {
        "spec.targetRefs[]": ({"group", "kind", "name", "sectionName"}, {"group", "kind", "name"}),
        "spec.headers.earlyRequestHeaders": ({"set", "add", "remove"}, set()),
    },
}


# A new EPP pod compiles its loops (numba) before it reports live: ~30-40 s of one core, more on a
# node that gives it less (the dev overlay requests a quarter core), then tokenizer and pool list.
EPP_STARTUP_SECONDS = 150


PROBES = (("startupProbe", "liveness"), ("livenessProbe", "liveness"), ("readinessProbe", "readiness"))


assert {service for _, service in PROBES} <= set(HEALTH_SERVICES)


PROMQL_WORDS = {"and", "or", "unless", "on", "ignoring", "group_left", "group_right", "bool", "offset"}


ALWAYS_LABELS = {"job", "instance"}  # Prometheus adds these to every scraped series


def kubectl_build(directory: Path) -> list[Obj]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, f"kubectl kustomize {directory}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


def keyed(objects: list[Obj]) -> dict[tuple[str, str, str, str], Obj]:
    out = {
        (o["apiVersion"], o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
        for o in objects
    }
    assert len(out) == len(objects), "two objects with the same identity"
    return out


_BUILDS: dict[str, list[Obj]] = {}


def built(target: str) -> list[Obj]:
    """The Python build of deploy/TARGET (built once; callers get a copy)."""
    if target not in _BUILDS:
        _BUILDS[target] = build(DEPLOY / target)
    return copy.deepcopy(_BUILDS[target])


def ident(obj: Obj) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def find(objects: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objects if o.get("kind") == kind and name in (None, o["metadata"].get("name"))]


def builtin_problems(objects: list[Obj]) -> list[str]:
    """Strict schema validation of every built-in kind (unknown fields are errors)."""
    problems = []
    for obj in objects:
        if obj.get("kind") in API_VERSIONS:
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{ident(obj)}: no Kubernetes {K8S_VERSION} schema for {obj.get('apiVersion')}")
        except kubernetes_validate.ValidationError as err:
            where = ".".join(str(p) for p in err.path) or "(top)"
            problems.append(f"{ident(obj)}: {where}: {err.message}")
    return problems


def _at(node: Any, path: str) -> Iterator[Any]:
    """The values at a dotted path, `[]` stepping into each list item."""
    head, _, rest = path.partition(".")
    items = head.endswith("[]")
    value = node.get(head.removesuffix("[]")) if isinstance(node, dict) else None
    for v in (value or []) if items else ([] if value is None else [value]):
        yield from (_at(v, rest) if rest else [v])


def crd_problems(objects: list[Obj]) -> list[str]:
    """The fields of the CRD kinds that the gateway and the EPP rely on (no CRD schemas offline)."""
    problems: list[str] = []
    gateways = {g["metadata"]["name"] for g in find(objects, "Gateway")}
    pools = {p["metadata"]["name"] for p in find(objects, "InferencePool")}
    for obj in objects:
        kind = obj.get("kind", "")
        if kind not in API_VERSIONS:
            continue
        bad = problems.append
        if obj.get("apiVersion") != API_VERSIONS[kind]:
            bad(f"{ident(obj)}: apiVersion {obj.get('apiVersion')}, expected {API_VERSIONS[kind]}")
        for path, (allowed, required) in CRD_SHAPES[kind].items():
            for node in _at(obj, path):
                if not isinstance(node, dict):
                    bad(f"{ident(obj)}: {path} must be a mapping")
                    continue
                if unknown := sorted(set(node) - allowed):
                    bad(f"{ident(obj)}: {path}: unknown field(s) {unknown}")
                if missing := sorted(required - set(node)):
                    bad(f"{ident(obj)}: {path}: missing {missing}")
        if kind == "InferencePool":
            ports = [p.get("number") for p in obj["spec"].get("targetPorts", [])]
            if not 1 <= len(ports) <= 8 or len(set(ports)) != len(ports):
                bad(f"{ident(obj)}: spec.targetPorts must be 1 to 8 unique ports")
            if any(not isinstance(n, int) or not 0 < n < 65536 for n in ports):
                bad(f"{ident(obj)}: spec.targetPorts {ports} are not port numbers")
            ref = obj["spec"].get("endpointPickerRef", {})
            if ref.get("kind", "Service") != "Service" or ref.get("group", "") != "":
                bad(f"{ident(obj)}: endpointPickerRef must name a core Service")
            if ref.get("failureMode", "FailClose") not in ("FailOpen", "FailClose"):
                bad(f"{ident(obj)}: endpointPickerRef.failureMode must be FailOpen or FailClose")
        elif kind == "Gateway":
            for listener in _at(obj, "spec.listeners[]"):
                if listener.get("protocol") not in ("HTTP", "HTTPS"):
                    bad(f"{ident(obj)}: listener {listener.get('name')}: protocol {listener.get('protocol')}")
        elif kind == "HTTPRoute":
            for parent in _at(obj, "spec.parentRefs[]"):
                if parent.get("kind", "Gateway") != "Gateway" or parent.get("name") not in gateways:
                    bad(f"{ident(obj)}: parentRef {parent} names no Gateway of this build")
            for backend in _at(obj, "spec.rules[].backendRefs[]"):
                if (backend.get("group"), backend.get("kind")) != (INFERENCE_GROUP, "InferencePool"):
                    bad(f"{ident(obj)}: backendRef {backend} is not an InferencePool")
                elif backend.get("name") not in pools:
                    bad(f"{ident(obj)}: backendRef names pool {backend.get('name')!r}, not in the build")
            for timeouts in _at(obj, "spec.rules[].timeouts"):
                for key, value in timeouts.items():
                    if not re.fullmatch(r"(\d+(h|m|s|ms))+", str(value)):
                        bad(f"{ident(obj)}: timeouts.{key}: {value!r} is not a Gateway API duration")
        elif kind == "ClientTrafficPolicy":
            for ref in _at(obj, "spec.targetRefs[]"):
                if (ref.get("group"), ref.get("kind")) != (GATEWAY_GROUP, "Gateway") or ref.get(
                    "name"
                ) not in gateways:
                    bad(f"{ident(obj)}: targetRef {ref} names no Gateway of this build")
        elif kind == "GatewayClass" and obj["spec"].get("controllerName") != ENVOY_GATEWAY_CONTROLLER:
            bad(f"{ident(obj)}: controllerName is not Envoy Gateway's")
    return problems


def _parse(parser: argparse.ArgumentParser, command: str, args: list[str]) -> argparse.Namespace:
    """`args` parsed by a real CLI's subcommand; argparse's complaint becomes ValueError."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args([command, *args])
    except SystemExit:
        raise ValueError(err.getvalue().strip().splitlines()[-1].split(" error: ", 1)[-1]) from None


def parse_epp_args(args: list[str]) -> argparse.Namespace:
    """The real `epp serve` parser."""
    return _parse(build_parser(), "serve", args)


def parse_sim_args(args: list[str]) -> argparse.Namespace:
    """The real `epp-sim serve-engine` parser."""
    return _parse(sim_parser(), "serve-engine", args)


def port_of(container: Obj, ref: str | int | None) -> int | None:
    """A container port by name or number."""
    for p in container.get("ports", []):
        if ref in (p.get("name"), p.get("containerPort")):
            number: int = p["containerPort"]
            return number
    return None


@dataclass
class Workload:
    """A Deployment's first container with its args as the kubelet hands them over."""

    obj: Obj
    problems: list[str]
    env: dict[str, str] = field(init=False)
    args: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.env = self.env_of(self.box)
        self.args = [self.expand(a) for a in self.box.get("args", [])]

    @property
    def pod(self) -> Obj:
        spec: Obj = self.obj["spec"]["template"]["spec"]
        return spec

    @property
    def box(self) -> Obj:
        container: Obj = self.pod["containers"][0]
        return container

    @property
    def labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.obj["spec"]["template"]["metadata"]["labels"]
        return labels

    def env_of(self, container: Obj) -> dict[str, str]:
        out = {}
        for e in container.get("env", []):
            path = (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
            if "value" in e:
                out[e["name"]] = e["value"]
            elif path == "metadata.namespace":
                out[e["name"]] = self.obj["metadata"].get("namespace", "default")
            else:
                out[e["name"]] = FIELD_SAMPLES.get(path, "<from a secret>")
        return out

    def expand(self, text: str) -> str:
        """$(VAR) as the kubelet expands it; an undefined one stays literal (and is a problem)."""

        def sub(m: re.Match[str]) -> str:
            if m.group(1) in self.env:
                return self.env[m.group(1)]
            self.problems.append(f"{ident(self.obj)}: $({m.group(1)}) is not defined in the container's env")
            return m.group(0)

        return re.sub(r"\$\(([A-Za-z_]\w*)\)", sub, text)

    def config_map_file(self, objects: list[Obj], container: Obj, path: str) -> str | None:
        """The content of `path` when it is a key of a ConfigMap mounted in `container`."""
        directory, _, key = path.rpartition("/")
        mount = next((m for m in container.get("volumeMounts", []) if m["mountPath"] == directory), None)
        volume: Obj = next(
            (v for v in self.pod.get("volumes", []) if mount and v["name"] == mount["name"]), {}
        )
        name = (volume.get("configMap") or {}).get("name")
        data: dict[str, str] = next(
            (cm.get("data", {}) for cm in find(objects, "ConfigMap", name) if name), {}
        )
        text: str | None = data.get(key)
        return text


@dataclass
class Stack:
    """The EPP, its Service, the pool and the model servers of one build."""

    objects: list[Obj]
    epp: Workload
    vllm: Workload  # the model servers: vLLM, or its CPU stand-in (then `sim` holds its flags)
    service: Obj
    pool: Obj
    flags: argparse.Namespace
    problems: list[str]
    sim: argparse.Namespace | None = None

    def bad(self, obj: Obj, message: str) -> None:
        self.problems.append(f"{ident(obj)}: {message}")

    @property
    def served_model(self) -> str | None:
        if self.sim is not None:
            model: str = self.sim.model
            return model
        named = [a.split("=", 1)[1] for a in self.vllm.args if a.startswith("--served-model-name=")]
        positional = [a for a in self.vllm.args if not a.startswith("-")]
        return next(iter(named or positional), None)


def stack_of(objects: list[Obj]) -> Stack | list[str]:
    """The stack, or the problems that keep it from being assembled."""
    problems: list[str] = []
    deployments = find(objects, "Deployment")
    epps = [d for d in deployments if d["spec"]["template"]["spec"]["containers"][0]["name"] == "epp"]
    others = [d for d in deployments if d not in epps]
    services, pools = find(objects, "Service"), find(objects, "InferencePool")
    if [len(epps), len(others), len(services), len(pools)] != [1, 1, 1, 1]:
        return ["expected one EPP Deployment, one model-server Deployment, one Service, one InferencePool"]
    epp, vllm = Workload(epps[0], problems), Workload(others[0], problems)
    try:
        flags = parse_epp_args(epp.args)
    except ValueError as err:
        return [*problems, f"{ident(epp.obj)}: args do not parse with `epp serve`: {err}"]
    command, sim = vllm.box.get("command"), None
    if command == SIM_COMMAND:
        try:
            sim = parse_sim_args(vllm.args)
        except ValueError as err:
            return [*problems, f"{ident(vllm.obj)}: args do not parse with `epp-sim serve-engine`: {err}"]
    elif command != VLLM_COMMAND:
        return [
            *problems,
            f"{ident(vllm.obj)}: runs {command}, neither `vllm serve` nor `epp-sim serve-engine`",
        ]
    return Stack(objects, epp, vllm, services[0], pools[0], flags, problems, sim)


def check_config(s: Stack) -> EppConfig | None:
    """--config-file is a key of a mounted ConfigMap that loads and whose plugins build."""
    text = s.epp.config_map_file(s.objects, s.epp.box, s.flags.config or "")
    if text is None:
        s.bad(s.epp.obj, f"--config-file {s.flags.config} is not a key of a mounted ConfigMap")
        return None
    try:
        cfg = parse_config(text, s.flags.config)
        build_scheduler(cfg, default_registry(), FakeClock(), random.Random(0))
    except ConfigError as err:
        s.bad(s.epp.obj, f"the config does not load: {err}")
        return None
    return cfg


def check_ports(s: Stack) -> None:
    """Flags, container ports, probes, the scrape annotation, the Service and the endpointPickerRef."""
    epp, f = s.epp, s.flags
    for name, want in (
        ("grpc", f.grpc_port),
        ("grpc-health", f.grpc_health_port),
        ("metrics", f.metrics_port),
    ):
        if port_of(epp.box, name) != want:
            s.bad(epp.obj, f"container port {name} is {port_of(epp.box, name)}, the flags say {want}")
    for probe, service in PROBES:
        grpc = (epp.box.get(probe) or {}).get("grpc") or {}
        if (grpc.get("port"), grpc.get("service")) != (f.grpc_health_port, service):
            s.bad(epp.obj, f"{probe} must be gRPC {service} on {f.grpc_health_port}")
    startup = epp.box.get("startupProbe") or {}
    budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    if budget < EPP_STARTUP_SECONDS:
        s.bad(
            epp.obj,
            f"startupProbe allows {budget} s: a new pod compiles its loops first (docs/deployment.md), "
            f"give it {EPP_STARTUP_SECONDS} s or more",
        )
    annotations = epp.obj["spec"]["template"]["metadata"].get("annotations", {})
    if annotations.get("prometheus.io/port") != str(f.metrics_port):
        s.bad(epp.obj, f"the prometheus.io/port annotation is not the metrics port {f.metrics_port}")
    if not s.service["spec"]["selector"].items() <= epp.labels.items():
        s.bad(s.service, "the selector does not match the EPP pods")
    headless = s.service["spec"].get("clusterIP") == "None"
    if not headless:
        s.bad(s.service, "must be headless (clusterIP: None) so Envoy spreads ext_proc streams over replicas")
    for p in s.service["spec"]["ports"]:
        target = port_of(epp.box, p["targetPort"])
        if target is None:
            s.bad(s.service, f"port {p['name']} targets {p['targetPort']!r}, not a container port")
        elif headless and target != p["port"]:
            s.bad(
                s.service,
                f"port {p['name']} is {p['port']} but reaches {target}: headless Services do not map",
            )
    ref = s.pool["spec"]["endpointPickerRef"]
    grpc = [p["port"] for p in s.service["spec"]["ports"] if port_of(epp.box, p["targetPort"]) == f.grpc_port]
    number = (ref.get("port") or {}).get("number")
    if ref["name"] != s.service["metadata"]["name"] or [number] != grpc:
        s.bad(s.pool, f"endpointPickerRef {ref['name']}:{number} is not the Service port to --grpc-port")
    if f.secure_serving is not True:
        s.bad(epp.obj, "--secure-serving must stay true (Envoy AI Gateway connects to the EPP with TLS)")


def check_discovery(s: Stack) -> None:
    """The EPP watches this pool (needs the discovery flags of epp/cli.py) and may read it."""
    if s.flags.pool_name != s.pool["metadata"]["name"]:
        s.bad(s.epp.obj, f"--pool-name {s.flags.pool_name!r} is not the pool {s.pool['metadata']['name']!r}")
    if s.flags.pool_namespace != s.pool["metadata"].get("namespace", "default"):
        s.bad(s.epp.obj, f"--pool-namespace {s.flags.pool_namespace!r} is not the pool's namespace")
    account, namespace = (
        s.epp.pod.get("serviceAccountName", "default"),
        s.epp.obj["metadata"].get("namespace"),
    )
    granted = set()
    for binding in find(s.objects, "RoleBinding"):
        subject = {"kind": "ServiceAccount", "name": account, "namespace": namespace}
        if subject in binding.get("subjects", []):
            for rule in (
                r for role in find(s.objects, "Role", binding["roleRef"]["name"]) for r in role["rules"]
            ):
                if {"list", "watch"} <= set(rule["verbs"]):
                    granted |= {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
    for group, resource in (("", "pods"), (INFERENCE_GROUP, "inferencepools")):
        if (group, resource) not in granted:
            s.bad(s.epp.obj, f"ServiceAccount {account} may not list/watch {resource}")


def check_shutdown(s: Stack) -> None:
    """A replica that stops waits out preStop, then lets open streams run for --shutdown-grace: both inside
    the termination grace period, and the grace at least the routes' request timeout (every response body
    streams through the EPP, so a shorter grace cuts generations the route allows)."""
    pod, grace = s.epp.pod, float(s.flags.shutdown_grace)
    command = s.epp.box.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pause = float(command[1]) if len(command) == 2 and command[0] == "sleep" else 0.0
    period = pod.get("terminationGracePeriodSeconds", 30)
    if pause + grace >= period:
        s.bad(
            s.epp.obj,
            f"preStop ({pause:g} s) + --shutdown-grace ({grace:g} s) do not fit in "
            f"terminationGracePeriodSeconds ({period})",
        )
    for route in find(s.objects, "HTTPRoute"):
        for rule in route["spec"].get("rules", []):
            timeout = _seconds(rule.get("timeouts", {}).get("request"))
            if timeout is not None and grace < timeout:
                s.bad(
                    s.epp.obj,
                    f"--shutdown-grace ({grace:g} s) is shorter than {ident(route)}'s request timeout "
                    f"({timeout:g} s): a rollout would cut generations the route allows",
                )


def _seconds(duration: str | None) -> float | None:
    """A Gateway API duration (`1h30m`, `300s`, `500ms`) in seconds."""
    if duration is None:
        return None
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+)(h|ms|m|s)", str(duration)))


def check_pool(s: Stack) -> None:
    """The pool selects the model servers (not the EPP) on the port they serve and probe."""
    selector, vllm = s.pool["spec"]["selector"]["matchLabels"], s.vllm
    if not selector.items() <= vllm.labels.items():
        s.bad(s.pool, f"selector {selector} does not match {ident(vllm.obj)}'s pods {vllm.labels}")
    if selector.items() <= s.epp.labels.items():
        s.bad(s.pool, "the selector also matches the EPP's pods")
    serving = port_of(vllm.box, "http")
    targets = [p["number"] for p in s.pool["spec"]["targetPorts"]]
    if targets != [serving]:
        s.bad(s.pool, f"targetPorts {targets} are not {ident(vllm.obj)}'s serving port [{serving}]")
    probe = (vllm.box.get("readinessProbe") or {}).get("httpGet") or {}
    if probe.get("path") != "/health" or port_of(vllm.box, probe.get("port")) != serving:
        s.bad(vllm.obj, f"the readinessProbe must be GET /health on the serving port {serving}")


def kv_events_settings(s: Stack) -> dict[str, Any] | None:
    """(endpoint, replay_endpoint, topic) the model server publishes with; None after a problem."""
    vllm = s.vllm
    if s.sim is not None:  # the stand-in's own reading of its flags (JSON, then the flags over it)
        try:
            cfg = sim_config_from_args(argparse.Namespace(**{**vars(s.sim), "tokenizer": None}))
        except ValueError as err:
            s.bad(vllm.obj, f"`epp-sim serve-engine` refuses its flags: {err}")
            return None
        if cfg.kv_events_endpoint is None:
            s.bad(vllm.obj, "KV events are off: give --kv-events-config or --kv-events-endpoint")
            return None
        if cfg.kv_events_mode == "connect":
            s.bad(vllm.obj, "--kv-events-mode connect: per-pod subscribers need the engine to bind")
        return {
            "endpoint": cfg.kv_events_endpoint,
            "replay_endpoint": cfg.kv_replay_endpoint,
            "topic": cfg.kv_topic,
        }
    if "--enable-prefix-caching" not in vllm.args:
        s.bad(vllm.obj, "--enable-prefix-caching is missing")
    raw = next((a.split("=", 1)[1] for a in vllm.args if a.startswith("--kv-events-config=")), "")
    try:
        kv = json.loads(raw)
    except ValueError as err:
        s.bad(vllm.obj, f"--kv-events-config is not JSON: {err}")
        return None
    if not isinstance(kv, dict):
        s.bad(vllm.obj, "--kv-events-config must be a JSON object")
        return None
    if unknown := sorted(set(kv) - VLLM_KV_EVENTS_KEYS):
        s.bad(vllm.obj, f"--kv-events-config has keys vLLM does not know: {unknown}")
    if kv.get("enable_kv_cache_events") is not True or kv.get("publisher") != "zmq":
        s.bad(vllm.obj, "KV events must be enabled with the zmq publisher")
    return kv


def check_kv_events(s: Stack) -> None:
    """The model servers publish (vLLM: with prefix caching, vLLM's JSON keys) on the ports the EPP
    subscribes to, with the topic the index keys on."""
    vllm, f = s.vllm, s.flags
    kv = kv_events_settings(s)
    if f.kv_events_mode != "per-pod":
        s.bad(s.epp.obj, f"--kv-events-mode is {f.kv_events_mode}, the pods publish per pod")
    if kv is None:
        return
    for key, want in (("endpoint", f.kv_events_port), ("replay_endpoint", f.kv_events_replay_port)):
        m = re.fullmatch(r"tcp://\*:(\d+)", str(kv.get(key)))
        port = int(m.group(1)) if m else None
        if port != want:
            s.bad(vllm.obj, f"KV events {key} port {port} is not the EPP's {want}")
        elif port_of(vllm.box, port) is None:
            s.bad(vllm.obj, f"KV events port {port} is not a declared container port")
    topic = re.fullmatch(r"kv@(.+):(\d+)@(.+)", str(kv.get("topic")))
    serving = port_of(vllm.box, "http")
    if topic is None or (int(topic.group(2)), topic.group(3)) != (serving, s.served_model):
        s.bad(vllm.obj, f"topic {kv.get('topic')!r} must be kv@<pod ip>:{serving}@{s.served_model}")


def check_sim_engine(s: Stack, cfg: EppConfig) -> None:
    """The CPU stand-in listens where the pool, the EPP and its probes reach it, with the index's blocks."""
    if s.sim is None:
        return
    sim, vllm, serving = s.sim, s.vllm, port_of(s.vllm.box, "http")
    if sim.host not in ("0.0.0.0", "::"):
        s.bad(vllm.obj, f"--host {sim.host} is out of reach of the EPP and the gateway: listen on 0.0.0.0")
    if sim.port != serving:
        s.bad(vllm.obj, f"--port {sim.port} is not the serving container port {serving}")
    if sim.block_size != cfg.index.block_size:
        s.bad(vllm.obj, f"--block-size {sim.block_size} is not the index's blockSize {cfg.index.block_size}")


def tokenizer_source(s: Stack, w: Workload, path: str) -> tuple[str, ...] | None:
    """What fills `path` for `w`'s container: the init container that writes it (fetch-tokenizer:
    ("fetch", MODEL, REVISION, HF_ENDPOINT); make-tokenizer: ("make", its command without the
    destination)), on a volume both mount; None (and a problem) when nothing does."""
    inits = [c for c in w.pod.get("initContainers", []) if c["name"] in TOKENIZER_INITS]
    if len(inits) != 1:
        s.bad(w.obj, f"{path}: needs one init container of {list(TOKENIZER_INITS)} to fill it")
        return None
    init = inits[0]
    under = {m["name"] for m in w.box.get("volumeMounts", []) if path.startswith(m["mountPath"] + "/")}
    if not under & {m["name"] for m in init.get("volumeMounts", [])}:
        s.bad(w.obj, f"{path} is not on a volume both containers mount")
    command = init.get("command") or []
    if init["name"] == "make-tokenizer":
        if command[:2] != ["python", "-c"] or len(command) != 4 or command[3] != path:
            s.bad(w.obj, f"make-tokenizer must be `python -c CODE {path}`")
            return None
        if "build_tiny_tokenizer(" not in command[2]:
            s.bad(w.obj, "make-tokenizer's code must call epp.testing.tokenizer.build_tiny_tokenizer")
        return ("make", *command[:3])
    env = w.env_of(init)
    if (env.get("MODEL"), env.get("DEST")) != (s.served_model, path):
        s.bad(w.obj, f"fetch-tokenizer must fetch {s.served_model!r} into {path}")
    if w.config_map_file(s.objects, init, command[-1] if command else "") is None:
        s.bad(w.obj, f"the init container runs {command[-1:]}, which no mounted ConfigMap holds")
    return ("fetch", *(env.get(k, "") for k in ("MODEL", "REVISION", "HF_ENDPOINT")))


def check_tokenizer(s: Stack, cfg: EppConfig) -> None:
    """The config has a tokenizer for the served model, an init container fills it on a shared volume,
    and it is the engine's own: the model's (fetched) for vLLM, the same made one for the stand-in."""
    model = s.served_model
    path = cfg.tokenizers.get(model or "")
    if path is None:
        s.bad(s.epp.obj, f"no tokenizer for the served model {model!r} in the config")
        return
    epp_source = tokenizer_source(s, s.epp, path)
    if s.sim is None:
        if epp_source is not None and epp_source[0] != "fetch":
            s.bad(s.epp.obj, "vLLM tokenizes with the model's own tokenizer: fetch it (fetch-tokenizer)")
        return
    if s.sim.tokenizer is None:
        s.bad(s.vllm.obj, "no --tokenizer: the engine would refuse text and chat prompts")
        return
    engine_source = tokenizer_source(s, s.vllm, s.sim.tokenizer)
    if None not in (epp_source, engine_source) and epp_source != engine_source:
        s.bad(s.vllm.obj, "its tokenizer is not made as the EPP's: prompts would not key its blocks")


def stack_problems(objects: list[Obj]) -> list[str]:
    """Everything that must agree across the EPP, its Service, the pool and the model servers."""
    s = stack_of(objects)
    if isinstance(s, list):
        return s
    cfg = check_config(s)
    check_ports(s)
    check_discovery(s)
    check_shutdown(s)
    check_pool(s)
    check_kv_events(s)
    if cfg is not None:
        check_sim_engine(s, cfg)
        check_tokenizer(s, cfg)
    return s.problems


def all_problems(objects: list[Obj]) -> list[str]:
    return [*builtin_problems(objects), *crd_problems(objects), *stack_problems(objects)]


def stack(target: str) -> Stack:
    s = stack_of(built(target))
    assert isinstance(s, Stack), s
    return s


def _broken(tmp_path: Path, rel: str, old: str, new: str) -> Path:
    root = tmp_path / "deploy"
    shutil.copytree(DEPLOY, root)
    path = root / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} must occur once in {rel}"
    path.write_text(text.replace(old, new))
    return root


def epp_series() -> dict[str, frozenset[str]]:
    """Every series name the EPP's /metrics serves (histogram and counter suffixes too) -> its labels."""
    out = {}
    for name, info in exposed_metrics().items():
        if info.type == "counter":
            out[name] = out[name.removesuffix("_total") + "_created"] = info.labels
        elif info.type == "histogram":
            out[name + "_bucket"] = info.labels | {"le"}
            out[name + "_sum"] = out[name + "_count"] = out[name + "_created"] = info.labels
        else:
            out[name] = info.labels
    return out


def promql_refs(expr: str) -> tuple[set[str], set[str], set[str]]:
    """(metric names, label names, labels of the outermost `by`) a PromQL expression uses."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels = {
        name for m in re.finditer(r"\{([^}]*)\}", s) for name in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", m[1])
    }
    s = re.sub(r"\{[^}]*\}", " ", s)
    groups = [
        {x.strip() for x in m[1].split(",") if x.strip()}
        for m in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", s)
    ]
    s = re.sub(r"\[[^\]]*\]", " ", re.sub(r"\b(?:by|without)\s*\([^)]*\)", " ", s))
    names = {
        m[0]
        for m in re.finditer(r"[A-Za-z_:][\w:]*", s)
        if not s[m.end() :].lstrip().startswith("(") and m[0] not in PROMQL_WORDS
    }
    return names, labels.union(*groups), groups[0] if groups else set()


def _panels(dashboard: Obj) -> Iterator[Obj]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def dashboard_problems(dashboard: Obj, series: dict[str, frozenset[str]]) -> list[str]:
    problems = []
    ids = [p.get("id") for p in _panels(dashboard)]
    if len(ids) != len(set(ids)):
        problems.append("panel ids are not unique")
    boxes = [(p.get("title"), p.get("gridPos", {})) for p in dashboard.get("panels", [])]
    for i, (a, pa) in enumerate(boxes):
        for b, pb in boxes[i + 1 :]:
            if all(
                pa.get(lo, 0) < pb.get(lo, 0) + pb.get(ext, 0)
                and pb.get(lo, 0) < pa.get(lo, 0) + pa.get(ext, 0)
                for lo, ext in (("x", "w"), ("y", "h"))
            ):
                problems.append(f"panels {a!r} and {b!r} overlap")
    variables = {v["name"] for v in dashboard.get("templating", {}).get("list", [])}
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query") if var.get("type") == "query" else None
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", (query or {}).get("query", ""))
        if query is not None and (
            m is None or m[1] not in series or m[2] not in series[m[1]] | ALWAYS_LABELS
        ):
            problems.append(f"variable {var['name']}: {query} is not label_values of an exported metric")
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            expr, where = target["expr"], f"panel {panel['title']!r}"
            if expr.count("(") != expr.count(")") or expr.count("{") != expr.count("}"):
                problems.append(f"{where}: unbalanced brackets in {expr}")
            names, labels, outer = promql_refs(expr)
            known = set(ALWAYS_LABELS)
            for name in sorted(names):
                if name not in series:
                    problems.append(f"{where}: {name} is not a metric the EPP exports")
                known |= series.get(name, labels)  # an unknown metric's labels are not checked
            if not names:
                problems.append(f"{where}: no metric in {expr}")
            if unknown := sorted(labels - known):
                problems.append(f"{where}: label(s) {unknown} are not on {sorted(names)}")
            if legend := set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", ""))) - outer:
                problems.append(
                    f"{where}: the legend uses {sorted(legend)}, which the query does not group by"
                )
            if missing := sorted(set(re.findall(r"\$(\w+)", expr)) - variables - {"__rate_interval"}):
                problems.append(f"{where}: {missing} are not dashboard variables")
    return problems


INFERENCE_PERF_KEYS: dict[str, set[str]] = {
    section: set(keys.split())
    for section, keys in {
        "": "api data load metrics report storage server tokenizer circuit_breakers",
        "api": "type streaming headers slo_unit slo_tpot_header slo_ttft_header response_format "
        "session_id_header_key session_token_header_key",
        "server": "type model_name base_url ignore_eos api_key cert_path key_path",
        "tokenizer": "pretrained_model_name_or_path trust_remote_code token load_timeout",
        "data": "type path corpus_file_path input_distribution output_distribution shared_prefix multimodal "
        "trace otel_trace_replay weka_trace_replay conversation_replay visionarena synthetic_agentic "
        "use_chat_template",
        "data.shared_prefix": "num_groups num_unique_system_prompts num_prompts_per_group "
        "num_users_per_system_prompt system_prompt_len question_len output_len seed question_distribution "
        "output_distribution enable_multi_turn_chat multimodal",
        "load": "type interval stages sweep num_workers worker_max_concurrency worker_max_tcp_connections "
        "trace circuit_breakers request_timeout request_retries request_retry_backoff_sec "
        "stage_teardown_grace_seconds lora_traffic_split base_seed",
        "report": "request_lifecycle prometheus session_lifecycle goodput",
        "storage": "local_storage google_cloud_storage simple_storage_service",
    }.items()
}


SHARED_PREFIX_SIZES = (
    "num_groups",
    "num_prompts_per_group",
    "system_prompt_len",
    "question_len",
    "output_len",
)


def inference_perf_problems(cfg: Obj, served_model: str | None) -> list[str]:
    problems = []
    for section, allowed in INFERENCE_PERF_KEYS.items():
        node: Any = cfg
        for part in filter(None, section.split(".")):
            node = node.get(part) or {}
        if unknown := sorted(set(node) - allowed):
            problems.append(f"{section or 'top level'}: unknown key(s) {unknown}")
    server, data, load, api = (cfg.get(k) or {} for k in ("server", "data", "load", "api"))
    if server.get("type") != "vllm" or not str(server.get("base_url")).startswith("http"):
        problems.append("server needs type vllm and the gateway's base_url")
    if server.get("model_name") != served_model:
        problems.append(
            f"server.model_name {server.get('model_name')!r} is not the served model {served_model!r}"
        )
    if not str((cfg.get("tokenizer") or {}).get("pretrained_model_name_or_path")).startswith("/"):
        problems.append("tokenizer.pretrained_model_name_or_path must be a local directory")
    shared = data.get("shared_prefix") or {}
    if data.get("type") != "shared_prefix" or not all(
        isinstance(shared.get(k), int) for k in SHARED_PREFIX_SIZES
    ):
        problems.append(f"data must be a shared_prefix workload setting {', '.join(SHARED_PREFIX_SIZES)}")
    stages = load.get("stages") or []
    if (
        load.get("type") not in ("constant", "poisson")
        or not stages
        or any(set(s) != {"rate", "duration"} for s in stages)
    ):
        problems.append("load needs constant or poisson stages of {rate, duration}")
    if api.get("type") not in ("completion", "chat") or api.get("streaming") is not True:
        problems.append("api must be completion or chat with streaming on (time to first token needs it)")
    return problems


SCRIPT = DEPLOY / "base" / "fetch-tokenizer.py"


MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass(frozen=True)
class Hit:
    """A request a local stand-in server received: its path and its Authorization header."""

    path: str
    authorization: str | None


@contextlib.asynccontextmanager
async def hub(
    files: dict[str, bytes], token: str | None = None, redirect: Callable[[str], str] | None = None
) -> AsyncIterator[tuple[str, list[Hit]]]:
    """A local stand-in for the Hub's /{repo}/resolve/{revision}/{file}; records every request.

    With `token`, resolve answers 401 unless `Authorization: Bearer <token>` comes with it. With
    `redirect`, resolve answers an existing file with a 302 to `redirect(file)` (the Hub sends large
    files to its CDN that way). Any server also serves /blobs/{file} to anyone (a CDN), and answers
    /hop/{n}/{file} with a 302 to /hop/{n+1}/{file} (a redirect loop)."""
    seen: list[Hit] = []

    def record(request: web.Request) -> None:
        seen.append(Hit(request.path, request.headers.get("Authorization")))

    async def resolve(request: web.Request) -> web.StreamResponse:
        record(request)
        if token is not None and request.headers.get("Authorization") != f"Bearer {token}":
            return web.Response(status=401)
        m = request.match_info
        body = files.get(m["file"]) if (f"{m['org']}/{m['name']}", m["rev"]) == (MODEL, "main") else None
        if body is None:
            return web.Response(status=404)
        if redirect is not None:
            return web.Response(status=302, headers={"Location": redirect(m["file"])})
        return web.Response(body=body)

    async def blob(request: web.Request) -> web.Response:
        record(request)
        body = files.get(request.match_info["file"])
        return web.Response(status=404) if body is None else web.Response(body=body)

    async def hop(request: web.Request) -> web.Response:
        record(request)
        n, name = int(request.match_info["n"]), request.match_info["file"]
        return web.Response(status=302, headers={"Location": f"/hop/{n + 1}/{name}"})

    app = web.Application()
    app.router.add_get("/{org}/{name}/resolve/{rev}/{file}", resolve)
    app.router.add_get("/blobs/{file}", blob)
    app.router.add_get("/hop/{n:\\d+}/{file}", hop)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    finally:
        await runner.cleanup()


def fetch_script() -> Any:
    """deploy/base/fetch-tokenizer.py as a module (its name has a hyphen, so no plain import)."""
    spec = importlib.util.spec_from_file_location("fetch_tokenizer", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def run_script(env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(SCRIPT), env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()
