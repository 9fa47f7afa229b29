"""Kubernetes discovery (the asyncio edge): list and watch the `InferencePool` and the Pods its
selector matches, and keep the datastore's endpoint set equal to what they describe.

Two tasks, informer-style. The pool task lists the pool (`fieldSelector=metadata.name=<pool>`, in
the API group `--pool-group` names: `inference.networking.k8s.io/v1` or the older
`inference.networking.x-k8s.io/v1alpha2`),
then watches from the list's `resourceVersion`; the pod task, started for the pool's selector and
restarted when the selector changes, lists the matching Pods and watches them the same way. A pool
marked for deletion (`metadata.deletionTimestamp`, held by a finalizer) counts as deleted. Every
watch asks for bookmarks and keeps the latest `resourceVersion` (bookmarks included), so a watch that
the server ends is resumed where it stopped without a list. `410 Gone` (HTTP status or `ERROR` event)
lists again at once; a list replaces the known objects, so nothing is lost or duplicated. Other
errors retry with exponential backoff (bounded), keeping the last known endpoint set meanwhile.

After a change the endpoint set (`epp.discovery.pool.pool_endpoints`) goes to
`Datastore.set_endpoints`; the scraper and the KV-event subscriber follow the datastore, and
`on_change` lets them follow at once instead of at their next reconcile.

`ready` is whether the pool exists and its pods have been listed; it goes false while the pool is
deleted (or marked for deletion, or its resource is not served) and true again once it exists and its
pods are listed, as the reference EPP's health answers follow its datastore's pool
(`cmd/epp/runner/health.go`); `wait_ready_change` lets the server's health service follow it.
API-server outages do not change it (the last known state stays in force).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import aiohttp

from epp.datastore import Datastore
from epp.discovery.client import ApiError, Gone, KubeApi, connect, resource_version
from epp.discovery.pool import (
    PoolError,
    PoolSpec,
    being_deleted,
    object_name,
    parse_pool,
    pool_endpoints,
)
from epp.discovery.settings import DiscoverySettings

log = logging.getLogger("epp.discovery")

POOL, POD = "pool", "pod"


class DiscoveryObserver(Protocol):
    """Told about lists, watch events, errors and the endpoint set (e.g. to export metrics)."""

    def on_discovery_list(self, resource: str) -> None: ...

    def on_discovery_event(self, resource: str, kind: str) -> None: ...

    def on_discovery_error(self, resource: str, kind: str) -> None: ...

    def on_discovery_endpoints(self, count: int, synced: bool) -> None: ...


class _Backoff:
    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self.delay = initial

    def reset(self) -> None:
        self.delay = self.initial

    async def sleep(self) -> None:
        delay, self.delay = self.delay, min(self.delay * 2, self.maximum)
        await asyncio.sleep(delay)


def error_kind(err: BaseException) -> str:
    """The `kind` label of a failed list or watch."""
    if isinstance(err, Gone):
        return "gone"
    if isinstance(err, ApiError):
        if err.status == 0:
            return "bad_response"
        if err.status == 404:
            return "not_found"
        if err.status in (401, 403):
            return "forbidden"
        return "api_error"
    if isinstance(err, (aiohttp.ClientError, OSError, asyncio.TimeoutError)):
        return "unreachable"
    return "internal"


class PoolWatcher:
    def __init__(
        self,
        datastore: Datastore,
        settings: DiscoverySettings,
        *,
        observer: DiscoveryObserver | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        problem = settings.check()
        if problem is not None:
            raise ValueError(f"discovery: {problem}")
        self.datastore = datastore
        self.settings = settings
        self.observer = observer
        self.on_change = on_change
        self.where = f"{settings.namespace}/{settings.pool_name}"
        self.pool: PoolSpec | None = None  # the last valid spec; None while the pool is missing
        self.pods: dict[str, Mapping[str, Any]] = {}
        self.pool_rv: str | None = None
        self.pods_rv: str | None = None
        self.endpoints: list[str] = []
        self.synced = False  # the pool was found and its pods listed at least once
        self._pods_listed = False  # the current pool's pods have been listed (reset when it goes)
        self._was_ready = False
        self.readiness_lost = 0  # how often `ready` went false after having been true
        self._ready_changed = asyncio.Event()
        self.lists: Counter[str] = Counter()
        self.events: Counter[tuple[str, str]] = Counter()
        self.errors: Counter[tuple[str, str]] = Counter()
        self._synced = asyncio.Event()
        self._published = False
        self._missing_logged = False
        self._api: KubeApi | None = None
        self._pool_task: asyncio.Task[None] | None = None
        self._pod_task: asyncio.Task[None] | None = None
        self._pod_selector: tuple[tuple[str, str], ...] | None = None
        self._retired: set[asyncio.Task[None]] = set()

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the credentials (DiscoveryConfigError if unusable) and start watching."""
        if self._api is not None:
            raise RuntimeError("PoolWatcher already started")
        self._api = KubeApi(await connect(self.settings), self.settings)
        self._pool_task = asyncio.create_task(self._pool_loop(), name="discovery-pool")

    async def stop(self) -> None:
        tasks = [t for t in (self._pool_task, self._pod_task, *self._retired) if t is not None]
        self._pool_task = self._pod_task = None
        self._retired.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        api, self._api = self._api, None
        if api is not None:
            await api.close()

    async def wait_synced(self) -> None:
        await self._synced.wait()

    @property
    def ready(self) -> bool:
        """The pool exists (not deleted, not being deleted) and its pods have been listed."""
        return self.pool is not None and self._pods_listed

    async def wait_ready_change(self, current: bool) -> bool:
        """Wait until `ready` is no longer `current`; return the new value."""
        while self.ready == current:
            self._ready_changed.clear()
            await self._ready_changed.wait()
        return self.ready

    # -- the pool ---------------------------------------------------------------------------
    async def _pool_loop(self) -> None:
        assert self._api is not None
        api, name = self._api, self.settings.pool_name
        backoff = _Backoff(self.settings.backoff_initial, self.settings.backoff_max)
        gone_streak = 0
        while True:
            try:
                items, rv = await api.list_pool(name)
                self._listed(POOL, backoff)
                self.pool_rv = rv
                found = [o for o in items if object_name(o) == name]
                if found:
                    self._apply_pool(found[0])
                else:
                    self._pool_missing("not found")
                while True:  # each watch ends at the server's timeout; resume from the last version
                    async with contextlib.aclosing(api.watch_pool(name, self.pool_rv)) as stream:
                        async for kind, obj in stream:
                            gone_streak = 0
                            self._on_pool_event(kind, obj)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                gone_streak = gone_streak + 1 if isinstance(err, Gone) else 0
                await self._failed(POOL, err, backoff, gone_streak)

    def _on_pool_event(self, kind: str, obj: Mapping[str, Any]) -> None:
        self._count_event(POOL, kind)
        self.pool_rv = resource_version(obj) or self.pool_rv
        if kind == "BOOKMARK" or object_name(obj) != self.settings.pool_name:
            return
        if kind == "DELETED":
            self._pool_missing("deleted")
        else:
            self._apply_pool(obj)

    def _apply_pool(self, obj: Mapping[str, Any]) -> None:
        if being_deleted(obj):  # held by a finalizer: as good as gone (the reference clears its store)
            self._pool_missing("is being deleted (metadata.deletionTimestamp is set)")
            return
        self._missing_logged = False
        try:
            spec = parse_pool(obj, self.settings.pool_group)
        except PoolError as err:
            self._count_error(POOL, "invalid_object")
            log.error(
                "%s; %s",
                err,
                "keeping the last valid spec" if self.pool else "no endpoints until it is fixed",
            )
            self._publish()
            return
        if spec != self.pool:
            log.info(
                "InferencePool %s: selector %s, target ports %s",
                self.where,
                spec.label_selector(),
                ",".join(map(str, spec.ports)),
            )
        self.pool = spec
        if self._pod_selector != spec.selector or self._pod_task is None:
            self._restart_pods(spec)
        self._publish()

    def _pool_missing(self, why: str, count: bool = True) -> None:
        if not self._missing_logged or self.pool is not None:
            if count:
                self._count_error(POOL, "not_found")
            log.warning("InferencePool %s %s: no endpoints until it exists", self.where, why)
        self._missing_logged = True
        self.pool = None
        self._pods_listed = False
        self._retire_pods()
        self.pods.clear()
        self.pods_rv = None
        self._publish()

    # -- the pods ---------------------------------------------------------------------------
    def _restart_pods(self, spec: PoolSpec) -> None:
        """Watch the pods of a new selector. The known pods stay until the new list replaces them
        (the selector is applied again when mapping), so pods both selectors match never leave."""
        self._retire_pods()
        self._pod_selector = spec.selector
        self._pod_task = asyncio.create_task(self._pod_loop(spec.label_selector()), name="discovery-pods")

    def _retire_pods(self) -> None:
        task, self._pod_task = self._pod_task, None
        self._pod_selector = None
        if task is not None and not task.done():
            task.cancel()
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)

    async def _pod_loop(self, selector: str) -> None:
        assert self._api is not None
        api = self._api
        backoff = _Backoff(self.settings.backoff_initial, self.settings.backoff_max)
        gone_streak = 0
        while True:
            try:
                items, rv = await api.list_pods(selector)
                self._listed(POD, backoff)
                pods: dict[str, Mapping[str, Any]] = {}
                for obj in items:
                    name = object_name(obj)
                    if name is None:
                        self._count_error(POD, "invalid_object")
                        log.warning("pod list for %s: an item without metadata.name, ignored", self.where)
                    else:
                        pods[name] = obj
                self.pods, self.pods_rv = pods, rv
                self._pods_listed = self.pool is not None
                if not self.synced and self.pool is not None:
                    self.synced = True
                    self._synced.set()
                    log.info("InferencePool %s synced: %d pods listed", self.where, len(pods))
                self._publish(force_report=True)
                while True:
                    async with contextlib.aclosing(api.watch_pods(selector, self.pods_rv)) as stream:
                        async for kind, obj in stream:
                            gone_streak = 0
                            self._on_pod_event(kind, obj)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                gone_streak = gone_streak + 1 if isinstance(err, Gone) else 0
                await self._failed(POD, err, backoff, gone_streak)

    def _on_pod_event(self, kind: str, obj: Mapping[str, Any]) -> None:
        self._count_event(POD, kind)
        self.pods_rv = resource_version(obj) or self.pods_rv
        if kind == "BOOKMARK":
            return
        name = object_name(obj)
        if name is None:
            self._count_error(POD, "invalid_object")
            log.warning("pod watch for %s: a %s event without metadata.name, ignored", self.where, kind)
            return
        if kind == "DELETED":
            self.pods.pop(name, None)
        else:
            self.pods[name] = obj
        self._publish()

    # -- shared -----------------------------------------------------------------------------
    def _publish(self, force_report: bool = False) -> None:
        """Hand the endpoint set to the datastore when it changed (and tell readiness when it changed)."""
        self._note_readiness()
        endpoints = pool_endpoints(self.pool, self.pods.values()) if self.pool is not None else []
        if endpoints == self.endpoints and self._published:
            if force_report and self.observer is not None:
                self.observer.on_discovery_endpoints(len(endpoints), self.synced)
            return
        self._published = True
        added, removed = self.datastore.set_endpoints((ep, None) for ep in endpoints)
        self.endpoints = endpoints
        if added or removed:
            log.info(
                "InferencePool %s: %d endpoints (added %s, removed %s)",
                self.where,
                len(endpoints),
                ",".join(sorted(added)) or "none",
                ",".join(sorted(removed)) or "none",
            )
        if self.observer is not None:
            self.observer.on_discovery_endpoints(len(endpoints), self.synced)
        if (added or removed) and self.on_change is not None:
            try:
                self.on_change()
            except Exception:
                log.exception("discovery: endpoint-set listener failed")

    def _note_readiness(self) -> None:
        ready = self.ready
        if ready == self._was_ready:
            return
        self._was_ready = ready
        self._ready_changed.set()
        if not ready:  # only after having been ready: it starts not ready
            log.warning("InferencePool %s is gone: not ready until it exists again", self.where)
        elif self.readiness_lost:
            log.info("InferencePool %s exists again and its pods are listed: ready", self.where)
        self.readiness_lost += not ready

    def _listed(self, resource: str, backoff: _Backoff) -> None:
        backoff.reset()
        self.lists[resource] += 1
        if self.observer is not None:
            self.observer.on_discovery_list(resource)

    def _count_event(self, resource: str, kind: str) -> None:
        self.events[(resource, kind.lower())] += 1
        if self.observer is not None:
            self.observer.on_discovery_event(resource, kind.lower())

    def _count_error(self, resource: str, kind: str) -> None:
        self.errors[(resource, kind)] += 1
        if self.observer is not None:
            self.observer.on_discovery_error(resource, kind)

    async def _failed(self, resource: str, err: Exception, backoff: _Backoff, gone_streak: int) -> None:
        kind = error_kind(err)
        if isinstance(err, ApiError) and err.from_event:
            self._count_event(resource, "ERROR")
        self._count_error(resource, kind)
        what = "InferencePool" if resource == POOL else "pods of InferencePool"
        if kind == "gone":
            log.info("%s %s: watch expired (%s); listing again", what, self.where, err)
            if gone_streak <= 1:
                return  # list again at once; twice in a row without an event backs off
        elif resource == POOL and kind == "not_found":
            log.error(
                "InferencePool %s: the API server has no inferencepools.%s/%s (is the CRD installed? "
                "--pool-group picks the API group): %s",
                self.where,
                self.settings.pool_group,
                self.settings.pool_version,
                err,
            )
            self._pool_missing("unavailable", count=False)
        elif kind == "forbidden":
            log.error(
                "%s %s: %s; the EPP's service account needs get/list/watch on pods and inferencepools",
                what,
                self.where,
                err,
            )
        elif kind == "internal":
            log.exception("%s %s: unexpected error", what, self.where)
        else:
            log.warning("%s %s: %s (%s); retrying in %.2fs", what, self.where, err, kind, backoff.delay)
        await backoff.sleep()
