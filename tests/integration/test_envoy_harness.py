"""The real-Envoy harness (epp.testing.envoy) and the fake model server (epp.testing.backend).

Only 127.0.0.1; no timing assertions; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format
from prometheus_client.parser import text_string_to_metric_families

from epp.server.tls import self_signed
from epp.testing.backend import FakeModelServer, start_backends, stop_backends
from epp.testing.envoy import (
    SUBSET_HINT_KEY,
    SUBSET_HINT_NAMESPACE,
    EnvoyConfig,
    EnvoyError,
    EnvoyProcess,
    free_port,
    render_bootstrap,
    validate_bootstrap,
)

from .stack import ENVOY_MARKS

pytestmark = ENVOY_MARKS

DEST = "x-gateway-destination-endpoint"
HINT_HEADER = "x-test-subset-hint"
TIMEOUT = aiohttp.ClientTimeout(total=30)


# ---- (a) every bootstrap variant passes `envoy --mode validate` ---------------------------------------
VARIANTS: dict[str, EnvoyConfig] = {
    "direct": EnvoyConfig(ext_proc=False),
    "duplex": EnvoyConfig(),
    "duplex-resp-streamed": EnvoyConfig(response_body_mode="STREAMED"),
    "duplex-resp-none": EnvoyConfig(response_body_mode="NONE"),
    "duplex-no-response-phase": EnvoyConfig(response_header_mode="SKIP", response_body_mode="NONE"),
    "buffered": EnvoyConfig(request_body_mode="BUFFERED", response_body_mode="NONE"),
    "buffered-resp-buffered": EnvoyConfig(request_body_mode="BUFFERED", response_body_mode="BUFFERED"),
    "tls": EnvoyConfig(epp_tls=True),
    "subset-hint-header": EnvoyConfig(subset_hint_from_header=HINT_HEADER),
    "subset-hint-static": EnvoyConfig(subset_hint_static=("127.0.0.1:8000", "127.0.0.1:8001")),
    "subset-hint-both-tls-buffered": EnvoyConfig(
        epp_tls=True,
        request_body_mode="BUFFERED",
        subset_hint_from_header=HINT_HEADER,
        subset_hint_static=("127.0.0.1:8000",),
    ),
    "tuned": EnvoyConfig(
        message_timeout_s=300,
        route_timeout_s=0,
        connect_timeout_s=0.5,
        per_connection_buffer_limit_bytes=8 << 20,
        failure_mode_allow=True,
    ),
    "override-host": EnvoyConfig(
        pool="override_host", pool_endpoints=("127.0.0.1:8000", "127.0.0.1:8001"), retries=2
    ),
    "override-host-direct": EnvoyConfig(
        ext_proc=False, pool="override_host", pool_endpoints=("127.0.0.1:8000",)
    ),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_bootstrap_variant_validates(name: str) -> None:
    validate_bootstrap(replace(VARIANTS[name], listener_port=free_port(), admin_port=free_port()))


def test_validate_reports_rejection() -> None:
    with pytest.raises(EnvoyError, match="rejected"):
        validate_bootstrap(EnvoyConfig(epp_host="not-an-ip"))  # STATIC clusters need IP addresses


def test_bootstrap_shape() -> None:
    boot = render_bootstrap(EnvoyConfig(subset_hint_from_header=HINT_HEADER))
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == [
        "envoy.filters.http.header_to_metadata",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    ext = hcm["http_filters"][1]["typed_config"]
    assert ext["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert ext["processing_mode"]["request_trailer_mode"] == "SEND"
    assert ext["metadata_options"]["receiving_namespaces"]["untyped"] == ["envoy.lb"]
    assert ext["metadata_options"]["forwarding_namespaces"]["untyped"] == [SUBSET_HINT_NAMESPACE]
    direct = render_bootstrap(EnvoyConfig(ext_proc=False))
    assert [c["name"] for c in direct["static_resources"]["clusters"]] == ["pool"]
    with pytest.raises(ValueError):
        EnvoyConfig(request_body_mode="STREAMED")  # type: ignore[arg-type]


# ---- (b) direct mode: the client names the backend ---------------------------------------------------
@pytest.fixture
async def backends() -> AsyncIterator[list[FakeModelServer]]:
    servers = await start_backends(3)
    yield servers
    await stop_backends(servers)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        yield s


def sse_events(text: str) -> list[str]:
    return [block[len("data: ") :] for block in text.split("\n\n") if block.startswith("data: ")]


async def test_direct_routes_to_named_backend(
    backends: list[FakeModelServer], session: aiohttp.ClientSession
) -> None:
    async with EnvoyProcess(EnvoyConfig(ext_proc=False)) as envoy:
        for round_ in range(2):
            for i, target in enumerate(backends):
                path = "/v1/completions" if round_ == 0 else "/v1/chat/completions"
                body: dict[str, Any] = (
                    {"model": "m", "prompt": f"hello {i}"}
                    if round_ == 0
                    else {"model": "m", "messages": [{"role": "user", "content": f"hello {i}"}]}
                )
                async with session.post(envoy.url + path, json=body, headers={DEST: target.address}) as r:
                    assert r.status == 200
                    assert r.headers["x-served-by"] == target.name
                    doc = await r.json()
                assert doc["served_by"] == target.name
                assert set(doc["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"}
                assert doc["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        for target in backends:
            assert len(target.requests) == 2
            assert {r.path for r in target.requests} == {"/v1/completions", "/v1/chat/completions"}
            assert all(r.headers[DEST] == target.address for r in target.requests)

        # A 5 MB body arrives intact on exactly the named backend.
        big = json.dumps({"model": "m", "prompt": "x" * 5_000_000}).encode()
        async with session.post(
            envoy.url + "/v1/completions",
            data=big,
            headers={DEST: backends[2].address, "content-type": "application/json"},
        ) as r:
            assert r.status == 200 and r.headers["x-served-by"] == backends[2].name
        last = backends[2].requests[-1]
        assert last.body_len == len(big)
        assert last.body_sha256 == hashlib.sha256(big).hexdigest()
        assert [len(b.requests) for b in backends] == [2, 2, 3]

        # An SSE stream arrives whole, with the usage chunk and [DONE].
        backends[1].num_chunks = 6
        stream_body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with session.post(
            envoy.url + "/v1/chat/completions", json=stream_body, headers={DEST: backends[1].address}
        ) as r:
            assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(await r.text())
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len(chunks) == 7 and all(c["served_by"] == backends[1].name for c in chunks)
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[:-1]) == "".join(
            f"tok{i} " for i in range(6)
        )
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6

        # No destination header: ORIGINAL_DST has no host and Envoy answers 503 itself.
        async with session.post(envoy.url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            assert r.status == 503
        assert [len(b.requests) for b in backends] == [2, 3, 3]


# ---- (c) the fake server's /metrics in every mode ----------------------------------------------------
async def test_fake_metrics_modes(session: aiohttp.ClientSession) -> None:
    async with FakeModelServer("m0", model="tiny", waiting=3, running=2, kv_usage=0.25) as srv:
        async with session.get(f"{srv.url}/metrics") as r:
            assert r.status == 200
            text = await r.text()
        samples = {
            (s.name, s.labels.get("model_name")): s
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }
        assert samples[("vllm:num_requests_waiting", "tiny")].value == 3
        assert samples[("vllm:num_requests_running", "tiny")].value == 2
        assert samples[("vllm:kv_cache_usage_perc", "tiny")].value == 0.25
        assert samples[("vllm:num_requests_waiting", "tiny")].labels["engine"] == "0"
        info = samples[("vllm:cache_config_info", None)]
        assert info.value == 1 and info.labels["block_size"] == "16"
        assert any(name == "vllm:time_to_first_token_seconds_bucket" for name, _ in samples)

        srv.set_knobs(waiting=7, kv_usage=0.5)
        async with session.get(f"{srv.url}/metrics") as r:
            assert 'vllm:num_requests_waiting{engine="0",model_name="tiny"} 7.0' in await r.text()

        srv.metrics_mode = "error500"
        async with session.get(f"{srv.url}/metrics") as r:
            assert r.status == 500

        srv.metrics_mode = "garbage"
        async with session.get(f"{srv.url}/metrics") as r:
            assert r.status == 200
            garbage = await r.text()
        with pytest.raises(ValueError):
            list(text_string_to_metric_families(garbage))

        # Knobs also over HTTP, for servers in another process.
        async with session.post(f"{srv.url}/fake/knobs", json={"metrics_mode": "hang"}) as r:
            assert r.status == 200 and (await r.json())["metrics_mode"] == "hang"
        async with session.post(f"{srv.url}/fake/knobs", json={"metrics_mode": "nope"}) as r:
            assert r.status == 400
        with pytest.raises(asyncio.TimeoutError):
            async with session.get(f"{srv.url}/metrics", timeout=aiohttp.ClientTimeout(total=0.3)):
                pass

        async def scrape() -> int:
            async with session.get(f"{srv.url}/metrics") as r:
                return r.status

        hung = asyncio.create_task(scrape())
        for _ in range(100):
            if srv.metrics_scrapes == 6:
                break
            await asyncio.sleep(0.02)
        await asyncio.wait_for(srv.stop(), 10)  # a hung scrape does not block shutdown
        try:
            status = await asyncio.wait_for(hung, 10)
        except aiohttp.ClientError:
            status = None
        assert status != 200  # released by stop(): 503 or a closed connection, never metrics
    assert srv.metrics_scrapes == 6


async def test_fake_server_basics(session: aiohttp.ClientSession) -> None:
    async with FakeModelServer("solo", num_chunks=3) as srv:
        assert srv.address == f"127.0.0.1:{srv.port}"
        async with session.get(f"{srv.url}/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "fake-model"
        async with session.get(f"{srv.url}/health") as r:
            assert r.status == 200
        async with session.post(f"{srv.url}/v1/completions", data=b"not json") as r:
            assert r.status == 400 and r.headers["x-served-by"] == "solo"
        async with session.post(
            f"{srv.url}/v1/completions", json={"model": "m", "prompt": "p", "stream": True}
        ) as r:
            events = sse_events(await r.text())
        assert len(events) == 4 and events[-1] == "[DONE]"  # no usage chunk unless include_usage
        assert srv.requests[0].json is None
        assert srv.requests[1].json == {"model": "m", "prompt": "p", "stream": True}


async def test_backend_cli(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    port_file = tmp_path / "ports"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.testing.backend", "--count", "3", "--port-file", str(port_file)
    )
    try:
        for _ in range(200):
            if port_file.exists() or proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
        addresses = port_file.read_text().split()
        assert len(addresses) == 3
        for i, addr in enumerate(addresses):
            async with session.get(f"http://{addr}/health") as r:
                assert r.status == 200 and r.headers["x-served-by"] == f"pod-{i}"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0


# ---- (d) the ext_proc paths, with a minimal processor (not the real EPP) -----------------------------
class MiniProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Routes to ``pick(metadata_context)``; echoes duplex bodies, routes BUFFERED ones in the body reply."""

    def __init__(self, pick: Callable[[dict[str, Any]], str], buffered: bool = False) -> None:
        self.pick, self.buffered = pick, buffered
        self.metadata: list[dict[str, Any]] = []

    @staticmethod
    def _route(dest: str | None) -> pb.CommonResponse:
        common = pb.CommonResponse(clear_route_cache=dest is not None)
        if dest is not None:
            common.header_mutation.set_headers.append(
                base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=DEST, raw_value=dest.encode()))
            )
        return common

    @staticmethod
    def _echo(body: bytes, end: bool) -> pb.CommonResponse:
        return pb.CommonResponse(
            body_mutation=pb.BodyMutation(
                streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=end)
            )
        )

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        body, md = bytearray(), {}
        async for req in request_iterator:
            kind = req.WhichOneof("request")
            if kind == "request_headers":
                md = json_format.MessageToDict(req.metadata_context)
                self.metadata.append(md)
                eos = req.request_headers.end_of_stream
                if eos or self.buffered:
                    route = self._route(self.pick(md) if eos else None)
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=route))
            elif kind == "request_body" and self.buffered:
                yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=self._route(self.pick(md))))
            elif kind == "request_body":
                body += req.request_body.body
                if req.request_body.end_of_stream:  # deferred headers response, then the echoed body
                    yield pb.ProcessingResponse(
                        request_headers=pb.HeadersResponse(response=self._route(self.pick(md)))
                    )
                    data, step = bytes(body), 62_000
                    for i in range(0, max(len(data), 1), step):
                        yield pb.ProcessingResponse(
                            request_body=pb.BodyResponse(
                                response=self._echo(data[i : i + step], i + step >= len(data))
                            )
                        )
            elif kind == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif kind == "response_body":
                rb = req.response_body
                yield pb.ProcessingResponse(
                    response_body=pb.BodyResponse(
                        response=None if self.buffered else self._echo(rb.body, rb.end_of_stream)
                    )
                )
            elif kind == "request_trailers":
                yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            elif kind == "response_trailers":
                yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def hint_of(md: dict[str, Any]) -> list[str] | None:
    hint = md.get("filterMetadata", {}).get(SUBSET_HINT_NAMESPACE, {}).get(SUBSET_HINT_KEY)
    if hint is None:
        return None
    return hint.split(",") if isinstance(hint, str) else list(hint)


async def run_processor(proc: MiniProcessor, tls: bool = False) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(proc, server)
    if tls:
        crt, key = self_signed()
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, crt)]))
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_ext_proc_duplex_and_subset_hints(
    backends: list[FakeModelServer], session: aiohttp.ClientSession, tls: bool
) -> None:
    def pick(md: dict[str, Any]) -> str:
        hint = hint_of(md)
        return hint[-1] if hint else backends[0].address

    proc = MiniProcessor(pick)
    server, port = await run_processor(proc, tls)
    cfg = EnvoyConfig(
        epp_port=port,
        epp_tls=tls,
        subset_hint_from_header=HINT_HEADER,
        subset_hint_static=(backends[1].address,),
        message_timeout_s=10,
    )
    try:
        async with EnvoyProcess(cfg) as envoy:
            req = {"model": "m", "prompt": "hi"}
            async with session.post(envoy.url + "/v1/completions", json=req) as r:
                assert r.status == 200 and r.headers["x-served-by"] == backends[1].name
            assert hint_of(proc.metadata[-1]) == [backends[1].address]  # static hint: a list
            header_hint = f"{backends[0].address},{backends[2].address}"
            async with session.post(
                envoy.url + "/v1/completions", json=req, headers={HINT_HEADER: header_hint}
            ) as r:
                assert r.status == 200 and r.headers["x-served-by"] == backends[2].name
            raw = proc.metadata[-1]["filterMetadata"][SUBSET_HINT_NAMESPACE][SUBSET_HINT_KEY]
            assert raw == header_hint  # header hint: one comma-joined string, overriding the static one
            assert HINT_HEADER not in backends[2].requests[-1].headers  # the header itself is removed

            big = json.dumps({"model": "m", "prompt": "y" * 5_000_000}).encode()
            async with session.post(
                envoy.url + "/v1/completions", data=big, headers={"content-type": "application/json"}
            ) as r:
                assert r.status == 200 and r.headers["x-served-by"] == backends[1].name
            assert backends[1].requests[-1].body_sha256 == hashlib.sha256(big).hexdigest()
    finally:
        await server.stop(None)


async def test_ext_proc_buffered_routes_and_limits(
    backends: list[FakeModelServer], session: aiohttp.ClientSession
) -> None:
    proc = MiniProcessor(lambda md: backends[2].address, buffered=True)
    server, port = await run_processor(proc)
    cfg = EnvoyConfig(
        epp_port=port, request_body_mode="BUFFERED", response_body_mode="NONE", message_timeout_s=10
    )
    try:
        async with EnvoyProcess(cfg) as envoy:
            ok = json.dumps({"model": "m", "prompt": "z" * 500_000}).encode()
            async with session.post(envoy.url + "/v1/completions", data=ok) as r:
                assert r.status == 200 and r.headers["x-served-by"] == backends[2].name
            assert backends[2].requests[-1].body_sha256 == hashlib.sha256(ok).hexdigest()
            too_big = json.dumps({"model": "m", "prompt": "z" * 2_000_000}).encode()
            async with session.post(envoy.url + "/v1/completions", data=too_big) as r:
                assert r.status == 413  # above per_connection_buffer_limit_bytes (1 MiB)
            assert len(backends[2].requests) == 1
    finally:
        await server.stop(None)
