"""What a simulated engine's `/metrics` shows: its scheduler's stats as of the end of its last step. Pure.

vLLM builds the stats behind `/metrics` once per step, at the end of `Scheduler.update_from_output`
(`make_stats`): after the step's finished requests (and the requests aborted during the step) were
freed, before the engine core takes in the requests that arrived meanwhile (they join the waiting
queue between steps) and before the next step is scheduled. A scrape returns the last stats made:

- `num_requests_waiting` / `num_requests_running` / `kv_cache_usage_perc`: the queues and the
  blocks in use at the end of the last step. A request that arrived during the step in progress is
  not waiting yet, and one that arrives during a step and is admitted at the next one is never seen
  waiting; the blocks the step in progress took are not in use yet. A request loading its CPU-tier
  hit is waiting (vLLM's gauge adds its WAITING_FOR_REMOTE_KVS requests, `num_skipped_waiting_reqs`,
  to the others) and its blocks are in use;
- `prefix_cache_queries` / `prefix_cache_hits`: vLLM records a request's lookup when the scheduler
  admits it and publishes the step's totals with the same stats, so they move at the end of the step
  that admitted it;
- the LoRA adapters of the running and waiting requests: vLLM's front end rebuilds them from the
  queued / scheduled / preempted / finished events that come with each step's outputs, so they too
  are those of the end of the last step.

An idle engine's scrape returns the end of its last step; before its first step, zeros.
The engine calls `StepStats.take` at the end of every step (in a span of decode-only steps only the
first step's start changes any of this, taking the blocks its decodes reach, so the engine takes the
stats once that step has ended and again at the span's end); `snapshot` builds what the EPP's scraper
would read.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from typing import TYPE_CHECKING

from epp.types import MetricsSnapshot, metrics_snapshot

if TYPE_CHECKING:
    from simulator.kvcache import ReqState

_NONE: frozenset[str] = frozenset()


class StepStats:
    __slots__ = (
        "block_size",
        "hits",
        "models",
        "num_gpu_blocks",
        "queries",
        "running",
        "running_loras",
        "used",
        "waiting",
        "waiting_loras",
    )

    def __init__(self, block_size: int, num_gpu_blocks: int, models: frozenset[str]) -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.models = models
        self.waiting = self.running = self.used = self.queries = self.hits = 0
        self.running_loras = self.waiting_loras = _NONE

    def take(
        self,
        waiting: Iterable[ReqState],
        n_waiting: int,
        running: Iterable[ReqState],
        n_running: int,
        used: int,
        queries: int,
        hits: int,
        loras: bool,
    ) -> None:
        """The state at the end of a step: the first `n_waiting` of `waiting` (those in the scheduler's
        queue; arrivals since the step was scheduled come after them), the running requests, the blocks
        in use and the prefix-cache counters. `loras`: walk the queues for adapters (only engines that
        ever served one)."""
        self.waiting = n_waiting
        self.running = n_running
        self.used = used
        self.queries = queries
        self.hits = hits
        if loras:
            self.running_loras = frozenset(r.lora for r in running if r.lora)
            self.waiting_loras = frozenset(r.lora for r in islice(waiting, n_waiting) if r.lora)

    def snapshot(self, observed_at: float) -> MetricsSnapshot:
        """What the EPP's scraper builds from the engine's `/metrics` page."""
        usable = self.num_gpu_blocks - 1
        return metrics_snapshot(  # (a scrape per engine every 50 ms in the cluster)
            observed_at,  # observed_at
            self.waiting,  # waiting
            self.running,  # running
            self.used / usable,  # kv_usage
            self.block_size,  # block_size
            self.num_gpu_blocks,  # num_gpu_blocks
            float(self.queries),  # prefix_cache_queries
            float(self.hits),  # prefix_cache_hits
            self.models,  # models
            self.running_loras,  # running_lora_adapters
            self.waiting_loras,  # waiting_lora_adapters
        )
