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
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from epp import requests
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
    check_config,
    crd_problems,
    dashboard_problems,
    epp_series,
    fetch_script,
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
    # /debug/* (decisions, endpoints, index) is for development; production serves only /metrics etc.
    assert [st.flags.enable_debug_endpoints for st in (base, dev, prod)] == [True, True, False]
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


def _quantity(text: str | int) -> float:
    """A Kubernetes CPU or memory quantity as a number (cores, bytes)."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    t = str(text)
    unit = next((u for u in sorted(units, key=len, reverse=True) if t.endswith(u)), "")
    return float(t[: len(t) - len(unit)]) * units.get(unit, 1)


def test_production_strips_every_control_header_the_epp_reads_before_envoy_routes() -> None:
    """A client must not pick its objective, model rewrite or fairness id: the production Gateway removes
    them early (before the ext_proc filter), under every name the EPP reads, and the tenancy header when
    the config uses one."""
    prod = stack("overlays/production")
    (policy,) = find(prod.objects, "ClientTrafficPolicy")
    assert [r["name"] for r in policy["spec"]["targetRefs"]] == [
        g["metadata"]["name"] for g in find(prod.objects, "Gateway")
    ]
    removed = set(policy["spec"]["headers"]["earlyRequestHeaders"]["remove"])
    control = {
        requests.OBJECTIVE_HEADER,
        requests.GIE_OBJECTIVE_HEADER,
        requests.MODEL_REWRITE_HEADER,
        requests.GIE_MODEL_REWRITE_HEADER,
        requests.FAIRNESS_HEADER,
        requests.GIE_FAIRNESS_HEADER,
    }
    assert control <= set(requests.HEADERS_OF_INTEREST)  # (the names the EPP reads)
    cfg = check_config(prod)
    assert cfg is not None
    tenant = {cfg.tenancy.header} if cfg.tenancy is not None else set()
    assert removed == control | tenant
    assert find(stack("base").objects, "ClientTrafficPolicy") == []  # (base: no Envoy Gateway CRD assumed)


def test_dev_runs_on_a_cluster_without_gpus_or_secrets() -> None:
    dev, base = stack("overlays/dev"), stack("base")
    # vLLM needs a GPU (the base asks for one); dev runs its CPU stand-in from the EPP image.
    assert base.sim is None and base.vllm.box["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert dev.sim is not None and dev.vllm.box["image"] == dev.epp.box["image"] == "epp:dev"
    text = yaml.safe_dump_all(built("overlays/dev"))
    assert "nvidia.com/gpu" not in text and "secretKeyRef" not in text and "hf-token" not in text
    # Same model name as the base, so requests, the config and the benchmarks are the same.
    assert dev.served_model == base.served_model
    # Small: everything running at once asks for under a core and 2GiB.
    running = [
        c
        for d in find(built("overlays/dev"), "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
        for _ in range(d["spec"]["replicas"])
    ]
    assert sum(_quantity(c["resources"]["requests"]["cpu"]) for c in running) < 1
    assert sum(_quantity(c["resources"]["requests"]["memory"]) for c in running) < 2 * 2**30


def test_dev_pods_make_the_same_tokenizer_and_the_epp_loads_it(tmp_path: Path) -> None:
    dev = stack("overlays/dev")
    dirs = []
    for w in (dev.epp, dev.vllm):  # each pod's init container, run here into tmp_path
        init = next(c for c in w.pod["initContainers"] if c["name"] == "make-tokenizer")
        _, flag, code, dest = init["command"]
        dirs.append(tmp_path / dest.strip("/"))
        subprocess.run([sys.executable, flag, code, str(dirs[-1])], cwd=ROOT, check=True, timeout=120)
    made = [{p.name: p.read_bytes() for p in d.iterdir()} for d in dirs]
    assert made[0] == made[1] and sorted(made[0]) == ["tokenizer.json", "tokenizer_config.json"]
    epp, engine = (PromptTokenizer.from_dir(d) for d in dirs)
    messages = [{"role": "user", "content": "What is in the KV cache?"}]
    assert epp.has_chat_template and len(list(epp.encode_chat(messages))) > 5
    assert list(epp.encode_chat(messages)) == list(engine.encode_chat(messages))


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            "        - --host=0.0.0.0\n",
            "        - --host=127.0.0.1\n",
            "Deployment/vllm-llama3-8b: --host 127.0.0.1 is out of reach of the EPP and the gateway",
        ),
        (
            "        - --block-size=16\n",
            "        - --block-size=32\n",
            "Deployment/vllm-llama3-8b: --block-size 32 is not the index's blockSize 16",
        ),
        (
            "        - --num-gpu-blocks=4096\n",
            "        - --num-gpu-blcks=4096\n",
            "Deployment/vllm-llama3-8b: args do not parse with `epp-sim serve-engine`: "
            "unrecognized arguments: --num-gpu-blcks=4096",
        ),
        (
            '"endpoint": "tcp://*:5557"',
            '"endpoint": "tcp://*:5559"',
            "Deployment/vllm-llama3-8b: KV events endpoint port 5559 is not the EPP's 5557",
        ),
        (
            "build_tiny_tokenizer(sys.argv[1])\n        - /var/lib/engine/tokenizer",
            "build_tiny_tokenizer(sys.argv[1], vocab_size=1024)\n        - /var/lib/engine/tokenizer",
            "Deployment/vllm-llama3-8b: its tokenizer is not made as the EPP's",
        ),
        (
            "        - name: tokenizer\n          mountPath: /var/lib/engine\n          readOnly: true\n",
            "",
            "Deployment/vllm-llama3-8b: /var/lib/engine/tokenizer is not on a volume both containers mount",
        ),
    ],
)
def test_a_broken_dev_engine_is_reported_and_nothing_else(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    root = _broken(tmp_path, "overlays/dev/kustomization.yaml", old, new)
    problems = all_problems(build(root / "overlays/dev"))
    assert problems and problems[0].startswith(message), problems
    assert {p.split(":")[0] for p in problems} == {message.split(":")[0]}, problems


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
    # The image carries the compiled code: built after the package is installed, into the directory
    # `epp serve` seeds its cache from, for the CPU the pods compile for (else they would not find it).
    seed = re.search(r"EPP_NUMBA_CACHE_SEED=(\S+)", last["ENV"]).group(1)  # type: ignore[union-attr]
    assert re.search(r"NUMBA_CPU_NAME=\S+", last["ENV"])
    runs = [ln for ln in lines if ln.startswith("RUN ")]
    warm = [
        i for i, ln in enumerate(runs) if re.search(rf"NUMBA_CACHE_DIR={re.escape(seed)} epp warm-up\b", ln)
    ]
    installed = [i for i, ln in enumerate(runs) if "pip install ." in ln]
    assert warm and installed and installed[0] < warm[0], runs
    assert lines.index(runs[warm[0]]) < lines.index(next(ln for ln in lines if ln.startswith("USER ")))
    for s in (stack(t) for t in STACKS):
        assert s.epp.pod["securityContext"]["runAsNonRoot"] is True
        assert s.epp.pod["securityContext"]["runAsUser"] == uid
        assert {p["containerPort"] for p in s.epp.box["ports"]} == exposed
        # Every container of the image that imports the compiled loops (the EPP, the dev engines;
        # not the init containers) must be able to write numba's cache: a read-only cache
        # directory fails the import ("no locator available").
        for w in (s.epp, s.vllm):
            if w.box["image"] != s.epp.box["image"]:
                continue
            assert w.pod["securityContext"]["runAsUser"] == uid
            assert w.box["securityContext"]["readOnlyRootFilesystem"] is True
            mounts = [m["mountPath"] for m in w.box["volumeMounts"] if not m.get("readOnly")]
            assert any(cache_dir.startswith(m.rstrip("/") + "/") for m in mounts), (cache_dir, mounts)
            # ...and the seed must not be under a mount, which would hide what the image put there
            every = [m["mountPath"] for m in w.box["volumeMounts"]]
            assert not any(seed.startswith(m.rstrip("/") + "/") for m in every), (seed, every)
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
            "base/epp-deployment.yaml",
            "          failureThreshold: 90\n",
            "          failureThreshold: 30\n",
            "Deployment/epp: startupProbe allows 60 s: a new pod compiles its loops first",
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
            "base/epp-deployment.yaml",
            "--shutdown-grace=300s",
            "--shutdown-grace=60s",
            "Deployment/epp: --shutdown-grace (60 s) is shorter than HTTPRoute/vllm-llama3-8b's request",
        ),
        (
            "base/epp-deployment.yaml",
            "terminationGracePeriodSeconds: 330",
            "terminationGracePeriodSeconds: 300",
            "Deployment/epp: preStop (15 s) + --shutdown-grace (300 s) do not fit in termination",
        ),
        (
            "base/epp-rbac.yaml",
            'resources: ["inferencepools"]',
            'resources: ["inferencepool"]',
            "Deployment/epp: ServiceAccount epp may not list/watch inferencepools",
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
    resources = "      path: /spec/template/spec/containers/0/resources\n"
    root = _broken(
        tmp_path / "b",
        "overlays/dev/kustomization.yaml",
        "    - op: replace\n" + resources,
        "    - op: move\n" + resources,
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
        "epp_discovery_synced",  # discovery health
        "epp_discovery_errors_total",
    }
    assert charted - queried == set()
    by_kind = [
        promql_refs(t["expr"])[2]
        for p in _panels(dashboard)
        for t in p.get("targets", [])
        if "epp_discovery_errors_total" in promql_refs(t["expr"])[0]
    ]
    assert by_kind and all("kind" in by for by in by_kind)  # forbidden (RBAC) apart from unreachable


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
    target["expr"] = good
    row = next(p for p in dashboard["panels"] if p["title"] == "Kubernetes discovery")
    row["gridPos"]["y"] = 85  # onto the three panels above it
    assert dashboard_problems(dashboard, epp_series()) == [
        f"panels {above!r} and 'Kubernetes discovery' overlap"
        for above in ("Metrics scrape errors", "Metrics age per pod", "Pods in rotation")
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


def test_port_forwards_go_where_envoy_gateway_puts_the_gateways_envoy() -> None:
    # Envoy Gateway runs a Gateway's Envoy (and its Service) in its own namespace, labelled with the
    # Gateway's name and namespace; a port-forward in the pool's namespace finds nothing.
    gateways = {
        (g["metadata"]["name"], g["metadata"]["namespace"]) for t in STACKS for g in find(built(t), "Gateway")
    }
    for path in (ROOT / "docs" / "deployment.md", DEPLOY / "benchmarking" / "inference-perf.yaml"):
        text = path.read_text()
        namespaces = re.findall(r"kubectl (?:-n (\S+) )?(?:get service|port-forward)", text)
        assert namespaces and set(namespaces) == {"envoy-gateway-system"}, (path, namespaces)
        selectors = re.findall(
            r"gateway\.envoyproxy\.io/owning-gateway-name=([\w-]+),"
            r"gateway\.envoyproxy\.io/owning-gateway-namespace=(\$NS|[\w-]+)",
            text,
        )
        given = re.findall(r"^\s*NS=([\w-]+)", text, re.M)  # what $NS is set to, where it is used
        named = {(n, x) for n, ns in selectors for x in (given if ns == "$NS" else [ns])}
        assert named and named <= gateways, (path, named)


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
    asked = [h.path for h in seen]
    for optional in (
        "chat_template.jinja",
        "special_tokens_map.json",
        "config.json",
        "preprocessor_config.json",
    ):
        assert f"/{MODEL}/resolve/main/{optional}" in asked  # optional files too
    loaded, original = PromptTokenizer.from_dir(dest), PromptTokenizer.from_dir(source)
    messages = [{"role": "user", "content": "hello there"}]
    assert loaded.has_chat_template
    assert list(loaded.encode_chat(messages)) == list(original.encode_chat(messages))


async def test_fetch_tokenizer_brings_the_model_type_that_picks_the_tokenizer_class(tmp_path: Path) -> None:
    """A Qwen2 tokenizer saved as the generic class: transformers 5 (vLLM 0.32) builds Qwen2's own class from
    config.json's model type, which changes the ids; the fetched directory loads as the engine's."""
    source = build_tiny_tokenizer(tmp_path / "source")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    files = {
        "tokenizer.json": (source / "tokenizer.json").read_bytes(),
        "tokenizer_config.json": json.dumps(config).encode(),
        "config.json": json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}).encode(),
    }
    for name, body in files.items():
        (source / name).write_bytes(body)
    dest = tmp_path / "tokenizers" / "qwen"
    async with hub(files) as (url, _):
        code, _, err = await run_script({"MODEL": MODEL, "DEST": str(dest), "HF_ENDPOINT": url})
    assert (code, err) == (0, "")
    assert sorted(p.name for p in dest.iterdir()) == sorted(files)
    loaded = PromptTokenizer.from_dir(dest)
    text = "x 123 4567. Hello world"
    without = tmp_path / "no-model-type"
    without.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (without / name).write_bytes(files[name])
    assert list(loaded.encode_text(text, add_special_tokens=False)) == list(
        PromptTokenizer.from_dir(source).encode_text(text, add_special_tokens=False)
    )
    # (the model type matters: without config.json the generic class keys this text otherwise)
    assert list(loaded.encode_text(text, add_special_tokens=False)) != list(
        PromptTokenizer.from_dir(without).encode_text(text, add_special_tokens=False)
    )


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


async def test_fetch_tokenizer_does_not_send_the_token_where_the_hub_redirects(tmp_path: Path) -> None:
    # The Hub answers large files with a 302 to its CDN; urllib would carry Authorization along.
    files = {"tokenizer.json": b'{"model": {}}', "tokenizer_config.json": b'{"bos_token": "<s>"}'}
    dest = tmp_path / "out"
    async with (
        hub(files) as (cdn, cdn_seen),
        hub(files, token="secret", redirect=lambda name: f"{cdn}/blobs/{name}") as (url, seen),
    ):
        env = {"MODEL": MODEL, "DEST": str(dest), "HF_ENDPOINT": url, "HF_TOKEN": "secret"}
        code, _, err = await run_script(env)
    assert (code, err) == (0, "")
    assert {n: (dest / n).read_bytes() for n in files} == files  # downloaded through the redirect
    assert {h.authorization for h in seen} == {"Bearer secret"}
    # Another port on the same address is another origin: the CDN never sees the token.
    assert sorted(h.path for h in cdn_seen) == ["/blobs/tokenizer.json", "/blobs/tokenizer_config.json"]
    assert {h.authorization for h in cdn_seen} == {None}


async def test_fetch_tokenizer_keeps_the_token_on_a_redirect_within_the_hub(tmp_path: Path) -> None:
    files = {"tokenizer.json": b'{"model": {}}'}
    dest = tmp_path / "out"
    async with hub(files, token="secret", redirect=lambda name: f"/blobs/{name}") as (url, seen):
        env = {"MODEL": MODEL, "DEST": str(dest), "HF_ENDPOINT": url, "HF_TOKEN": "secret"}
        code, _, err = await run_script(env)
    assert (code, err) == (0, "")
    assert (dest / "tokenizer.json").read_bytes() == files["tokenizer.json"]
    assert [h.authorization for h in seen if h.path == "/blobs/tokenizer.json"] == ["Bearer secret"]


async def test_fetch_tokenizer_stops_a_redirect_loop_and_says_so(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    async with hub({"tokenizer.json": b"{}"}, redirect=lambda name: f"/hop/1/{name}") as (url, seen):
        code, _, err = await run_script({"MODEL": MODEL, "DEST": str(dest), "HF_ENDPOINT": url})
    assert (code, err.strip()) == (
        1,
        f"fetch-tokenizer: {url}/{MODEL}/resolve/main/tokenizer.json: more than 5 redirects "
        f"(the last to {url}/hop/6/tokenizer.json)",
    )
    assert [h.path for h in seen][-1] == "/hop/5/tokenizer.json" and not dest.exists()


def test_fetch_tokenizer_origins_compare_scheme_host_and_port() -> None:
    origin = fetch_script().origin
    assert origin("https://HuggingFace.co/a/resolve/main/x") == origin("https://huggingface.co:443/b")
    assert origin("http://127.0.0.1:8080/a") == origin("http://127.0.0.1:8080/b?c=d")
    assert origin("http://127.0.0.1:8080/a") != origin("http://127.0.0.1:8081/a")
    assert origin("https://huggingface.co/a") != origin("http://huggingface.co/a")  # no downgrade
    assert origin("https://huggingface.co/a") != origin("https://cdn-lfs.huggingface.co/a")
