"""The simulated vLLM engine: one hand-built case per prefix-cache rule (vllm-prefix-cache.md), events
through the production decoder and index, chunked prefill, decode blocks, preemption, the CPU tier,
metrics, and hypothesis checks against a literal model of the rules."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epp.kvindex.events import BlockRemoved, BlockStored, decode_batch
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.ingest import Applied, KvIngest
from epp.kvindex.keys import block_keys, root_key
from simulator.engine import Engine, EngineConfig
from simulator.hashing import block_hash, root_hash
from simulator.kernel import Kernel
from simulator.latency import PROFILES, LatencyProfile
from simulator.records import RequestRecord, SimRequest

POD = "10.0.0.1:8000"
LAT = PROFILES["llama-3.1-8b-h100"]


@dataclass
class Run:
    """One engine on its own kernel, with every event decoded and (optionally) fed to an index."""

    engine: Engine
    kernel: Kernel
    batches: list[tuple[int, bytes, float]] = field(default_factory=list)
    first: list[tuple[str, float]] = field(default_factory=list)
    finished: list[tuple[str, float]] = field(default_factory=list)

    @property
    def events(self) -> list[BlockStored | BlockRemoved]:
        out: list[BlockStored | BlockRemoved] = []
        for _, payload, _ in self.batches:
            out.extend(e for e in decode_batch(payload).events if isinstance(e, BlockStored | BlockRemoved))
        return out

    def removed(self, tier: str = "gpu") -> list[int]:
        return [e.block_hashes[0] for e in self.events if isinstance(e, BlockRemoved) and e.tier == tier]

    def stored(self, tier: str = "gpu") -> list[BlockStored]:
        return [e for e in self.events if isinstance(e, BlockStored) and e.tier == tier]


def make(**cfg: object) -> Run:
    k = Kernel()
    latency = cfg.pop("latency", LAT)
    cfg.setdefault("async_scheduling", False)  # vLLM's synchronous engine core; async: test_sim_async.py
    run = Run(None, k)  # type: ignore[arg-type]
    run.engine = Engine(
        k,
        EngineConfig(**cfg),  # type: ignore[arg-type]
        latency,  # type: ignore[arg-type]
        on_events=lambda seq, payload, at: run.batches.append((seq, payload, at)),
        on_first_token=lambda rec, t: run.first.append((rec.request_id, t)),
        on_finish=lambda rec, t: run.finished.append((rec.request_id, t)),
    )
    return run


def sequential(run: Run, prompts: list[list[int]], max_tokens: int = 1) -> list[RequestRecord]:
    """Requests one at a time, in order (as `engine-replay` runs them)."""
    recs = []
    for i, p in enumerate(prompts):
        recs.append(run.engine.submit(SimRequest(f"r{i}", p, max_tokens)))
        run.kernel.run()
    return recs


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def hashes_of(tokens: list[int], bs: int, salt: str | None = None) -> list[int]:
    out, p = [], root_hash(None, salt)
    for b in range(len(tokens) // bs):
        p = block_hash(p, tokens[b * bs : (b + 1) * bs])
        out.append(p)
    return out


# Prompts of block size 4: A, B, C are distinct 8-token (two-block) prompts.
A, B, C = toks(100, 8), toks(200, 8), toks(300, 8)
HA, HB, HC = hashes_of(A, 4), hashes_of(B, 4), hashes_of(C, 4)


# -- rule 1: the null block -------------------------------------------------------------------


def test_one_block_is_the_reserved_null_block() -> None:
    run = make(num_gpu_blocks=4, block_size=4)  # 3 blocks hold KV
    assert sequential(run, [toks(0, 12)])[0].cached_tokens == 0  # 3 blocks: fits
    with pytest.raises(ValueError, match=r"need 4 blocks .* 3 usable"):
        run.engine.submit(SimRequest("big", toks(0, 13)))
    with pytest.raises(ValueError, match="need 4 blocks"):
        run.engine.submit(SimRequest("grows", toks(0, 12), max_tokens=2))  # its first output needs a 4th
    m = run.engine.metrics()
    assert m.num_gpu_blocks == 4 and m.block_size == 4
    assert run.engine.pool.free_queue() == [3, 2, 1]


# -- rule 2: hits, capped at floor((len - 1) / block_size) blocks --------------------------------


@pytest.mark.parametrize(
    ("n", "bs", "cached"),
    [
        (608, 32, 576),  # the reference's examples: a repeated 608-token prompt hits 576 tokens
        (512, 32, 480),  # and a repeated block-aligned 512-token prompt 480 (its last block recomputed)
        (8, 4, 4),  # floor(7 / 4) = 1 block
        (9, 4, 8),  # floor(8 / 4) = 2 blocks: every full block
        (3, 4, 0),  # no full block
    ],
)
def test_a_repeated_prompt_hits_its_full_blocks_but_never_its_last_token(
    n: int, bs: int, cached: int
) -> None:
    run = make(num_gpu_blocks=64, block_size=bs)
    recs = sequential(run, [toks(0, n), toks(0, n)])
    assert [r.cached_tokens for r in recs] == [0, cached]


def test_a_hit_is_the_longest_run_from_the_start() -> None:
    run = make(num_gpu_blocks=64, block_size=4)
    shared = toks(0, 8)
    recs = sequential(run, [shared + toks(50, 8), shared + toks(60, 8), toks(1, 8) + toks(50, 8)])
    # r1 shares r0's first two blocks only; r2 differs in block 0, so block 2/3 matches are useless
    assert [r.cached_tokens for r in recs] == [0, 8, 0]


# -- rule 3: allocation from the front of the free queue, evicting ---------------------------------


def test_allocation_from_the_front_evicts_least_recently_freed_blocks_first() -> None:
    run = make(num_gpu_blocks=5, block_size=4)  # usable 1 2 3 4
    # A takes 1 2 and frees them in reverse to the tail: queue 3 4 2 1
    # B takes 3 4 (never used: nothing evicted): queue 2 1 4 3
    # C takes 2 (evicts A's block 1, HA[1]), then 1 (evicts HA[0]): queue 4 3 1 2
    # A again: nothing cached; takes 4 (evicts HB[1]) and 3 (evicts HB[0])
    recs = sequential(run, [A, B, C, A])
    assert [r.cached_tokens for r in recs] == [0, 0, 0, 0]
    assert run.removed() == [HA[1], HA[0], HB[1], HB[0]]
    assert run.engine.pool.free_queue() == [1, 2, 3, 4]  # C's blocks (1: HC[1], 2: HC[0]), then A's


# -- rule 4: freeing in reverse; hashed to the tail, partial to the front; hits refreshed -----------


def test_a_prompts_last_blocks_are_evicted_before_its_first() -> None:
    run = make(num_gpu_blocks=5, block_size=4)
    a12 = toks(100, 12)
    h = hashes_of(a12, 4)
    # a12 takes 1 2 3, freed in reverse: queue 4 3 2 1 (its deepest block, in 3, goes first)
    # B takes 4, then 3: evicts h[2] only
    # a12 again: blocks 0 and 1 are still cached; the cap allows floor(11 / 4) = 2 blocks: 8 tokens
    recs = sequential(run, [a12, B, a12])
    assert [r.cached_tokens for r in recs] == [0, 0, 8]
    assert run.removed()[0] == h[2]


def test_partial_blocks_are_freed_to_the_front_and_reused_first() -> None:
    run = make(num_gpu_blocks=6, block_size=4)  # usable 1..5
    a10 = toks(100, 10)  # two full blocks and a partial one
    # a10 takes 1 2 3; freed in reverse: 3 (partial) to the front, 2 1 to the tail: queue 3 4 5 2 1
    r0 = sequential(run, [a10])
    assert run.engine.pool.free_queue() == [3, 4, 5, 2, 1]
    # B6 (one full block + a partial) takes 3 then 4: no eviction
    r1 = sequential(run, [toks(200, 6)])
    assert run.removed() == []
    # a10 again hits both its full blocks (the cap allows floor(9 / 4) = 2)
    r2 = sequential(run, [a10])
    assert [r.cached_tokens for r in r0 + r1 + r2] == [0, 0, 8]


def test_hit_blocks_are_refreshed_by_their_use() -> None:
    run = make(num_gpu_blocks=6, block_size=4)  # usable 1..5
    a12 = A + toks(108, 4)
    # A takes 1 2 -> queue 3 4 5 2 1; B takes 3 4 -> queue 5 2 1 4 3
    # a12 hits A's two blocks (cap floor(11 / 4) = 2): 1 and 2 leave the queue; it takes 5 for its third
    #   block; freed in reverse: 5 2 1 to the tail -> queue 4 3 5 2 1
    # C takes 4 and 3: evicts B (HB[1], HB[0]) although A was cached before B: A's use refreshed it
    recs = sequential(run, [A, B, a12, C, [*A, 1], B])
    assert [r.cached_tokens for r in recs] == [0, 0, 8, 0, 8, 0]
    assert run.removed()[:2] == [HB[1], HB[0]]


# -- rule 5: duplicate copies under one hash --------------------------------------------------------


def test_a_repeated_block_aligned_prompt_stores_a_second_copy_and_both_are_evicted() -> None:
    run = make(num_gpu_blocks=4, block_size=4)  # usable 1 2 3
    # A takes 1 2 -> queue 3 2 1
    # A again: the cap allows 1 block (floor(7 / 4)): hits HA[0] in 1; takes 3 and recomputes HA[1] there:
    #   a second physical copy (one BlockStored [HA[1]] with parent HA[0]); freed: 3 1 to the tail:
    #   queue 2 3 1
    # B takes 2 (evicts the first copy of HA[1]) and 3 (evicts the second): two BlockRemoved of HA[1]
    recs = sequential(run, [A, A, B])
    assert [r.cached_tokens for r in recs] == [0, 4, 0]
    second = run.stored()[1]
    assert second.block_hashes == (HA[1],) and second.parent_block_hash == HA[0]
    assert run.removed() == [HA[1], HA[1]]
    assert run.engine.pool.lookup(HA, 2) == [1]  # HA[0] survives in block 1


def test_lookups_use_the_first_cached_copy() -> None:
    run = make(num_gpu_blocks=8, block_size=4)
    sequential(run, [A, A])  # HA[1] in blocks 2 (first) and 3 (second)
    assert run.engine.pool.copies(HA[1]) == [2, 3]
    assert run.engine.pool.lookup(HA, 2) == [1, 2]
    # free queue now 4 5 6 7 2 3 1; A + [9] hits HA[0] in 1 and the first copy of HA[1], in 2, takes 4 for
    # its partial block, and frees 4 to the front, 2 and 1 to the tail: copy 3 is now older than copy 2
    recs = sequential(run, [[*A, 9]])
    assert recs[0].cached_tokens == 8
    assert run.engine.pool.free_queue() == [4, 5, 6, 7, 3, 2, 1]


# -- rule 6: events and metrics -----------------------------------------------------------------------


def test_one_block_stored_per_request_and_step_and_metrics_count_queries_and_hits() -> None:
    run = make(num_gpu_blocks=16, block_size=4)
    # 11 tokens: two full blocks stored (the partial third is not); then 13 tokens: it hits the two and
    # stores only its third block, chained to HA[1]
    recs = sequential(run, [A + toks(108, 3), A + toks(108, 4) + [500]])
    s = run.stored()
    assert s[0].block_hashes == tuple(HA) and s[0].parent_block_hash is None
    assert s[0].token_ids == tuple(A) and s[0].block_size == 4
    assert recs[1].cached_tokens == 8
    assert s[1].block_hashes == (hashes_of(A + toks(108, 4), 4)[2],)
    assert s[1].parent_block_hash == HA[1] and s[1].token_ids == tuple(toks(108, 4))
    m = run.engine.metrics()
    assert m.prefix_cache_queries == 11 + 13 and m.prefix_cache_hits == 8
    assert m.waiting == 0 and m.running == 0 and m.kv_usage == 0.0
    assert [seq for seq, _, _ in run.batches] == list(range(len(run.batches)))


def test_events_feed_the_production_index_which_agrees_with_the_engine() -> None:
    run = make(num_gpu_blocks=10, block_size=4)
    prompts = [A, B, A + toks(108, 5), C, B + toks(208, 4), A]
    sequential(run, prompts)
    ingest = KvIngest(BlockIndex(block_size=4, max_entries=10_000), FreshnessTracker(), lambda pod: "m")
    for seq, payload, at in run.batches:
        assert isinstance(ingest.on_live(POD, 0, seq, payload, at), Applied)
    assert_index_agrees(run.engine, ingest, prompts)


def assert_index_agrees(
    engine: Engine, ingest: KvIngest, prompts: list[list[int]], salt: str | None = None
) -> None:
    bs = engine.block_size
    counts = ingest.index.pod_counts(POD)
    assert counts.get("gpu", 0) == len(engine.pool.cached)
    assert counts.get("cpu", 0) == (len(engine.cpu) if engine.cpu is not None else 0)
    for p in prompts:
        keys = block_keys(p, bs, root_key("m", salt))
        runs = ingest.index.lookup_tier_runs(keys, [POD], ["gpu", "cpu"])
        gpu, cpu = engine.probe(p, cache_salt=salt)
        assert int(runs[0][0]) * bs == gpu
        assert int(runs[1][0]) * bs == gpu + cpu


def test_salted_requests_share_nothing_with_others_and_the_index_sees_the_salt() -> None:
    run = make(num_gpu_blocks=16, block_size=4)
    e = run.engine
    recs = []
    for i, salt in enumerate([None, "t1", "t1", "t2"]):
        recs.append(e.submit(SimRequest(f"r{i}", [*A, 1], cache_salt=salt)))
        run.kernel.run()
    assert [r.cached_tokens for r in recs] == [0, 0, 8, 0]
    first = [ev for ev in run.stored() if ev.parent_block_hash is None]
    assert [ev.extra_keys for ev in first] == [None, (("t1",), None), (("t2",), None)]
    assert e.probe(A, cache_salt="t1")[0] == 8 and e.probe(A, cache_salt="t3")[0] == 0
    ingest = KvIngest(BlockIndex(block_size=4, max_entries=1000), FreshnessTracker(), lambda pod: "m")
    for seq, payload, at in run.batches:
        ingest.on_live(POD, 0, seq, payload, at)
    for salt in (None, "t1", "t2", "t3"):
        assert_index_agrees(e, ingest, [[*A, 1]], salt)


def test_lora_blocks_carry_the_adapter_in_every_blocks_extra_keys_and_the_index_keys_them_so() -> None:
    """As vLLM 0.18+: every block of a LoRA request has the adapter's name first in its extra keys, and
    the request's first block the salt after it; the router indexes them under (adapter, salt)."""
    run = make(num_gpu_blocks=16, block_size=4)
    e = run.engine
    e.submit(SimRequest("r0", [*A, 1], lora_name="ad", cache_salt="t1"))
    e.submit(SimRequest("r1", [*B, 1], lora_name="ad"))
    run.kernel.run()
    firsts = [ev.extra_keys for ev in run.stored() if ev.parent_block_hash is None]
    assert firsts == [(("ad", "t1"), ("ad",)), (("ad",), ("ad",))]
    ingest = KvIngest(BlockIndex(block_size=4, max_entries=1000), FreshnessTracker(), lambda pod: "m")
    for seq, payload, at in run.batches:
        ingest.on_live(POD, 0, seq, payload, at)
    found = {
        (prompt_id, salt): ingest.index.lookup(block_keys(p, 4, root_key("ad", salt)), [POD])[POD].get(
            "gpu", 0
        )
        for prompt_id, p in (("A", A), ("B", B))
        for salt in (None, "t1")
    }
    assert found == {("A", None): 0, ("A", "t1"): 2, ("B", None): 2, ("B", "t1"): 0}


def test_reset_prefix_cache_forgets_every_block_and_publishes_all_blocks_cleared() -> None:
    """vLLM's reset: refused while a request is queued or running; once idle, every cached block (GPU
    and CPU tier) is forgotten, `AllBlocksCleared` published at once, and the router's index follows."""
    run = make(num_gpu_blocks=6, block_size=4, cpu_blocks=8)
    e = run.engine
    sequential(run, [A, B, C])  # 5 usable GPU blocks: some of them went to the CPU tier
    assert len(e.pool.cached) and len(e.cpu)  # type: ignore[arg-type]
    e.submit(SimRequest("busy", [*A, 1], max_tokens=3))
    assert e.reset_prefix_cache() is False and len(e.pool.cached)
    run.kernel.run()
    ingest = KvIngest(BlockIndex(block_size=4, max_entries=1000), FreshnessTracker(), lambda pod: "m")
    for seq, payload, at in run.batches:
        ingest.on_live(POD, 0, seq, payload, at)
    assert ingest.index.pod_counts(POD).get("gpu", 0) > 0
    n = len(run.batches)
    assert e.reset_prefix_cache() is True
    assert e.pool.cached == {} and len(e.cpu) == 0 and e.probe(A) == (0, 0)  # type: ignore[arg-type]
    ((seq, payload, at),) = run.batches[n:]
    assert [type(ev).__name__ for ev in decode_batch(payload).events] == ["AllBlocksCleared"]
    ingest.on_live(POD, 0, seq, payload, at)
    assert ingest.index.pod_counts(POD) == {}
    again = sequential(run, [A])
    assert again[0].cached_tokens == 0  # nothing left to hit


# -- chunked prefill, decode, step times ------------------------------------------------------------


def test_chunked_prefill_respects_the_token_budget() -> None:
    lat = LatencyProfile("t", 0.004, 1e-4, 1e-7, 0.007, 1e-4, 1e-6, 1.0)
    run = make(num_gpu_blocks=32, block_size=4, max_num_batched_tokens=8, max_num_seqs=4, latency=lat)
    p = toks(0, 20)
    rec = sequential(run, [p])[0]
    s = run.stored()
    assert [len(e.block_hashes) for e in s] == [2, 2, 1]  # chunks of 8, 8, 4 tokens: one event per step
    assert [e.parent_block_hash for e in s] == [None, s[0].block_hashes[-1], s[1].block_hashes[-1]]
    assert run.engine.steps == 3
    # simulated step times: 4 ms fixed on the first chunk only, 1e-4 s per token, pairs u (c + u / 2)
    expect = (0.004 + 8e-4 + 1e-7 * 8 * 4) + (0.007 + 8e-4 + 1e-7 * 8 * 12) + (0.007 + 4e-4 + 1e-7 * 4 * 18)
    assert rec.ttft_s == pytest.approx(expect)


def test_decodes_share_the_budget_with_a_chunked_prefill() -> None:
    run = make(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    e = run.engine
    e.submit(SimRequest("dec", toks(0, 4), max_tokens=20))
    run.kernel.run(until=0.05)  # prefilled, decoding
    assert [name for name, _ in run.first] == ["dec"] and e.metrics().running == 1
    e.submit(SimRequest("long", toks(100, 14)))
    run.kernel.run()
    long = [s for s in run.stored() if 100 <= s.token_ids[0] < 114]
    # the decoder takes 1 token of the 8 per step: chunks of 7 then 7 tokens (one block, then two more)
    assert [len(s.block_hashes) for s in long] == [1, 2]


def test_generated_tokens_fill_blocks_that_are_hashed_and_stored_as_they_fill() -> None:
    run = make(num_gpu_blocks=16, block_size=4)
    out = toks(900, 8)
    rec = run.engine.submit(SimRequest("r", toks(0, 6), max_tokens=8, output_token_ids=out))
    run.kernel.run()
    # KV holds the prompt and the first 7 outputs (the 8th is never fed back): 13 tokens, 3 full blocks
    full = toks(0, 6) + out[:7]
    h = hashes_of(full, 4)
    s = run.stored()
    assert [e.block_hashes for e in s] == [(h[0],), (h[1],), (h[2],)]
    assert s[1].token_ids == tuple(full[4:8]) and s[1].parent_block_hash == h[0]
    assert rec.output_tokens == 8 and rec.tpot_s is not None and rec.tpot_s > 0
    assert run.engine.probe(full)[0] == 12
    # a later prompt that contains this answer hits it (a multi-turn chat)
    again = sequential(run, [[*full, 5]])
    assert again[0].cached_tokens == 12


def test_records_callbacks_and_times() -> None:
    run = make(num_gpu_blocks=64, block_size=16)
    e = run.engine
    r1 = e.submit(SimRequest("a", toks(0, 100), max_tokens=3))
    r2 = e.submit(SimRequest("b", toks(0, 100), max_tokens=1))
    run.kernel.run()
    assert run.first[0][0] == "a" and {n for n, _ in run.finished} == {"a", "b"}
    # both are admitted in the same step; a's full blocks are cached when they are scheduled (as vLLM's
    # allocate_slots does), so b, scheduled after it, hits them: 6 blocks of 16 (the cap allows 6)
    assert r1.cached_tokens == 0 and r2.cached_tokens == 96
    assert r1.queue_s == 0.0 and r1.ttft_s == r2.ttft_s
    assert r1.output_tokens == 3 and r2.output_tokens == 1 and r2.tpot_s == 0.0
    assert r1.e2e_s is not None and r1.ttft_s is not None and r1.e2e_s > r1.ttft_s
    assert e.idle and e.pool.num_free == e.pool.usable


def test_step_time_uses_the_reference_cost_model_coefficients() -> None:
    from epp.costmodel.profile import REFERENCE_PROFILES

    ref = REFERENCE_PROFILES["llama-3.1-8b-h100"]
    assert LAT.prefill_per_token_s == ref.prefill_per_token_s
    assert LAT.decode_per_context_token_s == ref.decode_per_context_token_s
    assert LAT.reload_seconds(1000) == ref.reload_s("cpu", 1000)
    run = make(num_gpu_blocks=1024, block_size=16)
    rec = sequential(run, [toks(0, 2000)])[0]
    assert rec.ttft_s == pytest.approx(ref.prefill_s(2000, 0))  # one step: the cost model's prefill


# -- preemption and queueing --------------------------------------------------------------------


def test_a_full_cache_queues_then_preempts_and_everything_finishes() -> None:
    run = make(num_gpu_blocks=9, block_size=4, max_num_seqs=8)  # 8 usable blocks
    e = run.engine
    recs = [e.submit(SimRequest(f"r{i}", toks(i * 100, 6), max_tokens=12)) for i in range(4)]
    checks = []

    def probe() -> None:
        e.pool.check()
        checks.append(len(e.waiting))
        if not e.idle:
            run.kernel.schedule(0.001, probe, priority=1)

    run.kernel.schedule(0.0, probe, priority=1)
    run.kernel.run()
    assert all(r.output_tokens == 12 and r.finished_s is not None for r in recs)
    assert e.preemptions > 0 and sum(r.preemptions for r in recs) == e.preemptions
    assert max(checks) > 0  # some waited
    assert e.pool.num_free == e.pool.usable
    assert e.metrics().prefix_cache_queries == 4 * 6  # preempted re-admissions are not counted again


def test_the_request_admitted_last_is_the_one_preempted_and_it_resumes_from_its_cached_blocks() -> None:
    """As vLLM (recompute): when a decoding request needs a block and none is free, the running request
    admitted most recently is preempted, its blocks freed (hashed ones kept cached); it is scheduled
    again once there is room, hits the blocks of its own that are still cached, and its record keeps
    the hit of its first scheduling."""
    run = make(num_gpu_blocks=7, block_size=4, max_num_seqs=4)  # 6 usable blocks
    e = run.engine
    a = e.submit(SimRequest("a", toks(0, 8), max_tokens=9))  # each grows to 16 tokens: 4 blocks
    b = e.submit(SimRequest("b", toks(500, 8), max_tokens=9))
    run.kernel.run()
    assert (a.preemptions, b.preemptions) == (0, 1)  # b, admitted after a, made room
    assert a.output_tokens == b.output_tokens == 9 and a.finished_s is not None and b.finished_s is not None
    assert b.finished_s > a.finished_s and b.cached_tokens == 0  # the first scheduling's hit, kept
    assert e.metrics().prefix_cache_queries == 16  # each counted once
    # b's prompt blocks were stored once: at its re-admission they were still cached, and it hit them
    h = hashes_of(toks(500, 8), 4)
    assert sum(ev.block_hashes.count(x) for ev in run.stored() for x in h) == 2
    e.pool.check()
    assert e.pool.num_free == e.pool.usable


# -- the CPU tier -------------------------------------------------------------------------------


def test_write_back_evicted_blocks_go_to_the_cpu_tier_and_are_loaded_back_instead_of_recomputed() -> None:
    run = make(num_gpu_blocks=4, block_size=4, cpu_blocks=8, cpu_write_policy="write-back")  # GPU 1 2 3
    a12 = A + toks(108, 4)
    # A takes 1 2 -> queue 3 2 1; B takes 3, then 2 (evicts HA[1]: kept on the CPU, parent HA[0])
    # a12: GPU hit HA[0] (block 1); the CPU tier continues with HA[1] (cap floor(11 / 4) = 2): loaded,
    #   not recomputed; only the third block is computed
    recs = sequential(run, [A, B, a12])
    assert [(r.cached_tokens, r.cpu_loaded_tokens) for r in recs] == [(0, 0), (0, 0), (4, 4)]
    assert recs[2].reported_cached_tokens == 8
    cpu_stored = run.stored("cpu")
    assert cpu_stored[0].block_hashes == (HA[1],) and cpu_stored[0].parent_block_hash == HA[0]
    assert cpu_stored[0].token_ids == tuple(A[4:])
    # the loaded block is cached when the load has ended and a12 is scheduled (vLLM's
    # `_update_waiting_for_remote_kv`), then its first chunk's block: two BlockStored in one batch
    gpu = run.stored()
    h12 = hashes_of(a12, 4)
    assert gpu[-2].block_hashes == (h12[1],) and gpu[-2].parent_block_hash == HA[0]
    assert gpu[-1].block_hashes == (h12[2],) and gpu[-1].parent_block_hash == h12[1]
    m = run.engine.metrics()
    assert m.prefix_cache_hits == 4  # the CPU part is the connector's, not the prefix cache's
    ingest = KvIngest(BlockIndex(block_size=4, max_entries=1000), FreshnessTracker(), lambda pod: "m")
    for seq, payload, at in run.batches:
        ingest.on_live(POD, 0, seq, payload, at)
    assert_index_agrees(run.engine, ingest, [A, B, a12])


def test_cpu_reload_costs_its_bandwidth_and_latency() -> None:
    bs = 16
    run = make(num_gpu_blocks=9, block_size=bs, cpu_blocks=64)  # 8 usable blocks of 16
    a = toks(0, 64)  # 4 blocks
    b = toks(1000, 128)  # 8 blocks: evicts all of a to the CPU
    recs = sequential(run, [a, b, [*a, 7]])
    assert recs[2].cpu_loaded_tokens == 64 and recs[2].cached_tokens == 0
    prefill = LAT.step_seconds(1, 1, 1 * (64 + 0.5), 0, 0)
    assert recs[2].ttft_s == pytest.approx(prefill + LAT.reload_seconds(64))
    assert run.removed("cpu") == []  # the CPU tier never filled


def test_write_back_cpu_tier_evicts_least_recently_used_with_cpu_events() -> None:
    run = make(num_gpu_blocks=3, block_size=4, cpu_blocks=2, cpu_write_policy="write-back")  # 2 usable
    sequential(run, [A, B, C])
    # B evicts A's 2 blocks to the CPU (HA[1], HA[0]); C evicts B's (HB[1], HB[0]), which pushes A's out
    assert run.removed("gpu") == [HA[1], HA[0], HB[1], HB[0]]
    assert run.removed("cpu") == [HA[1], HA[0]]
    assert list(run.engine.cpu.lru) == [HB[1], HB[0]]  # type: ignore[union-attr]


def all_hashes(run: Run, kind: type, tier: str) -> list[int]:
    return [h for e in run.events if isinstance(e, kind) and e.tier == tier for h in e.block_hashes]


def test_write_through_stores_every_block_on_the_cpu_as_it_is_computed() -> None:
    """vLLM's OffloadingConnector: each block goes to the CPU as it is computed (its BlockStored right
    after the GPU's); the GPU evicting it later is only a GPU BlockRemoved, and it is loaded back."""
    run = make(num_gpu_blocks=4, block_size=4, cpu_blocks=8)  # usable GPU 1 2 3; write-through: default
    a12 = A + toks(108, 4)
    recs = sequential(run, [A, B, a12])
    assert [(r.cached_tokens, r.cpu_loaded_tokens) for r in recs] == [(0, 0), (0, 0), (4, 4)]
    cpu = run.stored("cpu")
    assert cpu[0].block_hashes == tuple(HA) and cpu[0].parent_block_hash is None
    assert cpu[0].token_ids == tuple(A)
    assert cpu[1].block_hashes == tuple(HB)
    assert all_hashes(run, BlockStored, "cpu")[:4] == [*HA, *HB]  # a12's blocks follow (its third)
    assert HA[1] in all_hashes(run, BlockRemoved, "gpu")  # evicted by B's second block...
    assert all_hashes(run, BlockRemoved, "cpu") == []  # ...and still on the CPU, where a12 loads it
    events = run.events
    first_gpu = next(i for i, e in enumerate(events) if isinstance(e, BlockStored) and e.tier == "gpu")
    assert events[first_gpu + 1] == cpu[0]  # the CPU's copy right after the GPU's
    ingest = KvIngest(BlockIndex(block_size=4, max_entries=1000), FreshnessTracker(), lambda pod: "m")
    for seq, payload, at in run.batches:
        ingest.on_live(POD, 0, seq, payload, at)
    assert_index_agrees(run.engine, ingest, [A, B, a12])


def test_write_through_cpu_tier_keeps_the_most_recently_written_blocks() -> None:
    run = make(num_gpu_blocks=3, block_size=4, cpu_blocks=2)  # 2 usable GPU blocks, 2 CPU blocks
    sequential(run, [A, B, C])
    # each request's two blocks are written through; each pair pushes the one before out of the CPU
    assert all_hashes(run, BlockRemoved, "cpu") == [*HA, *HB]
    assert all_hashes(run, BlockRemoved, "gpu") == [HA[1], HA[0], HB[1], HB[0]]
    assert list(run.engine.cpu.lru) == list(hashes_of(C, 4)[:2])  # type: ignore[union-attr]


def test_an_unknown_cpu_write_policy_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="cpu_write_policy must be one of write-through, write-back"):
        EngineConfig(cpu_blocks=4, cpu_write_policy="lazy")


# -- hypothesis: sequential requests against a literal model of the rules ---------------------------


class RefEngine:
    """vllm-prefix-cache.md, literally, for requests run one at a time (list free queue, front = 0)."""

    def __init__(self, num_blocks: int, bs: int, budget: int) -> None:
        self.bs, self.budget = bs, budget
        self.free = list(range(1, num_blocks))
        self.hash_of: dict[int, int] = {}
        self.copies: dict[int, list[int]] = {}
        self.removed: list[int] = []

    def run(self, prompt: list[int], outputs: list[int]) -> int:
        bs = self.bs
        tokens = prompt + outputs  # the KV the request computes: prompt + all outputs but the last
        hashes = hashes_of(tokens, bs)
        hit: list[int] = []
        for h in hashes[: (len(prompt) - 1) // bs]:
            if h not in self.copies:
                break
            hit.append(self.copies[h][0])
        for b in hit:
            if b in self.free:
                self.free.remove(b)
        blocks, cached = list(hit), len(hit)
        done = len(hit) * bs
        while done < len(prompt):  # chunked prefill
            done += min(len(prompt) - done, self.budget)
            cached = self._fill(blocks, hashes, cached, done)
        for c in range(len(prompt), len(tokens)):  # one decode token per step
            cached = self._fill(blocks, hashes, cached, c + 1)
        for b in reversed(blocks):
            if b in self.hash_of:
                self.free.append(b)
            else:
                self.free.insert(0, b)
        return len(hit) * bs

    def _fill(self, blocks: list[int], hashes: list[int], cached: int, upto: int) -> int:
        while len(blocks) * self.bs < upto:
            b = self.free.pop(0)
            if b in self.hash_of:
                h = self.hash_of.pop(b)
                self.copies[h].remove(b)
                if not self.copies[h]:
                    del self.copies[h]
                self.removed.append(h)
            blocks.append(b)
        for i in range(cached, upto // self.bs):
            self.hash_of[blocks[i]] = hashes[i]
            self.copies.setdefault(hashes[i], []).append(blocks[i])
        return max(cached, upto // self.bs)


segments = st.lists(st.integers(0, 2), min_size=1, max_size=6)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, int, list[tuple[list[int], int]]]:
    bs = draw(st.sampled_from([1, 2, 4]))
    blocks = draw(st.integers(3, 14))
    reqs = []
    prev: list[int] = []
    for _ in range(draw(st.integers(1, 25))):
        # a new prompt continues a previous one (shared prefixes, repeats, block-aligned or not) or not
        keep = draw(st.integers(0, len(prev))) if len(prev) > 0 and draw(st.booleans()) else 0
        prompt = prev[:keep] + [t for seg in draw(st.lists(segments, max_size=3)) for t in seg]
        if not prompt:
            prompt = [0]
        max_tokens = draw(st.integers(1, 5))
        kv = len(prompt) + max_tokens - 1
        if -(-kv // bs) > blocks - 1:
            continue
        reqs.append((prompt, max_tokens))
        prev = prompt
    return bs, blocks, reqs


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from([1, 3, 8, 8192]))
def test_sequential_requests_match_the_literal_model(
    w: tuple[int, int, list[tuple[list[int], int]]], budget: int
) -> None:
    bs, blocks, reqs = w
    run = make(num_gpu_blocks=blocks, block_size=bs, max_num_batched_tokens=budget, max_num_seqs=1)
    ref = RefEngine(blocks, bs, budget)
    recs = []
    for i, (prompt, max_tokens) in enumerate(reqs):
        outputs = [7 + (i + j) % 3 for j in range(max_tokens)]  # generated tokens repeat prompts' ids
        rec = run.engine.submit(SimRequest(f"r{i}", prompt, max_tokens, output_token_ids=outputs))
        run.kernel.run()
        assert rec.cached_tokens == ref.run(prompt, outputs[: max_tokens - 1])
        assert run.engine.pool.free_queue() == ref.free
        recs.append(rec)
    run.engine.pool.check()
    assert run.removed() == ref.removed  # the eviction order, from the decoded events
    assert {h: run.engine.pool.copies(h) for h in run.engine.pool.cached} == ref.copies
    m = run.engine.metrics()
    assert m.prefix_cache_hits == sum(r.cached_tokens for r in recs)
    assert m.prefix_cache_queries == sum(len(p) for p, _ in reqs)


# -- hypothesis: concurrent requests keep the invariants and the index in agreement ----------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.integers(0, 3), st.integers(1, 24), st.integers(1, 12)),
        min_size=1,
        max_size=30,
    ),
    st.integers(0, 12),
)
def test_concurrent_requests_conserve_blocks_and_the_index_agrees(
    reqs: list[tuple[int, int, int, int]], cpu_blocks: int
) -> None:
    run = make(
        num_gpu_blocks=12, block_size=4, max_num_batched_tokens=16, max_num_seqs=4, cpu_blocks=cpu_blocks
    )
    e, k = run.engine, run.kernel
    prompts = [toks(1000 * family, n) for _, family, n, _ in reqs]
    recs: list[RequestRecord] = []
    for (at, _, _, m), p in zip(reqs, prompts, strict=True):
        k.at(at * 0.01, lambda p=p, m=m: recs.append(e.submit(SimRequest(f"r{len(recs)}", p, m))))  # type: ignore[misc]

    def check() -> None:
        e.pool.check()
        if len(k) > 0:
            k.schedule(0.003, check, priority=1)

    k.schedule(0.0, check, priority=1)
    k.run()
    e.pool.check()
    assert len(recs) == len(reqs) and all(r.output_tokens == r.max_tokens for r in recs)
    assert all(r.ttft_s is not None and r.ttft_s > 0 for r in recs)
    assert e.pool.num_free == e.pool.usable and e.idle
    assert e.metrics().prefix_cache_hits == sum(r.cached_tokens for r in recs)
    ingest = KvIngest(BlockIndex(block_size=4, max_entries=10_000), FreshnessTracker(), lambda pod: "m")
    for seq, payload, t in run.batches:
        ingest.on_live(POD, 0, seq, payload, t)
    assert POD not in ingest.counters or ingest.counters[POD].orphans == 0
    assert_index_agrees(e, ingest, prompts)


# -- metrics, adapters, wire format, configuration -------------------------------------------------


def test_metrics_while_busy_are_what_the_scraper_would_read() -> None:
    """vLLM's /metrics shows the stats made at the end of the last step (`step_stats.py`)."""
    run = make(num_gpu_blocks=11, block_size=4, max_num_seqs=2, model="llama")  # 10 usable
    e = run.engine
    for i in range(3):
        e.submit(SimRequest(f"r{i}", toks(i * 100, 8), max_tokens=4, lora_name="ad" if i == 2 else None))
    run.kernel.step()  # the first step started: two admitted (max_num_seqs), one waiting
    assert (len(e.waiting), len(e.running), e.pool.num_used) == (1, 2, 4)  # the scheduler, live
    m = e.metrics()
    assert (m.waiting, m.running, m.kv_usage, m.prefix_cache_queries) == (0, 0, 0.0, 0.0)  # no step ended yet
    run.kernel.step()  # its end (the next step starts right after: the decodes take their third block)
    assert e.pool.num_used == 6
    m = e.metrics()
    assert (m.waiting, m.running) == (1, 2)
    assert m.kv_usage == pytest.approx(4 / 10)  # 2 blocks each, at the end of the first step
    assert m.prefix_cache_queries == 16
    assert m.models == frozenset({"llama"}) and m.waiting_lora_adapters == frozenset({"ad"})
    assert m.observed_at == run.kernel.now() and e.metrics(5.0).observed_at == 5.0
    run.kernel.run()
    assert e.metrics().kv_usage == 0.0
    adapter = [ev for ev in run.stored() if ev.lora_name == "ad"]
    assert adapter and all(ev.token_ids[0] >= 200 for ev in adapter)


def test_payloads_are_map_encoded_vllm_batches_with_the_dp_rank() -> None:
    import msgspec

    run = make(num_gpu_blocks=8, block_size=4, dp_rank=1)
    sequential(run, [A])
    seq, payload, at = run.batches[0]
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert (seq, ts, rank) == (0, at, 1)
    assert events[0]["type"] == "BlockStored" and events[0]["medium"] == "GPU"
    assert decode_batch(payload).data_parallel_rank == 1


def test_default_outputs_are_deterministic_and_bad_requests_are_refused() -> None:
    def stored_after(seed: str) -> list[BlockStored]:
        run = make(num_gpu_blocks=16, block_size=4)
        run.engine.submit(SimRequest(seed, toks(0, 4), max_tokens=9))
        run.kernel.run()
        return run.stored()

    assert stored_after("x") == stored_after("x") != stored_after("y")
    e = make(num_gpu_blocks=16, block_size=4).engine
    for bad, match in [
        (SimRequest("e", []), "empty prompt"),
        (SimRequest("n", [1, -2]), ">= 0"),
        (SimRequest("f", [1.5, 2.0]), "integers"),  # type: ignore[list-item]
        (SimRequest("m", [1], max_tokens=0), "max_tokens"),
        (SimRequest("o", [1], max_tokens=4, output_token_ids=[1, 2]), "output token ids"),
    ]:
        with pytest.raises(ValueError, match=match):
            e.submit(bad)
    with pytest.raises(ValueError):
        EngineConfig(max_num_seqs=512, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="reload bandwidth"):
        Engine(Kernel(), EngineConfig(cpu_blocks=4), LatencyProfile("x", 0, 0, 0, 0, 0, 0, 1.0))
    with pytest.raises(ValueError, match="unknown latency profile"):
        Engine(Kernel(), EngineConfig(), "no-such-profile")


def test_an_aborted_request_leaves_at_the_end_of_the_step_and_its_blocks_stay_cached() -> None:
    """vLLM's abort: a waiting request leaves at once; a running one at the end of the step in progress,
    before its outputs, with no finish; its blocks are freed and stay in the prefix cache; even one whose
    last token that step computes is aborted (vLLM's `EngineCore.step` drains its aborts queue before
    `update_from_output`); a second abort, or one after the finish, is False."""
    run = make(num_gpu_blocks=64, block_size=16, max_num_seqs=1)
    e, k = run.engine, run.kernel
    long_ = e.submit(SimRequest("long", toks(0, 64), 500))
    queued = e.submit(SimRequest("queued", toks(1000, 32), 5))  # waits: one sequence at a time
    k.run(until=0.2)
    assert len(e.running) == 1 and len(e.waiting) == 1
    assert e.abort(queued) and not e.waiting and queued.aborted_s == 0.2
    assert e.abort(long_) and not e.abort(long_)
    assert len(e.running) == 1  # until the step in progress ends
    k.run()
    assert not e.running and e.idle and e.pool.num_used == 0
    assert long_.finished_s is None and long_.aborted_s == 0.2 and 1 <= long_.output_tokens < 500
    assert queued.scheduled_s is None and run.finished == []
    again = sequential(run, [toks(0, 64)])[0]  # the aborted prompt's blocks are still cached
    assert again.cached_tokens == 48  # (the last block: vLLM always computes the prompt's last token)
    assert not e.abort(again)  # finished
    last = e.submit(SimRequest("last", toks(5000, 16), 2))
    while last.first_token_s is None:
        k.step()
    assert e.abort(last)  # during its last step: the abort wins
    k.run()
    assert last.finished_s is None and last.aborted_s is not None and last.output_tokens == 1
    assert [name for name, _ in run.finished] == ["r0"] and e.pool.num_used == 0
