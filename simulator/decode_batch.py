"""An engine's decoding requests, booked per event, not per token. Pure.

Every running request past its prefill decodes one token in every step (`engine.py`, step 1). A decoding
request keeps where its decode started (step `s0`, computed tokens `c0`, outputs `o0`) and the step of
its last token (`s_fin`), so where it is in any step is arithmetic. It is looked at only in the steps
where it starts or fills a block (`start`: it takes one more block when its next token starts one, as
vLLM's `allocate_slots` does, preempting if none is free; the block its token fills is hashed and
cached) and at its last step (`end`), so a step costs Python work for the requests that change state in
it, not for the whole batch. A pending wake is void once its request stopped decoding (`stop`, at a
preemption or an abort, moves its `epoch` on).

`n` and `ctx` (their KV tokens at the start of the current step) are what the step's time needs;
`bounds` holds, per pending wake, the last step a decode-only span may reach (`engine.py`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from simulator.kvcache import DECODE, KvCacheManager, ReqState

Wake = list[tuple[ReqState, int]]
Grow = Callable[[ReqState, int, int], bool]
"""`Scheduler.grow(r, upto, s)`: blocks for r's first `upto` tokens, preempting; False when r was."""


class DecodeBatch:
    __slots__ = ("_ends", "_kv", "_starts", "block_size", "bounds", "ctx", "n")

    def __init__(self, kv: KvCacheManager) -> None:
        self._kv = kv
        self.block_size = kv.block_size
        self._starts: dict[int, Wake] = {}  # step -> decoding requests that start / fill a block
        self._ends: dict[int, Wake] = {}  # step -> decoding requests that finish at its end
        self.bounds: list[int] = []  # heap: the last step a span may reach, per pending wake (lazy)
        self.n = 0  # decoding requests
        self.ctx = 0  # their KV tokens, at the start of the current step

    def begin(self, r: ReqState, s: int) -> None:
        """r's prefill is complete and it has its first outputs: it decodes from step s."""
        r.phase = DECODE
        r.s0 = s
        r.c0 = r.computed
        r.o0 = r.outputs
        r.s_fin = s + r.max_tokens - r.outputs - 1
        self.n += 1
        self.ctx += r.computed
        self._ends.setdefault(r.s_fin, []).append((r, r.epoch))
        heapq.heappush(self.bounds, r.s_fin)
        self.wake(r, s)

    def start(self, s: int, grow: Grow) -> None:
        """Step s starts: the decoding requests whose token starts a block in it take one (`grow`, which may
        preempt), those whose token fills one cache it; the bounds of past steps are dropped."""
        starts = self._starts
        bounds = self.bounds
        push = heapq.heappush
        wakes = starts.pop(s, None)
        if wakes:
            bs = self.block_size
            last = bs - 1
            cache_full = self._kv.cache_full
            for r, epoch in wakes:
                if r.epoch != epoch or r.phase != DECODE:
                    continue
                c = r.c0 + s - r.s0  # the position r computes in step s
                m = c % bs
                if m == 0 and not grow(r, c + 1, s):
                    continue
                if m == last:
                    cache_full(r, c + 1)
                # `wake(r, s + 1)`, inlined (this loop is a good part of an engine's time)
                m = (m + 1) % bs
                w = s + 1 + last - m if m and m != last else s + 1
                if w <= r.s_fin:
                    wake = starts.get(w)
                    if wake is None:
                        starts[w] = [(r, r.epoch)]
                    else:
                        wake.append((r, r.epoch))
                    push(bounds, w - 1)
        while bounds and bounds[0] < s:
            heapq.heappop(bounds)

    def wake(self, r: ReqState, s: int) -> None:
        """Look at decoding r again in the first step from `s` where it starts or fills a block."""
        bs = self.block_size
        m = (r.c0 + s - r.s0) % bs
        if m and m != bs - 1:
            s += bs - 1 - m
        if s <= r.s_fin:
            self._starts.setdefault(s, []).append((r, r.epoch))
            heapq.heappush(self.bounds, s - 1)

    def end(self, s: int) -> list[ReqState] | None:
        """Step s ended (every decoding request computed one more token): the requests whose last token it
        computed, done decoding (None: none was due)."""
        self.ctx += self.n
        ends = self._ends.pop(s, None)
        if not ends:
            return None
        done = []
        for r, epoch in ends:
            if r.epoch == epoch and r.phase == DECODE:
                r.computed = r.c0 + s - r.s0 + 1
                r.outputs = r.max_tokens
                self.n -= 1
                self.ctx -= r.computed
                done.append(r)
        return done

    def stop(self, v: ReqState, s: int) -> None:
        """Decoding v stops before step s (preempted or aborted): its progress is settled, its wakes void."""
        done = s - v.s0
        v.computed = v.c0 + done
        v.outputs = v.o0 + done
        self.n -= 1
        self.ctx -= v.computed
        v.epoch += 1
