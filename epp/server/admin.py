"""Admin HTTP (aiohttp): /metrics, /healthz, /readyz and /debug/{endpoints,index,decisions}."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epp.clock import Clock
from epp.datastore import Datastore, EndpointRecord
from epp.server.metrics import EppMetrics


def endpoint_json(rec: EndpointRecord, now: float) -> dict[str, Any]:
    metrics = None
    if rec.metrics is not None:
        metrics = {
            k: sorted(v) if isinstance(v, frozenset) else v
            for k, v in dataclasses.asdict(rec.metrics).items()
        }
    return {
        "address": rec.id,
        "model": rec.model,
        "healthy": rec.healthy,
        "metrics": metrics,
        "metrics_age_seconds": None if rec.metrics is None else round(now - rec.metrics.observed_at, 6),
        "in_flight_requests": rec.in_flight_requests,
        "in_flight_prompt_tokens": rec.in_flight_prompt_tokens,
        "prefill_backlog": {
            "requests": rec.prefill_backlog.requests,
            "uncached_tokens": rec.prefill_backlog.tokens,
        },
        "decoding_requests": rec.decoding_requests,
        "scrape_failures": rec.scrape_failures,
        "last_error": rec.last_error,
    }


class AdminServer:
    def __init__(
        self,
        metrics: EppMetrics,
        datastore: Datastore,
        clock: Clock,
        ready: Callable[[], bool],
        debug_endpoints: bool = True,
        debug_index: Callable[[], dict[str, Any]] | None = None,
        debug_decisions: Callable[[int], dict[str, Any]] | None = None,
    ) -> None:
        self.metrics = metrics
        self.datastore = datastore
        self.clock = clock
        self.ready = ready
        self.app = web.Application()
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/healthz", self._healthz)
        self.app.router.add_get("/readyz", self._readyz)
        self.debug_index = debug_index
        self.debug_decisions = debug_decisions
        if debug_endpoints:
            self.app.router.add_get("/debug/endpoints", self._endpoints)
            if debug_index is not None:
                self.app.router.add_get("/debug/index", self._index)
            if debug_decisions is not None:
                self.app.router.add_get("/debug/decisions", self._decisions)
        self._runner: web.AppRunner | None = None
        self.port = 0
        # /metrics is rendered here, off the event loop (one thread: concurrent scrapes queue, they do
        # not compete with the loop for the GIL side by side)
        self._render = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epp-metrics-render")

    async def start(self, host: str, port: int) -> int:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._render.shutdown(wait=False, cancel_futures=True)

    async def _metrics(self, request: web.Request) -> web.Response:
        """Rendering a large exposition takes long (seconds for tens of thousands of series), so it runs in
        a thread, and the loop goes on routing requests meanwhile. The collectors that read loop-owned
        state (datastore records, cost model, KV index) are collected here first, on the loop, where
        that state is never mid-change; the thread renders their families and the thread-safe
        prometheus_client metrics (`EppMetrics.exposition`)."""
        exposition = self.metrics.exposition()
        body = await asyncio.get_running_loop().run_in_executor(self._render, generate_latest, exposition)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        if self.ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready\n")

    async def _index(self, request: web.Request) -> web.Response:
        assert self.debug_index is not None
        return web.json_response(self.debug_index())

    async def _decisions(self, request: web.Request) -> web.Response:
        assert self.debug_decisions is not None
        raw = request.query.get("limit", "20")
        if not raw.isdigit() or not 0 < int(raw) <= 10_000:
            return web.json_response(
                {"error": f"limit must be an integer in 1..10000, got {raw!r}"}, status=400
            )
        return web.json_response(self.debug_decisions(int(raw)))

    async def _endpoints(self, request: web.Request) -> web.Response:
        now = self.clock.now()
        return web.json_response({"endpoints": [endpoint_json(r, now) for r in self.datastore.records()]})
