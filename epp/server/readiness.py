"""When the EPP answers ready: the gRPC health services and `/readyz` (the asyncio edge).

Alive (`liveness`) as soon as it listens. Ready (`readiness`, `""`, the ext_proc service name and the
reference chart's `inference-extension`) once, with discovery, the pool has been found and its pods
listed and the first attempt to list the `InferenceModelRewrite`s has ended, and every endpoint has had
its first metrics scrape attempt (at most the scrape timeout), so the staleness filter does not answer
429 for the first round after start. After that, with a pool, readiness follows it as the reference
EPP's health server follows its datastore's pool (`cmd/epp/runner/health.go`): NOT_SERVING while the
pool is deleted (or being deleted), SERVING again once it exists, its pods are listed and their
endpoints (re-added without metrics) have had a first scrape attempt; liveness stays.
"""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health, health_pb2

from epp.datastore import Datastore
from epp.discovery.rewrite_watcher import ModelRewriteWatcher
from epp.discovery.tracker import PodTracker
from epp.server.ext_proc import SERVICE_NAME
from epp.server.startup import ScrapeRound

log = logging.getLogger("epp.server")

REFERENCE_CHART_SERVICE = "inference-extension"
"""The service name the reference's Helm chart probes (liveness and readiness) without leader election."""
HEALTH_SERVICES = ("", "liveness", "readiness", SERVICE_NAME, REFERENCE_CHART_SERVICE)
READINESS_SERVICES = ("", "readiness", SERVICE_NAME, REFERENCE_CHART_SERVICE)  # follow the pool
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Readiness:
    def __init__(
        self,
        servicer: health.aio.HealthServicer,  # type: ignore[name-defined]
        datastore: Datastore,
        scrape_timeout: float,
        *,
        discovery: PodTracker | None = None,
        rewrites: ModelRewriteWatcher | None = None,
        scrape_round: ScrapeRound | None = None,
    ) -> None:
        self.servicer = servicer
        self.datastore = datastore
        self.scrape_timeout = scrape_timeout
        self.discovery = discovery
        self.rewrites = rewrites
        self.scrape_round = scrape_round
        self._ready = False
        self._pool_serving = True  # with discovery: the pool's readiness as last answered (`_follow_pool`)
        self._task: asyncio.Task[None] | None = None

    def is_ready(self) -> bool:
        """What `/readyz` answers: as the readiness services."""
        return self._ready and (self.discovery is None or (self.discovery.ready and self._pool_serving))

    async def starting(self) -> None:
        """Listening soon: every service NOT_SERVING until `alive`."""
        for name in HEALTH_SERVICES:
            await self.servicer.set(name, NOT_SERVING)

    async def alive(self) -> None:
        """Serving: liveness now, readiness once its conditions hold (a task, until `stop`)."""
        await self.servicer.set("liveness", SERVING)
        self._task = asyncio.create_task(self._become_ready(), name="epp-readiness")

    def stop(self) -> None:
        self._ready = False
        if self._task is not None:
            self._task.cancel()

    async def _become_ready(self) -> None:
        if self.discovery is not None:
            await self.discovery.wait_synced()
        if self.rewrites is not None:  # the first requests follow the rewrite rules that exist
            await self.rewrites.wait_settled()
        if self.scrape_round is not None:
            done = await self.scrape_round.wait(set(self.datastore.ids()), self.scrape_timeout)
            self.scrape_round.finish()
            if not done:
                log.warning("ready before every endpoint's first metrics scrape ended (--metrics-timeout)")
        # (the pool may have gone while the first scrapes ran: then the readiness services start NOT_SERVING)
        pool = self.discovery is None or self.discovery.ready
        for name in HEALTH_SERVICES:
            await self.servicer.set(name, SERVING if pool or name not in READINESS_SERVICES else NOT_SERVING)
        self._pool_serving = pool  # /readyz agrees with the readiness services from here on
        self._ready = True
        if self.discovery is not None:
            await self._follow_pool(self.discovery, pool)

    async def _follow_pool(self, watcher: PodTracker, ready: bool) -> None:
        """`ready`: what the readiness services answer now."""
        while True:
            ready = await watcher.wait_ready_change(ready)
            self._pool_serving = False  # (gone, or back but not yet scraped)
            if ready and self.scrape_round is not None:
                # Back: the pods' endpoints were re-added without metrics; as at start, wait (at most the
                # scrape timeout) for their first scrape, or the staleness filter would answer 429.
                self.scrape_round.begin()
                ids = set(self.datastore.ids())
                fresh = {eid for eid in ids if (r := self.datastore.get(eid)) is not None and r.metrics}
                await self.scrape_round.wait(ids - fresh, self.scrape_timeout)
                self.scrape_round.finish()
                ready = watcher.ready  # (it may have gone again meanwhile)
            self._pool_serving = ready
            for name in READINESS_SERVICES:
                await self.servicer.set(name, SERVING if ready else NOT_SERVING)
