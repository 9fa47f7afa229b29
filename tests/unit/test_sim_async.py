"""Async scheduling (vLLM's default): the engine core schedules step k+1 while step k runs, so a request
that arrives during step k is scheduled at the end of step k+1, and step k+1's KV events and stats go out
at the end of step k. The same engine with `async_scheduling=False` is vLLM's synchronous core."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.engine import Engine, EngineConfig
from simulator.kernel import Kernel
from simulator.kvcache import ReqState
from simulator.latency import PROFILES
from simulator.records import RequestRecord, SimRequest
from simulator.step_ahead import StepAhead

LAT = PROFILES["llama-3.1-8b-h100"]


class Run:
    def __init__(self, asynchronous: bool, spans: bool = True, **cfg: int) -> None:
        self.kernel = Kernel()
        self.batches: list[tuple[float, list[str]]] = []
        self.engine = Engine(
            self.kernel,
            EngineConfig(async_scheduling=asynchronous, **cfg),  # type: ignore[arg-type]
            LAT,
            on_events=self._events,
            spans=spans,
        )

    def _events(self, seq: int, payload: bytes, at: float) -> None:
        _, events, _ = msgspec.msgpack.decode(payload)
        self.batches.append((at, [ev[0] if isinstance(ev, list) else ev["type"] for ev in events]))

    def submit(self, name: str, n: int, max_tokens: int, start: int = 0) -> RequestRecord:
        return self.engine.submit(SimRequest(name, list(range(start, start + n)), max_tokens))


def stepped(
    asynchronous: bool, arrive: float, max_tokens: int = 40, spans: bool = False
) -> tuple[Run, RequestRecord, list[float]]:
    """One long decode (`a`), and `b` arriving at `arrive`: with every step's end."""
    run = Run(asynchronous, spans=spans, num_gpu_blocks=200, block_size=16)
    run.submit("a", 64, max_tokens)
    b: list[RequestRecord] = []
    run.kernel.at(arrive, lambda: b.append(run.submit("b", 32, 2, start=5000)))
    ends: list[float] = []
    last = 0  # (-1 while the first step is scheduled: none has ended)
    while run.kernel.step():
        if run.engine.steps_ended() != last:
            last = 0  # (-1 while the first step is scheduled: none has ended)
            ends.append(run.kernel.now())
    return run, b[0], ends


def test_a_request_arriving_mid_step_is_scheduled_one_step_later_than_by_a_synchronous_core() -> None:
    _, b_sync, ends_sync = stepped(False, 0.05)
    asyn, b_async, ends_async = stepped(True, 0.05)
    assert ends_sync[:3] == ends_async[:3]  # the same steps until b joins
    k = next(i for i, t in enumerate(ends_sync) if t > 0.05)  # the step in progress when b arrived
    assert b_sync.scheduled_s == ends_sync[k]  # at the end of that step
    assert b_async.scheduled_s == ends_async[k + 1]  # at the end of the next one: it was scheduled already
    assert b_async.first_token_s is not None and b_sync.first_token_s is not None
    assert b_async.first_token_s > b_sync.first_token_s
    assert asyn.engine.idle and asyn.engine.pool.num_used == 0


def test_an_arrival_at_an_idle_engine_is_scheduled_at_once_either_way() -> None:
    a, b = Run(False, num_gpu_blocks=200), Run(True, num_gpu_blocks=200)
    got = []
    for run in (a, b):
        recs: list[RequestRecord] = []
        run.kernel.at(0.25, lambda run=run, recs=recs: recs.append(run.submit("x", 40, 3)))  # type: ignore[misc]
        run.kernel.run()
        got.append((recs[0].scheduled_s, recs[0].first_token_s, recs[0].finished_s))
    assert got[0] == got[1] and got[0][0] == 0.25


def test_when_nothing_else_runs_the_held_request_is_scheduled_at_the_next_step_end() -> None:
    """`a` finishes with the step in progress (its only token): vLLM's pipeline holds an empty step after
    it, so `b`, which arrived during it, is scheduled at its end, as by a synchronous core; when `a` has
    a step more to run, `b` waits for that step's end."""
    _, b_sync, ends = stepped(False, 1e-6, max_tokens=1)
    _, b_async, _ = stepped(True, 1e-6, max_tokens=1)
    assert b_sync.scheduled_s == b_async.scheduled_s == ends[0]
    _, b_two, ends_two = stepped(True, 1e-6, max_tokens=2)
    assert b_two.scheduled_s == ends_two[1]


def test_a_pipelined_steps_events_and_stats_go_out_when_it_is_scheduled_not_when_it_ends() -> None:
    runs = {}
    for asynchronous in (False, True):
        run = Run(asynchronous, spans=False, num_gpu_blocks=200, max_num_batched_tokens=64, max_num_seqs=4)
        run.submit("a", 256, 2)  # 4 chunks of 64 tokens, 4 blocks each
        seen = []
        while run.kernel.step():
            m = run.engine.metrics()
            seen.append((run.kernel.now(), m.running, m.kv_usage))
        runs[asynchronous] = (run, seen)
    (sync, seen_sync), (asyn, seen_async) = runs[False], runs[True]
    stored_sync = [at for at, kinds in sync.batches if "BlockStored" in kinds]
    stored_async = [at for at, kinds in asyn.batches if "BlockStored" in kinds]
    assert len(stored_sync) == len(stored_async) == 4  # each chunk's 4 blocks
    # the first step ran from idle (scheduled as it started): its blocks at its end, as synchronously;
    # the next ones were scheduled while the one before ran: their blocks go out one step earlier
    assert stored_async[0] == stored_sync[0]
    assert stored_async[1:] == stored_sync[:-1]
    # the stats: what a synchronous core shows at a step's end, one step earlier (the step scheduled then
    # has its blocks); the last decode's new block shows too, which the synchronous stats never do (its
    # request has finished and freed it by the end of the step that allocates it)
    usage_sync = [round(u * 199) for _, _, u in seen_sync]
    usage_async = [round(u * 199) for _, _, u in seen_async]
    assert usage_sync == [0, 4, 8, 12, 16, 0]
    assert usage_async == [0, 8, 12, 16, 17, 0]


def test_aborting_a_request_not_yet_scheduled_drops_it_and_the_engine_goes_idle() -> None:
    run = Run(True, spans=True, num_gpu_blocks=200)
    a = run.submit("a", 64, 30)
    held: list[RequestRecord] = []
    run.kernel.at(0.03, lambda: held.append(run.submit("b", 32, 5, start=7000)))
    run.kernel.at(0.031, lambda: run.engine.abort(held[0]))
    run.kernel.run()
    assert held[0].aborted_s == 0.031 and held[0].scheduled_s is None and held[0].finished_s is None
    assert a.finished_s is not None
    assert run.engine.idle and run.engine.pool.num_used == 0 and not run.engine.waiting


@pytest.mark.parametrize("arrive", [0.3, 0.5, 0.5123])
def test_a_mid_span_arrival_is_scheduled_as_step_by_step(arrive: float) -> None:
    """A decode span is cut one step after the step in progress (the next one is scheduled already)."""
    _, b_step, ends = stepped(True, arrive, max_tokens=200)
    span, b_span, _ = stepped(True, arrive, max_tokens=200, spans=True)
    k = next(i for i, t in enumerate(ends) if t > arrive)
    assert b_span.scheduled_s == b_step.scheduled_s == ends[k + 1]
    assert b_span.finished_s == b_step.finished_s
    assert span.engine.kernel.events_run < 100  # (spans: far fewer kernel events than 200 steps)


def admitted(asynchronous: bool, **cfg: int) -> tuple[float | None, list[float]]:
    """`a` (3 tokens) and `c` (10) run, `b` waits for what `a` frees: when is `b` scheduled, and every
    step's end. Prompts of 20 tokens: two blocks of 16 each, for the whole request."""
    run = Run(asynchronous, spans=False, block_size=16, **cfg)
    run.submit("a", 20, 3)
    run.submit("c", 20, 10, start=1000)
    b = run.submit("b", 20, 3, start=2000)
    ends: list[float] = []
    last = 0
    while run.kernel.step():
        if run.engine.steps_ended() != last:
            last = run.engine.steps_ended()
            ends.append(run.kernel.now())
    assert run.engine.idle and run.engine.pool.num_used == 0
    return b.scheduled_s, ends


@pytest.mark.parametrize(
    "cfg",
    [
        {"max_num_seqs": 2, "num_gpu_blocks": 200},  # b waits for a's running slot
        {"max_num_seqs": 8, "num_gpu_blocks": 6},  # b waits for a's blocks (5 usable, 2 each)
    ],
)
def test_what_a_request_ending_with_a_step_frees_is_used_a_step_later(cfg: dict[str, int]) -> None:
    """vLLM scheduled the next step while `a`'s last one ran, with `a` still holding its slot and blocks:
    `b` gets them at the end of that next step; a synchronous core gives them at once."""
    b_sync, ends = admitted(False, **cfg)
    b_async, ends_async = admitted(True, **cfg)
    a_done = ends[2]  # a: its prefill, then two decode steps
    assert b_sync == a_done
    assert b_async == ends_async[3] and ends_async[2] == a_done


def test_with_nothing_else_running_what_a_request_frees_is_used_at_once() -> None:
    """Only `a` runs: the step vLLM scheduled ahead of its end is empty, so `b` starts when `a` ends."""
    for asynchronous in (False, True):
        run = Run(asynchronous, spans=False, block_size=16, max_num_seqs=1, num_gpu_blocks=200)
        a = run.submit("a", 32, 3)
        b = run.submit("b", 32, 3, start=2000)
        run.kernel.run()
        assert b.scheduled_s == a.finished_s


class Watched(StepAhead):
    """Notes for each released request the step it was held in and the step it was released at."""

    __slots__ = ("released",)

    def __init__(self, released: dict[int, tuple[int, int]]) -> None:
        super().__init__()
        self.released = released

    def release(self, s: int, busy: bool) -> list[ReqState]:
        flights = {id(r): flight for flight, r in self.held}
        out = super().release(s, busy)
        self.released.update({id(r.rec): (flights[id(r)], s) for r in out})
        return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_random_workloads_with_aborts_loads_and_resets_end_clean(seed: int, spans: bool) -> None:
    """Whatever arrives, aborts or loads from the CPU tier, with small `max_num_seqs` and tight KV: every
    request finishes with its tokens or is aborted, none is scheduled before it arrived or held past the
    step after next, and the engine ends idle with every block back and its stats at zero."""
    rng = random.Random(seed)
    k = Kernel()
    max_seqs = rng.randint(1, 6)
    blocks = rng.randint(12, 60)
    cfg = EngineConfig(
        num_gpu_blocks=blocks,
        block_size=rng.choice([4, 8, 16]),
        max_num_batched_tokens=max(max_seqs, rng.choice([16, 32, 64, 256])),
        max_num_seqs=max_seqs,
        cpu_blocks=rng.choice([0, 0, 2 * blocks]),
        cpu_write_policy=rng.choice(["write-through", "write-back"]),
    )
    e = Engine(k, cfg, LAT, spans=spans, on_events=lambda seq, payload, at: None)
    recs: list[RequestRecord] = []
    released: dict[int, tuple[int, int]] = {}  # id(record) -> (step in flight at arrival, step released)
    ahead = e._ahead = Watched(released)
    families = [list(range(i * 1000, i * 1000 + 200)) for i in range(4)]

    def submit() -> None:
        prompt = rng.choice(families)[: rng.randint(1, 120)] + [rng.randint(10**5, 10**6) for _ in range(3)]
        try:
            rec = e.submit(SimRequest(f"r{len(recs)}", prompt, rng.randint(1, 40)))
        except ValueError:  # more blocks than the engine holds
            return
        recs.append(rec)
        if rng.random() < 0.3:
            k.at(k.now() + rng.expovariate(20.0), lambda: e.abort(rec))

    t = 0.0
    for _ in range(rng.randint(5, 60)):
        t += rng.expovariate(50.0)
        k.at(t, submit)
        if rng.random() < 0.1:
            k.at(t, e.metrics)
        if rng.random() < 0.1:
            k.at(t, e.reset_prefix_cache)
    k.run()
    for rec in recs:
        assert (rec.finished_s is None) != (rec.aborted_s is None), rec.request_id
        assert rec.scheduled_s is None or rec.scheduled_s >= rec.arrival_s
        assert rec.finished_s is None or rec.output_tokens == rec.request.max_tokens
        flight, at = released.get(id(rec), (0, 0))
        assert at <= flight + 2
    assert e.idle and not (ahead.held or e.waiting or e.running or e._loads.holding)
    assert e.pool.num_used == 0
    e.pool.check()
    m = e.metrics()
    assert (m.waiting, m.running, m.kv_usage) == (0, 0, 0.0)
    assert e.prefix_cache_hits == sum(r.cached_tokens for r in recs)


def arrivals_during(
    run: Run, steps: dict[str, int], abort_at_end: tuple[int, RequestRecord] | None = None
) -> dict[str, RequestRecord]:
    """Step `run` event by event; submit each name while its step runs (32 tokens, 2 outputs), and abort
    a record at the end of a step (an event at the same time, after the step's end)."""
    recs: dict[str, RequestRecord] = {}
    while run.kernel.step():
        e = run.engine
        for name, step in steps.items():
            if name not in recs and e._in_step and e._step == step:
                recs[name] = run.submit(name, 32, 2, start=1000 * (len(recs) + 1))
                if abort_at_end is not None and abort_at_end[0] == step:
                    rec = abort_at_end[1]
                    run.kernel.at(run.kernel.peek(), lambda rec=rec: run.engine.abort(rec))  # type: ignore[misc]
    return recs


def test_a_held_request_is_scheduled_when_the_only_running_one_is_aborted_as_its_step_ends() -> None:
    run = Run(True, spans=False, num_gpu_blocks=200, block_size=16)
    a = run.submit("a", 64, 40)
    r = arrivals_during(run, {"r": 5}, abort_at_end=(5, a))["r"]
    assert a.aborted_s is not None and a.finished_s is None
    assert r.scheduled_s == a.aborted_s and r.finished_s is not None  # nothing runs after the abort
    assert run.engine.idle and run.engine.pool.num_used == 0
    assert run.engine._ahead is not None and not run.engine._ahead.held


def test_a_request_due_at_an_empty_engine_fills_the_step_ahead_and_the_next_arrival_waits() -> None:
    """`a` ends with step 5; `w` arrived during step 4 (due at step 6), `r` during step 5: vLLM's step 6,
    scheduled while 5 ran, holds `w`, so `r` goes a step later, not with it."""
    run = Run(True, spans=False, num_gpu_blocks=200, block_size=16)
    a = run.submit("a", 64, 6)  # its prefill, then five decode steps
    recs = arrivals_during(run, {"w": 4, "r": 5})
    w, r = recs["w"], recs["r"]
    assert w.scheduled_s == a.finished_s
    assert r.scheduled_s is not None and w.scheduled_s is not None and r.scheduled_s > w.scheduled_s


def test_the_blocks_a_finished_request_freed_that_the_admitted_one_hits_are_not_held_back_twice() -> None:
    """`b` extends `a`'s prompt and is released as `a` ends: vLLM scheduled that step while `a` held its
    blocks, so `b`'s hits on them took nothing from the free queue; only the rest of what `a` freed is
    held back, and `b` fits at once (with its 4 blocks cached)."""
    run = Run(True, spans=False, num_gpu_blocks=24, block_size=16)
    prompt = list(range(64))
    a = run.engine.submit(SimRequest("a", prompt, 3))  # 4 prompt blocks, a fifth for its outputs
    run.submit("c", 200, 40, start=1000)  # 15 blocks by its end: the KV stays tight
    b: list[RequestRecord] = []
    e = run.engine
    while run.kernel.step():
        if (
            not b
            and e._in_step
            and any(r.rec is a for r in e.running.values())
            and e._decodes._ends.get(e._step + 1)
        ):
            b.append(
                e.submit(SimRequest("b", prompt + list(range(5000, 5048)), 1))
            )  # a ends with the next step
    assert b[0].scheduled_s == a.finished_s and b[0].cached_tokens == 64
