"""Discovery against the fake API server, for the reference EPP's reactions (gateway-api-inference-
extension `pkg/epp/controller/inferencepool_reconciler.go`, `pkg/epp/datastore`):

- an InferencePool marked for deletion (`metadata.deletionTimestamp` set while a finalizer holds it)
  clears the endpoint set at once, as a deleted one does; and an EPP started while its pool is being
  deleted has no endpoints;
- a pod's active-ports annotation, changed on a running pod, changes its endpoints through the watch.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import AsyncIterator

import pytest

from epp.datastore import Datastore
from epp.discovery.watcher import PoolWatcher
from epp.testing.kube_api import POOLS, FakeKubeApi
from epp.testing.wait import eventually
from tests.support.discovery import pool_watching, settings_at

POOL = "llama"
APP = {"app": "vllm"}
FINALIZER = "gateway.example.com/inferencepool-cleanup"
GAIE = "inference.networking.k8s.io/active-ports"
LLMD = "llm-d.ai/active-ports"


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi() as server:
        yield server


@contextlib.asynccontextmanager
async def watching(api: FakeKubeApi, tmp_path: pathlib.Path) -> AsyncIterator[tuple[PoolWatcher, Datastore]]:
    async with pool_watching(settings_at(api, tmp_path, POOL)) as watched:
        yield watched


def ids(ds: Datastore) -> set[str]:
    return set(ds.ids())


async def test_a_pool_marked_for_deletion_clears_the_endpoints_before_it_is_gone(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    api.add_pool(POOL, APP, [8000], finalizers=[FINALIZER])
    api.add_pod("a", "10.0.0.1", APP)
    api.add_pod("b", "10.0.0.2", APP)
    async with watching(api, tmp_path) as (w, ds):
        await eventually(lambda: ids(ds) == {"10.0.0.1:8000", "10.0.0.2:8000"}, "both pods")
        api.delete_pool(POOL)  # the finalizer holds it: only marked, a MODIFIED event
        marked = api.get(POOLS, "default", POOL)
        assert marked["metadata"]["deletionTimestamp"] and marked["metadata"]["finalizers"] == [FINALIZER]
        await eventually(lambda: ids(ds) == set(), "no endpoints while the pool is being deleted")
        assert w.pool is None
        api.add_pod("c", "10.0.0.3", APP)  # pods that come meanwhile do not bring endpoints back
        api.update_pool(POOL, finalizers=[])  # the controller lets go: the object is gone (DELETED)
        await eventually(lambda: w.events[("pool", "deleted")] == 1, "the pool's DELETED event")
        assert ids(ds) == set()
        api.add_pool(POOL, APP, [8000])  # created again
        await eventually(
            lambda: ids(ds) == {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}, "the new pool's pods"
        )


async def test_an_epp_started_while_its_pool_is_being_deleted_has_no_endpoints(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    api.add_pool(POOL, APP, [8000], finalizers=[FINALIZER])
    api.add_pod("a", "10.0.0.1", APP)
    api.delete_pool(POOL)
    async with watching(api, tmp_path) as (w, ds):
        await eventually(lambda: w.lists["pool"] == 1 and w.pool_rv is not None, "the pool listed")
        await eventually(lambda: w.errors[("pool", "not_found")] == 1, "counted as missing")
        assert ids(ds) == set() and w.pool is None and not w.synced
        api.update_pool(POOL, finalizers=[])
        api.add_pool(POOL, APP, [8000])
        await eventually(lambda: ids(ds) == {"10.0.0.1:8000"}, "the new pool")
        assert w.synced


async def test_a_pods_active_ports_annotation_is_followed_through_the_watch(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    api.add_pool(POOL, APP, [8000, 8001])
    api.add_pod("a", "10.0.0.1", APP, annotations={GAIE: "8001"})
    api.add_pod("b", "10.0.0.2", APP)
    async with watching(api, tmp_path) as (w, ds):
        await eventually(
            lambda: ids(ds) == {"10.0.0.1:8001", "10.0.0.2:8000", "10.0.0.2:8001"}, "a serves only 8001"
        )
        api.update_pod("a", annotations={GAIE: "8000,8001"})
        await eventually(
            lambda: ids(ds) == {f"10.0.0.{i}:{p}" for i in (1, 2) for p in (8000, 8001)}, "a serves both"
        )
        api.update_pod("b", annotations={LLMD: "8000", GAIE: "8001"})  # llm-d's key wins
        await eventually(lambda: "10.0.0.2:8001" not in ids(ds), "b drops 8001")
        assert ids(ds) == {"10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000"}
        api.update_pod("b", annotations={GAIE: ""})  # no active port: no endpoint, the pod stays known
        await eventually(lambda: ids(ds) == {"10.0.0.1:8000", "10.0.0.1:8001"}, "b serves nothing")
        assert "b" in w.pods
        api.update_pod("b", annotations={})
        await eventually(lambda: len(ids(ds)) == 4, "b back on both ports")
        assert not w.errors
