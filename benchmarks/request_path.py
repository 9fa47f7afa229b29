"""The EPP's own work per request, without the network.

Feeds the ext_proc stream state machine the messages Envoy sends for one 4 KB chat
request in duplex mode (headers, body, end of body, response headers, response body, end),
against 16 endpoints with the default profile and metrics recorded. Prints the median
over batches of the time per request.

  python benchmarks/request_path.py [--endpoints 16] [--batches 20] [--per-batch 2000]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's packages first

from epp.clock import MonotonicClock
from epp.config import build_scheduler, default_config
from epp.datastore import Datastore
from epp.scheduling.builtin import default_registry
from epp.server.director import Director
from epp.server.ext_proc import RequestStream
from epp.server.metrics import EppMetrics
from epp.types import MetricsSnapshot


def messages(body: bytes) -> list[pb.ProcessingRequest]:
    def hv(k: str, v: str) -> base_pb2.HeaderValue:
        return base_pb2.HeaderValue(key=k, raw_value=v.encode())

    req_headers = [
        (":path", "/v1/chat/completions"),
        (":method", "POST"),
        (":authority", "gw"),
        ("content-type", "application/json"),
        ("x-request-id", "r1"),
        ("content-length", str(len(body))),
        ("user-agent", "bench"),
    ]
    usage = json.dumps(
        {"id": "x", "usage": {"prompt_tokens": 900, "completion_tokens": 16, "total_tokens": 916}}
    ).encode()
    return [
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=base_pb2.HeaderMap(headers=[hv(k, v) for k, v in req_headers])
            ),
            protocol_config=pb.ProtocolConfiguration(request_body_mode=4, response_body_mode=4),  # type: ignore[arg-type]
        ),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body)),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=b"", end_of_stream=True)),
        pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(
                headers=base_pb2.HeaderMap(
                    headers=[hv(":status", "200"), hv("content-type", "application/json")]
                )
            )
        ),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=usage)),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoints", type=int, default=16)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--per-batch", type=int, default=2000)
    args = ap.parse_args()
    clock = MonotonicClock()
    ds = Datastore(clock)
    for i in range(args.endpoints):
        ep = f"10.0.0.{i}:8000"
        ds.add_endpoint(ep)
        ds.record_metrics(
            ep, MetricsSnapshot(observed_at=clock.now() + 1e6, waiting=i % 3, kv_usage=0.1 * (i % 5))
        )
    sched = build_scheduler(default_config(), default_registry(), clock, random.Random(1), timer=clock)
    director = Director(ds, sched, EppMetrics(), clock)
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "lorem ipsum " * 335}]}
    ).encode()
    msgs = messages(body)

    def one() -> None:
        stream = RequestStream(director, 32 << 20)
        for m in msgs:
            for _ in stream.on_message(m):
                pass
        stream.close()

    for _ in range(args.per_batch):
        one()
    per_request = []
    for _ in range(args.batches):
        t0 = time.perf_counter()
        for _ in range(args.per_batch):
            one()
        per_request.append((time.perf_counter() - t0) / args.per_batch)
    assert ds.total_in_flight() == 0
    print(
        f"EPP request path without network: {args.endpoints} endpoints, {len(body)} B chat body, "
        "default profile"
    )
    print(
        f"per request: median {statistics.median(per_request) * 1e6:.1f} us "
        f"(min {min(per_request) * 1e6:.1f}, max {max(per_request) * 1e6:.1f}) over {args.batches} batches"
    )


if __name__ == "__main__":
    main()
