"""A request body that does not complete within `--request-body-timeout` of its headers: what it held goes
back to the shared body budget (so slow or stalled uploads cannot lock other requests out of it), the
refusal is counted, the stream's next message is answered 408, and other requests route meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.config import StaticEndpoint, parse_config
from epp.server.app import EppServer, ServerSettings
from epp.testing.wait import eventually

DUPLEX = 4
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins: [{type: ttft-scorer}, {type: max-score-picker}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: ttft-scorer}, {pluginRef: max-score-picker}]}]
"""
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hello there"}]}'


def headers() -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        ]
    )
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=hm),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=DUPLEX, response_body_mode=DUPLEX),  # type: ignore[arg-type]
    )


def chunk(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


class Feed:
    """A request iterator the test feeds one message at a time."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()

    async def __aiter__(self) -> AsyncIterator[pb.ProcessingRequest]:
        while (msg := await self.queue.get()) is not None:
            yield msg


async def test_a_stalled_body_gives_its_budget_back_and_is_refused_with_408() -> None:
    settings = ServerSettings.loopback(
        refresh_metrics_interval=0,
        request_body_timeout=1.5,  # long enough for the 503 below to come first on a busy machine
        max_buffered_body_bytes=4096,
        max_body_bytes=4096,
        seed=1,
    )
    epp = EppServer(settings, parse_config(CONFIG, "c.yaml"), [StaticEndpoint("10.0.0.1:8000")])
    await epp.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
            stub = pb_grpc.ExternalProcessorStub(ch)
            stalled = Feed()
            call = stub.Process(stalled.__aiter__())
            await stalled.queue.put(headers())
            await stalled.queue.put(chunk(b"x" * 3000, False))  # most of the 4 KiB budget, never finished
            budget = epp.body_budget
            await eventually(lambda: budget.held == 3000, "the partial body held")

            # Meanwhile another request cannot take the budget: 503.
            other = stub.Process(iter([headers(), chunk(BODY + b" " * 2000, True)]))
            [refused] = [r async for r in other]
            assert refused.immediate_response.status.code == 503

            await eventually(lambda: budget.held == 0, "the stalled body's bytes given back")
            timeouts = {"status": "408", "code": "RequestTimeout"}
            assert epp.metrics.registry.get_sample_value("epp_rejections_total", timeouts) == 1

            # Now a request routes; the stalled stream's next chunk gets 408 and nothing is in flight.
            ok = stub.Process(iter([headers(), chunk(BODY, True)]))
            answers = [r async for r in ok]
            assert answers[0].request_headers.response.header_mutation.set_headers
            await stalled.queue.put(chunk(b"y", True))
            first = await call.read()
            assert first.immediate_response.status.code == 408
            assert b"--request-body-timeout" in first.immediate_response.body
            await stalled.queue.put(None)
            await eventually(lambda: epp.datastore.total_in_flight() == 0, "nothing in flight")
            assert epp.metrics.registry.get_sample_value("epp_rejections_total", timeouts) == 1
    finally:
        await epp.stop(grace=0.2)
