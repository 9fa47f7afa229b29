"""Kubernetes discovery from an `InferencePool` (the asyncio edge): list and watch the pool, and track
the Pods its selector matches (`epp.discovery.tracker.PodTracker`, shared with selector mode).

Two tasks, informer-style. The pool task lists the pool (`fieldSelector=metadata.name=<pool>`, in
the API group `--pool-group` names: `inference.networking.k8s.io/v1` or the older
`inference.networking.x-k8s.io/v1alpha2`), then watches from the list's `resourceVersion`, resuming
after bookmarks and relisting on `410 Gone` as the pod task does; the pod task (the tracker's), started
for the pool's selector and restarted when the selector changes, lists the matching Pods and watches
them. A pool marked for deletion (`metadata.deletionTimestamp`, held by a finalizer) counts as
deleted.

`ready` is whether the pool exists and its pods have been listed; it goes false while the pool is
deleted (or marked for deletion, or its resource is not served) and true again once it exists and its
pods are listed, as the reference EPP's health answers follow its datastore's pool
(`cmd/epp/runner/health.go`). API-server outages do not change it (the last known state stays in
force).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epp.discovery.client import resource_version
from epp.discovery.pool import PoolError, being_deleted, object_name, parse_pool
from epp.discovery.settings import DiscoverySettings
from epp.discovery.tracker import (
    POD,
    POOL,
    DiscoveryObserver,
    PodTracker,
    error_kind,
    log,
)

__all__ = ["POD", "POOL", "DiscoveryObserver", "PoolWatcher", "error_kind"]


class PoolWatcher(PodTracker):
    rbac = "pods and inferencepools"

    def _settings_problem(self, settings: DiscoverySettings) -> str | None:
        if settings.selector_mode:
            return "--endpoint-selector settings read no pool (SelectorWatcher)"
        return super()._settings_problem(settings)

    def _setup(self) -> None:
        settings = self.settings
        self.where = f"{settings.namespace}/{settings.pool_name}"
        self.subject = f"InferencePool {self.where}"
        self.pods_subject = f"pods of InferencePool {self.where}"
        self.pool_rv: str | None = None
        self._missing_logged = False

    def _begin(self) -> None:
        self._spawn(self._pool_loop(), "discovery-pool")

    # -- the pool ---------------------------------------------------------------------------
    async def _pool_loop(self) -> None:
        name = self.settings.pool_name
        await self._list_and_watch(POOL, lambda api: api.pool(name), self._on_pool_list, self._on_pool_event)

    def _on_pool_list(self, items: list[Any], rv: str) -> None:
        self.pool_rv = rv
        found = [o for o in items if object_name(o) == self.settings.pool_name]
        if found:
            self._apply_pool(found[0])
        else:
            self._pool_missing("not found")

    def _on_pool_event(self, kind: str, obj: Mapping[str, Any]) -> None:
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
                "%s: selector %s, target ports %s",
                self.subject,
                spec.label_selector(),
                ",".join(map(str, spec.ports)),
            )
        self._track(spec)

    def _pool_missing(self, why: str, count: bool = True) -> None:
        if not self._missing_logged or self.pool is not None:
            if count:
                self._count_error(POOL, "not_found")
            log.warning("%s %s: no endpoints until it exists", self.subject, why)
        self._missing_logged = True
        self._untrack()

    def _handled(self, resource: str, kind: str, err: Exception, repeated: bool) -> bool:
        if resource != POOL or kind != "not_found":
            return False
        log.error(
            "%s: the API server has no inferencepools.%s/%s (is the CRD installed? "
            "--pool-group picks the API group): %s",
            self.subject,
            self.settings.pool_group,
            self.settings.pool_version,
            err,
        )
        self._pool_missing("unavailable", count=False)
        return True
