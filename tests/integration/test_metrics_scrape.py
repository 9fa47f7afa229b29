"""MetricsScraper against real aiohttp servers on 127.0.0.1 serving vLLM-style /metrics pages.

No timing assertions: every wait is for a condition, polled every 10 ms for up to 5 s.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from epp.clock import MonotonicClock
from epp.datastore import Datastore, EndpointRecord
from epp.sources.metrics_scrape import MetricsScraper, endpoint_url
from epp.testing.wait import eventually

THRESHOLD = 3


class FakeEngine:
    """A model server stand-in; `mode` is one of ok, 500, garbage, hang."""

    def __init__(self, waiting: int = 1) -> None:
        self.mode = "ok"
        self.waiting = waiting
        self.hits = 0
        self.pending = 0
        self.peers: set[Any] = set()
        self.release = asyncio.Event()
        self.port = 0
        self.ssl_context: Any = None  # serve https with it
        self._runner: web.AppRunner | None = None

    @property
    def id(self) -> str:
        return f"127.0.0.1:{self.port}"

    def page(self) -> str:
        labels = 'engine="0",model_name="llama"'
        return (
            "# HELP vllm:num_requests_waiting Number of requests waiting.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} {float(self.waiting)}\n"
            f"vllm:num_requests_running{{{labels}}} 2.0\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} 0.5\n"
            f'vllm:time_to_first_token_seconds_bucket{{{labels},le="0.1"}} 3.0\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1024"} 1.0\n'
        )

    async def _handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        if request.transport is not None:
            self.peers.add(request.transport.get_extra_info("peername"))
        if self.mode == "hang":
            self.pending += 1
            try:
                await self.release.wait()
            finally:
                self.pending -= 1
        if self.mode == "500":
            return web.Response(status=500, text="engine exploded")
        if self.mode == "garbage":
            return web.Response(text="<html><body>hello</body></html>", content_type="text/html")
        return web.Response(text=self.page(), content_type="text/plain")

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self.ssl_context)
        await site.start()  # port 0 the first time
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class Recorder:
    """A ScrapeObserver that keeps every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool, str | None, float]] = []

    def on_scrape(self, endpoint_id: str, ok: bool, error_kind: str | None, seconds: float) -> None:
        self.calls.append((endpoint_id, ok, error_kind, seconds))

    def kinds(self, endpoint_id: str) -> set[str | None]:
        return {kind for eid, _, kind, _ in self.calls if eid == endpoint_id}


EngineFactory = Callable[..., Awaitable[FakeEngine]]
ScraperFactory = Callable[..., Awaitable[MetricsScraper]]


@pytest.fixture
async def engine() -> AsyncIterator[EngineFactory]:
    started: list[FakeEngine] = []

    async def make(mode: str = "ok", waiting: int = 1) -> FakeEngine:
        eng = FakeEngine(waiting)
        eng.mode = mode
        started.append(await eng.start())
        return eng

    yield make
    for eng in started:
        await eng.stop()


@pytest.fixture
def datastore() -> Datastore:
    return Datastore(MonotonicClock(), unhealthy_after_failures=THRESHOLD)


@pytest.fixture
async def scraper(engine: EngineFactory, datastore: Datastore) -> AsyncIterator[ScraperFactory]:
    """Depends on `engine` so that scrapers stop before the servers do."""
    started: list[MetricsScraper] = []

    async def make(*, interval: float = 0.02, timeout: float = 1.0, **kw: Any) -> MetricsScraper:
        s = MetricsScraper(datastore, datastore.clock, interval=interval, timeout=timeout, **kw)
        await s.start()
        started.append(s)
        return s

    yield make
    for s in started:
        await s.stop()


def rec(ds: Datastore, eid: str) -> EndpointRecord:
    record = ds.get(eid)
    assert record is not None
    return record


async def test_values_reach_the_datastore_over_one_kept_alive_connection(
    engine: EngineFactory, scraper: ScraperFactory, datastore: Datastore
) -> None:
    eng = await engine(waiting=3)
    datastore.add_endpoint(eng.id, "llama")
    before = datastore.clock.now()
    await scraper()
    r = rec(datastore, eng.id)
    await eventually(lambda: r.metrics is not None, "first snapshot")
    assert r.metrics is not None
    assert (r.metrics.waiting, r.metrics.running, r.metrics.kv_usage) == (3, 2, 0.5)
    assert (r.metrics.block_size, r.metrics.num_gpu_blocks, r.metrics.models) == (
        16,
        1024,
        frozenset({"llama"}),
    )
    assert before <= r.metrics.observed_at <= datastore.clock.now()
    eng.waiting = 9
    await eventually(lambda: r.metrics is not None and r.metrics.waiting == 9, "updated value")
    await eventually(lambda: eng.hits >= 5, "several scrapes")
    assert len(eng.peers) == 1, "scrapes should reuse one keep-alive connection"
    assert r.healthy and r.scrape_failures == 0


@pytest.mark.parametrize(("mode", "kind"), [("500", "http_status"), ("garbage", "parse")])
async def test_failing_endpoint_turns_unhealthy_and_recovers(
    engine: EngineFactory, scraper: ScraperFactory, datastore: Datastore, mode: str, kind: str
) -> None:
    bad = await engine(mode=mode)
    datastore.add_endpoint(bad.id)
    observer = Recorder()
    await scraper(observer=observer)
    r = rec(datastore, bad.id)
    await eventually(lambda: not r.healthy, f"{bad.id} unhealthy after {THRESHOLD} failures")
    assert r.scrape_failures >= THRESHOLD
    assert r.last_error is not None and r.last_error.startswith(f"{kind}: ")
    assert bad.id not in {e.id for e in datastore.candidates()}
    assert kind in observer.kinds(bad.id)
    bad.mode = "ok"
    await eventually(lambda: r.healthy and r.metrics is not None, "recovery")
    assert r.last_error is None and r.scrape_failures == 0
    assert observer.calls[-1][1] is True


async def test_refused_connections_turn_unhealthy_and_recover(
    engine: EngineFactory, scraper: ScraperFactory, datastore: Datastore
) -> None:
    eng = await engine()
    await eng.stop()  # the port is now closed: connections are refused
    datastore.add_endpoint(eng.id)
    observer = Recorder()
    await scraper(observer=observer)
    r = rec(datastore, eng.id)
    await eventually(lambda: not r.healthy, "unhealthy after refused connections")
    assert r.last_error is not None and r.last_error.startswith("connect: ")
    assert observer.kinds(eng.id) == {"connect"}
    await eng.start()  # same port again
    await eventually(lambda: r.healthy and r.metrics is not None, "recovery once the server is back")


async def test_hung_endpoint_does_not_hold_up_healthy_one(
    engine: EngineFactory, scraper: ScraperFactory, datastore: Datastore
) -> None:
    hung, good = await engine(mode="hang"), await engine(waiting=1)
    datastore.add_endpoint(hung.id)
    datastore.add_endpoint(good.id)
    await scraper(timeout=30.0)  # far longer than any wait below: the hung scrape stays open
    await eventually(lambda: hung.pending == 1, "the hung request to be outstanding")
    hits = good.hits
    good.waiting = 11
    g = rec(datastore, good.id)
    await eventually(lambda: good.hits >= hits + 10, "healthy endpoint scraped on while the other hangs")
    await eventually(lambda: g.metrics is not None and g.metrics.waiting == 11, "fresh value")
    assert hung.pending == 1 and hung.hits == 1
    h = rec(datastore, hung.id)
    assert h.metrics is None and h.healthy


async def test_hung_endpoint_times_out_and_turns_unhealthy(
    engine: EngineFactory, scraper: ScraperFactory, datastore: Datastore
) -> None:
    hung, good = await engine(mode="hang"), await engine()
    datastore.add_endpoint(hung.id)
    datastore.add_endpoint(good.id)
    observer = Recorder()
    await scraper(interval=0.05, timeout=0.2, observer=observer)
    h, g = rec(datastore, hung.id), rec(datastore, good.id)
    await eventually(lambda: not h.healthy, "hung endpoint unhealthy")
    assert h.last_error is not None and h.last_error.startswith("timeout: ")
    assert observer.kinds(hung.id) == {"timeout"}
    assert g.healthy and g.scrape_failures == 0 and observer.kinds(good.id) == {None}
    hung.mode = "ok"
    hung.release.set()
    await eventually(lambda: h.healthy and h.metrics is not None, "recovery after it answers again")


async def test_endpoints_added_and_removed_later(
    engine: EngineFactory, scraper: ScraperFactory, datastore: Datastore
) -> None:
    a, b = await engine(waiting=1), await engine(waiting=2)
    datastore.add_endpoint(a.id)
    s = await scraper()
    assert s.scraping == {a.id}
    await eventually(lambda: rec(datastore, a.id).metrics is not None, "A scraped")
    assert b.hits == 0

    datastore.add_endpoint(b.id)
    await eventually(lambda: b.id in s.scraping, "B picked up by the ticker")
    await eventually(lambda: (m := rec(datastore, b.id).metrics) is not None and m.waiting == 2, "B scraped")

    datastore.remove_endpoint(a.id)
    await eventually(lambda: s.scraping == {b.id}, "A's task stopped")
    marker = b.hits
    await eventually(lambda: b.hits >= marker + 3, "B scraped on")  # lets any in-flight request to A land
    a_hits, marker = a.hits, b.hits
    await eventually(lambda: b.hits >= marker + 5, "B scraped on, again")
    assert a.hits == a_hits, "a removed endpoint must not be scraped"
    assert datastore.get(a.id) is None  # not resurrected by a late result


async def test_sync_reports_started_and_stopped(
    engine: EngineFactory, scraper: ScraperFactory, datastore: Datastore
) -> None:
    a = await engine()
    s = await scraper(interval=60.0)  # the ticker will not run during this test
    assert s.sync() == (set(), set())
    datastore.add_endpoint(a.id)
    assert s.sync() == ({a.id}, set())
    assert s.sync() == (set(), set())
    datastore.remove_endpoint(a.id)
    assert s.sync() == (set(), {a.id})
    assert s.scraping == frozenset()


async def test_stop_leaves_no_tasks_and_closes_the_session(
    engine: EngineFactory, datastore: Datastore
) -> None:
    hung, good = await engine(mode="hang"), await engine()
    datastore.add_endpoint(hung.id)
    datastore.add_endpoint(good.id)
    scraper = MetricsScraper(datastore, MonotonicClock(), interval=0.02, timeout=30.0)
    await scraper.start()
    session = scraper._session
    assert session is not None
    await eventually(lambda: hung.pending == 1 and good.hits >= 3, "scrapes under way")
    await scraper.stop()
    leftovers = [t for t in asyncio.all_tasks() if t.get_name().startswith("metrics-scrape") and not t.done()]
    assert leftovers == []
    assert session.closed and not scraper.running and scraper.scraping == frozenset()
    await scraper.stop()  # idempotent
    hits = good.hits
    await asyncio.sleep(0)
    assert good.hits == hits


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("10.0.0.1:8000", "http://10.0.0.1:8000/metrics"),
        ("fd00::1:8000", "http://[fd00::1]:8000/metrics"),
        ("[fd00::1]:8000", "http://[fd00::1]:8000/metrics"),
    ],
)
def test_endpoint_url(endpoint: str, url: str) -> None:
    assert endpoint_url("http", endpoint, "/metrics") == url


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("10.0.0.1:8000", "https://10.0.0.1:9400/stats"),
        ("fd00::1:8000", "https://[fd00::1]:9400/stats"),
        ("[fd00::1]:8000", "https://[fd00::1]:9400/stats"),
    ],
)
def test_endpoint_url_with_another_port(endpoint: str, url: str) -> None:
    """`--model-server-metrics-port`: the same host, that port."""
    assert endpoint_url("https", endpoint, "/stats", 9400) == url


async def test_https_scrapes_skip_verification_unless_asked_to_verify(tmp_path: Any) -> None:
    """An engine serving /metrics over https with a self-signed certificate: scraped with verification off
    (the reference's default); with it on (`--model-server-metrics-https-insecure-skip-verify=false`) the
    scrapes fail and the endpoint turns unhealthy, its values never read."""
    import ssl

    from epp.server.tls import self_signed

    crt, key = self_signed()
    (tmp_path / "c.pem").write_bytes(crt)
    (tmp_path / "k.pem").write_bytes(key)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    eng = FakeEngine(waiting=7)
    eng.ssl_context = ctx
    await eng.start()
    try:
        for verify in (False, True):
            ds = Datastore(MonotonicClock(), unhealthy_after_failures=THRESHOLD)
            ds.add_endpoint(eng.id, "llama")
            seen = Recorder()
            hits = eng.hits
            async with MetricsScraper(
                ds, ds.clock, interval=0.02, timeout=1.0, scheme="https", verify_tls=verify, observer=seen
            ):
                if not verify:
                    await eventually(lambda d=ds: rec(d, eng.id).metrics is not None, "https scraped")
                    assert rec(ds, eng.id).metrics.waiting == 7  # type: ignore[union-attr]
                else:
                    await eventually(lambda d=ds: not rec(d, eng.id).healthy, "verification fails")
                    assert rec(ds, eng.id).metrics is None and eng.hits == hits
                    assert True not in {ok for _, ok, _, _ in seen.calls}
    finally:
        await eng.stop()


async def test_a_page_of_megabytes_is_parsed_off_the_event_loop_and_its_model_names_bounded(
    engine: EngineFactory, scraper: ScraperFactory, datastore: Datastore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A valid page of ~2 MB naming 40,000 models (all lines the EPP reads): parsed in a worker thread,
    not on the loop that serves requests, and at most MAX_MODELS names kept."""
    import threading

    from epp.sources import metrics_scrape, metrics_text

    threads: set[int] = set()
    parse = metrics_scrape.parse_metrics

    def recording(text: str, now: float) -> object:
        threads.add(threading.get_ident())
        return parse(text, now)

    monkeypatch.setattr(metrics_scrape, "parse_metrics", recording)
    eng = await engine()
    lines = "".join(f'vllm:num_requests_waiting{{model_name="m{i}"}} 1\n' for i in range(40_000))
    eng.page = lambda: lines  # type: ignore[method-assign]
    datastore.add_endpoint(eng.id, "m")
    await scraper(interval=0.5, timeout=5.0)
    r = rec(datastore, eng.id)
    await eventually(lambda: r.metrics is not None, "the big page parsed")
    assert r.metrics is not None and len(r.metrics.models) == metrics_text.MAX_MODELS
    assert threads and threading.get_ident() not in threads
