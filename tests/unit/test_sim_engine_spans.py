"""Decode spans: an engine that runs runs of decode-only steps as one kernel event gives exactly what the
step-by-step engine (`spans=False`) gives: records, event batches and their times, metrics and
`steps_ended` at any moment, with requests arriving mid-span from kernel events or from outside."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.engine import Engine, EngineConfig
from simulator.kernel import Kernel
from simulator.latency import PROFILES
from simulator.records import RequestRecord, SimRequest

LAT = PROFILES["llama-3.1-8b-h100"]


@dataclass
class Twin:
    """One engine on its own kernel, with everything it reports."""

    kernel: Kernel
    engine: Engine
    batches: list[tuple[int, bytes, float]] = field(default_factory=list)
    calls: list[tuple[str, str, float]] = field(default_factory=list)
    recs: list[RequestRecord] = field(default_factory=list)

    def submit(self, i: int, prompt: list[int], max_tokens: int) -> None:
        self.recs.append(self.engine.submit(SimRequest(f"r{i}", prompt, max_tokens)))

    def outcome(self) -> list[tuple[object, ...]]:
        return [
            (r.request_id, r.first_token_s, r.finished_s, r.cached_tokens, r.preemptions, r.output_tokens)
            for r in self.recs
        ]


def twin(spans: bool, cfg: EngineConfig) -> Twin:
    k = Kernel()
    t = Twin(k, None)  # type: ignore[arg-type]
    t.engine = Engine(
        k,
        cfg,
        LAT,
        on_events=lambda seq, payload, at: t.batches.append((seq, payload, at)),
        on_first_token=lambda rec, at: t.calls.append(("first", rec.request_id, at)),
        on_finish=lambda rec, at: t.calls.append(("finish", rec.request_id, at)),
        spans=spans,
    )
    return t


requests = st.lists(
    st.tuples(
        st.floats(0.0, 0.5, allow_nan=False),  # arrival (s)
        st.integers(0, 3),  # prompt family (shared prefixes)
        st.integers(1, 40),  # prompt tokens
        st.integers(1, 60),  # max_tokens
    ),
    min_size=1,
    max_size=20,
)
configs = st.builds(
    EngineConfig,
    num_gpu_blocks=st.integers(30, 80),
    block_size=st.sampled_from([1, 4, 16]),
    max_num_batched_tokens=st.sampled_from([16, 64, 8192]),
    max_num_seqs=st.sampled_from([1, 2, 4, 16]),
    cpu_blocks=st.sampled_from([0, 8]),
    async_scheduling=st.booleans(),
)


def prompt_of(family: int, n: int) -> list[int]:
    return [family * 1000 + j for j in range(n)]


def fits(cfg: EngineConfig, n: int, m: int) -> bool:
    return -(-(n + m - 1) // cfg.block_size) <= cfg.num_gpu_blocks - 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests, configs)
def test_spans_change_nothing_with_arrivals_scheduled_on_the_kernel(
    reqs: list[tuple[float, int, int, int]], cfg: EngineConfig
) -> None:
    twins = [twin(False, cfg), twin(True, cfg)]
    samples: list[list[tuple[object, ...]]] = [[], []]
    for t, out in zip(twins, samples, strict=True):
        for i, (at, family, n, m) in enumerate(reqs):
            if fits(cfg, n, m):
                p = prompt_of(family, n)
                t.kernel.at(at, lambda t=t, i=i, p=p, m=m: t.submit(i, p, m))  # type: ignore[misc]

        def look(t: Twin = t, out: list[tuple[object, ...]] = out) -> None:  # a scraper, mid-span too
            m = t.engine.metrics()
            out.append((t.kernel.now(), m.waiting, m.running, m.kv_usage, m.prefix_cache_hits))
            if t.kernel.now() < 2.0:
                t.kernel.schedule(0.0037, look, priority=1)

        t.kernel.schedule(0.0, look, priority=1)
        t.kernel.run()
        t.engine.pool.check()
    step, span = twins
    assert span.outcome() == step.outcome()
    assert span.calls == step.calls
    assert span.batches == step.batches  # same events, same batches, same times
    assert samples[1] == samples[0]
    assert span.engine.steps == step.engine.steps and span.engine.idle


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests, configs, st.lists(st.floats(0.0, 0.6, allow_nan=False), max_size=30))
def test_spans_change_nothing_when_driven_from_outside_as_the_realtime_server_does(
    reqs: list[tuple[float, int, int, int]], cfg: EngineConfig, looks: list[float]
) -> None:
    """The serving driver runs the kernel up to the wall clock, then submits or reads: the steps ended so
    far (what it streams) and the metrics agree at every moment, mid-span or not."""
    moments = sorted([(at, i) for i, (at, *_rest) in enumerate(reqs)] + [(t, -1) for t in looks])
    twins = [twin(False, cfg), twin(True, cfg)]
    seen: list[list[tuple[object, ...]]] = [[], []]
    for t, out in zip(twins, seen, strict=True):
        for at, i in moments:
            t.kernel.run(until=at)
            if i >= 0:
                _, family, n, m = reqs[i]
                if fits(cfg, n, m):
                    t.submit(i, prompt_of(family, n), m)
            mx = t.engine.metrics()
            out.append((at, t.engine.steps_ended(), mx.running, mx.waiting, mx.kv_usage))
        t.kernel.run()
    step, span = twins
    assert seen[1] == seen[0]
    assert span.outcome() == step.outcome()
    assert span.batches == step.batches


def test_a_lone_decode_runs_as_few_kernel_events_and_a_mid_span_arrival_is_served_on_time() -> None:
    cfg = EngineConfig(num_gpu_blocks=100, block_size=16, max_num_seqs=4)
    runs = []
    for spans in (False, True):
        t = twin(spans, cfg)
        t.submit(0, list(range(32)), 200)  # a prompt of 2 blocks, then 199 decode steps
        t.kernel.at(0.5, lambda t=t: t.submit(1, list(range(500, 520)), 3))  # type: ignore[misc]
        t.kernel.run()
        runs.append(t)
    step, span = runs
    assert span.outcome() == step.outcome()
    assert step.engine.steps == span.engine.steps == 200  # 1 prefill + 199 decode steps
    # the decode of request 0 runs in spans between its block boundaries, not step by step
    assert span.kernel.events_run < step.kernel.events_run / 4
    first = {rid: at for kind, rid, at in span.calls if kind == "first"}
    assert 0.5 < first["r1"] < 0.6  # admitted at the end of the step in progress at 0.5


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests,
    configs,
    st.lists(st.tuples(st.floats(0.0, 0.6, allow_nan=False), st.integers(0, 19)), max_size=10),
)
def test_aborts_from_outside_change_nothing_between_spans_and_steps_and_leave_the_pool_whole(
    reqs: list[tuple[float, int, int, int]], cfg: EngineConfig, aborts: list[tuple[float, int]]
) -> None:
    """Aborts (a client going away, as the serving driver reports it) mid-span or not: the same records,
    calls, events and metrics with spans as without; an aborted request never finishes, and every block
    is accounted for."""
    moments = sorted(
        [(at, i, False) for i, (at, *_rest) in enumerate(reqs)] + [(t, j, True) for t, j in aborts]
    )
    twins = [twin(False, cfg), twin(True, cfg)]
    results: list[list[object]] = [[], []]
    for t, out in zip(twins, results, strict=True):
        for at, i, abort in moments:
            t.kernel.run(until=at)
            if abort:
                if i < len(t.recs):
                    out.append(t.engine.abort(t.recs[i]))
            else:
                _, family, n, m = reqs[i]
                if fits(cfg, n, m):
                    t.submit(i, prompt_of(family, n), m)
            mx = t.engine.metrics()
            out.append((mx.running, mx.waiting, mx.kv_usage, mx.prefix_cache_queries))
        t.kernel.run()
        t.engine.pool.check()
        assert t.engine.idle and not t.engine.running and not t.engine.waiting
        assert t.engine.pool.num_used == 0
        for r in t.recs:
            assert (r.aborted_s is None) != (r.finished_s is None)  # one or the other
    step, span = twins
    assert results[1] == results[0]
    assert span.outcome() == step.outcome()
    assert span.calls == step.calls
    assert span.batches == step.batches
    assert [r.aborted_s for r in span.recs] == [r.aborted_s for r in step.recs]
