"""Watching `InferenceModelRewrite` objects (the asyncio edge): list and watch them in the pool's
namespace and hand the rule table (`epp.discovery.rewrites`) to `on_change` whenever it changes.

One task, informer-style like the pool watcher (`epp.discovery.watcher`): list
`inferencemodelrewrites` of `settings.rewrite_group` (`v1alpha2`) in the namespace, then watch from the
list's `resourceVersion` with bookmarks, resuming from the last version seen when the server ends a
watch. `410 Gone` lists again at once (the list replaces what was known). An object marked for deletion
(`metadata.deletionTimestamp`) counts as deleted, as the reference's reconciler has it. Objects naming
another pool are ignored; an object that cannot be used is skipped with an error naming it and the
field, and the table is built from the others.

Rewrites are optional: a `404` (the CRD is not installed) or `401`/`403` (no RBAC for it) is logged
once, then retried with backoff without failing anything; the EPP serves meanwhile (with no rewrites
while the resource is not served; with the last known ones during other API-server errors). They
never change readiness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from epp.discovery.client import ApiError, Gone, KubeApi, connect, resource_version
from epp.discovery.pool import being_deleted, object_name
from epp.discovery.rewrites import EMPTY, KIND, ModelRewrite, RewriteError, RewriteTable, parse_rewrite
from epp.discovery.settings import REWRITE_PLURAL, REWRITE_VERSION, DiscoverySettings
from epp.discovery.watcher import DiscoveryObserver, _Backoff, error_kind

log = logging.getLogger("epp.discovery.rewrites")

REWRITE = "modelrewrite"  # the `resource` label of the discovery metrics


@dataclass(frozen=True, slots=True)
class _Known:
    rv: str | None  # the object's resourceVersion when it was read
    rewrite: ModelRewrite | None  # None: another pool's, being deleted, or invalid


class ModelRewriteWatcher:
    def __init__(
        self,
        settings: DiscoverySettings,
        on_change: Callable[[RewriteTable], None],
        *,
        observer: DiscoveryObserver | None = None,
    ) -> None:
        problem = settings.check()
        if problem is not None:
            raise ValueError(f"discovery: {problem}")
        self.settings = settings
        self.on_change = on_change
        self.observer = observer
        self.resource = f"{REWRITE_PLURAL}.{settings.rewrite_group}/{REWRITE_VERSION}"
        self.table: RewriteTable = EMPTY
        self.known: dict[str, _Known] = {}
        self.rv: str | None = None
        self.listed = False  # listed at least once
        self.lists = 0
        self.events: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self._listed_event = asyncio.Event()
        self._last_error: str | None = None  # the kind logged last; the same kind again is logged quietly
        self._api: KubeApi | None = None
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the credentials (DiscoveryConfigError if unusable) and start watching."""
        if self._api is not None:
            raise RuntimeError("ModelRewriteWatcher already started")
        self._api = KubeApi(await connect(self.settings), self.settings)
        self._task = asyncio.create_task(self._loop(), name="discovery-model-rewrites")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        api, self._api = self._api, None
        if api is not None:
            await api.close()

    async def wait_listed(self) -> None:
        await self._listed_event.wait()

    # -- the loop --------------------------------------------------------------------------
    async def _loop(self) -> None:
        assert self._api is not None
        api = self._api
        backoff = _Backoff(self.settings.backoff_initial, self.settings.backoff_max)
        gone_streak = 0
        while True:
            try:
                items, rv = await api.list_rewrites()
                self._on_list(items, rv, backoff)
                while True:  # each watch ends at the server's timeout; resume from the last version
                    async with contextlib.aclosing(api.watch_rewrites(self.rv or rv)) as stream:
                        async for kind, obj in stream:
                            gone_streak = 0
                            self._on_event(kind, obj)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                gone_streak = gone_streak + 1 if isinstance(err, Gone) else 0
                await self._failed(err, backoff, gone_streak)

    def _on_list(self, items: list[Any], rv: str, backoff: _Backoff) -> None:
        backoff.reset()
        self.lists += 1
        if self.observer is not None:
            self.observer.on_discovery_list(REWRITE)
        if self._last_error in ("not_found", "forbidden"):
            log.info("%s: served and readable again", self.resource)
        self._last_error = None
        self.rv = rv
        known: dict[str, _Known] = {}
        for obj in items:
            name = object_name(obj)
            if name is None:
                self._count_error("invalid_object")
                log.error("%s list: an item without metadata.name, skipped", self.resource)
                continue
            old = self.known.get(name)
            obj_rv = resource_version(obj)
            if old is not None and obj_rv is not None and old.rv == obj_rv:
                known[name] = old  # unchanged since it was read: not parsed (nor logged) again
            else:
                known[name] = self._read(name, obj)
        self.known = known
        if not self.listed:
            self.listed = True
            self._listed_event.set()
        self._publish()

    def _on_event(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.events[kind.lower()] += 1
        if self.observer is not None:
            self.observer.on_discovery_event(REWRITE, kind.lower())
        self.rv = resource_version(obj) or self.rv
        if kind == "BOOKMARK":
            return
        name = object_name(obj)
        if name is None:
            self._count_error("invalid_object")
            log.error("%s watch: a %s event without metadata.name, skipped", self.resource, kind)
            return
        if kind == "DELETED":
            self.known.pop(name, None)
        else:
            self.known[name] = self._read(name, obj)
        self._publish()

    def _read(self, name: str, obj: Mapping[str, Any]) -> _Known:
        rv = resource_version(obj)
        if being_deleted(obj):
            return _Known(rv, None)
        try:
            rewrite = parse_rewrite(obj, self.settings.pool_name, self.settings.pool_group)
        except RewriteError as err:
            self._count_error("invalid_object")
            log.error("%s; skipped (the other %ss stay in force)", err, KIND)
            return _Known(rv, None)
        if rewrite is None:
            log.debug("%s %r is for another pool, ignored", KIND, name)
        else:
            for warning in rewrite.warnings:
                log.warning("%s", warning)
        return _Known(rv, rewrite)

    def _publish(self) -> None:
        table = RewriteTable.build(k.rewrite for k in self.known.values() if k.rewrite is not None)
        if table == self.table:
            return
        self.table = table
        models = sorted(table.exact)
        log.info(
            "model rewrites for InferencePool %s/%s: %s%s (from %s)",
            self.settings.namespace,
            self.settings.pool_name,
            ", ".join(models) if models else "no exact models",
            f"; every other model by {table.generic.source!r}" if table.generic is not None else "",
            ", ".join(table.sources) or "no objects",
        )
        try:
            self.on_change(table)
        except Exception:
            log.exception("model rewrites: the listener failed")

    # -- errors ----------------------------------------------------------------------------
    def _count_error(self, kind: str, *, observed: bool = True) -> None:
        self.errors[kind] += 1
        if observed and self.observer is not None:
            self.observer.on_discovery_error(REWRITE, kind)

    async def _failed(self, err: Exception, backoff: _Backoff, gone_streak: int) -> None:
        kind = error_kind(err)
        if isinstance(err, ApiError) and err.from_event:
            self.events["error"] += 1
            if self.observer is not None:
                self.observer.on_discovery_event(REWRITE, "error")
        repeated = kind == self._last_error
        # A missing CRD (most clusters) or a Role without the rule is retried every backoff_max seconds for
        # as long as it lasts: the metric counts each such streak once, not every retry.
        self._count_error(kind, observed=not (repeated and kind in ("not_found", "forbidden")))
        self._last_error = kind
        where = f"{self.resource} in namespace {self.settings.namespace}"
        if kind == "gone":
            log.info("%s: watch expired (%s); listing again", where, err)
            if gone_streak <= 1:
                return  # list again at once; twice in a row without an event backs off
        elif kind == "not_found":
            self.known.clear()  # the resource is not served: no objects, no rewrites
            self._publish()
            (log.debug if repeated else log.warning)(
                "%s is not served (is the %s CRD installed?): no model rewrites; checking again "
                "every %.0fs at most (%s)",
                where,
                KIND,
                self.settings.backoff_max,
                err,
            )
        elif kind == "forbidden":
            (log.debug if repeated else log.error)(
                "%s: %s; the EPP's service account needs get/list/watch on %s.%s for model rewrites "
                "(the last known ones stay in force)",
                where,
                err,
                REWRITE_PLURAL,
                self.settings.rewrite_group,
            )
        elif kind == "internal":
            log.exception("%s: unexpected error", where)
        else:
            log.warning("%s: %s (%s); retrying in %.2fs", where, err, kind, backoff.delay)
        await backoff.sleep()
