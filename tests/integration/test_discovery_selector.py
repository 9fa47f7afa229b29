"""Selector mode against the fake API server (the real list/watch JSON): the pods of the namespace
that `--endpoint-selector` matches (set-based requirements included) are the endpoints on
`--endpoint-target-ports`; no InferencePool or InferenceModelRewrite is ever requested; readiness
comes once the pods are listed and outages, 410 Gone and RBAC errors are handled as in pool mode."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.clock import MonotonicClock
from epp.config import parse_config
from epp.datastore import Datastore
from epp.discovery.selector import parse_selector
from epp.discovery.selector_watcher import SelectorWatcher
from epp.discovery.settings import DiscoverySettings
from epp.server.app import EppServer, ServerSettings
from epp.testing.kube_api import ALPHA_POOLS, LLMD_REWRITES, PODS, POOLS, REWRITES, FakeKubeApi
from epp.testing.wait import eventually
from tests.support.discovery import fast_settings

SELECTOR = "app=vllm,env in (prod,staging),!canary"
PROD = {"app": "vllm", "env": "prod"}


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi() as server:
        yield server


def settings_for(kubeconfig: str, **kw: Any) -> DiscoverySettings:
    selected: dict[str, Any] = {"endpoint_selector": parse_selector(SELECTOR), "target_ports": (8000, 8001)}
    return fast_settings(kubeconfig, **{**selected, **kw})


@dataclass
class Rig:
    api: FakeKubeApi
    watcher: SelectorWatcher
    datastore: Datastore
    snapshots: list[set[str]] = field(default_factory=list)

    def ids(self) -> set[str]:
        return set(self.datastore.ids())

    async def until(self, want: set[str], what: str = "") -> None:
        await eventually(
            lambda: self.ids() == want, what or f"endpoints {sorted(want)} (have {sorted(self.ids())})"
        )


@contextlib.asynccontextmanager
async def watching(api: FakeKubeApi, tmp_path: pathlib.Path, **kw: Any) -> AsyncIterator[Rig]:
    ds = Datastore(MonotonicClock())
    snapshots: list[set[str]] = []
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    w = SelectorWatcher(
        ds, settings_for(kubeconfig, **kw), on_change=lambda _removed: snapshots.append(set(ds.ids()))
    )
    assert not w.ready
    await w.start()
    try:
        yield Rig(api, w, ds, snapshots)
    finally:
        await w.stop()


def no_pool_or_rewrite_requests(api: FakeKubeApi) -> bool:
    resources = (POOLS, ALPHA_POOLS, REWRITES, LLMD_REWRITES)
    return not any(api.list_requests(r) or api.watch_requests(r) for r in resources)


@pytest.mark.parametrize("namespace", ["default", "inference"])
async def test_the_selected_pods_of_the_namespace_give_one_endpoint_per_target_port(
    api: FakeKubeApi, tmp_path: pathlib.Path, namespace: str
) -> None:
    api.add_pool("unrelated-pool", PROD, [9000], namespace=namespace)  # never read in selector mode
    api.add_pod("prod", "10.0.0.1", PROD, namespace=namespace)
    api.add_pod("staging", "10.0.0.2", {"app": "vllm", "env": "staging"}, namespace=namespace)
    api.add_pod("unready", "10.0.0.3", PROD, ready=False, namespace=namespace)
    api.add_pod("dev", "10.0.0.4", {"app": "vllm", "env": "dev"}, namespace=namespace)
    api.add_pod("canary", "10.0.0.5", {**PROD, "canary": "yes"}, namespace=namespace)
    api.add_pod("other-ns", "10.0.0.6", PROD, namespace="elsewhere" if namespace == "default" else "default")
    async with watching(api, tmp_path, namespace=namespace) as r:
        await asyncio.wait_for(r.watcher.wait_synced(), 10)
        assert r.watcher.ready
        assert r.ids() == {"10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000", "10.0.0.2:8001"}
        assert set(r.watcher.pods) == {"prod", "staging", "unready"}  # the server applied the selector
        await eventually(lambda: len(api.watch_requests(PODS)) >= 1, "pod watch opened")
        watch = api.watch_requests(PODS)[0]
        assert watch["labelSelector"] == "app=vllm,!canary,env in (prod,staging)"
        assert watch["allowWatchBookmarks"].lower() == "true"
        assert watch["resourceVersion"] == r.watcher.pods_rv
        assert r.watcher.lists == {"pod": 1} and not r.watcher.errors
        assert no_pool_or_rewrite_requests(api)


async def test_pods_join_and_leave_as_they_change(api: FakeKubeApi, tmp_path: pathlib.Path) -> None:
    api.add_pod("a", "10.0.0.1", PROD)
    async with watching(api, tmp_path, target_ports=(8000,)) as r:
        await r.until({"10.0.0.1:8000"})
        api.add_pod("b", "10.0.0.2", {"app": "vllm", "env": "dev"})
        api.update_pod("b", labels={"app": "vllm", "env": "staging"})  # relabelled into the selector
        await r.until({"10.0.0.1:8000", "10.0.0.2:8000"}, "b joins")
        api.update_pod("a", labels={**PROD, "canary": "yes"})  # relabelled out of it
        await r.until({"10.0.0.2:8000"}, "a leaves")
        api.update_pod("b", ready=False)
        await r.until(set(), "b leaves when unready")
        api.update_pod("b", ready=True)
        api.add_pod("c", "10.0.0.3", PROD)
        await r.until({"10.0.0.2:8000", "10.0.0.3:8000"}, "b back, c joins")
        api.delete_pod("c")
        await r.until({"10.0.0.2:8000"}, "c deleted")
        assert r.watcher.lists["pod"] == 1 and not r.watcher.errors
        assert r.watcher.ready and r.watcher.readiness_lost == 0  # an empty set is still ready


async def test_the_active_ports_annotation_picks_among_the_target_ports(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    api.add_pod("a", "10.0.0.1", PROD, annotations={"llm-d.ai/active-ports": "8001,9999"})
    async with watching(api, tmp_path) as r:
        await r.until({"10.0.0.1:8001"})
        api.update_pod("a", annotations={})
        await r.until({"10.0.0.1:8000", "10.0.0.1:8001"}, "all target ports without the annotation")


async def test_not_ready_until_the_pods_are_listed_and_errors_are_retried(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    api.add_pod("a", "10.0.0.1", PROD)
    api.fail_next(503, count=2)
    async with watching(api, tmp_path) as r:
        await eventually(lambda: r.watcher.errors[("pod", "api_error")] == 2, "two failed lists")
        await r.until({"10.0.0.1:8000", "10.0.0.1:8001"}, "listed after the retries")
        assert r.watcher.ready and r.watcher.synced and r.watcher.lists["pod"] == 1


async def test_an_outage_keeps_the_last_set_and_readiness(api: FakeKubeApi, tmp_path: pathlib.Path) -> None:
    api.add_pod("a", "10.0.0.1", PROD)
    api.add_pod("b", "10.0.0.2", PROD)
    async with watching(api, tmp_path, target_ports=(8000,)) as r:
        await r.until({"10.0.0.1:8000", "10.0.0.2:8000"})
        await api.stop()
        await eventually(lambda: r.watcher.errors[("pod", "unreachable")] >= 2, "retries while down")
        assert r.ids() == {"10.0.0.1:8000", "10.0.0.2:8000"} and r.watcher.ready
        api.delete_pod("a")
        api.add_pod("c", "10.0.0.3", PROD)
        await api.start()
        await r.until({"10.0.0.2:8000", "10.0.0.3:8000"}, "caught up after the outage")
        assert r.watcher.readiness_lost == 0


@pytest.mark.parametrize("gone_as", ["event", "status"])
async def test_410_gone_relists_without_losing_or_duplicating_endpoints(
    gone_as: str, tmp_path: pathlib.Path
) -> None:
    async with FakeKubeApi(gone_as=gone_as) as api:
        for i in (1, 2, 3):
            api.add_pod(f"p{i}", f"10.0.0.{i}", PROD)
        async with watching(api, tmp_path, target_ports=(8000,)) as r:
            await r.until({"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"})
            await eventually(lambda: api.open_watches == 1, "the pod watch open")
            api.end_watches()
            api.delete_pod("p1")
            api.add_pod("p4", "10.0.0.4", PROD)
            api.compact()
            await r.until({"10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}, "the re-list's view")
            assert r.watcher.errors[("pod", "gone")] >= 1 and r.watcher.lists["pod"] >= 2
            assert all({"10.0.0.2:8000", "10.0.0.3:8000"} <= s for s in r.snapshots)  # never dropped
            assert r.datastore.ids().count("10.0.0.2:8000") == 1


async def test_forbidden_is_logged_with_the_rbac_selector_mode_needs(
    api: FakeKubeApi, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.add_pod("a", "10.0.0.1", PROD)
    api.fail_next(403)
    with caplog.at_level(logging.ERROR, logger="epp.discovery"):
        async with watching(api, tmp_path, target_ports=(8000,)) as r:
            await r.until({"10.0.0.1:8000"})
    assert r.watcher.errors[("pod", "forbidden")] == 1
    forbidden = [m for m in caplog.messages if "get/list/watch" in m]
    assert forbidden and all(m.endswith("get/list/watch on pods") for m in forbidden), forbidden
    assert "--endpoint-selector 'app=vllm,!canary,env in (prod,staging)'" in forbidden[0]


# -- the whole server --------------------------------------------------------------------------

NO_STALENESS_FILTER = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins: [{type: ttft-scorer}, {type: max-score-picker}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: ttft-scorer}, {pluginRef: max-score-picker}]}]
"""


async def health(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service))
        return int(resp.status)


async def test_the_server_in_selector_mode_is_ready_once_listed_and_reads_no_rewrites(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    api.add_pod("a", "10.0.0.1", PROD)
    api.add_rewrite("r", "default", [{"matches": [{"model": "x"}], "targets": [{"modelRewrite": "y"}]}])
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    await api.stop()  # the API server is down when the EPP starts: it cannot list yet
    settings = ServerSettings.loopback(refresh_metrics_interval=0, discovery=settings_for(kubeconfig))
    epp = EppServer(settings, parse_config(NO_STALENESS_FILTER, "no-filter.yaml"))
    assert epp.model_rewrites is None and isinstance(epp.discovery, SelectorWatcher)
    await epp.start()
    try:
        async with aiohttp.ClientSession() as session:
            watcher = epp.discovery
            await eventually(lambda: watcher.errors[("pod", "unreachable")] >= 1, "the list failed")
            assert not epp.is_ready()
            async with session.get(f"http://127.0.0.1:{epp.metrics_port}/readyz") as resp:
                assert resp.status == 503
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            assert await health(epp.grpc_health_port, "readiness") == not_serving
            assert await health(epp.grpc_health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING

            await api.start()
            await eventually(lambda: set(epp.datastore.ids()) == {"10.0.0.1:8000", "10.0.0.1:8001"}, "listed")
            await eventually(epp.is_ready, "ready once the pods are listed")
            serving = health_pb2.HealthCheckResponse.SERVING
            for _ in range(500):  # the readiness task sets the health services right after
                if await health(epp.grpc_health_port, "readiness") == serving:
                    break
                await asyncio.sleep(0.02)
            assert await health(epp.grpc_health_port, "readiness") == serving
            async with session.get(f"http://127.0.0.1:{epp.metrics_port}/metrics") as resp:
                text = await resp.text()
            assert "epp_discovery_endpoints 2.0" in text and "epp_discovery_synced 1.0" in text
            assert 'epp_discovery_lists_total{resource="pod"} 1.0' in text
        assert no_pool_or_rewrite_requests(api)
        assert not epp.director.model_rewrites  # the rewrite in the namespace was never read
    finally:
        await epp.stop(grace=0.2)
