"""An engine's scheduler queues: the waiting queue, the running set, each step's prefill chunks, admission
and preemption (vLLM's `Scheduler`, but for the decodes: `decode_batch.py`). Pure.

`schedule` is steps 2 and 3 of an engine's step (`engine.py`; step 1, the decodes, took its tokens
from the budget first):

2. Running requests still in their prefill get the next chunk, in admission order, while the
   token budget (`max_num_batched_tokens`) lasts: chunked prefill.
3. Unless a request was preempted in this step, the requests whose CPU-tier load has ended are
   scheduled (`cpu_loads.py`), then waiting requests are admitted in order while the budget lasts and
   fewer than `max_num_seqs` run: the GPU prefix-cache hit counts as computed, the first chunk is
   scheduled and the blocks for hit + chunk are taken. A request is admitted only if the blocks of
   its whole sequence fit (vLLM's default admission gate, `scheduler_reserve_full_isl`;
   `kvcache.KvCacheManager.admit`), not just its first chunk's; one that does not waits, and so does
   everything behind it (FCFS, as vLLM). One whose GPU hit the CPU tier continues is not scheduled: it
   waits for its load (`cpu_loads.py`) while the requests behind it are admitted.

Blocks are taken as needed, as vLLM's `allocate_slots` does: a chunk takes the blocks its tokens
reach (a decoding request one more when its next token starts a block: `decode_batch.py`). Full
blocks are hashed (chained over prompt and generated tokens) and cached when their tokens are
scheduled, so a request admitted later in the same step already hits them.

Preemption, as vLLM's (recompute): when a running request needs a block and none is free, the
most recently admitted running request is preempted (its blocks freed, its progress dropped) and
put at the front of the queue, until the block fits or the request preempted itself (`grow`). It is
scheduled again later with its prompt and the tokens it had generated as its prefill (which may
hit its own freed blocks); its record keeps the hit of its first scheduling and the metrics count
its query once, as vLLM's do.
"""

from __future__ import annotations

from collections import deque

from simulator.cpu_loads import Chunks, LoadQueue
from simulator.decode_batch import DecodeBatch
from simulator.engine_config import EngineConfig
from simulator.kvcache import DECODE, PREFILL, WAITING, KvCacheManager, ReqState

HeldBack = tuple[int, int, "set[int] | frozenset[int]"]
NOTHING_HELD: HeldBack = (0, 0, frozenset())


class Scheduler:
    """The engine's `waiting` queue and `running` set (by admission order; `prefilling`: those still in
    their prefill, in that order); `loads` holds the admitted requests waiting for their CPU-tier load,
    `decodes` books the decoding ones. `preempted`: a request was preempted in the step being scheduled
    (the engine clears it at each step's start)."""

    __slots__ = (
        "_decodes",
        "_kv",
        "_loads",
        "_max_seqs",
        "_max_tokens",
        "_order",
        "held_back",
        "preempted",
        "preemptions",
        "prefilling",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "running",
        "waiting",
    )

    def __init__(
        self, config: EngineConfig, kv: KvCacheManager, loads: LoadQueue, decodes: DecodeBatch
    ) -> None:
        self._kv = kv
        self._loads = loads
        self._decodes = decodes
        self._max_tokens = config.max_num_batched_tokens
        self._max_seqs = config.max_num_seqs
        self.waiting: deque[ReqState] = deque()
        self.running: dict[int, ReqState] = {}  # by admission order
        self.prefilling: list[ReqState] = []  # running, prefill incomplete, in admission order
        self._order = 0
        # (blocks, running slots, block ids) admission must leave alone in the step being scheduled: with
        # async scheduling, what the requests that ended with the step before freed (the engine sets it)
        self.held_back: HeldBack = NOTHING_HELD
        self.preempted = False
        self.preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def schedule(self, s: int, now: float) -> tuple[Chunks, int, int, float]:
        """Steps 2 and 3 of step s (see the module docstring): its prefill chunks, the requests it starts,
        their tokens and the token pairs their attention computes (`latency.LatencyProfile.step_seconds`)."""
        budget = self._max_tokens - self._decodes.n
        chunks: Chunks = []
        tokens = 0
        pairs = 0.0
        kv = self._kv
        for r in tuple(self.prefilling):
            if budget <= 0:
                break
            if r.phase != PREFILL:
                continue  # preempted in this step
            chunk = min(r.target - r.computed, budget)
            upto = r.computed + chunk
            if not self.grow(r, upto, s):
                continue
            kv.cache_full(r, upto)
            chunks.append((r, chunk))
            budget -= chunk
            tokens += chunk
            pairs += chunk * (r.computed + chunk / 2.0)
        starts = 0
        if not self.preempted:
            waiting, running = self.waiting, self.running
            max_seqs = self._max_seqs - self.held_back[1]
            more = True
            if self._loads.holding:  # vLLM schedules the waiting requests that hold blocks first
                n = len(chunks)
                budget, more = self._loads.schedule(
                    chunks, budget, max_seqs - len(running), self.run, now, self.held_back[0]
                )
                for r, chunk in chunks[n:]:
                    tokens += chunk
                    pairs += chunk * (r.computed + chunk / 2.0)
                    starts += 1
            while more and waiting and budget > 0 and len(running) < max_seqs:
                r = waiting[0]
                loaded = self._admit(r, budget, now)
                if loaded < 0:
                    break
                if loaded:
                    continue  # it waits for its CPU-tier load, holding its blocks
                chunk = r.target - r.computed if r.target - r.computed < budget else budget
                chunks.append((r, chunk))
                budget -= chunk
                tokens += chunk
                pairs += chunk * (r.computed + chunk / 2.0)
                starts += 1
                kv.cache_full(r, r.computed + chunk)
        return chunks, starts, tokens, pairs

    def _admit(self, r: ReqState, budget: int, now: float) -> int:
        """Waiting request `r` (the queue's head): -1 if its blocks do not fit; else it leaves the queue, its
        prefix-cache lookup is counted, and it is either scheduled (0: r.computed is its hit, its first
        chunk's blocks are taken) or, when the CPU tier continues its hit, left waiting for that load (the
        tokens loaded: the blocks of hit and load are taken, nothing is scheduled; `LoadQueue.start`)."""
        held, _, ids = self.held_back
        got = self._kv.admit(r, budget, self._reserved_blocks, held, ids)
        if got is None:
            return -1
        nh, nc, _ = got
        self.waiting.popleft()
        rec = r.rec
        bs = self._kv.block_size
        if rec.scheduled_s is None:  # not a preempted request's return
            rec.cached_tokens = nh * bs
            rec.cpu_loaded_tokens = nc * bs
            self.prefix_cache_queries += r.target
            self.prefix_cache_hits += nh * bs
        if nc:
            self._loads.start(r, nc * bs, now)
            return nc * bs
        self.run(r, now)
        return 0

    def _reserved_blocks(self) -> int:
        return self._loads.reserved_blocks(self.prefilling)

    def run(self, r: ReqState, now: float) -> None:
        """r is scheduled (admitted to the running set): its prefill starts."""
        r.phase = PREFILL
        r.order = self._order
        self._order += 1
        self.running[r.order] = r
        self.prefilling.append(r)
        if r.rec.scheduled_s is None:
            r.rec.scheduled_s = now

    def prefilled(self) -> None:
        """Some prefills completed: they leave `prefilling`."""
        self.prefilling = [r for r in self.prefilling if r.phase == PREFILL]

    def grow(self, r: ReqState, upto: int, s: int) -> bool:
        """Blocks for r's first `upto` tokens, preempting the newest running requests if needed; False
        when r itself was preempted."""
        kv = self._kv
        need = -(-upto // kv.block_size) - r.nblocks  # (`kv.grow`'s fast paths, inlined)
        if need <= 0:
            return True
        if need <= kv.pool.num_free:
            kv._take(r, need)
            return True
        while not kv.grow(r, upto):
            victim = self.running[next(reversed(self.running))]
            self._preempt(victim, s)
            if victim is r:
                return False
        return True

    def unschedule(self, v: ReqState, s: int) -> None:
        """Running v stops before step s: out of the running set and the decode accounting (its pending
        wakes void), its blocks freed (last first, kept in the prefix cache)."""
        del self.running[v.order]
        if v.phase == DECODE:
            self._decodes.stop(v, s)
        else:
            self.prefilling.remove(v)
        self._kv.free(v)

    def _preempt(self, v: ReqState, s: int) -> None:
        self.unschedule(v, s)
        v.computed = 0
        v.target = v.prompt_len + v.outputs
        v.phase = WAITING
        self.waiting.appendleft(v)
        v.rec.preemptions += 1
        self.preemptions += 1
        self.preempted = True
