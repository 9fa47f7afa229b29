"""Discovery against the fake API server for the reference EPP's `--pool-group` and its readiness
after the pool is deleted (gateway-api-inference-extension `cmd/epp/runner/health.go`,
`pkg/epp/controller/inferencepool_reconciler.go`, `pkg/epp/server/controller_manager.go`):

- with `inference.networking.x-k8s.io` the watcher lists and watches the v1alpha2 InferencePool
  (`spec.selector` a plain map, one `spec.targetPortNumber`) and builds the same endpoint set; a v1
  pool of the same name is a different object and is not read (and the reverse);
- the readiness services (`readiness`, `""`, the ext_proc service; `/readyz`) answer NOT_SERVING while
  the pool is deleted or being deleted, SERVING again once it exists; liveness stays SERVING, and an
  API-server outage does not change readiness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.config import parse_config
from epp.datastore import Datastore
from epp.discovery.settings import GROUP_V1, GROUP_V1ALPHA2, DiscoverySettings
from epp.discovery.watcher import PoolWatcher
from epp.server.app import EppServer, ServerSettings
from epp.server.ext_proc import SERVICE_NAME
from epp.testing.kube_api import ALPHA_POOLS, POOLS, FakeKubeApi
from epp.testing.wait import eventually
from tests.support.discovery import pool_watching, settings_at

POOL = "llama"
APP = {"app": "vllm"}
FINALIZER = "gateway.example.com/inferencepool-cleanup"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi() as server:
        yield server


def settings_for(api: FakeKubeApi, tmp_path: pathlib.Path, group: str) -> DiscoverySettings:
    return settings_at(api, tmp_path, POOL, pool_group=group)


@contextlib.asynccontextmanager
async def watching(
    api: FakeKubeApi, tmp_path: pathlib.Path, group: str
) -> AsyncIterator[tuple[PoolWatcher, Datastore]]:
    async with pool_watching(settings_for(api, tmp_path, group)) as watched:
        yield watched


def ids(ds: Datastore) -> set[str]:
    return set(ds.ids())


async def test_the_x_k8s_group_follows_the_v1alpha2_pool(api: FakeKubeApi, tmp_path: pathlib.Path) -> None:
    api.add_alpha_pool(POOL, APP, 8000)
    api.add_pool(POOL, {"app": "other"}, [9000])  # the v1 pool of the same name: another object
    for i, labels in enumerate((APP, APP, {"app": "other"}), start=1):
        api.add_pod(f"p{i}", f"10.0.0.{i}", labels)
    async with watching(api, tmp_path, GROUP_V1ALPHA2) as (w, ds):
        await eventually(lambda: ids(ds) == {"10.0.0.1:8000", "10.0.0.2:8000"}, "the v1alpha2 pool's pods")
        assert w.ready and w.synced
        # Listed and watched in the x-k8s group's v1alpha2 collection, by name; never the v1 one.
        await eventually(lambda: len(api.watch_requests(ALPHA_POOLS)) == 1, "the v1alpha2 pool watched")
        assert api.list_requests(ALPHA_POOLS)[0]["fieldSelector"] == f"metadata.name={POOL}"
        assert api.watch_requests(ALPHA_POOLS)[0]["fieldSelector"] == f"metadata.name={POOL}"
        assert api.list_requests(POOLS) == [] and api.watch_requests(POOLS) == []

        api.update_pool(POOL, selector=APP, ports=[7000])  # a change to the v1 pool changes nothing
        api.update_alpha_pool(POOL, port=8001)
        await eventually(lambda: ids(ds) == {"10.0.0.1:8001", "10.0.0.2:8001"}, "the new target port")
        api.update_alpha_pool(POOL, selector={"app": "other"})
        await eventually(lambda: ids(ds) == {"10.0.0.3:8001"}, "the new selector")

        api.delete_alpha_pool(POOL)
        await eventually(lambda: ids(ds) == set(), "the v1alpha2 pool deleted")
        assert api.objects[POOLS]  # the v1 pool is still there, and still not read
        assert not w.ready
        api.add_alpha_pool(POOL, APP, 8000)
        await eventually(lambda: ids(ds) == {"10.0.0.1:8000", "10.0.0.2:8000"}, "created again")
        assert w.ready and w.lists["pool"] == 1 and not w.errors.get(("pool", "invalid_object"))


async def test_the_default_group_does_not_read_a_v1alpha2_pool(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    api.add_alpha_pool(POOL, APP, 8000)
    api.add_pod("a", "10.0.0.1", APP)
    async with watching(api, tmp_path, GROUP_V1) as (w, ds):
        await eventually(lambda: w.errors[("pool", "not_found")] == 1, "no v1 pool of that name")
        assert ids(ds) == set() and not w.ready and api.list_requests(ALPHA_POOLS) == []
        api.add_pool(POOL, APP, [8002])
        await eventually(lambda: ids(ds) == {"10.0.0.1:8002"}, "the v1 pool")


async def test_without_the_v1alpha2_crd_the_error_names_that_resource(
    api: FakeKubeApi, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.alpha_crd_installed = False
    api.add_pool(POOL, APP, [8000])  # a v1 pool exists, but the x-k8s group was asked for
    api.add_pod("a", "10.0.0.1", APP)
    with caplog.at_level(logging.ERROR, logger="epp.discovery"):
        async with watching(api, tmp_path, GROUP_V1ALPHA2) as (w, ds):
            await eventually(lambda: w.errors[("pool", "not_found")] >= 2, "retried")
            assert any(
                "no inferencepools.inference.networking.x-k8s.io/v1alpha2 (is the CRD installed?" in m
                for m in caplog.messages
            )
            assert ids(ds) == set() and not w.synced
            api.alpha_crd_installed = True
            api.add_alpha_pool(POOL, APP, 8000)
            await eventually(lambda: ids(ds) == {"10.0.0.1:8000"}, "found once the CRD is served")


async def test_a_malformed_v1alpha2_pool_is_logged_and_the_last_valid_spec_kept(
    api: FakeKubeApi, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = api.add_alpha_pool(POOL, APP, 8000)
    api.add_pod("a", "10.0.0.1", APP)
    with caplog.at_level(logging.ERROR, logger="epp.discovery"):
        async with watching(api, tmp_path, GROUP_V1ALPHA2) as (w, ds):
            await eventually(lambda: ids(ds) == {"10.0.0.1:8000"}, "the valid pool")
            broken = {**good, "spec": {"selector": APP}}  # targetPortNumber gone
            api.put(ALPHA_POOLS, broken)
            await eventually(lambda: w.errors[("pool", "invalid_object")] == 1, "malformed version counted")
            assert any("spec.targetPortNumber must be a port number" in m for m in caplog.messages)
            assert any("keeping the last valid spec" in m for m in caplog.messages)
            api.add_pod("b", "10.0.0.2", APP)  # still watching, under the last valid spec
            await eventually(lambda: ids(ds) == {"10.0.0.1:8000", "10.0.0.2:8000"}, "kept running")
            assert w.ready


# -- readiness of the whole server -------------------------------------------------------------

NO_STALENESS_FILTER = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins: [{type: ttft-scorer}, {type: max-score-picker}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: ttft-scorer}, {pluginRef: max-score-picker}]}]
"""
READINESS = ("readiness", "", SERVICE_NAME)


async def health(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service))
        return int(resp.status)


async def statuses(epp: EppServer, session: aiohttp.ClientSession) -> dict[str, Any]:
    """Every health answer: the gRPC services and /readyz."""
    out: dict[str, Any] = {s: await health(epp.grpc_health_port, s) for s in (*READINESS, "liveness")}
    async with session.get(f"http://127.0.0.1:{epp.metrics_port}/readyz") as resp:
        out["/readyz"] = resp.status
    return out


READY = {"readiness": SERVING, "": SERVING, SERVICE_NAME: SERVING, "liveness": SERVING, "/readyz": 200}
GONE = {
    "readiness": NOT_SERVING,
    "": NOT_SERVING,
    SERVICE_NAME: NOT_SERVING,
    "liveness": SERVING,
    "/readyz": 503,
}


async def until_health(
    epp: EppServer, session: aiohttp.ClientSession, want: dict[str, Any], what: str
) -> None:
    last: dict[str, Any] = {}
    for _ in range(1000):
        last = await statuses(epp, session)
        if last == want:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what}: health {last}, wanted {want}")


@pytest.mark.parametrize("group", [GROUP_V1, GROUP_V1ALPHA2])
async def test_readiness_follows_the_pool_after_it_is_deleted(
    api: FakeKubeApi, tmp_path: pathlib.Path, group: str
) -> None:
    alpha = group == GROUP_V1ALPHA2

    def add(finalizers: list[str] | None = None) -> None:
        if alpha:
            api.add_alpha_pool(POOL, APP, 8000, finalizers=finalizers)
        else:
            api.add_pool(POOL, APP, [8000], finalizers=finalizers)

    def delete() -> None:
        (api.delete_alpha_pool if alpha else api.delete_pool)(POOL)

    def release() -> None:
        (api.update_alpha_pool if alpha else api.update_pool)(POOL, finalizers=[])

    add()
    api.add_pod("a", "10.0.0.1", APP)
    settings = ServerSettings.loopback(
        refresh_metrics_interval=0, pool_name=POOL, discovery=settings_for(api, tmp_path, group)
    )
    epp = EppServer(settings, parse_config(NO_STALENESS_FILTER, "no-filter.yaml"))
    await epp.start()
    watcher = epp.discovery
    assert watcher is not None
    try:
        async with aiohttp.ClientSession() as session:
            await until_health(epp, session, READY, "ready once the pool and its pods are listed")
            assert epp.datastore.ids() == ["10.0.0.1:8000"]

            # An API-server outage keeps readiness and the last known endpoints.
            await api.stop()
            await eventually(lambda: watcher.errors[("pool", "unreachable")] >= 1, "the outage noticed")
            assert await statuses(epp, session) == READY
            assert epp.datastore.ids() == ["10.0.0.1:8000"]
            await api.start()

            delete()
            await until_health(epp, session, GONE, "not ready once the pool is deleted")
            assert epp.datastore.ids() == []
            add(finalizers=[FINALIZER])
            await until_health(epp, session, READY, "ready again once it exists")
            assert epp.datastore.ids() == ["10.0.0.1:8000"]

            delete()  # held by its finalizer: marked for deletion only, which counts as deleted
            await until_health(epp, session, GONE, "not ready while it is being deleted")
            deleted = watcher.events[("pool", "deleted")]
            release()
            await eventually(lambda: watcher.events[("pool", "deleted")] == deleted + 1, "then gone")
            assert await statuses(epp, session) == GONE
            add()
            await until_health(epp, session, READY, "ready again")
            assert watcher.readiness_lost == 2
    finally:
        await epp.stop(grace=0.2)


async def test_a_pool_that_comes_back_is_ready_once_its_endpoints_are_scraped(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    """Deleting the pool drops its endpoints (and their metrics); when it exists again, readiness waits, as
    at start, for the re-added endpoints' first scrape, so the staleness filter does not answer 429 to the
    first requests."""
    from aiohttp import web

    open_ = asyncio.Event()
    open_.set()
    hits = 0

    async def metrics(_: web.Request) -> web.Response:
        nonlocal hits
        hits += 1
        await open_.wait()
        return web.Response(text="vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    api.add_pool(POOL, APP, [port])
    api.add_pod("a", "127.0.0.1", APP)
    settings = ServerSettings.loopback(
        refresh_metrics_interval=0.05,
        metrics_timeout=30.0,
        pool_name=POOL,
        discovery=settings_for(api, tmp_path, GROUP_V1),
    )
    epp = EppServer(settings, parse_config(NO_STALENESS_FILTER, "no-filter.yaml"))
    await epp.start()
    endpoint = f"127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            await until_health(epp, session, READY, "ready once the pool's endpoint is scraped")
            api.delete_pool(POOL)
            await until_health(epp, session, GONE, "not ready once the pool is deleted")
            open_.clear()  # the next scrapes hang
            before = hits
            api.add_pool(POOL, APP, [port])
            await eventually(lambda: hits > before, "the re-added endpoint's first scrape sent")
            await asyncio.sleep(0.3)  # room for readiness to move (it must not yet)
            assert await statuses(epp, session) == GONE
            record = epp.datastore.get(endpoint)
            assert record is not None and record.metrics is None
            open_.set()
            await until_health(epp, session, READY, "ready once that scrape ended")
            record = epp.datastore.get(endpoint)
            assert record is not None and record.metrics is not None
    finally:
        open_.set()
        await epp.stop(grace=0.2)
        await runner.cleanup()
