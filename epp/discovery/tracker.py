"""The pods one label selector matches in one namespace -> the datastore's endpoint set (the asyncio
edge shared by both discovery modes).

`PodTracker` lists the Pods of a `PoolSpec` (a selector and target ports) and watches them from the
list's `resourceVersion`, informer-style: every watch asks for bookmarks and keeps the latest
`resourceVersion` (bookmarks included), so a watch that the server ends is resumed where it stopped
without a list. `410 Gone` (HTTP status or `ERROR` event) lists again at once; a list replaces the
known pods, so nothing is lost or duplicated. Other errors retry with exponential backoff (bounded),
keeping the last known endpoint set meanwhile. The loop itself, its backoff, counts and failure logs
are `ListWatcher`'s (`watch_loop.py`, shared with the rewrite watcher); the pods' list and events are
handled here.

Who decides the spec is the subclass: `PoolWatcher` (`watcher.py`) reads it from an InferencePool
and calls `_track` / `_untrack` as the pool changes or goes; `SelectorWatcher`
(`selector_watcher.py`) tracks the fixed `--endpoint-selector` / `--endpoint-target-ports` from the
start. After a change the endpoint set (`epp.discovery.pool.pool_endpoint_names`) goes to
`Datastore.set_endpoints`; `on_change` lets the scraper and KV-event subscriber follow at once.

`ready` is whether a spec is tracked and its pods have been listed; `wait_ready_change` lets the
server's health service follow it. API-server outages do not change it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from epp.datastore import Datastore
from epp.discovery.client import resource_version
from epp.discovery.pool import PoolSpec, object_name, pool_endpoint_names
from epp.discovery.selector import LabelSelector
from epp.discovery.settings import DiscoverySettings
from epp.discovery.watch_loop import DiscoveryObserver, ListWatcher, error_kind

log = logging.getLogger("epp.discovery")

POOL, POD = "pool", "pod"

__all__ = ["POD", "POOL", "DiscoveryObserver", "PodTracker", "error_kind", "log"]


class PodTracker(ListWatcher):
    subject = "discovery"  # who the endpoints come from, in logs (set by the subclass)
    pods_subject = "pods"  # the same for the pods' list and watch
    logger = log

    def __init__(
        self,
        datastore: Datastore,
        settings: DiscoverySettings,
        *,
        observer: DiscoveryObserver | None = None,
        on_change: Callable[[set[str]], None] | None = None,
    ) -> None:
        """`on_change(removed)`: the endpoint set changed; `removed` are the ids that left it."""
        super().__init__(settings, observer)
        self.datastore = datastore
        self.on_change = on_change
        self.pool: PoolSpec | None = None  # the spec the pods are selected by; None: none (yet)
        self.pods: dict[str, Mapping[str, Any]] = {}
        self.pods_rv: str | None = None
        self.endpoints: list[str] = []
        self.names: dict[str, str] = {}
        self.synced = False  # a spec was tracked and its pods listed at least once
        self._pods_listed = False  # the current spec's pods have been listed (reset by `_untrack`)
        self._was_ready = False
        self.readiness_lost = 0  # how often `ready` went false after having been true
        self._ready_changed = asyncio.Event()
        self._synced = asyncio.Event()
        self._published = False
        self._tasks: list[asyncio.Task[None]] = []  # the subclass's own loops
        self._pod_task: asyncio.Task[None] | None = None
        self._pod_selector: LabelSelector | None = None
        self._retired: set[asyncio.Task[None]] = set()
        self._setup()

    def _setup(self) -> None:
        """The subclass's own state, once the settings are checked."""

    @property
    def lists(self) -> Counter[str]:
        """Lists done, by resource (`pool`, `pod`)."""
        return self._lists

    @property
    def events(self) -> Counter[tuple[str, str]]:
        """Watch events, by resource and lowercase type."""
        return self._events

    @property
    def errors(self) -> Counter[tuple[str, str]]:
        """Failures and invalid objects, by resource and kind."""
        return self._errors

    # -- lifecycle -------------------------------------------------------------------------
    def _begin(self) -> None:
        """Start what decides the spec (called once the API client exists)."""
        raise NotImplementedError

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))

    def _take_tasks(self) -> list[asyncio.Task[None]]:
        tasks = [t for t in (*self._tasks, self._pod_task, *self._retired) if t is not None]
        self._tasks = []
        self._pod_task = None
        self._retired.clear()
        return tasks

    async def wait_synced(self) -> None:
        await self._synced.wait()

    @property
    def ready(self) -> bool:
        """A spec is tracked (the pool exists; always in selector mode) and its pods have been listed."""
        return self.pool is not None and self._pods_listed

    async def wait_ready_change(self, current: bool) -> bool:
        """Wait until `ready` is no longer `current`; return the new value."""
        while self.ready == current:
            self._ready_changed.clear()
            await self._ready_changed.wait()
        return self.ready

    # -- the spec ---------------------------------------------------------------------------
    def _track(self, spec: PoolSpec) -> None:
        """Select the pods by `spec` from now on: a new selector restarts the pod watch; the known
        pods stay until the new list replaces them (the selector is applied again when mapping), so
        pods both selectors match never leave."""
        self.pool = spec
        if self._pod_selector != spec.selector or self._pod_task is None:
            self._retire_pods()
            self._pod_selector = spec.selector
            self._pod_task = asyncio.create_task(self._pod_loop(spec.label_selector()), name="discovery-pods")
        self._publish()

    def _untrack(self) -> None:
        """No spec any more (the pool is gone): no pods, no endpoints, not ready."""
        self.pool = None
        self._pods_listed = False
        self._retire_pods()
        self.pods.clear()
        self.pods_rv = None
        self._publish()

    def _retire_pods(self) -> None:
        task, self._pod_task = self._pod_task, None
        self._pod_selector = None
        if task is not None and not task.done():
            task.cancel()
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)

    # -- the pods ---------------------------------------------------------------------------
    async def _pod_loop(self, selector: str) -> None:
        await self._list_and_watch(POD, lambda api: api.pods(selector), self._on_pod_list, self._on_pod_event)

    def _on_pod_list(self, items: list[Any], rv: str) -> None:
        pods: dict[str, Mapping[str, Any]] = {}
        for obj in items:
            name = object_name(obj)
            if name is None:
                self._count_error(POD, "invalid_object")
                log.warning("pod list of %s: an item without metadata.name, ignored", self.subject)
            else:
                pods[name] = obj
        self.pods, self.pods_rv = pods, rv
        self._pods_listed = self.pool is not None
        if not self.synced and self.pool is not None:
            self.synced = True
            self._synced.set()
            log.info("%s synced: %d pods listed", self.subject, len(pods))
        self._publish(force_report=True)

    def _on_pod_event(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.pods_rv = resource_version(obj) or self.pods_rv
        if kind == "BOOKMARK":
            return
        name = object_name(obj)
        if name is None:
            self._count_error(POD, "invalid_object")
            log.warning("pod watch of %s: a %s event without metadata.name, ignored", self.subject, kind)
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
        names = pool_endpoint_names(self.pool, self.pods.values()) if self.pool is not None else {}
        endpoints = sorted(names)
        if endpoints == self.endpoints and names == self.names and self._published:
            if force_report and self.observer is not None:
                self.observer.on_discovery_endpoints(len(endpoints), self.synced)
            return
        self._published = True
        added, removed = self.datastore.set_endpoints((ep, None) for ep in endpoints)
        self.datastore.set_names(names)
        self.endpoints, self.names = endpoints, names
        if added or removed:
            log.info(
                "%s: %d endpoints (added %s, removed %s)",
                self.subject,
                len(endpoints),
                ",".join(sorted(added)) or "none",
                ",".join(sorted(removed)) or "none",
            )
        if self.observer is not None:
            self.observer.on_discovery_endpoints(len(endpoints), self.synced)
        if (added or removed) and self.on_change is not None:
            try:
                self.on_change(removed)
            except Exception:
                log.exception("discovery: endpoint-set listener failed")

    def _note_readiness(self) -> None:
        ready = self.ready
        if ready == self._was_ready:
            return
        self._was_ready = ready
        self._ready_changed.set()
        if not ready:  # only after having been ready: it starts not ready
            log.warning("%s is gone: not ready until it exists again", self.subject)
        elif self.readiness_lost:
            log.info("%s exists again and its pods are listed: ready", self.subject)
        self.readiness_lost += not ready

    def _what(self, resource: str) -> str:
        return self.subject if resource == POOL else self.pods_subject
