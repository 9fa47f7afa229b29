"""A trivial ext_proc server for reference: fixed destination, no parsing, no scheduling.

It does only what Envoy's duplex protocol requires (hold the headers answer until the body
ends, echo the body, echo response chunks), so its added latency is the floor for any
Python ext_proc server on this machine. `overhead.py` measures it beside the EPP.

  python benchmarks/trivial_ext_proc.py --port P --destination 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
from collections.abc import AsyncIterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's packages first

from epp.server.ext_proc_wire import echo  # the same answer shape as the EPP's


class Trivial(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, destination: str) -> None:
        header = base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="x-gateway-destination-endpoint", raw_value=destination.encode())
        )
        self.headers_response = pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(
                response=pb.CommonResponse(
                    header_mutation=pb.HeaderMutation(set_headers=[header]), clear_route_cache=True
                )
            )
        )

    async def Process(
        self, it: AsyncIterator[pb.ProcessingRequest], ctx: object
    ) -> AsyncIterator[pb.ProcessingResponse]:
        body: list[bytes] = []
        async for msg in it:
            which = msg.WhichOneof("request")
            if which == "request_headers":
                if msg.request_headers.end_of_stream:
                    yield self.headers_response
            elif which == "request_body":
                body.append(msg.request_body.body)
                if msg.request_body.end_of_stream:
                    yield self.headers_response
                    yield echo(b"".join(body), True, False)
            elif which == "request_trailers":
                yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            elif which == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif which == "response_body":
                yield echo(msg.response_body.body, msg.response_body.end_of_stream, True)
            elif which == "response_trailers":
                yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


async def serve(port: int, destination: str) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Trivial(destination), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--destination", required=True)
    a = ap.parse_args()
    asyncio.run(serve(a.port, a.destination))
