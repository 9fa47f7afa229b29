"""The list-then-watch loop every discovery watcher runs (the asyncio edge), and what they share around
it: the settings check, the API client, the list/event/error counts and the failure handling.

`list_and_watch` is one resource's informer-style loop: list, then watch from the list's
`resourceVersion` with bookmarks; when the server ends a watch it is resumed from the last
`resourceVersion` seen (events and bookmarks included), without a new list. `410 Gone` (HTTP status
or `ERROR` event) lists again at once -- a second one in a row without an event between waits for the
backoff first; other errors retry with exponential backoff (bounded), which a successful list resets.

`ListWatcher` is the base of `PodTracker` (`tracker.py`: the pool's pods and selector mode's, and
`PoolWatcher`'s pool) and `ModelRewriteWatcher` (`rewrite_watcher.py`): `_list_and_watch` runs the
loop for one `resource` (the metrics' label), counting lists, events and errors (to the observer as
well) and logging failures; what the objects mean is the subclass's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, Protocol

import aiohttp

from epp.discovery.client import ApiError, Event, Gone, KubeApi, Request, connect, resource_version
from epp.discovery.settings import DiscoverySettings

OnList = Callable[[list[Any], str], None]
OnEvent = Callable[[str, Mapping[str, Any]], None]


class DiscoveryObserver(Protocol):
    """Told about lists, watch events, errors and the endpoint set (e.g. to export metrics)."""

    def on_discovery_list(self, resource: str) -> None: ...

    def on_discovery_event(self, resource: str, kind: str) -> None: ...

    def on_discovery_error(self, resource: str, kind: str) -> None: ...

    def on_discovery_endpoints(self, count: int, synced: bool) -> None: ...


class Backoff:
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


async def list_and_watch(
    list_fn: Callable[[], Awaitable[tuple[list[Any], str]]],
    watch_fn: Callable[[str], AsyncGenerator[Event, None]],
    on_list: OnList,
    on_event: OnEvent,
    on_failed: Callable[[Exception, float], None],
    backoff: Backoff,
) -> None:
    """List (`on_list(items, resourceVersion)`) and watch (`on_event(type, object)` per event, bookmarks
    included) until cancelled. A failure goes to `on_failed(err, the backoff's next delay)`, inside the
    `except` block, then the loop lists again: at once after a first `410 Gone`, else after the backoff."""
    gone_streak = 0
    while True:
        try:
            items, rv = await list_fn()
            backoff.reset()
            on_list(items, rv)
            while True:  # each watch ends at the server's timeout; resume from the last version
                async with contextlib.aclosing(watch_fn(rv)) as stream:
                    async for kind, obj in stream:
                        gone_streak = 0
                        rv = resource_version(obj) or rv
                        on_event(kind, obj)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            gone_streak = gone_streak + 1 if isinstance(err, Gone) else 0
            on_failed(err, backoff.delay)
            if gone_streak == 1:
                continue  # list again at once; twice in a row without an event backs off
            await backoff.sleep()


class ListWatcher:
    """Checked settings, the API client (made by `start`), counts by resource, and the loop."""

    logger = logging.getLogger("epp.discovery")  # where failures are logged (set by the subclass)
    rbac = "pods"  # what the service account must be allowed to get/list/watch, as a 403 names it

    def __init__(self, settings: DiscoverySettings, observer: DiscoveryObserver | None) -> None:
        problem = self._settings_problem(settings)
        if problem is not None:
            raise ValueError(f"discovery: {problem}")
        self.settings = settings
        self.observer = observer
        self._lists: Counter[str] = Counter()  # by resource
        self._events: Counter[tuple[str, str]] = Counter()  # by resource and lowercase type
        self._errors: Counter[tuple[str, str]] = Counter()  # by resource and `error_kind`
        self._api: KubeApi | None = None

    def _settings_problem(self, settings: DiscoverySettings) -> str | None:
        """Why `settings` cannot be watched by this class (None: they can)."""
        return settings.check()

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the credentials (DiscoveryConfigError if unusable) and start watching."""
        if self._api is not None:
            raise RuntimeError(f"{type(self).__name__} already started")
        self._api = KubeApi(await connect(self.settings), self.settings)
        self._begin()

    def _begin(self) -> None:
        """Start the loops (called once the API client exists)."""
        raise NotImplementedError

    async def stop(self) -> None:
        tasks = self._take_tasks()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        api, self._api = self._api, None
        if api is not None:
            await api.close()

    def _take_tasks(self) -> list[asyncio.Task[None]]:
        """The running loops, forgotten (`stop` cancels them)."""
        raise NotImplementedError

    # -- the loop --------------------------------------------------------------------------
    async def _list_and_watch(
        self,
        resource: str,
        request: Callable[[KubeApi], Request],
        on_list: OnList,
        on_event: OnEvent,
    ) -> None:
        """`list_and_watch` of `request(api)`, counted as `resource`: each list and event before
        `on_list` / `on_event`, each failure (and logged) before the backoff."""
        assert self._api is not None
        api = self._api
        call = request(api)

        def listed(items: list[Any], rv: str) -> None:
            self._count_list(resource)
            on_list(items, rv)

        def event(kind: str, obj: Mapping[str, Any]) -> None:
            self._count_event(resource, kind)
            on_event(kind, obj)

        await list_and_watch(
            lambda: api.list_items(call),
            lambda rv: api.watch_events(call, rv),
            listed,
            event,
            lambda err, delay: self._failed(resource, err, delay),
            Backoff(self.settings.backoff_initial, self.settings.backoff_max),
        )

    # -- counts ----------------------------------------------------------------------------
    def _count_list(self, resource: str) -> None:
        self._lists[resource] += 1
        if self.observer is not None:
            self.observer.on_discovery_list(resource)

    def _count_event(self, resource: str, kind: str) -> None:
        self._events[(resource, kind.lower())] += 1
        if self.observer is not None:
            self.observer.on_discovery_event(resource, kind.lower())

    def _count_error(self, resource: str, kind: str, *, observed: bool = True) -> None:
        self._errors[(resource, kind)] += 1
        if observed and self.observer is not None:
            self.observer.on_discovery_error(resource, kind)

    # -- failures --------------------------------------------------------------------------
    def _what(self, resource: str) -> str:
        """What failed, as the log lines name it."""
        raise NotImplementedError

    def _repeats(self, kind: str) -> bool:
        """Whether a failure of `kind` repeats the last one (logged quietly; a 404 or 403 streak is
        observed once). By default no failure is a repeat."""
        return False

    def _handled(self, resource: str, kind: str, err: Exception, repeated: bool) -> bool:
        """A subclass's own handling of a failure (logged and acted on: True), before the generic one."""
        return False

    def _failed(self, resource: str, err: Exception, delay: float) -> None:
        kind = error_kind(err)
        if isinstance(err, ApiError) and err.from_event:
            self._count_event(resource, "ERROR")
        repeated = self._repeats(kind)
        self._count_error(resource, kind, observed=not (repeated and kind in ("not_found", "forbidden")))
        what = self._what(resource)
        if kind == "gone":
            self.logger.info("%s: watch expired (%s); listing again", what, err)
        elif self._handled(resource, kind, err, repeated):
            pass
        elif kind == "forbidden":
            (self.logger.debug if repeated else self.logger.error)(
                "%s: %s; the EPP's service account needs get/list/watch on %s", what, err, self.rbac
            )
        elif kind == "internal":
            self.logger.exception("%s: unexpected error", what)
        else:
            self.logger.warning("%s: %s (%s); retrying in %.2fs", what, err, kind, delay)
