"""One simulated vLLM engine (a pod), close to vLLM's V1 scheduler, driven by the event kernel. Pure.

The scheduler lives here; blocks, the prefix cache, the CPU tier and the KV events are the KV cache
manager's (`kvcache.py`, over `blocks.py` and `offload.py`), as vLLM splits its `Scheduler` and its
`KVCacheManager`. Scheduling, per step (one forward pass; its time from
`latency.LatencyProfile.step_seconds`, so the EPP's cost model describes this engine):

1. Every running request past its prefill decodes one token (it always fits: `max_num_seqs` is at
   most the token budget). vLLM walks its running queue in admission order and can starve a
   decode behind a long prefill chunk; here decodes go first (as Sarathi and vLLM V0's chunked
   prefill do), so a running request never skips a step.
2. Running requests still in their prefill get the next chunk, in admission order, while the
   token budget (`max_num_batched_tokens`) lasts: chunked prefill.
3. Unless a request was preempted in this step, the requests whose CPU-tier load has ended are
   scheduled (below), then waiting requests are admitted in order while the budget lasts and fewer
   than `max_num_seqs` run: the GPU prefix-cache hit counts as computed, the first chunk is
   scheduled and the blocks for hit + chunk are taken. A request is admitted only if the blocks of
   its whole sequence fit (vLLM's default admission gate, `scheduler_reserve_full_isl`;
   `kvcache.KvCacheManager.admit`), not just its first chunk's; one that does not waits, and so does
   everything behind it (FCFS, as vLLM).

CPU-tier loads, as vLLM's offloading connector runs them (`load_kv_async`: the scheduler's
WAITING_FOR_REMOTE_KVS). A waiting request whose GPU hit the CPU tier continues is not scheduled
when it is admitted: its hit blocks and the blocks to load into are taken (the latter uncached), its
lookup is counted, and it waits (`_holding`, vLLM's `kv_holding_waiting`: a waiting request in the
stats, never preempted) while the requests behind it are admitted; its load takes
`latency.reload_seconds` from that step's start and no step's time. A load starts only if its blocks
fit beside what the in-flight prefills and loads still need for their whole sequences (vLLM's
`reserved_blocks`). The load is reported finished at the first step start at or after its end (vLLM's
worker reports it at the end of the step in progress; an engine with nothing else to run steps idly
until then, here it waits for the load's end). From then the request is scheduled before the waiting
ones, in the order the loads started: its loaded blocks are cached (one `BlockStored`) and, if the
rest of its sequence fits, its first chunk runs with hit + load counted as computed
(`Scheduler._update_waiting_for_remote_kv`); if not, nothing behind it is admitted in that step.

A request submitted while a step runs joins the queue the scheduler sees when the next step is
scheduled, as vLLM's engine core takes in new requests between steps.

Blocks are taken as needed, as vLLM's `allocate_slots` does: a chunk takes the blocks its tokens
reach; a decoding request takes one more when its next token starts a block. Full blocks are
hashed (chained over prompt and generated tokens) and cached when their tokens are scheduled, so a
request admitted later in the same step already hits them. A request's first output token comes
at the end of the step that completes its prefill; it finishes after `max_tokens`, and its blocks
are then freed in reverse order.

Preemption, as vLLM's (recompute): when a running request needs a block and none is free, the
most recently admitted running request is preempted (its blocks freed, its progress dropped) and
put at the front of the queue, until the block fits or the request preempted itself. It is
scheduled again later with its prompt and the tokens it had generated as its prefill (which may
hit its own freed blocks); its record keeps the hit of its first scheduling and the metrics count
its query once, as vLLM's do. A request needing more blocks than the engine holds is refused at
`submit`.

Decode bookkeeping is per event, not per token: a decoding request is looked at only in the steps
where it starts or fills a block and at its last step (`_wake_start`, `_wake_end`), so a step costs
Python work for the requests that change state in it, not for the whole batch.

Spans: consecutive decode-only steps in which no request wakes (nothing waits, nothing prefills, no
event is pending) change nothing but the step counter and the context length, so they run as one
kernel event: the engine computes each step's end time as the kernel would (one after the other,
`t + step_seconds(...)`) and schedules only the last one. Every observation gives the same answer
mid-span (metrics, probes, `steps_ended`). A request submitted mid-span cuts the span at the end of
the step in progress, where the step-by-step engine would have seen it.

Abort (`abort`, a client gone): a waiting request leaves at once; a running or loading one leaves at
the end of the step in progress, before that step's outputs are processed (vLLM's `EngineCore.step`
drains its aborts queue before `update_from_output`), so it gets no token from that step and never
finishes, even when that step would have given its last token. One aborted between two steps (or
while the engine only waits for a load) leaves before the next is scheduled.

Outputs: KV events (`events.py`) at the end of each step that produced any; `metrics()` as the
EPP's scraper would read vLLM's `/metrics`: the stats of the end of the last step (`step_stats.py`);
per-request `RequestRecord`s and the callbacks `on_first_token(record, t)` and `on_finish(record, t)`.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections import deque
from itertools import chain

from epp.types import MetricsSnapshot
from simulator.engine_config import EngineConfig
from simulator.events import EventSink, OnEvents
from simulator.kernel import Handle, Kernel
from simulator.kvcache import DECODE, DONE, LOADED, LOADING, PREFILL, WAITING, KvCacheManager, ReqState
from simulator.latency import DEFAULT_PROFILE, LatencyProfile, latency_profile
from simulator.records import (
    RequestCallback,
    RequestRecord,
    SimRequest,
    TokenIds,
    as_token_array,
    fed_tokens,
)
from simulator.step_stats import StepStats

__all__ = ["Engine", "EngineConfig"]


Wake = list[tuple[ReqState, int]]


class Engine:
    """One engine on `kernel`. `latency`: a `LatencyProfile` or a name in `latency.PROFILES`.
    `on_events(seq, payload, at)` receives its KV event batches; `on_first_token(record, t)` and
    `on_finish(record, t)` its requests' progress."""

    def __init__(
        self,
        kernel: Kernel,
        config: EngineConfig | None = None,
        latency: LatencyProfile | str = DEFAULT_PROFILE,
        *,
        on_events: OnEvents | None = None,
        on_first_token: RequestCallback | None = None,
        on_finish: RequestCallback | None = None,
        spans: bool = True,
    ) -> None:
        """`spans=False` runs every step as its own kernel event (the same results, slower; a check)."""
        self.kernel = kernel
        self._spans = spans
        self.config = cfg = config or EngineConfig()
        self.latency = latency_profile(latency) if isinstance(latency, str) else latency
        if cfg.cpu_blocks and self.latency.cpu_bandwidth_bytes_per_s is None:
            raise ValueError(f"a CPU tier needs a reload bandwidth; profile {self.latency.name!r} has none")
        self.block_size = cfg.block_size
        self.sink = EventSink(on_events, cfg.block_size, cfg.dp_rank) if on_events is not None else None
        self.kv = KvCacheManager(cfg.num_gpu_blocks, cfg.block_size, cfg.cpu_blocks, self.sink)
        self.pool = self.kv.pool
        self.cpu = self.kv.cpu
        self.on_first_token = on_first_token
        self.on_finish = on_finish
        self.waiting: deque[ReqState] = deque()
        self.running: dict[int, ReqState] = {}  # by admission order
        self._prefilling: list[ReqState] = []  # running, prefill incomplete, in admission order
        self._chunks: list[tuple[ReqState, int]] = []  # this step's prefill chunks
        self._wake_start: dict[int, Wake] = {}  # step -> decoding requests that start / fill a block
        self._wake_end: dict[int, Wake] = {}  # step -> decoding requests that finish at its end
        self._n_dec = 0  # decoding requests
        self._ctx = 0  # their KV tokens, at the start of the current step
        self._step = 0
        self._bounds: list[int] = []  # heap: the last step a span may reach, per pending wake (lazy)
        self._span: tuple[int, list[float], int, Handle] | None = None  # (first step, ends, ctx, event)
        self._span_stats = False  # the span's first step's end has not been taken into `stats` yet
        self._order = 0
        self._aborts: list[ReqState] = []  # running requests aborted, leaving at the next step end or start
        self._arrivals: list[ReqState] = []  # waiting, submitted since the current step was scheduled
        self._holding: list[ReqState] = []  # loading their CPU-tier hit (vLLM's kv_holding_waiting), in order
        self._wait: Handle | None = None  # no step runs: the engine waits for the first load to end
        self._states: dict[int, ReqState] = {}  # id(record) -> its state, until it finishes or leaves
        self._busy = False
        self._preempted = False
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.steps = 0
        self.preemptions = 0
        self._loras = False  # set once a request names a LoRA adapter
        self.stats = StepStats(cfg.block_size, cfg.num_gpu_blocks, frozenset({cfg.model}))

    # -- requests ------------------------------------------------------------------------------
    def submit(self, request: SimRequest) -> RequestRecord:
        """Queue a request now; ValueError if it is malformed or can never fit the KV cache."""
        if request.lora_name:
            self._loras = True
        bs = self.block_size
        prompt = as_token_array(request.prompt_token_ids, "prompt token ids")
        n = len(prompt)
        m = request.max_tokens
        if n == 0:
            raise ValueError(f"request {request.request_id!r}: empty prompt")
        if m < 1:
            raise ValueError(f"request {request.request_id!r}: max_tokens must be >= 1, got {m}")
        need = -(-(n + m - 1) // bs)  # the last output token is never fed back
        if need > self.pool.usable:
            raise ValueError(
                f"request {request.request_id!r}: {n} prompt + {m} output tokens need {need} blocks of "
                f"{bs} tokens; the engine has {self.pool.usable} usable blocks"
            )
        tokens = fed_tokens(request, prompt, m - 1)
        rec = RequestRecord(request, n, self.kernel.now())
        state = self.kv.new_request(rec, tokens)
        self._states[id(rec)] = state
        self.waiting.append(state)
        self._arrivals.append(state)
        if self._span is not None:
            self._cut_span()
        if not self._busy:
            self._busy = True
            self.kernel.schedule(0.0, self._start_step)
        elif self._wait is not None:
            self._wake_up()
        return rec

    def abort(self, rec: RequestRecord) -> bool:
        """vLLM's abort (its client went away): a waiting request leaves the queue now; a running one
        leaves at the end of the step in progress (a span is cut at that step), before its outputs: as
        vLLM's `EngineCore.step` processes the aborts that came during the model's execution before
        `update_from_output`, it gets no token from that step, and one whose last token that step computes
        does not finish. Its blocks are freed, last first, and stay in the prefix cache; no callback fires
        for it; `rec.aborted_s` is when the abort came. False when it already finished or was aborted."""
        r = self._states.pop(id(rec), None)
        if r is None or r.rec is not rec:
            return False
        rec.aborted_s = self.kernel.now()
        if r.phase == WAITING:
            self.waiting.remove(r)
            if r in self._arrivals:
                self._arrivals.remove(r)
            r.phase = DONE
            return True
        self._aborts.append(r)  # (a request loading its CPU-tier hit leaves as a running one does)
        if self._span is not None:
            self._cut_span()
        elif self._wait is not None:
            self._wake_up()
        return True

    def _leave(self, s: int) -> None:
        """The aborted running requests leave: at the end of step s, before its outputs (what it computed
        for them is dropped), or before step s is scheduled when they were aborted between steps."""
        prefill = False
        for v in self._aborts:
            if v.phase == LOADING or v.phase == LOADED:
                self._holding.remove(v)
                self.kv.free(v)
            else:
                prefill = prefill or v.phase == PREFILL
                self._unschedule(v, s)
            v.phase = DONE
            v.rec.output_tokens = v.outputs
        self._aborts = []
        if prefill and self._chunks:
            self._chunks = [c for c in self._chunks if c[0].phase == PREFILL]

    # -- one step ------------------------------------------------------------------------------
    def _start_step(self) -> None:
        s = self._step
        self._arrivals.clear()  # (the engine core took them in: the scheduler sees them now)
        if self._holding:
            self._loads_ended()
        if self._aborts:
            self._leave(s)
        self._preempted = False
        wakes = self._wake_start.pop(s, None)
        if wakes:
            for r, epoch in wakes:
                if r.epoch == epoch and r.phase == DECODE:
                    self._decode_wake(r, s)
        bounds = self._bounds
        while bounds and bounds[0] < s:
            heapq.heappop(bounds)
        if self._prefilling or self.waiting or self._holding:
            dt = self._schedule_prefills(s)
            if dt is None:
                return
        elif self._n_dec:
            self._chunks = []
            if bounds and self._spans and bounds[0] > s and (self.sink is None or not self.sink.events):
                self._start_span(s, bounds[0])
                return
            dt = self.latency.step_seconds(0, 0, 0.0, self._n_dec, self._ctx)
        else:
            self._busy = False
            self._take_stats()  # (vLLM steps once more to send out what left: an empty step's stats)
            return
        self.steps += 1
        self.kernel.schedule(dt, self._end_step)

    def _start_span(self, s: int, last: int) -> None:
        """Steps s..last, decode only, as one kernel event (see the module docstring)."""
        n = self._n_dec
        ends = self.latency.decode_step_ends(self.kernel.now(), last - s + 1, n, self._ctx)
        self.steps += last - s + 1
        self._span = (s, ends, self._ctx, self.kernel.at(ends[-1], self._end_step))
        self._span_stats = last > s  # (the last step's end is a kernel event: `_end_step` takes its stats)
        self._step = last
        self._ctx += n * (last - s)  # at the start of the last step (its end adds n)

    def _cut_span(self) -> None:
        """Something changed mid-span: end the span with the step in progress now (the first one not
        ended before now; one ending exactly now has not run its end yet, as in the kernel's order)."""
        assert self._span is not None
        s, ends, ctx0, handle = self._span
        i = bisect_left(ends, self.kernel.now())
        left = len(ends) - 1 - i
        if left <= 0:
            return
        self.kernel.cancel(handle)
        self.steps -= left
        self._step = s + i
        self._ctx = ctx0 + self._n_dec * i
        self._span = (s, ends[: i + 1], ctx0, self.kernel.at(ends[i], self._end_step))

    def steps_ended(self) -> int:
        """Steps whose end has happened by now (one is in progress while the engine is busy)."""
        if self._span is not None:
            ends = self._span[1]
            return self.steps - len(ends) + min(bisect_right(ends, self.kernel.now()), len(ends) - 1)
        return self.steps - (1 if self._busy and self._wait is None else 0)

    def _schedule_prefills(self, s: int) -> float | None:
        """Steps 2 and 3 of the module docstring; the step's time, or None when the step is empty."""
        budget = self.config.max_num_batched_tokens - self._n_dec
        chunks: list[tuple[ReqState, int]] = []
        tokens = 0
        pairs = 0.0
        for r in tuple(self._prefilling):
            if budget <= 0:
                break
            if r.phase != PREFILL:
                continue  # preempted in this step
            chunk = min(r.target - r.computed, budget)
            upto = r.computed + chunk
            if not self._grow(r, upto, s):
                continue
            self.kv.cache_full(r, upto)
            chunks.append((r, chunk))
            budget -= chunk
            tokens += chunk
            pairs += chunk * (r.computed + chunk / 2.0)
        starts = 0
        if not self._preempted:
            waiting, running = self.waiting, self.running
            max_seqs = self.config.max_num_seqs
            now = self.kernel.now()
            more = True
            if self._holding:  # vLLM schedules the waiting requests that hold blocks first
                kv = self.kv
                for r in tuple(self._holding):
                    if budget <= 0 or len(running) >= max_seqs:
                        more = False
                        break
                    if r.phase == LOADING:
                        continue  # skipped for this step
                    kv.cache_full(r, r.computed)  # its loaded blocks are cached (one BlockStored)
                    if kv.remaining(r) > self.pool.num_free:  # the whole-sequence gate
                        more = False
                        break
                    self._holding.remove(r)
                    self._run(r, now)
                    chunk = r.target - r.computed if r.target - r.computed < budget else budget
                    kv.grow(r, r.computed + chunk)  # (it fits: the gate)
                    chunks.append((r, chunk))
                    budget -= chunk
                    tokens += chunk
                    pairs += chunk * (r.computed + chunk / 2.0)
                    starts += 1
                    kv.cache_full(r, r.computed + chunk)
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
                self.kv.cache_full(r, r.computed + chunk)
        if not chunks and not self._n_dec:  # an empty step (vLLM still makes its stats)
            if self.sink is not None and self.sink.events:  # (a load's allocation evicted blocks)
                self.sink.flush(self.kernel.now())
            self._take_stats()
            if self.waiting and (self._preempted or not self._holding):
                self.kernel.schedule(0.0, self._start_step)  # everything running was preempted: admit afresh
            elif self._holding:
                self._await_load()
            else:
                self._busy = False
            return None
        self._chunks = chunks
        return self.latency.step_seconds(starts, tokens, pairs, self._n_dec, self._ctx)

    def _admit(self, r: ReqState, budget: int, now: float) -> int:
        """Waiting request `r` (the queue's head): -1 if its blocks do not fit; else it leaves the queue, its
        prefix-cache lookup is counted, and it is either scheduled (0: r.computed is its hit, its first
        chunk's blocks are taken) or, when the CPU tier continues its hit, left waiting for that load (the
        tokens loaded: the blocks of hit and load are taken, nothing is scheduled; `_holding`)."""
        got = self.kv.admit(r, budget, self._reserved_blocks)
        if got is None:
            return -1
        nh, nc, _ = got
        self.waiting.popleft()
        rec = r.rec
        bs = self.block_size
        if rec.scheduled_s is None:  # not a preempted request's return
            rec.cached_tokens = nh * bs
            rec.cpu_loaded_tokens = nc * bs
            self.prefix_cache_queries += r.target
            self.prefix_cache_hits += nh * bs
        if nc:
            r.phase = LOADING
            r.ready_s = now + self.latency.reload_seconds(nc * bs)
            self._holding.append(r)
            return nc * bs
        self._run(r, now)
        return 0

    def _run(self, r: ReqState, now: float) -> None:
        """r is scheduled (admitted to the running set): its prefill starts."""
        r.phase = PREFILL
        r.order = self._order
        self._order += 1
        self.running[r.order] = r
        self._prefilling.append(r)
        if r.rec.scheduled_s is None:
            r.rec.scheduled_s = now

    # -- CPU-tier loads (vLLM's offloading connector: `load_kv_async`, WAITING_FOR_REMOTE_KVS) -------
    def _reserved_blocks(self) -> int:
        """vLLM's `_inflight_prefill_reserved_blocks`: the blocks that the running requests still in their
        prefill and the loading ones still need for their whole sequences (a load must leave them free)."""
        remaining = self.kv.remaining
        return sum(remaining(r) for r in self._prefilling) + sum(remaining(r) for r in self._holding)

    def _loads_ended(self) -> None:
        """At a step's start: the loads that have ended are reported finished (vLLM's worker reports them at
        the end of the step in progress, `finished_recving`; an engine with nothing else to run steps idly
        until then), so those requests can be scheduled."""
        now = self.kernel.now()
        for r in self._holding:
            if r.phase == LOADING and r.ready_s <= now:
                r.phase = LOADED

    def _await_load(self) -> None:
        """Nothing to run but loads: the next step starts when the first one ends (or a request arrives or
        leaves: `_wake_up`)."""
        ends = [r.ready_s for r in self._holding if r.phase == LOADING]
        if not ends:  # (the gate that starts a load keeps the blocks of the loads before it free)
            raise AssertionError("requests holding loaded blocks cannot be scheduled on an idle engine")
        self._wait = self.kernel.at(max(min(ends), self.kernel.now()), self._load_waited)

    def _load_waited(self) -> None:
        self._wait = None
        self._start_step()

    def _wake_up(self) -> None:
        """A request arrived or left while the engine waits for a load: it steps now."""
        assert self._wait is not None
        self.kernel.cancel(self._wait)
        self._wait = None
        self.kernel.schedule(0.0, self._start_step)

    def _grow(self, r: ReqState, upto: int, s: int) -> bool:
        """Blocks for r's first `upto` tokens, preempting the newest running requests if needed; False
        when r itself was preempted."""
        kv = self.kv
        while not kv.grow(r, upto):
            victim = self.running[next(reversed(self.running))]
            self._preempt(victim, s)
            if victim is r:
                return False
        return True

    def _unschedule(self, v: ReqState, s: int) -> None:
        """Running v stops before step s: out of the running set and the decode accounting (its pending
        wakes void), its blocks freed (last first, kept in the prefix cache)."""
        del self.running[v.order]
        if v.phase == DECODE:
            done = s - v.s0
            v.computed = v.c0 + done
            v.outputs = v.o0 + done
            self._n_dec -= 1
            self._ctx -= v.computed
            v.epoch += 1
        else:
            self._prefilling.remove(v)
        self.kv.free(v)

    def _preempt(self, v: ReqState, s: int) -> None:
        self._unschedule(v, s)
        v.computed = 0
        v.target = v.prompt_len + v.outputs
        v.phase = WAITING
        self.waiting.appendleft(v)
        v.rec.preemptions += 1
        self.preemptions += 1
        self._preempted = True

    def _decode_wake(self, r: ReqState, s: int) -> None:
        c = r.c0 + s - r.s0  # the position r computes in step s
        bs = self.block_size
        if c % bs == 0 and not self._grow(r, c + 1, s):
            return
        if (c + 1) % bs == 0:
            self.kv.cache_full(r, c + 1)
        self._wake(r, s + 1)

    def _wake(self, r: ReqState, s: int) -> None:
        """Look at decoding r again in the first step from `s` where it starts or fills a block."""
        bs = self.block_size
        m = (r.c0 + s - r.s0) % bs
        if m and m != bs - 1:
            s += bs - 1 - m
        if s <= r.s_fin:
            self._wake_start.setdefault(s, []).append((r, r.epoch))
            heapq.heappush(self._bounds, s - 1)

    def _end_step(self) -> None:
        self._span = None
        self._span_stats = False
        s = self._step
        if self._aborts:
            self._leave(s)
        self._step = s + 1
        now = self.kernel.now()
        self._ctx += self._n_dec
        done: list[tuple[RequestCallback | None, RequestRecord]] | None = None
        ends = self._wake_end.pop(s, None)
        if ends:
            done = []
            for r, epoch in ends:
                if r.epoch == epoch and r.phase == DECODE:
                    r.computed = r.c0 + s - r.s0 + 1
                    r.outputs = r.max_tokens
                    self._n_dec -= 1
                    self._ctx -= r.computed
                    self._finish(r, now)
                    done.append((self.on_finish, r.rec))
        if self._chunks:
            if done is None:
                done = []
            self._end_prefills(s, now, done)
        if self.sink is not None:
            self.sink.flush(now)
        self._take_stats()
        if done:
            for callback, rec in done:
                if callback is not None:
                    callback(rec, now)
        if not (self.waiting or self.running or self._holding):
            self._busy = False
        elif self.kernel.peek() > now:
            self._start_step()  # nothing else happens at `now`: the same as scheduling it
        else:
            self.kernel.schedule(0.0, self._start_step)

    def _end_prefills(
        self, s: int, now: float, done: list[tuple[RequestCallback | None, RequestRecord]]
    ) -> None:
        """The step's prefill chunks are computed: a request whose prefill is complete gets a token."""
        prefilled = False
        for r, chunk in self._chunks:
            r.computed += chunk
            if r.computed < r.target:
                continue
            prefilled = True
            r.outputs += 1
            if r.outputs == 1:
                r.rec.first_token_s = now
                done.append((self.on_first_token, r.rec))
            if r.outputs >= r.max_tokens:
                self._finish(r, now)
                done.append((self.on_finish, r.rec))
                continue
            r.phase = DECODE
            r.s0 = s + 1
            r.c0 = r.computed
            r.o0 = r.outputs
            r.s_fin = r.s0 + r.max_tokens - r.outputs - 1
            self._n_dec += 1
            self._ctx += r.computed
            self._wake_end.setdefault(r.s_fin, []).append((r, r.epoch))
            heapq.heappush(self._bounds, r.s_fin)
            self._wake(r, r.s0)
        self._chunks = []
        if prefilled:
            self._prefilling = [r for r in self._prefilling if r.phase == PREFILL]

    def _finish(self, r: ReqState, now: float) -> None:
        r.phase = DONE
        self._states.pop(id(r.rec), None)
        del self.running[r.order]
        self.kv.free(r)
        rec = r.rec
        rec.finished_s = now
        rec.output_tokens = r.outputs

    def _take_stats(self) -> None:
        """vLLM's `make_stats` at the end of a step: what `metrics()` shows until the next one."""
        waiting = self.waiting
        holding = self._holding  # (loading requests wait: vLLM counts WAITING_FOR_REMOTE_KVS as waiting)
        self.stats.take(
            chain(holding, waiting) if holding else waiting,
            len(holding) + len(waiting) - len(self._arrivals),
            self.running.values(),
            len(self.running),
            self.pool.num_used,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self._loras,
        )

    # -- observation ---------------------------------------------------------------------------
    def metrics(self, now: float | None = None) -> MetricsSnapshot:
        """What the EPP's scraper builds from this engine's vLLM `/metrics` page now: the stats of the end
        of the last step (`step_stats.py`), not the scheduler's state mid-step. The live state stays in
        `waiting`, `running`, `pool` and the `prefix_cache_*` counters."""
        span = self._span
        if self._span_stats and span is not None and len(span[1]) > 1 and span[1][0] <= self.kernel.now():
            # the span's first step has ended (its start took the blocks of its wakes; nothing changes
            # after it): the stats its end would have made, as `steps_ended` counts it
            self._span_stats = False
            self._take_stats()
        return self.stats.snapshot(self.kernel.now() if now is None else now)

    def probe(
        self, token_ids: TokenIds, cache_salt: str | None = None, lora_name: str | None = None
    ) -> tuple[int, int]:
        """(tokens of the prompt's longest cached prefix on the GPU, tokens the CPU tier continues it
        with), both in whole blocks and without vLLM's `len - 1` cap: the engine's true state."""
        return self.kv.probe(as_token_array(token_ids), cache_salt, lora_name)

    def reset_prefix_cache(self) -> bool:
        """vLLM's `reset_prefix_cache` (its `POST /reset_prefix_cache`): every cached block is forgotten
        and `AllBlocksCleared` published; refused (False, nothing changed) while requests are queued or
        running, as vLLM refuses while blocks are in use."""
        if self._busy or self.waiting or self.running:
            return False
        return self.kv.reset_prefix_cache(self.kernel.now())

    @property
    def idle(self) -> bool:
        return not self._busy
