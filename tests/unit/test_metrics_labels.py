"""The request metrics' model labels stay bounded whatever names clients send, without pushing the
operator's models into `other`; `/metrics` is rendered off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import aiohttp
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.server.admin import AdminServer
from epp.server.director import Director
from epp.server.ext_proc import RequestStream
from epp.server.model_labels import OTHER_MODEL, ModelLabels
from epp.testing.fakes import FakeClock

from .test_ext_proc_interop import with_headers
from .test_ext_proc_stream import body, director, headers
from .test_model_rewrites import exact_rule, obj, table

REQUESTS = "inference_objective_request_total"


def served(*names: str) -> ModelLabels:
    return ModelLabels(lambda n: n in names, max_names=3, max_pairs=2, max_chars=10)


# -- ModelLabels ----------------------------------------------------------------------------------


def test_junk_names_take_the_slots_but_never_a_known_names_label() -> None:
    labels = served("llama")
    got = [labels.name(f"junk{i}") for i in range(5)]
    assert got == ["junk0", "junk1", "junk2", OTHER_MODEL, OTHER_MODEL]
    assert labels.name("llama") == "llama"  # came after the junk: still its own
    assert labels.name("junk1") == "junk1"  # a name keeps the slot it took


def test_a_long_name_is_other_unless_known() -> None:
    labels = served("a-very-long-served-name")
    assert labels.name("x" * 11) == OTHER_MODEL
    assert labels.name("a-very-long-served-name") == "a-very-long-served-name"
    assert labels.name("short") == "short"  # the long one took no slot


def test_a_name_becoming_known_stops_counting_against_the_slots() -> None:
    known: set[str] = set()
    labels = ModelLabels(known.__contains__, max_names=1)
    assert labels.name("a") == "a"
    assert labels.name("b") == OTHER_MODEL
    known.add("b")  # a pod serving it appeared
    assert labels.name("b") == "b"


def test_pairs_are_bounded_and_then_keep_the_target() -> None:
    labels = ModelLabels(lambda n: n.startswith("s"), max_pairs=2)
    assert labels.pair("s1", "s2") == ("s1", "s2")
    assert labels.pair("s1", "s3") == ("s1", "s3")
    assert labels.pair("s2", "s3") == (OTHER_MODEL, "s3")  # past the pair slots: the model server's side
    assert labels.pair("s1", "s2") == ("s1", "s2")  # a pair keeps its slot
    assert labels.pair("s2", "s2") == ("s2", "s2")  # no rewrite: no pair slot needed


def test_a_rule_pair_needs_no_pair_slot() -> None:
    labels = ModelLabels(lambda n: True, max_pairs=0)
    labels.set_rule_pairs({("food", "food-v2")})
    assert labels.pair("food", "food-v2") == ("food", "food-v2")
    assert labels.pair("food", "food-v3") == (OTHER_MODEL, "food-v3")


def test_a_pair_with_other_on_either_side_takes_no_pair_slot() -> None:
    labels = ModelLabels(lambda n: n == "s", max_names=1, max_pairs=1)
    assert labels.pair("first", "s") == ("first", "s")  # the only name slot and the only pair slot
    assert labels.pair("junk", "s") == (OTHER_MODEL, "s")
    assert labels.pair("s", "junk") == ("s", OTHER_MODEL)
    assert labels.pair("first", "s") == ("first", "s")


# -- through the director -------------------------------------------------------------------------


def route(d: Director, model: str, target: str | None = None) -> RequestStream:
    s = RequestStream(d, 1 << 30)
    extra = {} if target is None else {"x-gateway-model-name-rewrite": target}
    s.on_message(with_headers(headers(), **extra))
    doc = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    s.on_message(body(json.dumps(doc).encode(), True))
    assert s.routed is not None
    return s


def pairs(d: Director) -> set[tuple[str, str]]:
    return {
        (s.labels["model_name"], s.labels["target_model_name"])
        for fam in d.metrics.registry.collect()
        for s in fam.samples
        if s.name == REQUESTS
    }


def test_junk_model_names_do_not_push_a_served_model_into_other() -> None:
    d = director()
    d.datastore.add_endpoint("10.0.0.9:80", "llama-3")  # served from now on (its configured model)
    for i in range(300):
        route(d, f"junk-{i}").close()
    route(d, "llama-3").close()
    route(d, "batch").close()  # a configured objective
    sample = d.metrics.registry.get_sample_value
    assert sample(REQUESTS, {"model_name": "llama-3", "target_model_name": "llama-3"}) == 1
    assert sample(REQUESTS, {"model_name": "batch", "target_model_name": "batch"}) == 1
    assert sample(REQUESTS, {"model_name": OTHER_MODEL, "target_model_name": OTHER_MODEL}) == 300 - 256


def test_names_a_rewrite_rule_names_get_their_own_label() -> None:
    d = director()
    for i in range(300):
        route(d, f"junk-{i}").close()
    d.model_rewrites = table(obj(rules=[exact_rule("food", ("food-v1", 90), ("food-v2", 10))]))
    s = route(d, "food")
    assert s.routed is not None and s.routed.labels[0] == "food"
    assert s.routed.labels[1] in ("food-v1", "food-v2")


def test_client_chosen_pairs_are_bounded() -> None:
    d = director()
    for i in range(40):
        for j in range(20):  # 800 pairs of 60 names, through the rewrite header
            route(d, f"client-{i}", f"target-{j}").close()
    got = pairs(d)
    assert len(got) <= 256 + 20  # the pair slots, then (other, target) per target
    assert {t for _, t in got} == {f"target-{j}" for j in range(20)}
    sample = d.metrics.registry.get_sample_value
    assert sum(sample(REQUESTS, {"model_name": m, "target_model_name": t}) or 0 for m, t in got) == 800


def test_the_running_gauge_goes_back_to_zero_when_a_name_gets_its_own_label_in_flight() -> None:
    d = director()
    for i in range(256):
        route(d, f"junk-{i}").close()
    s = route(d, "late")  # routed as `other`
    d.datastore.add_endpoint("10.0.0.9:80", "late")  # ... and served while in flight
    s.close()
    gauge = "inference_objective_running_requests"
    assert d.metrics.registry.get_sample_value(gauge, {"model_name": OTHER_MODEL}) == 0
    assert d.metrics.registry.get_sample_value(gauge, {"model_name": "late"}) is None


# -- /metrics off the event loop ------------------------------------------------------------------


class _WaitsForTheLoop(Collector):
    """Tells the loop it started, then blocks until a coroutine on the loop has answered: it can only
    finish when the collection runs in another thread (on the loop, nothing else runs until it returns,
    so it waits out its deadlock guard and reports that the loop never answered)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, started: asyncio.Event) -> None:
        self.loop = loop
        self.started = started
        self.loop_ran = threading.Event()
        self.saw_loop_run = False

    def describe(self) -> list[Metric]:
        return []  # (else registering it would collect it)

    def collect(self) -> Iterator[Metric]:
        self.loop.call_soon_threadsafe(self.started.set)
        self.saw_loop_run = self.loop_ran.wait(timeout=10)  # (a deadlock guard, not a timing)
        fam = GaugeMetricFamily("test_blocking", "d")
        fam.add_metric([], 1.0)
        yield fam


class _RecordsItsThread(Collector):
    def __init__(self) -> None:
        self.threads: list[int] = []

    def describe(self) -> list[Metric]:
        return []  # (else registering it would collect it)

    def collect(self) -> Iterator[Metric]:
        self.threads.append(threading.get_ident())
        fam = GaugeMetricFamily("test_live", "d")
        fam.add_metric([], 2.0)
        yield fam


async def scrape(d: Director) -> str:
    admin = AdminServer(d.metrics, d.datastore, FakeClock(), lambda: True)
    port = await admin.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200
            return await r.text()
    finally:
        await admin.stop()


async def test_the_loop_runs_other_work_while_metrics_are_rendered() -> None:
    d = director()
    started = asyncio.Event()
    blocking = _WaitsForTheLoop(asyncio.get_running_loop(), started)
    d.metrics.threadsafe.register(blocking)
    d.metrics.attach_pool(d.datastore, d.clock, "pool")

    async def answer_during_the_scrape() -> None:
        await started.wait()
        blocking.loop_ran.set()

    task = asyncio.create_task(answer_during_the_scrape())
    text = await scrape(d)
    await task
    assert blocking.saw_loop_run
    assert "test_blocking 1.0" in text and 'inference_pool_ready_pods{name="pool"} 2.0' in text


async def test_live_collectors_are_collected_on_the_loop_thread() -> None:
    d = director()
    live = _RecordsItsThread()
    d.metrics.attach_live(live)
    text = await scrape(d)
    assert live.threads == [threading.get_ident()]
    assert "test_live 2.0" in text
