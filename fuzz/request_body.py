"""Fuzz target: request bodies through the parser and the director (tokenizer, chat template, TTFT
scorer). The first byte picks the API path. A `RequestError` must be a 4xx with a message; anything
else raised is a finding. Run with `python fuzz/run.py request_body SECONDS`."""

from __future__ import annotations

import random
import sys
import tempfile

import atheris

from fuzz import COMPILED

with atheris.instrument_imports(include=["epp"], exclude=COMPILED):
    from epp.config import build_scheduler, default_config
    from epp.costmodel.service import SERVICE_KEY as COST_KEY
    from epp.costmodel.service import CostModel
    from epp.datastore import Datastore
    from epp.kvindex.freshness import FreshnessTracker
    from epp.kvindex.index import BlockIndex
    from epp.kvindex.prompt import TokenizerRegistry
    from epp.kvindex.service import SERVICE_KEY, KvIndexService
    from epp.requests import RequestError
    from epp.scheduling.builtin import default_registry
    from epp.server.director import Director
    from epp.server.metrics import EppMetrics
    from epp.testing.fakes import FakeClock
    from epp.testing.tokenizer import build_tiny_tokenizer
    from epp.types import MetricsSnapshot

PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/other")


def _director() -> Director:
    clock = FakeClock()
    ds = Datastore(clock)
    for i in range(2):
        ds.add_endpoint(f"10.0.0.{i}:80")
        ds.record_metrics(f"10.0.0.{i}:80", MetricsSnapshot(observed_at=clock.now(), waiting=i))
    tokenizers = TokenizerRegistry({"m": build_tiny_tokenizer(tempfile.mkdtemp(prefix="fuzz-tok-"))})
    kv = KvIndexService(BlockIndex(16, 10_000), FreshnessTracker(), tokenizers, 16)
    cost = CostModel()
    services = {SERVICE_KEY: kv, COST_KEY: cost}
    scheduler = build_scheduler(
        default_config(), default_registry(), clock, random.Random(0), services=services
    )
    return Director(ds, scheduler, EppMetrics(), clock, cost=cost)


DIRECTOR = _director()


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    headers = {":path": PATHS[data[0] % len(PATHS)]}
    try:
        routed = DIRECTOR.route(headers, data[1:])
    except RequestError as err:
        if not (400 <= err.status < 500 and err.message):
            raise AssertionError(
                f"a RequestError must be a 4xx with a message: {err.status} {err!r}"
            ) from None
        return
    DIRECTOR.finish(routed, "complete")
    if DIRECTOR.datastore.total_in_flight() != 0:
        raise AssertionError("a finished request is still in flight")


if __name__ == "__main__":
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
