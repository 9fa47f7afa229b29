"""The simulated engine on three rules of vLLM 0.32 that a step-by-step comparison with vLLM's own
`Scheduler` found missing (tests/vllm/test_vllm_scheduler_diff.py checks them against vLLM):

- admission needs the whole sequence's blocks free, not just the first chunk's
  (`allocate_slots(..., full_sequence_must_fit=scheduler_reserve_full_isl)`, on by default);
- `/metrics` shows the stats made at the end of the last step (`Scheduler.make_stats` in
  `update_from_output`), not the scheduler's state mid-step;
- a running request aborted during a step leaves before that step's outputs (`EngineCore.step` drains
  its aborts queue before `update_from_output`): even in its last step it ends aborted."""

from __future__ import annotations

import pytest

from simulator.engine import Engine, EngineConfig
from simulator.kernel import Kernel
from simulator.latency import PROFILES
from simulator.records import SimRequest

LAT = PROFILES["llama-3.1-8b-h100"]


def engine(spans: bool = True, **cfg: int) -> tuple[Engine, Kernel, list[tuple[str, str]]]:
    k = Kernel()
    calls: list[tuple[str, str]] = []
    e = Engine(
        k,
        EngineConfig(**{"async_scheduling": False, **cfg}),  # type: ignore[arg-type]  # sync: test_sim_async.py
        LAT,
        on_first_token=lambda rec, t: calls.append(("first", rec.request_id)),
        on_finish=lambda rec, t: calls.append(("finish", rec.request_id)),
        spans=spans,
    )
    return e, k, calls


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def until(k: Kernel, done: object) -> None:
    while not done():  # type: ignore[operator]
        assert k.step()


# -- admission: the whole sequence must fit ------------------------------------------------------


def test_a_prompt_whose_first_chunk_fits_but_not_its_whole_waits_instead_of_being_preempted() -> None:
    """9 usable blocks of 4 tokens, a budget of 8 tokens a step. `a` decodes (it ends needing 5 blocks);
    `b`'s 32-token prompt needs 8 blocks, and only 7 are free when it arrives. Its first chunk (2 blocks)
    would fit: admitted on that, it grew chunk by chunk against `a`'s decode and was preempted. vLLM
    keeps it waiting until its 8 blocks are free."""
    e, k, _ = engine(num_gpu_blocks=10, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    a = e.submit(SimRequest("a", toks(0, 4), max_tokens=17))
    until(k, lambda: a.first_token_s is not None)
    assert e.pool.num_free == 7
    b = e.submit(SimRequest("b", toks(100, 32), max_tokens=1))
    until(k, lambda: len(e.running) == 1 and e.pool.num_free < 7)  # the next step was scheduled
    assert list(e.waiting) and b.scheduled_s is None  # 8 blocks needed, 7 free: it waits
    k.run()
    assert a.finished_s is not None and b.scheduled_s is not None and b.scheduled_s >= a.finished_s
    assert (a.preemptions, b.preemptions, e.preemptions) == (0, 0, 0)
    assert b.output_tokens == 1 and e.pool.num_free == 9


def test_the_gate_counts_hit_blocks_that_sit_in_the_free_queue() -> None:
    """A hit block nobody uses is in the free queue: taking it uses free capacity (vLLM's
    `_get_num_evictable_blocks`). `c`'s 16 tokens stay cached in 4 free blocks; `hold` decodes in 3
    blocks, so 6 are free; `d` (c's prompt + 16 tokens, 8 blocks) hits c's 4 and needs 4 more: 4 + 4 > 6,
    it waits (its first chunk alone, 7 tokens: 2 new blocks + the 4 hit ones, would fit)."""
    e, k, _ = engine(num_gpu_blocks=10, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    c = e.submit(SimRequest("c", toks(0, 16), max_tokens=1))
    k.run()
    assert c.finished_s is not None and e.probe(toks(0, 16))[0] == 16 and e.pool.num_free == 9
    hold = e.submit(SimRequest("hold", toks(500, 8), max_tokens=5))  # 8 + 4 tokens: 3 blocks
    until(k, lambda: hold.first_token_s is not None)  # and its first decode step took its third block
    assert e.pool.num_free == 6
    d = e.submit(SimRequest("d", toks(0, 16) + toks(900, 16), max_tokens=1))
    k.step()  # the next step is scheduled without d
    assert d.scheduled_s is None and len(e.waiting) == 1
    k.run()
    assert d.scheduled_s is not None and d.scheduled_s >= hold.finished_s  # type: ignore[operator]
    assert d.cached_tokens == 16 and e.preemptions == 0


def test_a_request_that_fits_whole_is_admitted_with_only_its_first_chunks_blocks() -> None:
    """The gate is a check, not a reservation: the rest of the prompt's blocks come chunk by chunk."""
    e, k, _ = engine(num_gpu_blocks=10, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    r = e.submit(SimRequest("r", toks(0, 32), max_tokens=1))  # 8 blocks of the 9
    k.step()
    assert r.scheduled_s == 0.0 and e.pool.num_used == 2  # the first chunk's 8 tokens
    k.run()
    assert r.finished_s is not None and e.steps == 4


# -- metrics: the end of the last step -----------------------------------------------------------


def test_metrics_are_the_stats_of_the_end_of_the_last_step() -> None:
    """The review's case: `a` decodes; `b` arrives mid-step. vLLM takes `b` in between two steps and
    admits it at the next one, so /metrics never shows it waiting; the step that admits it takes its
    blocks and records its prefix-cache query, which /metrics shows from that step's end."""
    e, k, _ = engine(num_gpu_blocks=1000, block_size=16)
    a = e.submit(SimRequest("a", toks(1, 199), max_tokens=50))
    k.run(until=0.2)  # a decodes
    before = e.metrics()
    assert (before.waiting, before.running, before.prefix_cache_queries) == (0, 1, 199)
    assert before.kv_usage is not None
    used = e.pool.num_used  # a's blocks (15: 199 prompt tokens and 27 outputs so far)
    assert before.kv_usage == pytest.approx(used / 999)
    b = e.submit(SimRequest("b", toks(500, 200), max_tokens=5))
    m = e.metrics()
    assert len(e.waiting) == 1  # in the engine's queue
    assert (m.waiting, m.running, m.kv_usage) == (0, 1, before.kv_usage)  # not in vLLM's stats yet
    end = k.peek()
    k.run(until=end)  # the step in progress ends; the next one (admitting b) starts at once
    assert b.scheduled_s == end and not e.waiting and e.pool.num_used == used + 13
    m = e.metrics()
    assert (m.waiting, m.running, m.prefix_cache_queries) == (0, 1, 199)  # the end of a's step
    assert m.kv_usage == pytest.approx(used / 999)
    k.run(until=k.peek())  # the step that admitted b ends
    m = e.metrics()
    assert (m.waiting, m.running, m.prefix_cache_queries) == (0, 2, 399)
    assert m.kv_usage == pytest.approx((used + 13) / 999)
    k.run()
    idle = e.metrics(123.0)  # an idle engine: the end of its last step
    assert (idle.waiting, idle.running, idle.kv_usage, idle.prefix_cache_queries) == (0, 0, 0.0, 399)
    assert idle.observed_at == 123.0 and a.finished_s is not None


def test_a_request_that_waits_shows_from_the_end_of_the_step_that_could_not_admit_it() -> None:
    """max_num_seqs 1: `q` arrives while `a` runs; the next step cannot admit it, and that step's end
    shows it waiting (and `a`'s blocks, not `q`'s, which it has none of)."""
    e, k, _ = engine(num_gpu_blocks=100, block_size=4, max_num_seqs=1)
    a = e.submit(SimRequest("a", toks(0, 8), max_tokens=6))
    k.step()  # a's prefill step started
    q = e.submit(SimRequest("q", toks(100, 8), max_tokens=1))
    assert e.metrics().waiting == 0
    k.step()  # its end; the next step starts and cannot admit q
    assert e.metrics().waiting == 0 and len(e.waiting) == 1  # the first step's end: q had not arrived
    k.step()
    m = e.metrics()
    assert (m.waiting, m.running, m.kv_usage) == (1, 1, pytest.approx(3 / 99))
    k.run()
    assert q.scheduled_s is not None and q.scheduled_s >= a.finished_s  # type: ignore[operator]
    assert e.metrics().waiting == 0


# -- abort: before the step's outputs -------------------------------------------------------------


@pytest.mark.parametrize("spans", [False, True])
def test_an_abort_during_the_last_step_ends_the_request_aborted_without_its_last_token(spans: bool) -> None:
    ref, rk, _ = engine(spans, num_gpu_blocks=100, block_size=4)
    done = ref.submit(SimRequest("r", toks(0, 8), max_tokens=6))
    rk.run()
    assert done.finished_s is not None
    e, k, calls = engine(spans, num_gpu_blocks=100, block_size=4)
    r = e.submit(SimRequest("r", toks(0, 8), max_tokens=6))
    k.run(until=done.finished_s - 1e-6)  # its last step (a decode span's, with spans) runs
    assert e.abort(r)
    k.run()
    assert r.finished_s is None and r.aborted_s is not None and r.output_tokens == 5
    assert calls == [("first", "r")] and e.pool.num_used == 0 and e.steps == ref.steps
    assert not e.abort(r)


def test_an_abort_during_the_prefill_step_gives_no_first_token() -> None:
    e, k, calls = engine(num_gpu_blocks=100, block_size=4)
    r = e.submit(SimRequest("r", toks(0, 8), max_tokens=3))
    k.step()  # its prefill step started
    assert e.abort(r) and len(e.running) == 1  # until the step's end
    k.run()
    assert r.first_token_s is None and r.finished_s is None and r.output_tokens == 0 and calls == []
    assert e.probe(toks(0, 8))[0] == 8  # the blocks the step computed stay cached


def test_an_aborted_requests_blocks_are_freed_before_those_of_requests_finishing_in_that_step() -> None:
    """vLLM frees an aborted request when it drains the aborts queue, before `update_from_output` frees
    the step's finished ones: the free queue's tail has the aborted blocks first."""
    e, k, _ = engine(num_gpu_blocks=100, block_size=4)
    fin = e.submit(SimRequest("fin", toks(0, 8), max_tokens=1))  # finishes at the end of the first step
    gone = e.submit(SimRequest("gone", toks(100, 8), max_tokens=5))
    k.step()  # the first step started: both admitted
    held = {r.rec.request_id: r.table[: r.nblocks].tolist() for r in e.running.values()}
    assert e.abort(gone)
    k.step()
    assert fin.finished_s is not None and gone.aborted_s is not None
    tail = e.pool.free_queue()[-4:]
    assert tail == held["gone"][::-1] + held["fin"][::-1]
