"""Every error status through real Envoy, each followed by a request that still works; the subset
hint; disconnects releasing in-flight state; unhealthy backends losing and regaining traffic."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.config import EppConfig, parse_config
from epp.scheduling.builtin import default_registry
from epp.scheduling.registry import NoParams, PluginSpec
from epp.server.app import EppServer, ServerSettings
from epp.server.ext_proc import SERVICE_NAME
from epp.testing.envoy import EnvoyConfig
from epp.types import Endpoint

from .stack import CHAT, eventually, stack


def error_of(text: str) -> dict[str, object]:
    doc = json.loads(text)
    assert set(doc) == {"error"}
    return doc["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "'model'"),
        (b'{"model": "m"}', "'messages'"),
        (b'"just a string"', "JSON object"),
    ],
)
async def test_bad_bodies_get_400_and_the_next_request_works(raw: bytes, needle: str) -> None:
    async with stack(1) as st:
        status, by, text = await st.chat(data=raw, headers={"content-type": "application/json"})
        assert (status, by) == (400, None)
        err = error_of(text)
        assert err["code"] == 400 and needle in str(err["message"])
        assert (await st.chat())[0] == 200
        assert st.backends[0].requests and all(r.json == CHAT for r in st.backends[0].requests)
        assert await st.metric("epp_rejections_total", status="400") == 1


async def test_body_over_the_limit_gets_413() -> None:
    async with stack(1, settings=replace(ServerSettings(), max_body_bytes=64 * 1024)) as st:
        raw = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
        status, _, text = await st.chat(data=raw, headers={"content-type": "application/json"})
        assert status == 413
        assert "exceeds 65536 bytes" in str(error_of(text)["message"])
        assert (await st.chat())[0] == 200
        assert len(st.backends[0].requests) == 1


async def test_no_endpoints_gets_503() -> None:
    async with stack(1, endpoints=[]) as st:
        status, by, text = await st.chat()
        assert (status, by) == (503, None)
        assert error_of(text)["type"] == "ServiceUnavailable"


def staleness_config(max_age: str) -> EppConfig:
    """The staleness filter (`maxAge`) and the queue scorer."""
    text = f"""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: metrics-staleness-filter
  parameters: {{maxAge: {max_age}}}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: metrics-staleness-filter}}, {{pluginRef: queue-scorer}}]
"""
    return parse_config(text, f"staleness-{max_age}.yaml")


async def test_every_endpoint_filtered_gets_429() -> None:
    # Every /metrics hangs (a long scrape timeout keeps the endpoints healthy): once all metrics are
    # older than maxAge the staleness filter removes every endpoint. (Scraping switched off with the
    # filter in the profile is refused at start: tests/integration/test_startup_checks.py.)
    settings = replace(ServerSettings(), metrics_timeout=30.0)
    async with stack(2, config=staleness_config("100ms"), settings=settings) as st:
        for b in st.backends:
            b.metrics_mode = "hang"
        clock, records = st.epp.clock, st.epp.datastore.records
        await eventually(
            lambda: all(clock.now() - r.metrics.observed_at > 0.3 for r in records()),  # type: ignore[union-attr]
            "every endpoint's metrics stale",
        )
        status, by, text = await st.chat()
        assert (status, by) == (429, None)
        assert "metrics-staleness-filter" in str(error_of(text)["message"])


OBJECTIVES = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
objectives:
- {name: batch, priority: -1}
- {name: chat, priority: 10}
"""


async def test_sheddable_request_meets_a_saturated_pool_with_429() -> None:
    async with stack(2, config=parse_config(OBJECTIVES, "objectives.yaml")) as st:
        for b in st.backends:
            b.waiting = 8
        await eventually(
            lambda: all(r.metrics is not None and r.metrics.waiting == 8 for r in st.epp.datastore.records()),
            "saturation scraped",
        )
        status, _, text = await st.chat(headers={"x-gateway-inference-objective": "batch"})
        assert status == 429
        assert "sheddable" in str(error_of(text)["message"])
        assert (await st.chat(headers={"x-gateway-inference-objective": "chat"}))[0] == 200
        assert (await st.chat())[0] == 200
        st.backends[0].waiting = 0
        await eventually(
            lambda: st.epp.datastore.get(st.backends[0].address).metrics.waiting == 0,  # type: ignore[union-attr]
            "pool no longer saturated",
        )
        assert (await st.chat(headers={"x-gateway-inference-objective": "batch"}))[:2] == (200, "pod-0")


class _Exploding:
    name = "boom"

    def score(self, state: object, request: object, endpoints: Sequence[Endpoint]) -> list[float]:
        if getattr(request, "model", "") == "explode":
            raise RuntimeError("plugin bug")
        return [1.0] * len(endpoints)


EXPLODING = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: exploding-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: exploding-scorer}]
"""


async def test_an_internal_error_is_500_and_the_server_keeps_serving() -> None:
    registry = default_registry()
    registry.register(PluginSpec("exploding-scorer", "scorer", NoParams, lambda n, p, h: _Exploding()))
    settings = ServerSettings.loopback(
        refresh_metrics_interval=0,
    )
    epp = EppServer(settings, parse_config(EXPLODING, "x.yaml"), registry=registry)
    from epp.testing.backend import FakeModelServer
    from epp.testing.envoy import EnvoyProcess

    async with FakeModelServer("pod-0") as backend:
        epp.datastore.add_endpoint(backend.address)
        await epp.start()
        try:
            async with EnvoyProcess(EnvoyConfig(epp_port=epp.grpc_port)) as envoy:
                import aiohttp

                async with aiohttp.ClientSession() as s:
                    url = f"{envoy.url}/v1/chat/completions"
                    async with s.post(url, json={**CHAT, "model": "explode"}) as r:
                        assert r.status == 500
                        assert error_of(await r.text())["type"] == "Internal"
                    async with s.post(url, json=CHAT) as r:
                        assert r.status == 200
        finally:
            await epp.stop(grace=0.2)


async def test_subset_hint_restricts_the_pick() -> None:
    hint = EnvoyConfig(subset_hint_from_header="x-test-subset")
    async with stack(3, envoy=hint) as st:
        st.backend("pod-1").waiting = 50  # the EPP would never pick it on its own
        await eventually(
            lambda: st.epp.datastore.get(st.backend("pod-1").address).metrics.waiting == 50,  # type: ignore[union-attr]
            "load scraped",
        )
        only = {"x-test-subset": st.backend("pod-1").address}
        served = Counter([(await st.chat(headers=only))[1] for _ in range(4)])
        assert served == {"pod-1": 4}
        two = {"x-test-subset": f"{st.backend('pod-0').address},{st.backend('pod-1').address}"}
        assert (await st.chat(headers=two))[1] == "pod-0"
        status, _, text = await st.chat(headers={"x-test-subset": "10.255.0.1:8000"})
        assert status == 503
        assert "subset" in str(error_of(text)["message"])
        assert (await st.chat())[0] == 200


async def test_client_disconnect_mid_stream_releases_in_flight_state() -> None:
    async with stack(1, backend_kwargs={"num_chunks": 50, "stream_delay": 0.05}) as st:
        body = {**CHAT, "stream": True}
        resp = await st.session.post(f"{st.url}/v1/chat/completions", json=body)
        assert resp.status == 200
        await resp.content.readline()
        await eventually(lambda: st.epp.datastore.total_in_flight() == 1, "request in flight")
        resp.close()  # hang up mid-stream
        await st.wait_idle()
        assert await st.metric("epp_requests_released_total", cause="disconnect") == 1
        assert await st.metric("epp_endpoint_in_flight_requests") == 0


async def test_without_response_phases_requests_are_released_as_unobserved_not_disconnect() -> None:
    """response_header_mode SKIP, response_body_mode NONE: Envoy sends nothing of the response, and ends
    the ext_proc stream once the HTTP request is over, the same way (a half-close, then a reset) when it
    completed and when its client hung up mid-response: the EPP cannot tell them apart, both are
    `unobserved`."""
    envoy = EnvoyConfig(response_header_mode="SKIP", response_body_mode="NONE")
    async with stack(1, envoy=envoy, backend_kwargs={"num_chunks": 50, "stream_delay": 0.05}) as st:
        assert (await st.chat())[0] == 200
        await st.wait_idle()
        assert await st.metric("epp_requests_released_total", cause="unobserved") == 1
        resp = await st.session.post(f"{st.url}/v1/chat/completions", json={**CHAT, "stream": True})
        assert resp.status == 200
        await resp.content.readline()
        assert st.epp.datastore.total_in_flight() == 1
        resp.close()  # hang up mid-stream
        await st.wait_idle()
        assert await st.metric("epp_requests_released_total", cause="unobserved") == 2
        assert await st.metric("epp_requests_released_total", cause="disconnect") == 0
        assert await st.metric("epp_requests_released_total") == 2


async def test_client_disconnect_before_body_end_leaks_nothing() -> None:
    async with stack(1) as st:
        _reader, writer = await asyncio.open_connection("127.0.0.1", st.envoy.listener_port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100000\r\n\r\n" + b'{"model": "fake-model", "messages": [' + b" " * 5000
        )
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()
        await writer.wait_closed()
        assert (await st.chat())[0] == 200
        await st.wait_idle()
        assert len(st.backends[0].requests) == 1
        assert await st.metric("epp_picks_total") == 1


@pytest.mark.parametrize("mode", ["error500", "garbage", "hang"])
async def test_backend_with_failing_metrics_stops_receiving_traffic_and_returns(mode: str) -> None:
    settings = replace(ServerSettings(), metrics_timeout=0.2)
    async with stack(2, settings=settings) as st:
        sick = st.backend("pod-0")
        sick.metrics_mode = mode  # type: ignore[assignment]
        await eventually(lambda: not st.epp.datastore.get(sick.address).healthy, "sick backend unhealthy")  # type: ignore[union-attr]
        served = Counter([(await st.chat())[1] for _ in range(5)])
        assert served == {"pod-1": 5}
        assert await st.metric("epp_endpoint_healthy", endpoint=sick.address) == 0
        assert await st.metric("epp_metrics_scrape_errors_total", endpoint=sick.address) >= 3
        sick.metrics_mode = "ok"
        st.backend("pod-1").waiting = 10
        await eventually(
            lambda: (
                st.epp.datastore.get(sick.address).healthy  # type: ignore[union-attr]
                and st.epp.datastore.get(st.backend("pod-1").address).metrics.waiting == 10
            ),  # type: ignore[union-attr]
            "sick backend healthy again",
        )
        assert (await st.chat())[1] == "pod-0"


async def test_stale_metrics_stop_traffic_via_the_staleness_filter() -> None:
    cfg = staleness_config("300ms")
    # A hung /metrics with a long scrape timeout: the endpoint stays "healthy" but its data ages.
    settings = replace(ServerSettings(), metrics_timeout=30.0)
    async with stack(2, config=cfg, settings=settings) as st:
        st.backend("pod-0").metrics_mode = "hang"
        rec = st.epp.datastore.get(st.backend("pod-0").address)
        clock = st.epp.clock
        await eventually(lambda: clock.now() - rec.metrics.observed_at > 0.5, "pod-0 metrics stale")  # type: ignore[union-attr]
        assert rec is not None and rec.healthy
        served = Counter([(await st.chat())[1] for _ in range(4)])
        assert served == {"pod-1": 4}


async def test_grpc_health_serves_every_name() -> None:
    async with stack(1) as st, grpc.aio.insecure_channel(f"127.0.0.1:{st.epp.grpc_health_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "liveness", "readiness", SERVICE_NAME):
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, name
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
