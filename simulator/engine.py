"""One simulated vLLM engine (a pod), close to vLLM's V1 scheduler, driven by the event kernel. Pure.

The engine runs the steps. Who runs in a step is the scheduler's (`scheduler.py`: the waiting queue,
the running set, admission, chunked prefill and preemption, with the CPU-tier loads of `cpu_loads.py`);
the decoding requests are booked per event (`decode_batch.py`); blocks, the prefix cache, the CPU tier
and the KV events are the KV cache manager's (`kvcache.py`, over `blocks.py` and `offload.py`), as vLLM
splits its `Scheduler` and its `KVCacheManager`. Scheduling, per step (one forward pass; its time from
`latency.LatencyProfile.step_seconds`, so the EPP's cost model describes this engine):

1. Every running request past its prefill decodes one token (it always fits: `max_num_seqs` is at
   most the token budget). vLLM walks its running queue in admission order and can starve a
   decode behind a long prefill chunk; here decodes go first (as Sarathi and vLLM V0's chunked
   prefill do), so a running request never skips a step.
2. Running requests still in their prefill get the next chunk, in admission order, while the
   token budget (`max_num_batched_tokens`) lasts: chunked prefill.
3. Unless a request was preempted in this step, the requests whose CPU-tier load has ended are
   scheduled, then waiting requests are admitted in order while the budget lasts and fewer than
   `max_num_seqs` run, each only if the blocks of its whole sequence fit (FCFS; `scheduler.py`).

A request submitted while a step runs joins the queue the scheduler sees when the next step is
scheduled, as vLLM's engine core takes in new requests between steps. With async scheduling (vLLM's
default, `EngineConfig.async_scheduling`) vLLM scheduled that next step already, while this one ran: the
request reaches the scheduler a step later, unless nothing else runs then (vLLM's step scheduled ahead
was empty); what the requests that end with a step free (blocks, running slots) is admitted into a step
later, vLLM having scheduled the next step while they still held it (`step_ahead.py`); and a step
scheduled while another ran sends its KV events and its stats when that one ends (`_scheduled`), as
vLLM's `update_from_output` does (docs/simulator.md).
A request needing more blocks than the engine holds is refused at `submit`. A request's first output
token comes at the end of the step that completes its prefill; it finishes after `max_tokens`, and its
blocks are then freed in reverse order.

Spans: consecutive decode-only steps in which no request wakes (nothing waits, nothing prefills, no
event is pending) change nothing but the step counter and the context length, so they run as one
kernel event: the engine computes each step's end time as the kernel would (one after the other,
`t + step_seconds(...)`) and schedules only the last one. Every observation gives the same answer
mid-span (metrics, probes, `steps_ended`). A request submitted mid-span cuts the span at the end of
the step in progress (async: of the next one), where the step-by-step engine would have seen it.

Abort (`abort`, a client gone): a waiting request leaves at once; a running or loading one leaves at
the end of the step in progress, before that step's outputs are processed (vLLM's `EngineCore.step`
drains its aborts queue before `update_from_output`), so it gets no token from that step and never
finishes, even when that step would have given its last token. One aborted between two steps (or
while the engine only waits for a load) leaves before the next is scheduled.

Outputs: KV events (`events.py`) at the end of each step that produced any (async: see above);
`metrics()` as the EPP's scraper would read vLLM's `/metrics`: the stats of the end of the last step
(`step_stats.py`);
per-request `RequestRecord`s and the callbacks `on_first_token(record, t)` and `on_finish(record, t)`.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import chain

from epp.types import MetricsSnapshot
from simulator.cpu_loads import Chunks, LoadQueue
from simulator.decode_batch import DecodeBatch
from simulator.engine_config import EngineConfig
from simulator.events import EventSink, OnBatches, OnEvents
from simulator.kernel import Handle, Kernel
from simulator.kvcache import DONE, LOADED, LOADING, PREFILL, WAITING, KvCacheManager, ReqState
from simulator.latency import DEFAULT_PROFILE, LatencyProfile, latency_profile
from simulator.records import (
    RequestCallback,
    RequestRecord,
    SimRequest,
    TokenIds,
    as_token_array,
    fed_tokens,
)
from simulator.scheduler import NOTHING_HELD, Scheduler
from simulator.step_ahead import StepAhead
from simulator.step_stats import StepStats

__all__ = ["Engine", "EngineConfig"]


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
        on_batches: OnBatches | None = None,
    ) -> None:
        """`spans=False` runs every step as its own kernel event (the same results, slower; a check).
        `on_batches`, instead of `on_events`: the KV event batches decoded, not as msgpack (`events.py`)."""
        self.kernel = kernel
        self._spans = spans
        self.config = cfg = config or EngineConfig()
        self.latency = latency_profile(latency) if isinstance(latency, str) else latency
        if cfg.cpu_blocks and self.latency.cpu_bandwidth_bytes_per_s is None:
            raise ValueError(f"a CPU tier needs a reload bandwidth; profile {self.latency.name!r} has none")
        self.block_size = cfg.block_size
        self.sink = (
            EventSink(on_events, cfg.block_size, cfg.dp_rank, on_batches=on_batches)
            if on_events is not None or on_batches is not None
            else None
        )
        self.kv = KvCacheManager(
            cfg.num_gpu_blocks,
            cfg.block_size,
            cfg.cpu_blocks,
            self.sink,
            cfg.cpu_write_policy == "write-through",
        )
        self.pool = self.kv.pool
        self.cpu = self.kv.cpu
        self.on_first_token = on_first_token
        self.on_finish = on_finish
        self._decodes = DecodeBatch(self.kv)
        self._loads = LoadQueue(kernel, self.kv, self.latency, self._start_step)
        self._sched = Scheduler(cfg, self.kv, self._loads, self._decodes)
        self._grow = self._sched.grow
        self.waiting = self._sched.waiting
        self.running = self._sched.running  # by admission order
        self._chunks: Chunks = []  # this step's prefill chunks
        self._step = 0
        self._span: tuple[int, list[float], int, Handle] | None = None  # (first step, ends, ctx, event)
        self._span_stats = False  # the span's first step's end has not been taken into `stats` yet
        self._aborts: list[ReqState] = []  # running requests aborted, leaving at the next step end or start
        self._arrivals: list[ReqState] = []  # waiting, submitted since the current step was scheduled
        self._ahead = StepAhead() if cfg.async_scheduling else None
        self._in_step = False  # a step (or a span) is scheduled and its end has not come
        self._states: dict[int, ReqState] = {}  # id(record) -> its state, until it finishes or leaves
        self._busy = False
        self.steps = 0
        self._loras = False  # set once a request names a LoRA adapter
        self.stats = StepStats(cfg.block_size, cfg.num_gpu_blocks, frozenset({cfg.model}))

    @property
    def prefix_cache_queries(self) -> int:
        return self._sched.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self._sched.prefix_cache_hits

    @property
    def preemptions(self) -> int:
        return self._sched.preemptions

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
        if self._ahead is not None and self._in_step:  # the step after this one is scheduled already
            span = self._span
            flight = self._step if span is None else span[0] + bisect_left(span[1], self.kernel.now())
            self._ahead.hold(flight, state)
            if span is not None:
                self._cut_span(1)
            return rec
        self.waiting.append(state)
        self._arrivals.append(state)
        if self._span is not None:
            self._cut_span()
        if not self._busy:
            self._busy = True
            self.kernel.schedule(0.0, self._start_step)
        elif self._loads.wait is not None:
            self._loads.wake_up()
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
        if self._ahead is not None and self._ahead.drop(r):
            r.phase = DONE
            return True
        if r.phase == WAITING:
            self.waiting.remove(r)
            if r in self._arrivals:
                self._arrivals.remove(r)
            r.phase = DONE
            return True
        self._aborts.append(r)  # (a request loading its CPU-tier hit leaves as a running one does)
        if self._span is not None:
            self._cut_span()
        elif self._loads.wait is not None:
            self._loads.wake_up()
        return True

    def _leave(self, s: int) -> None:
        """The aborted running requests leave: at the end of step s, before its outputs (what it computed
        for them is dropped), or before step s is scheduled when they were aborted between steps."""
        prefill = False
        for v in self._aborts:
            if self._ahead is not None:
                self._ahead.freeing(v)
            if v.phase == LOADING or v.phase == LOADED:
                self._loads.leave(v)
            else:
                prefill = prefill or v.phase == PREFILL
                self._sched.unschedule(v, s)
            v.phase = DONE
            v.rec.output_tokens = v.outputs
        self._aborts = []
        if prefill and self._chunks:
            self._chunks = [c for c in self._chunks if c[0].phase == PREFILL]

    # -- one step ------------------------------------------------------------------------------
    def _start_step(self) -> None:
        s = self._step
        self._arrivals.clear()  # (the engine core took them in: the scheduler sees them now)
        ahead = self._ahead
        pipelined = False
        if ahead is not None:
            pipelined, ahead.pipelined = ahead.pipelined, False
        holding = self._loads.holding
        if holding:
            self._loads.ended()
        if self._aborts:
            self._leave(s)
        if ahead is not None and ahead.held:  # (after the aborted ones left: they no longer run)
            self.waiting.extend(ahead.release(s, bool(self.running or self.waiting)))
        sched = self._sched
        sched.preempted = False
        dec = self._decodes
        dec.start(s, self._grow)
        if sched.prefilling or self.waiting or holding:
            if pipelined and self.running and ahead is not None:  # (nothing runs: its step ahead was empty)
                sched.held_back = ahead.held_back()
            chunks, starts, tokens, pairs = sched.schedule(s, self.kernel.now())
            sched.held_back = NOTHING_HELD
            if not chunks and not dec.n:
                self._empty_step()
                return
            self._chunks = chunks
            dt = self.latency.step_seconds(starts, tokens, pairs, dec.n, dec.ctx)
            if pipelined:
                self._scheduled()
        elif dec.n:
            self._chunks = []
            if pipelined:
                self._scheduled()
            bounds = dec.bounds
            if (
                bounds
                and self._spans
                and bounds[0] > s
                and (self.sink is None or not self.sink.events)
                and not (ahead is not None and ahead.held)
            ):
                self._start_span(s, bounds[0])
                return
            dt = self.latency.step_seconds(0, 0, 0.0, dec.n, dec.ctx)
        else:
            self._busy = False
            self._take_stats()  # (vLLM steps once more to send out what left: an empty step's stats)
            return
        self.steps += 1
        self._in_step = True
        self.kernel.schedule(dt, self._end_step)

    def _scheduled(self) -> None:
        """Async scheduling: vLLM scheduled this step while the one before ran, and sent the step's KV
        events and stats at the end of that one (`update_from_output`): now, in the simulator's time. (A
        step started from idle was scheduled as it started: its events and stats come at its end.)"""
        sink = self.sink
        if sink is not None and sink.dirty:
            sink.flush(self.kernel.now())
        self._take_stats()

    def _empty_step(self) -> None:
        """Nothing to run (vLLM still makes its stats)."""
        if self.sink is not None and self.sink.events:  # (a load's allocation evicted blocks)
            self.sink.flush(self.kernel.now())
        self._take_stats()
        holding = self._loads.holding
        if self.waiting and (self._sched.preempted or not holding):
            self.kernel.schedule(0.0, self._start_step)  # everything running was preempted: admit afresh
        elif holding:
            self._loads.await_first()
        elif self._ahead is not None and self._ahead.held:  # (a backstop: released when nothing runs)
            self.waiting.extend(self._ahead.release_all())
            self.kernel.schedule(0.0, self._start_step)
        else:
            self._busy = False

    def _start_span(self, s: int, last: int) -> None:
        """Steps s..last, decode only, as one kernel event (see the module docstring)."""
        dec = self._decodes
        n = dec.n
        ends = self.latency.decode_step_ends(self.kernel.now(), last - s + 1, n, dec.ctx)
        self.steps += last - s + 1
        self._span = (s, ends, dec.ctx, self.kernel.at(ends[-1], self._end_step))
        self._span_stats = last > s  # (the last step's end is a kernel event: `_end_step` takes its stats)
        self._in_step = True
        self._step = last
        dec.ctx += n * (last - s)  # at the start of the last step (its end adds n)

    def _cut_span(self, later: int = 0) -> None:
        """Something changed mid-span: end the span with the step in progress now (the first one not
        ended before now; one ending exactly now has not run its end yet, as in the kernel's order), or
        `later` steps after it (async scheduling: the next step is scheduled already)."""
        assert self._span is not None
        s, ends, ctx0, handle = self._span
        i = bisect_left(ends, self.kernel.now()) + later
        left = len(ends) - 1 - i
        if left <= 0:
            return
        self.kernel.cancel(handle)
        self.steps -= left
        self._step = s + i
        self._decodes.ctx = ctx0 + self._decodes.n * i
        self._span = (s, ends[: i + 1], ctx0, self.kernel.at(ends[i], self._end_step))

    def steps_ended(self) -> int:
        """Steps whose end has happened by now (one is in progress while the engine is busy)."""
        if self._span is not None:
            ends = self._span[1]
            return self.steps - len(ends) + min(bisect_right(ends, self.kernel.now()), len(ends) - 1)
        return self.steps - (1 if self._busy and self._loads.wait is None else 0)

    def _end_step(self) -> None:
        self._span = None
        self._span_stats = False
        self._in_step = False
        s = self._step
        free0, running0 = self.pool.num_free, len(self.running)
        ahead = self._ahead
        if ahead is not None:
            ahead.step_ends()
        if self._aborts:
            self._leave(s)
        self._step = s + 1
        now = self.kernel.now()
        done: list[tuple[RequestCallback | None, RequestRecord]] | None = None
        ended = self._decodes.end(s)
        if ended is not None:
            done = []
            for r in ended:
                self._finish(r, now)
                done.append((self.on_finish, r.rec))
        if self._chunks:
            if done is None:
                done = []
            self._end_prefills(s, now, done)
        if ahead is not None:
            ahead.freed(self.pool.num_free - free0, running0 - len(self.running))
        sink = self.sink
        if sink is not None and sink.dirty:
            sink.flush(now)
        self._take_stats()
        if done:
            for callback, rec in done:
                if callback is not None:
                    callback(rec, now)
        if not (self.waiting or self.running or self._loads.holding or (ahead is not None and ahead.held)):
            self._busy = False
            return
        if ahead is not None:
            ahead.pipelined = True
        if self.kernel.peek() > now:
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
            self._decodes.begin(r, s + 1)
        self._chunks = []
        if prefilled:
            self._sched.prefilled()

    def _finish(self, r: ReqState, now: float) -> None:
        r.phase = DONE
        self._states.pop(id(r.rec), None)
        del self.running[r.order]
        if self._ahead is not None:
            self._ahead.freeing(r)
        self.kv.free(r)
        rec = r.rec
        rec.finished_s = now
        rec.output_tokens = r.outputs

    def _take_stats(self) -> None:
        """vLLM's `make_stats` at the end of a step: what `metrics()` shows until the next one."""
        waiting = self.waiting
        holding = self._loads.holding  # (loading: vLLM counts WAITING_FOR_REMOTE_KVS as waiting)
        sched = self._sched
        if not self._loras:  # `StepStats.take` without the adapters (a stats per step: inlined)
            stats = self.stats
            stats.waiting = len(holding) + len(waiting) - len(self._arrivals)
            stats.running = len(self.running)
            stats.used = self.pool.num_blocks - 1 - self.pool.num_free
            stats.queries = sched.prefix_cache_queries
            stats.hits = sched.prefix_cache_hits
            return
        self.stats.take(
            chain(holding, waiting) if holding else waiting,
            len(holding) + len(waiting) - len(self._arrivals),
            self.running.values(),
            len(self.running),
            self.pool.num_used,
            sched.prefix_cache_queries,
            sched.prefix_cache_hits,
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
