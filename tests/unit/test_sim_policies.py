"""Every simulator policy is an EPP config that builds with the production registry."""

from __future__ import annotations

import random

import pytest

from epp.config import build_scheduler
from epp.costmodel.service import SERVICE_KEY as COST_KEY
from epp.costmodel.service import CostModel
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.service import SERVICE_KEY, KvIndexService
from epp.scheduling.builtin import default_registry
from epp.testing.fakes import FakeClock, endpoint, token_request
from simulator import policies

EXPECTED = [
    "dynamo-kv",
    "gie-default",
    "least-load",
    "llm-d-precise",
    "random",
    "round-robin",
    "sglang-cache-aware",
    "ttft",
    "oracle",
]


def test_the_issue_s_policies_are_all_there() -> None:
    assert policies.names() == EXPECTED


@pytest.mark.parametrize("name", EXPECTED)
def test_every_policy_builds_and_picks(name: str) -> None:
    svc = KvIndexService(BlockIndex(16, 10_000), FreshnessTracker(), TokenizerRegistry({}), 16)
    services = {SERVICE_KEY: svc, COST_KEY: CostModel()}
    sched = build_scheduler(
        policies.load(name), default_registry(), FakeClock(1000.0), random.Random(0), services=services
    )
    eps = [endpoint(f"10.0.0.{i}:80") for i in range(3)]
    decision = sched.schedule(token_request(list(range(100))), eps).decision
    assert decision.primary in {e.id for e in eps}


def test_an_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="known: dynamo-kv, gie-default"):
        policies.config_text("best-effort")


@pytest.mark.parametrize("seed", range(5))
def test_least_load_is_not_random_when_nothing_waits(seed: int) -> None:
    """At low load nothing waits anywhere: least-load then picks the pod with the fewest requests in
    flight (a queue-only policy would pick at random); a queue, when there is one, comes first."""
    sched = build_scheduler(
        policies.load("least-load"), default_registry(), FakeClock(1000.0), random.Random(seed), services={}
    )
    idle = [endpoint("10.0.0.1:80", in_flight=3), endpoint("10.0.0.2:80", in_flight=1)]
    assert sched.schedule(token_request([1, 2, 3]), idle).decision.primary == "10.0.0.2:80"
    queued = [endpoint("10.0.0.1:80", in_flight=3), endpoint("10.0.0.2:80", waiting=2, in_flight=1)]
    assert sched.schedule(token_request([1, 2, 3]), queued).decision.primary == "10.0.0.1:80"
