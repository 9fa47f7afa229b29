"""CPU-tier reloads as vLLM 0.32's offloading connector runs them: asynchronously, beside the steps.

`OffloadingConnectorScheduler.get_num_new_matched_tokens` answers `load_kv_async=True`, so the
scheduler allocates the request's blocks, parks it in WAITING_FOR_REMOTE_KVS (still a waiting
request in the stats) and skips it; the load runs while other requests' steps go on at their own
speed; once the worker reports it finished the request's loaded blocks are cached and it is
scheduled with them counted as computed (`Scheduler._update_waiting_for_remote_kv`)."""

from __future__ import annotations

import pytest

from simulator.engine import Engine, EngineConfig
from simulator.kernel import Kernel
from simulator.latency import PROFILES
from simulator.records import RequestRecord, SimRequest

LAT = PROFILES["llama-3.1-8b-h100"]


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def engine(**cfg: int) -> tuple[Engine, Kernel]:
    k = Kernel()
    cfg = {"async_scheduling": False, **cfg}  # the step a request is seen in: vLLM's synchronous engine core
    return Engine(k, EngineConfig(**cfg), LAT, spans=False), k  # type: ignore[arg-type]


def run_one(e: Engine, k: Kernel, prompt: list[int]) -> RequestRecord:
    rec = e.submit(SimRequest(f"p{prompt[0]}", prompt, max_tokens=1))
    k.run()
    return rec


def step_ends(e: Engine, k: Kernel, until: float) -> list[float]:
    """Run the kernel to `until`, noting the time of every step end (the engine's public step count)."""
    ends: list[float] = []
    seen = e.steps_ended()
    while len(k) and k.peek() <= until:
        k.step()
        n = e.steps_ended()
        ends.extend([k.now()] * (n - seen))
        seen = n
    return ends


A = toks(0, 3072)  # 192 blocks of 16: a load of ~18 ms, 2.5 decode steps
LOAD = LAT.reload_seconds(3072)


def held_on_cpu() -> tuple[Engine, Kernel]:
    """201 blocks of 16 tokens (200 usable): A's blocks are pushed to the CPU tier by a 200-block prompt."""
    e, k = engine(num_gpu_blocks=201, block_size=16, cpu_blocks=400)
    run_one(e, k, A)
    run_one(e, k, toks(10_000, 3200))
    assert e.probe(A) == (0, 3072)
    return e, k


def scenario(with_load: bool) -> tuple[Engine, RequestRecord, RequestRecord | None, float, list[float]]:
    """`d` decodes 40 tokens; 3 steps into it, `c` (A and one token) arrives and loads A from the CPU."""
    e, k = held_on_cpu()
    d = e.submit(SimRequest("d", toks(5000, 16), max_tokens=40))
    ends = step_ends(e, k, k.now() + 1e-9)  # d's prefill step is scheduled
    while len(ends) < 3:
        ends += step_ends(e, k, k.peek())
    t_sub = k.now() + 1e-4  # mid-step: c is taken in at the next step's start
    c = None
    if with_load:
        k.at(t_sub, lambda: None)
        ends += step_ends(e, k, t_sub)
        c = e.submit(SimRequest("c", [*A, 7], max_tokens=2))
    ends += step_ends(e, k, float("inf"))
    return e, d, c, t_sub, ends


def test_a_cpu_tier_load_does_not_slow_the_other_requests_steps() -> None:
    """While `c` loads its 3,072 CPU-held tokens, `d`'s decode steps take exactly the time they take
    without `c` (before: the first of them took the whole reload too, 18 ms more); `c` is scheduled at the
    first step end after its load has ended, and its first token comes after that."""
    _, d0, _, _, alone = scenario(with_load=False)
    e, d, c, t_sub, ends = scenario(with_load=True)
    assert c is not None and c.scheduled_s is not None and c.first_token_s is not None
    t0 = min(t for t in ends if t > t_sub)  # the step end after c's arrival: its load starts there
    ready = t0 + LOAD
    assert 2 * (alone[4] - alone[3]) < LOAD  # the load spans several of d's steps
    assert c.scheduled_s == min(t for t in ends if t >= ready)  # not before its load has ended
    before = [t for t in ends if t <= c.scheduled_s]
    assert before == alone[: len(before)]  # d's steps until then: exactly as without c
    assert c.first_token_s == min(t for t in ends if t > c.scheduled_s) > ready
    assert (c.cached_tokens, c.cpu_loaded_tokens, c.reported_cached_tokens) == (0, 3072, 3072)
    assert d.output_tokens == d0.output_tokens == 40 and c.output_tokens == 2
    assert e.pool.num_free == e.pool.usable and e.idle


def test_a_loading_request_waits_in_the_stats_and_holds_its_blocks() -> None:
    """vLLM keeps a WAITING_FOR_REMOTE_KVS request in its waiting queues (`kv_holding_waiting`):
    `num_requests_waiting` counts it, `num_requests_running` does not; the blocks it loads into are
    allocated (in `kv_cache_usage_perc`) but not cached before the load ends; its prefix-cache lookup
    is counted at the end of the step that started the load (its GPU hit only), once."""
    e, k = held_on_cpu()
    d = e.submit(SimRequest("d", toks(5000, 16), max_tokens=40))
    while d.first_token_s is None:
        assert k.step()
    q0 = e.metrics().prefix_cache_queries
    c = e.submit(SimRequest("c", [*A, 7], max_tokens=2))
    t_arrive = k.now()
    while k.now() == t_arrive:  # d's step in progress ends: c is taken in and starts loading
        assert k.step()
    k.step()  # the end of the step that started the load
    m = e.metrics()
    assert c.scheduled_s is None and c.cpu_loaded_tokens == 3072
    assert (m.waiting, m.running) == (1, 1)
    assert m.kv_usage == pytest.approx((2 + 192) / 200)  # d's 2 blocks and the 192 loading
    assert (m.prefix_cache_queries - q0, m.prefix_cache_hits) == (3073, 0)
    assert e.probe(A) == (0, 3072)  # the loading blocks are not cached yet
    while c.scheduled_s is None:
        assert k.step()
    assert e.probe(A)[0] == 3072  # cached when it is scheduled
    k.run()
    assert e.metrics().prefix_cache_queries - q0 == 3073


def test_requests_behind_a_load_are_admitted_while_it_runs() -> None:
    """vLLM skips a loading request and schedules the ones behind it; on an engine with nothing else to
    run, an arrival is scheduled at once (vLLM steps idly while it waits), the load's request when its
    load ends, and the load's time is the loading request's alone."""
    e, k = held_on_cpu()
    c = e.submit(SimRequest("c", [*A, 7], max_tokens=1))
    k.step()  # the (empty) step that starts the load
    t_load = k.now()
    k.at(t_load + 1e-3, lambda: None)
    k.step()
    x = e.submit(SimRequest("x", toks(9000, 32), max_tokens=1))
    k.run()
    assert x.scheduled_s == t_load + 1e-3 and x.first_token_s is not None
    ready = t_load + LOAD
    assert x.first_token_s < ready  # x did not wait for c's load
    assert c.scheduled_s is not None and c.scheduled_s >= ready
    assert c.first_token_s == pytest.approx(c.scheduled_s + LAT.step_seconds(1, 1, 3072.5, 0, 0))


def test_an_aborted_load_frees_its_blocks_at_once() -> None:
    e, k = held_on_cpu()
    c = e.submit(SimRequest("c", [*A, 7], max_tokens=1))
    k.step()
    assert not e.idle and e.pool.num_free == e.pool.usable - 192
    assert e.abort(c)
    k.run()
    assert e.idle and e.pool.num_free == e.pool.usable and c.first_token_s is None
    assert e.probe(A) == (0, 3072) and e.metrics().waiting == 0


def test_a_load_leaves_the_blocks_the_loads_before_it_still_need() -> None:
    """vLLM admits a load only if its blocks fit beside what the in-flight prefills and loads still need
    for their whole sequences (`reserved_blocks`): 8 usable blocks of 4; c1 loads 2 of its 7 (5 more to
    come), c2's 2-block load would leave 4 free, so c2 waits until c1 is done (without the reservation
    it loaded at once and c1 waited for c2)."""
    e, k = engine(num_gpu_blocks=9, block_size=4, cpu_blocks=64)
    a1, a2 = toks(0, 8), toks(100, 8)
    run_one(e, k, a1)
    run_one(e, k, a2)
    run_one(e, k, toks(1000, 32))
    assert e.probe(a1) == e.probe(a2) == (0, 8)
    c1 = e.submit(SimRequest("c1", [*a1, *toks(200, 20)], max_tokens=1))
    c2 = e.submit(SimRequest("c2", [*a2, 7], max_tokens=1))
    k.step()
    assert e.metrics().waiting == 2 and e.pool.num_free == 6  # c1 loads, c2 waits for blocks
    k.run()
    assert c1.finished_s is not None and c2.scheduled_s is not None
    assert c2.scheduled_s >= c1.finished_s + LAT.reload_seconds(8)
    assert (c1.cpu_loaded_tokens, c2.cpu_loaded_tokens) == (8, 8)


def test_a_block_aligned_prompt_held_on_the_cpu_is_loaded_whole_and_its_last_token_computed() -> None:
    """The connector looks up whole blocks to the prompt's end (`num_tokens // block_size`), and vLLM's
    `_update_waiting_for_remote_kv` then leaves one token to compute when the load covered the prompt:
    all 192 blocks of A are loaded, none recomputed (the GPU hit alone stops one token short)."""
    e, k = held_on_cpu()
    rec = e.submit(SimRequest("again", A, max_tokens=2))
    k.run()
    assert (rec.cached_tokens, rec.cpu_loaded_tokens) == (0, 3072)
    assert rec.first_token_s is not None and rec.finished_s is not None and rec.output_tokens == 2
    assert e.probe(A)[0] == 3072  # every block back on the GPU, cached
    e.pool.check()
