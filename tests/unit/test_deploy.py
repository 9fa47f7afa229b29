"""deploy/ cannot drift: every kustomize build is schema-valid, and its pieces agree with each other
and with the code (the `epp serve` flags, the config loader, the metrics registry, the Dockerfile).

Builds go through the Python stand-in (tests/support/kustomize.py) and, where kubectl exists,
through `kubectl kustomize` too: both must give the same objects. Built-in kinds are validated by
kubernetes-validate (strict); the CRD kinds field by field below. Each check returns problems as
text, so the bad-input tests can show the exact message a broken manifest produces.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from epp.cli import build_parser
from epp.kvindex.prompt import PromptTokenizer
from epp.testing.tokenizer import build_tiny_tokenizer
from tests.support.deploy_checks import (
    DEPLOY,
    INFERENCE_GROUP,
    KUBECTL,
    MODEL,
    ROOT,
    SHARED_PREFIX_SIZES,
    STACKS,
    TARGETS,
    _broken,
    _panels,
    all_problems,
    built,
    builtin_problems,
    crd_problems,
    dashboard_problems,
    epp_series,
    find,
    hub,
    inference_perf_problems,
    keyed,
    kubectl_build,
    promql_refs,
    run_script,
    stack,
    stack_problems,
)
from tests.support.kustomize import KustomizeError, build, config_map_hash


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed; the Python build is checked alone")
@pytest.mark.parametrize("target", TARGETS)
def test_python_build_gives_the_objects_kubectl_kustomize_gives(target: str) -> None:
    ours, theirs = keyed(built(target)), keyed(kubectl_build(DEPLOY / target))
    assert sorted(ours) == sorted(theirs)
    for key, obj in ours.items():
        assert obj == theirs[key], f"{key} differs"


def test_config_map_name_hash_is_kustomizes() -> None:
    # `kubectl kustomize` (kustomize v5.5.0) names these generated ConfigMaps c-772g99m6b7,
    # c-bdg947hgcc and c-7b7m6km575 (the last exercises Go's JSON escaping).
    assert config_map_hash({"a.yaml": "x: 1\n"}) == "772g99m6b7"
    assert config_map_hash({"k": "v"}) == "bdg947hgcc"
    assert config_map_hash({"k": "<a&b>\u2028é"}) == "7b7m6km575"


@pytest.mark.parametrize("target", TARGETS)
def test_every_build_passes_schema_validation(target: str) -> None:
    objects = built(target)
    assert objects
    assert builtin_problems(objects) == []
    assert crd_problems(objects) == []


@pytest.mark.parametrize("target", STACKS)
def test_the_pieces_of_each_stack_agree(target: str) -> None:
    assert stack_problems(built(target)) == []


def test_overlays_size_the_epp_for_their_purpose() -> None:
    base, dev, prod = (stack(t) for t in STACKS)
    assert [s.epp.obj["spec"]["replicas"] for s in (base, dev, prod)] == [2, 1, 3]
    assert dev.epp.box["resources"]["requests"] != base.epp.box["resources"]["requests"]
    assert (dev.flags.log_level, base.flags.log_level, prod.flags.log_level) == ("debug", "info", "info")
    # Production: a PDB keeps the EPP serving through drains; replicas spread over nodes and zones.
    pdbs = [
        p
        for p in find(prod.objects, "PodDisruptionBudget")
        if p["spec"]["selector"]["matchLabels"].items() <= prod.epp.labels.items()
    ]
    assert len(pdbs) == 1 and 1 <= pdbs[0]["spec"]["minAvailable"] < prod.epp.obj["spec"]["replicas"]
    spread = prod.epp.pod["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in spread} == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    assert all(c["labelSelector"]["matchLabels"].items() <= prod.epp.labels.items() for c in spread)
    assert find(base.objects, "PodDisruptionBudget") == find(dev.objects, "PodDisruptionBudget") == []
    # A replica leaves the Service's DNS (preStop) before it stops, well within the grace period.
    for st in (base, dev, prod):
        pause = st.epp.box["lifecycle"]["preStop"]["exec"]["command"]
        assert pause[0] == "sleep" and int(pause[1]) < st.epp.pod["terminationGracePeriodSeconds"]


def test_envoy_gateway_values_declare_inference_pool_backends() -> None:
    values = yaml.safe_load((DEPLOY / "gateway" / "envoy-gateway-values.yaml").read_text())
    resources = values["config"]["envoyGateway"]["extensionManager"]["backendResources"]
    assert {"group": INFERENCE_GROUP, "kind": "InferencePool", "version": "v1"} in resources
    classes = [g["metadata"]["name"] for g in find(built("gateway"), "GatewayClass")]
    assert classes == [find(built("base"), "Gateway")[0]["spec"]["gatewayClassName"]]


def test_dockerfile_matches_the_cli_and_the_manifests() -> None:
    text = re.sub(r"^\s*#.*\n", "", (ROOT / "Dockerfile").read_text(), flags=re.M).replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    last = {ln.split()[0]: ln.split(None, 1)[1] for ln in lines}  # the last of each instruction
    assert last["FROM"] == "python:3.11-slim"
    assert json.loads(last["ENTRYPOINT"]) == ["epp", "serve"]
    assert re.search(r'^epp = "epp\.cli:main"$', (ROOT / "pyproject.toml").read_text(), re.M)
    defaults = build_parser().parse_args(["serve"])
    exposed = {int(p) for p in last["EXPOSE"].split()}
    assert exposed == {defaults.grpc_port, defaults.grpc_health_port, defaults.metrics_port}
    copied = [src for ln in lines if ln.startswith("COPY ") for src in ln.split()[1:-1]]
    assert [src for src in copied if not (ROOT / src).exists()] == []
    uid = int(last["USER"].split(":")[0])
    cache_dir = re.search(r"NUMBA_CACHE_DIR=(\S+)", last["ENV"]).group(1)  # type: ignore[union-attr]
    for s in (stack(t) for t in STACKS):
        assert s.epp.pod["securityContext"]["runAsNonRoot"] is True
        assert s.epp.pod["securityContext"]["runAsUser"] == uid
        assert {p["containerPort"] for p in s.epp.box["ports"]} == exposed
        if s.epp.box["securityContext"].get("readOnlyRootFilesystem"):  # numba must write its cache
            mounts = [m["mountPath"] for m in s.epp.box["volumeMounts"] if not m.get("readOnly")]
            assert any(cache_dir.startswith(m.rstrip("/") + "/") for m in mounts), (cache_dir, mounts)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "tests", ".git"} <= set(ignored) and not {"epp", "simulator"} & set(ignored)


@pytest.mark.parametrize(
    ("rel", "old", "new", "message"),
    [
        (
            "base/inferencepool.yaml",
            "- number: 8000",
            "- number: 8001",
            "InferencePool/vllm-llama3-8b: targetPorts [8001] are not Deployment/vllm-llama3-8b's "
            "serving port [8000]",
        ),
        (
            "base/vllm-deployment.yaml",
            '"endpoint": "tcp://*:5557"',
            '"endpoint": "tcp://*:5559"',
            "Deployment/vllm-llama3-8b: KV events endpoint port 5559 is not the EPP's 5557",
        ),
        (
            "base/vllm-deployment.yaml",
            '"publisher": "zmq",',
            '"publisher": "zmq", "hwm": 10, "buffersteps": 5,',
            "Deployment/vllm-llama3-8b: --kv-events-config has keys vLLM does not know: ['buffersteps']",
        ),
        (
            "base/epp-config.yaml",
            "- type: ttft-scorer ",
            "- type: ttft-scorerr ",
            "Deployment/epp: the config does not load: /etc/epp/epp-config.yaml: plugin 'ttft-scorerr'",
        ),
        (
            "base/epp-deployment.yaml",
            "- --kv-events-mode=per-pod",
            "- --kv-events-mode=perpod",
            "Deployment/epp: args do not parse with `epp serve`: argument --kv-events-mode: "
            "invalid choice: 'perpod'",
        ),
        (
            "base/epp-deployment.yaml",
            "- --pool-namespace=$(POD_NAMESPACE)",
            "- --pool-namespace=$(NAMESPACE)",
            "Deployment/epp: $(NAMESPACE) is not defined in the container's env",
        ),
        (
            "base/epp-deployment.yaml",
            "            service: readiness",
            "            service: ready",
            "Deployment/epp: readinessProbe must be gRPC readiness on 9003",
        ),
        (
            "base/epp-service.yaml",
            "    targetPort: metrics",
            "    targetPort: prometheus",
            "Service/epp: port metrics targets 'prometheus', not a container port",
        ),
        (
            "base/epp-service.yaml",
            "    port: 9090",
            "    port: 9091",
            "Service/epp: port metrics is 9091 but reaches 9090: headless Services do not map",
        ),
        (
            "base/epp-rbac.yaml",
            'resources: ["inferencepools"]',
            'resources: ["inferencepool"]',
            "Deployment/epp: ServiceAccount epp may not get/list/watch inferencepools",
        ),
        (
            "base/httproute.yaml",
            "      name: vllm-llama3-8b\n    timeouts",
            "      name: vllm-llama3\n    timeouts",
            "HTTPRoute/vllm-llama3-8b: backendRef names pool 'vllm-llama3', not in the build",
        ),
        (
            "base/inferencepool.yaml",
            "    port:\n      number: 9002",
            "    portNumber: 9002",
            "InferencePool/vllm-llama3-8b: spec.endpointPickerRef: unknown field(s) ['portNumber']",
        ),
        (
            "base/epp-deployment.yaml",
            "  replicas: 2\n",
            "  replicas: 2\n  replica: 2\n",
            "Deployment/epp: spec: Additional properties are not allowed ('replica' was unexpected)",
        ),
    ],
)
def test_a_broken_manifest_is_reported_and_nothing_else(
    tmp_path: Path, rel: str, old: str, new: str, message: str
) -> None:
    root = _broken(tmp_path, rel, old, new)
    for target in ("base", "overlays/production"):
        problems = all_problems(build(root / target))
        # The cause is named, and only the broken object is reported (a consequence may follow).
        assert problems and problems[0].startswith(message), problems
        assert {p.split(":")[0] for p in problems} == {message.split(":")[0]}, problems


def test_kustomize_stand_in_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    root = _broken(tmp_path, "overlays/dev/kustomization.yaml", "namespace: inference-dev", "namePrefix: x-")
    with pytest.raises(KustomizeError, match=r"unsupported kustomization field\(s\) \['namePrefix'\]"):
        build(root / "overlays/dev")
    root = _broken(
        tmp_path / "b", "overlays/dev/kustomization.yaml", "    - op: replace\n", "    - op: move\n"
    )
    with pytest.raises(KustomizeError, match="JSON patch op 'move' is not supported"):
        build(root / "overlays/dev")
    root = _broken(tmp_path / "c", "base/kustomization.yaml", "- fetch-tokenizer.py", "- fetch_tokenizer.py")
    with pytest.raises(
        KustomizeError, match=re.escape("configMapGenerator epp-config: no file 'fetch_tokenizer.py'")
    ):
        build(root / "base")
    assert build(DEPLOY / "overlays/dev")  # the untouched tree still builds


def test_dashboard_queries_only_what_the_epp_exports() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "epp-dashboard.json").read_text())
    series = epp_series()
    assert "epp_kv_events_total" in series and "le" in series["epp_time_to_first_byte_seconds_bucket"]
    assert dashboard_problems(dashboard, series) == []
    queried = set().union(
        *(promql_refs(t["expr"])[0] for p in _panels(dashboard) for t in p.get("targets", []))
    )
    charted = {
        "inference_objective_request_total",  # request rate
        "inference_objective_request_error_total",  # errors by code
        "inference_extension_scheduler_e2e_duration_seconds_bucket",  # scheduling latency
        "epp_pick_mode_total",
        "epp_kv_index_entries",  # index size
        "epp_kv_pod_freshness",
        "epp_kv_events_total",
        "epp_endpoint_in_flight_requests",
        "epp_time_to_first_byte_seconds_bucket",  # observed TTFT
        "epp_cost_model_prefill_scale",  # calibration of the estimate
    }
    assert charted - queried == set()


def test_dashboard_with_an_unknown_metric_label_or_legend_is_reported() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "epp-dashboard.json").read_text())
    panel = next(p for p in _panels(dashboard) if p.get("targets"))
    target = panel["targets"][0]
    good = target["expr"]
    target["expr"] = good.replace("inference_objective_request_total", "inference_objective_requests_total")
    assert dashboard_problems(dashboard, epp_series()) == [
        f"panel {panel['title']!r}: inference_objective_requests_total is not a metric the EPP exports"
    ]
    target["expr"] = good.replace("by (model_name)", "by (model)")
    assert dashboard_problems(dashboard, epp_series()) == [
        f"panel {panel['title']!r}: label(s) ['model'] are not on ['inference_objective_request_total']",
        f"panel {panel['title']!r}: the legend uses ['model_name'], which the query does not group by",
    ]


def test_inference_perf_config_is_a_shared_prefix_run_against_the_pool() -> None:
    cfg = yaml.safe_load((DEPLOY / "benchmarking" / "inference-perf.yaml").read_text())
    model = stack("base").served_model
    assert inference_perf_problems(cfg, model) == []
    shared = cfg["data"]["shared_prefix"]
    shared["num_group"] = shared.pop("num_groups")
    assert inference_perf_problems(cfg, model) == [
        "data.shared_prefix: unknown key(s) ['num_group']",
        f"data must be a shared_prefix workload setting {', '.join(SHARED_PREFIX_SIZES)}",
    ]


def test_deployment_guide_names_only_files_that_exist() -> None:
    text = (ROOT / "docs" / "deployment.md").read_text()
    paths = set(re.findall(r"\b((?:deploy|docs|examples)/[\w./-]*\w)", text))
    assert {
        "deploy/overlays/dev",
        "deploy/overlays/production",
        "deploy/benchmarking/inference-perf.yaml",
    } <= paths
    assert [p for p in sorted(paths) if not (ROOT / p).exists()] == []
    assert "kubectl apply -k deploy/overlays/production" in text
    assert "guidellm run" in text and f"model={stack('base').served_model}" in text


async def test_fetch_tokenizer_writes_a_directory_the_epp_loads(tmp_path: Path) -> None:
    source = build_tiny_tokenizer(tmp_path / "source")
    files = {n: (source / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json")}
    dest = tmp_path / "tokenizers" / "llama"
    async with hub(files, token="secret") as (url, seen):
        env = {"MODEL": MODEL, "DEST": str(dest), "HF_ENDPOINT": url, "HF_TOKEN": "secret"}
        code, out, err = await run_script(env)
    assert (code, err) == (0, "")
    assert out.strip() == f"fetch-tokenizer: {MODEL}: wrote tokenizer.json, tokenizer_config.json to {dest}"
    assert sorted(p.name for p in dest.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert f"/{MODEL}/resolve/main/chat_template.jinja" in seen  # optional files are asked for
    loaded, original = PromptTokenizer.from_dir(dest), PromptTokenizer.from_dir(source)
    messages = [{"role": "user", "content": "hello there"}]
    assert loaded.has_chat_template
    assert list(loaded.encode_chat(messages)) == list(original.encode_chat(messages))


async def test_fetch_tokenizer_failures_say_why_and_write_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    async with hub({"tokenizer_config.json": b'{"bos_token": "<s>"}'}) as (url, _):
        code, _, err = await run_script({"MODEL": MODEL, "DEST": str(dest), "HF_ENDPOINT": url})
    assert (code, err.strip()) == (
        1,
        f"fetch-tokenizer: {url}/{MODEL}/resolve/main/tokenizer.json: not found (404): "
        f"is MODEL={MODEL!r} right?",
    )
    async with hub({"tokenizer.json": b"{}"}, token="secret") as (url, _):
        code, _, err = await run_script({"MODEL": MODEL, "DEST": str(dest), "HF_ENDPOINT": url})
    assert code == 1 and err.rstrip().endswith(
        "tokenizer.json: HTTP 401 (a gated model needs HF_TOKEN with access to it)"
    )
    async with hub({"tokenizer.json": b"{}", "tokenizer_config.json": b"not json"}) as (url, _):
        code, _, err = await run_script({"MODEL": MODEL, "DEST": str(dest), "HF_ENDPOINT": url})
    assert code == 1 and "tokenizer_config.json: not valid JSON" in err
    assert not dest.exists()  # the good tokenizer.json fetched before was not written either
    code, _, err = await run_script({"DEST": str(dest)})
    assert (code, err.strip()) == (2, "fetch-tokenizer: set MODEL")
