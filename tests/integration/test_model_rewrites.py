"""InferenceModelRewrite objects watched through the fake API server (the real list/watch JSON), as
the reference EPP's reconciler follows them (gateway-api-inference-extension / llm-d-router
`pkg/epp/controller/inferencemodelrewrite_reconciler.go`): only objects whose `spec.poolRef` names
this pool apply; one marked for deletion counts as deleted; bad objects are skipped, logged naming the
object and the field, and the others stay in force; a missing CRD or missing RBAC is logged and
retried without failing the EPP; `410 Gone` lists again; watches resume from the last version."""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from epp.config import parse_config
from epp.discovery.rewrite_watcher import REWRITE, ModelRewriteWatcher
from epp.discovery.rewrites import EMPTY, RewriteTable
from epp.discovery.settings import GROUP_V1, GROUP_V1ALPHA2, DiscoverySettings
from epp.server.app import EppServer, ServerSettings
from epp.testing.kube_api import LLMD_REWRITES, REWRITES, FakeKubeApi
from epp.testing.wait import eventually
from tests.support.discovery import settings_at

POOL = "llama"
APP = {"app": "vllm"}
FINALIZER = "example.com/keep"


def exact(model: str, *targets: tuple[str, int | None]) -> dict[str, Any]:
    return {
        "matches": [{"model": {"type": "Exact", "value": model}}],
        "targets": [{"modelRewrite": t, **({"weight": w} if w is not None else {})} for t, w in targets],
    }


def generic(*targets: str) -> dict[str, Any]:
    return {"targets": [{"modelRewrite": t} for t in targets]}


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi() as server:
        yield server


def settings_for(
    api: FakeKubeApi, tmp_path: pathlib.Path, group: str = GROUP_V1, **kw: Any
) -> DiscoverySettings:
    return settings_at(api, tmp_path, POOL, pool_group=group, **kw)


class Tables:
    def __init__(self) -> None:
        self.seen: list[RewriteTable] = []

    def __call__(self, table: RewriteTable) -> None:
        self.seen.append(table)

    @property
    def last(self) -> RewriteTable:
        return self.seen[-1] if self.seen else EMPTY

    def target(self, model: str) -> str | None:
        rule = self.last.lookup(model)
        return None if rule is None else rule.targets[0].model


@contextlib.asynccontextmanager
async def watching(
    api: FakeKubeApi, tmp_path: pathlib.Path, group: str = GROUP_V1, observer: Any = None, **kw: Any
) -> AsyncIterator[tuple[ModelRewriteWatcher, Tables]]:
    tables = Tables()
    w = ModelRewriteWatcher(settings_for(api, tmp_path, group, **kw), tables, observer=observer)
    await w.start()
    try:
        yield w, tables
    finally:
        await w.stop()


async def test_the_rules_follow_the_objects_of_the_pool(api: FakeKubeApi, tmp_path: pathlib.Path) -> None:
    api.add_rewrite("canary", POOL, [exact("food-review", ("food-review-v2", None))])
    api.add_rewrite("elsewhere", "other-pool", [exact("x", ("never", None))])
    async with watching(api, tmp_path) as (w, tables):
        await eventually(lambda: tables.target("food-review") == "food-review-v2", "listed")
        assert tables.last.sources == ("canary",) and tables.target("x") is None
        await eventually(lambda: len(api.watch_requests(REWRITES)) == 1, "watching")
        [listed] = api.list_requests(REWRITES)
        assert "fieldSelector" not in listed and "labelSelector" not in listed  # the whole namespace

        api.update_rewrite("canary", rules=[exact("food-review", ("food-review-v3", None))])
        await eventually(lambda: tables.target("food-review") == "food-review-v3", "modified")
        api.add_rewrite("base", POOL, [generic("base-model")], created="2025-02-01T00:00:00Z")
        await eventually(lambda: tables.target("anything") == "base-model", "added")
        assert tables.target("food-review") == "food-review-v3"  # exact beats generic
        api.update_rewrite("elsewhere", pool=POOL)  # now it references this pool
        await eventually(lambda: tables.target("x") == "never", "moved to this pool")
        api.update_rewrite("elsewhere", pool="other-pool")  # and away again
        await eventually(lambda: tables.target("x") == "base-model", "moved away")
        api.delete_rewrite("canary")
        await eventually(lambda: tables.target("food-review") == "base-model", "deleted")
        assert w.events["added"] == 1 and w.events["deleted"] == 1 and w.lists == 1


async def test_the_oldest_object_wins_across_objects(api: FakeKubeApi, tmp_path: pathlib.Path) -> None:
    api.add_rewrite("newer", POOL, [exact("m", ("from-newer", None))], created="2025-03-01T00:00:00Z")
    api.add_rewrite("older", POOL, [exact("m", ("from-older", None))], created="2025-01-01T00:00:00Z")
    async with watching(api, tmp_path) as (_, tables):
        await eventually(lambda: tables.target("m") == "from-older", "the oldest wins")
        api.delete_rewrite("older")
        await eventually(lambda: tables.target("m") == "from-newer", "then the next oldest")


async def test_an_object_marked_for_deletion_no_longer_applies(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    api.add_rewrite("canary", POOL, [exact("m", ("m-v2", None))])
    api.update_rewrite("canary", finalizers=[FINALIZER])
    async with watching(api, tmp_path) as (w, tables):
        await eventually(lambda: tables.target("m") == "m-v2", "listed")
        api.delete_rewrite("canary")  # held by the finalizer: only marked
        await eventually(lambda: tables.target("m") is None, "marked for deletion: gone")
        assert w.events["modified"] == 1
        api.update_rewrite("canary", finalizers=[])
        await eventually(lambda: w.events["deleted"] == 1, "then deleted")
        assert tables.target("m") is None


async def test_the_pool_group_must_match_the_pool_ref(api: FakeKubeApi, tmp_path: pathlib.Path) -> None:
    api.add_rewrite("v1-ref", POOL, [exact("a", ("a-v1", None))])  # poolRef.group: the v1 group
    api.add_rewrite("alpha-ref", POOL, [exact("b", ("b-v1", None))], pool_group=GROUP_V1ALPHA2)
    api.add_rewrite("default-ref", POOL, [exact("c", ("c-v1", None))], pool_group=None)  # the CRD default
    async with watching(api, tmp_path, GROUP_V1ALPHA2) as (w, tables):
        await eventually(lambda: w.listed, "listed")
        assert tables.last.sources == ("alpha-ref",)
    async with watching(api, tmp_path, GROUP_V1) as (w, tables):
        await eventually(lambda: w.listed, "listed")
        assert tables.last.sources == ("default-ref", "v1-ref")


async def test_llm_d_group_reads_that_resource(api: FakeKubeApi, tmp_path: pathlib.Path) -> None:
    api.add_rewrite("gie", POOL, [exact("m", ("from-gie", None))])
    api.add_rewrite("llmd", POOL, [exact("m", ("from-llmd", None))], resource=LLMD_REWRITES)
    async with watching(api, tmp_path, rewrite_group="llm-d.ai") as (_, tables):
        await eventually(lambda: tables.target("m") == "from-llmd", "the llm-d.ai resource")
        assert tables.last.sources == ("llmd",) and api.list_requests(REWRITES) == []


async def test_a_bad_object_is_skipped_with_a_clear_error_and_the_others_stay(
    api: FakeKubeApi, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "epp.discovery.rewrites")
    api.add_rewrite("good", POOL, [exact("m", ("m-v2", None))])
    # the oldest: it would win "m" if it were valid
    api.add_rewrite("bad", POOL, [exact("m", ("m-v9", 0))], created="2024-01-01T00:00:00Z")
    async with watching(api, tmp_path) as (w, tables):
        await eventually(lambda: tables.target("m") == "m-v2", "the good object applies")
        assert w.errors["invalid_object"] == 1
        [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert record.getMessage() == (
            "InferenceModelRewrite 'bad': spec.rules[0].targets[0].weight must be an integer from 1 to "
            "1000000, got 0; skipped (the other InferenceModelRewrites stay in force)"
        )
        # a relist does not log it again (unchanged), an update of it is read again
        api.end_watches()
        api.add_pod("unrelated", "10.0.0.9", APP)  # the watcher's version falls behind...
        api.compact()  # ...and is compacted: its next watch gets 410
        await eventually(lambda: w.lists == 2, "listed again after 410")
        assert w.errors["invalid_object"] == 1
        api.update_rewrite("bad", rules=[exact("m", ("m-v9", None)), {"targets": []}])
        await eventually(lambda: w.errors["invalid_object"] == 2, "the bad update counted")
        assert "'bad': spec.rules[1].targets must list at least one target" in caplog.records[-1].getMessage()
        assert tables.target("m") == "m-v2"
        api.update_rewrite("bad", rules=[exact("m", ("m-v9", None))])  # fixed: the oldest wins now
        await eventually(lambda: tables.target("m") == "m-v9", "the fixed object applies")
        # a good object broken later is dropped, the rest unaffected
        broken = api.get(REWRITES, "default", "good")
        broken["spec"]["rules"] = [exact("n", ("n-v2", None))]
        broken["spec"]["poolRef"].pop("name")
        api.put_rewrite(broken)
        await eventually(lambda: w.errors["invalid_object"] == 3, "the broken object counted")
        assert "'good': spec.poolRef.name is missing or empty" in caplog.records[-1].getMessage()
        assert tables.target("m") == "m-v9" and tables.target("n") is None


async def test_mixed_weights_are_a_warning(
    api: FakeKubeApi, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "epp.discovery.rewrites")
    api.add_rewrite("mixed", POOL, [exact("m", ("a", 3), ("b", None))])
    async with watching(api, tmp_path) as (w, tables):
        await eventually(lambda: tables.target("m") == "a", "it applies")
        assert w.errors["invalid_object"] == 0
        assert any(
            "'mixed': spec.rules[0].targets: weights are set on some targets only; targets 1 (no weight)"
            in r.getMessage()
            for r in caplog.records
        )


async def test_without_the_crd_it_is_logged_once_and_retried(
    api: FakeKubeApi, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "epp.discovery.rewrites")
    api.rewrite_crd_installed = False
    api.add_rewrite("canary", POOL, [exact("m", ("m-v2", None))])
    observed = Counter[str]()

    class Observer:
        def on_discovery_list(self, resource: str) -> None:
            observed["list"] += 1

        def on_discovery_event(self, resource: str, kind: str) -> None:
            observed[kind] += 1

        def on_discovery_error(self, resource: str, kind: str) -> None:
            observed[kind] += 1

    async with watching(api, tmp_path, observer=Observer()) as (w, tables):
        await eventually(lambda: w.errors["not_found"] >= 3, "retried")
        assert observed["not_found"] == 1  # the metric counts the streak once, not every retry
        assert tables.target("m") is None and not w.listed
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert warnings[0].startswith(
            "inferencemodelrewrites.inference.networking.x-k8s.io/v1alpha2 in namespace default is not "
            "served (is the InferenceModelRewrite CRD installed?): no model rewrites"
        )
        api.rewrite_crd_installed = True
        await eventually(lambda: tables.target("m") == "m-v2", "read once the CRD is served")
        # the CRD removed while watching: no rewrites, until it is back (a new streak, counted again)
        api.rewrite_crd_installed = False
        api.end_watches()
        await eventually(lambda: tables.target("m") is None, "the resource gone: no rewrites")
        assert observed["not_found"] == 2
        api.rewrite_crd_installed = True
        await eventually(lambda: tables.target("m") == "m-v2", "back")


async def test_forbidden_keeps_the_last_rules_and_names_the_rbac(
    api: FakeKubeApi, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, "epp.discovery.rewrites")
    api.add_rewrite("canary", POOL, [exact("m", ("m-v2", None))])
    async with watching(api, tmp_path) as (w, tables):
        await eventually(lambda: tables.target("m") == "m-v2", "listed")
        api.fail_next(403, 4)
        api.end_watches()
        await eventually(lambda: w.errors["forbidden"] == 4, "forbidden, retried")
        assert tables.target("m") == "m-v2"  # the last known rules stay
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1
        assert "needs get/list/watch on inferencemodelrewrites.inference.networking.x-k8s.io" in errors[0]
        api.add_rewrite("later", POOL, [exact("n", ("n-v2", None))])
        await eventually(lambda: tables.target("n") == "n-v2", "recovered")


@pytest.mark.parametrize("gone_as", ["event", "status"])
async def test_gone_lists_again_and_nothing_is_lost(tmp_path: pathlib.Path, gone_as: str) -> None:
    async with FakeKubeApi(gone_as=gone_as) as api:
        api.add_rewrite("a", POOL, [exact("m", ("m-v2", None))])
        async with watching(api, tmp_path) as (w, tables):
            await eventually(lambda: tables.target("m") == "m-v2", "listed")
            await eventually(lambda: api.open_watches == 1, "watching")
            api.end_watches()  # the server ends the watch: resumed from the last version, no list
            await eventually(lambda: len(api.watch_requests(REWRITES)) == 2, "resumed")
            assert w.lists == 1
            api.add_rewrite("b", POOL, [exact("n", ("n-v2", None))])
            await eventually(lambda: tables.target("n") == "n-v2", "an event after the resume")
            api.end_watches()  # the watch ends before it could tell of what follows
            api.delete_rewrite("a")
            api.add_rewrite("c", POOL, [generic("c-base")])
            api.compact()  # the next watch, from before these changes, gets 410
            await eventually(lambda: w.lists == 2, "listed again")
            assert w.errors["gone"] >= 1
            await eventually(lambda: tables.last.sources == ("b", "c"), "relisted")
            assert tables.target("m") == "c-base" and tables.target("n") == "n-v2"
            assert w.events["deleted"] == 0  # learnt from the list, not from an event


async def test_bookmarks_move_the_resume_point(api: FakeKubeApi, tmp_path: pathlib.Path) -> None:
    async with watching(api, tmp_path) as (w, _):
        await eventually(lambda: api.open_watches == 1, "watching")
        assert api.watch_requests(REWRITES)[0]["allowWatchBookmarks"] in ("true", "True")
        api.add_pod("unrelated", "10.0.0.9", APP)  # bumps the resourceVersion
        rv = api.bookmark()
        await eventually(lambda: w.rv == str(rv), "bookmark seen")
        api.end_watches()
        await eventually(lambda: len(api.watch_requests(REWRITES)) == 2, "resumed")
        assert api.watch_requests(REWRITES)[1]["resourceVersion"] == str(rv)


# -- the whole server ---------------------------------------------------------------------------

CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins: [{type: max-score-picker}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: max-score-picker}]}]
"""


async def test_the_server_applies_the_rewrites_and_serves_without_the_crd(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    api.add_pool(POOL, APP, [8000])
    api.add_pod("a", "10.0.0.1", APP)
    api.rewrite_crd_installed = False
    settings = ServerSettings.loopback(
        refresh_metrics_interval=0, pool_name=POOL, discovery=settings_for(api, tmp_path), seed=1
    )
    epp = EppServer(settings, parse_config(CONFIG, "config.yaml"))
    await epp.start()
    watcher = epp.model_rewrites
    assert watcher is not None
    body = json.dumps({"model": "food-review", "prompt": "hi", "max_tokens": 1}).encode()
    try:
        async with aiohttp.ClientSession() as session:

            async def ready() -> bool:
                async with session.get(f"http://127.0.0.1:{epp.metrics_port}/readyz") as resp:
                    return resp.status == 200

            await eventually(lambda: epp.is_ready(), "ready without the rewrite CRD")
            assert await ready()
            assert watcher.errors["not_found"] >= 1
            routed = epp.director.route({}, body)
            assert routed.request.model == "food-review" and routed.body is None
            epp.director.finish(routed, "complete")

            api.rewrite_crd_installed = True
            api.add_rewrite(
                "canary", POOL, [exact("food-review", ("food-review-v1", 90), ("food-review-v2", 10))]
            )
            await eventually(lambda: bool(epp.director.model_rewrites), "the rules reach the director")
            seen = set()
            for _ in range(60):
                routed = epp.director.route({}, body)
                assert routed.incoming_model == "food-review" and routed.body is not None
                assert json.loads(routed.body)["model"] == routed.request.model
                seen.add(routed.request.model)
                epp.director.finish(routed, "complete")
            assert seen == {"food-review-v1", "food-review-v2"}
            assert sum(epp.director.rewrite_decisions.values()) == 60
            assert (
                epp.metrics.registry.get_sample_value("epp_discovery_lists_total", {"resource": REWRITE})
                == watcher.lists
            )
            api.delete_rewrite("canary")
            await eventually(lambda: not epp.director.model_rewrites, "deleted: no rules")
            assert epp.is_ready()
    finally:
        await epp.stop(grace=0.2)
    assert watcher._task is None  # stopped with the server


async def test_readiness_waits_for_the_first_list_of_rewrites(
    api: FakeKubeApi, tmp_path: pathlib.Path
) -> None:
    """A new replica turns ready only once its first attempt to list the rewrites has ended, so its first
    requests follow the rules that exist (the pool listed and synced is not enough)."""
    import asyncio

    from epp.testing.kube_api import REWRITES as REWRITES_RESOURCE

    api.add_pool(POOL, APP, [8000])
    api.add_pod("a", "10.0.0.1", APP)
    api.add_rewrite("canary", POOL, [exact("food-review", ("food-review-v2", None))])
    gate = api.hold_lists[REWRITES_RESOURCE] = asyncio.Event()
    settings = ServerSettings.loopback(
        refresh_metrics_interval=0, pool_name=POOL, discovery=settings_for(api, tmp_path), seed=1
    )
    epp = EppServer(settings, parse_config(CONFIG, "config.yaml"))
    await epp.start()
    try:
        assert epp.discovery is not None
        await epp.discovery.wait_synced()
        await eventually(
            lambda: any("inferencemodelrewrites" in path for path, _ in api.requests), "the rewrites listed"
        )
        await asyncio.sleep(0.3)  # room for the readiness task to run on (it must stay waiting)
        assert not epp.is_ready() and not epp.director.model_rewrites
        gate.set()
        await eventually(lambda: epp.is_ready(), "ready once the rewrites are listed")
        body = json.dumps({"model": "food-review", "prompt": "hi", "max_tokens": 1}).encode()
        routed = epp.director.route({}, body)
        assert routed.request.model == "food-review-v2"
        epp.director.finish(routed, "complete")
    finally:
        await epp.stop(grace=0.2)
