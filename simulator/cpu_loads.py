"""An engine's CPU-tier loads, as vLLM's offloading connector runs them (`load_kv_async`: the scheduler's
WAITING_FOR_REMOTE_KVS). Pure.

A waiting request whose GPU hit the CPU tier continues is not scheduled when it is admitted
(`scheduler.py`): its hit blocks and the blocks to load into are taken (the latter uncached), its
lookup is counted, and it waits (`holding`, vLLM's `kv_holding_waiting`: a waiting request in the
stats, never preempted) while the requests behind it are admitted; its load takes
`latency.reload_seconds` from that step's start and no step's time. A load starts only if its blocks
fit beside what the in-flight prefills and loads still need for their whole sequences (vLLM's
`reserved_blocks`: `reserved_blocks`). The load is reported finished at the first step start
at or after its end (`ended`; vLLM's worker reports it at the end of the step in progress; an engine
with nothing else to run steps idly until then, here it waits for the load's end: `await_first`). From
then the request is scheduled before the waiting ones, in the order the loads started (`schedule`): its
loaded blocks are cached (one `BlockStored`) and, if the rest of its sequence fits, its first chunk runs
with hit + load counted as computed (`Scheduler._update_waiting_for_remote_kv`); if not, nothing behind
it is admitted in that step. A loading request that is aborted leaves as a running one does, at the
next step boundary (`leave`).
"""

from __future__ import annotations

from collections.abc import Callable

from simulator.kernel import Handle, Kernel
from simulator.kvcache import LOADED, LOADING, KvCacheManager, ReqState
from simulator.latency import LatencyProfile

Chunks = list[tuple[ReqState, int]]


class LoadQueue:
    """The requests loading their CPU-tier hit, or loaded and not yet scheduled (`holding`, in the order
    their loads started), and the engine's wait for the first load to end (`wait`) when it has nothing
    else to run. `step` starts the engine's next step."""

    __slots__ = ("_kernel", "_kv", "_latency", "_step", "holding", "wait")

    def __init__(
        self, kernel: Kernel, kv: KvCacheManager, latency: LatencyProfile, step: Callable[[], None]
    ) -> None:
        self._kernel = kernel
        self._kv = kv
        self._latency = latency
        self._step = step
        self.holding: list[ReqState] = []  # vLLM's kv_holding_waiting, in the order the loads started
        self.wait: Handle | None = None  # no step runs: the engine waits for the first load to end

    def start(self, r: ReqState, tokens: int, now: float) -> None:
        """Admitted r waits for the load of `tokens` tokens (its blocks taken), started at `now`."""
        r.phase = LOADING
        r.ready_s = now + self._latency.reload_seconds(tokens)
        self.holding.append(r)

    def reserved_blocks(self, prefilling: list[ReqState]) -> int:
        """vLLM's `_inflight_prefill_reserved_blocks`: the blocks that the running requests still in their
        prefill and the loading ones still need for their whole sequences (a load must leave them free)."""
        remaining = self._kv.remaining
        return sum(remaining(r) for r in prefilling) + sum(remaining(r) for r in self.holding)

    def ended(self) -> None:
        """At a step's start: the loads that have ended are reported finished (vLLM's worker reports them at
        the end of the step in progress, `finished_recving`; an engine with nothing else to run steps idly
        until then), so those requests can be scheduled."""
        now = self._kernel.now()
        for r in self.holding:
            if r.phase == LOADING and r.ready_s <= now:
                r.phase = LOADED

    def schedule(
        self,
        chunks: Chunks,
        budget: int,
        seats: int,
        run: Callable[[ReqState, float], None],
        now: float,
        held_back: int = 0,
    ) -> tuple[int, bool]:
        """The loaded requests are scheduled first (vLLM schedules the waiting requests that hold blocks
        first), in order, while `budget` tokens last and `seats` requests may still run: `run`, their first
        chunk appended to `chunks` and its blocks taken. (The budget left, whether the waiting requests may
        be admitted after them.)"""
        kv = self._kv
        pool = kv.pool
        for r in tuple(self.holding):
            if budget <= 0 or seats <= 0:
                return budget, False
            if r.phase == LOADING:
                continue  # skipped for this step
            kv.cache_full(r, r.computed)  # its loaded blocks are cached (one BlockStored)
            if r.computed >= r.target:  # the load covered the whole prompt: vLLM computes its last token
                r.computed = r.target - 1
            if kv.remaining(r) + held_back > pool.num_free:  # the whole-sequence gate (async: `admit`)
                return budget, False
            self.holding.remove(r)
            run(r, now)
            seats -= 1
            chunk = r.target - r.computed if r.target - r.computed < budget else budget
            kv.grow(r, r.computed + chunk)  # (it fits: the gate)
            chunks.append((r, chunk))
            budget -= chunk
            kv.cache_full(r, r.computed + chunk)
        return budget, True

    def leave(self, r: ReqState) -> None:
        """Loading or loaded r was aborted: it leaves, its blocks freed (last first)."""
        self.holding.remove(r)
        self._kv.free(r)

    def await_first(self) -> None:
        """Nothing to run but loads: the next step starts when the first one ends (or a request arrives or
        leaves: `wake_up`)."""
        ends = [r.ready_s for r in self.holding if r.phase == LOADING]
        if not ends:  # (the gate that starts a load keeps the blocks of the loads before it free)
            raise AssertionError("requests holding loaded blocks cannot be scheduled on an idle engine")
        self.wait = self._kernel.at(max(min(ends), self._kernel.now()), self._waited)

    def _waited(self) -> None:
        self.wait = None
        self._step()

    def wake_up(self) -> None:
        """A request arrived or left while the engine waits for a load: it steps now."""
        assert self.wait is not None
        self._kernel.cancel(self.wait)
        self.wait = None
        self._kernel.schedule(0.0, self._step)
