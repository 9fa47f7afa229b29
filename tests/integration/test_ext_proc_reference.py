"""Real Envoy in front of the EPP: the destination the EPP picks is the one Envoy routes to, whatever a
client sends in `x-gateway-destination-endpoint`, in every request body mode the EPP accepts; in the
modes where Envoy routes on the request headers before the body is read (STREAMED, NONE), a request with
a body is refused with the EPP's 500 instead of going past the EPP.

The test harness renders only the modes the EPP supports (`EnvoyConfig` refuses STREAMED), so the two
others are set in the rendered bootstrap here. Loopback only; no timing assertions.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import epp.testing.envoy as envoy_mod
from epp.testing.wait import eventually

from .stack import ENVOY_MARKS, Stack, stack

pytestmark = ENVOY_MARKS

DEST = "x-gateway-destination-endpoint"
BIG = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "x" * 300_000}]}).encode()


@pytest.fixture
def request_body_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    mode: str = request.param
    render = envoy_mod.render_bootstrap

    def rendered(cfg: envoy_mod.EnvoyConfig) -> dict[str, Any]:
        boot = render(cfg)
        hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        [ext] = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
        ext["typed_config"]["processing_mode"]["request_body_mode"] = mode
        return boot

    monkeypatch.setattr(envoy_mod, "render_bootstrap", rendered)
    yield mode


async def chunks(data: bytes, n: int) -> AsyncIterator[bytes]:
    """The body in `n` writes, so that Envoy sees it in several chunks."""
    step = -(-len(data) // n)
    for i in range(0, len(data), step):
        yield data[i : i + step]
        await asyncio.sleep(0.02)


async def loaded_pod0(st: Stack) -> None:
    """pod-0 reports a long queue: the EPP picks pod-1."""
    st.backend("pod-0").waiting = 50
    await eventually(
        lambda: st.epp.datastore.get(st.backend("pod-0").address).metrics.waiting == 50,  # type: ignore[union-attr]
        "load scraped",
    )


async def post(st: Stack, data: bytes | AsyncIterator[bytes], dest: str) -> tuple[int, str | None, str]:
    headers = {"content-type": "application/json", DEST: dest}
    async with st.session.post(f"{st.url}/v1/chat/completions", data=data, headers=headers) as r:
        return r.status, r.headers.get("x-served-by"), await r.text()


@pytest.mark.parametrize("request_body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"], indirect=True)
async def test_the_epps_pick_replaces_a_client_sent_destination(request_body_mode: str) -> None:
    async with stack(2) as st:
        await loaded_pod0(st)
        wanted = st.backend("pod-0").address  # what the client asks for
        for data in (BIG, chunks(BIG, 6)):
            status, by, _ = await post(st, data, wanted)
            assert (status, by) == (200, "pod-1")
        assert st.backend("pod-0").requests == []
        assert [r.headers[DEST] for r in st.backend("pod-1").requests] == [st.backend("pod-1").address] * 2
        await st.wait_idle()


@pytest.mark.parametrize("request_body_mode", ["STREAMED", "NONE"], indirect=True)
async def test_a_body_in_a_mode_envoy_routes_on_the_headers_in_is_refused(request_body_mode: str) -> None:
    async with stack(2) as st:
        await loaded_pod0(st)
        wanted = st.backend("pod-0").address
        small = b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}'
        for data in (chunks(BIG, 6), small):
            status, by, text = await post(st, data, wanted)
            assert (status, by) == (500, None), text
            err = json.loads(text)["error"]
            assert err["type"] == "Internal"
            assert f"request_body_mode {request_body_mode} is not supported" in err["message"]
        # Nothing reached a model server, nothing was routed or left in flight.
        assert st.backend("pod-0").requests == [] and st.backend("pod-1").requests == []
        assert await st.metric("epp_rejections_total", status="500", code="Internal") == 2
        assert await st.metric("epp_picks_total") == 0
        # A request without a body is still picked at its headers, by the EPP.
        async with st.session.get(f"{st.url}/v1/models", headers={DEST: wanted}) as r:
            assert r.status == 200 and r.headers.get("x-served-by") == "pod-1"
        await st.wait_idle()


async def raw_http1(st: Stack, head: str) -> tuple[int, str | None]:
    """One HTTP/1.1 request written as is (`head`: request line and headers, without the final CRLF),
    with a zero-length chunked body; (status, x-served-by) of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", st.envoy.listener_port)
    try:
        writer.write(
            f"{head}\r\nconnection: close\r\n\r\n".encode() + (b"0\r\n\r\n" if "chunked" in head else b"")
        )
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    lines = answer.decode("latin-1").split("\r\n")
    served = [line.split(":", 1)[1].strip() for line in lines if line.lower().startswith("x-served-by:")]
    return int(lines[0].split()[1]), served[0] if served else None


@pytest.mark.parametrize("request_body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"], indirect=True)
async def test_an_empty_chunked_body_is_routed_as_a_request_without_a_body(request_body_mode: str) -> None:
    """HTTP/1.1 `transfer-encoding: chunked` with a zero-length body: Envoy sends the request's end as an
    empty body message of its own. The request is picked as one whose headers ended it (`content-length:
    0`), by the EPP: the GET is served, the POST reaches the model server (which judges the empty body)."""
    async with stack(2) as st:
        await loaded_pod0(st)
        wanted = st.backend("pod-0").address  # what the client asks for
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            start = f"{method} {path} HTTP/1.1\r\nhost: x\r\n{DEST}: {wanted}"
            chunked = await raw_http1(st, f"{start}\r\ntransfer-encoding: chunked")
            sized = await raw_http1(st, f"{start}\r\ncontent-length: 0")
            assert chunked == sized == ((200 if method == "GET" else 400), "pod-1"), (method, chunked, sized)
        posted = st.backend("pod-1").served("/v1/chat/completions")
        assert [r.body_len for r in posted] == [0, 0]
        assert all(r.headers[DEST] == st.backend("pod-1").address for r in posted)
        assert st.backend("pod-0").requests == []
        assert await st.metric("epp_rejections_total") == 0
        assert await st.metric("epp_picks_total") == 4
        await st.wait_idle()


@pytest.mark.parametrize("request_body_mode", ["BUFFERED_PARTIAL"], indirect=True)
async def test_a_buffered_partial_body_over_envoys_buffer_is_413_naming_the_limit(
    request_body_mode: str,
) -> None:
    """In BUFFERED_PARTIAL Envoy sends the body once: whole, with its end, when it fits its buffer (routed
    as in BUFFERED), else the part that filled the buffer, without its end (the rest would go on unread).
    That part is refused with 413 naming the limit, not parsed into a 400 blaming the client."""
    limit = 64 * 1024
    async with stack(2, envoy=envoy_mod.EnvoyConfig(per_connection_buffer_limit_bytes=limit)) as st:
        await loaded_pod0(st)
        wanted = st.backend("pod-0").address
        for data in (BIG, chunks(BIG, 6)):
            status, by, text = await post(st, data, wanted)
            assert (status, by) == (413, None), text
            err = json.loads(text)["error"]
            assert err["type"] == "PayloadTooLarge"
            message = err["message"]
            assert "Envoy's buffer limit under request_body_mode BUFFERED_PARTIAL" in message
            assert "per_connection_buffer_limit_bytes" in message and "FULL_DUPLEX_STREAMED" in message
        assert await st.metric("epp_rejections_total", status="413", code="PayloadTooLarge") == 2
        assert st.backend("pod-0").requests == [] and st.backend("pod-1").requests == []
        assert st.epp.body_budget.held == 0  # the part Envoy sent is not held
        # A body within the buffer is routed, by the EPP, as in BUFFERED.
        small = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}).encode()
        assert (await post(st, small, wanted))[:2] == (200, "pod-1")
        assert await st.metric("epp_picks_total") == 1
        await st.wait_idle()
