"""The soak benchmark's pure parts: interval quantiles from histogram deltas, failure classes, RSS growth."""

from __future__ import annotations

import math

import pytest

from benchmarks.soak_parts import (
    Failure,
    Outage,
    Traffic,
    TrafficSpec,
    bucket_delta,
    classify,
    count_classes,
    histogram_buckets,
    histogram_quantile,
    rss_growth,
)

NAME = "inference_extension_scheduler_e2e_duration_seconds"


def _text(counts: dict[str, int]) -> str:
    lines = ["# HELP x", f"# TYPE {NAME} histogram"]
    lines += [f'{NAME}_bucket{{le="{le}"}} {float(n)}' for le, n in counts.items()]
    lines.append(f"{NAME}_count {float(list(counts.values())[-1])}")
    lines.append('other_bucket{le="0.001"} 99.0')
    return "\n".join(lines)


def test_buckets_parse_only_the_named_histogram() -> None:
    b = histogram_buckets(_text({"0.001": 3, "0.002": 5, "+Inf": 6}), NAME)
    assert b == {0.001: 3.0, 0.002: 5.0, math.inf: 6.0}
    assert histogram_buckets("garbage\n", NAME) == {}


def test_interval_quantiles_come_from_the_delta_not_the_totals() -> None:
    before = histogram_buckets(_text({"0.001": 100, "0.002": 100, "0.004": 100, "+Inf": 100}), NAME)
    now = histogram_buckets(_text({"0.001": 100, "0.002": 100, "0.004": 200, "+Inf": 200}), NAME)
    delta = bucket_delta(now, before)
    # the 100 new observations all fell in (2 ms, 4 ms]: the median interpolates to 3 ms
    assert histogram_quantile(0.5, delta) == pytest.approx(0.003)
    assert histogram_quantile(0.99, delta) == pytest.approx(0.00398)
    # over the totals the median would be the first bucket's
    assert histogram_quantile(0.5, now) == pytest.approx(0.001)


def test_quantile_edges() -> None:
    assert histogram_quantile(0.5, {}) is None
    assert histogram_quantile(0.5, {0.001: 0.0, math.inf: 0.0}) is None
    # everything above the last finite bound: the bound, as Prometheus does
    assert histogram_quantile(0.99, {0.001: 0.0, 1.0: 0.0, math.inf: 5.0}) == 1.0
    # a counter that went back (a restarted EPP) counts nothing rather than negative
    assert bucket_delta({0.001: 1.0}, {0.001: 5.0}) == {0.001: 0.0}
    with pytest.raises(ValueError, match="quantile must be in"):
        histogram_quantile(1.5, {0.001: 1.0})


POD, OTHER = "127.0.0.1:8001", "127.0.0.1:8002"
OUT = [Outage(POD, down_at=100.0, up_at=106.0)]
RESET = "upstream connect error or disconnect/reset before headers. reset reason: connection failure"


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        # the EPP answered itself
        (
            Failure(10.0, 10.1, 503, '{"error": {"message": "inference error: ServiceUnavailable - x"}}'),
            "epp",
        ),
        # Envoy's own 5xx without an upstream cause: the ext_proc stream failed
        (Failure(10.0, 10.1, 500, ""), "epp"),
        # in flight when the pod was killed
        (Failure(99.0, 100.2, 0, "ClientPayloadError: truncated", POD), "engine"),
        # sent 0.5 s after the kill: the EPP could not know yet
        (Failure(100.5, 100.6, 503, RESET, POD), "engine"),
        # sent 3 s after the kill: the EPP had time to see it go
        (Failure(103.0, 103.1, 503, RESET, POD), "epp"),
        # a connection failure on a pod with no outage
        (Failure(103.0, 103.1, 503, RESET, OTHER), "unexplained"),
        # after the pod came back: nothing explains it
        (Failure(107.0, 107.1, 503, RESET, POD), "unexplained"),
        # the engine's own 5xx
        (Failure(50.0, 50.1, 500, '{"error": {"message": "engine failed"}}', POD), "engine"),
        # a 4xx from the engine: the workload's fault, not explained by any outage
        (Failure(50.0, 50.1, 400, '{"error": {"message": "bad"}}', POD), "unexplained"),
        # no endpoint known (no header on a transport error): any overlapping outage
        (Failure(100.3, 100.4, 0, "ServerDisconnectedError", None), "engine"),
    ],
)
def test_failure_classes(failure: Failure, expected: str) -> None:
    assert classify(failure, OUT, know_after_s=1.15) == expected


def test_still_down_pod_and_counts() -> None:
    still_down = [Outage(POD, 100.0, None)]
    late = Failure(200.0, 200.1, 503, RESET, POD)
    assert classify(late, still_down, 1.15) == "epp"
    counts = count_classes([late, Failure(100.1, 100.2, 503, RESET, POD)], still_down, 1.15)
    assert counts == {"epp": 1, "engine": 1, "unexplained": 0}


def test_rss_growth_after_warmup() -> None:
    samples = [(0.0, 100), (60.0, 150), (120.0, 200), (180.0, 210), (240.0, 205)]
    assert rss_growth(samples, 100.0) == (200, 210, pytest.approx(0.05))
    assert rss_growth(samples, 1000.0) is None
    assert rss_growth([], 0.0) is None


def test_traffic_is_seeded_and_mixed() -> None:
    spec = TrafficSpec(system_tokens=20, question_tokens=5, chat_system_tokens=5, conversations=2, turns=2)
    a, b = Traffic(spec, 1), Traffic(spec, 1)
    first = [a.next() for _ in range(60)]
    assert first == [b.next() for _ in range(60)]
    assert {kind for kind, _ in first} == {"shared", "chat", "unique"}
    # shared requests from different load processes share the group prompts
    other = Traffic(spec, 2)
    assert other.systems == a.systems
    # a chat's next turn extends the previous one (system, question, answer, question)
    turns = [m for kind, m in first if kind == "chat"]
    assert any(len(m) == 4 for m in turns) and any(len(m) == 2 for m in turns)


def test_bad_traffic_spec_names_the_field() -> None:
    with pytest.raises(ValueError, match="groups must be >= 1"):
        TrafficSpec(groups=0).check()
    with pytest.raises(ValueError, match="weights"):
        TrafficSpec(shared_weight=0, chat_weight=0, unique_weight=0).check()
