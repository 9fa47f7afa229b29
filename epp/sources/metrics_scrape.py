"""Scrape every endpoint's `/metrics` into the datastore (the asyncio + aiohttp edge).

One task per endpoint, so a hung endpoint only ever delays itself (and only up to `timeout`); a
ticker reconciles the tasks with the datastore's endpoint set every `interval`. All requests share
one `aiohttp.ClientSession` whose keep-alive pool holds about one connection per endpoint (each
task scrapes sequentially); its total size is unlimited so hung endpoints cannot starve the others.
Scrapes start on a fixed grid of `interval` seconds (not interval + scrape time); ticks missed by a
slow scrape are skipped rather than bunched up. The body is requested uncompressed: on a cluster
network, gunzipping a page every 50 ms costs the EPP more CPU than the bytes are worth.

Failures (kinds "timeout", "connect", "http_status", "parse") go to
`Datastore.record_scrape_failure`, which marks the endpoint unhealthy after its threshold; the next
success (`record_metrics`) makes it healthy again. Logging is per endpoint and on changes only: the
first failure of a streak or a change of error kind (at most once per `log_every` seconds), the
transition to unhealthy, and the recovery.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from epp.clock import Clock
from epp.datastore import Datastore
from epp.sources.metrics_text import MetricsParseError, parse_metrics
from epp.types import EndpointId

__all__ = ["MetricsScraper", "ScrapeObserver", "endpoint_url"]

log = logging.getLogger(__name__)

_HEADERS = {
    "Accept": "text/plain;version=0.0.4;q=1.0, */*;q=0.1",
    "Accept-Encoding": "identity",
    "User-Agent": "epp-metrics-scraper",
}


_PARSE_INLINE_BYTES = 512 * 1024
"""Pages larger than this are parsed in a worker thread: parsing takes ~50 ns a byte, and a page of
megabytes would hold up every request for that long (the thread shares the interpreter, but the loop
keeps getting its turns)."""


class ScrapeObserver(Protocol):
    """Told about every scrape, e.g. to export scrape counters and latency."""

    def on_scrape(self, endpoint_id: str, ok: bool, error_kind: str | None, seconds: float) -> None: ...


class _ScrapeError(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


@dataclass(slots=True)
class _Streak:
    """Per-endpoint failure state, used to keep logging to state changes."""

    failures: int = 0
    kind: str | None = None
    unhealthy: bool = False
    last_log_at: float = -math.inf


def endpoint_url(scheme: str, endpoint_id: EndpointId, path: str, port: int | None = None) -> str:
    """`ip:port` (IPv6 bracketed or not) plus path -> URL; `port`: that port instead of the endpoint's."""
    host, sep, own = endpoint_id.rpartition(":")
    if not sep:
        host, own = endpoint_id, ""
    if port is not None:
        own = str(port)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{own}{path}" if own else f"{scheme}://{host}{path}"


class MetricsScraper:
    max_body_bytes: int = 16 * 1024 * 1024
    """A larger response is a "parse" failure (a metrics page is tens of kilobytes)."""
    log_every: float = 30.0
    """Seconds between repeated failure log lines of one endpoint (health transitions always log)."""

    def __init__(
        self,
        datastore: Datastore,
        clock: Clock,
        *,
        interval: float,
        timeout: float,
        path: str = "/metrics",
        scheme: str = "http",
        port: int | None = None,
        verify_tls: bool = True,
        observer: ScrapeObserver | None = None,
    ) -> None:
        """`port`: scrape that port of every endpoint instead of its serving port; `verify_tls`: check the
        engines' certificates on https (the reference EPP skips it by default)."""
        if not (math.isfinite(interval) and interval > 0):
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self._datastore = datastore
        self._clock = clock
        self._interval = interval
        self._timeout = timeout
        self._request_timeout = aiohttp.ClientTimeout(total=timeout)
        self._path = path if path.startswith("/") else "/" + path
        self._scheme = scheme
        self._port = port
        self._verify_tls = verify_tls
        self._observer = observer
        self._observer_failed = False
        self._session: aiohttp.ClientSession | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._tasks: dict[EndpointId, asyncio.Task[None]] = {}
        self._retired: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> bool:
        return self._session is not None

    @property
    def scraping(self) -> frozenset[EndpointId]:
        """Endpoints that currently have a live scrape task."""
        return frozenset(eid for eid, task in self._tasks.items() if not task.done())

    async def __aenter__(self) -> MetricsScraper:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._session is not None:
            raise RuntimeError("MetricsScraper already started")
        connector = aiohttp.TCPConnector(
            limit=0,
            keepalive_timeout=max(30.0, 4 * self._interval),
            ssl=self._verify_tls,  # True: aiohttp's default (verifying) context
        )
        self._session = aiohttp.ClientSession(
            connector=connector, headers=_HEADERS, timeout=self._request_timeout
        )
        self.sync()
        self._ticker = asyncio.create_task(self._tick(), name="metrics-scrape-sync")

    async def stop(self) -> None:
        """Cancel and await every task, then close the session. Idempotent."""
        session, self._session = self._session, None  # from here on sync() is a no-op
        if session is None:
            return
        tasks = [*self._tasks.values(), *self._retired]
        if self._ticker is not None:
            tasks.append(self._ticker)
        self._tasks.clear()
        self._retired.clear()
        self._ticker = None
        for task in tasks:
            task.cancel()
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await session.close()

    def sync(self) -> tuple[set[EndpointId], set[EndpointId]]:
        """Match the scrape tasks to the datastore's endpoints; returns (started, stopped) ids."""
        session = self._session
        if session is None:
            return set(), set()
        wanted = set(self._datastore.ids())
        stopped: set[EndpointId] = set()
        for eid in [eid for eid in self._tasks if eid not in wanted]:
            task = self._tasks.pop(eid)
            stopped.add(eid)
            if task.done():
                self._reap(eid, task)
            else:
                task.cancel()
                self._retired.add(task)
                task.add_done_callback(self._retired.discard)
        started: set[EndpointId] = set()
        for eid in wanted:
            old = self._tasks.get(eid)
            if old is not None and not old.done():
                continue
            if old is not None:
                self._reap(eid, old)  # it crashed, or saw itself removed just before a re-add
            else:
                started.add(eid)
            self._tasks[eid] = asyncio.create_task(self._run(eid, session), name=f"metrics-scrape:{eid}")
        return started, stopped

    # -- tasks -----------------------------------------------------------------------------
    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                self.sync()
            except Exception:
                log.exception("metrics scraper: reconciling endpoints failed")

    async def _run(self, eid: EndpointId, session: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        url = endpoint_url(self._scheme, eid, self._path, self._port)
        streak = _Streak()
        next_at = loop.time()
        while self._datastore.get(eid) is not None:
            await self._scrape(eid, url, session, streak)
            next_at += self._interval
            now = loop.time()
            if next_at < now:  # the scrape overran: skip the missed ticks, keep the grid
                next_at += math.ceil((now - next_at) / self._interval) * self._interval
            await asyncio.sleep(next_at - now)

    async def _scrape(
        self, eid: EndpointId, url: str, session: aiohttp.ClientSession, streak: _Streak
    ) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            body = await self._fetch(session, url)
            text = body.decode("utf-8", "replace")
            if len(body) > _PARSE_INLINE_BYTES:  # (a vLLM page is ~10-100 KB) big ones: off the event loop
                snapshot = await asyncio.to_thread(parse_metrics, text, self._clock.now())
            else:
                snapshot = parse_metrics(text, self._clock.now())
        except _ScrapeError as exc:
            kind, detail = exc.kind, exc.detail
        except TimeoutError:
            kind, detail = "timeout", f"no complete response within {self._timeout:g}s"
        except (aiohttp.ClientError, OSError) as exc:
            kind, detail = "connect", str(exc) or type(exc).__name__
        except MetricsParseError as exc:
            kind, detail = "parse", str(exc)
        else:
            self._datastore.record_metrics(eid, snapshot)
            self._succeeded(eid, streak)
            self._observe(eid, True, None, loop.time() - started)
            return
        self._failed(eid, streak, kind, detail, loop.time())
        self._observe(eid, False, kind, loop.time() - started)

    async def _fetch(self, session: aiohttp.ClientSession, url: str) -> bytes:
        async with session.get(url, timeout=self._request_timeout, allow_redirects=False) as resp:
            if resp.status != 200:
                raise _ScrapeError("http_status", f"HTTP {resp.status} {resp.reason or ''}".rstrip())
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_any():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise _ScrapeError("parse", f"response larger than {self.max_body_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

    # -- bookkeeping -----------------------------------------------------------------------
    def _succeeded(self, eid: EndpointId, streak: _Streak) -> None:
        if streak.failures == 0:
            return
        if streak.unhealthy:
            log.info("endpoint %s healthy again: metrics scrape ok after %d failures", eid, streak.failures)
        else:
            log.debug("metrics scrape of %s ok after %d failures", eid, streak.failures)
        streak.failures, streak.kind, streak.unhealthy = 0, None, False

    def _failed(self, eid: EndpointId, streak: _Streak, kind: str, detail: str, now: float) -> None:
        error = f"{kind}: {detail}"
        streak.failures += 1
        if self._datastore.record_scrape_failure(eid, error):
            streak.unhealthy = True
            streak.last_log_at = now
            log.warning(
                "endpoint %s unhealthy after %d failed metrics scrapes: %s", eid, streak.failures, error
            )
        elif kind != streak.kind and now - streak.last_log_at >= self.log_every:
            streak.last_log_at = now
            log.warning("metrics scrape of %s failed: %s", eid, error)
        streak.kind = kind

    def _observe(self, eid: EndpointId, ok: bool, kind: str | None, seconds: float) -> None:
        if self._observer is None:
            return
        try:
            self._observer.on_scrape(eid, ok, kind, seconds)
        except Exception:
            if not self._observer_failed:
                self._observer_failed = True
                log.exception("metrics scrape observer failed (further failures not logged)")

    @staticmethod
    def _reap(eid: EndpointId, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("metrics scrape task of %s crashed", eid, exc_info=exc)
