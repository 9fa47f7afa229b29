"""The real EPP (`EppServer`: ext_proc gRPC on a port-0 loopback socket) on an event loop of its own
thread, so that synchronous hypothesis tests can drive it with a plain gRPC client.

Everything that touches the server's state (datastore, metrics) runs on that loop (`call`), which
keeps the datastore single-writer.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any, TypeVar

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.config import StaticEndpoint, parse_config
from epp.server.app import EppServer, ServerSettings
from epp.server.ext_proc_wire import DESTINATION_HEADER
from epp.testing.wait import eventually

T = TypeVar("T")
DUPLEX, STREAMED, BUFFERED = 4, 1, 2
ENDPOINTS = ("10.0.0.1:8000", "10.0.0.2:8000")
# No staleness filter: the endpoints are never scraped (nothing listens there; the EPP only names them).
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins: [{type: ttft-scorer}, {type: max-score-picker}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: ttft-scorer}, {pluginRef: max-score-picker}]}]
"""
CHAT_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hello there"}]}'


class ServerThread:
    def __init__(self, max_body_bytes: int = ServerSettings().max_body_bytes) -> None:
        self.settings = ServerSettings.loopback(
            refresh_metrics_interval=0,
            max_body_bytes=max_body_bytes,
            seed=1,
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="epp-loop", daemon=True)
        self.server: EppServer | None = None
        self.channel: grpc.Channel | None = None

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> ServerThread:
        self.thread.start()

        async def start() -> EppServer:
            server = EppServer(
                self.settings, parse_config(CONFIG, "hostile.yaml"), [StaticEndpoint(a) for a in ENDPOINTS]
            )
            await server.start()
            return server

        self.server = self.call(start())
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{self.server.grpc_port}",
            options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)],
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.server is not None:
            self.call(self.server.stop(grace=0.2))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    @property
    def epp(self) -> EppServer:
        assert self.server is not None
        return self.server

    def process(
        self, messages: Iterable[pb.ProcessingRequest], timeout: float = 30.0
    ) -> list[pb.ProcessingResponse]:
        """One ext_proc stream: send the messages (then half-close), read every response."""
        assert self.channel is not None
        stub = pb_grpc.ExternalProcessorStub(self.channel)
        return list(stub.Process(iter(messages), timeout=timeout))

    def stream(
        self, messages: Iterator[pb.ProcessingRequest], timeout: float = 60.0
    ) -> Iterator[pb.ProcessingResponse]:
        assert self.channel is not None
        stub = pb_grpc.ExternalProcessorStub(self.channel)
        return stub.Process(messages, timeout=timeout)  # type: ignore[no-any-return]

    def sample_sum(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (read on the server's loop)."""

        async def read() -> float:
            total = 0.0
            for family in self.epp.metrics.registry.collect():
                for s in family.samples:
                    if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                        total += s.value
            return total

        return self.call(read())

    def wait_idle(self) -> None:
        ds = self.epp.datastore
        self.call(eventually(lambda: ds.total_in_flight() == 0, "in-flight back to zero"))

    def in_flight(self) -> int:
        async def read() -> int:
            return self.epp.datastore.total_in_flight()

        return self.call(read())

    def assert_serves(self) -> None:
        """A normal duplex request still gets a destination, and is released when its stream ends."""
        out = self.process([headers(), body(CHAT_BODY, True)])
        assert destination(out[0]) in ENDPOINTS, out
        assert b"".join(echoed(out[1:])) == CHAT_BODY
        self.wait_idle()


def headers(
    eos: bool = False,
    mode: int | None = DUPLEX,
    response_mode: int = DUPLEX,
    path: bytes = b"/v1/chat/completions",
    extra: Iterable[tuple[str, bytes]] = (),
) -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=path),
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
            *(base_pb2.HeaderValue(key=k, raw_value=v) for k, v in extra),
        ]
    )
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=eos))
    if mode is not None:
        req.protocol_config.request_body_mode = mode  # type: ignore[assignment]
        req.protocol_config.response_body_mode = response_mode  # type: ignore[assignment]
    return req


def body(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def destination(resp: pb.ProcessingResponse) -> str:
    common = resp.request_headers.response if resp.HasField("request_headers") else resp.request_body.response
    found = [
        h.header.raw_value.decode()
        for h in common.header_mutation.set_headers
        if h.header.key == DESTINATION_HEADER
    ]
    assert len(found) == 1, resp
    return found[0]


def echoed(responses: Iterable[pb.ProcessingResponse]) -> Iterator[bytes]:
    for r in responses:
        assert r.HasField("request_body"), r
        yield r.request_body.response.body_mutation.streamed_response.body
