"""The cluster skips the scrape rounds of idle gaps, and that changes nothing: the records, the summary
and what the router sees at every arrival are the same as with every round run; only the rounds (and the
run time of long gaps) drop. `Kernel.repeat_before` lands on the very float the chain of scrapes would."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import random
import time
from typing import Any

import pytest

from epp.config import parse_config
from epp.types import Endpoint
from simulator import policies, replay
from simulator.cli import main
from simulator.cluster import Cluster, ClusterConfig
from simulator.engine import EngineConfig
from simulator.kernel import repeat_before
from simulator.results import REJECTED
from simulator.traces import TraceRequest, agentic, multi_turn, shared_prefix

QUICK = ["replay", "--no-progress", "--jobs", "1", "--pods", "2", "--num-gpu-blocks", "1024"]


def chain(start: float, delay: float, limit: float) -> tuple[float, int]:
    """What `repeat_before` computes, one addition at a time (as the scrapes schedule each other)."""
    t, n = start, 0
    while True:
        a = t + delay
        if not a < limit or not a > t:
            return t, n
        t, n = a, n + 1


# -- the arithmetic ----------------------------------------------------------------------------------


def test_repeat_before_is_the_chain_of_additions_exactly() -> None:
    rng = random.Random(7)
    for _ in range(400):
        delay = rng.choice(
            [
                0.05,
                0.1,
                1 / 3,
                1e-3,
                0.013,
                0.7,
                rng.random(),
                rng.random() * 1e-2,
                2.0 ** -rng.randint(1, 20),
            ]
        )
        start = rng.choice(
            [0.0, delay, rng.random() * 1000, float(rng.randint(0, 2**20)), 2.0 ** rng.randint(-3, 30)]
        )
        steps = rng.choice([0, 1, 2, 3, 5, 100, 10_000, 100_000])
        limit = (
            start
            + steps * delay
            + rng.choice([0.0, delay / 2, -delay / 2, delay * 1e-9, rng.random() * delay])
        )
        assert repeat_before(start, delay, limit) == chain(start, delay, limit), (start, delay, limit)


def test_repeat_before_with_ties_and_a_clock_that_cannot_move() -> None:
    """A delay of m + 1/2 ulps rounds to even: the first step of a binade may differ from the next."""
    for e in range(1, 30):
        ulp = 2.0 ** (e - 52)
        for m in (0, 1, 2, 3):
            delay = m * ulp + ulp / 2
            for offset in (0, 1, 5):
                start = 2.0**e + offset * ulp
                limit = start + 20_000 * delay
                assert repeat_before(start, delay, limit) == chain(start, delay, limit), (e, m, offset)
    assert repeat_before(2.0**24, 1e-9, 2.0**25) == (2.0**24, 0)  # 1e-9 is below half an ulp there
    assert repeat_before(5.0, 0.05, 5.0) == (5.0, 0) and repeat_before(5.0, 0.05, 5.05) == (5.0, 0)


def test_repeat_before_crosses_years_in_a_few_steps() -> None:
    began = time.perf_counter()
    at, rounds = repeat_before(0.0, 0.05, 1e8)
    assert time.perf_counter() - began < 0.05
    assert at < 1e8 <= at + 0.05 and rounds == 2_000_000_072  # (the chain drifts from 0.05 x k)


# -- the cluster -------------------------------------------------------------------------------------


def two_bursts(base: list[TraceRequest], gap: float) -> list[TraceRequest]:
    """`base`, then `base` again `gap` seconds later."""
    n = len(base)
    late = [dataclasses.replace(r, arrival=r.arrival + gap, index=r.index + n) for r in base]
    return [*base, *late]


def run(text: str, trace: list[TraceRequest], cfg: ClusterConfig, skip: bool, oracle: bool = False) -> Any:
    """The records, picks, final time, scrape rounds, and at every arrival the candidates' views and the
    KV freshness tracker's state per pod."""
    c = Cluster(parse_config(text, "p.yaml"), cfg, oracle=oracle, skip_idle_scrapes=skip)
    seen: list[tuple[float, list[Endpoint], list[tuple[str, dict[str, Any]]]]] = []
    schedule = c.scheduler.schedule

    def watched(request: Any, candidates: list[Endpoint]) -> Any:
        pods = [(pod, dataclasses.asdict(state)) for pod, state in c.freshness._pods.items()]
        seen.append((c.kernel.now(), list(candidates), pods))
        return schedule(request, candidates)

    c.scheduler.schedule = watched  # type: ignore[method-assign]
    records = [dataclasses.astuple(r) for r in sorted(c.run(trace), key=lambda r: r.index)]
    return records, dict(c.modes), c.kernel.now(), seen, c.scrape_rounds


TTFT = policies.config_text("ttft")
TIGHT = TTFT.replace("maxAge: 2s", "maxAge: 50ms")  # as old as the scrape interval allows


@pytest.mark.parametrize(
    ("workload", "interval", "delay", "loss"),
    [
        ("shared-prefix", 0.05, 0.002, 0.0),
        ("shared-prefix", 0.013, 0.05, 0.2),  # messages still in the inbox when the engines go idle
        ("multi-turn", 0.3, 0.0, 0.0),
        ("agentic", 0.05, 0.002, 0.3),
    ],
)
@pytest.mark.parametrize("policy", ["ttft", "llm-d-precise", "least-load", "oracle"])
def test_skipping_idle_rounds_changes_nothing_the_router_sees(
    workload: str, interval: float, delay: float, loss: float, policy: str
) -> None:
    if workload == "shared-prefix":
        base = shared_prefix(4, 3, 500, 100, 20, rate=5, seed=3)
    elif workload == "multi-turn":
        base = multi_turn(3, 3, 300, 50, 30, rate=2, seed=3)
    else:
        base = agentic(2, 3, 300, 50, 30, 20, rate=1, seed=3)
    trace = two_bursts(base, 120.0137)
    cfg = ClusterConfig(
        pods=3,
        engine=EngineConfig(num_gpu_blocks=512),
        scrape_interval=interval,
        event_delay=delay,
        event_loss=loss,
        seed=3,
    )
    text = policies.config_text(policy)
    skipped, every = (
        run(text, trace, cfg, True, policy == "oracle"),
        run(text, trace, cfg, False, policy == "oracle"),
    )
    assert skipped[:4] == every[:4]
    assert len(skipped[3]) == len(trace)  # a view per arrival compared
    assert every[4] > 120 / interval > 10 * skipped[4]


def test_arrivals_exactly_on_scrape_ticks_see_the_same_rounds() -> None:
    """An arrival at the time of a round runs before it (it was scheduled first): the round the router
    has seen is the one before. With maxAge equal to the interval some metrics are just too old (the
    chain of rounds drifts by ulps): the same requests are rejected either way."""
    ticks = [0.0]
    for _ in range(5000):
        ticks.append(ticks[-1] + 0.05)
    base = shared_prefix(3, 2, 200, 50, 5, rate=5, seed=1)
    at = [3, 4, 7, 40, 41, 2400, 2401, 2402, 4999]
    trace = [dataclasses.replace(base[i % len(base)], arrival=ticks[k], index=i) for i, k in enumerate(at)]
    cfg = ClusterConfig(pods=2, engine=EngineConfig(num_gpu_blocks=256), scrape_interval=0.05, seed=1)
    rejected = {}
    for oracle in (False, True):
        skipped, every = run(TIGHT, trace, cfg, True, oracle), run(TIGHT, trace, cfg, False, oracle)
        assert skipped[:4] == every[:4]
        assert skipped[4] < 100 < 5000 <= every[4]
        rejected[oracle] = sum(REJECTED in record for record in skipped[0])
    assert rejected == {False: 2, True: 0}  # the oracle scrapes at every arrival


def test_a_long_quiet_gap_costs_almost_nothing() -> None:
    """Two requests 1e7 simulated seconds (~4 months) apart: without skipping 2e8 scrape rounds."""
    base = shared_prefix(1, 2, 200, 50, 5, rate=5, seed=1)
    trace = two_bursts(base, 1e7)
    cfg = ClusterConfig(pods=2, engine=EngineConfig(num_gpu_blocks=256), seed=1)
    c = Cluster(policies.load("ttft"), cfg)
    began = time.perf_counter()
    records = c.run(trace)
    assert time.perf_counter() - began < 5
    assert {r.status for r in records} == {"completed"} and c.scrape_rounds < 200
    late = max(records, key=lambda r: r.arrival_s)
    assert late.arrival_s == trace[-1].arrival > 1e7 and late.ttft_s is not None and 0 < late.ttft_s < 1


# -- the command -------------------------------------------------------------------------------------


def mooncake(path: pathlib.Path) -> None:
    """Two bursts of a shared-prefix conversation, 120 s apart, with a 3 s pause inside the first."""
    lines = []
    for burst in (0, 120_000):
        for k, pause in enumerate((0, 150, 300, 3300, 3400, 3450)):
            ids = [1, 2, 10 + k] if k % 2 else [1, 3, 20 + k]
            lines.append(
                {"timestamp": burst + pause, "input_length": 1400, "output_length": 12, "hash_ids": ids}
            )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_the_command_writes_the_same_bytes_with_fewer_rounds(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "bursts.jsonl"
    mooncake(trace)
    rounds: dict[bool, int] = {}

    def counted(skip: bool) -> Any:
        def make(*args: Any, **kwargs: Any) -> Cluster:
            c = Cluster(*args, **kwargs, skip_idle_scrapes=skip)
            run = c.run

            def counting(t: Any) -> Any:
                out = run(t)
                rounds[skip] = rounds.get(skip, 0) + c.scrape_rounds
                return out

            c.run = counting  # type: ignore[method-assign]
            return c

        return make

    outs = {}
    for skip in (True, False):
        monkeypatch.setattr(replay, "Cluster", counted(skip))
        outs[skip] = out = tmp_path / f"skip-{skip}"
        assert main([*QUICK, "--trace", str(trace), "--policies", "all", "--out", str(out)]) == 0
    files = sorted(p.name for p in outs[True].iterdir() if p.suffix in (".json", ".jsonl"))
    assert (
        "summary.json" in files and "records-ttft.jsonl" in files and len(files) == 1 + len(policies.names())
    )
    for name in files:
        assert (outs[True] / name).read_bytes() == (outs[False] / name).read_bytes(), name
    doc = json.loads((outs[True] / "summary.json").read_text())
    assert all(f["requests"] == 12 and f["rejected_requests"] == 0 for f in doc["policies"].values())
    per_policy = len(policies.names())
    assert rounds[False] > per_policy * 120 / 0.05 and rounds[True] < rounds[False] / 20
    assert not math.isnan(doc["policies"]["ttft"]["ttft_mean_s"])
