"""Kubernetes discovery against a fake API server that speaks the real list/watch JSON: the watcher
(initial list, pods joining and leaving, selector and port changes, bookmarks, 410 Gone in both
forms, outages, missing or malformed pools) and a whole EppServer whose KV-event subscriptions and
index follow the pool's pods (real ZeroMQ publishers on 127.0.0.x)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.clock import MonotonicClock
from epp.config import KvEventsConfig, parse_config
from epp.datastore import Datastore
from epp.discovery.settings import DiscoverySettings
from epp.discovery.watcher import PoolWatcher
from epp.server.app import EppServer, ServerSettings
from epp.testing.envoy import free_port
from epp.testing.kube_api import PODS, FakeKubeApi
from epp.testing.kv_publisher import KvEventPublisher, stored
from epp.testing.wait import eventually
from tests.support.discovery import fast_settings

POOL = "llama"
APP = {"app": "vllm"}
BS = 16


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi() as server:
        yield server


@dataclass
class Rig:
    api: FakeKubeApi
    watcher: PoolWatcher
    datastore: Datastore
    snapshots: list[set[str]] = field(default_factory=list)  # the endpoint set after each change

    def ids(self) -> set[str]:
        return set(self.datastore.ids())

    async def until(self, want: set[str], what: str = "") -> None:
        await eventually(
            lambda: self.ids() == want, what or f"endpoints {sorted(want)} (have {sorted(self.ids())})"
        )

    def errors(self, resource: str, kind: str) -> int:
        return self.watcher.errors[(resource, kind)]


def settings_for(kubeconfig: str, **kw: Any) -> DiscoverySettings:
    return fast_settings(kubeconfig, POOL, **kw)


@contextlib.asynccontextmanager
async def watching(api: FakeKubeApi, tmp_path: pathlib.Path, **kw: Any) -> AsyncIterator[Rig]:
    ds = Datastore(MonotonicClock())
    snapshots: list[set[str]] = []
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    w = PoolWatcher(
        ds, settings_for(kubeconfig, **kw), on_change=lambda _removed: snapshots.append(set(ds.ids()))
    )
    await w.start()
    try:
        yield Rig(api, w, ds, snapshots)
    finally:
        await w.stop()


async def test_the_initial_list_gives_the_ready_pods_one_endpoint_per_port(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    api.add_pool(POOL, APP, [8000, 8001])
    api.add_pool("other-pool", {"app": "other"}, [9000])
    api.add_pod("ready", "10.0.0.1", APP)
    api.add_pod("unready", "10.0.0.2", APP, ready=False)
    api.add_pod("pending", None, APP, ready=False)
    api.add_pod("terminating", "10.0.0.3", APP)
    api.update_pod("terminating", deleting=True)
    api.add_pod("not-selected", "10.0.0.4", {"app": "other"})
    api.add_pod("other-namespace", "10.0.0.5", APP, namespace="elsewhere")
    async with watching(api, tmp_path) as r:
        await asyncio.wait_for(r.watcher.wait_synced(), 10)
        assert r.ids() == {"10.0.0.1:8000", "10.0.0.1:8001"}
        # Named as the reference's datastore names them (its per-pod metrics' `model_server_pod`).
        assert {ep: r.datastore.get(ep).name for ep in r.ids()} == {  # type: ignore[union-attr]
            "10.0.0.1:8000": "ready-rank-0",
            "10.0.0.1:8001": "ready-rank-1",
        }
        assert set(r.watcher.pods) == {"ready", "unready", "pending", "terminating"}  # the selector's pods
        # Both watches ask for bookmarks and start where their lists ended.
        await eventually(lambda: len(api.watch_requests(PODS)) >= 1, "pod watch opened")
        pod_watch = api.watch_requests(PODS)[0]
        assert pod_watch["allowWatchBookmarks"].lower() == "true"
        assert pod_watch["labelSelector"] == "app=vllm"
        assert pod_watch["resourceVersion"] == r.watcher.pods_rv
        pool_watch = api.watch_requests("inferencepools")[0]
        assert pool_watch["fieldSelector"] == f"metadata.name={POOL}"
        assert r.watcher.lists == {"pool": 1, "pod": 1}
        assert not r.watcher.errors


async def test_pods_join_and_leave_as_they_change(api: FakeKubeApi, tmp_path: pathlib.Path) -> None:
    api.add_pool(POOL, APP, [8000])
    api.add_pod("a", "10.0.0.1", APP)
    async with watching(api, tmp_path) as r:
        await r.until({"10.0.0.1:8000"})
        api.add_pod("b", "10.0.0.2", APP, ready=False)
        await eventually(lambda: "b" in r.watcher.pods, "pod b seen")
        assert r.ids() == {"10.0.0.1:8000"}  # not ready: not a candidate
        api.update_pod("b", ready=True)
        await r.until({"10.0.0.1:8000", "10.0.0.2:8000"}, "b joins once ready")
        api.update_pod("a", ready=False)
        await r.until({"10.0.0.2:8000"}, "a leaves when unready")
        api.update_pod("a", ready=True)
        await r.until({"10.0.0.1:8000", "10.0.0.2:8000"}, "a back")
        api.update_pod("a", deleting=True)
        await r.until({"10.0.0.2:8000"}, "a leaves when terminating")
        api.delete_pod("a")
        await eventually(lambda: "a" not in r.watcher.pods, "a forgotten")
        api.update_pod("b", labels={"app": "something-else"})  # relabelled out of the selector
        await r.until(set(), "b leaves when it no longer matches")
        api.add_pod("c", "10.0.0.3", APP)
        await r.until({"10.0.0.3:8000"})
        api.delete_pod("c")
        api.add_pod("c2", "10.0.0.3", APP)  # replaced at the same address: the same endpoint, renamed
        await eventually(lambda: r.datastore.get("10.0.0.3:8000").name == "c2-rank-0", "renamed")  # type: ignore[union-attr]
        assert r.watcher.lists["pod"] == 1  # everything above came from one watch
        assert r.watcher.events[("pod", "deleted")] >= 2
        assert not r.watcher.errors


async def test_a_selector_change_restarts_the_pod_watch_and_keeps_shared_pods(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    api.add_pool(POOL, {"app": "vllm", "gen": "1"}, [8000])
    api.add_pod("old", "10.0.0.1", {"app": "vllm", "gen": "1"})
    api.add_pod("both", "10.0.0.2", {"app": "vllm", "gen": "1", "canary": "yes"})
    api.add_pod("new", "10.0.0.3", {"app": "vllm", "gen": "2", "canary": "yes"})
    async with watching(api, tmp_path) as r:
        await r.until({"10.0.0.1:8000", "10.0.0.2:8000"})
        api.update_pool(POOL, selector={"canary": "yes"})
        await r.until({"10.0.0.2:8000", "10.0.0.3:8000"}, "the new selector's pods")
        assert all("10.0.0.2:8000" in s for s in r.snapshots), r.snapshots  # never dropped in between
        await eventually(
            lambda: any(q.get("labelSelector") == "canary=yes" for q in api.watch_requests(PODS)),
            "a pod watch with the new selector",
        )
        api.add_pod("late", "10.0.0.4", {"canary": "yes"})
        await r.until({"10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}, "the new watch delivers")
        api.add_pod("ignored", "10.0.0.5", {"app": "vllm", "gen": "1"})  # only the old selector's
        api.update_pool(POOL, ports=[8000, 9000])
        await r.until({f"10.0.0.{i}:{p}" for i in (2, 3, 4) for p in (8000, 9000)}, "a second target port")
        assert not r.watcher.errors


async def test_bookmarks_advance_the_resource_version_so_a_compaction_needs_no_relist(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    api.add_pool(POOL, APP, [8000])
    api.add_pod("a", "10.0.0.1", APP)
    async with watching(api, tmp_path) as r:
        await r.until({"10.0.0.1:8000"})
        await eventually(lambda: api.open_watches == 2, "both watches open")
        for i in range(3):  # changes the watches do not select: the resourceVersion moves past them
            api.add_pod(f"unrelated-{i}", f"10.1.0.{i}", {"app": "other"})
        assert r.watcher.pods_rv is not None and int(r.watcher.pods_rv) < api.rv
        rv = api.bookmark()
        await eventually(lambda: r.watcher.pods_rv == str(rv) and r.watcher.pool_rv == str(rv), "bookmarked")
        assert r.watcher.events[("pod", "bookmark")] == 1
        api.compact()
        api.end_watches()  # as at the server's watch timeout
        await eventually(lambda: len(api.watch_requests(PODS)) >= 2, "pod watch resumed")
        assert api.watch_requests(PODS)[-1]["resourceVersion"] == str(rv)
        api.add_pod("b", "10.0.0.2", APP)
        await r.until({"10.0.0.1:8000", "10.0.0.2:8000"}, "the resumed watch delivers")
        assert r.watcher.lists == {"pool": 1, "pod": 1}  # resumed, not re-listed
        assert not r.watcher.errors


@pytest.mark.parametrize("gone_as", ["event", "status"])
async def test_410_gone_relists_without_losing_or_duplicating_endpoints(
    gone_as: str, tmp_path: pathlib.Path
) -> None:
    async with FakeKubeApi(gone_as=gone_as) as api:
        api.add_pool(POOL, APP, [8000])
        for i in (1, 2, 3):
            api.add_pod(f"p{i}", f"10.0.0.{i}", APP)
        async with watching(api, tmp_path) as r:
            await r.until({"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"})
            await eventually(lambda: api.open_watches == 2, "both watches open")
            # The watches end; before the watcher is back, the world changes and history is compacted:
            # what happened can only be learnt from a new list.
            api.end_watches()
            api.delete_pod("p1")
            api.update_pod("p2", ready=False)
            api.add_pod("p4", "10.0.0.4", APP)
            api.compact()
            await r.until({"10.0.0.3:8000", "10.0.0.4:8000"}, "the re-list's view")
            assert r.errors("pod", "gone") >= 1 and r.watcher.lists["pod"] >= 2
            # The event form arrives as a watch event; the status form is the HTTP answer.
            assert (r.watcher.events[("pod", "error")] >= 1) == (gone_as == "event")
            assert r.datastore.ids().count("10.0.0.3:8000") == 1
            assert all("10.0.0.3:8000" in s for s in r.snapshots)  # an unchanged pod never left
            api.add_pod("p5", "10.0.0.5", APP)
            await r.until({"10.0.0.3:8000", "10.0.0.4:8000", "10.0.0.5:8000"}, "watching again after it")


async def test_an_api_server_outage_keeps_the_last_set_and_recovers(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    api.add_pool(POOL, APP, [8000])
    api.add_pod("a", "10.0.0.1", APP)
    api.add_pod("b", "10.0.0.2", APP)
    async with watching(api, tmp_path) as r:
        await r.until({"10.0.0.1:8000", "10.0.0.2:8000"})
        await api.stop()
        await eventually(lambda: r.errors("pod", "unreachable") >= 2, "retries while the API is down")
        assert r.ids() == {"10.0.0.1:8000", "10.0.0.2:8000"}  # the last known set stays in force
        api.delete_pod("a")
        api.add_pod("c", "10.0.0.3", APP)
        await api.start()
        await r.until({"10.0.0.2:8000", "10.0.0.3:8000"}, "caught up after the outage")
        assert r.watcher.synced


async def test_injected_errors_are_retried(api: FakeKubeApi, tmp_path: pathlib.Path) -> None:
    api.add_pool(POOL, APP, [8000])
    api.add_pod("a", "10.0.0.1", APP)
    api.fail_next(500, count=2)
    async with watching(api, tmp_path) as r:
        await r.until({"10.0.0.1:8000"})
        assert r.errors("pool", "api_error") + r.errors("pod", "api_error") == 2


async def test_forbidden_is_logged_with_the_rbac_needed(
    api: FakeKubeApi, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.add_pool(POOL, APP, [8000])
    api.add_pod("a", "10.0.0.1", APP)
    api.fail_next(403)
    with caplog.at_level(logging.ERROR, logger="epp.discovery"):
        async with watching(api, tmp_path) as r:
            await r.until({"10.0.0.1:8000"})
    assert r.errors("pool", "forbidden") == 1
    assert any("get/list/watch on pods and inferencepools" in m for m in caplog.messages)


async def test_a_missing_pool_gives_no_endpoints_until_it_exists(
    api: FakeKubeApi, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.add_pod("a", "10.0.0.1", APP)
    with caplog.at_level(logging.WARNING, logger="epp.discovery"):
        async with watching(api, tmp_path) as r:
            await eventually(lambda: r.errors("pool", "not_found") == 1, "missing pool counted")
            assert any(f"InferencePool default/{POOL} not found" in m for m in caplog.messages)
            assert r.ids() == set() and not r.watcher.synced
            api.add_pool(POOL, APP, [8000])
            await r.until({"10.0.0.1:8000"}, "the pool appears")
            assert r.watcher.synced
            api.delete_pool(POOL)
            await r.until(set(), "the pool is deleted")
            api.add_pod("b", "10.0.0.2", APP)
            api.add_pool(POOL, APP, [8000])
            await r.until({"10.0.0.1:8000", "10.0.0.2:8000"}, "created again")
            assert r.watcher.lists["pool"] == 1  # all through the one watch


async def test_without_the_crd_the_watcher_keeps_retrying(
    api: FakeKubeApi, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.crd_installed = False
    api.add_pod("a", "10.0.0.1", APP)
    with caplog.at_level(logging.ERROR, logger="epp.discovery"):
        async with watching(api, tmp_path) as r:
            await eventually(lambda: r.errors("pool", "not_found") >= 2, "retried")
            assert any("is the CRD installed?" in m for m in caplog.messages)
            api.crd_installed = True
            api.add_pool(POOL, APP, [8000])
            await r.until({"10.0.0.1:8000"}, "found once the CRD exists")


async def test_malformed_pools_are_logged_counted_and_survived(
    api: FakeKubeApi, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = api.add_pool(POOL, APP, [8000])
    broken = {**good, "spec": {"selector": {"matchLabels": APP}}}  # no targetPorts
    api.put_pool(broken)
    api.add_pod("a", "10.0.0.1", APP)
    with caplog.at_level(logging.ERROR, logger="epp.discovery"):
        async with watching(api, tmp_path) as r:
            await eventually(lambda: r.errors("pool", "invalid_object") == 1, "malformed pool counted")
            assert any("spec.targetPorts is missing" in m for m in caplog.messages)
            assert r.ids() == set() and not r.watcher.synced
            api.update_pool(POOL, ports=[8000])
            await r.until({"10.0.0.1:8000"}, "fixed")
            api.put_pool({**broken, "spec": {"targetPorts": [{"number": 8000}]}})  # selector gone
            await eventually(lambda: r.errors("pool", "invalid_object") == 2, "second malformed version")
            assert any("keeping the last valid spec" in m for m in caplog.messages)
            api.add_pod("b", "10.0.0.2", APP)  # still watching, under the last valid spec
            await r.until({"10.0.0.1:8000", "10.0.0.2:8000"}, "the watcher kept running")


async def test_a_pod_without_a_name_is_counted_and_ignored(api: FakeKubeApi, tmp_path: pathlib.Path) -> None:
    api.add_pool(POOL, APP, [8000])
    api.add_pod("a", "10.0.0.1", APP)
    nameless = api.get(PODS, "default", "a")
    del nameless["metadata"]["name"]
    nameless["status"]["podIP"] = "10.0.0.9"
    api.objects[PODS][("default", "")] = nameless  # something the real API would never list
    async with watching(api, tmp_path) as r:
        await r.until({"10.0.0.1:8000"})
        assert r.errors("pod", "invalid_object") == 1


# -- the whole server --------------------------------------------------------------------------

MODEL = "m"
HOSTS = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4"}


async def health(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service))
        return int(resp.status)


async def serving(port: int, service: str) -> None:
    for _ in range(500):
        if await health(port, service) == health_pb2.HealthCheckResponse.SERVING:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"gRPC health {service!r} never SERVING")


async def get(session: aiohttp.ClientSession, epp: EppServer, path: str) -> tuple[int, Any]:
    async with session.get(f"http://127.0.0.1:{epp.metrics_port}{path}") as resp:
        body = await resp.json() if path.startswith("/debug") else await resp.text()
        return resp.status, body


NO_STALENESS_FILTER = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins: [{type: ttft-scorer}, {type: max-score-picker}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: ttft-scorer}, {pluginRef: max-score-picker}]}]
"""


async def test_the_server_follows_the_pool_and_drains_departed_pods_from_the_index(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    target, events = free_port(), free_port()
    pubs = {
        name: await KvEventPublisher(f"tcp://{ip}:{events}", topic=f"kv@{ip}:{target}@{MODEL}").start()
        for name, ip in HOSTS.items()
    }
    ep = {name: f"{ip}:{target}" for name, ip in HOSTS.items()}
    for name in ("a", "b"):
        api.add_pod(name, HOSTS[name], APP)
    # The subscriber's own reconcile is far slower than any wait below: it follows the set through discovery.
    # No scraping here (nothing serves /metrics), so no metrics-staleness-filter either (refused at start).
    cfg = replace(
        parse_config(NO_STALENESS_FILTER, "no-filter.yaml"),
        kv_events=KvEventsConfig(mode="per-pod", port=events, sync_interval=300.0),
    )
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    settings = ServerSettings.loopback(
        refresh_metrics_interval=0,
        pool_name=POOL,
        discovery=settings_for(kubeconfig),
    )
    epp = EppServer(settings, cfg)
    await epp.start()
    assert epp.subscriber is not None
    sub = epp.subscriber

    def subscribed() -> set[str]:
        return {pod for pod, _ in sub._streams}

    def blocks(name: str) -> int:
        return sum(epp.kv_index.pod_counts(ep[name]).values())

    async def joined(name: str) -> None:
        for _ in range(500):  # ZeroMQ's slow joiner: publish until one batch has arrived
            await pubs[name].publish([])
            if ep[name] in epp.ingest.last_seq:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{name} never received an event batch")

    async def store(name: str, first_hash: int, n_blocks: int) -> None:
        tokens = list(range(first_hash * 1000, first_hash * 1000 + n_blocks * BS))
        await pubs[name].publish([stored(list(range(first_hash, first_hash + n_blocks)), None, tokens)])

    try:
        async with aiohttp.ClientSession() as session:
            # No pool yet: alive, not ready, no endpoints.
            watcher = epp.discovery
            assert watcher is not None
            await eventually(lambda: watcher.errors[("pool", "not_found")] == 1, "no pool yet")
            assert (await get(session, epp, "/readyz"))[0] == 503
            assert (
                await health(epp.grpc_health_port, "readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
            )
            assert await health(epp.grpc_health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING
            assert epp.datastore.ids() == []

            api.add_pool(POOL, APP, [target])
            await eventually(lambda: set(epp.datastore.ids()) == {ep["a"], ep["b"]}, "a and b discovered")
            await eventually(lambda: subscribed() == {ep["a"], ep["b"]}, "subscribed to a and b")
            assert (await get(session, epp, "/readyz"))[0] == 200
            await serving(epp.grpc_health_port, "readiness")
            await serving(epp.grpc_health_port, "")

            await joined("a")
            await joined("b")
            await store("a", 100, 3)
            await store("b", 200, 2)
            await eventually(lambda: blocks("a") == 3 and blocks("b") == 2, "blocks indexed")
            _, index = await get(session, epp, "/debug/index")
            assert set(index["pods"]) == {ep["a"], ep["b"]}

            # b turns unready: out of the set, its socket closed, its blocks gone; a untouched.
            api.update_pod("b", ready=False)
            await eventually(lambda: ep["b"] not in epp.datastore.ids(), "b left the set")
            await eventually(lambda: subscribed() == {ep["a"]}, "b's subscription closed")
            assert blocks("b") == 0 and blocks("a") == 3
            _, index = await get(session, epp, "/debug/index")
            assert set(index["pods"]) == {ep["a"]}

            # c arrives: subscribed and indexed.
            api.add_pod("c", HOSTS["c"], APP)
            await eventually(lambda: subscribed() == {ep["a"], ep["c"]}, "subscribed to c")
            await joined("c")
            await store("c", 300, 4)
            await eventually(lambda: blocks("c") == 4, "c's blocks indexed")

            # a is deleted: drained.
            api.delete_pod("a")
            await eventually(lambda: subscribed() == {ep["c"]}, "a's subscription closed")
            assert blocks("a") == 0 and blocks("c") == 4
            _, index = await get(session, epp, "/debug/index")
            assert set(index["pods"]) == {ep["c"]}
            # Late events from a departed pod's publisher change nothing.
            await store("a", 400, 2)
            await store("c", 500, 1)
            await eventually(lambda: blocks("c") == 5, "c still indexed")
            assert blocks("a") == 0

            _, text = await get(session, epp, "/metrics")
            assert "epp_discovery_endpoints 1.0" in text
            assert "epp_discovery_synced 1.0" in text
            assert f'inference_pool_ready_pods{{name="{POOL}"}}' in text
    finally:
        await epp.stop(grace=0.2)
        for p in pubs.values():
            await p.stop()


async def test_the_metrics_of_a_pod_that_leaves_the_pool_go_with_it(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    port = free_port()
    a, b = f"{HOSTS['a']}:{port}", f"{HOSTS['b']}:{port}"
    api.add_pool(POOL, APP, [port])
    api.add_pod("a", HOSTS["a"], APP)
    api.add_pod("b", HOSTS["b"], APP)
    settings = ServerSettings.loopback(
        refresh_metrics_interval=0,
        pool_name=POOL,
        discovery=settings_for(api.write_kubeconfig(tmp_path / "kubeconfig")),
    )
    epp = EppServer(settings, parse_config(NO_STALENESS_FILTER, "no-filter.yaml"))
    await epp.start()
    picks = "epp_picks_total"
    try:
        async with aiohttp.ClientSession() as session:
            await eventually(lambda: set(epp.datastore.ids()) == {a, b}, "a and b discovered")
            for ep in (a, b, a):  # what the request path and the scraper record per endpoint
                epp.metrics.picks(ep, "default", "scored").inc()
                epp.metrics.on_scrape(ep, False, "timeout", 0.1)
            api.delete_pod("a")
            await eventually(lambda: set(epp.datastore.ids()) == {b}, "a left")
            _, text = await get(session, epp, "/metrics")
            assert f'"{a}"' not in text
            assert f'{picks}{{endpoint="{b}",profile="default",reason="scored"}} 1.0' in text
            api.add_pod("a", HOSTS["a"], APP)  # back, at the same address
            await eventually(lambda: set(epp.datastore.ids()) == {a, b}, "a back")
            epp.metrics.picks(a, "default", "scored").inc()
            _, text = await get(session, epp, "/metrics")
            assert f'{picks}{{endpoint="{a}",profile="default",reason="scored"}} 1.0' in text
    finally:
        await epp.stop(grace=0.2)
