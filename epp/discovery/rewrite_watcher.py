"""Watching `InferenceModelRewrite` objects (the asyncio edge): list and watch them in the pool's
namespace and hand the rule table (`epp.discovery.rewrites`) to `on_change` whenever it changes.

One task, informer-style like the pool watcher (`epp.discovery.watcher`), on the same loop
(`epp.discovery.watch_loop`: backoff, counts, failure logs): list `inferencemodelrewrites` of
`settings.rewrite_group` (`v1alpha2`) in the namespace, then watch from the list's `resourceVersion`
with bookmarks, resuming from the last version seen when the server ends a watch. `410 Gone` lists
again at once (the list replaces what was known). An object marked for deletion
(`metadata.deletionTimestamp`) counts as deleted, as the reference's reconciler has it. Objects naming
another pool are ignored; an object that cannot be used is skipped with an error naming it and the
field, and the table is built from the others.

Rewrites are optional: a `404` (the CRD is not installed) or `401`/`403` (no RBAC for it) is logged
once, then retried with backoff without failing anything; the EPP serves meanwhile (with no rewrites
while the resource is not served; with the last known ones during other API-server errors). Readiness
waits for the first attempt to list them (`wait_settled`: listed, or that attempt failed), so that the
first requests a new replica takes already follow the rules that exist; later failures never change it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from epp.discovery.client import resource_version
from epp.discovery.pool import being_deleted, object_name
from epp.discovery.rewrites import EMPTY, KIND, ModelRewrite, RewriteError, RewriteTable, parse_rewrite
from epp.discovery.settings import REWRITE_PLURAL, REWRITE_VERSION, DiscoverySettings
from epp.discovery.watch_loop import DiscoveryObserver, ListWatcher

log = logging.getLogger("epp.discovery.rewrites")

REWRITE = "modelrewrite"  # the `resource` label of the discovery metrics


@dataclass(frozen=True, slots=True)
class _Known:
    rv: str | None  # the object's resourceVersion when it was read
    rewrite: ModelRewrite | None  # None: another pool's, being deleted, or invalid


class ModelRewriteWatcher(ListWatcher):
    logger = log

    def __init__(
        self,
        settings: DiscoverySettings,
        on_change: Callable[[RewriteTable], None],
        *,
        observer: DiscoveryObserver | None = None,
    ) -> None:
        super().__init__(settings, observer)
        self.on_change = on_change
        self.resource = f"{REWRITE_PLURAL}.{settings.rewrite_group}/{REWRITE_VERSION}"
        group = settings.rewrite_group
        self.rbac = f"{REWRITE_PLURAL}.{group} for model rewrites (the last known ones stay in force)"
        self.table: RewriteTable = EMPTY
        self.known: dict[str, _Known] = {}
        self.rv: str | None = None
        self.listed = False  # listed at least once
        self._listed_event = asyncio.Event()
        self._settled_event = asyncio.Event()  # the first list attempt ended (listed or failed)
        self._last_error: str | None = None  # the kind logged last; the same kind again is logged quietly
        self._task: asyncio.Task[None] | None = None

    @property
    def lists(self) -> int:
        """Lists done."""
        return self._lists[REWRITE]

    @property
    def events(self) -> Counter[str]:
        """Watch events by lowercase type (a snapshot)."""
        return Counter({kind: n for (_, kind), n in self._events.items()})

    @property
    def errors(self) -> Counter[str]:
        """Failures and invalid objects by kind (a snapshot)."""
        return Counter({kind: n for (_, kind), n in self._errors.items()})

    # -- lifecycle -------------------------------------------------------------------------
    def _begin(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="discovery-model-rewrites")

    def _take_tasks(self) -> list[asyncio.Task[None]]:
        task, self._task = self._task, None
        return [] if task is None else [task]

    async def wait_listed(self) -> None:
        await self._listed_event.wait()

    async def wait_settled(self) -> None:
        """Until the first attempt to list the rewrites has ended, in a list or a failure."""
        await self._settled_event.wait()

    def _failed(self, resource: str, err: Exception, delay: float) -> None:
        super()._failed(resource, err, delay)
        self._settled_event.set()

    # -- the loop --------------------------------------------------------------------------
    async def _loop(self) -> None:
        await self._list_and_watch(REWRITE, lambda api: api.rewrites(), self._on_list, self._on_event)

    def _on_list(self, items: list[Any], rv: str) -> None:
        if self._last_error in ("not_found", "forbidden"):
            log.info("%s: served and readable again", self.resource)
        self._last_error = None
        self.rv = rv
        known: dict[str, _Known] = {}
        for obj in items:
            name = object_name(obj)
            if name is None:
                self._count_error(REWRITE, "invalid_object")
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
            self._settled_event.set()
        self._publish()

    def _on_event(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.rv = resource_version(obj) or self.rv
        if kind == "BOOKMARK":
            return
        name = object_name(obj)
        if name is None:
            self._count_error(REWRITE, "invalid_object")
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
            self._count_error(REWRITE, "invalid_object")
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
    def _what(self, resource: str) -> str:
        return f"{self.resource} in namespace {self.settings.namespace}"

    def _repeats(self, kind: str) -> bool:
        # A missing CRD (most clusters) or a Role without the rule is retried every backoff_max seconds for
        # as long as it lasts: the metric counts each such streak once, not every retry.
        repeated, self._last_error = kind == self._last_error, kind
        return repeated

    def _handled(self, resource: str, kind: str, err: Exception, repeated: bool) -> bool:
        if kind != "not_found":
            return False
        self.known.clear()  # the resource is not served: no objects, no rewrites
        self._publish()
        (log.debug if repeated else log.warning)(
            "%s is not served (is the %s CRD installed?): no model rewrites; checking again "
            "every %.0fs at most (%s)",
            self._what(resource),
            KIND,
            self.settings.backoff_max,
            err,
        )
        return True
